"""`StepContext`: what the blocks of one wrapped model share, and the one module that changes it.

The root state (state.py), the blocks (blocks.py, fetch_group.py, flat_param.py) and the
tiered optimizer (tierzero.optim) all read the context; every field is written only by its
methods, so the life of a step can be read in one place (beside `StepContext`).

The context sits below the flat tensors and blocks that share it: it knows them by the small
Protocols `FlatRef` and `HeldBlock`, never by their classes.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from enum import Enum
from types import MappingProxyType
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Protocol

import torch
import torch.distributed as dist

from tierzero.config import Tier
from tierzero.layout import BlockTiers, CommBytes, FlatLayout, ZeroStage
from tierzero.placement import CheckpointHome, Kind, PlacementManager, TensorHandle
from tierzero.prefetch import Prefetcher
from tierzero.runtime.activation_pack import HeldCopies
from tierzero.runtime.schedule import PLAIN, Schedule
from tierzero.runtime.step_queue import StepQueue


class FlatRef(Protocol):
    """What the shared step state, and the gathers below the flat tensors, use of a flat tensor
    (tierzero.runtime.flat_param.FlatParam, a level above)."""

    name: str
    layout: FlatLayout

    @property
    def param(self) -> TensorHandle: ...

    @property
    def nbytes(self) -> int: ...


class HeldBlock(Protocol):
    """What the shared step state uses of a block (tierzero.runtime.blocks.Block, above)."""

    name: str

    @property
    def nbytes(self) -> int: ...


class PendingGather(NamedTuple):
    """One flat tensor fetched or on its way to the device. `full` is every rank's shard
    gathered once `work` is done (None: nothing in flight); `scratch` is the device buffer
    `full` lives in (None at world size 1, where `full` is the pinned device copy of the shard),
    which holds the shard's device copy pinned until `work` is done."""

    full: torch.Tensor
    work: dist.Work | None
    scratch: torch.Tensor | None


class Phase(Enum):
    """Where a wrapped model is in its step: blocks forwarded during BACKWARD are recomputed."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass
class GatherCounts:
    """Flat-tensor fetches at world size > 1 whose all-gather the prefetcher started ahead, and
    those that had to start it themselves."""

    ahead: int = 0
    on_demand: int = 0


# The life of a step, by the methods that write the context:
#
#     begin_iteration   the root's forward starts: phase FORWARD (IDLE without grad), the calling
#                       thread its owner (`check_thread` refuses another's until the step ends);
#                       all-gathers started ahead for the previous iteration are dropped by the caller
#     hold / release    a block is fetched / released (the held set, and device room beside it;
#                       a forward's first fetches give `forward_order` when its backward ends)
#     add_activation_bytes  placed activations kept on the device (less device room)
#     put / take gather an all-gather started ahead waits here for its block's fetch
#     begin_backward    the first pre-backward hook: phase BACKWARD, the final callback queued once
#                       (after the last step's overlapped updates, which it waits for)
#     end_iteration     the final callback of a backward (or the end of an inference forward)
#
# A backward that raises never runs its final callback: the phase stays BACKWARD after it.
# `backward_died()` tells the next root forward so, which then ends that iteration first.
@dataclass(eq=False)
class StepContext:
    """State shared by every block of one wrapped model (see the comment above)."""

    pm: PlacementManager
    compute_dtype: torch.dtype
    tiers: BlockTiers
    """The tier of each block's parameters, gradient and optimizer states (Config's split
    resolved at wrap: [Note: split placement] in tierzero/layout/split.py)."""
    rank: int = 0
    world_size: int = 1
    group: dist.ProcessGroup | None = None
    """The process group of the data-parallel ranks (None: the default group)."""
    zero_stage: int = 3
    """Config.zero_stage: what each rank keeps whole rather than as its shard (`zero`)."""
    grad_dtype: torch.dtype = torch.float32
    """The dtype gradients are reduced in and kept in (Config.grad_dtype)."""
    comm: CommBytes = field(default_factory=CommBytes, init=False)
    """Bytes of the collectives issued for this model since the last `take()` (runtime.step_comm_bytes)."""
    phase: Phase = field(default=Phase.IDLE, init=False)
    prefetcher: Prefetcher | None = field(default=None, init=False)
    gather_counts: GatherCounts = field(default_factory=GatherCounts, init=False)
    agree_group: Any = field(default=None, init=False)
    """The gloo group the ranks agree their all-gathers ahead in (stage 3, world size > 1: [Note:
    gathers ahead agreed across ranks] in collectives.py); None: no agreement needed."""
    captures: int = field(default=0, init=False)
    """Flat gradients whose shares early capture summed on the device (grads.py), since wrap."""
    _largest_block: int = field(default=0, init=False)
    """Device bytes of the largest block: room early capture leaves for the next fetch."""
    _capture_bytes: int = field(default=0, init=False)
    """Device bytes early capture holds now (not available for fetched copies)."""
    _held: dict[str, HeldBlock] = field(default_factory=dict, init=False)
    _gathers: dict[FlatRef, PendingGather] = field(default_factory=dict, init=False)
    """All-gathers started ahead of their block's fetch (world size > 1), in issue order; they
    are always among the blocks the prefetcher chose last, so they fit the device room."""
    _device_home_bytes: int = field(default=0, init=False)
    """Bytes of tensors homed on the device tier (not available for fetched copies)."""
    _activation_bytes: int = field(default=0, init=False)
    """Device bytes of placed activations kept for backward: packs homed on the device, and
    device copies acquired for a block's backward (tierzero/runtime/activations.py)."""
    _activation_home_bytes: int = field(default=0, init=False)
    """Of `_activation_bytes`, the packs homed on the device (the rest: acquired copies)."""
    _end_backward: Callable[[], None] | None = field(default=None, init=False)
    _callback_queued: bool = field(default=False, init=False)
    _grads_final: Callable[[FlatRef], None] | None = field(default=None, init=False)
    _iteration_end: Callable[[], None] | None = field(default=None, init=False)
    forward_order: tuple[str, ...] = field(default=(), init=False)
    """Blocks in the order the last forward with grad that ended first fetched them (the
    overlapped step updates in this order, so the next forward's first block is ready first)."""
    _forward_seen: dict[str, None] = field(default_factory=dict, init=False)
    updates: StepQueue | None = field(default=None, init=False)
    """The overlapped step's queue of block updates (see [Note: overlapped step] in
    step_queue.py), once a tiered optimizer runs its step under the next forward."""
    owner: threading.Thread | None = field(default=None, init=False)
    """The thread whose step is under way (from the root's forward to the end of its backward)."""
    schedule: Schedule = field(default=PLAIN, init=False)
    """The schedule the blocks' hooks consult: PLAIN, or tz.accumulate's layer-major step from its
    forward to the end of its backward (schedule.py)."""
    unfrozen: bool = field(default=False, init=False)
    """A parameter of a frozen flat tensor was set to require a gradient since the last
    wrapping.refresh: the next forward takes it in first."""
    clip_norm_type: float | None = field(default=None, init=False)
    """The norm tz.clip_grad_norm_ last computed: each FlatGrad computes it as its gradient is
    written in backward, so clipping needs no second read of the gradients."""

    copies: HeldCopies = field(init=False)
    """The held flat tensors' device copies, by storage pointer (the saved-tensor hooks tell views
    of parameters by them: activation_pack.py)."""

    def __post_init__(self) -> None:
        self.copies = HeldCopies(self.pm.device)

    def __repr__(self) -> str:
        return (f"StepContext(rank={self.rank}/{self.world_size}, phase={self.phase.value}, "
                f"held={list(self._held)}, gathers={len(self._gathers)})")

    @property
    def device(self) -> torch.device:
        return self.pm.device

    @functools.cached_property
    def zero(self) -> ZeroStage:  # built once: a fetch reads it several times
        return ZeroStage(self.zero_stage, self.world_size)

    # ----------------------------------------------------------------------------- setup

    def param_tier(self, block: str) -> Tier:
        """The home tier of `block`'s trainable parameters."""
        return Tier(self.tiers.params[block])

    def grad_tier(self, block: str) -> Tier:
        """The tier of `block`'s gradient."""
        return Tier(self.tiers.grads[block])

    def master_tier(self, block: str) -> Tier:
        """The tier of `block`'s master weights and optimizer moments: where its update runs
        (on the device for "device", on the CPU for "host" and "nvme")."""
        return Tier(self.tiers.optimizer_states[block])

    def register(self, owner: str, data: torch.Tensor, home: Tier, *, kind: Kind,
                 dtype: torch.dtype | None = None, lazy: bool = False,
                 borrowed: CheckpointHome | None = None) -> TensorHandle:
        """Register a tensor in the placement manager (the one place the runtime does)."""
        handle = self.pm.register(owner, data, home, kind=kind, dtype=dtype, lazy=lazy, borrowed=borrowed)
        if home is Tier.DEVICE:
            self._device_home_bytes += handle.nbytes
        return handle

    def unregister(self, handle: TensorHandle) -> None:
        """Give a tensor registered with `register` back to the placement manager."""
        self.pm.unregister(handle)
        if handle.home is Tier.DEVICE:
            self._device_home_bytes -= handle.nbytes

    def attach(self, prefetcher: Prefetcher, end_backward: Callable[[], None], largest_block: int) -> None:
        """The root state's prefetcher and final callback of a backward pass, and the device
        bytes of its largest block (at wrap, and again when the root state is rebuilt:
        wrapping.refresh)."""
        self.prefetcher = prefetcher
        self._end_backward = end_backward
        self._largest_block = largest_block

    def on_grads_final(self, callback: Callable[[FlatRef], None] | None) -> None:
        """Call `callback` once per backward with each trainable flat tensor whose gradient is
        final (a tiered optimizer under Config.step_in_backward)."""
        self._grads_final = callback

    def clips_with(self, norm_type: float) -> None:
        """tz.clip_grad_norm_ was called with `norm_type`: backward computes it from now on."""
        self.clip_norm_type = norm_type

    def on_iteration_end(self, callback: Callable[[], None] | None) -> None:
        """Call `callback` last at the end of every backward (or inference forward): a tiered
        optimizer under Config.step_in_backward waits there for the updates it runs meanwhile,
        so backward() returns with every block updated (and raises an update's error)."""
        self._iteration_end = callback

    def overlap_step(self, queue: StepQueue) -> None:
        """A tiered optimizer queues its block updates on `queue` (the newest optimizer's;
        it closed the last one's first)."""
        self.updates = queue

    def wait_updates(self, flats: list[FlatRef]) -> None:
        """Return once the overlapped step has updated `flats` (before they are fetched)."""
        if self.updates is not None:
            self.updates.wait([f.param for f in flats])

    def drain_updates(self, *, forget_failure: bool = False) -> None:
        """Return once the overlapped step has updated every block (before reads that span
        the blocks: backward, clipping, the next step, state dicts, checkpoints); raise a
        failed update's error unless `forget_failure` (a checkpoint load replaces it all)."""
        if self.updates is not None:
            self.updates.drain(forget_failure=forget_failure)

    def update_done(self) -> None:
        """An update of the overlapped step ended (on its thread): the prefetcher plans again,
        so a block of its plan that was still being updated at the last fetch is brought now,
        while the block before it computes, not on demand at its own fetch (built-in 350m,
        activation checkpointing: 5-15 ms of copy waits at each of the first eight blocks).
        Not where blocks are all-gathered across ranks: collectives run on the training loop's
        thread only."""
        if self.prefetcher is not None and not self.zero.gathers:
            self.prefetcher.reissue()

    def updating(self, handles: tuple[TensorHandle, ...]) -> bool:
        """Whether an update of the overlapped step still writes these parameter handles."""
        return self.updates is not None and self.updates.busy(handles)

    @property
    def wants_grads_final(self) -> bool:
        return self._grads_final is not None

    def grads_final(self, flat: FlatRef) -> None:
        assert self._grads_final is not None
        self._grads_final(flat)

    # --------------------------------------------------------------------- step lifecycle

    def begin_iteration(self, *, grad: bool) -> None:
        self.phase = Phase.FORWARD if grad else Phase.IDLE
        self._forward_seen = {}
        self.owner = threading.current_thread()

    def check_thread(self, model_name: str) -> None:
        """RuntimeError when a step another thread started is not over (its forward, or a
        backward still to come): the model is left as it is, for that thread to finish. A
        forward run inside a backward (a recompute, on autograd's thread) is part of that step."""
        owner = self.owner
        if owner is None or owner is threading.current_thread() or torch._C._current_graph_task_id() != -1:
            return
        raise RuntimeError(
            f"tierzero: this {model_name} is in the middle of a step that thread {owner.name!r} started (its forward, "
            f"or the backward that must follow it); a wrapped model runs one step at a time, so this call from "
            f"thread {threading.current_thread().name!r} was refused and the model left as it was. Use the model from "
            "one thread, or hold a lock around each step (forward, backward, optimizer step)")

    def begin_backward(self) -> None:
        """First pre-backward hook of a backward pass: queue the final callback once."""
        if self.phase is not Phase.BACKWARD:
            self.drain_updates()  # a block no forward fetched may still be updating
        self.phase = Phase.BACKWARD
        if not self._callback_queued and self._end_backward is not None:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def backward_died(self) -> bool:
        """The phase is BACKWARD but no backward is running on this thread: the last one raised
        before its final callback. (A forward inside a running backward is a recompute.)"""
        return self.phase is Phase.BACKWARD and torch._C._current_graph_task_id() == -1

    def end_iteration(self, *, died: bool = False) -> None:
        """The backward (or an inference forward) is over; `died`: it raised, so the prefetcher
        learns nothing from it (its fetches stopped short of a trace)."""
        self._callback_queued = False
        self.owner = None
        if self._forward_seen and not died:
            self.forward_order = tuple(self._forward_seen)
        self._forward_seen = {}
        self.phase = Phase.IDLE
        if self.prefetcher is not None:
            self.prefetcher.end(learn=not died)
        if self._iteration_end is not None:
            self._iteration_end()

    # ------------------------------------------------------------------------ held blocks

    @property
    def held(self) -> Mapping[str, HeldBlock]:
        """Blocks fetched now, by name."""
        return MappingProxyType(self._held)

    def hold(self, block: HeldBlock) -> None:
        self._held[block.name] = block
        if self.phase is Phase.FORWARD:
            self._forward_seen.setdefault(block.name)

    def release(self, block: HeldBlock) -> None:
        del self._held[block.name]

    def device_room(self) -> int:
        """Bytes of the device budget not taken by device-homed tensors, held blocks, the placed
        activations kept on the device and early capture's buffers."""
        held = sum(b.nbytes for b in self._held.values())
        return (self.pm.budget(Tier.DEVICE) - self._device_home_bytes - held - self._activation_bytes
                - self._capture_bytes)

    @property
    def device_home_bytes(self) -> int:
        """Bytes of the tensors registered with a device home (not activations)."""
        return self._device_home_bytes

    def add_activation_bytes(self, nbytes: int, *, home: bool = False) -> None:
        """Placed activations took (or, negative, gave back) device bytes; `home`: packs homed
        on the device, else device copies of packs homed elsewhere, acquired for backward."""
        self._activation_bytes += nbytes
        if home:
            self._activation_home_bytes += nbytes

    def device_beside(self) -> int:
        """Device bytes neither held blocks nor packs acquired for backward take out of the room
        `device_room` leaves beside the homes: early capture's buffers and packs homed on the
        device. They come and go over an iteration; the tier model replays the room they left
        at each fetch (tierzero/planning/tier_model.py)."""
        return self._capture_bytes + self._activation_home_bytes

    def capture_room(self, nbytes: int) -> bool:
        """Take `nbytes` of device room for early capture if the largest block still fits beside
        them (a fetch must never lack room for capture's sake); give them back with
        `capture_done`."""
        if self.device_room() - nbytes < self._largest_block:
            return False
        self._capture_bytes += nbytes
        self.captures += 1
        return True

    def capture_done(self, nbytes: int) -> None:
        self._capture_bytes -= nbytes

    # --------------------------------------------------------------- all-gathers started ahead

    def put_gather(self, flat: FlatRef, pending: PendingGather) -> None:
        assert flat not in self._gathers, flat
        self._gathers[flat] = pending

    def take_gather(self, flat: FlatRef) -> PendingGather | None:
        return self._gathers.pop(flat, None)

    def has_gather(self, flat: FlatRef) -> bool:
        return flat in self._gathers

    def gathered_flats(self) -> Iterator[FlatRef]:
        """Flat tensors with an all-gather waiting, in issue order (a snapshot)."""
        return iter(list(self._gathers))

    def count_gather(self, *, ahead: bool) -> None:
        if ahead:
            self.gather_counts.ahead += 1
        else:
            self.gather_counts.on_demand += 1

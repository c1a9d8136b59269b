"""`StepContext`: what the blocks of one wrapped model share, split by concern the way FSDP2
splits its state: the step's phase and owning thread (`StepPhase`), the device account
(device_account.py), the all-gathers started ahead (`GathersAhead`), the held copies the
saved-tensor hooks recognise (activation_pack.py), the schedule (schedule.py); the context itself
keeps the configuration, the registration of tensors, and the callbacks and step queue that the
tiered optimizer (tierzero.optim) plugs in. Each part's fields are written only by its methods.

The context sits below the flat tensors and blocks that share it: it knows them by the small
Protocols `FlatRef` and `HeldBlock`, never by their classes.
"""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Iterator, NamedTuple, Protocol

import torch
import torch.distributed as dist

from tierzero.config import Tier
from tierzero.layout import BlockTiers, CommBytes, FlatLayout, ZeroStage
from tierzero.placement import CheckpointHome, Kind, PlacementManager, TensorHandle
from tierzero.prefetch import Prefetcher
from tierzero.runtime.activation_pack import HeldCopies
from tierzero.runtime.step.device_account import DeviceAccount, HeldBlock
from tierzero.runtime.step.schedule import PLAIN, Schedule
from tierzero.runtime.step.step_queue import StepQueue


class FlatRef(Protocol):
    """What the shared step state, and the gathers below the flat tensors, use of a flat tensor
    (tierzero.runtime.flat.flat_param.FlatParam, a level above)."""

    name: str
    layout: FlatLayout

    @property
    def param(self) -> TensorHandle: ...

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


class GathersAhead:
    """All-gathers started ahead of their block's fetch (world size > 1), in issue order, each
    waiting for its fetch to take it; they are always among the blocks the prefetcher chose
    last, so they fit the device room."""

    def __init__(self) -> None:
        self._pending: dict[FlatRef, PendingGather] = {}
        self.counts = GatherCounts()

    def put(self, flat: FlatRef, pending: PendingGather) -> None:
        assert flat not in self._pending, flat
        self._pending[flat] = pending

    def take(self, flat: FlatRef) -> PendingGather | None:
        return self._pending.pop(flat, None)

    def __contains__(self, flat: FlatRef) -> bool:
        return flat in self._pending

    def __len__(self) -> int:
        return len(self._pending)

    def flats(self) -> Iterator[FlatRef]:
        """Flat tensors with an all-gather waiting, in issue order (a snapshot)."""
        return iter(list(self._pending))

    def count(self, *, ahead: bool) -> None:
        if ahead:
            self.counts.ahead += 1
        else:
            self.counts.on_demand += 1


class StepPhase:
    """Where a wrapped model is in its step (`phase`), the thread that owns the step (`owner`, from
    the root's forward to the end of its backward), and the blocks a forward with grad fetched,
    in the order it first did."""

    def __init__(self) -> None:
        self.phase = Phase.IDLE
        self.owner: threading.Thread | None = None
        self._seen: dict[str, None] = {}
        self._callback_queued = False

    def begin(self, *, grad: bool) -> None:
        self.phase = Phase.FORWARD if grad else Phase.IDLE
        self._seen = {}
        self.owner = threading.current_thread()

    def saw(self, block: str) -> None:
        """`block` was fetched (in a forward, its order counts)."""
        if self.phase is Phase.FORWARD:
            self._seen.setdefault(block)

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

    def enter_backward(self, *, can_queue: bool) -> bool:
        """Phase BACKWARD; True where the iteration's final callback is to be queued now (the
        first time, where there is one: `can_queue`)."""
        self.phase = Phase.BACKWARD
        if self._callback_queued or not can_queue:
            return False
        self._callback_queued = True
        return True

    def backward_died(self) -> bool:
        """The phase is BACKWARD but no backward is running on this thread: the last one raised
        before its final callback. (A forward inside a running backward is a recompute.)"""
        return self.phase is Phase.BACKWARD and torch._C._current_graph_task_id() == -1

    def end(self) -> tuple[str, ...]:
        """Phase IDLE, no owner; the blocks the forward fetched, in the order it first did."""
        order = tuple(self._seen)
        self._callback_queued = False
        self.owner = None
        self._seen = {}
        self.phase = Phase.IDLE
        return order


# The life of a step, by the methods that write the context (the phase and owner in `step`):
#
#     begin_iteration   the root's forward starts: phase FORWARD (IDLE without grad), the calling
#                       thread its owner (`step.check_thread` refuses another's until the step
#                       ends); all-gathers started ahead for the previous iteration are dropped by
#                       the caller
#     hold / release    a block is fetched / released (held in `account`, the device account; a
#                       forward's first fetches give `forward_order` when its backward ends)
#     begin_backward    the first pre-backward hook: phase BACKWARD, the final callback queued once
#                       (after the last step's overlapped updates, which it waits for)
#     end_iteration     the final callback of a backward (or the end of an inference forward)
#
# A backward that raises never runs its final callback: the phase stays BACKWARD after it.
# `step.backward_died()` tells the next root forward so, which then ends that iteration first.
@dataclass(eq=False)
class StepContext:
    """State shared by every block of one wrapped model (see the comment above), and its parts:
    the device account (`account`), the all-gathers started ahead (`gathers`), the held copies the
    saved-tensor hooks recognise (`copies`) and the schedule the blocks follow (`schedule`)."""

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
    step: StepPhase = field(default_factory=StepPhase, init=False)
    """The step's phase and the thread that owns it."""
    prefetcher: Prefetcher | None = field(default=None, init=False)
    gathers: GathersAhead = field(default_factory=GathersAhead, init=False)
    agree_group: Any = field(default=None, init=False)
    """The gloo group the ranks agree their all-gathers ahead in (stage 3, world size > 1: [Note:
    gathers ahead agreed across ranks] in collectives.py); None: no agreement needed."""
    _end_backward: Callable[[], None] | None = field(default=None, init=False)
    grads_final: Callable[[FlatRef], None] | None = field(default=None, init=False)
    """Called with each trainable flat tensor whose gradient is final, once per backward
    (`on_grads_final`); None: nobody asks."""
    _iteration_end: Callable[[], None] | None = field(default=None, init=False)
    forward_order: tuple[str, ...] = field(default=(), init=False)
    """Blocks in the order the last forward with grad that ended first fetched them (the
    overlapped step updates in this order, so the next forward's first block is ready first)."""
    updates: StepQueue | None = field(default=None, init=False)
    """The overlapped step's queue of block updates (see [Note: overlapped step] in
    step_queue.py), once a tiered optimizer runs its step under the next forward."""
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
    account: DeviceAccount = field(init=False)
    """The device room of the step ([Note: the device account] in device_account.py)."""

    def __post_init__(self) -> None:
        self.copies = HeldCopies(self.pm.device)
        self.account = DeviceAccount(self.pm)

    def __repr__(self) -> str:
        return (f"StepContext(rank={self.rank}/{self.world_size}, phase={self.step.phase.value}, "
                f"held={list(self.account.held)}, gathers={len(self.gathers)})")

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
        self.account.registered(handle, added=True)
        return handle

    def unregister(self, handle: TensorHandle) -> None:
        """Give a tensor registered with `register` back to the placement manager."""
        self.pm.unregister(handle)
        self.account.registered(handle, added=False)

    def attach(self, prefetcher: Prefetcher, end_backward: Callable[[], None], largest_block: int) -> None:
        """The root state's prefetcher and final callback of a backward pass, and the device
        bytes of its largest block (at wrap, and again when the root state is rebuilt:
        wrapping.refresh)."""
        self.prefetcher = prefetcher
        self._end_backward = end_backward
        self.account.largest_block = largest_block

    def on_grads_final(self, callback: Callable[[FlatRef], None] | None) -> None:
        """Call `callback` once per backward with each trainable flat tensor whose gradient is
        final (a tiered optimizer under Config.step_in_backward)."""
        self.grads_final = callback

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

    # --------------------------------------------------------------------- step lifecycle

    def begin_iteration(self, *, grad: bool) -> None:
        self.step.begin(grad=grad)

    def begin_backward(self) -> None:
        """First pre-backward hook of a backward pass: queue the final callback once."""
        if self.step.phase is not Phase.BACKWARD:
            self.drain_updates()  # a block no forward fetched may still be updating
        if self.step.enter_backward(can_queue=self._end_backward is not None):
            torch.autograd.Variable._execution_engine.queue_callback(self._end_backward)

    def end_iteration(self, *, died: bool = False) -> None:
        """The backward (or an inference forward) is over; `died`: it raised, so the prefetcher
        learns nothing from it (its fetches stopped short of a trace)."""
        order = self.step.end()
        if order and not died:
            self.forward_order = order
        if self.prefetcher is not None:
            self.prefetcher.end(learn=not died)
        if self._iteration_end is not None:
            self._iteration_end()

    # ------------------------------------------------------------------------ held blocks

    def hold(self, block: HeldBlock) -> None:
        """`block` is fetched: held in the device account (a forward's first holds give its order)."""
        self.account.hold(block)
        self.step.saw(block.name)

    def release(self, block: HeldBlock) -> None:
        self.account.release(block)

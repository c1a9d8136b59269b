"""A block's optimizer state on its tiers and what one update of it holds: the way into the
runtime for tierzero.optim (which never calls the placement manager itself).

BlockState holds one trainable flat tensor's fp32 master weights (the FlatParam's) and the
optimizer's flat states (moments) by name; `update()` pins the gradient, master weights and
moments on the tier the update runs on, hands them over as a BlockUpdate, and on the way out
stores the new parameters and releases the state dirty. `check_update_fits` refuses at
construction an update that could never fit; `update_queue` and `beside_compute` tie the
overlapped step's queue and update threads to the trace; `global_norm` is clipping's collective.
"""

from __future__ import annotations

import contextlib
import math
import time
import zlib
from typing import Callable, Iterator, NamedTuple, Sequence, TypeVar

import torch

from tierzero.config import Tier
from tierzero.layout import ROOT, StateCodec, round_stochastic_, window_numel
from tierzero.placement import UPDATES_TRACK, Kind, TensorHandle
from tierzero.runtime.flat.collectives import all_reduce_, rank_errors
from tierzero.runtime.flat.flat_param import FlatParam
from tierzero.runtime.flat.grads import FlatGrad
from tierzero.runtime.state import TieredState
from tierzero.runtime.step.step_context import StepContext
from tierzero.runtime.step.step_queue import StepQueue

Result = TypeVar("Result")

MASTER = Kind.MASTER.value
"""The master weights' name among a BlockState's kinds (and in an optimizer's state dict)."""

Piece = tuple[int, int, int]
"""(lo, hi, parameter index): a part of one parameter in shard coordinates."""


class Held(NamedTuple):
    """What an update holds, as stored: the gradient (its factor apart), the master weights and
    states in their formats (`codecs`), and the shard's elements."""
    grad: torch.Tensor
    scale: float | None
    tensors: list[torch.Tensor]
    codecs: list[StateCodec]
    numel: int


class BlockUpdate:
    """What one update of a block holds pinned: its gradient (as stored, without the pending
    factor) and its master weights and states, each this rank's whole shard, in their formats.
    Tensors not kept as fp32 are worked on a window at a time, widened to fp32 ([Note: state
    windows])."""

    def __init__(self, block: BlockState, grad: torch.Tensor, tensors: list[torch.Tensor]) -> None:
        self._block, self._grad, self._tensors = block, grad, tensors
        self._gradient = block.gradient
        self._views: list[torch.Tensor] = list(tensors)
        """Per held tensor, the fp32 values `pieces` slices: the tensor itself, or a window's."""
        self._bases = [0] * len(tensors)
        """Per held tensor, the shard offset of its view's first element (a window's start for
        the decoded ones, 0 for the others)."""
        self._scratch: torch.Tensor | None = None
        """fp32 room for the windows, kept through the update (fresh pages cost a fault each)."""
        self.skip: frozenset[int] = frozenset()
        """Parameters (by index) no gradient reached: torch's optimizers skip them."""
        self.collectives: Callable[[], None] | None = None
        """After the update: what takes collectives (FlatParam.master_updated), for the thread
        that drives the model's."""
        self.windowed = bool(block.coded)
        """Whether some held tensor is not fp32, so updates go a window at a time (`window`)."""

    @contextlib.contextmanager
    def window(self, lo: int, hi: int, step: int) -> Iterator[None]:
        """Within: `pieces` in [lo, hi) (lo a multiple of QUANT_BLOCK) slice fp32 values decoded
        from the tensors that are not fp32; on a clean exit they are encoded back, bf16 master
        weights rounded stochastically with random bits from (block, `step`, element)."""
        numel, width = self._block.flat.layout.shard_numel, window_numel(lo, hi)
        coded = self._block.coded
        if self._scratch is None or self._scratch.shape[1] < width:
            self._scratch = torch.empty(len(coded), width, dtype=torch.float32, device=self._tensors[0].device)
        scratch = self._scratch[:, :width]
        for row, i in zip(scratch, coded):
            self._views[i] = self._block.codecs[i].decode(self._tensors[i], numel, lo, hi, row)
            self._bases[i] = lo
        try:
            yield
            for row, i in zip(scratch, coded):
                if i == 0:  # bf16 master weights
                    first, seed = self.rounding(step)
                    round_stochastic_(row[:hi - lo], self._tensors[0][lo:hi], first + lo, seed)
                else:
                    self._block.codecs[i].encode(row, self._tensors[i], numel, lo, hi)
        finally:
            self._views, self._bases = list(self._tensors), [0] * len(self._tensors)

    def rounding(self, step: int) -> tuple[int, int]:
        """bf16 master weights' stochastic rounding at `step`: (the shard's first element in the
        flat tensor, the seed), so each element's random bits are its own on every placement."""
        flat = self._block.flat
        return flat.layout.shard_range(flat.ctx.rank)[0], zlib.crc32(flat.name.encode()) ^ (step * 0x9E3779B1)

    def held(self) -> Held:
        """The held tensors as stored, for a kernel that updates windows in place (Held)."""
        scale = self._gradient.scale
        return Held(self._grad, None if scale is None else float(scale), self._tensors, self._block.codecs,
                    self._block.flat.layout.shard_numel)

    def pieces(self, pieces: Sequence[Piece]) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
        """The fp32 gradient of each piece (the pending factor applied) and, per held tensor
        (master weights first, then the states in order), its fp32 slice for each piece."""
        grads = self._gradient.scaled_pieces(self._grad, [(lo, hi) for lo, hi, _ in pieces])
        return grads, [[t[lo - b:hi - b] for lo, hi, _ in pieces] for t, b in zip(self._views, self._bases)]


# [Note: state windows]
# States kept in bfloat16 or int8 (Config.optimizer_state_dtype), and bf16 master weights, are
# updated a window of the shard at a time: widened to fp32 scratch, updated there by the same
# fused kernel as fp32 states, then stored back in their format. Windows start at multiples of
# the optimizer's STATE_WINDOW (a multiple of QUANT_BLOCK) from the shard's start, so an int8
# block is decoded and encoded once per update, and the bits depend on neither the tier nor
# the placement. bf16 master weights are rounded stochastically with bits hashed from the
# block's name, its step and each element's index in the whole flat tensor.


class BlockState:
    """One trainable flat tensor's optimizer state: the fp32 master weights (they belong to the
    FlatParam, which holds the values) and the optimizer's states by name, zeros at the start."""

    def __init__(self, flat: FlatParam, state_dtype: str = "float32") -> None:
        self.flat = flat
        self.gradient = _gradient(flat)
        self.state_dtype = state_dtype
        """The states' format (Config.optimizer_state_dtype)."""
        self._handles: dict[str, TensorHandle] = {Kind.MASTER.value: flat.ensure_master()}
        self._staging: list[Tier] = []
        """Each handle's staging tier, in order: a handle's home never changes."""
        self._codecs: dict[str, StateCodec] = {
            Kind.MASTER.value: StateCodec("float32" if flat.master_dtype == torch.float32 else "bfloat16")}
        """Each kind's format, in the handles' order."""
        self.coded: tuple[int, ...] = ()
        """The kinds (by index in `kinds`) not kept as fp32, which updates widen a window at a
        time ([Note: state windows])."""
        self._kinds_changed()

    def _kinds_changed(self) -> None:
        """Kinds were added or removed: the staging tiers and the coded kinds follow the handles."""
        self._staging = [h.staging for h in self._handles.values()]
        self.coded = tuple(i for i, c in enumerate(self._codecs.values()) if not c.exact)

    @property
    def codecs(self) -> list[StateCodec]:
        """Each kind's format, in the order updates get them (master weights first)."""
        return list(self._codecs.values())

    def codec(self, kind: str) -> StateCodec:
        return self._codecs[kind]

    @property
    def kinds(self) -> list[str]:
        """The master weights' name (MASTER) and the states', in the order updates get them."""
        return list(self._handles)

    @property
    def states(self) -> list[str]:
        """The optimizer's states besides the master weights, in the order updates get them."""
        return list(self._handles)[1:]

    def add(self, kind: str) -> None:
        """Register the state `kind` (a placed kind's name: "exp_avg", "momentum"), zeros, on the
        optimizer states' tier."""
        ctx = self.flat.ctx
        codec = StateCodec(self.state_dtype, unsigned=kind == Kind.EXP_AVG_SQ.value)
        handle = ctx.register(self.flat.name, codec.zeros(self.flat.layout.shard_numel),
                              ctx.master_tier(self.flat.name), kind=Kind(kind))
        self._handles[kind] = handle
        self._codecs[kind] = codec
        self._kinds_changed()

    def remove(self, kind: str) -> None:
        """Unregister the state `kind` (given back: a newer optimizer took over, or a failed add)."""
        handle = self._handles.pop(kind)
        del self._codecs[kind]
        self._kinds_changed()
        self.flat.ctx.pm.unregister(handle)

    def read(self, kind: str) -> torch.Tensor:
        """A copy of this rank's shard of `kind` ("master" or a state), as a CPU tensor, in its
        format (an int8 state: its bytes, codes then scales)."""
        return self.flat.ctx.pm.read(self._handles[kind])

    def stored_as(self, kind: str) -> tuple[torch.dtype, torch.Size]:
        """The dtype and shape `kind`'s shard is stored as (its format's), without reading it."""
        handle = self._handles[kind]
        return handle.dtype, handle.shape

    def store(self, kind: str, values: torch.Tensor) -> None:
        """Overwrite this rank's shard of `kind` on its home tier (`values` in its format)."""
        self.flat.ctx.pm.store(self._handles[kind], values)

    def stored(self) -> dict[str, tuple[TensorHandle, StateCodec]]:
        """The states besides the master weights, as a checkpoint stores them (runtime.rank_shards):
        each one's handle and format."""
        return {k: (h, self._codecs[k]) for k, h in list(self._handles.items())[1:]}

    def prefetch(self, *, speculative: bool, grad: bool = True) -> None:
        """Start reading the state (and the gradient, `grad`) toward the tiers the update uses:
        in one call, the gradient first."""
        gradient = self.gradient
        pairs = list(zip(self._handles.values(), self._staging))
        if grad and not gradient.empty:  # an empty gradient holds nothing to read
            pairs.insert(0, (gradient.handle, self._staging[0]))
        self.flat.ctx.pm.prefetch(pairs, speculative=speculative)

    @contextlib.contextmanager
    def update(self, *, ahead: Sequence[BlockState] = (), grads_ahead: bool = True) -> Iterator[BlockUpdate]:
        """The gradient (copied to the master weights' tier if it lives apart), master weights
        and states pinned; then the blocks `ahead` start reading their state (and gradients,
        `grads_ahead`): the first for sure, the others speculatively, so the read-ahead can
        never evict what this update is about to use. On a clean exit the master weights' new
        values reach the parameters (the BlockUpdate's `collectives` say what is left for the caller);
        the state is released dirty either way."""
        flat, pm = self.flat, self.flat.ctx.pm
        pairs = [self.gradient.to_hold(self._staging[0]), *zip(self._handles.values(), self._staging)]
        with torch.profiler.record_function(f"tierzero::optimizer_step {flat.name}"), pm.copies.context(), \
                pm.hold(pairs, dirty=[False] + [True] * (len(pairs) - 1)) as (stored, *tensors):
            for k, block in enumerate(ahead):
                block.prefetch(speculative=k > 0, grad=grads_ahead)
            update = BlockUpdate(self, self.gradient.mine(stored), tensors)
            update.skip = self.gradient.unreached()
            yield update
            update.collectives = flat.master_updated(tensors[0])


def check_update_fits(state: TieredState, blocks: Sequence[BlockState], who: str) -> None:
    """After registering states: their NVMe writes landed (a disk error fails here), the
    host-homed ones leave room to stage the NVMe ones, and each block's update fits its tier."""
    state.pm.settle()
    state.pm.room.check_staging()
    for block in blocks:
        _check_update_fits(state, block, who)


def _check_update_fits(state: TieredState, block: BlockState, who: str) -> None:
    """A block's update holds its gradient, master weights and moments at once on the tier the
    CPU works on them in (and a staging buffer for the new parameters when they are stored to
    an NVMe home apart from the master weights): refused now if that can never fit, not at the
    first step."""
    flat = block.flat
    handles = list(block._handles.values())
    extra = []
    if handles[0] is not flat.param and flat.param.home is Tier.NVME:
        extra.append((Tier.HOST, flat.param.nbytes))
    grad, where = block.gradient.handle, handles[0].staging
    if grad.staging is not where:  # a gradient placed apart is copied to the update's tier
        extra.append((where, grad.nbytes))
    held = _held_through_backward(state, flat, where) if state.config.step_in_backward else []
    beside = f", and the {ROOT!r} gradient backward holds meanwhile (step_in_backward)" if held else ""
    state.pm.room.check_working_set(
        f"{who}'s update of block {flat.name!r} (its gradient, master weights and moments{beside})",
        [*([grad] if grad.staging is where else []), *handles], extra + held)


# [Note: room held through backward]
# With step_in_backward a block's update (its gradient, master weights and moments pinned at
# once) runs while backward goes on, and backward holds the gradient it is summing into pinned
# until that gradient is final. The root's gradient (the embedding and the head: its first
# contributions come before the blocks', its last after) stays pinned through the whole
# backward. Were the update's working set and that gradient more than the tier's free room, the
# update waits for room that backward holds while backward waits for the room the update holds:
# both stuck (issue 46, defect 7: the built-in tiny model, everything on NVMe, host_budget
# 3200KiB failed in its first backward; 3330048 bytes, the update's four 776 KiB buffers and the
# root's 145 KiB gradient, trains). So the check at construction counts it. The gradient of the
# block backward computes next is not counted: backward takes it only once the update before it
# has what it needs, and an update never waits for backward.
def _held_through_backward(state: TieredState, flat: FlatParam, where: Tier) -> list[tuple[Tier, int]]:
    """Config.step_in_backward: the room on `where` that backward keeps pinned while `flat`'s
    update runs beside it, and that the update can therefore never take (see the Note above)."""
    extra = []
    for other in state.flat_params(trainable=True):
        if other is flat or other.name != ROOT or other.grad is None:
            continue
        held = _gradient(other).handle
        if held.staging is where and held.home is not where:  # a home is counted as homed
            extra.append((where, held.nbytes))
    return extra


def update_queue(state: TieredState, read_ahead: int) -> StepQueue:
    """The overlapped step's queue of block updates, attached to the model: the loop's waits
    for an update are host stalls, and the tier model learns how far updates read ahead."""
    ctx, telemetry = state.ctx, state.pm.recorder
    queue = StepQueue(on_wait=lambda s: telemetry.record_stall(Tier.HOST, s, {"update": s}), on_done=ctx.update_done)
    telemetry.info["update_read_ahead"] = read_ahead  # the tier model replays the updates
    ctx.overlap_step(queue)
    return queue


def beside_compute(state: TieredState, update: Callable[[], Result], name: str, *,
                   overlapped: bool) -> Callable[[], Result]:
    """`update` of block `name` run on a thread beside compute: its waits for data are not
    stalls of the training loop (telemetry counts them apart; the loop's waits for the update
    are). Each update is a span of the trace's "updates" track, with the seconds it waited for
    data and whether it is the overlapped step's (under the next forward) or step_in_backward's:
    the tier model replays the former."""
    telemetry = state.pm.recorder

    def beside() -> Result:
        t0 = time.perf_counter()
        with telemetry.background() as waited:
            try:
                return update()
            finally:
                telemetry.record_span(UPDATES_TRACK, f"update {name}", t0, time.perf_counter(),
                                      {"block": name, "wait_s": round(waited(), 6), "overlapped": overlapped})
    return beside


def global_norm(shard_norms: list[torch.Tensor], norm_type: float, ctx: StepContext) -> torch.Tensor:
    """The norm over every rank's gradient shards from this rank's per-shard norms (shards split
    the flat gradients exactly, padding holds zeros), reduced on the device."""
    local = torch.stack([n.to(ctx.device) for n in shard_norms])
    streams = ctx.pm.copies
    with rank_errors(ctx.rank, ctx.world_size, "all-reduce of the gradient norm"):
        if math.isinf(norm_type):
            return all_reduce_(streams.to_device(local.max()), ctx.group, ctx.world_size, streams, op="max",
                               comm=ctx.comm)
        powered = all_reduce_(streams.to_device(local.pow(norm_type).sum()), ctx.group, ctx.world_size, streams,
                              comm=ctx.comm)
    return powered.pow(1.0 / norm_type)


def _gradient(flat: FlatParam) -> FlatGrad:
    assert flat.grad is not None, f"{flat.name} is not trainable"
    return flat.grad

"""`FlatParam`: one flat tensor of a block, its residency, and the parameters that view it.

A block's trainable parameters (or its frozen ones) are packed into one flat tensor whose
shard for this rank (the whole tensor at world size 1) lives in the placement manager
(`param`, Kind.PARAM or Kind.FROZEN, in the compute dtype). A trainable one also has its
gradient (`grad`, a FlatGrad) and, when the optimizer needs them, fp32 master weights
(`master`: see [Note: master weights]).

At ZeRO stages 1 and 2 (`ZeroStage.params_whole`) `param` holds the whole flat tensor on every
rank instead of the shard, while the master weights stay this rank's shard (so they are never
the parameters themselves): new values of the shard (an optimizer step, a load) are cast to the
compute dtype and all-gathered, in a device scratch buffer, into every rank's whole copy.
"""

from __future__ import annotations

from enum import Enum
from typing import Callable

import torch
from torch import nn

from tierzero.config import Tier
from tierzero.formats import LoadedShard, ShardRequest
from tierzero.layout import FlatLayout, ZeroStage, fetched_bytes
from tierzero.placement import CheckpointHome, Kind, TensorHandle
from tierzero.runtime.flat.collectives import all_gather_flat, broadcast_from_first_, rank_errors
from tierzero.runtime.flat.gathers import discard_gather
from tierzero.runtime.flat.grad_views import view_of
from tierzero.runtime.flat.grads import FlatGrad
from tierzero.runtime.flat.placeholders import guard, unguard
from tierzero.runtime.step.step_context import StepContext


# Parameters are never replaced: each stays the same nn.Parameter object, and its `.data` is set
# to a view into the device copy while HELD, and to a one-element zero-stride placeholder of the
# same shape, dtype and device otherwise, which refuses to be read (placeholders.py). Autograd
# saves parameters (leaves) by reference, so a backward sees whatever `.data` holds then: the
# copy the pre-backward hook fetched. Only ParamViews' `install`, `install_scratch` and
# `uninstall` change the state, as their last line.
class ParamState(Enum):
    """What a FlatParam's nn.Parameters hold.

    FREE     one-element zero-stride placeholders with the right shape: no device memory.
    HELD     views into the flat tensor's pinned device copy: its bytes on the device tier.
    SCRATCH  full CPU tensors that load_state_dict copies into: the block's bytes in CPU memory
             outside every budget, only while a load runs.
    """

    FREE = "free"
    HELD = "held"
    SCRATCH = "scratch"


# [Note: master weights]
# The master weights are registered at wrap only when the values given are wider than the
# parameters (fp32 values, a narrower compute dtype): the parameters alone would lose bits.
# Otherwise (fp32 compute; or values already in the compute dtype, such as a bf16 model's
# weights loaded for bf16 compute) the parameters hold the values exactly, and `ensure_master`
# makes the master weights when the optimizer asks for them: the parameters themselves when
# they are fp32 and live on the optimizer states' tier (`master is param`: one copy, no
# separate write), else their values upcast to fp32, bit for bit what registering them at wrap
# would have written. A load saves that write (two thirds of a bf16 model's swap writes); every
# reader of the values before then (state dicts, checkpoints, export) reads the parameters.
# This holds at every ZeRO stage: the master weights are this rank's shard, cut from the
# parameters' whole flat tensor at stages 1 and 2.
#
# A shard loaded from a checkpoint whose bytes it is exactly (the same case: values in the
# compute dtype) is registered with the checkpoint's files as its NVMe home until its first
# write, so a load writes nothing to the swap files (see [Note: copy-on-write home] in
# tierzero/placement/storage/cow_home.py).
class FlatParam:
    """One flat tensor of a block and the nn.Parameters that view it (see the module docstring)."""

    def __init__(self, name: str, params: list[nn.Parameter], layout: FlatLayout,
                 orig_dtypes: list[torch.dtype], ctx: StepContext, home: Tier) -> None:
        self.name = name
        """The block's name: the owner of this flat tensor's handles."""
        self.params = params
        self.layout = layout
        self.orig_dtypes = orig_dtypes
        self.ctx = ctx
        self.home = home
        self.trainable = params[0].requires_grad
        assert all(p.requires_grad == self.trainable for p in params), name
        self._param: TensorHandle | None = None
        self.master: TensorHandle | None = None
        """fp32 master weights (the parameters' own handle when they double as them)."""
        self.grad: FlatGrad | None = None
        """The gradient shard of a trainable flat tensor."""
        self.source = FlatSource(self)
        """What the parameters consult while they hold placeholders (`p.grad`, requires_grad set)."""
        self.views = ParamViews(self)
        """What the parameters hold (ParamState), and its transitions."""

    @property
    def param(self) -> TensorHandle:
        """This rank's shard of the parameters in the compute dtype (the whole flat tensor at
        stages 1 and 2)."""
        assert self._param is not None, f"{self.name}: not registered"
        return self._param

    @property
    def values(self) -> TensorHandle:
        """Where the values are kept at full precision: the master weights, else the parameters."""
        return self.master if self.master is not None else self.param

    @property
    def nbytes(self) -> int:
        """Device bytes while fetched (see fetched_bytes)."""
        return fetched_bytes(self.layout, self.ctx.compute_dtype, gathered=self.ctx.zero.gathers)

    @property
    def shard(self) -> slice:
        """This rank's part of the flat tensor."""
        return slice(*self.layout.shard_range(self.ctx.rank))

    @property
    def is_free(self) -> bool:
        return self.views.state is ParamState.FREE

    # ----------------------------------------------------------------------------- setup

    def register(self, values: list[torch.Tensor]) -> None:
        """Put this rank's shard of the parameters' values (the first rank's values, so every
        rank starts alike) into the placement manager; the parameters become placeholders.
        Trainable ones get a gradient shard (and, when the compute dtype is narrower than fp32,
        fp32 master weights made from these full-precision values)."""
        ctx = self.ctx
        kind = Kind.PARAM if self.trainable else Kind.FROZEN
        flat = self.layout.flatten(values, dtype=torch.float32, device="cpu")
        if ctx.world_size > 1:  # broadcast on the device, where the group's collectives run
            with rank_errors(ctx.rank, ctx.world_size, f"broadcast of {self.name}.{kind.value} at wrap"):
                flat = broadcast_from_first_(ctx.pm.copies.to_device(flat), ctx.group, ctx.world_size,
                                             ctx.pm.copies).cpu()
        self._register(flat[self.shard], flat if ctx.zero.params_whole else None, lazy=False)

    def register_shard(self, shard: LoadedShard) -> None:
        """As `register`, from this rank's shard itself (`layout.shard_numel` elements in
        `load_dtype`, read from a checkpoint by every rank): no communication, except at
        stages 1 and 2, where the shards are all-gathered into every rank's whole parameters.
        NVMe homes are written lazily (PlacementManager.register): the blocks of a load that fit
        the host budget stay there, unwritten until their room is needed; a shard that comes
        with its checkpoint home (`borrows_checkpoint`) is never written at load."""
        ctx = self.ctx
        whole = None
        if ctx.zero.params_whole:
            assert shard.home is None, self.name  # the whole parameters are not the shard's bytes
            whole = self._gather(ctx.pm.copies.to_device(shard.values, ctx.compute_dtype), "at wrap")
        self._register(shard.values, whole, lazy=True, borrowed=shard.home)

    def _register(self, shard: torch.Tensor, whole: torch.Tensor | None, *, lazy: bool,
                  borrowed: CheckpointHome | None = None) -> None:
        """Register the parameters (`whole` when every rank keeps them whole, else `shard`, with
        its checkpoint home when `borrowed`), and the gradient of a trainable flat tensor, with
        its master weights when the parameters cannot hold `shard`'s values exactly
        ([Note: master weights])."""
        ctx = self.ctx
        assert shard.numel() == self.layout.shard_numel, (self.name, shard.shape)
        kind = Kind.PARAM if self.trainable else Kind.FROZEN
        self._param = ctx.register(self.name, shard if whole is None else whole, self.home, kind=kind,
                                   dtype=ctx.compute_dtype, lazy=lazy, borrowed=borrowed)
        if self.trainable:
            self.grad = FlatGrad(self.name, self.layout, ctx)
            if not self._params_hold(shard.dtype):
                self.master = ctx.register(self.name, shard.float(), ctx.master_tier(self.name), kind=Kind.MASTER,
                                           lazy=lazy)
        self.views.uninstall()

    @property
    def load_dtype(self) -> torch.dtype:
        """The dtype to give this flat tensor's values in (register_shard, store_values; see
        `load_dtype`)."""
        return load_dtype(self.orig_dtypes, self.ctx.compute_dtype)

    @property
    def shard_request(self) -> ShardRequest:
        """What to read from a checkpoint for this flat tensor (WeightPlan.read_shards)."""
        return shard_request(self.layout, self.orig_dtypes, self.ctx.compute_dtype)

    def _params_hold(self, dtype: torch.dtype) -> bool:
        """Whether the parameters (compute dtype) hold values of `dtype` exactly, so that master
        weights made from them later are bit for bit those values: fp32 parameters hold the
        floating dtypes values come in (fp32, bf16, fp16), narrower ones only their own."""
        # bf16 master weights (Config.master_dtype) are the bf16 parameters: they hold the values
        return dtype == self.ctx.compute_dtype or self.ctx.compute_dtype == torch.float32 or self.master_dtype != torch.float32

    @property
    def master_dtype(self) -> torch.dtype:
        """The master weights' dtype (Config.master_dtype)."""
        return getattr(torch, self.ctx.pm.config.master_dtype)

    def ensure_master(self) -> TensorHandle:
        """Master weights for the optimizer: the parameters themselves where the plan says they
        are (ElementBytes.params_are_master: the master dtype, on the optimizer states' tier, kept
        as this rank's shard), else their values in the master dtype, registered on that tier
        (exactly the values: the parameters hold them whenever `master` is None)."""
        if self.master is None:
            ctx = self.ctx
            element = ctx.pm.config.element_bytes(cuda=ctx.pm.device.type == "cuda")  # the plan's rule
            if element.params_are_master(same_tier=self.home is ctx.master_tier(self.name),
                                         params_whole=ctx.zero.params_whole):
                self.master = self.param
            else:
                values = ctx.pm.read(self.param)
                if ctx.zero.params_whole:
                    values = values[self.shard]
                self.master = ctx.register(self.name, values.to(self.master_dtype), ctx.master_tier(self.name),
                                           kind=Kind.MASTER)
        return self.master

    def freeze(self, home: Tier) -> None:
        """Its parameters were all frozen after wrap (peft froze a base): it becomes a frozen
        flat tensor, labelled so (Kind.FROZEN), homed on `home` (moved there when that is another
        tier), its gradient and separate master weights given back (a frozen flat tensor holds
        its values in the compute dtype, as one frozen at wrap does)."""
        ctx = self.ctx
        assert self.is_free and self.trainable, (self.name, self.views.state)
        if self.grad is not None:
            self.grad.capture.drop()
            ctx.unregister(self.grad.handle)
        if self.master is not None and self.master is not self.param:
            ctx.unregister(self.master)
        if home is self.home:
            self._param = ctx.pm.relabel(self.param, Kind.FROZEN)
        else:
            values = ctx.pm.read(self.param)
            ctx.unregister(self.param)
            self._param = ctx.register(self.name, values, home, kind=Kind.FROZEN, dtype=ctx.compute_dtype)
        self.trainable, self.grad, self.master, self.home = False, None, None, home

    def close(self) -> None:
        """Give every handle back (its parameters are taken over by another flat tensor)."""
        assert self.is_free, (self.name, self.views.state)
        ctx = self.ctx
        if self.grad is not None:
            ctx.unregister(self.grad.handle)
        if self.master is not None and self.master is not self.param:
            ctx.unregister(self.master)
        ctx.unregister(self.param)

    def clear_grad(self, *, set_to_none: bool = True) -> None:
        with torch._C.DisableTorchFunctionSubclass():  # autograd's .grad (not SlotEdits.forget's p.grad = None)
            for p in self.params:
                p.grad = None
        if self.grad is not None:
            self.grad.clear(set_to_none=set_to_none)

    # ---------------------------------------------------------------------------- values

    def read_full(self) -> list[torch.Tensor]:
        """Current values as CPU tensors in the parameters' original dtypes (from the fp32
        master weights when there are any), gathered from every rank (a collective: every rank
        calls it)."""
        ctx = self.ctx
        ctx.drain_updates()
        flat = ctx.pm.read(self.values)
        if flat.numel() < self.layout.padded_numel:
            with rank_errors(ctx.rank, ctx.world_size, f"all-gather of {self.param.name} for a state dict"):
                flat = all_gather_flat(ctx.pm.copies.to_device(flat), self.layout, ctx.group, ctx.comm,
                                       ctx.pm.copies).cpu()
        return [v.to(dt, copy=True) for v, dt in zip(self.layout.views(flat), self.orig_dtypes)]

    def write_values(self, shard: torch.Tensor) -> None:
        """New values of this rank's shard in the compute dtype: with fp32 master weights apart,
        the elements whose compute-dtype value changed take the new value and the others keep
        their full precision."""
        if self.master is not None and self.master is not self.param:
            master = self.ctx.pm.read(self.master)
            changed = shard != master.to(shard.dtype)
            master[changed] = shard[changed].to(master.dtype)
            shard = master
        self.store_values(shard)

    def write_full(self, values: list[torch.Tensor]) -> None:
        """Overwrite the values with this rank's part of `values` (full tensors)."""
        self.store_values(self.layout.flatten(values, dtype=self.load_dtype, device="cpu")[self.shard])

    def store_values(self, shard: torch.Tensor) -> None:
        """New values of this rank's shard: the master weights (fp32; registered now when the
        parameters cannot hold these values exactly) and the parameters (compute dtype)."""
        self.ctx.drain_updates()
        if self.master is None and self.trainable and not self._params_hold(shard.dtype):
            self.master = self.ctx.register(self.name, shard.float(), self.ctx.master_tier(self.name), kind=Kind.MASTER)
        elif self.master is not None and self.master is not self.param:
            self.ctx.pm.store(self.master, shard.to(self.master.dtype))
        self._store_param(shard)

    def master_updated(self, master: torch.Tensor) -> Callable[[], None] | None:
        """The master weights now hold `master` (an optimizer step): store the new parameters,
        unless the parameters are the master weights (the master's write reaches them), and drop
        a gathered copy of the old ones either way. Across ranks what takes collectives (the
        all-gather of the new parameters at stages 1 and 2; dropping an all-gather started
        ahead) is returned instead, for the thread that drives the collectives to run in step
        order, the same on every rank; the caller runs the rest wherever it is."""
        ctx = self.ctx
        if ctx.zero.params_whole and ctx.world_size > 1:
            shard = master.to(ctx.compute_dtype, copy=True)  # `master` is released before this runs
            return lambda: self._store_param(shard)
        if self.master is not self.param:
            self._store_param(master, discard=ctx.world_size == 1)
        return (lambda: discard_gather(ctx, self)) if ctx.world_size > 1 else None

    def _store_param(self, shard: torch.Tensor, *, discard: bool = True) -> None:
        ctx = self.ctx
        streams = ctx.pm.copies
        shard = shard.to(ctx.compute_dtype)
        if ctx.zero.params_whole and self.param.home is Tier.DEVICE:  # gathered in place
            whole = ctx.pm.acquire(self.param, Tier.DEVICE)
            try:
                self._gather(streams.to_device(shard), "of the updated values", out=whole)
            finally:
                ctx.pm.release(self.param, Tier.DEVICE, dirty=True)
        elif ctx.zero.params_whole:  # gathered on the device, stored to the home and cached copies
            nbytes = self.layout.padded_numel * ctx.compute_dtype.itemsize
            scratch = ctx.pm.scratch.reserve(nbytes, Tier.DEVICE, what=f"{self.param.name} (updated, gathered)")
            assert scratch is not None
            try:
                whole = scratch[:nbytes].view(ctx.compute_dtype)
                ctx.pm.store(self.param, self._gather(streams.to_device(shard), "of the updated values", out=whole))
            finally:
                ctx.pm.scratch.free(scratch, Tier.DEVICE)
        else:
            ctx.pm.store(self.param, shard)
        if discard:
            discard_gather(ctx, self)

    def _gather(self, shard: torch.Tensor, why: str, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Every rank's `shard` gathered into the whole flat tensor (stages 1 and 2)."""
        ctx = self.ctx
        with torch.profiler.record_function(f"tierzero::all_gather_updated {self.name}"), \
                rank_errors(ctx.rank, ctx.world_size, f"all-gather of {self.name}'s parameters {why}"):
            return all_gather_flat(shard, self.layout, ctx.group, ctx.comm, ctx.pm.copies, out=out)

    def __repr__(self) -> str:
        kind = "param" if self.trainable else "frozen"
        return f"FlatParam({self.name!r}, {kind}, {self.layout}, {self.views.state.value})"


class ParamViews:
    """What one FlatParam's nn.Parameters hold (ParamState) and the transitions between: the
    only writers of their `.data`."""

    def __init__(self, flat: FlatParam) -> None:
        self._flat = flat
        ctx = flat.ctx
        self.placeholders = [torch.zeros((), dtype=ctx.compute_dtype, device=ctx.device).expand(s.shape)
                             for s in flat.layout.slots]
        """Per parameter, the one-element zero-stride tensor it holds while FREE."""
        self.device: torch.Tensor | None = None
        """The device copy the parameters view while HELD."""
        self.state = ParamState.FREE

    def install(self, flat: torch.Tensor) -> None:
        """FREE -> HELD: the parameters view the device copy `flat`."""
        owner = self._flat
        assert self.state is ParamState.FREE, (owner.name, self.state)
        unguard(owner.params)
        for p, view in zip(owner.params, owner.layout.views(flat)):
            p.data = view
        self.device = flat
        owner.ctx.copies.track(owner, flat)
        self.state = ParamState.HELD

    def install_scratch(self, values: list[torch.Tensor]) -> None:
        """FREE -> SCRATCH: the parameters hold `values` (full CPU tensors) for a state-dict load."""
        owner = self._flat
        if self.state is not ParamState.FREE:
            raise RuntimeError(f"{owner.name}: load_state_dict while the block is in use "
                               f"({self.state.value}); load between training steps")
        unguard(owner.params)
        for p, v in zip(owner.params, values):
            p.data = v
        self.state = ParamState.SCRATCH

    def uninstall(self) -> None:
        """HELD / SCRATCH -> FREE: the parameters become placeholders again, refusing reads
        ([Note: unfetched parameters] in placeholders.py)."""
        owner = self._flat
        for p, ph in zip(owner.params, self.placeholders):
            p.data = ph
        guard(owner.params, [slot.fqn for slot in owner.layout.slots], owner.source)
        if self.device is not None:
            owner.ctx.copies.untrack(self.device)
            self.device = None
        self.state = ParamState.FREE

    def held(self) -> torch.Tensor:
        """HELD: this rank's shard of the device copy, as the caller may have changed it, on the CPU."""
        assert self.state is ParamState.HELD and self.device is not None, (self._flat.name, self.state)
        return self.device[self._flat.shard].to("cpu", copy=True)


class FlatSource:
    """What a FlatParam's parameters consult while they hold placeholders (placeholders.ParamSource):
    `p.grad` answered from the flat gradient, `p.grad = None` and `requires_grad` set heard."""

    def __init__(self, flat: FlatParam) -> None:
        self._flat = flat

    def grad_view(self, index: int) -> torch.Tensor | None:
        """`p.grad` of parameter `index` while FREE: its gradient as torch's clipping sees it
        ([Note: gradients seen through p.grad] in grad_views.py), None where torch's is None."""
        flat = self._flat
        ctx = flat.ctx
        if flat.grad is None:
            return None
        if ctx.updates is not None and ctx.updates.clears(flat.param):
            ctx.drain_updates()  # a zero_grad waits behind the overlapped step's update: answer after it
        return view_of(flat.grad, index, flat.layout.slots[index].fqn, flat.views.placeholders[index],
                       refused=ctx.grads_final is not None)

    def grad_set_none(self, index: int) -> None:
        """`p.grad = None` of parameter `index` while FREE (model.zero_grad()): its gradient is
        forgotten, as torch forgets it (after the overlapped step's update of the block)."""
        flat = self._flat
        if flat.grad is None:
            return
        if flat.ctx.updating((flat.param,)):
            flat.ctx.drain_updates()
        flat.grad.slots.forget(index)

    def requires_grad_set(self, index: int, requires_grad: bool) -> None:
        """Parameter `index` was set to require a gradient or not while FREE: one of a frozen flat
        tensor unfrozen is taken in before the next forward (wrapping.refresh)."""
        if requires_grad and not self._flat.trainable:
            self._flat.ctx.unfrozen = True


def load_dtype(orig_dtypes: list[torch.dtype], compute_dtype: torch.dtype) -> torch.dtype:
    """The dtype a flat tensor's values are given in: the compute dtype when every parameter
    has it (the values are then exactly the parameters: no master weights are written until the
    optimizer needs them), else fp32."""
    return compute_dtype if all(d == compute_dtype for d in orig_dtypes) else torch.float32


def shard_request(layout: FlatLayout, dtypes: list[torch.dtype], compute_dtype: torch.dtype, *,
                  borrow: bool = False) -> ShardRequest:
    """The checkpoint read for a flat tensor of `layout` whose parameters have `dtypes`, its
    shard given in `load_dtype`; `borrow` (see `borrows_checkpoint`) when that is the compute
    dtype, the parameters' registered bytes."""
    out_dtype = load_dtype(dtypes, compute_dtype)
    return ShardRequest(layout, dtypes, out_dtype, borrow and out_dtype == compute_dtype)


def borrows_checkpoint(home: Tier, zero: ZeroStage) -> bool:
    """Whether a load may keep the checkpoint's files as the parameters' NVMe home (the note
    [Note: copy-on-write home] in tierzero/placement/storage/cow_home.py): when they are homed on NVMe and registered
    as this rank's shard (not whole, as at stages 1 and 2). It does for each shard whose bytes
    are the checkpoint's exactly (WeightPlan.segments): the same dtype, the compute dtype (no
    master weights then either)."""
    return home is Tier.NVME and not zero.params_whole

"""`FlatGrad`: the gradient of one trainable flat tensor, and the one place a clip factor applies.

This rank's shard of the flat gradient, in `config.grad_dtype`, lives in the placement manager
on `config.grads` (at ZeRO stage 1 the whole flat gradient, of which readers see this rank's
shard). Early capture, beside GradCapture, sums gradients into it as autograd sends them."""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator, NamedTuple, Sequence

import torch
from torch import nn

from tierzero.config import Tier
from tierzero.layout import FlatLayout
from tierzero.placement import CopyEvent, Kind, TensorHandle
from tierzero.runtime.flat.collectives import all_reduce_flat, rank_errors, reduce_scatter_flat
from tierzero.runtime.step.step_context import StepContext


# [Note: a flat gradient's life]
# A FlatGrad's life in a step:
#
#     accumulate  after the block's backward, the parameters' .grad (what early capture did not
#                 take already: [Note: early gradient capture]) are flattened (and
#                 reduce-scattered, averaged, across ranks; all-reduced at stage 1) into the
#                 stored gradient, in its dtype: the first time in a step it is overwritten,
#                 later times (gradient accumulation) added to
#     norms       with clipping on (StepContext.clip_norm_type, set by the first tz.clip_grad_norm_),
#                 each accumulate computes the shard's norms while the bytes are at hand, so
#                 clipping reads no gradient: they stand until the stored gradient changes
#     scale       tz.clip_grad_norm_ records a factor without touching the stored bytes
#     scaled      readers (the optimizer, the norm) see the gradient in fp32 times the pending
#                 factor; the next accumulate folds the factor into the stored bytes first
#     clear       zero_grad(): forgotten (set_to_none) or zeros
#
# `empty` is set_to_none's state: no gradient since the last zero_grad().
class FlatGrad:
    """The gradient shard of one trainable flat tensor (see [Note: a flat gradient's life])."""

    def __init__(self, owner: str, layout: FlatLayout, ctx: StepContext) -> None:
        self.layout = layout
        self.ctx = ctx
        self.whole = ctx.zero.grads_whole
        """The whole flat gradient is kept (stage 1), not this rank's shard."""
        # Room only: nothing is read before the first accumulate overwrites it whole (or a
        # zero_grad(set_to_none=False) zeroes it), so no zeros are written to the tier at wrap.
        numel = layout.padded_numel if self.whole else layout.shard_numel
        self.handle: TensorHandle = ctx.register(owner, torch.empty(numel, device="meta"), ctx.grad_tier(owner),
                                                 kind=Kind.GRAD, dtype=ctx.grad_dtype)
        self.empty = True
        self.scale: torch.Tensor | None = None
        """A factor (clip_grad_norm_) not yet applied to the stored gradient."""
        self._norms: tuple[float, list[torch.Tensor]] | None = None
        """(norm type, norms_of() of the stored gradient), computed as it was written."""
        self._reached: set[int] = set()
        """Parameters (by index) that a gradient reached since the last zero_grad(set_to_none)."""
        self._captured: set[int] = set()
        """Early capture: parameters (by index) with contributions summed into `_held`."""
        self._held: torch.Tensor | None = None
        """Early capture ([Note: early gradient capture]): where this backward's shares are summed:
        the stored gradient, acquired (overwrite) at the first share and pinned until accumulate folds in
        the rest, or a view of `_scratch`."""
        self._scratch: torch.Tensor | None = None
        """Early capture on the device: the buffer `_held` views, given back at accumulate."""
        self._refused = False
        """Early capture found no room for its buffer in this backward: none until accumulate."""
        self._partial: tuple[Any, set[int]] | None = None
        """A factor `scale_slot` gave some parameters, not yet every one with a gradient:
        (the factor, those parameters by index); see [Note: gradients seen through p.grad]."""
        self._forgotten: set[int] = set()
        """Parameters whose `p.grad` was set to None (model.zero_grad()), not yet every one with a
        gradient: zeroed in the stored bytes before the gradient is next read or added to."""

    @contextlib.contextmanager
    def acquire(self, *, writable: bool = False, tier: Tier | None = None) -> Iterator[torch.Tensor]:
        """This rank's shard as stored (its dtype, without the pending factor) on `tier` (None:
        the tier the CPU works on it in; an update elsewhere takes a copy there)."""
        self._settle_partial()
        self._settle_forgotten()
        with self._stored(writable=writable, tier=tier) as buf:
            yield self._mine(buf)

    def _mine(self, buf: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the stored gradient `buf` (all of it, but at stage 1)."""
        return buf[slice(*self.layout.shard_range(self.ctx.rank))] if self.whole else buf

    @contextlib.contextmanager
    def _stored(self, *, writable: bool = False, overwrite: bool = False,
                tier: Tier | None = None) -> Iterator[torch.Tensor]:
        """The stored gradient (the whole one at stage 1); overwrite=True: the caller writes all
        of it, so the stored bytes are not read."""
        pm, tier = self.ctx.pm, tier or self.handle.staging
        buf = pm.acquire(self.handle, tier, overwrite=overwrite)
        try:
            yield buf
        finally:
            # lazily: a gradient that stays in host memory until the step is used and cleared
            # there, never written to an NVMe home (written only when its room is needed)
            pm.release(self.handle, tier, dirty=writable or overwrite, lazy=True)

    def scaled(self, g: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
        """`g` (the stored gradient or a slice of it) times the pending factor: the one place
        the factor is applied. In fp32 (a copy of a bfloat16 gradient), unless `inplace`."""
        if not inplace and g.dtype != torch.float32:
            return g.float() if self.scale is None else g.float().mul_(self.scale)
        if self.scale is None:
            return g
        return g.mul_(self.scale) if inplace else g * self.scale

    def prefetch(self, *, speculative: bool = False, tier: Tier | None = None) -> None:
        if not self.empty:
            self.ctx.pm.prefetch(self.handle, tier or self.handle.staging, speculative=speculative)

    def scaled_pieces(self, g: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """`scaled` of each slice [lo, hi) of `g` in `bounds` (an update's pieces), in fp32."""
        return [self.scaled(g[lo:hi]) for lo, hi in bounds]

    def scale_by(self, factor: torch.Tensor) -> None:
        self._settle_partial()
        if not self.empty:
            self.scale = factor if self.scale is None else self.scale * factor
            self._norms = None  # of the unscaled bytes: clipping twice reads again

    def norms_of(self, g: torch.Tensor, norm_type: float) -> list[torch.Tensor]:
        """The norms clip_grad_norm_ combines, of `g` (the stored shard) times the pending
        factor: at world size 1 one per parameter, as torch.nn.utils.clip_grad_norm_ computes
        them (the same bits); with several ranks one of the whole shard (padding is zeros)."""
        if self.layout.world_size == 1:
            return [self._norm(g[s.offset:s.offset + s.numel], norm_type) for s in self.layout.slots]
        return [self._norm(g, norm_type)]

    def _norm(self, g: torch.Tensor, norm_type: float) -> torch.Tensor:
        return torch.linalg.vector_norm(self.scaled(g), norm_type)

    def has_norms(self, norm_type: float) -> bool:
        return self._norms is not None and self._norms[0] == norm_type

    def norms(self, norm_type: float) -> list[torch.Tensor]:
        """norms_of() the stored gradient: as computed in backward, or read now (and kept)."""
        if self._norms is not None and self.has_norms(norm_type):
            return self._norms[1]
        with self.acquire() as g:
            self._norms = (norm_type, self.norms_of(g, norm_type))
        return self._norms[1]

    # Through p.grad: a parameter's part of the gradient ([Note: gradients seen through p.grad]).

    def scale_slot(self, index: int, factor: torch.Tensor | float) -> None:
        """Parameter `index`'s gradient times `factor` (a CPU scalar tensor, or a number): torch's
        clipping multiplies each `p.grad` by one factor. Once every parameter with a gradient has
        had the same factor, it is the pending factor of the whole flat gradient, as
        tz.clip_grad_norm_ sets it; a factor given to some parameters only is multiplied into
        their stored bytes before the gradient is next read."""
        if self._partial is not None:
            given, indices = self._partial
            same = given is factor or (not isinstance(given, torch.Tensor) and given == factor)
            if not same or index in indices:
                self._settle_partial()
        if self._partial is None:
            self._partial = (factor, set())
        self._partial[1].add(index)
        if self._partial[1] >= self.reached():
            self._partial = None
            self.scale_by(torch.as_tensor(factor, dtype=torch.float32))

    def _settle_partial(self) -> None:
        """A factor that reached only some parameters: multiplied into their stored bytes."""
        if self._partial is None:
            return
        factor, indices = self._partial
        self._partial = None
        with self._stored(writable=True) as buf:
            mine = self._fold_scale(buf)
            for i in sorted(indices):
                self._slot_of(mine, i).mul_(factor)

    def forget_slot(self, index: int) -> None:
        """`p.grad = None` for parameter `index` (model.zero_grad()): its gradient forgotten, as
        torch forgets it; once every parameter with a gradient is, the whole gradient is cleared
        (`clear`), else their parts are zeroed before the gradient is next read."""
        if index not in self.reached():
            return
        self._forgotten.add(index)
        if not self.reached():
            self.clear(set_to_none=True)

    def _settle_forgotten(self) -> None:
        if not self._forgotten:
            return
        forgotten, self._forgotten = sorted(self._forgotten), set()
        self._settle_partial()
        with self._stored(writable=True) as buf:
            mine = self._fold_scale(buf)
            for i in forgotten:
                self._slot_of(mine, i).zero_()
        self._reached.difference_update(forgotten)

    def clamp_slot(self, index: int, lo: float | None, hi: float | None) -> None:
        """Parameter `index`'s gradient clamped elementwise to [lo, hi] (clip_grad_value_), in
        the stored bytes (the pending factor folded in first)."""
        self._settle_partial()
        with self._stored(writable=True) as buf:
            self._slot_of(self._fold_scale(buf), index).clamp_(min=lo, max=hi)

    def _fold_scale(self, buf: torch.Tensor) -> torch.Tensor:
        """The pending factor multiplied into the stored gradient `buf`, the norms forgotten;
        returns this rank's shard of it."""
        self.scaled(buf, inplace=True)
        self.scale = None
        self._norms = None
        return self._mine(buf)

    def _slot_of(self, mine: torch.Tensor, index: int) -> torch.Tensor:
        """Parameter `index`'s part of this rank's shard `mine` (empty where the shard has none)."""
        start, stop = self.layout.shard_range(self.ctx.rank)
        slot = self.layout.slots[index]
        lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, stop)
        return mine[lo - start:max(lo, hi) - start]

    def reached(self) -> frozenset[int]:
        """Parameters (by index) that have a gradient, as torch's `p.grad is not None`."""
        if self.empty:
            return frozenset()
        return frozenset(range(len(self.layout.slots))) - self.unreached()

    @property
    def _on_device(self) -> bool:
        """Early capture sums into a device buffer, not the stored gradient
        ([Note: early gradient capture]; in a layer-major step also where that buffer sums in a
        wider dtype than the compute dtype, see [Note: layer-major sums in the gradient's dtype])."""
        return (self.ctx.pm.copies.asynchronous or self.ctx.world_size > 1
                or self._sum_dtype() != self.ctx.compute_dtype)

    def can_capture(self, dtype: torch.dtype) -> bool:
        """Early capture applies now to a contribution of `dtype` (see [Note: early gradient capture])."""
        if self._on_device:
            return not self._refused and dtype == self.ctx.compute_dtype
        if self._held is not None:
            return dtype == self._held.dtype
        return dtype == self.handle.dtype and self.empty

    def _sum_dtype(self) -> torch.dtype:
        """The dtype of early capture's device buffer: the compute dtype, in which autograd would
        sum; in a layer-major step of several micro-batches, the stored gradient's where it is
        wider ([Note: layer-major sums in the gradient's dtype])."""
        compute = self.ctx.compute_dtype
        if self.ctx.schedule.sums_wide and self.handle.dtype.itemsize > compute.itemsize:
            return self.handle.dtype
        return compute

    def capture(self, index: int, g: torch.Tensor) -> bool:
        """Sum one contribution to parameter `index`'s gradient into this backward's sum, as
        autograd's input buffer would (the first one copied, later ones added, in arrival
        order); False when early capture does not apply (the caller passes `g` on)."""
        if not self.can_capture(g.dtype) or (self._held is None and not self._start_capture()):
            return False
        assert self._held is not None
        slot = self.layout.slots[index]
        view = self._held[slot.offset:slot.offset + slot.numel]
        self._reached.add(index)
        share = g.reshape(-1)
        if index in self._captured:
            view.add_(share.to(view.device))  # a no-op where the share is there already
        else:
            view.copy_(share)
            self._captured.add(index)
        return True

    def _start_capture(self) -> bool:
        """The first share of a backward: take where the shares are summed
        ([Note: early gradient capture])."""
        ctx, h = self.ctx, self.handle
        with torch.profiler.record_function(f"tierzero::capture_grad {h.owner}"):
            if not self._on_device:
                return self._hold_stored()
            dtype = self._sum_dtype()
            nbytes = self.layout.padded_numel * dtype.itemsize
            scratch = None
            if ctx.account.take_capture(nbytes):
                scratch = ctx.pm.scratch.reserve(nbytes, Tier.DEVICE, what=f"{h.name} (captured)", wait=False)
                if scratch is None:
                    ctx.account.capture_done(nbytes)
            if scratch is None:
                return self._capture_refused(dtype)
            self._scratch, self._held = scratch, scratch[:nbytes].view(dtype)
            return True

    def _hold_stored(self) -> bool:
        """Sum this backward's shares in the stored gradient itself, pinned from now until
        accumulate (overwritten: not zeroed, accumulate zeroes what no share reached)."""
        self._held = self.ctx.pm.acquire(self.handle, self.handle.staging, overwrite=True)
        return True

    def _capture_refused(self, dtype: torch.dtype) -> bool:
        """No device room for early capture's buffer: the shares go on to autograd (False). In a
        layer-major step that sums in a wider dtype, autograd would sum the micro-batches in the
        compute dtype ([Note: layer-major sums in the gradient's dtype]): on one rank, into a
        gradient nothing was stored in yet, the shares are summed in the stored gradient itself
        (each copied to its tier), the same bits; otherwise a warning says what differs."""
        ctx, h = self.ctx, self.handle
        if dtype == ctx.compute_dtype:
            self._refused = True
            return False
        if ctx.world_size == 1 and self.empty:
            return self._hold_stored()
        self._refused = True
        warnings.warn(f"tz.accumulate: no device room for {self.layout.padded_numel * dtype.itemsize} bytes to sum "
                      f"{h.owner}'s gradient over the micro-batches in {dtype}; autograd sums them in "
                      f"{ctx.compute_dtype} instead, not as the plain loop does (raise device_budget, or run "
                      "the plain loop)", RuntimeWarning, stacklevel=2)
        return False

    def drop_capture(self) -> None:
        """Forget contributions captured by a backward that never reached accumulate (it
        raised): the stored gradient is left as it was."""
        if self._scratch is not None:
            assert self._held is not None  # set together: the view of the room capture took
            self.ctx.pm.scratch.free(self._scratch, Tier.DEVICE)
            self.ctx.account.capture_done(self._held.nbytes)
        elif self._held is not None:
            self.ctx.pm.release(self.handle, self.handle.staging)
        self._held = self._scratch = None
        self._captured.clear()
        self._refused = False

    def accumulate(self, params: list[nn.Parameter]) -> None:
        """Move the parameters' .grad (and what early capture summed) into the shard;
        idempotent (no .grad, nothing captured: no-op)."""
        with torch._C.DisableTorchFunctionSubclass():  # autograd's .grad, never a GradView
            grads = [p.grad for p in params]
        if all(g is None for g in grads) and self._held is None:
            return
        self._settle_partial()
        self._settle_forgotten()
        with torch._C.DisableTorchFunctionSubclass():  # autograd's .grad: not model.zero_grad()'s
            for p in params:
                p.grad = None  # frees the device copy as soon as it is accumulated
        self._reached.update(i for i, g in enumerate(grads) if g is not None)
        with torch.profiler.record_function(f"tierzero::accumulate_grad {self.handle.owner}"):
            if self._held is not None and self._scratch is None:
                self._accumulate_held(grads)
            else:
                try:
                    self._accumulate_reduced(grads)
                finally:
                    self.drop_capture()
        self._refused = False
        self.empty = False

    def _fold(self, buf: torch.Tensor, grads: list[torch.Tensor | None]) -> None:
        """Early capture's sum in `buf` completed: what autograd still held added, the slots no
        share reached and the padding zeroed."""
        for i, (slot, g) in enumerate(zip(self.layout.slots, grads)):
            view = buf[slot.offset:slot.offset + slot.numel]
            if i in self._captured:
                if g is not None:
                    view.add_(g.reshape(-1).to(view.device))
            elif g is not None:
                view.copy_(g.reshape(-1))
            else:
                view.zero_()
        for lo, hi in self.layout.gaps():
            buf[lo:hi].zero_()

    def _accumulate_held(self, grads: list[torch.Tensor | None]) -> None:
        """Early capture into the stored gradient: fold in the rest, release it (once)."""
        buf, self._held = self._held, None
        assert buf is not None
        try:
            self._fold(buf, grads)
            self._written(buf)
        finally:
            self._captured.clear()
            self.ctx.pm.release(self.handle, self.handle.staging, dirty=True, lazy=True)

    def _accumulate_reduced(self, grads: list[torch.Tensor | None]) -> None:
        """This rank's part of every rank's gradient, reduced on the device, into the stored
        gradient: the first time in a step by an asynchronous device-to-host copy (written over
        whole), later times added to it."""
        ctx, h = self.ctx, self.handle
        streams = ctx.pm.copies
        buf = ctx.pm.acquire(h, h.staging, overwrite=self.empty)
        written = None
        try:
            if self._held is None and self.empty and self.layout.world_size == 1:
                written = self._write_straight(buf, grads)
                return
            if self._held is not None:
                self._fold(self._held, grads)
                full = self._held if self._held.dtype == buf.dtype else streams.to_device(self._held, buf.dtype)
            else:
                full = self.layout.flatten(grads, dtype=buf.dtype, out=streams.empty(self.layout.padded_numel,
                                                                                     buf.dtype))
            what = "all-reduce" if self.whole else "reduce-scatter"
            with rank_errors(ctx.rank, ctx.world_size, f"{what} of {h.name}"):
                if self.whole:
                    reduced = all_reduce_flat(full, self.layout, ctx.group, ctx.comm, streams)
                else:
                    reduced = reduce_scatter_flat(full, self.layout, ctx.group, ctx.comm, streams)
            if not self.empty:
                self.scaled(buf, inplace=True).add_(reduced.to(buf.device))
                self._written(buf)
            elif streams.is_device(buf):
                self._written(buf.copy_(reduced))
            else:
                self._written(reduced)  # the norms of the device copy: the bytes are the same
                written = streams.copy(buf, reduced, after=streams.compute_ready())
        finally:
            ctx.pm.release(h, h.staging, dirty=True, lazy=True, written=written)

    def _write_straight(self, buf: torch.Tensor, grads: list[torch.Tensor | None]) -> CopyEvent | None:
        """One rank, nothing captured (none taken, or its buffer refused), the stored gradient
        `buf` written over whole: each parameter's `.grad` straight into its slice, with no flat
        temporary. A flat one on the device would be device memory outside its budget, taken
        exactly when early capture found no room in it. To the host, one copy per parameter on
        the copy stream after compute: what CUDA's copy engine does with a gather list. Where
        the dtypes differ, CUDA converts each parameter on the device as it copies it (one
        parameter's temporary at a time, on the copy stream). The norms are taken from the
        `.grad` on the device before they leave. Returns the event of the last copy: a stream
        runs its copies in order."""
        streams = self.ctx.pm.copies
        if streams.is_device(buf):
            self._written(self.layout.flatten(grads, dtype=buf.dtype, out=buf))
            return None
        pairs = []
        for slot, g in zip(self.layout.slots, grads, strict=True):
            view = buf[slot.offset:slot.offset + slot.numel]
            if g is None:
                view.zero_()
            pairs.append((view, g))
        for lo, hi in self.layout.gaps():
            buf[lo:hi].zero_()
        self._written(buf, parts=[v if g is None else g.reshape(-1) for v, g in pairs])
        after = streams.compute_ready()
        event = None
        for view, g in pairs:
            if g is not None:
                event = streams.copy(view, g.reshape(-1), after=after)
        return event

    def _written(self, buf: torch.Tensor, *, parts: list[torch.Tensor] | None = None) -> None:
        """The stored gradient now holds `buf`'s values (or, at world size 1, is about to hold
        `parts`, each parameter's values, as they are copied in): no factor pending, norms
        taken now."""
        self.scale = None
        norm_type = self.ctx.clip_norm_type
        if norm_type is None:
            self._norms = None
        elif parts is None:
            self._norms = (norm_type, self.norms_of(self._mine(buf), norm_type))
        else:
            self._norms = (norm_type, [self._norm(p.to(buf.dtype), norm_type) for p in parts])

    def unreached(self) -> frozenset[int]:
        """Parameters (by index) without a gradient, which torch's optimizers and clipping skip
        (`p.grad is None`): on one rank those no gradient reached since zero_grad(set_to_none);
        with several ranks none (their stored zeros are the gradient, as DDP makes them); and
        those whose `p.grad` was set to None since (forget_slot)."""
        if self.layout.world_size > 1:
            return frozenset(self._forgotten)
        return frozenset(range(len(self.layout.slots))) - self._reached | self._forgotten

    def clear(self, *, set_to_none: bool = True) -> None:
        """Forget the gradient (set_to_none) or make it zeros (a parameter without a gradient
        keeps none, as torch's zero_grad(set_to_none=False) leaves its .grad None)."""
        self.drop_capture()
        if set_to_none:
            self._reached.clear()
        self.scale = None
        self._partial = None
        self._forgotten.clear()
        self._norms = None
        self.empty = set_to_none
        if set_to_none:
            self.ctx.pm.discard(self.handle)  # a dirty host copy is never written home
        else:
            with self._stored(overwrite=True) as buf:
                buf.zero_()

    def clear_slots(self, indices: Sequence[int], *, set_to_none: bool = True) -> None:
        """`clear` for parameters `indices` only (an optimizer's zero_grad, whose groups leave out
        the others: torch's leaves their `.grad`): their part zeroed, and forgotten (set_to_none)."""
        if set(indices) >= set(range(len(self.layout.slots))):
            self.clear(set_to_none=set_to_none)
            return
        if self.empty:
            return
        self._settle_partial()
        with self._stored(writable=True) as buf:
            mine = self._fold_scale(buf)
            for i in indices:
                self._slot_of(mine, i).zero_()
        if set_to_none:
            self._reached.difference_update(indices)

    def __repr__(self) -> str:
        return f"FlatGrad({self.handle.name!r}, empty={self.empty}, scaled={self.scale is not None})"


# [Note: early gradient capture]
# Early capture (`GradCapture`): each share of a parameter's gradient is summed into the stored
# gradient as autograd sends it (a post hook on the node that sends it), in the order autograd
# would sum it, so the bits are the same, and None goes on in its place: autograd neither buffers
# it nor sets `.grad`. Without it the root block (embedding, LM head, final norm), fetched before
# the first block and done after the last, has its gradients held by autograd from the LM head's
# backward to the end of backward (a tied embedding / LM head's share waits in autograd's input
# buffer for the embedding's: vocab x width x 4 bytes, 0.5 GB at 50k x 2560), and every block's
# `.grad` exist whole beside its stored gradient before the flattening: all outside the budgets.
# Where the shares are summed:
#
#     the stored gradient   synchronous CPU copies, one rank, gradients stored in the parameters'
#                           dtype, the first backward since zero_grad() (a second one adds to the
#                           stored sum, which autograd's order would not): acquired (overwrite) at
#                           the first share and held until the block's accumulate
#     a device buffer       wherever copies are asynchronous (CUDA, the stream stand-in) or there
#                           are several ranks: the whole flat gradient of this backward, in the
#                           parameters' dtype, reserved (device budget) at the first share when
#                           there is room now; at accumulate it is what the reduce-scatter (or
#                           all-reduce) reads and what the device-to-host copy takes to the
#                           stored gradient, exactly as the flattened `.grad` would be
#
# A share that arrives otherwise (a recompute in backward, no room for the buffer) is added at
# accumulate; on one rank with nothing captured, each parameter's `.grad` goes straight into its
# slice of the stored gradient, with no flat temporary on the device (`_write_straight`). The
# device-to-host copy of a gradient runs on the copy stream: backward goes on at once, and the
# stored gradient's readers wait for the copy's event (PlacementManager.release's `written`); its
# norms are taken on the device before it leaves.
class GradCapture:
    """Early capture for a wrapped model's trainable parameters ([Note: early gradient capture]):
    after each forward with autograd, a walk of the graph from the outputs finds every edge into one of
    those parameters' AccumulateGrad nodes and puts a post hook on the node that sends it; the
    hook gives the share to the parameter's FlatGrad (`capture`) and passes None on in its
    place."""

    def __init__(self, params: Sequence[tuple[nn.Parameter, FlatGrad, int]]) -> None:
        self._where = {id(p): (p, grad, i) for p, grad, i in params}
        """id(parameter) -> (the parameter, its FlatGrad, its index there)."""

    def install(self, outputs: Sequence[torch.Tensor]) -> None:
        """Hook the nodes that send gradients to the parameters, in the graph behind `outputs`."""
        if not self._where or not any(g.can_capture(p.dtype) for p, g, _ in self._where.values()):
            return
        seen: set[Any] = set()
        todo = [t.grad_fn for t in outputs if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            edges = []
            for j, (child, _) in enumerate(node.next_functions):
                if child is None:
                    continue
                variable = getattr(child, "variable", None)
                if variable is not None and id(variable) in self._where:
                    _, grad, i = self._where[id(variable)]
                    edges.append(_Edge(j, child, grad, i))
                elif child not in seen:
                    todo.append(child)
            if edges:
                node.register_hook(_capture_hook(edges))


def _accumulates(accumulate: Any) -> bool:
    """This backward runs the AccumulateGrad node `accumulate`: a .backward() that reaches it
    (the engine's answer, which torch's multi-grad hooks also ask); never torch.autograd.grad,
    which returns gradients instead (the engine refuses the question there)."""
    try:
        return torch._C._will_engine_execute_node(accumulate)
    except RuntimeError:  # "... currently running autograd.grad()"
        return False


class _Edge(NamedTuple):
    """Where a node sends a parameter's gradient: its output `position`, to `accumulate` (the
    parameter's AccumulateGrad node); the parameter is `index` in `grad`."""

    position: int
    accumulate: Any
    grad: FlatGrad
    index: int


def _capture_hook(edges: list[_Edge]) -> Any:
    """A node post hook: the gradients the node sends along `edges` go to the FlatGrads; None
    goes on in their place; only when this backward accumulates into the parameter (not for
    torch.autograd.grad, nor a backward(inputs=...) without it)."""
    def hook(grad_inputs: tuple[torch.Tensor | None, ...], grad_outputs: Any) -> tuple[Any, ...] | None:
        out = list(grad_inputs)
        taken = False
        for e in edges:
            g = out[e.position]
            if g is not None and _accumulates(e.accumulate) and e.grad.capture(e.index, g):
                out[e.position] = None
                taken = True
        return tuple(out) if taken else None
    return hook

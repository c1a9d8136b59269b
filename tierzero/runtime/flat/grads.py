"""`FlatGrad`: the gradient of one trainable flat tensor, and the one place a clip factor applies.

This rank's shard of the flat gradient, in `config.grad_dtype`, lives in the placement manager
on `config.grads` (at ZeRO stage 1 the whole flat gradient, of which readers see this rank's
shard). Early capture (capture.py) sums gradients into it as autograd sends them."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Sequence

import torch
from torch import nn

from tierzero.config import Tier
from tierzero.layout import FlatLayout
from tierzero.placement import CopyEvent, Kind, TensorHandle
from tierzero.runtime.flat.capture import CaptureSum
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
        self.capture = CaptureSum(self, self._reached.add)
        """Where early capture sums this backward's shares ([Note: early gradient capture])."""
        self.slots = SlotEdits(self)
        """Edits of single parameters' parts made through `p.grad` ([Note: gradients seen
        through p.grad])."""

    @contextlib.contextmanager
    def acquire(self, *, writable: bool = False) -> Iterator[torch.Tensor]:
        """This rank's shard as stored (its dtype, without the pending factor) on the tier the
        CPU works on it in (an update elsewhere holds it with `to_hold`)."""
        self.slots.settle()
        with self._stored(writable=writable) as buf:
            yield self.mine(buf)

    def to_hold(self, tier: Tier) -> tuple[TensorHandle, Tier]:
        """(handle, tier) for a caller that holds the stored gradient on `tier` beside other
        tensors in one PlacementManager.hold, released clean (as `acquire` alone does); `mine`
        of what it holds is this rank's shard."""
        self.slots.settle()
        return self.handle, tier

    def mine(self, buf: torch.Tensor) -> torch.Tensor:
        """This rank's shard of the stored gradient `buf` (all of it, but at stage 1)."""
        return buf[slice(*self.layout.shard_range(self.ctx.rank))] if self.whole else buf

    @contextlib.contextmanager
    def _stored(self, *, writable: bool = False, overwrite: bool = False) -> Iterator[torch.Tensor]:
        """The stored gradient (the whole one at stage 1); overwrite=True: the caller writes all
        of it, so the stored bytes are not read."""
        pm, tier = self.ctx.pm, self.handle.staging
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

    def prefetch(self) -> None:
        """Start reading the stored gradient toward the tier the CPU works on it in."""
        if not self.empty:
            self.ctx.pm.prefetch(self.handle, self.handle.staging)

    def scaled_pieces(self, g: torch.Tensor, bounds: Sequence[tuple[int, int]]) -> list[torch.Tensor]:
        """`scaled` of each slice [lo, hi) of `g` in `bounds` (an update's pieces), in fp32."""
        return [self.scaled(g[lo:hi]) for lo, hi in bounds]

    def scale_by(self, factor: torch.Tensor) -> None:
        self.slots.settle_partial()
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

    def _fold_scale(self, buf: torch.Tensor) -> torch.Tensor:
        """The pending factor multiplied into the stored gradient `buf`, the norms forgotten;
        returns this rank's shard of it."""
        self.scaled(buf, inplace=True)
        self.scale = None
        self._norms = None
        return self.mine(buf)

    def reached(self) -> frozenset[int]:
        """Parameters (by index) that have a gradient, as torch's `p.grad is not None`."""
        if self.empty:
            return frozenset()
        return frozenset(range(len(self.layout.slots))) - self.unreached()

    def accumulate(self, params: list[nn.Parameter]) -> None:
        """Move the parameters' .grad (and what early capture summed) into the shard;
        idempotent (no .grad, nothing captured: no-op)."""
        with torch._C.DisableTorchFunctionSubclass():  # autograd's .grad, never a GradView
            grads = [p.grad for p in params]
        capture = self.capture
        if all(g is None for g in grads) and capture.held is None:
            return
        self.slots.settle()
        with torch._C.DisableTorchFunctionSubclass():  # autograd's .grad: not model.zero_grad()'s
            for p in params:
                p.grad = None  # frees the device copy as soon as it is accumulated
        self._reached.update(i for i, g in enumerate(grads) if g is not None)
        with torch.profiler.record_function(f"tierzero::accumulate_grad {self.handle.owner}"):
            if capture.held is not None and capture.scratch is None:
                self._accumulate_held(grads)
            else:
                try:
                    self._accumulate_reduced(grads)
                finally:
                    capture.drop()
        self.empty = False

    def _accumulate_held(self, grads: list[torch.Tensor | None]) -> None:
        """Early capture into the stored gradient: fold in the rest, release it (once)."""
        try:
            self._written(self.capture.fold_held(grads))
        finally:
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
            held = self.capture.held
            if held is None and self.empty and self.layout.world_size == 1:
                written = self._write_straight(buf, grads)
                return
            if held is not None:
                self.capture.fold(held, grads)
                full = held if held.dtype == buf.dtype else streams.to_device(held, buf.dtype)
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
            self._norms = (norm_type, self.norms_of(self.mine(buf), norm_type))
        else:
            self._norms = (norm_type, [self._norm(p.to(buf.dtype), norm_type) for p in parts])

    def unreached(self) -> frozenset[int]:
        """Parameters (by index) without a gradient, which torch's optimizers and clipping skip
        (`p.grad is None`): on one rank those no gradient reached since zero_grad(set_to_none);
        with several ranks none (their stored zeros are the gradient, as DDP makes them); and
        those whose `p.grad` was set to None since (SlotEdits.forget)."""
        if self.layout.world_size > 1:
            return frozenset(self.slots.forgotten)
        return frozenset(range(len(self.layout.slots))) - self._reached | self.slots.forgotten

    def clear(self, *, set_to_none: bool = True) -> None:
        """Forget the gradient (set_to_none) or make it zeros (a parameter without a gradient
        keeps none, as torch's zero_grad(set_to_none=False) leaves its .grad None)."""
        self.capture.drop()
        if set_to_none:
            self._reached.clear()
        self.scale = None
        self.slots.clear()
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
        self.slots.settle_partial()
        self.slots.zero(indices)
        if set_to_none:
            self._reached.difference_update(indices)

    def __repr__(self) -> str:
        return f"FlatGrad({self.handle.name!r}, empty={self.empty}, scaled={self.scale is not None})"


class SlotEdits:
    """Edits of single parameters' parts of a flat gradient, as torch's code makes them through
    `p.grad` ([Note: gradients seen through p.grad] in grad_views.py): a factor some of its
    parameters have had but not yet every one, and gradients forgotten (`p.grad = None`) but
    not yet every one, both made in the stored bytes before the gradient is next read or added to."""

    def __init__(self, grad: FlatGrad) -> None:
        self._grad = grad
        self.partial: tuple[Any, set[int]] | None = None
        """A factor `scale` gave some parameters, not yet every one with a gradient: (the factor,
        those parameters by index)."""
        self.forgotten: set[int] = set()
        """Parameters whose `p.grad` was set to None (model.zero_grad()), not yet every one with a
        gradient: zeroed in the stored bytes before the gradient is next read or added to."""

    def scale(self, index: int, factor: torch.Tensor | float) -> None:
        """Parameter `index`'s gradient times `factor` (a CPU scalar tensor, or a number): torch's
        clipping multiplies each `p.grad` by one factor. Once every parameter with a gradient has
        had the same factor, it is the pending factor of the whole flat gradient, as
        tz.clip_grad_norm_ sets it; a factor given to some parameters only is multiplied into
        their stored bytes before the gradient is next read."""
        if self.partial is not None:
            given, indices = self.partial
            same = given is factor or (not isinstance(given, torch.Tensor) and given == factor)
            if not same or index in indices:
                self.settle_partial()
        if self.partial is None:
            self.partial = (factor, set())
        self.partial[1].add(index)
        if self.partial[1] >= self._grad.reached():
            self.partial = None
            self._grad.scale_by(torch.as_tensor(factor, dtype=torch.float32))

    def forget(self, index: int) -> None:
        """`p.grad = None` for parameter `index` (model.zero_grad()): its gradient forgotten, as
        torch forgets it; once every parameter with a gradient is, the whole gradient is cleared
        (FlatGrad.clear), else their parts are zeroed before the gradient is next read."""
        if index not in self._grad.reached():
            return
        self.forgotten.add(index)
        if not self._grad.reached():
            self._grad.clear(set_to_none=True)

    def clamp(self, index: int, lo: float | None, hi: float | None) -> None:
        """Parameter `index`'s gradient clamped elementwise to [lo, hi] (clip_grad_value_), in
        the stored bytes (the pending factor folded in first)."""
        self.settle_partial()
        self._edit([index], lambda part: part.clamp_(min=lo, max=hi))

    def zero(self, indices: Sequence[int]) -> None:
        """Parameters `indices`' parts of the stored gradient zeroed (the pending factor folded in)."""
        self._edit(indices, torch.Tensor.zero_)

    def settle_partial(self) -> None:
        """A factor that reached only some parameters: multiplied into their stored bytes."""
        if self.partial is None:
            return
        factor, indices = self.partial
        self.partial = None
        self._edit(sorted(indices), lambda part: part.mul_(factor))

    def settle(self) -> None:
        """Every edit pending made in the stored bytes: the factor, then the forgotten parts."""
        self.settle_partial()
        if not self.forgotten:
            return
        forgotten, self.forgotten = sorted(self.forgotten), set()
        self.zero(forgotten)
        self._grad._reached.difference_update(forgotten)

    def clear(self) -> None:
        self.partial = None
        self.forgotten.clear()

    def _edit(self, indices: Sequence[int], edit: Callable[[torch.Tensor], object]) -> None:
        """`edit` each of parameters `indices`' parts of this rank's shard, in the stored bytes."""
        grad = self._grad
        start, stop = grad.layout.shard_range(grad.ctx.rank)
        with grad._stored(writable=True) as buf:
            mine = grad._fold_scale(buf)
            for i in indices:
                slot = grad.layout.slots[i]
                lo, hi = max(slot.offset, start), min(slot.offset + slot.numel, stop)
                edit(mine[lo - start:max(lo, hi) - start])

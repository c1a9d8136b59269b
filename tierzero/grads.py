"""`FlatGrad`: the gradient of one trainable flat tensor, and the one place a clip factor applies.

This rank's shard of the flat gradient, in `config.grad_dtype`, lives in the placement manager
on `config.grads` (at ZeRO stage 1 the whole flat gradient, of which readers see this rank's
shard). Its life in a step:

    accumulate  after the block's backward, the parameters' .grad are flattened (and
                reduce-scattered, averaged, across ranks; all-reduced at stage 1) into the
                stored gradient, in its dtype: the first time in a step it is overwritten,
                later times (gradient accumulation) added to
    norms       with clipping on (StepContext.clip_norm_type, set by the first tz.clip_grad_norm_),
                each accumulate computes the shard's norms while the bytes are at hand, so
                clipping reads no gradient: they stand until the stored gradient changes
    scale       tz.clip_grad_norm_ records a factor without touching the stored bytes
    scaled      readers (the optimizer, the norm) see the gradient in fp32 times the pending
                factor; the next accumulate folds the factor into the stored bytes first
    clear       zero_grad(): forgotten (set_to_none) or zeros

`empty` is set_to_none's state: no gradient since the last zero_grad().
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch import nn

from tierzero.handles import Kind, TensorHandle
from tierzero.sharding import FlatLayout, all_reduce_flat, rank_errors, reduce_scatter_flat
from tierzero.step_context import StepContext


class FlatGrad:
    """The gradient shard of one trainable flat tensor (see the module docstring)."""

    def __init__(self, owner: str, layout: FlatLayout, ctx: StepContext) -> None:
        self.layout = layout
        self.ctx = ctx
        self.whole = ctx.zero.grads_whole
        """The whole flat gradient is kept (stage 1), not this rank's shard."""
        # Room only: nothing is read before the first accumulate overwrites it whole (or a
        # zero_grad(set_to_none=False) zeroes it), so no zeros are written to the tier at wrap.
        numel = layout.padded_numel if self.whole else layout.shard_numel
        self.handle: TensorHandle = ctx.register(owner, torch.empty(numel, device="meta"), ctx.grad_tier,
                                                 kind=Kind.GRAD, dtype=ctx.grad_dtype)
        self.empty = True
        self.scale: torch.Tensor | None = None
        """A factor (clip_grad_norm_) not yet applied to the stored gradient."""
        self._norms: tuple[float, list[torch.Tensor]] | None = None
        """(norm type, norms_of() of the stored gradient), computed as it was written."""

    @contextlib.contextmanager
    def acquire(self, *, writable: bool = False) -> Iterator[torch.Tensor]:
        """This rank's shard as stored (its dtype, without the pending factor) on the tier the
        CPU works on."""
        with self._stored(writable=writable) as buf:
            yield self._mine(buf)

    def _mine(self, buf: torch.Tensor) -> torch.Tensor:
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

    def prefetch(self, *, speculative: bool = False) -> None:
        if not self.empty:
            self.ctx.pm.prefetch(self.handle, self.handle.staging, speculative=speculative)

    def scaled(self, g: torch.Tensor, *, inplace: bool = False) -> torch.Tensor:
        """`g` (the stored gradient or a slice of it) times the pending factor: the one place
        the factor is applied. In fp32 (a copy of a bfloat16 gradient), unless `inplace`."""
        if not inplace and g.dtype != torch.float32:
            return g.float() if self.scale is None else g.float().mul_(self.scale)
        if self.scale is None:
            return g
        return g.mul_(self.scale) if inplace else g * self.scale

    def scale_by(self, factor: torch.Tensor) -> None:
        if not self.empty:
            self.scale = factor if self.scale is None else self.scale * factor
            self._norms = None  # of the unscaled bytes: clipping twice reads again

    def norms_of(self, g: torch.Tensor, norm_type: float) -> list[torch.Tensor]:
        """The norms clip_grad_norm_ combines, of `g` (the stored shard) times the pending
        factor: at world size 1 one per parameter, as torch.nn.utils.clip_grad_norm_ computes
        them (the same bits); with several ranks one of the whole shard (padding is zeros)."""
        if self.layout.world_size == 1:
            return [torch.linalg.vector_norm(self.scaled(g[s.offset:s.offset + s.numel]), norm_type)
                    for s in self.layout.slots]
        return [torch.linalg.vector_norm(self.scaled(g), norm_type)]

    def has_norms(self, norm_type: float) -> bool:
        return self._norms is not None and self._norms[0] == norm_type

    def norms(self, norm_type: float) -> list[torch.Tensor]:
        """norms_of() the stored gradient: as computed in backward, or read now."""
        if self._norms is not None and self.has_norms(norm_type):
            return self._norms[1]
        with self.acquire() as g:
            return self.norms_of(g, norm_type)

    def accumulate(self, params: list[nn.Parameter]) -> None:
        """Move the parameters' .grad into the shard; idempotent (no .grad: no-op)."""
        grads = [p.grad for p in params]
        if all(g is None for g in grads):
            return
        for p in params:
            p.grad = None  # frees the device copy as soon as it is accumulated
        ctx = self.ctx
        with torch.profiler.record_function(f"tierzero::accumulate_grad {self.handle.owner}"), \
                self._stored(writable=True, overwrite=self.empty) as buf:
            if self.empty and self.layout.world_size == 1 and buf.device == ctx.device:
                # No collective and no copy between devices: flatten straight into the
                # gradient, without a block-sized temporary.
                self.layout.flatten(grads, dtype=buf.dtype, out=buf)
            else:
                full = self.layout.flatten(grads, dtype=buf.dtype, device=ctx.device)
                what = "all-reduce" if self.whole else "reduce-scatter"
                with rank_errors(ctx.rank, ctx.world_size, f"{what} of {self.handle.name}"):
                    if self.whole:
                        reduced = all_reduce_flat(full, self.layout, ctx.group, ctx.comm)
                    else:
                        reduced = reduce_scatter_flat(full, self.layout, ctx.group, ctx.comm)
                if self.empty:
                    buf.copy_(reduced)
                else:
                    self.scaled(buf, inplace=True).add_(reduced.to(buf.device))
            self.scale = None
            norm_type = ctx.clip_norm_type
            self._norms = None if norm_type is None else (norm_type, self.norms_of(self._mine(buf), norm_type))
        self.empty = False

    def clear(self, *, set_to_none: bool = True) -> None:
        """Forget the gradient (set_to_none) or make it zeros."""
        self.scale = None
        self._norms = None
        self.empty = set_to_none
        if set_to_none:
            self.ctx.pm.discard(self.handle)  # a dirty host copy is never written home
        else:
            with self._stored(overwrite=True) as buf:
                buf.zero_()

    def __repr__(self) -> str:
        return f"FlatGrad({self.handle.name!r}, empty={self.empty}, scaled={self.scale is not None})"

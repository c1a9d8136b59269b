"""`FlatGrad`: the gradient of one trainable flat tensor, and the one place a clip factor applies.

This rank's shard of the flat gradient, in `config.grad_dtype`, lives in the placement manager
on `config.grads` (at ZeRO stage 1 the whole flat gradient, of which readers see this rank's
shard). Its life in a step:

    accumulate  after the block's backward, the parameters' .grad are flattened (and
                reduce-scattered, averaged, across ranks; all-reduced at stage 1) into the
                stored gradient, in its dtype: the first time in a step it is overwritten,
                later times (gradient accumulation) added to
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

    @contextlib.contextmanager
    def acquire(self, *, writable: bool = False) -> Iterator[torch.Tensor]:
        """This rank's shard as stored (its dtype, without the pending factor) on the tier the
        CPU works on."""
        with self._stored(writable) as buf:
            yield buf[slice(*self.layout.shard_range(self.ctx.rank))] if self.whole else buf

    @contextlib.contextmanager
    def _stored(self, writable: bool) -> Iterator[torch.Tensor]:
        """The stored gradient (the whole one at stage 1)."""
        pm, tier = self.ctx.pm, self.handle.staging
        buf = pm.acquire(self.handle, tier)
        try:
            yield buf
        finally:
            pm.release(self.handle, tier, dirty=writable)

    def prefetch(self) -> None:
        self.ctx.pm.prefetch(self.handle, self.handle.staging)

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

    def accumulate(self, params: list[nn.Parameter]) -> None:
        """Move the parameters' .grad into the shard; idempotent (no .grad: no-op)."""
        grads = [p.grad for p in params]
        if all(g is None for g in grads):
            return
        for p in params:
            p.grad = None  # frees the device copy as soon as it is accumulated
        ctx = self.ctx
        with torch.profiler.record_function(f"tierzero::accumulate_grad {self.handle.owner}"), \
                self._stored(writable=True) as buf:
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
        self.empty = False

    def clear(self, *, set_to_none: bool = True) -> None:
        """Forget the gradient (set_to_none) or make it zeros."""
        self.scale = None
        self.empty = set_to_none
        if not set_to_none:
            with self._stored(writable=True) as buf:
                buf.zero_()

    def __repr__(self) -> str:
        return f"FlatGrad({self.handle.name!r}, empty={self.empty}, scaled={self.scale is not None})"

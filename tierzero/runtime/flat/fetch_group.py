"""`FetchGroup`: the device copies and collectives of one block's flat tensors, issued together.

How a block is fetched: the comment above `FetchGroup`.

The fetch of each flat tensor is gathers.py's (plain functions, below the flat tensors).

Gradients go the other way once per block: `reduce_grads()` moves each trainable flat
tensor's parameter gradients into its FlatGrad (reduce-scattered across ranks; all-reduced at
stage 1).
"""

from __future__ import annotations

import contextlib
from typing import Sequence

import torch

from tierzero.runtime.flat.collectives import agree_all, rank_errors
from tierzero.runtime.flat.flat_param import FlatParam
from tierzero.runtime.flat.gathers import discard_gather, drop_gather, finish_gather, start_gather
from tierzero.runtime.step.step_context import PendingGather, StepContext


# A block has one or two flat tensors (its trainable parameters, its frozen ones). The group
# brings them to the device as one: for each, this rank's shard is acquired on the device tier
# (the placement manager's copy stream, from host or NVMe); at world size N > 1 a scratch buffer
# for the full tensor is reserved on the device tier and the all-gather of every rank's shard
# into it starts (async); at stages 1 and 2 every rank keeps the whole tensor, which is fetched
# as at world size 1. Every flat tensor of the block is started before any is waited for, so
# the collectives of a block are in flight together. An all-gather the prefetcher starts ahead
# waits in the StepContext (a `PendingGather` record) until its block's fetch takes it; a release
# frees the scratch buffer or, when the same block is fetched next (the last block: forward, then
# its backward), parks the finished gather for that fetch. At world size 1 the shard is the whole
# tensor, the fetched copy is the shard's device copy, and no collective runs (so at stages 1
# and 2, with the whole tensor on every rank).
class FetchGroup:
    """One block's flat tensors, fetched, released and reduced together (see the comment above)."""

    def __init__(self, name: str, flats: list[FlatParam], ctx: StepContext) -> None:
        self.name = name
        self.flats = flats
        self.ctx = ctx
        self._fetched: list[PendingGather] | None = None
        """The finished fetches whose memory the flat tensors view, while fetched."""

    def gather_ahead(self) -> None:
        """Start the all-gathers of the block (stage 3, world size > 1) unless fetched or started."""
        ctx = self.ctx
        assert ctx.zero.gathers, self.name
        with torch.profiler.record_function(f"tierzero::gather_ahead {self.name}"):
            for flat in self.flats:
                if flat.is_free and flat not in ctx.gathers:
                    ctx.gathers.put(flat, start_gather(ctx, flat))

    def fetch(self) -> None:
        """Every flat tensor FREE -> HELD on its full tensor, gathered ahead or now. On failure
        nothing stays held or reserved."""
        assert self._fetched is None, self.name
        ctx = self.ctx
        pending: list[PendingGather] = []
        finished = 0
        try:
            for flat in self.flats:
                ahead = ctx.gathers.take(flat)
                if ctx.zero.gathers:
                    ctx.gathers.count(ahead=ahead is not None)
                pending.append(ahead or start_gather(ctx, flat))
            for flat, p in zip(self.flats, pending):
                finish_gather(ctx, flat, p)
                finished += 1
                flat.views.install(p.full)
        except BaseException:
            self._abandon(pending, finished)
            raise
        self._fetched = pending

    def _abandon(self, pending: list[PendingGather], finished: int) -> None:
        """Undo a failed fetch: the first `finished` gathers were waited for (and installed)."""
        for i, (flat, p) in enumerate(zip(self.flats, pending)):
            flat.views.uninstall()
            try:
                if i >= finished:
                    with contextlib.suppress(Exception):  # the first error is the one raised
                        finish_gather(self.ctx, flat, p)
            finally:
                drop_gather(self.ctx, flat, p)

    def free(self, *, keep_gathered: bool = False) -> None:
        """Every flat tensor HELD -> FREE; keep_gathered: the gathered copies (stage 3, world size > 1)
        wait in the context for the next fetch instead of being freed."""
        assert self._fetched is not None, self.name
        for flat, p in zip(self.flats, self._fetched):
            flat.views.uninstall()
            if keep_gathered:
                assert p.scratch is not None, flat.name
                self.ctx.gathers.put(flat, p._replace(work=None))  # done; its shard is released
            else:
                drop_gather(self.ctx, flat, p)
        self._fetched = None

    def reduce_grads(self) -> None:
        """Move the parameters' .grad of each trainable flat tensor into its gradient shard."""
        for flat in self.flats:
            if flat.grad is not None:
                flat.grad.accumulate(flat.params)

    def __repr__(self) -> str:
        return f"FetchGroup({self.name!r}, {len(self.flats)} flat tensors, fetched={self._fetched is not None})"


def gather_ahead(ctx: StepContext, groups: list[FetchGroup], every: Sequence[FetchGroup] = ()) -> None:
    """The prefetcher's choice when blocks are gathered (stage 3, world size > 1): start the
    all-gathers of `groups`; of those started earlier for blocks neither chosen now nor held,
    keep the ones that fit the device room left beside the chosen blocks, in the order they were
    started, and drop the rest (so what is in flight always fits the room the choice was made
    in, and a block the lookahead reached earlier, as it does across the turn from forward to
    backward, is not gathered twice). `every`: all the model's groups, in one order on every
    rank; given (and an agreement group made), the choice is agreed across ranks first, so that
    every rank starts the same all-gathers in the same order ([Note: gathers ahead agreed across
    ranks] in collectives.py)."""
    chosen = {g.name for g in groups}
    keep = chosen | set(ctx.account.held)
    room = ctx.account.free_bytes() - sum(f.nbytes for g in groups for f in g.flats)
    kept = set()
    for flat in ctx.gathers.flats():
        if flat.name in keep:
            kept.add(flat)
        elif flat.nbytes <= room:
            room -= flat.nbytes
            kept.add(flat)
    if every and ctx.agree_group is not None:
        flats = [f for g in every for f in g.flats]
        with rank_errors(ctx.rank, ctx.world_size, "the agreement on the all-gathers to start ahead"):
            agreed = agree_all([g.name in chosen for g in every] + [f in kept for f in flats], ctx.agree_group)
        chosen = {g.name for g, yes in zip(every, agreed) if yes}
        kept = {f for f, yes in zip(flats, agreed[len(every):]) if yes}
        groups = _trace_order([g for g in every if g.name in chosen], ctx)
    for flat in ctx.gathers.flats():
        if flat not in kept:
            discard_gather(ctx, flat)
    for group in groups:
        if group.name in chosen:
            group.gather_ahead()


def _trace_order(groups: list[FetchGroup], ctx: StepContext) -> list[FetchGroup]:
    """`groups` nearest first in the trace the prefetcher follows (the same on every rank)."""
    upcoming = ctx.prefetcher.next_units(1 << 30) if ctx.prefetcher is not None else ()
    at = {}
    for i, name in enumerate(upcoming):
        at.setdefault(name, i)
    return sorted(groups, key=lambda g: at.get(g.name, len(upcoming)))


def discard_gathers(ctx: StepContext) -> None:
    """Drop every all-gather started ahead (a new iteration starts from a clean slate)."""
    for flat in ctx.gathers.flats():
        discard_gather(ctx, flat)

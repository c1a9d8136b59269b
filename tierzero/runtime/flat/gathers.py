"""One flat tensor's fetch to the device: its shard's device copy and, across ranks at stage 3,
the all-gather of every rank's shard into a scratch buffer (a `PendingGather` record).

Plain module-level functions over the context (tests patch them), below the flat tensors:
they know a flat tensor by `FlatRef`. FetchGroup (fetch_group.py) issues them for a block; a
flat tensor drops a stale all-gather started ahead when its values change (`discard_gather`).
"""

from __future__ import annotations

import torch

from tierzero.config import Tier
from tierzero.runtime.flat.collectives import rank_errors, start_all_gather
from tierzero.runtime.step.step_context import FlatRef, PendingGather, StepContext


def start_gather(ctx: StepContext, flat: FlatRef) -> PendingGather:
    """Acquire the shard on the device and, across ranks, start its all-gather."""
    shard = ctx.pm.acquire(flat.param, Tier.DEVICE)
    if not ctx.zero.gathers:
        return PendingGather(shard, None, None)
    nbytes = flat.layout.padded_numel * ctx.compute_dtype.itemsize
    try:
        scratch = ctx.pm.scratch.reserve(nbytes, Tier.DEVICE, what=f"{flat.param.name} (gathered)")
    except BaseException:
        ctx.pm.release(flat.param, Tier.DEVICE)
        raise
    full = scratch[:nbytes].view(ctx.compute_dtype)
    try:
        with torch.profiler.record_function(f"tierzero::all_gather {flat.name}"), \
                rank_errors(ctx.rank, ctx.world_size, f"all-gather of {flat.param.name}"):
            work = start_all_gather(shard, full, ctx.group, ctx.comm, ctx.pm.copies)
    except BaseException:
        ctx.pm.scratch.free(scratch, Tier.DEVICE)
        ctx.pm.release(flat.param, Tier.DEVICE)
        raise
    return PendingGather(full, work, scratch)


def finish_gather(ctx: StepContext, flat: FlatRef, pending: PendingGather) -> None:
    """Wait for the all-gather; the shard's device copy is then no longer needed (it stays
    cached, evictable)."""
    if pending.work is None:
        return
    try:
        with torch.profiler.record_function(f"tierzero::wait_all_gather {flat.name}"), \
                rank_errors(ctx.rank, ctx.world_size, f"all-gather of {flat.param.name}"):
            pending.work.wait()
    finally:
        ctx.pm.release(flat.param, Tier.DEVICE)


def drop_gather(ctx: StepContext, flat: FlatRef, pending: PendingGather) -> None:
    """Give back the device memory of a finished fetch."""
    if pending.scratch is None:
        ctx.pm.release(flat.param, Tier.DEVICE)
    else:
        ctx.pm.scratch.free(pending.scratch, Tier.DEVICE)


def discard_gather(ctx: StepContext, flat: FlatRef) -> None:
    """Forget an all-gather started ahead (its values are stale once the shard is written)."""
    pending = ctx.gathers.take(flat)
    if pending is not None:
        finish_gather(ctx, flat, pending)
        drop_gather(ctx, flat, pending)

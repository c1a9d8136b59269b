"""Resharding: which elements of which saved shards make a rank's shard under a new layout.

A flat tensor saved by N ranks is N shards of one flat buffer (`FlatLayout`: parameters at
offsets, padded to a multiple of N). Loading it on M ranks, or with another padding or
alignment, rank r needs the elements of its new shard: for each parameter, the piece of it
inside [r's start, r's end) under the new layout is found at the parameter's offset under the
saved layout, and that saved range is cut at the saved shards' boundaries into `ReadOp`s.
Everything here is pure (layouts and ints in, ops out): the IO that follows the ops is the
checkpoint reader's (tierzero.ckpt_io).

An int8 optimizer state is resharded block by block instead (`block_reshard_plan`): each rank's
shard starts on a block ([Note: shards on int8 blocks] in tierzero/layout/flat_layout.py), so a
block's codes and scale move whole, from the saved rank that holds it to the new one.
"""

from __future__ import annotations

from typing import Iterator, NamedTuple

from tierzero.config import QUANT_BLOCK, SCALE_BYTES, quant_blocks
from tierzero.layout import FlatLayout


class ReadOp(NamedTuple):
    """Copy `count` elements from `src_start` of rank `src_rank`'s saved shard to `dst_start`."""

    src_rank: int
    src_start: int
    dst_start: int
    count: int


def range_ops(layout: FlatLayout, start: int, count: int, dst_start: int) -> Iterator[ReadOp]:
    """Ops reading elements [start, start + count) of `layout`'s flat buffer from its shards."""
    while count:
        r = start // layout.shard_numel
        r_start, r_end = layout.shard_range(r)
        take = min(count, r_end - start)
        yield ReadOp(r, start - r_start, dst_start, take)
        start, dst_start, count = start + take, dst_start + take, count - take


def reshard_plan(saved: FlatLayout, new: FlatLayout, rank: int) -> list[ReadOp]:
    """Which elements of which saved shards make `rank`'s shard of `new` (a pure function).

    The layouts must hold the same parameters (names, shapes) in the same order; their world
    sizes, padding and alignment may differ. Elements of the new shard that are padding are
    in no op (the caller zeroes them). Adjacent ops are merged."""
    saved_params = [(s.fqn, tuple(s.shape)) for s in saved.slots]
    new_params = [(s.fqn, tuple(s.shape)) for s in new.slots]
    if saved_params != new_params:
        raise ValueError(f"reshard_plan: the layouts hold different parameters: saved "
                         f"{saved_params[:4]}..., new {new_params[:4]}...")
    a, b = new.shard_range(rank)
    if (saved.world_size, saved.padded_numel, tuple(s.offset for s in saved.slots)) == \
            (new.world_size, new.padded_numel, tuple(s.offset for s in new.slots)):
        return [ReadOp(rank, 0, 0, b - a)]  # the same layout: the rank's own shard, whole
    ops: list[ReadOp] = []
    for old, cur in zip(saved.slots, new.slots):
        lo, hi = max(a, cur.offset), min(b, cur.offset + cur.numel)
        if lo >= hi:
            continue
        for op in range_ops(saved, old.offset + lo - cur.offset, hi - lo, lo - a):
            last = ops[-1] if ops else None
            if (last is not None and last.src_rank == op.src_rank and last.src_start + last.count == op.src_start
                    and last.dst_start + last.count == op.dst_start):
                ops[-1] = last._replace(count=last.count + op.count)
            else:
                ops.append(op)
    return ops


def on_blocks(layout: FlatLayout) -> bool:
    """Whether every shard of `layout` starts on a multiple of QUANT_BLOCK of the flat index (so
    its int8 states' blocks are the flat tensor's, whatever the world size)."""
    return layout.world_size == 1 or layout.shard_numel % QUANT_BLOCK == 0


def block_reshard_plan(saved: FlatLayout, new: FlatLayout, rank: int) -> list[ReadOp] | None:
    """Which bytes of which saved shards make `rank`'s shard of an int8 state under `new` (a pure
    function), or None where blocks do not carry over: the layouts place the parameters at other
    offsets, or a shard of either starts inside a block (checkpoints of 2+ ranks saved before
    shards started on blocks). A stored int8 shard is its blocks' codes (QUANT_BLOCK bytes each)
    then their fp32 scales; blocks past the saved buffer's end are in no op (zeros: decoded, 0)."""
    if (tuple(s.offset for s in saved.slots) != tuple(s.offset for s in new.slots)
            or not on_blocks(saved) or not on_blocks(new)):
        return None
    per_saved, per_new = quant_blocks(saved.shard_numel), quant_blocks(new.shard_numel)
    first = new.shard_range(rank)[0] // QUANT_BLOCK
    stop = min(first + per_new, saved.world_size * per_saved)
    codes, scales = [], []
    k = first
    while k < stop:
        r, at = divmod(k, per_saved)
        take = min(stop - k, per_saved - at)
        codes.append(ReadOp(r, at * QUANT_BLOCK, (k - first) * QUANT_BLOCK, take * QUANT_BLOCK))
        scales.append(ReadOp(r, per_saved * QUANT_BLOCK + at * SCALE_BYTES,
                             per_new * QUANT_BLOCK + (k - first) * SCALE_BYTES, take * SCALE_BYTES))
        k += take
    return codes + scales

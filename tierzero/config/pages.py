"""The page the tiers' allocators and the NVMe extents round every buffer up to, and the room one
region needs to always find a window for a working set: the rules `tierzero.placement` allocates
by and `tierzero.layout`'s plan counts by, written once. No torch here."""

from __future__ import annotations

from typing import Sequence

from io_engine import PAGE


def round_up(nbytes: int, multiple: int = PAGE) -> int:
    """The bytes a buffer of `nbytes` takes from a tier's budget (whole pages)."""
    return -(-nbytes // multiple) * multiple


def windowed_bytes(sizes: Sequence[int]) -> int:
    """Bytes of one region in which buffers of `sizes`, taken one at a time and held together,
    always find a window, wherever the ones taken first were cut (PinnedArena.bytes_for, and the
    plan's host room where the host tier is one pinned region). See [Note: working set
    windows] in tierzero/placement/storage/tiers.py."""
    pages = sorted(round_up(max(n, 1)) for n in sizes)
    if not pages:
        return 0
    *rest, last = pages
    return sum(rest) + (len(rest) + 1) * (last - PAGE) + PAGE


__all__ = ["PAGE", "round_up", "windowed_bytes"]

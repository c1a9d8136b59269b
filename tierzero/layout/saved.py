"""How the tensors autograd saves in one block call pack into one buffer of bytes.

Several saved tensors often view one storage (q, k and v of one projection; a tensor and its
transpose), so the pack holds one *segment* per storage: the bytes from the first to the last
byte any of its saved tensors reaches. Each saved tensor is then rebuilt as a view into its
segment with its own dtype, size, stride and offset, so backward sees the same strides (kernels
choose their path, and so their rounding, by layout) and the same aliasing as in forward. A
segment starts at the same address modulo `SEGMENT_ALIGN` as the bytes it copies did, because
some kernels' results depend on alignment (the pack's buffer itself is page-aligned).

Arithmetic over tensor geometry only: the runtime packs with it (tierzero/runtime/activations.py)
and planning sizes a model's activations with it without running it for real.
"""

from __future__ import annotations

from typing import Hashable, NamedTuple, Sequence

import torch

SEGMENT_ALIGN = 64
"""Bytes: the alignment CPU allocators give storages (CUDA's 256 and 512 are multiples of it)."""


class SavedSpan(NamedTuple):
    """The bytes of its storage one saved tensor reaches: [first, end)."""

    first: int
    end: int


class SavedGeometry(NamedTuple):
    """Where one saved tensor lies in its storage (`storage`, a key; `address`: where the
    storage's byte 0 is): what `PackLayout.add_all` needs of it."""

    storage: Hashable
    address: int
    offset: int
    """In elements, as Tensor.storage_offset()."""
    itemsize: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]


def _span(offset: int, itemsize: int, shape: Sequence[int], stride: Sequence[int]) -> SavedSpan:
    first = offset * itemsize
    if 0 in shape:
        return SavedSpan(first, first)
    extent = sum((s - 1) * st for s, st in zip(shape, stride)) + 1
    return SavedSpan(first, first + extent * itemsize)


def saved_span(t: torch.Tensor) -> SavedSpan:
    """The span of `t`'s storage that `t` reaches (empty for a tensor without elements)."""
    return _span(t.storage_offset(), t.element_size(), t.shape, t.stride())


class Segment(NamedTuple):
    """One storage's saved bytes [start, end) in a pack, at byte `offset` of the pack."""

    start: int
    end: int
    phase: int
    """The address of `start` modulo SEGMENT_ALIGN, which the pack keeps."""
    offset: int = -1

    @property
    def nbytes(self) -> int:
        return self.end - self.start


class PackLayout:
    """Segments of one pack, gathered as tensors are saved (`add`), then placed (`finish`)."""

    def __init__(self) -> None:
        self._index: dict[Hashable, int] = {}
        self.segments: list[Segment] = []
        self.nbytes = 0
        """The pack's bytes once finished."""

    def add(self, storage: Hashable, address: int, span: SavedSpan) -> int:
        """The segment of `storage` (a key; `address`: where the storage's byte 0 is) grown to
        hold `span`; its index."""
        i = self._index.get(storage)
        if i is None:
            self._index[storage] = i = len(self.segments)
            self.segments.append(Segment(span.first, span.end, (address + span.first) % SEGMENT_ALIGN))
            return i
        seg = self.segments[i]
        start = min(seg.start, span.first)
        phase = seg.phase if start == seg.start else (address + start) % SEGMENT_ALIGN
        self.segments[i] = Segment(start, max(seg.end, span.end), phase)
        return i

    def add_all(self, saved: Sequence[SavedGeometry]) -> list[tuple[int, SavedSpan]]:
        """`add` of each saved tensor's span, in order; (its segment's index, its span) for each."""
        out = []
        for g in saved:
            span = _span(g.offset, g.itemsize, g.shape, g.stride)
            out.append((self.add(g.storage, g.address, span), span))
        return out

    def finish(self) -> int:
        """Give each segment its offset in the pack (its phase kept); the pack's bytes."""
        offset = 0
        for i, seg in enumerate(self.segments):
            offset += (seg.phase - offset) % SEGMENT_ALIGN
            self.segments[i] = seg._replace(offset=offset)
            offset += seg.nbytes
        self.nbytes = offset
        return offset

    def byte_offset(self, segment: int, span: SavedSpan) -> int:
        """Where in the pack (after `finish`) the bytes of `span` of that segment's storage start."""
        seg = self.segments[segment]
        return seg.offset + span.first - seg.start

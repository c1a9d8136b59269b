"""The NVMe tier: swap files of one rank, an extent allocator, checksummed IO through io_engine.

Layout: this run's locked folder nvme_dir/rank{r}/run-<time>-<pid>-<random>/ holds its chunk
files (tierzero/placement/storage/swap_dirs.py: two runs or two ranks never share a file, and what a
killed run left is reclaimed safely by the next). Space grows in preallocated
chunk files (CHUNK_BYTES, or one tensor's size if larger, or half the disk's free space if
less) up to the NVMe budget;
extents are 4 KiB aligned, allocated first-fit and coalesced on free. A tensor takes one extent
when a hole fits it, else pieces of the largest holes (a `SwapRegion`), so free space left in
the tails of chunk files is never lost to fragmentation. All IO goes through
io_engine (O_DIRECT when possible) from page-aligned host buffers; with checksums on, every
write records the xxh3 of the bytes written and every read verifies it. A region may have a
checkpoint's files as its bytes until its first write (`borrow`/`adopt`: see the note
[Note: copy-on-write home] in tierzero/placement/storage/cow_home.py).
"""

from __future__ import annotations

import bisect
import os
from typing import NamedTuple

import numpy as np

from io_engine import IOEngine, IOFuture, PreallocatedFile, free_disk_bytes
from tierzero.config import IOConfig
from tierzero.placement.storage.cow_home import CheckpointFiles, CheckpointHome, Segment
from tierzero.placement.storage.swap_dirs import FILE_MODE, RunFolder
from tierzero.placement.telemetry import Telemetry
from tierzero.placement.storage.tiers import ALIGNMENT, Budget, round_up

CHUNK_BYTES = 1 << 30
"""Swap space is added in files of this size (or one extent's size, when larger)."""


class ChecksumError(OSError):
    """Bytes read back from a swap file differ from the bytes written there."""


class Extent(NamedTuple):
    """A 4 KiB-aligned byte range of one chunk file."""

    chunk: int
    offset: int
    length: int


def write_extent(engine: IOEngine, file: PreallocatedFile, buf: np.ndarray, offset: int, *,
                 checksum: bool) -> IOFuture:
    """The one place swap bytes are written (module level so tests can patch it)."""
    return engine.pwrite(file, buf, offset, checksum=checksum)


def read_extent(engine: IOEngine, file: PreallocatedFile, buf: np.ndarray, offset: int, *,
                checksum: bool) -> IOFuture:
    """The one place swap bytes are read (module level so tests can patch it)."""
    return engine.pread(file, buf, offset, checksum=checksum)


class SwapRegion(NamedTuple):
    """Where one tensor's bytes live in the swap files: usually one extent, sometimes pieces."""

    extents: tuple[Extent, ...]
    length: int


class ExtentAllocator:
    """First-fit allocation of aligned extents over a set of chunks, coalescing on free.

    Pure bookkeeping (no IO): per chunk a sorted list of free (offset, length) holes.
    """

    def __init__(self, alignment: int = ALIGNMENT) -> None:
        self.alignment = alignment
        self._sizes: dict[int, int] = {}
        self._holes: dict[int, list[tuple[int, int]]] = {}
        self._next_chunk = 0
        self.used_bytes = 0

    @property
    def capacity(self) -> int:
        return sum(self._sizes.values())

    def chunks(self) -> dict[int, int]:
        return dict(self._sizes)

    def add_chunk(self, size: int) -> int:
        assert size > 0 and size % self.alignment == 0, size
        chunk = self._next_chunk
        self._next_chunk += 1
        self._sizes[chunk] = size
        self._holes[chunk] = [(0, size)]
        return chunk

    def remove_chunk(self, chunk: int) -> None:
        assert self.is_empty(chunk), f"chunk {chunk} still holds extents"
        del self._sizes[chunk], self._holes[chunk]

    def is_empty(self, chunk: int) -> bool:
        return self._holes[chunk] == [(0, self._sizes[chunk])]

    def alloc(self, nbytes: int) -> Extent | None:
        """The first hole that fits `nbytes` (rounded up to the alignment), or None."""
        length = round_up(max(nbytes, 1), self.alignment)
        for chunk, holes in self._holes.items():
            for i, (off, size) in enumerate(holes):
                if size >= length:
                    return self._take(chunk, i, length)
        return None

    def alloc_largest(self, max_bytes: int) -> Extent | None:
        """Up to `max_bytes` (aligned) from the start of the largest hole, or None when full."""
        best = max(((size, chunk, i) for chunk, holes in self._holes.items()
                    for i, (_, size) in enumerate(holes)), default=None)
        if best is None:
            return None
        size, chunk, i = best
        return self._take(chunk, i, min(size, round_up(max_bytes, self.alignment)))

    @property
    def free_bytes(self) -> int:
        return self.capacity - self.used_bytes

    def _take(self, chunk: int, i: int, length: int) -> Extent:
        holes = self._holes[chunk]
        off, size = holes[i]
        if size == length:
            del holes[i]
        else:
            holes[i] = (off + length, size - length)
        self.used_bytes += length
        return Extent(chunk, off, length)

    def free(self, ext: Extent) -> None:
        holes = self._holes[ext.chunk]
        i = bisect.bisect_left(holes, (ext.offset, 0))
        assert i == len(holes) or holes[i][0] >= ext.offset + ext.length, f"double free of {ext}"
        assert i == 0 or sum(holes[i - 1]) <= ext.offset, f"double free of {ext}"
        start, end = ext.offset, ext.offset + ext.length
        if i < len(holes) and holes[i][0] == end:  # merge with the hole after
            end = sum(holes.pop(i))
        if i > 0 and sum(holes[i - 1]) == start:  # merge with the hole before
            i -= 1
            start = holes.pop(i)[0]
        holes.insert(i, (start, end - start))
        self.used_bytes -= ext.length

    def __repr__(self) -> str:
        return f"ExtentAllocator(chunks={len(self._sizes)}, used={self.used_bytes}, capacity={self.capacity})"


class SwapSpace:
    """This run's swap files on one rank: extents reserved from the NVMe budget, checksummed IO.

    Not thread-safe for allocation (the placement manager allocates under its lock); `write` and
    `read` are blocking, thread-safe, and meant for the manager's worker threads.
    """

    def __init__(self, nvme_dir: str | os.PathLike[str], rank: int, budget: Budget, io: IOConfig, *,
                 checksums: bool = True, chunk_bytes: int = CHUNK_BYTES,
                 telemetry: Telemetry | None = None) -> None:
        self.budget = budget
        self.telemetry = telemetry if telemetry is not None else Telemetry()
        """Counts every read and write (bytes by kind, busy time)."""
        self.checksums = checksums
        self.chunk_bytes = round_up(chunk_bytes)
        self.folder = RunFolder(nvme_dir, rank)
        """This run's locked folder (tierzero/placement/storage/swap_dirs.py)."""
        self.run_dir = self.folder.path
        self.engine = IOEngine(threads=io.threads, block_size=io.block_size, direct=io.direct)
        self.allocator = ExtentAllocator()
        self._files: dict[int, PreallocatedFile] = {}
        self._checksums: dict[tuple[int, int], int] = {}
        self.checkpoint_files = CheckpointFiles(io.direct)
        """The checkpoint files that copy-on-write homes read (held open while they do)."""
        self._borrowed: dict[tuple[int, int], CheckpointHome] = {}
        """Region (its first extent) -> the checkpoint bytes it holds until its first write.
        Set under the placement manager's lock; popped by the write on a worker: the moves of
        one tensor that touch its home run in order, so no read of it runs meanwhile."""
        self._closed = False

    @property
    def file_bytes(self) -> int:
        return self.allocator.capacity

    def try_alloc(self, nbytes: int) -> SwapRegion | None:
        """A region for `nbytes` reserved from the NVMe budget, growing the swap files as needed;
        None when the budget has no room."""
        length = round_up(max(nbytes, 1))
        if not self.budget.try_reserve(length):
            return None
        try:
            ext = self.allocator.alloc(length)
            if ext is None and self.budget.limit - self.file_bytes >= length:
                self._grow(self._chunk_size(length))
                ext = self.allocator.alloc(length)
            if ext is not None:
                return SwapRegion((ext,), length)
            # No hole fits: use the budget's last room, then take pieces of the largest holes.
            # The reservation guarantees holes + room >= length.
            if self.allocator.free_bytes < length:
                self._grow(self.budget.limit - self.file_bytes)
            pieces = []
            while sum(e.length for e in pieces) < length:
                piece = self.allocator.alloc_largest(length - sum(e.length for e in pieces))
                assert piece is not None, (self.allocator, length)
                pieces.append(piece)
            return SwapRegion(tuple(pieces), length)
        except BaseException:
            self.budget.release(length)
            raise

    def borrow(self, segments: list[Segment], nbytes: int) -> CheckpointHome:
        """Read a shard of `nbytes` from checkpoint `segments` (a load: every byte read and
        hashed, none kept) and return them as a home for `adopt` (checked on every later read;
        see [Note: copy-on-write home] in tierzero/placement/storage/cow_home.py)."""
        home = CheckpointHome(segments, nbytes, self.checkpoint_files)
        self.telemetry.nvme_started()
        try:
            home.load(self.engine, checksums=self.checksums)
        except BaseException:
            home.close()
            raise
        finally:
            self.telemetry.nvme_finished("read", "params", nbytes)
        return home

    def adopt(self, region: SwapRegion, home: CheckpointHome, name: str) -> None:
        """The region's bytes are `home`'s until its first write: reads read the checkpoint, the
        write goes to the region and forgets it. The region stays reserved all along, so that
        write never lacks room: only the copy at registration is saved."""
        home.name = name
        self._borrowed[_key(region)] = home

    def free(self, region: SwapRegion) -> None:
        self._forget_borrowed(region)
        for ext in region.extents:
            self._checksums.pop((ext.chunk, ext.offset), None)
            self.allocator.free(ext)
        self.budget.release(region.length)

    def write(self, region: SwapRegion, buf: np.ndarray, name: str, traffic: str = "other") -> None:
        """Write buf[:region.length] (page-aligned) to the region; blocking. `traffic`: the
        group telemetry counts the bytes under (Kind.traffic)."""
        pieces = self._pieces(region, buf)
        self._forget_borrowed(region)  # the checkpoint's bytes are old from now on
        self.telemetry.nvme_started()
        try:
            futures = [write_extent(self.engine, self._files[e.chunk], piece, e.offset, checksum=self.checksums)
                       for e, piece in pieces]
            for e, fut in zip(region.extents, futures):
                _result(fut, f"writing tensor {name!r} to NVMe")
                if self.checksums:
                    self._checksums[(e.chunk, e.offset)] = fut.checksum
        finally:
            self.telemetry.nvme_finished("write", traffic, region.length)

    def read(self, region: SwapRegion, buf: np.ndarray, name: str, traffic: str = "other") -> None:
        """Read the region into buf[:region.length] and verify its checksums; blocking. A
        borrowed region reads its checkpoint segments instead (into its first home.nbytes)."""
        pieces = self._pieces(region, buf)
        home = self._borrowed.get(_key(region))
        if home is not None:
            self.telemetry.nvme_started()
            try:
                home.read(self.engine, buf)
            finally:
                self.telemetry.nvme_finished("read", traffic, home.nbytes)
            return
        self.telemetry.nvme_started()
        try:
            futures = [read_extent(self.engine, self._files[e.chunk], piece, e.offset, checksum=self.checksums)
                       for e, piece in pieces]
            for fut in futures:
                _result(fut, f"reading tensor {name!r} from NVMe")
        finally:
            self.telemetry.nvme_finished("read", traffic, region.length)
        for e, fut in zip(region.extents, futures):
            expected = self._checksums.get((e.chunk, e.offset)) if self.checksums else None
            if expected is not None and fut.checksum != expected:
                raise ChecksumError(
                    f"checksum mismatch reading tensor {name!r} from {self._files[e.chunk].path} at "
                    f"offset {e.offset} ({e.length} bytes): wrote xxh3 {expected:#018x}, read back "
                    f"{fut.checksum:#018x}; the swap file was modified or the drive returned bad data")

    def location(self, region: SwapRegion) -> tuple[str, int]:
        """(file, offset) of the region's first byte: its checkpoint file while borrowed."""
        home = self._borrowed.get(_key(region))
        if home is not None:
            return home.location()
        return str(self._files[region.extents[0].chunk].path), region.extents[0].offset

    def borrowed(self, region: SwapRegion) -> bool:
        """Whether the region's bytes are still a checkpoint's (not written since adopt)."""
        return _key(region) in self._borrowed

    def close(self) -> None:
        """Close the engine and remove this run's swap files and folder; idempotent."""
        if self._closed:
            return
        self._closed = True
        self.engine.close()
        for home in self._borrowed.values():
            home.close()
        self._borrowed.clear()
        self.checkpoint_files.close()
        for f in self._files.values():
            f.close()
        self._files.clear()
        self.folder.remove()  # what is already gone (the user removed nvme_dir) is no error

    def _chunk_size(self, length: int) -> int:
        """The next swap file's size for a region of `length`: `chunk_bytes` (or `length` when
        larger) within the budget's room, and at most half the disk's free space when that is
        less, so a small disk holding a small state is not refused for a 1 GiB chunk."""
        size = min(max(self.chunk_bytes, length), self.budget.limit - self.file_bytes)
        if size > length:
            size = max(length, min(size, round_up(free_disk_bytes(self.run_dir) // 2)))
        return size

    def _grow(self, size: int) -> None:
        size -= size % ALIGNMENT
        if size <= 0:
            return
        chunk = self.allocator.add_chunk(size)
        try:
            self._files[chunk] = PreallocatedFile(str(self.folder.file(chunk)), size, mode=FILE_MODE)
        except BaseException:
            self.allocator.remove_chunk(chunk)
            raise

    def _forget_borrowed(self, region: SwapRegion) -> None:
        home = self._borrowed.pop(_key(region), None)
        if home is not None:
            home.close()

    def _pieces(self, region: SwapRegion, buf: np.ndarray) -> list[tuple[Extent, np.ndarray]]:
        if buf.nbytes < region.length:
            raise ValueError(f"swap IO: buffer of {buf.nbytes} bytes is smaller than the region's {region.length}")
        out, start = [], 0
        for e in region.extents:
            out.append((e, buf[start: start + e.length]))
            start += e.length
        return out

    def __repr__(self) -> str:
        return f"SwapSpace({str(self.run_dir)!r}, files={len(self._files)}, {self.allocator!r})"


def _key(region: SwapRegion) -> tuple[int, int]:
    return region.extents[0].chunk, region.extents[0].offset


def _result(fut: IOFuture, what: str) -> int:
    """fut.result(), with the tensor named on the error (io_engine's names path, offset, errno)."""
    try:
        return fut.result()
    except OSError as e:
        if hasattr(e, "add_note"):
            e.add_note(f"tierzero: while {what}")
        raise

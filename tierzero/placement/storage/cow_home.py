"""Copy-on-write NVMe homes: a checkpoint file serves as a parameter shard's NVMe home until
the shard is first written (see [Note: copy-on-write home]).
"""

from __future__ import annotations

import os
import threading
from typing import NamedTuple, Sequence

import numpy as np

from io_engine import PAGE, IOEngine, ReadOnlyFile, aligned_empty, checksum


# [Note: copy-on-write home] A model loaded from a checkpoint (`tz.from_pretrained`, `tz.wrap(...,
# weights=)`) with its parameters homed on NVMe would copy them into the swap files, though the
# checkpoint's files already hold those very bytes when no conversion happens (the parameters'
# dtype is the checkpoint's and the compute dtype: the case FlatParam loads without master
# weights). Such a shard keeps the checkpoint as its home instead. Its phases:
#
#     load      WeightPlan.read_shard finds the shard's `Segment`s, one per slot of its FlatLayout
#               that this rank's shard covers (its own rows at ZeRO-3), and `SwapSpace.borrow`
#               reads them with io_engine, recording an xxh3 per segment (Config.checksums;
#               without, each file's size and modification time), and keeps none of the bytes:
#               the shard's values are a meta tensor from here on.
#     register  PlacementManager.register(..., borrowed=home): the swap extent is still reserved
#               (allocated from the NVMe budget), so the first write can never fail for lack of
#               room; only the write is skipped. `SwapSpace.adopt` ties the home to the extent.
#               Nothing is copied (no host staging copy: the first fetch reads the files).
#     read      every read of the extent (a fetch, pm.read, a checkpoint, an export) reads the
#               segments instead and verifies them: a mismatch is a `CheckpointChangedError`
#               naming the file, offset, key and tensor.
#     write     the first write of the extent (an optimizer step's new parameters, a dirty
#               eviction, pm.store, a checkpoint load) goes to the swap file as for any tensor,
#               and the home is forgotten.
#     forget    that write, unregister or close: the home lets go of its files.
#
# The files are opened once (read-only, `CheckpointFiles`) and stay open while a home reads
# them, so renaming or deleting the checkpoint folder (or replacing its files by new ones, as
# save_pretrained does) changes nothing for the model; writing into a file in place does, and
# is caught by the checks.
#
# Segment offsets are not page aligned: a read takes each segment's page-aligned superset with
# O_DIRECT into a page-aligned bounce buffer, then copies the segment out and hashes it while the
# later segments are read (`_read_segments`). Measured on the dev VM against reading each segment
# straight into place (io_engine then falls back to buffered reads, hashing on its workers): 1.8-2.2
# GB/s against 1.7-1.85 GB/s, with both into buffers already touched; fresh ones halve either
# (a page fault per page), so bounce buffers are reused (`Bounces`). A load copies nothing out
# of them: it hashes them where they lie (measured, a copy out and a copy into the host staging
# buffer were half of the load's time on 2 cores).
class Segment(NamedTuple):
    """Bytes of a checkpoint file that a shard holds at `at`."""

    key: str
    """The checkpoint's key of the tensor they belong to."""
    path: str
    offset: int
    """Byte offset in the file."""
    nbytes: int
    at: int
    """Byte offset in the shard."""


class CheckpointChangedError(OSError):
    """A checkpoint file serving as a tensor's NVMe home no longer holds the bytes loaded."""


class Bounces:
    """Page-aligned bounce buffers for reads of checkpoint segments, reused (at most `keep` of
    them kept between reads, the largest asked for so far). Thread-safe."""

    def __init__(self, keep: int = 2) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._free: list[np.ndarray] = []

    def take(self, nbytes: int) -> np.ndarray:
        with self._lock:
            for i, buf in enumerate(self._free):
                if buf.nbytes >= nbytes:
                    return self._free.pop(i)
        return aligned_empty(nbytes)

    def give_back(self, buf: np.ndarray) -> None:
        with self._lock:
            self._free = sorted([*self._free, buf], key=lambda b: b.nbytes)[-self._keep:]

    def clear(self) -> None:
        with self._lock:
            self._free = []


class CheckpointFiles:
    """The checkpoint files the copy-on-write homes of one swap space read: each opened once
    (a ReadOnlyFile: reads survive a rename or removal of its path), closed when the last home
    reading it lets go, or at close(); and the bounce buffers their reads use. Thread-safe."""

    def __init__(self, direct: bool | str) -> None:
        self._direct = direct
        self._lock = threading.Lock()
        self._files: dict[str, ReadOnlyFile] = {}
        self._users: dict[str, int] = {}
        self.bounces = Bounces()

    def take(self, path: str) -> ReadOnlyFile:
        key = os.path.abspath(path)
        with self._lock:
            if key not in self._files:
                self._files[key] = ReadOnlyFile(key, direct=self._direct)
                self._users[key] = 0
            self._users[key] += 1
            return self._files[key]

    def give_back(self, file: ReadOnlyFile) -> None:
        with self._lock:
            self._users[file.path] -= 1
            if self._users[file.path] == 0:
                del self._users[file.path]
                self._files.pop(file.path).close()

    def close(self) -> None:
        with self._lock:
            files, self._files, self._users = list(self._files.values()), {}, {}
        for f in files:
            f.close()
        self.bounces.clear()

    def __len__(self) -> int:
        return len(self._files)


class CheckpointHome:
    """One shard's bytes in checkpoint files (see the module docstring): its segments, the files
    held open for them, and what was read at load (a checksum per segment, or each file's size
    and modification time)."""

    def __init__(self, segments: Sequence[Segment], nbytes: int, files: CheckpointFiles) -> None:
        self.segments = tuple(segments)
        self.nbytes = nbytes
        """Bytes of the shard (segments, gaps and padding)."""
        self.name = ""
        """The tensor it is the home of, once adopted (for errors)."""
        self._files = files
        self._open: list[ReadOnlyFile] = []
        try:
            for s in self.segments:
                self._open.append(files.take(s.path))
        except BaseException:
            self.close()
            raise
        self._checksums: list[int] | None = None
        self._stats: dict[str, tuple[int, int]] = {}

    def load(self, engine: IOEngine, *, checksums: bool) -> None:
        """Read the shard's bytes and record what later reads verify (the bytes themselves are
        not kept: every later read of the home reads the files)."""
        sums = _read_segments(engine, self._open, self.segments, None, self.nbytes, self._files.bounces,
                              hashes=checksums)
        if checksums:
            self._checksums = sums
        else:
            self._stats = {f.path: _stat(f) for f in self._open}

    def read(self, engine: IOEngine, out: np.ndarray) -> None:
        """Read the shard into out[:nbytes], verified against the load (CheckpointChangedError)."""
        for s, f in zip(self.segments, self._open):
            if _size(f) < s.offset + s.nbytes:
                raise self._changed(s, f"lie past the file's end ({_size(f)} bytes now)")
        try:
            sums = _read_segments(engine, self._open, self.segments, out, self.nbytes, self._files.bounces,
                                  hashes=self._checksums is not None)
        except OSError as e:
            if hasattr(e, "add_note"):
                e.add_note(f"tierzero: while reading tensor {self.name!r} from its checkpoint file; "
                           f"{_ADVICE}")
            raise
        for i, (s, f) in enumerate(zip(self.segments, self._open)):
            if self._checksums is not None and sums[i] != self._checksums[i]:
                raise self._changed(s, f"had xxh3 {self._checksums[i]:#018x} at load and now {sums[i]:#018x}")
            if self._checksums is None and _stat(f) != self._stats[f.path]:
                raise self._changed(s, f"its file's (size, mtime_ns) was {self._stats[f.path]} at load and "
                                       f"is now {_stat(f)}")

    def location(self) -> tuple[str, int]:
        """(file, offset) of the shard's first checkpoint byte."""
        s = self.segments[0]
        return s.path, s.offset

    def close(self) -> None:
        """Let go of the files; idempotent."""
        opened, self._open = self._open, []
        for f in opened:
            self._files.give_back(f)

    def _changed(self, s: Segment, how: str) -> CheckpointChangedError:
        return CheckpointChangedError(
            f"tensor {self.name!r}: the checkpoint file {s.path!r} changed since the model was loaded from "
            f"it: bytes [{s.offset}, {s.offset + s.nbytes}) (key {s.key!r}) {how}. {_ADVICE}")

    def __repr__(self) -> str:
        files = sorted({os.path.basename(s.path) for s in self.segments})
        return f"CheckpointHome({self.name!r}, {len(self.segments)} segments of {files}, {self.nbytes} bytes)"


_ADVICE = ("Until its first update a loaded parameter is read from the checkpoint's files (its "
           "copy-on-write NVMe home, tierzero/placement/storage/cow_home.py), so they must not be modified in place while "
           "the model lives: restore the file, or load the model again from the new files "
           "(tz.from_pretrained); save new weights to a new file or folder (tz.save_pretrained replaces "
           "files, which is safe)")


def _stat(f: ReadOnlyFile) -> tuple[int, int]:
    st = f.stat()
    return st.st_size, st.st_mtime_ns


def _read_segments(engine: IOEngine, files: Sequence[ReadOnlyFile], segments: Sequence[Segment],
                   out: np.ndarray | None, nbytes: int, bounces: Bounces, *, hashes: bool) -> list[int]:
    """Fill out[:nbytes] with the segments (zeros elsewhere; out None: a load, which keeps
    nothing); the xxh3 of each segment's bytes when `hashes`. Each segment's page-aligned
    superset (clamped to its file's end) is read with O_DIRECT into one bounce buffer, all at
    once, then copied out."""
    spans, total = [], 0
    for f, s in zip(files, segments):
        lo = s.offset - s.offset % PAGE
        hi = min(-(-(s.offset + s.nbytes) // PAGE) * PAGE, _size(f))
        spans.append((lo, hi, total))
        total += -(-(hi - lo) // PAGE) * PAGE
    bounce = bounces.take(total)
    futures = [engine.pread(f, bounce[at:at + hi - lo], lo) for f, (lo, hi, at) in zip(files, spans)]
    try:
        sums, end = [], 0
        for s, (lo, _, at), fut in zip(segments, spans, futures):
            fut.result()  # copied out and hashed while the later segments are still read
            piece = bounce[at + s.offset - lo: at + s.offset - lo + s.nbytes]
            if out is not None:
                out[end:s.at] = 0
                out[s.at:s.at + s.nbytes] = piece
            end = s.at + s.nbytes
            if hashes:
                sums.append(checksum(piece))
        if out is not None:
            out[end:nbytes] = 0
    finally:
        for fut in futures:  # none may still write into the bounce buffer when it is reused
            fut.exception()
        bounces.give_back(bounce)
    return sums


def _size(f: ReadOnlyFile) -> int:
    return f.stat().st_size

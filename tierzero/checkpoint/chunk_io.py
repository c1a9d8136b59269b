"""Checkpoint file IO: a rank's files written with checksums, and verified (partial) reads.

Writing a rank's files (`write_rank_files`): the data file is preallocated at its final size (a
full disk fails here, before anything is written); each source (one stored tensor shard) is read
into one of two page-aligned buffers, zero-padded to a whole page, and written with io_engine
(O_DIRECT), one request per CHUNK_BYTES chunk whose xxh3 is computed as it goes; while one
buffer's chunks are being written, the next source is read into the other (`double_buffered`).
The file is fsynced; the state blob follows in its own file the same way. What the manifest
records for the rank (regions, sizes, checksums) is returned.

Reading (`Reader`): first every rank file's presence and size are checked against the manifest;
then a region is read either whole, straight into the caller's buffer, or, when resharding,
only the chunks holding the elements that a rank's ReadOps ask for. Every chunk read is verified
against the manifest's xxh3; a mismatch is a CheckpointError naming the file and byte range.
"""

from __future__ import annotations

import io
import os
from collections import deque
from pathlib import Path
from typing import Any, Callable, NamedTuple, Protocol, Sequence, TypeVar

import numpy as np
import torch

from io_engine import PAGE, IOEngine, IOFuture, PreallocatedFile, aligned_empty
from tierzero.checkpoint.format import (CHUNK_BYTES, DATA_FILE, STATE_FILE, CheckpointError, Manifest,
                                        RankFiles, Region, region_offsets)
from tierzero.checkpoint.reshard import ReadOp
from tierzero.config import IOConfig


def open_engine(io_config: IOConfig) -> IOEngine:
    return IOEngine(threads=io_config.threads, block_size=io_config.block_size, direct=io_config.direct)


def chunk_spans(length: int, chunk_bytes: int) -> list[tuple[int, int]]:
    return [(c, min(c + chunk_bytes, length)) for c in range(0, length, chunk_bytes)]


class Pending(Protocol):
    """Work still running on a buffer: an io_engine IOFuture or a concurrent.futures.Future."""

    def exception(self, timeout: float | None = None) -> BaseException | None: ...


_F = TypeVar("_F", bound=Pending)


def double_buffered(count: int, nbytes: int, start: Callable[[int, np.ndarray], list[_F]],
                    finish: Callable[[int, list[_F]], None]) -> None:
    """Run items 0..count-1 through two page-aligned buffers of `nbytes`, item i in buffer i % 2.

    `start(i, buf)` begins item i and returns the futures of its work still running on `buf`;
    `finish(i, futures)` completes it. Item i + 2 starts only after finish(i) returned, so one
    item's IO overlaps its neighbour's and no buffer is refilled while in use. On failure every
    started item's futures are waited for before raising: nothing runs on a buffer afterwards."""
    bufs = [aligned_empty(nbytes) for _ in range(2)]
    pending: deque[tuple[int, list[_F]]] = deque()
    try:
        for i in range(count):
            if len(pending) == 2:
                finish(*pending[0])
                pending.popleft()
            pending.append((i, start(i, bufs[i % 2])))
        while pending:
            finish(*pending[0])
            pending.popleft()
    finally:
        for _, futures in pending:
            for f in futures:
                f.exception()


# ----------------------------------------------------------------------------- writing


def _write_chunks(engine: IOEngine, file: PreallocatedFile, buf: np.ndarray, offset: int,
                  chunk_bytes: int) -> list[IOFuture]:
    """Start writing `buf` at `offset`, one checksummed request per chunk."""
    return [engine.pwrite(file, buf[s:e], offset + s, checksum=True) for s, e in chunk_spans(buf.nbytes, chunk_bytes)]


def _checksums(futures: list[IOFuture]) -> tuple[int, ...]:
    for f in futures:
        f.result()
    return tuple(f.checksum for f in futures)


class Source(NamedTuple):
    """One tensor shard to write: its region key, size, and how to read it into a buffer."""

    key: str
    nbytes: int
    read_into: Callable[[np.ndarray], Any]


def write_rank_files(folder: Path, rank: int, sources: Sequence[Source], state_blob: bytes, io_config: IOConfig,
                     *, chunk_bytes: int = CHUNK_BYTES) -> RankFiles:
    """Write rank `rank`'s data file (every source's bytes, in order, each in a page-aligned
    region) and state file into `folder`, fsynced; two buffers alternate so that reading one
    source overlaps writing the previous one. Returns what the manifest records for the rank."""
    offsets = region_offsets([s.nbytes for s in sources])
    padded = [end - start for start, end in zip(offsets, offsets[1:])]
    data_name, state_name = DATA_FILE.format(rank), STATE_FILE.format(rank)
    regions: dict[str, Region] = {}
    with open_engine(io_config) as engine:
        with PreallocatedFile(folder / data_name, offsets[-1]) as data:

            def start(i: int, buf: np.ndarray) -> list[IOFuture]:
                src = sources[i]
                buf = buf[:padded[i]]
                src.read_into(buf)
                buf[src.nbytes:] = 0
                return _write_chunks(engine, data, buf, offsets[i], chunk_bytes)

            def finish(i: int, futures: list[IOFuture]) -> None:
                regions[sources[i].key] = Region(offsets[i], sources[i].nbytes, _checksums(futures))

            double_buffered(len(sources), max(padded, default=PAGE), start, finish)
            os.fsync(data.handle.fd)
        raw = np.frombuffer(state_blob, dtype=np.uint8)
        with PreallocatedFile(folder / state_name, raw.nbytes) as sf:
            state_chunks = _checksums(_write_chunks(engine, sf, raw, 0, chunk_bytes))
            os.fsync(sf.handle.fd)
    return RankFiles(data=data_name, data_bytes=offsets[-1], regions={s.key: regions[s.key] for s in sources},
                     state=state_name, state_bytes=raw.nbytes, state_chunks=state_chunks)


# ----------------------------------------------------------------------------- reading


class Reader:
    """Verified reads of a checkpoint's files for one loading rank."""

    def __init__(self, folder: Path, manifest: Manifest, engine: IOEngine) -> None:
        self.folder = folder
        self.manifest = manifest
        self.engine = engine
        self.chunk = manifest.chunk_bytes

    def check_files(self) -> None:
        """Every rank's files exist with the sizes the manifest records."""
        for rank, files in enumerate(self.manifest.ranks):
            for name, size in ((files.data, files.data_bytes), (files.state, files.state_bytes)):
                path = self.folder / name
                try:
                    got = path.stat().st_size
                except FileNotFoundError:
                    raise CheckpointError(
                        f"{str(path)!r}: missing; the checkpoint was written by {self.manifest.world_size} "
                        f"rank(s) and needs the files of all of them (rank {rank} wrote this one); copy it "
                        "back or load an earlier checkpoint") from None
                if got != size:
                    raise CheckpointError(f"{str(path)!r}: {got} bytes, the manifest records {size}; the file "
                                          "is truncated or was overwritten: load an earlier checkpoint")

    def read_chunks(self, name: str, offset: int, chunks: Sequence[int], spans: Sequence[tuple[int, int]],
                    buf: np.ndarray, what: str) -> None:
        """Read the chunks `spans` (byte ranges relative to `offset`, with their expected xxh3 in
        `chunks`) of file `name` into the same positions of `buf`, and verify them."""
        path = self.folder / name
        futures = [self.engine.pread(path, buf[s:e], offset + s, checksum=True) for s, e in spans]
        for (s, e), fut, want in zip(spans, futures, chunks):
            fut.result()
            if fut.checksum != want:
                raise CheckpointError(
                    f"{str(path)!r}: checksum mismatch in bytes [{offset + s}, {offset + e}) ({what}): the "
                    f"manifest records xxh3 {want:016x}, the file holds {fut.checksum:016x}; the file is "
                    "corrupt: restore it or load an earlier checkpoint")

    def read_state(self, rank: int) -> dict[str, Any]:
        files = self.manifest.ranks[rank]
        buf = aligned_empty(files.state_bytes)
        spans = chunk_spans(files.state_bytes, self.chunk)
        self.read_chunks(files.state, 0, files.state_chunks, spans, buf, "training state")
        return torch.load(io.BytesIO(buf.tobytes()), map_location="cpu", weights_only=True)

    def read_ops(self, key: str, ops: list[ReadOp], itemsize: int, dst: np.ndarray) -> None:
        """Fill dst (zeroed where no op writes) from the saved shards, per `ops`."""
        regions = [r.regions[key] for r in self.manifest.ranks]
        if len(ops) == 1 and ops[0].src_start == ops[0].dst_start == 0 and \
                ops[0].count * itemsize == regions[ops[0].src_rank].nbytes:
            region = regions[ops[0].src_rank]  # a whole shard: read straight into dst
            self.read_chunks(self.manifest.ranks[ops[0].src_rank].data, region.offset, region.chunks,
                             chunk_spans(region.length, self.chunk), dst, key)
            return
        dst[:] = 0
        for rank in sorted({op.src_rank for op in ops}):
            region, mine = regions[rank], [op for op in ops if op.src_rank == rank]
            spans = chunk_spans(region.length, self.chunk)
            need = sorted({i for op in mine for i in range(op.src_start * itemsize // self.chunk,
                                                           -(-(op.src_start + op.count) * itemsize // self.chunk))})
            scratch = aligned_empty(region.length)
            self.read_chunks(self.manifest.ranks[rank].data, region.offset, [region.chunks[i] for i in need],
                             [spans[i] for i in need], scratch, key)
            for op in mine:
                dst[op.dst_start * itemsize:(op.dst_start + op.count) * itemsize] = \
                    scratch[op.src_start * itemsize:(op.src_start + op.count) * itemsize]

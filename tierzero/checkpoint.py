"""Checkpoints: streaming save and load of a wrapped model's tiered state, resharding, export.

A checkpoint is a folder `DIR/ckpt-NNNNNNNN/` holding

    manifest.json     one header line "tierzero-checkpoint 1 xxh3=<hex>" (the xxh3 of the rest),
                      then JSON: world size, the optimizer, and per flat tensor of every block its
                      FlatLayout (names, shapes, offsets, original dtypes), its stored tensors
                      (kind -> dtype) and step count; per rank its files, sizes and the xxh3 of
                      every chunk of every region; aliases (tied parameters' other names)
    rankRRRRR.bin     written by rank R: its shard of every stored tensor, each in a region that
                      starts on a 4 KiB boundary and is padded with zeros to a whole page, so
                      every byte of the file lies in some chunk whose checksum the manifest holds
    rankRRRRR.pt      written by rank R: the optimizer's param_groups, the model's persistent
                      buffers (outside the tiers) and the caller's `extra` (RNG states, data
                      position, step, scheduler), torch.save'd, checksummed

Phases of a save (every rank): rank 0 picks the next number and makes `.tmp-ckpt-N/`; each
rank preallocates its data file (a full disk fails here, before anything is written) and
streams its tensors block by block: a tensor is read from its home tier into one of two
page-aligned buffers (NVMe homes through io_engine) while the previous buffer's chunks are
written with io_engine (O_DIRECT, checksummed as they go); files are fsynced; rank 0 writes the
manifest last, fsyncs it and the folder, renames the folder to `ckpt-N` and fsyncs DIR, then
prunes to `keep_last`. A crash at any moment leaves either the old set of complete checkpoints
or the new one; `.tmp-*` leftovers are ignored by load and removed by the next save.

Phases of a load: the manifest's checksum, the model's layouts (a different model is refused
before anything is touched), every rank file's presence and size are checked first; then each
tensor's shard for this rank is planned from the saved layout (`reshard_plan`: a pure function
of the old layout, the new one and the rank, so N ranks load into M), only the chunks holding
those bytes are read and verified, and the tensor is stored to its home tier while the next one
is read. A corrupt chunk fails the load with an error naming the file and byte range; the model
is then partially loaded and must be loaded again before use.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import io
import json
import os
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple, Sequence

import numpy as np
import torch
import torch.distributed as dist
import xxhash
from torch import nn

from io_engine import PAGE, IOEngine, PreallocatedFile, aligned_empty
from tierzero import runtime
from tierzero.blocks import FlatParam
from tierzero.config import IOConfig
from tierzero.safetensors_file import TensorSpec, fsync_dir, load_safetensors, write_safetensors
from tierzero.sharding import FlatLayout, ParamSlot, world

FORMAT = "tierzero-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
CHUNK_BYTES = 8 << 20
"""Bytes covered by one checksum: the unit a partial (resharding) read fetches and verifies."""
PREFIX, TMP_PREFIX, TRASH_PREFIX = "ckpt-", ".tmp-ckpt-", ".trash-ckpt-"
_CKPT_RE = re.compile(rf"^{PREFIX}(\d{{8}})$")
VALUES = "values"
"""Kind of a flat tensor's values: the fp32 master weights when there are any, else the parameters."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file and what is wrong with it."""


def _round_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


# ----------------------------------------------------------------------------- the manifest


class Region(NamedTuple):
    """One stored tensor shard in a rank's data file: `nbytes` of data at `offset`, padded to a
    whole page, with the xxh3 of each CHUNK_BYTES piece of that padded length."""

    offset: int
    nbytes: int
    chunks: tuple[int, ...]

    @property
    def length(self) -> int:
        return _round_up(self.nbytes)


@dataclass(frozen=True, kw_only=True)
class RankFiles:
    """What one rank wrote."""

    data: str
    data_bytes: int
    regions: dict[str, Region]
    """"<flat name>/<kind>" -> its region."""
    state: str
    state_bytes: int
    state_chunks: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class FlatEntry:
    """One flat tensor of a block, as saved."""

    name: str
    """The FlatParam's placement name ("layers.0.param", "root.frozen")."""
    trainable: bool
    layout: FlatLayout
    dtypes: tuple[str, ...]
    """Original dtype of each parameter (slot order)."""
    kinds: dict[str, str]
    """Stored tensors, kind -> dtype: "values" and the optimizer's moments."""
    steps: int | None


@dataclass(frozen=True, kw_only=True)
class Manifest:
    world_size: int
    optimizer: str | None
    chunk_bytes: int
    flats: tuple[FlatEntry, ...]
    ranks: tuple[RankFiles, ...]
    aliases: dict[str, str]
    """Other names of tied parameters -> the name they are stored under."""

    def flat(self, name: str) -> FlatEntry | None:
        return next((f for f in self.flats if f.name == name), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, "world_size": self.world_size,
            "optimizer": self.optimizer, "chunk_bytes": self.chunk_bytes, "aliases": self.aliases,
            "flats": [{"name": f.name, "trainable": f.trainable, "dtypes": list(f.dtypes), "kinds": f.kinds,
                       "steps": f.steps, "numel": f.layout.numel, "padded_numel": f.layout.padded_numel,
                       "world_size": f.layout.world_size,
                       "slots": [[s.fqn, list(s.shape), s.offset, s.numel] for s in f.layout.slots]}
                      for f in self.flats],
            "ranks": [{"data": r.data, "data_bytes": r.data_bytes, "state": r.state, "state_bytes": r.state_bytes,
                       "state_chunks": [f"{c:016x}" for c in r.state_chunks],
                       "regions": {k: [g.offset, g.nbytes, [f"{c:016x}" for c in g.chunks]]
                                   for k, g in r.regions.items()}}
                      for r in self.ranks],
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Manifest":
        flats = tuple(FlatEntry(
            name=f["name"], trainable=f["trainable"], dtypes=tuple(f["dtypes"]), kinds=dict(f["kinds"]),
            steps=f["steps"],
            layout=FlatLayout(tuple(ParamSlot(fqn, torch.Size(shape), off, n) for fqn, shape, off, n in f["slots"]),
                              f["numel"], f["padded_numel"], f["world_size"])) for f in d["flats"])
        ranks = tuple(RankFiles(
            data=r["data"], data_bytes=r["data_bytes"], state=r["state"], state_bytes=r["state_bytes"],
            state_chunks=tuple(int(c, 16) for c in r["state_chunks"]),
            regions={k: Region(off, n, tuple(int(c, 16) for c in cs)) for k, (off, n, cs) in r["regions"].items()})
            for r in d["ranks"])
        return cls(world_size=d["world_size"], optimizer=d["optimizer"], chunk_bytes=d["chunk_bytes"],
                   flats=flats, ranks=ranks, aliases=dict(d["aliases"]))


def write_manifest(path: Path, manifest: Manifest) -> None:
    body = json.dumps(manifest.to_json(), indent=1).encode()
    try:
        with open(path, "wb") as f:
            f.write(f"{FORMAT} {VERSION} xxh3={xxhash.xxh3_64_intdigest(body):016x}\n".encode() + body)
            f.flush()
            os.fsync(f.fileno())
    except OSError as e:
        raise type(e)(e.errno, f"writing the checkpoint manifest {str(path)!r}: {e.strerror}") from e


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """The manifest at `path`, its checksum verified; CheckpointError naming it otherwise."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CheckpointError(f"{str(path)!r}: no such file; a checkpoint folder holds {MANIFEST} "
                              "(an interrupted save leaves none: load an earlier checkpoint)") from None
    head, _, body = raw.partition(b"\n")
    m = re.fullmatch(rf"{FORMAT} (\d+) xxh3=([0-9a-f]{{16}})".encode(), head)
    if m is None:
        raise CheckpointError(f"{str(path)!r}: the first line is not '{FORMAT} <version> xxh3=<16 hex digits>'; "
                              "the manifest is corrupt or not a tierzero checkpoint")
    if int(m.group(1)) != VERSION:
        raise CheckpointError(f"{str(path)!r}: format version {int(m.group(1))}, this tierzero reads {VERSION}")
    got = xxhash.xxh3_64_intdigest(body)
    if got != int(m.group(2), 16):
        raise CheckpointError(f"{str(path)!r}: checksum mismatch: the header says xxh3 {m.group(2).decode()}, "
                              f"the contents hash to {got:016x}; the manifest is corrupt: restore it or "
                              "load an earlier checkpoint")
    try:
        return Manifest.from_json(json.loads(body))
    except (ValueError, KeyError, TypeError) as e:  # checksum matched: written by another format
        raise CheckpointError(f"{str(path)!r}: unreadable manifest ({e!r})") from None


# ------------------------------------------------------------------------------ resharding


class ReadOp(NamedTuple):
    """Copy `count` elements from `src_start` of rank `src_rank`'s saved shard to `dst_start`."""

    src_rank: int
    src_start: int
    dst_start: int
    count: int


def _range_ops(layout: FlatLayout, start: int, count: int, dst_start: int) -> Iterator[ReadOp]:
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
    if [(s.fqn, tuple(s.shape)) for s in saved.slots] != [(s.fqn, tuple(s.shape)) for s in new.slots]:
        raise ValueError(f"reshard_plan: the layouts hold different parameters: saved "
                         f"{[(s.fqn, tuple(s.shape)) for s in saved.slots][:4]}..., new "
                         f"{[(s.fqn, tuple(s.shape)) for s in new.slots][:4]}...")
    a, b = new.shard_range(rank)
    if (saved.world_size, saved.padded_numel, tuple(s.offset for s in saved.slots)) == \
            (new.world_size, new.padded_numel, tuple(s.offset for s in new.slots)):
        return [ReadOp(rank, 0, 0, b - a)]  # the same layout: the rank's own shard, whole
    ops: list[ReadOp] = []
    for old, cur in zip(saved.slots, new.slots):
        lo, hi = max(a, cur.offset), min(b, cur.offset + cur.numel)
        if lo >= hi:
            continue
        for op in _range_ops(saved, old.offset + lo - cur.offset, hi - lo, lo - a):
            last = ops[-1] if ops else None
            if (last is not None and last.src_rank == op.src_rank and last.src_start + last.count == op.src_start
                    and last.dst_start + last.count == op.dst_start):
                ops[-1] = last._replace(count=last.count + op.count)
            else:
                ops.append(op)
    return ops


# ---------------------------------------------------------------------------- chunked IO


def _engine(io: IOConfig) -> IOEngine:
    return IOEngine(threads=io.threads, block_size=io.block_size, direct=io.direct)


def _chunk_spans(length: int, chunk_bytes: int) -> list[tuple[int, int]]:
    return [(c, min(c + chunk_bytes, length)) for c in range(0, length, chunk_bytes)]


def _write_chunks(engine: IOEngine, file: PreallocatedFile, buf: np.ndarray, offset: int,
                  chunk_bytes: int) -> list[Any]:
    """Start writing `buf` at `offset`, one checksummed request per chunk."""
    return [engine.pwrite(file, buf[s:e], offset + s, checksum=True) for s, e in _chunk_spans(buf.nbytes, chunk_bytes)]


def _checksums(futures: list[Any]) -> tuple[int, ...]:
    for f in futures:
        f.result()
    return tuple(f.checksum for f in futures)


class _Reader:
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
        spans = _chunk_spans(files.state_bytes, self.chunk)
        self.read_chunks(files.state, 0, files.state_chunks, spans, buf, "training state")
        return torch.load(io.BytesIO(buf.tobytes()), map_location="cpu", weights_only=True)

    def read_ops(self, key: str, ops: list[ReadOp], itemsize: int, dst: np.ndarray) -> None:
        """Fill dst (zeroed where no op writes) from the saved shards, per `ops`."""
        regions = [r.regions[key] for r in self.manifest.ranks]
        if len(ops) == 1 and ops[0].src_start == ops[0].dst_start == 0 and \
                ops[0].count * itemsize == regions[ops[0].src_rank].nbytes:
            region = regions[ops[0].src_rank]  # a whole shard: read straight into dst
            self.read_chunks(self.manifest.ranks[ops[0].src_rank].data, region.offset, region.chunks,
                             _chunk_spans(region.length, self.chunk), dst, key)
            return
        dst[:] = 0
        for rank in sorted({op.src_rank for op in ops}):
            region, mine = regions[rank], [op for op in ops if op.src_rank == rank]
            spans = _chunk_spans(region.length, self.chunk)
            need = sorted({i for op in mine for i in range(op.src_start * itemsize // self.chunk,
                                                           -(-(op.src_start + op.count) * itemsize // self.chunk))})
            scratch = aligned_empty(region.length)
            self.read_chunks(self.manifest.ranks[rank].data, region.offset, [region.chunks[i] for i in need],
                             [spans[i] for i in need], scratch, key)
            for op in mine:
                dst[op.dst_start * itemsize:(op.dst_start + op.count) * itemsize] = \
                    scratch[op.src_start * itemsize:(op.src_start + op.count) * itemsize]


# ------------------------------------------------------------------------ the rank's tensors


class _Job(NamedTuple):
    """One stored tensor of this rank: its region key, placement name, dtype and elements."""

    key: str
    flat: FlatParam
    kind: str
    pm_name: str
    dtype: torch.dtype
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


def _jobs(state: runtime.TieredState, optimizer: Any) -> list[_Job]:
    pm = state.pm
    jobs = []
    for flat in state.flat_params():
        values = flat.master_name if flat.has_master else flat.param_name
        names = {VALUES: values, **(optimizer.state_names(flat) if optimizer is not None and flat.trainable else {})}
        for kind, name in names.items():
            rec = pm.records[name]
            jobs.append(_Job(f"{flat.param_name}/{kind}", flat, kind, name, rec.dtype, rec.shape.numel()))
    return jobs


def _check_optimizer(state: runtime.TieredState, optimizer: Any) -> None:
    if optimizer is None:
        return
    mine = set(state.flat_params())
    if not callable(getattr(optimizer, "state_names", None)) or not set(optimizer.flat_params) <= mine:
        raise ValueError(f"checkpoint: expected a tz.AdamW / tz.SGD built on this model, got "
                         f"{type(optimizer).__name__}; pass the optimizer created with this model, or None")


class _Comm:
    """The few collectives a save needs (world size 1: none)."""

    def __init__(self, group: Any, world_size: int) -> None:
        self.group, self.world_size = group, world_size

    def broadcast(self, obj: Any) -> Any:
        if self.world_size == 1:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def gather(self, obj: Any) -> list[Any]:
        if self.world_size == 1:
            return [obj]
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)


# ----------------------------------------------------------------------------- public API


def checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """The complete checkpoints in `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := _CKPT_RE.match(p.name))]
    return [p for _, p in sorted(found) if (p / MANIFEST).is_file()]


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """`root` itself when it is a checkpoint folder, else the newest complete checkpoint in it."""
    root = Path(root)
    if (root / MANIFEST).is_file():
        return root
    found = checkpoints(root)
    return found[-1] if found else None


def save_checkpoint(dir: str | os.PathLike[str], model: nn.Module, optimizer: Any = None,
                    extra: Any = None, keep_last: int | None = None) -> Path:
    """Save the model's tiered state (and the optimizer's) as a new checkpoint in `dir`; returns
    its folder. `extra` (RNG states, data position, ...; anything torch.save takes with
    weights_only loading) is stored per rank and returned by load_checkpoint. keep_last: keep
    only that many newest checkpoints. Call it on every rank, between training steps."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"save_checkpoint: keep_last: expected None or an int >= 1, got {keep_last}")
    state = runtime.state_of(model)
    _check_optimizer(state, optimizer)
    rank, world_size = world(state.ctx.group)
    comm = _Comm(state.ctx.group, world_size)
    root = Path(dir)
    seq = None
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        for p in root.iterdir():  # leftovers of saves that were interrupted
            if p.name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                shutil.rmtree(p, ignore_errors=True)
        done = [int(m.group(1)) for p in root.iterdir() if (m := _CKPT_RE.match(p.name))]
        seq = max(done, default=0) + 1
        (root / f"{TMP_PREFIX}{seq:08d}").mkdir()
    seq = comm.broadcast(seq)
    tmp, final = root / f"{TMP_PREFIX}{seq:08d}", root / f"{PREFIX}{seq:08d}"
    # Every rank learns whether every other one succeeded (a failed rank must not leave the
    # others waiting in a collective); only then does rank 0 publish the checkpoint.
    try:
        outcome: RankFiles | str = _write_rank(tmp, rank, state, optimizer, extra)
    except Exception as e:
        outcome, failure = f"rank {rank}: {e}", e
    except BaseException:  # interrupted: no collective may follow
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    else:
        failure = None
    every = comm.gather(outcome)
    errors = [o for o in every if isinstance(o, str)]
    if rank == 0 and not errors:
        try:
            _publish(root, tmp, final, _manifest(state, optimizer, world_size, every), keep_last)
        except Exception as e:
            errors, failure = [f"rank 0: {e}"], e
    errors = comm.broadcast(errors)
    if errors:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if failure is not None:
            raise failure
        raise RuntimeError(f"save_checkpoint: the save failed on other ranks ({'; '.join(errors)}); the "
                           "previous checkpoints are intact")
    return final


def _publish(root: Path, tmp: Path, final: Path, manifest: Manifest, keep_last: int | None) -> None:
    """Rank 0: the manifest last, fsynced; the folder renamed into place; old ones pruned."""
    write_manifest(tmp / MANIFEST, manifest)
    fsync_dir(tmp)
    os.rename(tmp, final)
    fsync_dir(root)
    if keep_last is not None:
        for old in checkpoints(root)[:-keep_last]:
            trash = root / f"{TRASH_PREFIX}{old.name}"
            os.rename(old, trash)  # a crash mid-delete leaves no half checkpoint under ckpt-*
            shutil.rmtree(trash)


def _manifest(state: runtime.TieredState, optimizer: Any, world_size: int, ranks: list[RankFiles]) -> Manifest:
    pm = state.pm
    flats = []
    for flat in state.flat_params():
        values = flat.master_name if flat.has_master else flat.param_name
        kinds = {VALUES: str(pm.records[values].dtype).removeprefix("torch.")}
        steps = None
        if optimizer is not None and flat.trainable:
            kinds.update({k: str(pm.records[n].dtype).removeprefix("torch.")
                          for k, n in optimizer.state_names(flat).items()})
            steps = optimizer.block_steps(flat)
        flats.append(FlatEntry(name=flat.param_name, trainable=flat.trainable, layout=flat.layout,
                               dtypes=tuple(str(d).removeprefix("torch.") for d in flat.orig_dtypes),
                               kinds=kinds, steps=steps))
    canonical = {id(p): n for n, p in state.model.named_parameters()}
    aliases = {n: canonical[id(p)] for n, p in state.model.named_parameters(remove_duplicate=False)
               if canonical[id(p)] != n}
    return Manifest(world_size=world_size, optimizer=type(optimizer).__name__ if optimizer is not None else None,
                    chunk_bytes=CHUNK_BYTES, flats=tuple(flats), ranks=tuple(ranks), aliases=aliases)


class Source(NamedTuple):
    """One tensor shard to write: its region key, size, and how to read it into a buffer."""

    key: str
    nbytes: int
    read_into: Callable[[np.ndarray], Any]


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's buffers that its state_dict holds (running statistics and the like): they
    live outside the tiers, whole on every rank."""
    return {f"{prefix}{'.' if prefix else ''}{name}": buf for prefix, module in model.named_modules()
            for name, buf in module._buffers.items()
            if buf is not None and name not in module._non_persistent_buffers_set}


def _training_blob(optimizer: Any, extra: Any, buffers: dict[str, torch.Tensor]) -> bytes:
    blob = io.BytesIO()
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups] if optimizer else []
    torch.save({"param_groups": groups, "extra": extra,
                "buffers": {k: v.detach().to("cpu", copy=True) for k, v in buffers.items()}}, blob)
    return blob.getvalue()


def _write_rank(tmp: Path, rank: int, state: runtime.TieredState, optimizer: Any, extra: Any) -> RankFiles:
    pm = state.pm
    sources = [Source(j.key, j.nbytes, lambda buf, n=j.pm_name: pm.read(n, out=buf))
               for j in _jobs(state, optimizer)]
    blob = _training_blob(optimizer, extra, persistent_buffers(state.model))
    return write_rank_files(tmp, rank, sources, blob, state.config.io)


def write_rank_files(folder: Path, rank: int, sources: Sequence[Source], state_blob: bytes, io_config: IOConfig,
                     *, chunk_bytes: int = CHUNK_BYTES) -> RankFiles:
    """Write rank `rank`'s data file (every source's bytes, in order, each in a page-aligned
    region) and state file into `folder`, fsynced; two buffers alternate so that reading one
    source overlaps writing the previous one. Returns what the manifest records for the rank."""
    offsets = np.cumsum([0] + [_round_up(s.nbytes) for s in sources]).tolist()
    data_name, state_name = f"rank{rank:05d}.bin", f"rank{rank:05d}.pt"
    regions: dict[str, Region] = {}
    with _engine(io_config) as engine:
        with PreallocatedFile(folder / data_name, offsets[-1]) as data:
            size = max((_round_up(s.nbytes) for s in sources), default=PAGE)
            bufs = [aligned_empty(size) for _ in range(2)]
            pending: list[tuple[Source, int, list[Any]] | None] = [None, None]

            def finish(slot: int) -> None:
                if pending[slot] is not None:
                    src, off, futures = pending[slot]
                    regions[src.key] = Region(off, src.nbytes, _checksums(futures))
                    pending[slot] = None

            try:
                for i, src in enumerate(sources):
                    slot = i % 2
                    finish(slot)  # the buffer's previous writes are done before it is refilled
                    buf = bufs[slot][:_round_up(src.nbytes)]
                    src.read_into(buf)
                    buf[src.nbytes:] = 0
                    pending[slot] = (src, offsets[i], _write_chunks(engine, data, buf, offsets[i], chunk_bytes))
                finish(len(sources) % 2)
                finish((len(sources) + 1) % 2)
            finally:
                for p in pending:  # on failure, no write may still use a buffer or the file
                    for f in (p[2] if p else []):
                        f.exception()
            os.fsync(data.handle.fd)
        raw = np.frombuffer(state_blob, dtype=np.uint8)
        with PreallocatedFile(folder / state_name, raw.nbytes) as sf:
            state_chunks = _checksums(_write_chunks(engine, sf, raw, 0, chunk_bytes))
            os.fsync(sf.handle.fd)
    return RankFiles(data=data_name, data_bytes=offsets[-1], regions={s.key: regions[s.key] for s in sources},
                     state=state_name, state_bytes=raw.nbytes, state_chunks=state_chunks)


def load_checkpoint(dir: str | os.PathLike[str], model: nn.Module, optimizer: Any = None) -> Any:
    """Load the newest checkpoint in `dir` (or the checkpoint folder `dir`) into the wrapped
    model and optimizer, resharding when the world size differs; returns the `extra` saved by
    this rank (rank 0's when the checkpoint had fewer ranks). Call it on every rank."""
    state = runtime.state_of(model)
    _check_optimizer(state, optimizer)
    rank, _ = world(state.ctx.group)
    folder = latest_checkpoint(dir)
    if folder is None:
        raise CheckpointError(f"{str(dir)!r}: no checkpoint there (no {MANIFEST}, no complete {PREFIX}N folder)")
    manifest = read_manifest(folder / MANIFEST)
    jobs = _jobs(state, optimizer)
    _check_model(folder / MANIFEST, manifest, state, optimizer, jobs)
    with _engine(state.config.io) as engine:
        reader = _Reader(folder, manifest, engine)
        reader.check_files()
        state_rank = rank if rank < manifest.world_size else 0
        saved = reader.read_state(state_rank)
        buffers = persistent_buffers(model)
        if set(buffers) != set(saved["buffers"]):
            raise CheckpointError(
                f"{str(folder / manifest.ranks[state_rank].state)!r} holds buffers {sorted(saved['buffers'])[:6]}, "
                f"this model has {sorted(buffers)[:6]}; load it into the model it was saved from")
        pm = state.pm
        plans = []
        for job in jobs:
            entry = manifest.flat(job.flat.param_name)
            plans.append((_dtype(entry.kinds[job.kind]), reshard_plan(entry.layout, job.flat.layout, rank)))
        size = max((_round_up(job.numel * dtype.itemsize) for job, (dtype, _) in zip(jobs, plans)), default=PAGE)
        bufs = [aligned_empty(size) for _ in range(2)]

        def read(i: int) -> torch.Tensor:
            """Job i's shard, in the saved dtype, in one of the two buffers."""
            (dtype, ops), nbytes = plans[i], jobs[i].numel * plans[i][0].itemsize
            dst = bufs[i % 2][:_round_up(nbytes)]
            reader.read_ops(jobs[i].key, ops, dtype.itemsize, dst)
            return torch.from_numpy(dst[:nbytes]).view(dtype)

        with cf.ThreadPoolExecutor(1, thread_name_prefix="tierzero-ckpt-read") as ahead:
            nxt = ahead.submit(read, 0) if jobs else None
            for i, job in enumerate(jobs):
                values = nxt.result()
                nxt = ahead.submit(read, i + 1) if i + 1 < len(jobs) else None
                _store(pm, job, values)
    with torch.no_grad():
        for name, buf in buffers.items():
            buf.copy_(saved["buffers"][name])
    if optimizer is not None:
        for group, saved_group in zip(optimizer.param_groups, saved["param_groups"]):
            group.update(saved_group)
        for flat in optimizer.flat_params:
            optimizer.set_block_steps(flat, manifest.flat(flat.param_name).steps)
    return saved["extra"]


def _store(pm: Any, job: _Job, values: torch.Tensor) -> None:
    flat = job.flat
    if job.kind != VALUES:
        pm.store(job.pm_name, values.to(job.dtype))
        return
    if flat.has_master:
        pm.store(flat.master_name, values.float())
    pm.store(flat.param_name, values.to(flat.ctx.compute_dtype))


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in a checkpoint manifest")
    return dtype


def _check_model(path: Path, manifest: Manifest, state: runtime.TieredState, optimizer: Any,
                 jobs: list[_Job]) -> None:
    """The manifest describes this model (and this optimizer's state): else CheckpointError."""
    mine = {f.param_name: f for f in state.flat_params()}
    saved = {f.name: f for f in manifest.flats}
    if set(mine) != set(saved):
        raise CheckpointError(
            f"{str(path)!r} was written for a different model: its blocks are {sorted(saved)[:8]}, this "
            f"model's are {sorted(mine)[:8]} (missing here: {sorted(set(saved) - set(mine))[:4]}, not in the "
            f"checkpoint: {sorted(set(mine) - set(saved))[:4]}); load it into the model it was saved from")
    for name, flat in mine.items():
        ours = [(s.fqn, tuple(s.shape)) for s in flat.layout.slots]
        theirs = [(s.fqn, tuple(s.shape)) for s in saved[name].layout.slots]
        if ours != theirs:
            diff = next(((a, b) for a, b in zip(ours, theirs) if a != b), (ours[len(theirs):], theirs[len(ours):]))
            raise CheckpointError(
                f"{str(path)!r} was written for a different model: block {name!r} holds (name, shape) "
                f"{diff[1]} in the checkpoint but {diff[0]} in this model; load it into the model it was "
                "saved from")
    for job in jobs:
        if job.kind not in saved[job.flat.param_name].kinds:
            raise CheckpointError(
                f"{str(path)!r} holds no optimizer state {job.kind!r} for {job.flat.param_name!r} (saved with "
                f"optimizer {manifest.optimizer}, loading into {type(optimizer).__name__}); load with "
                "optimizer=None, or use the optimizer the checkpoint was saved with")
    if optimizer is not None and manifest.optimizer is None:
        raise CheckpointError(f"{str(path)!r} was saved without an optimizer; load with optimizer=None")


# ---------------------------------------------------------------------------- export, import


def export_checkpoint(ckpt: str | os.PathLike[str], to: str | os.PathLike[str], *,
                      io_config: IOConfig | None = None) -> Path:
    """Write the model in checkpoint `ckpt` (a folder, or the newest checkpoint in it) as one
    safetensors file with every parameter under its name in its original dtype (tied parameters
    under each of their names) and the persistent buffers, reading one block at a time: the
    file is a full state dict that plain PyTorch loads without tierzero."""
    folder = latest_checkpoint(ckpt)
    if folder is None:
        raise CheckpointError(f"{str(ckpt)!r}: no checkpoint there (no {MANIFEST}, no complete {PREFIX}N folder)")
    manifest = read_manifest(folder / MANIFEST)
    engine = _engine(io_config or IOConfig())
    try:
        reader = _Reader(folder, manifest, engine)
        reader.check_files()
        buffers = reader.read_state(0)["buffers"]
        cache: dict[str, torch.Tensor] = {}

        def full(entry: FlatEntry) -> torch.Tensor:
            """The block's whole flat values (one block cached at a time)."""
            if entry.name not in cache:
                cache.clear()
                layout, dtype = entry.layout, _dtype(entry.kinds[VALUES])
                dst = aligned_empty(_round_up(layout.numel * dtype.itemsize))
                reader.read_ops(f"{entry.name}/{VALUES}", list(_range_ops(layout, 0, layout.numel, 0)),
                                dtype.itemsize, dst)
                cache[entry.name] = torch.from_numpy(dst[:layout.numel * dtype.itemsize]).view(dtype)
            return cache[entry.name]

        specs, where = [], {}
        for entry in manifest.flats:
            for slot, dt in zip(entry.layout.slots, entry.dtypes):
                where[slot.fqn] = (entry, slot, _dtype(dt))
        for name in [*where, *manifest.aliases]:
            entry, slot, dtype = where[manifest.aliases.get(name, name)]
            specs.append(TensorSpec(name, tuple(slot.shape), dtype, lambda e=entry, s=slot, d=dtype:
                                    full(e)[s.offset:s.offset + s.numel].to(d).view(s.shape)))
        specs += [TensorSpec(k, tuple(v.shape), v.dtype, lambda v=v: v) for k, v in buffers.items()]
        return write_safetensors(to, specs, {"format": "pt", "tierzero_checkpoint": str(folder)})
    finally:
        engine.close()


def load_weights(model: nn.Module, source: str | os.PathLike[str] | dict[str, torch.Tensor]) -> None:
    """Start a wrapped model from plain weights: a state dict, a torch.save'd state dict file or
    a safetensors file. Every parameter must be given (tied parameters under any one of their
    names); ValueError naming the file and the keys otherwise."""
    runtime.state_of(model)
    what = "state dict"
    if not isinstance(source, dict):
        path = Path(source)
        what = repr(str(path))
        if not path.is_file():
            raise FileNotFoundError(f"load_weights: {what}: no such file; give a .safetensors file or a "
                                    "torch.save'd state dict")
        if path.suffix == ".safetensors":
            source = load_safetensors(path)
        else:
            try:
                source = torch.load(path, map_location="cpu", weights_only=True)
            except Exception as e:
                raise ValueError(f"load_weights: {what} is neither a safetensors file nor a torch.save'd "
                                 f"state dict ({e})") from None
            if not isinstance(source, dict):
                raise ValueError(f"load_weights: {what} holds a {type(source).__name__}, expected a state dict")
    sd = dict(source)
    groups: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), []).append(name)
    for names in groups.values():  # tied parameters: any one name gives them all
        given = next((n for n in names if n in sd), None)
        if given is not None:
            for n in names:
                sd.setdefault(n, sd[given])
    expected = set(model.state_dict().keys())
    missing, unexpected = sorted(expected - set(sd)), sorted(set(sd) - expected)
    if missing or unexpected:
        raise ValueError(f"load_weights: {what} does not match {type(model).__name__}: missing "
                         f"{missing[:6]}{' ...' if len(missing) > 6 else ''}, unexpected "
                         f"{unexpected[:6]}{' ...' if len(unexpected) > 6 else ''}")
    model.load_state_dict(sd, strict=True)


def main(argv: list[str]) -> int:
    """`tierzero export CKPT --to model.safetensors`."""
    p = argparse.ArgumentParser(prog="tierzero export", description="write a checkpoint's model as one "
                                "safetensors file that plain PyTorch / transformers load")
    p.add_argument("ckpt", help="a checkpoint folder, or a folder of checkpoints (the newest is used)")
    p.add_argument("--to", required=True, help="output .safetensors file")
    args = p.parse_args(argv)
    try:
        out = export_checkpoint(args.ckpt, args.to)
    except (CheckpointError, OSError) as e:
        print(f"tierzero export: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out} ({out.stat().st_size} bytes)")
    return 0

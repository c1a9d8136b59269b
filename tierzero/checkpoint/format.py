"""The checkpoint format on disk: folder names, the manifest, and finding checkpoints.

This module is the format's data (the manifest's records, their JSON, the names of folders and
files) and nothing else: the bytes of the rank files are written and read by chunk_io.py. The
layout of a checkpoint folder: [Note: checkpoint layout].
"""

from __future__ import annotations

import json
import os
import re
import stat
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Sequence

import torch
import xxhash

from io_engine import PAGE, not_own
from tierzero.layout import FlatLayout, ParamSlot

FORMAT = "tierzero-checkpoint"
VERSION = 1
# [Note: checkpoint layout]
# A checkpoint is a folder `DIR/ckpt-NNNNNNNN/` holding
#
#     manifest.json     one header line "tierzero-checkpoint 1 xxh3=<hex>" (the xxh3 of the rest),
#                       then JSON: world size, the optimizer, and per flat tensor of every block its
#                       FlatLayout (names, shapes, offsets, original dtypes), its stored tensors
#                       (kind -> dtype) and step count; per rank its files, sizes and the xxh3 of
#                       every chunk of every region; aliases (tied parameters' other names)
#     rankRRRRR.bin     written by rank R: its shard of every stored tensor, each in a region that
#                       starts on a 4 KiB boundary and is padded with zeros to a whole page, so
#                       every byte of the file lies in some chunk whose checksum the manifest holds
#     rankRRRRR.pt      written by rank R: the optimizer's param_groups, the model's persistent
#                       buffers (outside the tiers) and the caller's `extra` (RNG states, data
#                       position, step, scheduler), torch.save'd, checksummed
#     config.json       only for a model with a transformers `config`: its config (and
#                       generation_config.json), written by rank 0 before the manifest, so that
#                       `tierzero export CKPT --to DIR` writes a transformers model folder
#
# The manifest is written last: a `ckpt-N` folder holding one is complete. A save in progress
# writes into `.tmp-ckpt-N/` and renames it; pruning renames a folder to `.trash-ckpt-N` before
# deleting it; both kinds of leftovers are never read.
MANIFEST = "manifest.json"
CHUNK_BYTES = 8 << 20
"""Bytes covered by one checksum: the unit a partial (resharding) read fetches and verifies."""
PREFIX, TMP_PREFIX, TRASH_PREFIX = "ckpt-", ".tmp-ckpt-", ".trash-ckpt-"
_CKPT_RE = re.compile(rf"^{PREFIX}(\d{{8}})$")
DATA_FILE, STATE_FILE = "rank{:05d}.bin", "rank{:05d}.pt"
"""A rank's file names, formatted with the rank."""
EXTRA_FILES = ("config.json", "generation_config.json")
"""Files a checkpoint may hold besides the rank files (the model's transformers config)."""
VALUES = "values"
"""Kind of a flat tensor's values: the fp32 master weights when there are any, else the parameters."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded: the message names the file and what is wrong with it."""


def round_up(n: int) -> int:
    """`n` bytes padded to a whole page, as every region of a data file is."""
    return -(-n // PAGE) * PAGE


def region_offsets(sizes: Sequence[int]) -> list[int]:
    """Where each region of a data file starts, for regions of `sizes` bytes in that order, then
    the file's size: each region starts on a page and is padded to a whole page."""
    offsets = [0]
    for n in sizes:
        offsets.append(offsets[-1] + round_up(n))
    return offsets


def torch_dtype(name: str) -> torch.dtype:
    """The dtype a manifest names ("float32", "bfloat16")."""
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise CheckpointError(f"unknown dtype {name!r} in a checkpoint manifest")
    return dtype


# ----------------------------------------------------------------------------- the manifest


class Region(NamedTuple):
    """One stored tensor shard in a rank's data file: `nbytes` of data at `offset`, padded to a
    whole page, with the xxh3 of each CHUNK_BYTES piece of that padded length."""

    offset: int
    nbytes: int
    chunks: tuple[int, ...]

    @property
    def length(self) -> int:
        return round_up(self.nbytes)


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
    steps: int | list[int] | None
    """The optimizer's update count: one for every parameter, or one per parameter (slot order)
    when some were skipped for want of a gradient; None without an optimizer."""


@dataclass(frozen=True, kw_only=True)
class Manifest:
    world_size: int
    optimizer: str | None
    chunk_bytes: int
    flats: tuple[FlatEntry, ...]
    ranks: tuple[RankFiles, ...]
    aliases: dict[str, str]
    """Other names of tied parameters -> the name they are stored under."""
    files: dict[str, int] = field(default_factory=dict)
    """The checkpoint's other files (the model's config.json, generation_config.json) -> the
    xxh3 of their bytes: every byte of a checkpoint is checksummed."""

    def flat(self, name: str) -> FlatEntry | None:
        return next((f for f in self.flats if f.name == name), None)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, "world_size": self.world_size,
            "optimizer": self.optimizer, "chunk_bytes": self.chunk_bytes, "aliases": self.aliases,
            "files": {name: f"{h:016x}" for name, h in self.files.items()},
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
        for i, r in enumerate(ranks):  # names from the file are confined to the checkpoint's folder
            if r.data != DATA_FILE.format(i) or r.state != STATE_FILE.format(i):
                raise ValueError(f"rank {i} names files {r.data!r} and {r.state!r}; expected "
                                 f"{DATA_FILE.format(i)!r} and {STATE_FILE.format(i)!r} in the checkpoint's folder")
        files = {name: int(h, 16) for name, h in d.get("files", {}).items()}
        if not set(files) <= set(EXTRA_FILES):
            raise ValueError(f"names other files {sorted(set(files) - set(EXTRA_FILES))}; expected some of {EXTRA_FILES}")
        return cls(world_size=d["world_size"], optimizer=d["optimizer"], chunk_bytes=d["chunk_bytes"],
                   flats=flats, ranks=ranks, aliases=dict(d["aliases"]), files=files)


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
        raise CheckpointError(f"{str(path)!r}: unreadable manifest ({e})") from None


# ------------------------------------------------------------------------ finding checkpoints


def _numbered(root: Path) -> list[tuple[int, Path]]:
    """The `ckpt-N` folders in `root`, complete or not, oldest first."""
    if not root.is_dir():
        return []
    return sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _CKPT_RE.match(p.name)))


def verify_file(path: Path, expected: int) -> bytes:
    """The bytes of one of a checkpoint's other files, checked against the manifest's xxh3."""
    data = path.read_bytes()
    got = xxhash.xxh3_64_intdigest(data)
    if got != expected:
        raise CheckpointError(f"{str(path)!r}: checksum mismatch: the manifest says xxh3 {expected:016x}, the file "
                              f"hashes to {got:016x}; the file was changed or corrupted: restore it or load an "
                              "earlier checkpoint")
    return data


def not_own_checkpoint(path: Path) -> str:
    """Why `path` is not a checkpoint this user's tierzero published, in words ("" when it is):
    it must be a real folder (not a link) of this user holding a manifest that is a regular file
    of this user. Only such a folder is pruned (root counts only its own, as for every removal)."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return e.strerror or str(e)
    why = not_own(st, folder=True)
    if why:
        return f"{why}: tierzero follows no link" if stat.S_ISLNK(st.st_mode) else why
    try:
        mst = os.lstat(path / MANIFEST)
    except OSError:
        return f"no {MANIFEST}"
    if not_own(mst, folder=False):
        return f"its {MANIFEST} is not a regular file of this user"
    return ""


def next_number(root: Path) -> int:
    """The number of the next checkpoint in `root`: one past every `ckpt-N` folder there."""
    return max((n for n, _ in _numbered(root)), default=0) + 1


def checkpoints(root: str | os.PathLike[str]) -> list[Path]:
    """The complete checkpoints in `root`, oldest first."""
    return [p for _, p in _numbered(Path(root)) if (p / MANIFEST).is_file()]


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    """`root` itself when it is a checkpoint folder, else the newest complete checkpoint in it."""
    root = Path(root)
    if (root / MANIFEST).is_file():
        return root
    found = checkpoints(root)
    return found[-1] if found else None


def open_checkpoint(root: str | os.PathLike[str]) -> tuple[Path, Manifest]:
    """The checkpoint folder `root` names (per latest_checkpoint) and its verified manifest, the
    other files it lists verified too (the rank files' chunks are verified as they are read);
    CheckpointError when there is none or a file differs."""
    folder = latest_checkpoint(root)
    if folder is None:
        raise CheckpointError(f"{str(root)!r}: no checkpoint there (no {MANIFEST}, no complete {PREFIX}N folder)")
    manifest = read_manifest(folder / MANIFEST)
    for name, expected in manifest.files.items():
        verify_file(folder / name, expected)
    return folder, manifest

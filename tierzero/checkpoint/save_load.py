"""Checkpoints of a wrapped model: save and load its tiered state (and its optimizer's).

The format on disk is format.py's; the checksummed file IO is chunk_io.py's; the resharding
plans are reshard.py's. This module is the orchestration around them and the only part that
touches the model's runtime objects (its flat tensors and this rank's shards of their values and
of the optimizer's states: the runtime's RankShard), which it turns into region keys and bytes.
The steps of each: [Note: phases of a save] and [Note: phases of a load].
"""

from __future__ import annotations

import concurrent.futures as cf
import io
import os
import re
import shutil
import warnings
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
import xxhash
from torch import nn

from io_engine import (MARKER, PAGE, folder_mode, make_folder, make_private, mark_own, marked_own, owner_gone,
                       remove_if_empty_own, temp_name)
from tierzero import runtime
from tierzero.checkpoint.chunk_io import Reader, Source, double_buffered, open_engine, write_rank_files
from tierzero.checkpoint.format import (CHUNK_BYTES, EXTRA_FILES, MANIFEST, PREFIX, TMP_PREFIX, TRASH_PREFIX,
                                        VALUES, CheckpointError, FlatEntry, Manifest, RankFiles, checkpoints,
                                        latest_checkpoint, next_number, not_own_checkpoint, open_checkpoint, round_up,
                                        torch_dtype, write_manifest)
from tierzero.checkpoint.reshard import ReadOp, block_reshard_plan, on_blocks, reshard_plan
from tierzero.config import state_nbytes
from tierzero.formats import fsync_dir, persistent_buffers, write_config_files
from tierzero.layout import StateCodec, window_numel
from tierzero.optim import SavedState, TieredOptimizer
from tierzero.runtime import (FlatParam, RankShard, all_gather_objects, broadcast_object, model_dtype, rank_shards,
                              world)

_UNMARKED_TMP = re.compile(re.escape(TMP_PREFIX) + r"\d{8}-\d+")
"""The exact name of a save's temporary folder (`temp_name`): one without its marker yet is
removed by a later save only when empty (a kill came between its mkdir and its marker)."""

__all__ = ["save_checkpoint", "load_checkpoint", "persistent_buffers", "CheckpointError", "checkpoints",
           "latest_checkpoint"]


# ------------------------------------------------------------------------ the rank's tensors


class _Job(NamedTuple):
    """One stored tensor of this rank: its region key, its flat tensor and the name the manifest
    gives it, its kind in the checkpoint ("values" or a moment's kind), and this rank's shard of
    it (whatever the ZeRO stage: a rank that keeps the whole parameters, stages 1 and 2, saves
    its shard)."""

    key: str
    flat: FlatParam
    name: str
    kind: str
    shard: RankShard

    @property
    def numel(self) -> int:
        return self.shard.numel

    @property
    def nbytes(self) -> int:
        return self.shard.nbytes


def _jobs(state: runtime.TieredState, saved: SavedState | None) -> list[_Job]:
    """This rank's stored tensors, in the model's order: each flat tensor's values (the fp32
    master weights when there are any, else the parameters), then the optimizer's moments of
    the blocks it updates."""
    stored = rank_shards(state.flat_params(), saved.blocks if saved is not None else {})
    return [_Job(f"{s.name}/{kind}", s.flat, s.name, kind, shard)
            for s in stored for kind, shard in {VALUES: s.values, **s.states}.items()]


def _saved_state(state: runtime.TieredState, optimizer: object) -> SavedState | None:
    """What the checkpoint saves of `optimizer` (None: none); ValueError unless it is a tiered
    optimizer built on this model."""
    if optimizer is None:
        return None
    saved = optimizer.saved_state() if isinstance(optimizer, TieredOptimizer) else None
    if saved is None or not set(saved.flats) <= set(state.flat_params()):
        raise ValueError(f"checkpoint: expected a tz.AdamW / tz.SGD built on this model, got "
                         f"{type(optimizer).__name__}; pass the optimizer created with this model, or None")
    return saved


# ----------------------------------------------------------------------------- save


# [Note: phases of a save]
# Every rank: rank 0 picks the next number and makes `.tmp-ckpt-N/`; each rank preallocates its
# data file (a full disk fails here, before anything is written) and streams its tensors block
# by block: a tensor is read from its home tier into one of two page-aligned buffers (NVMe homes
# through io_engine) while the previous buffer's chunks are written with io_engine (O_DIRECT,
# checksummed as they go); files are fsynced; every rank learns every rank's outcome; rank 0
# writes the model's transformers config.json when it has one (for `tierzero export --to DIR`),
# then the manifest last, fsyncs it and the folder, renames the folder to `ckpt-N` and fsyncs
# DIR, then prunes to `keep_last`. A crash at any moment leaves either the old set of complete
# checkpoints or the new one; `.tmp-*` leftovers are ignored by load and removed by the next save.
def save_checkpoint(dir: str | os.PathLike[str], model: nn.Module, optimizer: TieredOptimizer | None = None,
                    extra: Any = None, keep_last: int | None = None) -> Path:
    """Save the model's tiered state (and the optimizer's) as a new checkpoint in `dir`; returns
    its folder. `extra` (RNG states, data position, ...; anything torch.save takes with
    weights_only loading) is stored per rank and returned by load_checkpoint. keep_last: keep
    only that many newest checkpoints. Call it on every rank, between training steps."""
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"save_checkpoint: keep_last: expected None or an int >= 1, got {keep_last}")
    state = runtime.state_of(model)
    state.ctx.drain_updates()
    saved = _saved_state(state, optimizer)
    rank, world_size = world(state.ctx.group)
    group = state.ctx.group
    jobs = _jobs(state, saved)  # this rank's stored tensors, once: the files and the manifest
    root = Path(dir)
    names = None
    private = state.config.private_files
    if rank == 0:
        make_folder(root, private=private)
        for p in root.iterdir():  # leftovers of saves whose process was killed (only theirs: marked)
            if not p.name.startswith((TMP_PREFIX, TRASH_PREFIX)) or not owner_gone(p.name):
                continue
            if marked_own(p):
                shutil.rmtree(p, ignore_errors=True)
            elif _UNMARKED_TMP.fullmatch(p.name):  # killed between its mkdir and its marker
                remove_if_empty_own(p)
        seq = next_number(root)
        names = (temp_name(TMP_PREFIX, f"{seq:08d}"), f"{PREFIX}{seq:08d}")
        os.mkdir(root / names[0], folder_mode(private))
        mark_own(root / names[0])
    names = broadcast_object(names, group, world_size)
    tmp, final = root / names[0], root / names[1]
    # Every rank learns whether every other one succeeded (a failed rank must not leave the
    # others waiting in a collective); only then does rank 0 publish the checkpoint.
    try:
        outcome: RankFiles | str = _write_rank(tmp, rank, state, optimizer, jobs, extra)
    except Exception as e:
        outcome, failure = f"rank {rank}: {e}", e
    except BaseException:  # interrupted: no collective may follow
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    else:
        failure = None
    every = all_gather_objects(outcome, group, world_size)
    errors = [o for o in every if isinstance(o, str)]
    if rank == 0 and not errors:
        try:
            files = _write_hf_config(state, tmp)
            _publish(root, tmp, final, _manifest(state, saved, jobs, world_size, every, files), private)
        except Exception as e:
            errors, failure = [f"rank 0: {e}"], e
    errors = broadcast_object(errors, group, world_size)
    if rank == 0 and not errors and keep_last is not None:
        _prune(root, keep_last)
    if errors:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        if failure is not None:
            raise failure
        raise RuntimeError(f"save_checkpoint: the save failed on other ranks ({'; '.join(errors)}); the "
                           "previous checkpoints are intact")
    return final


def _publish(root: Path, tmp: Path, final: Path, manifest: Manifest, private: bool) -> None:
    """Rank 0: the manifest last, fsynced; the folder (private: 0700, its files 0600) renamed
    into place, then its marker removed (under its final name a manifest says it is tierzero's)."""
    write_manifest(tmp / MANIFEST, manifest)
    if private:
        make_private(tmp)
    fsync_dir(tmp)
    os.rename(tmp, final)
    (final / MARKER).unlink()
    fsync_dir(root)


def _prune(root: Path, keep_last: int) -> None:
    """Rank 0, after a save is published: the checkpoints older than the newest `keep_last`
    removed, each only when it is a folder this user's tierzero published (`not_own_checkpoint`:
    a link, another user's folder or one without a manifest stays, and is not counted); a failure
    is a warning, not the save's error."""
    own = [p for p in checkpoints(root) if not not_own_checkpoint(p)]
    for old in own[:-keep_last]:
        try:
            trash = root / temp_name(TRASH_PREFIX, old.name)
            mark_own(old)
            os.rename(old, trash)  # a crash mid-delete leaves no half checkpoint under ckpt-*
            shutil.rmtree(trash)
        except OSError as e:
            warnings.warn(f"save_checkpoint: the new checkpoint is saved, but pruning {str(old)!r} (keep_last="
                          f"{keep_last}) failed: {e}; remove it by hand", stacklevel=3)


def _write_hf_config(state: runtime.TieredState, tmp: Path) -> dict[str, int]:
    """Rank 0: the model's transformers config.json (and generation_config.json), when it has a
    transformers `config`, so that `tierzero export CKPT --to DIR` can write a model folder; the
    xxh3 of each file written, for the manifest."""
    model = state.model
    if callable(getattr(getattr(model, "config", None), "save_pretrained", None)):
        write_config_files(model, tmp, model_dtype(state))
    return {name: xxhash.xxh3_64_intdigest((tmp / name).read_bytes()) for name in EXTRA_FILES
            if (tmp / name).is_file()}


def _manifest(state: runtime.TieredState, saved: SavedState | None, jobs: list[_Job], world_size: int,
              ranks: list[RankFiles], files: dict[str, int]) -> Manifest:
    formats: dict[FlatParam, dict[str, str]] = {}
    for j in jobs:  # in the model's order, a flat tensor's values first
        formats.setdefault(j.flat, {})[j.kind] = j.shard.format
    names = {j.flat: j.name for j in jobs}
    flats = []
    for flat, kinds in formats.items():
        steps = saved.steps(flat) if saved is not None and flat in saved.blocks else None
        flats.append(FlatEntry(name=names[flat], trainable=flat.trainable, layout=flat.layout,
                               dtypes=tuple(str(d).removeprefix("torch.") for d in flat.orig_dtypes),
                               kinds=kinds, steps=steps))
    canonical = {id(p): n for n, p in state.model.named_parameters()}
    aliases = {n: canonical[id(p)] for n, p in state.model.named_parameters(remove_duplicate=False)
               if canonical[id(p)] != n}
    optimizer = type(saved.optimizer).__name__ if saved is not None else None
    return Manifest(world_size=world_size, optimizer=optimizer,
                    chunk_bytes=CHUNK_BYTES, flats=tuple(flats), ranks=tuple(ranks), aliases=aliases, files=files)


GROUP_PARAMS = "param_fqns"
"""A saved param group's parameters, by the model's names for them (the rank's .pt file; a
checkpoint from before parameter groups has one group without them)."""


def _training_blob(state: runtime.TieredState, optimizer: TieredOptimizer | None, extra: Any,
                   buffers: dict[str, torch.Tensor]) -> bytes:
    blob = io.BytesIO()
    groups = []
    if optimizer is not None:
        names = {id(p): n for n, p in state.model.named_parameters()}
        groups = [{**{k: v for k, v in g.items() if k != "params"}, GROUP_PARAMS: [names[id(p)] for p in g["params"]]}
                  for g in optimizer.param_groups]
    torch.save({"param_groups": groups, "extra": extra,
                "buffers": {k: v.detach().to("cpu", copy=True) for k, v in buffers.items()}}, blob)
    return blob.getvalue()


def _write_rank(tmp: Path, rank: int, state: runtime.TieredState, optimizer: TieredOptimizer | None,
                jobs: list[_Job], extra: Any) -> RankFiles:
    sources = [Source(j.key, j.nbytes, j.shard.read_into) for j in jobs]
    blob = _training_blob(state, optimizer, extra, persistent_buffers(state.model))
    return write_rank_files(tmp, rank, sources, blob, state.config.io)


# ----------------------------------------------------------------------------- load


# [Note: phases of a load]
# The manifest's checksum, the model's layouts (a different model is refused before anything is
# touched), every rank file's presence and size are checked first; then each tensor's shard for
# this rank is planned from the saved layout (`reshard_plan`: a pure function of the old layout,
# the new one and the rank, so N ranks load into M), only the chunks holding those bytes are read
# and verified, and the tensor is stored to its home tier while the next one is read. A corrupt
# chunk fails the load with an error naming the file and byte range; the model is then partially
# loaded and must be loaded again before use.
def load_checkpoint(dir: str | os.PathLike[str], model: nn.Module,
                    optimizer: TieredOptimizer | None = None, *, convert_states: bool = False) -> Any:
    """Load the newest checkpoint in `dir` (or the checkpoint folder `dir`) into the wrapped
    model and optimizer, resharding when the world size differs; returns the `extra` saved by
    this rank (rank 0's when the checkpoint had fewer ranks). Call it on every rank.
    Optimizer states saved in another format (Config.optimizer_state_dtype) are refused unless
    `convert_states` ([Note: state formats in checkpoints])."""
    state = runtime.state_of(model)
    state.ctx.drain_updates(forget_failure=True)  # what a failed step left is replaced now
    saved = _saved_state(state, optimizer)
    rank, _ = world(state.ctx.group)
    folder, manifest = open_checkpoint(dir)
    jobs = _jobs(state, saved)
    _check_model(folder / MANIFEST, manifest, optimizer, jobs)
    _check_formats(folder / MANIFEST, manifest, jobs, rank, convert_states)
    with open_engine(state.config.io) as engine:
        reader = Reader(folder, manifest, engine)
        reader.check_files()
        state_rank = rank if rank < manifest.world_size else 0
        blob = reader.read_state(state_rank)
        buffers = persistent_buffers(model)
        if set(buffers) != set(blob["buffers"]):
            raise CheckpointError(
                f"{str(folder / manifest.ranks[state_rank].state)!r} holds buffers {sorted(blob['buffers'])[:6]}, "
                f"this model has {sorted(buffers)[:6]}; load it into the model it was saved from")
        if optimizer is not None:
            _check_groups(folder / manifest.ranks[state_rank].state, blob["param_groups"], state, optimizer)
        plans = [_read_plan(manifest, job, rank) for job in jobs]
        size = max((round_up(numel * dtype.itemsize) for dtype, _, numel in plans), default=PAGE)

        def read(i: int, buf: np.ndarray) -> torch.Tensor:
            """Job i's shard, in the saved dtype, in `buf`."""
            dtype, ops, numel = plans[i]
            dst = buf[:round_up(numel * dtype.itemsize)]
            reader.read_ops(jobs[i].key, ops, dtype.itemsize, dst)
            return torch.from_numpy(dst[:numel * dtype.itemsize]).view(dtype)

        def store(i: int, futures: list[cf.Future[torch.Tensor]]) -> None:
            job, saved_format = jobs[i], manifest.flat(jobs[i].name).kinds[jobs[i].kind]
            jobs[i].shard.write(_converted(futures[0].result(), saved_format, job))

        # one thread reads the next shard while this one stores the current one to its tier
        with cf.ThreadPoolExecutor(1, thread_name_prefix="tierzero-ckpt-read") as ahead:
            double_buffered(len(jobs), size, lambda i, buf: [ahead.submit(read, i, buf)], store)
    with torch.no_grad():
        for name, buf in buffers.items():
            buf.copy_(blob["buffers"][name])
    if saved is not None:
        saved.load_groups([{k: v for k, v in g.items() if k != GROUP_PARAMS} for g in blob["param_groups"]], None)
        for job in jobs:
            if job.kind == VALUES and job.flat in saved.blocks:
                saved.set_steps(job.flat, manifest.flat(job.name).steps)
    return blob["extra"]


# [Note: state formats in checkpoints]
# A checkpoint stores each optimizer state in its format (Config.optimizer_state_dtype; the
# manifest's kinds name it): bf16 as bf16, int8 as this rank's bytes (codes, then one scale per
# block), never widened. A load into an optimizer whose states take another format is refused,
# naming both, unless `convert_states=True`, which widens the saved values to fp32 and stores
# them in the new format. bf16 and fp32 states reshard to any world size element by element;
# int8 states block by block (`block_reshard_plan`): every rank's shard starts on a block
# ([Note: shards on int8 blocks]), so a block's codes and scale move whole and the loaded
# states are the saved ones bit for bit. Blocks do not carry over where the parameters sit at
# other offsets (another compute dtype's alignment) or a saved shard starts inside a block (a
# checkpoint of 2+ ranks from before shards started on blocks): such a load is refused.
def _check_formats(path: Path, manifest: Manifest, jobs: list[_Job], rank: int, convert: bool) -> None:
    for job in jobs:
        if job.shard.codec is None:
            continue
        entry = manifest.flat(job.name)
        saved, mine = entry.kinds[job.kind], job.shard.format
        if saved != mine and not convert:
            raise CheckpointError(
                f"{str(path)!r} holds the optimizer state {job.kind!r} of {job.name!r} in {saved}, this "
                f"optimizer keeps it in {mine} (Config.optimizer_state_dtype); load with convert_states=True to "
                f"convert it, or set optimizer_state_dtype={saved!r}")
        if saved == "int8" and block_reshard_plan(entry.layout, job.flat.layout, rank) is None:
            raise CheckpointError(
                f"{str(path)!r} holds the optimizer state {job.kind!r} of {job.name!r} in int8 blocks "
                f"that do not carry over to this rank {rank} of {job.flat.layout.world_size}: saved by "
                f"{entry.layout.world_size} rank(s) with {'' if on_blocks(entry.layout) else 'shards starting inside blocks, '}"
                f"parameters at offsets {[s.offset for s in entry.layout.slots][:4]}..., here at "
                f"{[s.offset for s in job.flat.layout.slots][:4]}...; load it at the world size and compute_dtype it "
                "was saved with")


def _read_plan(manifest: Manifest, job: _Job, rank: int) -> tuple[torch.dtype, list[ReadOp], int]:
    """(saved dtype, read ops, elements read) of `job`'s shard for `rank`: an int8 state's bytes
    resharded block by block (checked by _check_formats), the rest element by element."""
    entry = manifest.flat(job.name)
    saved = entry.kinds[job.kind]
    if saved == "int8":
        ops = block_reshard_plan(entry.layout, job.flat.layout, rank)
        assert ops is not None  # _check_formats refused the load
        return torch.uint8, ops, state_nbytes(job.flat.layout.shard_numel, "int8")
    return torch_dtype(saved), reshard_plan(entry.layout, job.flat.layout, rank), job.flat.layout.shard_numel


def _converted(saved: torch.Tensor, saved_format: str, job: _Job) -> torch.Tensor:
    """`saved` (a shard in `saved_format`) as `job`'s shard takes it: values as they are (any
    floating dtype), a state in its own format, converted through fp32 when the formats differ."""
    codec = job.shard.codec
    if codec is None or saved_format == codec.dtype:
        return saved
    numel = job.flat.layout.shard_numel
    source = StateCodec(saved_format, unsigned=codec.unsigned)
    wide = source.decode(saved, numel, 0, numel, torch.zeros(window_numel(0, numel)))
    if codec.exact:
        return wide.clone()
    out = codec.zeros(numel)
    codec.encode(torch.cat([wide, torch.zeros(window_numel(0, numel) - numel)]), out, numel, 0, numel)
    return out


def _check_groups(path: Path, saved: list[dict[str, Any]], state: runtime.TieredState,
                  optimizer: TieredOptimizer) -> None:
    """The saved param groups are the optimizer's: as many, each of the same parameters (by name,
    when the checkpoint names them); else CheckpointError, before anything is loaded."""
    names = {id(p): n for n, p in state.model.named_parameters()}
    mine = [[names[id(p)] for p in g["params"]] for g in optimizer.param_groups]
    if len(saved) != len(mine):
        raise CheckpointError(f"{str(path)!r} holds {len(saved)} optimizer param group(s), this "
                              f"{type(optimizer).__name__} has {len(mine)}; build it with the groups it was saved with")
    for i, (group, ours) in enumerate(zip(saved, mine)):
        theirs = group.get(GROUP_PARAMS)
        if theirs is not None and theirs != ours:
            diff = sorted(set(theirs) ^ set(ours))[:4] or ["(the same parameters in another order)"]
            raise CheckpointError(f"{str(path)!r}: param group {i} was saved with {len(theirs)} parameters, this "
                                  f"optimizer's has {len(ours)} (differing: {diff}); build the optimizer with the "
                                  "groups it was saved with")


def _check_model(path: Path, manifest: Manifest, optimizer: TieredOptimizer | None, jobs: list[_Job]) -> None:
    """The manifest describes this model (and this optimizer's state): else CheckpointError."""
    mine = {j.name: j.flat for j in jobs if j.kind == VALUES}
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
        if job.kind not in saved[job.name].kinds:
            raise CheckpointError(
                f"{str(path)!r} holds no optimizer state {job.kind!r} for {job.name!r} (saved with "
                f"optimizer {manifest.optimizer}, loading into {type(optimizer).__name__}); load with "
                "optimizer=None, or use the optimizer the checkpoint was saved with")
    if optimizer is not None and manifest.optimizer is None:
        raise CheckpointError(f"{str(path)!r} was saved without an optimizer; load with optimizer=None")

"""Plain weights out of a checkpoint and into a wrapped model; the `tierzero export` command.

Export (`export_checkpoint`): the checkpoint's manifest and files are checked as for a load;
then, for every parameter (block by block in the saved order, then tied parameters' other
names), the block holding it is read whole from all the saved shards (one block in memory at a
time, every chunk verified), the parameter is cut out of it and cast to its original dtype (or
the one asked for), and written to one safetensors file, followed by the persistent buffers
from rank 0's state file. Exported to a folder instead, the same tensors (tied parameters once)
go through the transformers folder writer (tierzero/formats/hf_folder.py), next to the checkpoint's config.json: a transformers
model folder. No model and no tierzero runtime are needed: only the files.

Import (`load_weights`): a state dict, a torch.save'd one or a safetensors file goes into a
wrapped model through its ordinary load_state_dict, after checking that every parameter is
given (any one name of a tied parameter gives it); a transformers model folder is streamed into
the flat tensors shard by shard (tierzero/formats/weights.py resolves its keys as transformers does).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from io_engine import aligned_empty
from tierzero import runtime
from tierzero.checkpoint.chunk_io import Reader, open_engine
from tierzero.checkpoint.format import (VALUES, CheckpointError, FlatEntry, Manifest, open_checkpoint,
                                        round_up, torch_dtype)
from tierzero.checkpoint.reshard import range_ops
from tierzero.config import IOConfig, parse_size
from tierzero.formats import (CONFIG_FILE, CONFIG_FILES, TensorSpec, check_file_target, load_buffers,
                              load_safetensors, meta_model,
                              open_weights, original_format_specs, saved_dtype, write_safetensors, write_synced,
                              write_weights_folder)


def export_checkpoint(ckpt: str | os.PathLike[str], to: str | os.PathLike[str], *,
                      io_config: IOConfig | None = None, dtype: torch.dtype | None = None,
                      max_shard_size: int | str = "5GB") -> Path:
    """Write the model in checkpoint `ckpt` (a folder, or the newest checkpoint in it), reading
    one block at a time, as

    - `to` = FILE.safetensors: one file with every parameter under its name (tied parameters
      under each of their names) and the persistent buffers: a full state dict that plain
      PyTorch loads without tierzero; 0600, with its checksum in the metadata; an existing file
      there is replaced only when it is an earlier export (`check_file_target`);
    - `to` = a folder: the transformers folder format (tierzero/formats/hf_folder.py), which
      `AutoModelForCausalLM.from_pretrained(to)` loads: the checkpoint's config.json (saved
      from the model's transformers config; CheckpointError when there is none), tied
      parameters once, shards of at most `max_shard_size`, written whole or not at all.

    dtype casts floating tensors (None: the parameters' original dtypes)."""
    folder, manifest = open_checkpoint(ckpt)
    to = Path(to)
    as_folder = to.suffix != ".safetensors"
    if not as_folder:
        check_file_target(to, what="export")
    if as_folder and not (folder / CONFIG_FILE).is_file():
        raise CheckpointError(
            f"{str(folder)!r} holds no {CONFIG_FILE}: it was saved from a model without a transformers "
            f"`config` (or by an older tierzero), so it cannot be exported as a transformers folder; export "
            f"it to a .safetensors file instead (--to {to.name}.safetensors)")
    limit = parse_size(max_shard_size, what="export: max_shard_size")
    with open_engine(io_config or IOConfig()) as engine:
        reader = Reader(folder, manifest, engine)
        reader.check_files()
        chunks = _checkpoint_specs(reader, manifest, dtype, aliases=not as_folder)
        if not as_folder:
            return write_safetensors(to, [s for chunk in chunks for s in chunk],
                                     {"format": "pt", "tierzero_checkpoint": folder.name}, checksum=True)
        specs = _original_format(folder, chunks)
        return write_weights_folder(to, specs, limit, lambda tmp: _copy_configs(folder, tmp, dtype))


def _original_format(folder: Path, chunks: list[list[TensorSpec]]) -> list[TensorSpec]:
    """The folder's tensors as transformers' save_pretrained writes them by default (its
    conversions reverted, a mixture-of-experts model's experts one tensor each: see [Note:
    streamed conversions]), asked of the model class config.json names, built on the meta
    device; the model's own names without transformers installed or for a class it lacks."""
    try:
        import transformers  # optional dependency
    except ImportError:
        return [s for chunk in chunks for s in chunk]
    arch = (json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8")).get("architectures") or [None])[0]
    model_cls = getattr(transformers, arch, None) if isinstance(arch, str) else None
    if model_cls is None:
        return [s for chunk in chunks for s in chunk]
    return original_format_specs(meta_model(folder, model_cls=model_cls), chunks)


def _checkpoint_specs(reader: Reader, manifest: Manifest, dtype: torch.dtype | None, *,
                      aliases: bool) -> list[list[TensorSpec]]:
    """Every parameter (block by block in the saved order, then, with `aliases`, tied
    parameters' other names) and the persistent buffers from rank 0's state file, a list per
    flat tensor (the aliases and the buffers one more each)."""
    buffers = reader.read_state(0)["buffers"]
    cache: dict[str, torch.Tensor] = {}

    def full(entry: FlatEntry) -> torch.Tensor:
        """The block's whole flat values (one block cached at a time)."""
        if entry.name not in cache:
            cache.clear()
            layout, stored = entry.layout, torch_dtype(entry.kinds[VALUES])
            dst = aligned_empty(round_up(layout.numel * stored.itemsize))
            reader.read_ops(f"{entry.name}/{VALUES}", list(range_ops(layout, 0, layout.numel, 0)),
                            stored.itemsize, dst)
            cache[entry.name] = torch.from_numpy(dst[:layout.numel * stored.itemsize]).view(stored)
        return cache[entry.name]

    chunks: dict[Any, list[TensorSpec]] = {}
    where = {}
    for entry in manifest.flats:
        for slot, dt in zip(entry.layout.slots, entry.dtypes):
            where[slot.fqn] = (entry, slot, saved_dtype(torch_dtype(dt), dtype))
    for name in [*where, *(manifest.aliases if aliases else ())]:
        entry, slot, out = where[manifest.aliases.get(name, name)]
        chunks.setdefault(entry.name if name in where else "aliases", []).append(
            TensorSpec(name, tuple(slot.shape), out, lambda e=entry, s=slot, d=out:
                       full(e)[s.offset:s.offset + s.numel].to(d).view(s.shape)))
    for k, v in buffers.items():
        out = saved_dtype(v.dtype, dtype)
        chunks.setdefault(None, []).append(TensorSpec(k, tuple(v.shape), out, lambda v=v, d=out: v.to(d)))
    return list(chunks.values())


def _copy_configs(ckpt: Path, folder: Path, dtype: torch.dtype | None) -> None:
    """The checkpoint's config files into `folder`; config.json records `dtype` when given (the
    dtype transformers loads the values in)."""
    for name in CONFIG_FILES:
        if (ckpt / name).is_file():
            text = (ckpt / name).read_text(encoding="utf-8")
            if name == CONFIG_FILE and dtype is not None:
                config = json.loads(text)
                config["torch_dtype" if "torch_dtype" in config else "dtype"] = str(dtype).removeprefix("torch.")
                text = json.dumps(config, indent=2, sort_keys=True) + "\n"
            write_synced(folder / name, text)


def load_weights(model: nn.Module, source: str | os.PathLike[str] | dict[str, torch.Tensor]) -> None:
    """Start a wrapped model from plain weights: a state dict, a torch.save'd state dict file, a
    safetensors file, or a transformers model folder (sharded safetensors, streamed block by
    block: see tierzero/formats/weights.py). Every parameter must be given (tied parameters under any
    one of their names); ValueError naming the file(s) and the keys otherwise."""
    state = runtime.state_of(model)
    what = "state dict"
    if not isinstance(source, dict):
        path = Path(source)
        what = repr(str(path))
        if path.is_dir():
            _load_folder(state, path)
            return
        if not path.is_file():
            raise FileNotFoundError(f"load_weights: {what}: no such file; give a .safetensors file, a "
                                    "transformers model folder or a torch.save'd state dict")
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


def _load_folder(state: runtime.TieredState, path: Path) -> None:
    """Each flat tensor's shard read from the folder's files and stored in place (one block in
    memory at a time; every rank reads its own rows: no collective), then the buffers."""
    blocked = [f.name for f in state.flat_params() if not f.is_free]
    if blocked:
        raise RuntimeError(f"load_weights: blocks {blocked} are in use; load between training steps")
    plan = open_weights(state.model, path, strict=True)
    flats = state.flat_params()
    wanted = [f.shard_request for f in flats]
    with plan.source, contextlib.closing(plan.read_shards(wanted, state.ctx.rank)) as shards:
        for flat, shard in zip(flats, shards):
            with torch.profiler.record_function(f"tierzero::load_weights {flat.name}"):
                flat.store_values(shard.values)
        load_buffers(state.model, plan, state.ctx.device)

"""Plain weights out of a checkpoint and into a wrapped model; the `tierzero export` command.

Export (`export_checkpoint`): the checkpoint's manifest and files are checked as for a load;
then, for every parameter (block by block in the saved order, then tied parameters' other
names), the block holding it is read whole from all the saved shards (one block in memory at a
time, every chunk verified), the parameter is cut out of it and cast to its original dtype, and
written to one safetensors file, followed by the persistent buffers from rank 0's state file.
No model and no tierzero runtime are needed: only the files.

Import (`load_weights`): a state dict, a torch.save'd one or a safetensors file goes into a
wrapped model through its ordinary load_state_dict, after checking that every parameter is
given (any one name of a tied parameter gives it); a transformers model folder is streamed into
the flat tensors shard by shard (tierzero/weights.py resolves its keys as transformers does).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from torch import nn

from io_engine import aligned_empty
from tierzero import runtime
from tierzero.ckpt_format import VALUES, CheckpointError, FlatEntry, open_checkpoint, round_up, torch_dtype
from tierzero.ckpt_io import Reader, open_engine
from tierzero.config import IOConfig
from tierzero.reshard import range_ops
from tierzero.safetensors_file import TensorSpec, write_safetensors
from tierzero.weights import load_buffers, load_safetensors, open_weights


def export_checkpoint(ckpt: str | os.PathLike[str], to: str | os.PathLike[str], *,
                      io_config: IOConfig | None = None) -> Path:
    """Write the model in checkpoint `ckpt` (a folder, or the newest checkpoint in it) as one
    safetensors file with every parameter under its name in its original dtype (tied parameters
    under each of their names) and the persistent buffers, reading one block at a time: the
    file is a full state dict that plain PyTorch loads without tierzero."""
    folder, manifest = open_checkpoint(ckpt)
    with open_engine(io_config or IOConfig()) as engine:
        reader = Reader(folder, manifest, engine)
        reader.check_files()
        buffers = reader.read_state(0)["buffers"]
        cache: dict[str, torch.Tensor] = {}

        def full(entry: FlatEntry) -> torch.Tensor:
            """The block's whole flat values (one block cached at a time)."""
            if entry.name not in cache:
                cache.clear()
                layout, dtype = entry.layout, torch_dtype(entry.kinds[VALUES])
                dst = aligned_empty(round_up(layout.numel * dtype.itemsize))
                reader.read_ops(f"{entry.name}/{VALUES}", list(range_ops(layout, 0, layout.numel, 0)),
                                dtype.itemsize, dst)
                cache[entry.name] = torch.from_numpy(dst[:layout.numel * dtype.itemsize]).view(dtype)
            return cache[entry.name]

        specs, where = [], {}
        for entry in manifest.flats:
            for slot, dt in zip(entry.layout.slots, entry.dtypes):
                where[slot.fqn] = (entry, slot, torch_dtype(dt))
        for name in [*where, *manifest.aliases]:
            entry, slot, dtype = where[manifest.aliases.get(name, name)]
            specs.append(TensorSpec(name, tuple(slot.shape), dtype, lambda e=entry, s=slot, d=dtype:
                                    full(e)[s.offset:s.offset + s.numel].to(d).view(s.shape)))
        specs += [TensorSpec(k, tuple(v.shape), v.dtype, lambda v=v: v) for k, v in buffers.items()]
        return write_safetensors(to, specs, {"format": "pt", "tierzero_checkpoint": str(folder)})


def load_weights(model: nn.Module, source: str | os.PathLike[str] | dict[str, torch.Tensor]) -> None:
    """Start a wrapped model from plain weights: a state dict, a torch.save'd state dict file, a
    safetensors file, or a transformers model folder (sharded safetensors, streamed block by
    block: see tierzero/weights.py). Every parameter must be given (tied parameters under any
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
    plan = open_weights(state.model, path)
    with plan.source:
        for flat in state.flat_params():
            with torch.profiler.record_function(f"tierzero::load_weights {flat.name}"):
                flat.store_values(plan.read_shard(flat.layout, state.ctx.rank, flat.orig_dtypes))
        load_buffers(state.model, plan, state.pm.device)


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

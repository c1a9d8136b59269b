"""`tierzero export CKPT --to FILE.safetensors | DIR`: a checkpoint's model as plain weights
(tierzero.checkpoint.export does the work)."""

from __future__ import annotations

import argparse
import sys

import torch

from tierzero.checkpoint import export_checkpoint


def main(argv: list[str]) -> int:
    """`tierzero export CKPT --to model.safetensors | DIR`."""
    p = argparse.ArgumentParser(prog="tierzero export", description="write a checkpoint's model as one "
                                "safetensors file that plain PyTorch loads, or as a transformers model "
                                "folder that AutoModelForCausalLM.from_pretrained loads")
    p.add_argument("ckpt", help="a checkpoint folder, or a folder of checkpoints (the newest is used)")
    p.add_argument("--to", required=True, help="output: a .safetensors file, or a folder (config.json and "
                   "safetensors shards; the checkpoint must hold the model's config.json)")
    p.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="cast floating tensors to this dtype (default: the parameters' own)")
    p.add_argument("--max-shard-size", default="5GB", help="largest file of a folder (default 5GB)")
    args = p.parse_args(argv)
    try:
        out = export_checkpoint(args.ckpt, args.to, dtype=getattr(torch, args.dtype) if args.dtype else None,
                                max_shard_size=args.max_shard_size)
    except (OSError, ValueError) as e:  # CheckpointError is a ValueError
        print(f"tierzero export: {e}", file=sys.stderr)
        return 1
    size = out.stat().st_size if out.is_file() else sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size} bytes)")
    return 0

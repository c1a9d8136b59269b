"""ZeRO-3 memory per rank: bytes per tier of each rank for N = 1, 2, 4 ranks (gloo, this machine).

For each world size N the same GPT (same seed) is wrapped by N processes (torch.multiprocessing,
gloo, a FileStore) with parameters and optimizer states homed on NVMe and fp32 gradients on
host, and trains a few steps of tz.AdamW on its slice of the same global batch. Each rank
reports the bytes of training state homed on each tier ("state": its shards), the peak bytes
reserved per tier over the run ("peak": state plus staging buffers, cached copies and the
blocks gathered to the device) and the median step time. The table shows every rank and the
ratio of rank 0's state to the one-process state; --json prints one JSON object instead.

    python benchmarks/zero3_memory.py --nvme-dir runs/bench-zero3 [--world-sizes 1,2,4] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import tierzero as tz
from tierzero import runtime
from tierzero.layout import ROOT, block_fetch_bytes, blocks_of
from tierzero.models import GPT, GPTConfig
from tierzero.config.tiernames import Tier

TIERS = ("device", "host", "nvme")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvme-dir", default="runs/bench-zero3", help="swap folder (removed afterwards)")
    p.add_argument("--world-sizes", default="1,2,4", help="comma-separated numbers of ranks")
    p.add_argument("--d", type=int, default=384, help="model width")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="global batch (a multiple of every world size)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--budget-blocks", type=float, default=4.0,
                   help="device budget per rank = root block + this many of the largest block, as fetched")
    p.add_argument("--json", action="store_true")
    return p


def _rank(rank: int, world_size: int, args: argparse.Namespace, init_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=300))
    try:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=4,
                              n_embd=args.d))
        sizes = {name: block_fetch_bytes(ps, torch.float32, world_size)
                 for name, _, ps in blocks_of(model, tz.Config())}
        root = sizes.pop(ROOT)
        n_params = model.num_params()
        cfg = tz.Config(device_budget=root + int(args.budget_blocks * max(sizes.values())),
                        host_budget=8 * n_params * 4 // world_size + (256 << 20),
                        nvme_dir=args.nvme_dir, nvme_budget=6 * n_params * 4, params="nvme",
                        optimizer_states="nvme", grads="host", compute_dtype="float32")
        tz.wrap(model, cfg)
        pm = runtime.placement_manager(model)
        opt = tz.AdamW(model, lr=1e-3)
        g = torch.Generator().manual_seed(1)
        rows = slice(rank * args.batch // world_size, (rank + 1) * args.batch // world_size)
        times = []
        for _ in range(args.steps):
            x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
            y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
            t0 = time.perf_counter()
            model(x[rows], y[rows]).loss.backward()
            tz.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
            times.append(time.perf_counter() - t0)
        pm.flush()
        result = {
            "rank": rank, "params": n_params,
            "state": {t.value: sum(h.nbytes for h in pm.handles if h.home is t) for t in Tier},
            "peak": {t: pm.peak_bytes(t) for t in TIERS},
            "budget": {t: pm.budget(t) for t in TIERS},
            "step_s": statistics.median(times[1:] or times),
        }
        Path(out, f"rank{rank}.json").write_text(json.dumps(result))
        runtime.close(model)
    finally:
        dist.destroy_process_group()


def measure(args: argparse.Namespace, world_size: int) -> list[dict[str, Any]]:
    if args.batch % world_size:
        raise ValueError(f"--batch {args.batch} must be a multiple of every world size, got {world_size}")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(world_size, args, os.path.join(tmp, "init"), tmp),
                           nprocs=world_size, start_method="spawn")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world_size)]


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    worlds = [int(w) for w in args.world_sizes.split(",")]
    Path(args.nvme_dir).mkdir(parents=True, exist_ok=True)
    try:
        results = {n: measure(args, n) for n in worlds}
    finally:
        shutil.rmtree(args.nvme_dir, ignore_errors=True)
    base = results[worlds[0]][0]["state"]
    if args.json:
        print(json.dumps({"args": vars(args), "ranks": {str(n): r for n, r in results.items()}}, indent=2))
        return 0
    mib = lambda b: f"{b / 2**20:8.1f}"  # noqa: E731
    print(f"GPT d={args.d} layers={args.layers} vocab={args.vocab}: {results[worlds[0]][0]['params']:,} params; "
          "MiB per rank (state = shards homed there, peak = most reserved at once)")
    print(f"{'N':>2} {'rank':>4} | {'state dev':>9} {'state host':>10} {'state nvme':>10} | "
          f"{'peak dev':>9} {'peak host':>9} {'peak nvme':>9} | {'host x N/1':>10} {'nvme x N/1':>10} | step s")
    for n, ranks in results.items():
        for r in ranks:
            s, p = r["state"], r["peak"]
            ratio = {t: s[t] * n / base[t] if base[t] else float("nan") for t in ("host", "nvme")}
            print(f"{n:>2} {r['rank']:>4} | {mib(s['device']):>9} {mib(s['host']):>10} {mib(s['nvme']):>10} | "
                  f"{mib(p['device']):>9} {mib(p['host']):>9} {mib(p['nvme']):>9} | "
                  f"{ratio['host']:>10.4f} {ratio['nvme']:>10.4f} | {r['step_s']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

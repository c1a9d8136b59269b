"""ZeRO stages 1, 2, 3 on N = 1, 2, 4 gloo ranks: per-rank bytes per tier and comm bytes per step,
measured next to the model (tierzero.zero_model, `tierzero estimate`), and step time.

For each world size N the same GPT (same seed) is trained by N processes (torch.multiprocessing,
gloo, a FileStore), each on its slice of the same global batch, once per stage and gradient
dtype (one after another in the same processes). The placement is ZeRO-Offload's: parameters
homed on the device tier (the CPU standing in for it here), gradients and optimizer states on
the host, fp32 compute, tz.AdamW, gradients clipped. So every tier's peak is a figure the model
gives: the device holds the parameters (whole at stages 1 and 2, the rank's shard at 3, plus
at 3 the blocks gathered to compute: the root block and the block computed and the two
prefetched); the host holds the gradients and the optimizer states.

Per case and rank: the peak bytes reserved on each tier over the run next to the estimate
(`estimate(model, cfg, N).per_tier`: the per-rank state of the paper's model plus the device
working set), and the bytes of the collectives of the last step (tierzero.layout.CommBytes: gathered
outputs, reduced inputs) next to the traffic model (about 2Ψ elements for stages 1 and 2, 3Ψ for
3, less the block kept gathered from forward to backward). "ratio" columns are measured /
model; the script exits 1 when one is off by more than --tolerance. --json prints one object.

    python benchmarks/zero_stages.py [--world-sizes 1,2,4] [--grad-dtypes float32,bfloat16] [--json]
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
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
from tierzero.planning.estimates import estimate
from tierzero.models import GPT, GPTConfig

TIERS = ("device", "host", "nvme")
KINDS = ("all_gather", "reduce_scatter", "all_reduce")


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--world-sizes", default="1,2,4", help="comma-separated numbers of ranks")
    p.add_argument("--stages", default="1,2,3")
    p.add_argument("--grad-dtypes", default="float32,bfloat16")
    p.add_argument("--d", type=int, default=384, help="model width")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--batch", type=int, default=8, help="global batch (a multiple of every world size)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--tolerance", type=float, default=0.02, help="largest |measured / model - 1| accepted")
    p.add_argument("--json", action="store_true")
    return p


def model_of(args: argparse.Namespace) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=args.vocab, seq_len=args.seq, n_layer=args.layers, n_head=4, n_embd=args.d))


def config_of(stage: int, grad_dtype: str) -> tz.Config:
    return tz.Config(device_budget="4GiB", host_budget="4GiB", params="device", grads="host",
                     optimizer_states="host", compute_dtype="float32", zero_stage=stage, grad_dtype=grad_dtype)


def _case(rank: int, world_size: int, args: argparse.Namespace, stage: int, grad_dtype: str) -> dict[str, Any]:
    model = model_of(args)
    tz.wrap(model, config_of(stage, grad_dtype))
    pm = runtime.placement_manager(model)
    opt = tz.AdamW(model, lr=1e-3)
    g = torch.Generator().manual_seed(1)
    rows = slice(rank * args.batch // world_size, (rank + 1) * args.batch // world_size)
    times, comm = [], None
    for _ in range(args.steps):
        x = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        y = torch.randint(0, args.vocab, (args.batch, args.seq), generator=g)
        if world_size > 1:
            dist.barrier()  # every rank starts the step together: the time is the step's own
        t0 = time.perf_counter()
        model(x[rows], y[rows]).loss.backward()
        tz.clip_grad_norm_(model, 1.0)
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - t0)
        comm = runtime.step_comm_bytes(model)  # the last step's: the first records the trace
    pm.flush()
    assert comm is not None
    result = {"rank": rank, "peak": {t: pm.peak_bytes(t) for t in TIERS}, "budget": {t: pm.budget(t) for t in TIERS},
              "comm": comm.as_dict(), "step_s": statistics.median(times[1:] or times)}
    runtime.close(model)
    return result


def _rank(rank: int, world_size: int, args: argparse.Namespace, cases: list[tuple[int, str]], init_file: str,
          out: str) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    if world_size > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=600))
    try:
        results = {f"{stage}-{dt}": _case(rank, world_size, args, stage, dt) for stage, dt in cases}
        Path(out, f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        if world_size > 1:
            dist.destroy_process_group()


def measure(args: argparse.Namespace, world_size: int, cases: list[tuple[int, str]]) -> list[dict[str, Any]]:
    if args.batch % world_size:
        raise ValueError(f"--batch {args.batch} must be a multiple of every world size, got {world_size}")
    with tempfile.TemporaryDirectory() as tmp:
        mp.start_processes(_rank, args=(world_size, args, cases, os.path.join(tmp, "init"), tmp),
                           nprocs=world_size, start_method="spawn")
        return [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(world_size)]


def model_figures(args: argparse.Namespace, world_size: int, stage: int, grad_dtype: str) -> dict[str, Any]:
    est = estimate(model_of(args), config_of(stage, grad_dtype), world_size)
    assert est.per_rank is not None and est.comm is not None
    return {"params": est.params, "per_tier": est.per_tier, "home": est.home, "per_rank": est.per_rank.as_dict(),
            "comm": {**est.comm.as_dict(), "total": est.comm.total}}


def ratio(measured: float, model: float) -> float | None:
    return measured / model if model else (None if measured else 1.0)


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    worlds = [int(w) for w in args.world_sizes.split(",")]
    cases = [(int(s), dt) for dt in args.grad_dtypes.split(",") for s in args.stages.split(",")]
    rows, worst = [], 0.0
    for n in worlds:
        ranks = measure(args, n, cases)
        for stage, dt in cases:
            model = model_figures(args, n, stage, dt)
            for r in ranks:
                res = r[f"{stage}-{dt}"]
                comm_total = sum(res["comm"].values()) - (4 if n > 1 else 0)  # less the clip's fp32 norm
                row = {"world_size": n, "stage": stage, "grad_dtype": dt, "rank": res["rank"],
                       "peak": res["peak"], "estimate": model["per_tier"], "state_model": model["home"],
                       "comm": res["comm"], "comm_model": model["comm"], "step_s": res["step_s"],
                       "ratios": {**{t: ratio(res["peak"][t], model["per_tier"][t]) for t in TIERS},
                                  "comm": ratio(comm_total, model["comm"]["total"])}}
                worst = max([worst] + [abs(v - 1) for v in row["ratios"].values() if v is not None])
                rows.append(row)
    params = model_figures(args, 1, 3, "float32")["params"]
    if args.json:
        print(json.dumps({"args": vars(args), "params": params, "rows": rows, "worst": worst}, indent=2))
    else:
        _table(args, params, rows, worst)
    return 0 if worst <= args.tolerance else 1


def _table(args: argparse.Namespace, params: int, rows: list[dict[str, Any]], worst: float) -> None:
    mib = lambda b: f"{b / 2**20:8.2f}"  # noqa: E731
    print(f"GPT d={args.d} layers={args.layers} vocab={args.vocab}: Ψ = {params:,} params; fp32 compute, params "
          "on device, grads + AdamW states on host; MiB per rank: peak (est.); comm: last step, MiB (model)")
    print(f"{'N':>2} {'st':>2} {'grad':>8} {'rk':>2} | {'device peak (est.)':>19} | {'host peak (est.)':>19} | "
          f"{'nvme':>5} | {'AG':>7} {'RS':>7} {'AR':>7} {'(model)':>8} {'ratio':>6} | step s")
    for row in rows:
        p, e, c, m = row["peak"], row["estimate"], row["comm"], row["comm_model"]
        print(f"{row['world_size']:>2} {row['stage']:>2} {row['grad_dtype']:>8} {row['rank']:>2} | "
              f"{mib(p['device'])} ({mib(e['device'])}) | {mib(p['host'])} ({mib(e['host'])}) | "
              f"{p['nvme'] / 2**20:5.1f} | {mib(c['all_gather'])[2:]} {mib(c['reduce_scatter'])[2:]} "
              f"{mib(c['all_reduce'])[2:]} ({mib(m['total'])[2:]}) "
              f"{(row['ratios']['comm'] or 0):6.4f} | {row['step_s']:.3f}")
    print(f"largest |measured / model - 1| over peaks and comm bytes: {worst:.4f} (tolerance {args.tolerance})")


if __name__ == "__main__":
    sys.exit(main())

"""Prefetch policies side by side: none / lookahead / bytes / adaptive on a 24-block GPT, params
on NVMe, in scenarios of device budgets.

Each policy trains the same model (same seed, same batches) with tz.wrap + tz.AdamW under a
device budget of a few blocks, so blocks are read from NVMe every step; the policies take their
steps in turn, so load on the machine hits them alike. After warm-up steps (the first records
the trace) it measures step time and stall time (time compute waited for data, from the
placement manager's telemetry) per step and prints them side by side, with the stall share of
the step time. Each scenario (`--budget-blocks 2,4,8`: the device budget in blocks beside the
root block) runs all policies; the check line compares adaptive's stall with the best
hand-set built-in's plus 2 % of adaptive's step time. --json prints one JSON object instead.

    python benchmarks/prefetch.py --run-dir runs/bench-prefetch [--budget-blocks 2,4,8] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

import tierzero as tz
from tierzero import runtime
from tierzero.models import GPT, GPTConfig

POLICIES = {
    "none": tz.PrefetchConfig(policy="none", nvme_depth=0),
    "lookahead": tz.PrefetchConfig(policy="lookahead", depth=2, nvme_depth=4),
    "bytes": tz.PrefetchConfig(policy="bytes", reserve=0, nvme_depth=4),
    "adaptive": tz.PrefetchConfig(policy="adaptive", nvme_depth=4),
}
BUILTINS = ("none", "lookahead", "bytes")
"""The hand-set built-ins adaptive is checked against."""


class PolicyRun:
    """One policy's wrapped model, optimizer and measured steps."""

    def __init__(self, name: str, args: argparse.Namespace, budget_blocks: float) -> None:
        self.name, self.args = name, args
        torch.manual_seed(0)
        gcfg = GPTConfig(vocab_size=256, seq_len=args.seq, n_layer=args.layers, n_head=4, n_embd=args.d)
        model = GPT(gcfg)
        itemsize = 2 if args.compute_dtype == "bfloat16" else 4
        self.block_bytes = sum(p.numel() for p in model.blocks[0].parameters()) * itemsize
        root_bytes = sum(p.numel() for n, p in model.named_parameters() if not n.startswith("blocks.")) * itemsize
        budget = root_bytes + int(budget_blocks * self.block_bytes) + (1 << 20)
        # Host holds the fp32 gradients, master weights and moments (4x the parameters) plus room
        # to stage a few blocks, not the parameters themselves: every step reads them from NVMe.
        homes = 4 * model.num_params() * 4 + (model.num_params() * itemsize if args.params == "host" else 0)
        pinned_rounding = 2 if torch.cuda.is_available() else 1  # pinned buffers are powers of two
        host_budget = pinned_rounding * (homes + args.host_blocks * self.block_bytes) + (8 << 20)
        self.nvme_dir = Path(args.run_dir) / f"{name}-{budget_blocks:g}"
        shutil.rmtree(self.nvme_dir, ignore_errors=True)
        self.nvme_dir.mkdir(parents=True)
        cfg = tz.Config(device_budget=budget, host_budget=host_budget,
                        nvme_dir=str(self.nvme_dir) if args.params == "nvme" else None, nvme_budget="4GiB",
                        params=args.params, grads="host", optimizer_states="host",
                        compute_dtype=args.compute_dtype, prefetch=POLICIES[name])
        self.model = tz.wrap(model, cfg)
        self.pm = runtime.placement_manager(model)
        self.opt = tz.AdamW(model, lr=1e-4)
        self.steps: list[dict[str, Any]] = []

    def step(self, x: torch.Tensor, measure: bool) -> None:
        sync = torch.cuda.synchronize if self.pm.device.type == "cuda" else (lambda: None)
        x = x.to(self.pm.device)
        t0 = time.perf_counter()
        self.model(x, x).loss.backward()
        sync()
        t1 = time.perf_counter()
        if not self.args.no_optimizer:
            self.opt.step()
        self.opt.zero_grad()
        sync()
        t2 = time.perf_counter()
        stats = runtime.step_stats(self.model)
        if measure:
            self.steps.append({"step_s": t2 - t0, "fwd_bwd_s": t1 - t0, "stall_s": sum(stats.stall_s.values()),
                               "hits": stats.prefetch_hits, "misses": stats.prefetch_misses,
                               "bytes": stats.bytes_moved})

    def close(self) -> None:
        runtime.close(self.model)
        shutil.rmtree(self.nvme_dir, ignore_errors=True)

    def result(self) -> dict[str, Any]:
        step_s = statistics.median(s["step_s"] for s in self.steps)
        stall_s = statistics.median(s["stall_s"] for s in self.steps)
        return {
            "policy": self.name,
            "stall_s_each": [round(s["stall_s"], 4) for s in self.steps],
            "step_s_each": [round(s["step_s"], 3) for s in self.steps],
            "device": str(self.pm.device),
            "step_s": step_s,
            "fwd_bwd_s": statistics.median(s["fwd_bwd_s"] for s in self.steps),
            "stall_s": stall_s,
            "stall_fraction": stall_s / step_s,
            "prefetch_hits": self.steps[-1]["hits"],
            "prefetch_misses": self.steps[-1]["misses"],
            "bytes_per_step": self.steps[-1]["bytes"],
            "device_peak_bytes": self.pm.peak_bytes("device"),
            "device_budget_bytes": self.pm.budget("device"),
            "block_bytes": self.block_bytes,
        }


def run(args: argparse.Namespace, budget_blocks: float) -> list[dict[str, Any]]:
    """Every policy's step in turn, step by step, so machine load hits all of them alike."""
    runs = [PolicyRun(name, args, budget_blocks) for name in args.policies.split(",")]
    g = torch.Generator().manual_seed(1)
    try:
        for step in range(args.warmup + args.steps):
            x = torch.randint(0, 256, (args.batch, args.seq), generator=g)
            for r in runs:
                r.step(x, measure=step >= args.warmup)
        return [r.result() for r in runs]
    finally:
        for r in runs:
            r.close()


def check(results: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Adaptive's stall against the best hand-set built-in's plus 2 % of adaptive's step time."""
    by = {r["policy"]: r for r in results}
    builtins = [by[n] for n in BUILTINS if n in by]
    if "adaptive" not in by or not builtins:
        return None
    best = min(builtins, key=lambda r: r["stall_s"])
    a = by["adaptive"]
    bound = best["stall_s"] + 0.02 * a["step_s"]
    return {"best_builtin": best["policy"], "best_builtin_stall_s": best["stall_s"],
            "adaptive_stall_s": a["stall_s"], "bound_s": bound, "holds": a["stall_s"] <= bound}


def print_table(args: argparse.Namespace, budget_blocks: float, results: list[dict[str, Any]]) -> None:
    print(f"GPT {args.layers} blocks x d={args.d} ({results[0]['block_bytes'] / 2**20:.1f} MiB/block "
          f"{args.compute_dtype}) on {results[0]['device']}, batch {args.batch} x seq {args.seq}, params on "
          f"{args.params}, device budget = root + {budget_blocks:g} blocks; median of {args.steps} "
          f"steps after {args.warmup} warm-up{'; no optimizer step' if args.no_optimizer else ''}")
    print(f"{'policy':<10} {'step s':>8} {'fwd+bwd s':>9} {'stall s':>8} {'stall %':>8} {'hits':>6} "
          f"{'misses':>6} {'dev MiB/step':>12} {'->host MiB':>11} {'peak/budget':>12}")
    for r in results:
        b = r["bytes_per_step"]
        print(f"{r['policy']:<10} {r['step_s']:>8.3f} {r['fwd_bwd_s']:>9.3f} {r['stall_s']:>8.3f} "
              f"{100 * r['stall_fraction']:>7.1f}% "
              f"{r['prefetch_hits']:>6} {r['prefetch_misses']:>6} {b['device'] / 2**20:>12.1f} "
              f"{b['host'] / 2**20:>11.1f} {r['device_peak_bytes'] / r['device_budget_bytes']:>12.2f}")
    c = check(results)
    if c is not None:
        print(f"check: adaptive stall {c['adaptive_stall_s']:.4f} s <= best built-in ({c['best_builtin']}) "
              f"{c['best_builtin_stall_s']:.4f} s + 2 % of step = {c['bound_s']:.4f} s: "
              f"{'holds' if c['holds'] else 'FAILS'}")
    print()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run-dir", default="runs/bench-prefetch", help="folder for the NVMe swap files")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--budget-blocks", default="4", help="device budgets in blocks (+ root), comma list: "
                    "one scenario each, e.g. 2,4,8")
    ap.add_argument("--params", default="nvme", choices=["nvme", "host"], help="home tier of the parameters")
    ap.add_argument("--compute-dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--no-optimizer", action="store_true", help="time forward + backward only")
    ap.add_argument("--host-blocks", type=int, default=8, help="host staging room in blocks")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--policies", default="none,lookahead,bytes,adaptive")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    scenarios = [float(b) for b in args.budget_blocks.split(",")]
    setup = {k: getattr(args, k) for k in ("layers", "d", "batch", "seq", "host_blocks", "params",
                                           "compute_dtype", "no_optimizer", "warmup", "steps")}
    out = []
    for blocks in scenarios:
        results = run(args, blocks)
        out.append({"budget_blocks": blocks, "results": results, "check": check(results)})
        if not args.json:
            print_table(args, blocks, results)
    if args.json:
        print(json.dumps({"setup": setup, "scenarios": out}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

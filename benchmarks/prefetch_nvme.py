"""Prefetch policies where the state lives on NVMe: a built-in GPT (125m, 350m) with parameters,
gradients and optimizer states on NVMe, a device budget of a fraction of the fp32 parameters
and a host budget of 1 GiB (the configuration `tierzero tune` users tune), each policy on its
own wrapped copy of the model, taking turns of a few steps each (the same batches; load on the
machine hits all alike). After warm-up steps (the first records the trace) it measures per step the
step time (forward, backward, optimizer step), the stall (time the training loop waited for
data) and where it went (update: the overlapped step's update of a block; room; queued; write;
read; copy), and the waits of the update thread beside compute. Prints a table per model, or
one JSON object with --json.

    python benchmarks/prefetch_nvme.py --nvme-dir runs/bench-prefetch-nvme --models 125m,350m

Runs on an older tierzero too (PYTHONPATH=OLD_TREE): what that one does not report is absent.
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
from tierzero.models import build

POLICIES = {
    "none": {"policy": "none", "nvme_depth": 0},
    "lookahead": {"policy": "lookahead", "depth": 2, "nvme_depth": 4},
    "bytes": {"policy": "bytes", "nvme_depth": 4},
    "adaptive": {"policy": "adaptive", "nvme_depth": 4},
}


class PolicyRun:
    def __init__(self, name: str, model_name: str, args: argparse.Namespace) -> None:
        self.name = name
        torch.manual_seed(0)
        model = build(model_name, device="meta", vocab_size=256, seq_len=args.seq)
        n = sum(p.numel() for p in model.parameters())
        self.nvme = Path(args.nvme_dir) / f"{model_name}-{name}"
        shutil.rmtree(self.nvme, ignore_errors=True)
        self.nvme.parent.mkdir(parents=True, exist_ok=True)
        cfg = tz.Config(device_budget=int(args.device_fraction * 4 * n), host_budget=args.host_budget,
                        nvme_dir=str(self.nvme), params="nvme", grads="nvme", optimizer_states="nvme",
                        compute_dtype="float32", prefetch=tz.PrefetchConfig(**POLICIES[name]))
        self.model = tz.wrap(model, cfg)
        self.opt = tz.AdamW(self.model, lr=1e-4)
        self.rows: list[dict[str, Any]] = []

    def step(self, x: torch.Tensor, y: torch.Tensor, measure: bool) -> None:
        t0 = time.perf_counter()
        self.model(x, y).loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        step_s = time.perf_counter() - t0
        stats = runtime.step_stats(self.model)
        if measure:
            self.rows.append({"step_s": step_s, "stall_s": sum(stats.stall_s.values()),
                              "by_source": getattr(stats, "stall_s_by_source", None),
                              "background_wait_s": getattr(stats, "background_wait_s", None),
                              "nvme_read_bytes": stats.nvme_read_bytes, "nvme_write_bytes": stats.nvme_write_bytes})

    def close(self) -> None:
        runtime.close(self.model)
        shutil.rmtree(self.nvme, ignore_errors=True)

    def result(self) -> dict[str, Any]:
        med = lambda key: statistics.median(r[key] for r in self.rows)
        out = {"policy": self.name, "step_s": med("step_s"), "stall_s": med("stall_s"),
               "stall_s_each": [round(r["stall_s"], 4) for r in self.rows],
               "step_s_each": [round(r["step_s"], 3) for r in self.rows],
               "nvme_read_mb": med("nvme_read_bytes") / 1e6, "nvme_write_mb": med("nvme_write_bytes") / 1e6}
        out["stall_fraction"] = out["stall_s"] / out["step_s"]
        if self.rows[0]["by_source"] is not None:
            out["stall_by_source"] = {k: round(statistics.median(r["by_source"][k] for r in self.rows), 4)
                                      for k in self.rows[0]["by_source"]}
            out["background_wait_s"] = med("background_wait_s")
        return out


def run_model(model_name: str, args: argparse.Namespace) -> list[dict[str, Any]]:
    runs = []
    try:
        for name in args.policies.split(","):
            runs.append(PolicyRun(name, model_name, args))
        g = torch.Generator().manual_seed(1)
        batches = [torch.randint(0, 256, (args.batch, args.seq + 1), generator=g)
                   for _ in range(args.warmup + args.rounds * args.per_round)]
        for r in runs:
            for x in batches[:args.warmup]:
                r.step(x[:, :-1], x[:, 1:], measure=False)
        # [Note: rounds] Each policy takes `per_round` steps in a row, in turn: interleaving
        # single steps would let one model's background update and write-backs finish during
        # the other models' steps and hide its own stall. The first step of each turn inherits
        # that idle time and is not measured.
        for round_ in range(args.rounds):
            turn = batches[args.warmup + round_ * args.per_round:][:args.per_round]
            for r in runs:
                for k, x in enumerate(turn):
                    r.step(x[:, :-1], x[:, 1:], measure=k > 0)
        return [r.result() for r in runs]
    finally:
        for r in runs:
            r.close()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nvme-dir", default="runs/bench-prefetch-nvme")
    ap.add_argument("--models", default="125m,350m")
    ap.add_argument("--policies", default="none,lookahead,adaptive")
    ap.add_argument("--device-fraction", type=float, default=0.6, help="device budget / fp32 parameter bytes")
    ap.add_argument("--host-budget", default="1GiB")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=128)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=2, help="turns each policy takes")
    ap.add_argument("--per-round", type=int, default=3, help="steps in a row per turn (the first not measured)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    out = {"setup": vars(args), "models": {}}
    for model_name in args.models.split(","):
        results = run_model(model_name, args)
        out["models"][model_name] = results
        if not args.json:
            print(f"{model_name}: params, grads, states on NVMe; device {args.device_fraction:g} x fp32 params, host "
                  f"{args.host_budget}; batch {args.batch} x seq {args.seq}; median of "
                  f"{args.rounds * (args.per_round - 1)} steps")
            for r in results:
                src = r.get("stall_by_source")
                src = " ".join(f"{k}={v:.3f}" for k, v in src.items() if v >= 0.001) if src else "(not reported)"
                print(f"  {r['policy']:<10} step {r['step_s']:7.3f} s  stall {r['stall_s']:.3f} s "
                      f"({100 * r['stall_fraction']:.1f} %)  [{src}]  update thread waited "
                      f"{r.get('background_wait_s', float('nan')):.3f} s")
    if args.json:
        print(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Optimizer states split between host and NVMe: the NVMe bytes a step moves and its time, per
NVMe fraction, and "auto" against the best fixed host/NVMe share at three host budgets.

The built-in GPT (default: 125m, GPT-2 124M's shape) in fp32, parameters and gradients on the
host, optimizer states (fp32 master weights and AdamW's moments) split {"host": 1 - f, "nvme": f}
for each fraction f of --fractions, block by block ([Note: split placement]). Each run trains
--steps steps of one batch; the first (which records the trace) is left out of the figures, and
its update lands before the second starts (settled), as the last step's lands in it: each steady
step counts one update's traffic. Per run: the NVMe bytes read and written per steady step
(tierzero's counters), the states' bytes on NVMe (tz.tier_bytes), the step time. Every budget is
the placement plan's (tierzero.layout.PlacementPlan, [Note: one placement plan]): each fixed
fraction runs at its least host budget (its NVMe share is moved every step, not kept in spare
host memory); the device at the least budget of the states all on NVMe (no room for states).
Then, at three host budgets a quarter, a half and three quarters of the way from the least of the
states all on NVMe to the least of the states all on the host (room for that share of the
states), "auto" (optimizer_states="auto", grads=None) against the best
fixed share the plan accepts at that budget (the fewest NVMe bytes a step among
--compare-fractions), A B A B in the same process.

    .venv/bin/python benchmarks/split.py --nvme-dir runs/split [--model 125m] [--steps 4]
        [--fractions 0,0.25,0.5,0.75,1] [--shares 0.25,0.5,0.75] [--batch 1] [--seq 128] [--json]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

import torch

import tierzero as tz
from tierzero import runtime
from tierzero.config import format_size
from tierzero.models import build
from tierzero.planning.placement import placement_plan


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/split.py", description=__doc__.splitlines()[0])
    p.add_argument("--nvme-dir", default="runs/split")
    p.add_argument("--model", default="125m", help="a built-in model name (125m: GPT-2 124M's shape)")
    p.add_argument("--layers", type=int, default=None, help="override the model's layer count (smoke tests)")
    p.add_argument("--width", type=int, default=None, help="override the model's width (smoke tests)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--fractions", default="0,0.25,0.5,0.75,1", help="the fixed NVMe fractions run each at its least")
    p.add_argument("--shares", default="0.25,0.5,0.75",
                   help="the host budgets auto is compared at: these shares of the way from the states all on NVMe's "
                        "least host budget to all on the host's")
    p.add_argument("--compare-fractions", default="0,0.125,0.25,0.375,0.5,0.625,0.75,0.875,1",
                   help="the fixed NVMe fractions the best one at each host budget is chosen from")
    p.add_argument("--pairs", type=int, default=2, help="A B pairs of auto against the best fixed fraction")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def make_model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    overrides = {k: v for k, v in (("n_layer", args.layers), ("n_embd", args.width)) if v is not None}
    if "n_embd" in overrides:
        overrides["n_head"] = max(1, overrides["n_embd"] // 64)
    return build(args.model, seq_len=args.seq, **overrides)


def config(folder: Path | str, states: Any, host: int, device: int) -> tz.Config:
    return tz.Config(device_budget=device, host_budget=host, nvme_dir=str(folder), nvme_budget="64GiB",
                     compute_dtype="float32", params="host", grads=None, optimizer_states=states)


def split_of(f: float) -> Any:
    return "host" if f == 0 else "nvme" if f == 1 else {"host": 1 - f, "nvme": f}


def budgets(model: torch.nn.Module, args: argparse.Namespace) -> dict[str, Any]:
    """The plan's budgets: the device at the least of the states all on NVMe; each fixed
    fraction's least host budget; the three host budgets auto is compared at, with the best
    fixed share the plan accepts at each (the fewest NVMe bytes a step)."""
    on_nvme = placement_plan(model, config(args.nvme_dir, "nvme", 1 << 40, 1 << 40))
    device = on_nvme.need["device"]
    states = sum(t.nbytes for t in on_nvme.tensors if t.kind in ("master", "moments"))
    out: dict[str, Any] = {"device": device, "states": states, "fixed": {}, "auto": []}
    for f in fractions(args.fractions):
        out["fixed"][f] = placement_plan(model, config(args.nvme_dir, split_of(f), 1 << 40, device)).need["host"]
    steps = fractions(args.compare_fractions)
    on_host = placement_plan(model, config(args.nvme_dir, "host", 1 << 40, device)).need["host"]
    for share in fractions(args.shares):  # between the least of the states all on NVMe and all on the host
        host = on_nvme.need["host"] + int(share * (on_host - on_nvme.need["host"]))
        auto = placement_plan(model, config(args.nvme_dir, "auto", host, device))
        plans = [(placement_plan(model, config(args.nvme_dir, split_of(f), host, device)), f) for f in steps]
        plan, best = min(((p, f) for p, f in plans if not p.short()), key=lambda pf: (pf[0].nvme_step_bytes, -pf[1]))
        out["auto"].append({"share": share, "host": host, "auto_plan_nvme_bytes": auto.nvme_step_bytes,
                            "auto_split": auto.resolved.optimizer_states, "auto_grads": auto.resolved.grads,
                            "best_fraction": best, "best_plan_nvme_bytes": plan.nvme_step_bytes})
    return out


def fractions(text: str) -> list[float]:
    return [float(x) for x in text.split(",")]


def run(model_args: argparse.Namespace, name: str, states: Any, host: int, device: int,
        data: list[torch.Tensor]) -> dict[str, Any]:
    folder = Path(model_args.nvme_dir) / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    cfg = config(folder, states, host, device)
    model = tz.wrap(make_model(model_args), cfg)
    try:
        opt = tz.AdamW(model, lr=1e-4, weight_decay=0.1)
        steps = []
        for i, batch in enumerate(data):
            t0 = time.perf_counter()
            loss = model(batch[:, :-1], batch[:, 1:]).loss
            loss.backward()
            tz.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
            if i in (0, len(data) - 1):
                # Step 0's update lands in step 0, the last step's in the last: each steady step
                # then counts one update's bytes (its own), not its predecessor's beside its own.
                runtime.settle(model)
            stats = runtime.step_stats(model)
            steps.append({"step_s": time.perf_counter() - t0, "loss": loss.item(),
                          "nvme_read": stats.nvme_read_bytes, "nvme_write": stats.nvme_write_bytes})
        placed = tz.tier_bytes(model)["optimizer_states"]
    finally:
        runtime.close(model)
        shutil.rmtree(folder, ignore_errors=True)
    steady = steps[1:]
    return {"name": name, "states": states, "states_on_nvme": placed["nvme"], "states_bytes": sum(placed.values()),
            "step_s": statistics.median(s["step_s"] for s in steady),
            "steps_s": [round(s["step_s"], 3) for s in steady],
            "nvme_bytes_per_step": statistics.mean(s["nvme_read"] + s["nvme_write"] for s in steady),
            "nvme_read_per_step": statistics.mean(s["nvme_read"] for s in steady),
            "nvme_write_per_step": statistics.mean(s["nvme_write"] for s in steady),
            "losses": [s["loss"] for s in steps]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    probe = make_model(args)
    b = budgets(probe, args)
    g = torch.Generator().manual_seed(1)
    vocab = probe.config.vocab_size
    data = [torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g) for _ in range(args.steps)]
    fixed = []
    for f, host in b["fixed"].items():  # each at its least host budget
        fixed.append({"fraction": f, "host": host, **run(args, f"fixed-{f}", split_of(f), host, b["device"], data)})
        report_line(fixed[-1], args)
    compared = []
    for at in b["auto"]:
        pairs = []
        for _ in range(args.pairs):  # A B A B: auto, then the best fixed share, at the same budgets
            a = run(args, "auto", "auto", at["host"], b["device"], data)
            report_line(a, args)
            bf = run(args, f"best-{at['best_fraction']}", split_of(at["best_fraction"]), at["host"], b["device"], data)
            report_line(bf, args)
            pairs.append({"auto": a, "best_fixed": bf})
        compared.append({**at, "pairs": pairs,
                         "auto_over_best_step": [p["auto"]["step_s"] / p["best_fixed"]["step_s"] for p in pairs],
                         "auto_over_best_nvme": [p["auto"]["nvme_bytes_per_step"] / max(1, p["best_fixed"]["nvme_bytes_per_step"])
                                                 for p in pairs]})
        if not args.json:
            print(f"host {format_size(at['host'])} ({at['share']:g} of the way from the states on NVMe's least to on the host's): auto "
                  f"{at['auto_split']} plans {format_size(at['auto_plan_nvme_bytes'])}/step, best fixed "
                  f"{at['best_fraction']} {format_size(at['best_plan_nvme_bytes'])}/step; measured auto / best: step "
                  + ", ".join(f"{x:.2f}" for x in compared[-1]["auto_over_best_step"]) + "; NVMe bytes "
                  + ", ".join(f"{x:.2f}" for x in compared[-1]["auto_over_best_nvme"]), flush=True)
    result = {"model": args.model, "device": b["device"], "states": b["states"], "fixed": fixed, "auto": compared}
    if args.json:
        print(json.dumps(result))
    return result


def report_line(r: dict[str, Any], args: argparse.Namespace) -> None:
    if not args.json:
        share = r["states_on_nvme"] / max(1, r["states_bytes"])
        print(f"{r['name']:>10s}: states on NVMe {format_size(r['states_on_nvme']):>10s} ({share:.0%}), "
              f"NVMe {format_size(r['nvme_bytes_per_step']):>10s}/step (read {format_size(r['nvme_read_per_step'])}, "
              f"written {format_size(r['nvme_write_per_step'])}), step {r['step_s']:.2f} s {r['steps_s']}",
              flush=True)


if __name__ == "__main__":
    main()

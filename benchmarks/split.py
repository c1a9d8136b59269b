"""Optimizer states split between host and NVMe: the NVMe bytes a step moves and its time, per
NVMe fraction, and "auto" at a host budget that holds about half the states.

The built-in GPT (default: 125m, GPT-2 124M's shape) in fp32, parameters and gradients on the
host, optimizer states (fp32 master weights and AdamW's moments) split {"host": 1 - f, "nvme": f}
for each fraction f of --fractions, block by block ([Note: split placement]). Each run trains
--steps steps of one batch; the first (which records the trace) is left out of the figures, and
its update lands before the second starts (settled), as the last step's lands in it: each steady
step counts one update's traffic. Per run: the NVMe bytes read and written per steady step
(tierzero's counters, reads and writes apart), the states' bytes on
NVMe (tz.tier_bytes), the step time. Then "auto" (optimizer_states="auto" under a host budget
that holds the parameters, the gradients and about half the states beside the update's working
set, and a device budget with no room for states) against the best fixed fraction that fits the
same host budget, at that budget, as A B A B in the same process. Each fixed fraction runs at a
host budget that holds its host share of the states and no more (so its NVMe share is read and
written every step, not kept in spare host memory).

    .venv/bin/python benchmarks/split.py --nvme-dir runs/split [--model 125m] [--steps 4]
        [--fractions 0,0.25,0.5,0.75,1] [--batch 1] [--seq 128] [--json]
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
from tierzero.layout import ROOT, blocks_of
from tierzero.models import build


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/split.py", description=__doc__.splitlines()[0])
    p.add_argument("--nvme-dir", default="runs/split")
    p.add_argument("--model", default="125m", help="a built-in model name (125m: GPT-2 124M's shape)")
    p.add_argument("--layers", type=int, default=None, help="override the model's layer count (smoke tests)")
    p.add_argument("--width", type=int, default=None, help="override the model's width (smoke tests)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--fractions", default="0,0.25,0.5,0.75,1")
    p.add_argument("--pairs", type=int, default=2, help="A B pairs of auto against the best fixed fraction")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def make_model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    overrides = {k: v for k, v in (("n_layer", args.layers), ("n_embd", args.width)) if v is not None}
    if "n_embd" in overrides:
        overrides["n_head"] = max(1, overrides["n_embd"] // 64)
    return build(args.model, seq_len=args.seq, **overrides)


def budgets(model: torch.nn.Module, args: argparse.Namespace) -> dict[str, int]:
    """Device: the root and two blocks fetched (no room for states); host for the fixed fractions:
    everything; host for auto: params, grads, half the states and the update's working set."""
    cfg = tz.Config(compute_dtype="float32")
    sizes = {name: sum(p.numel() for _, p in ps) for name, _, ps in blocks_of(model, cfg)}
    root, block = sizes.pop(ROOT), max(sizes.values())
    n = sum(sizes.values()) + root
    device = 4 * (root + 3 * block)  # the root, the block computing, two fetched ahead: no block's states fit beside
    work = 3 * block * 20 + 4 * root * 2  # three blocks' params, grads and states in flight, the root's staging
    out = {"device": device, "host_auto": 8 * n + 6 * n + 12 * block + work}  # about half the states
    for f in fractions(args):  # params and grads, the host's share of the states (whole blocks: one more), the rest
        out[f"host_{f}"] = 8 * n + int((1 - f) * 12 * n) + (12 * block if 0 < f < 1 else 0) + work
    return out


def fractions(args: argparse.Namespace) -> list[float]:
    return [float(x) for x in args.fractions.split(",")]


def run(model_args: argparse.Namespace, name: str, states: Any, host: int, device: int,
        data: list[torch.Tensor]) -> dict[str, Any]:
    folder = Path(model_args.nvme_dir) / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    cfg = tz.Config(device_budget=device, host_budget=host, nvme_dir=str(folder), nvme_budget="64GiB",
                    compute_dtype="float32", params="host", optimizer_states=states)
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
    for f in fractions(args):  # each at a host budget that holds its host share and no more
        states = "host" if f == 0 else "nvme" if f == 1 else {"host": 1 - f, "nvme": f}
        fixed.append({"fraction": f, **run(args, f"fixed-{f}", states, b[f"host_{f}"], b["device"], data)})
        report_line(fixed[-1], args)
    fits = [r for r in fixed if b[f"host_{r['fraction']}"] <= b["host_auto"]] or fixed
    best = min(fits, key=lambda r: r["step_s"])  # the fastest fixed fraction that fits auto's host budget
    pairs = []
    for _ in range(args.pairs):  # A B A B: auto, then the best fixed fraction, both at auto's host budget
        a = run(args, "auto", "auto", b["host_auto"], b["device"], data)
        report_line(a, args)
        bf = run(args, f"best-{best['fraction']}", best["states"], b["host_auto"], b["device"], data)
        report_line(bf, args)
        pairs.append({"auto": a, "best_fixed": bf})
    result = {"model": args.model, "budgets": b, "fixed": fixed, "best_fraction": best["fraction"], "pairs": pairs,
              "auto_over_best": [p["auto"]["step_s"] / p["best_fixed"]["step_s"] for p in pairs]}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"auto / best fixed ({best['fraction']}): " + ", ".join(f"{x:.2f}" for x in result["auto_over_best"]))
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

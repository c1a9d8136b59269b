"""`tierzero train`: train a built-in GPT with tiered state and write a complete run folder.

The run folder holds:
- metrics.jsonl: one JSON object per step ("step", "loss", "lr", "step_s", "tokens_per_s",
  "stall_s", "prefetch_hits", "prefetch_misses", "bytes" {"device", "host", "nvme"} in use at
  the step's end, "moved_bytes" per destination tier, "nvme_read_bytes");
- trace.json: the Chrome trace of every move (open in https://ui.perfetto.dev);
- tiers.png: per-tier bytes over time and stall per step;
- summary.json: "state_bytes" (params + grads + optimizer states), "budgets" and
  "peak_bytes" (each {"device", "host", "nvme"}), "peak_rss", the model and the run's settings.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import sys
import time
from pathlib import Path

import torch

import tierzero as tz
from tierzero import data as tzdata
from tierzero.config import TIER_NAMES, format_size
from tierzero.estimate import Estimate, estimate
from tierzero.models import CONFIGS, build


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierzero train", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", choices=sorted(CONFIGS), help="built-in GPT size")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--device-budget", default="1GiB")
    p.add_argument("--host-budget", default="4GiB")
    p.add_argument("--nvme-dir", default=None, help="folder for swap files (on the fastest disk)")
    p.add_argument("--nvme-budget", default="256GiB")
    p.add_argument("--params", default=None, choices=TIER_NAMES,
                   help="home tier of parameters (default: nvme when --nvme-dir is given)")
    p.add_argument("--optimizer-states", default=None, choices=TIER_NAMES,
                   help="tier of fp32 master weights and moments (default: as --params)")
    p.add_argument("--grads", default=None, choices=TIER_NAMES,
                   help="tier of fp32 gradients (default: as --params)")
    p.add_argument("--run-dir", default="runs/train")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=10, help="linear warm-up steps before cosine decay")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0 = off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="text file to train on (default: the Python "
                   "standard library's source, read as bytes)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def _config(args: argparse.Namespace) -> tz.Config:
    params = args.params or ("nvme" if args.nvme_dir else "host")
    return tz.Config(device_budget=args.device_budget, host_budget=args.host_budget,
                     nvme_dir=args.nvme_dir, nvme_budget=args.nvme_budget, params=params,
                     grads=args.grads or params, optimizer_states=args.optimizer_states or params)


def check_room(model: torch.nn.Module, cfg: tz.Config) -> Estimate:
    """Fail at start, before anything is written, when a tier's budget cannot hold the state
    homed there, or when the disk under nvme_dir has less free space than the state placed on
    NVMe. (A device budget too small for the largest block is wrap's error.)"""
    est = estimate(model, cfg)
    flags = {"device": "--device-budget", "host": "--host-budget", "nvme": "--nvme-budget"}
    for tier in TIER_NAMES:
        budget = getattr(cfg, f"{tier}_budget")
        if est.home[tier] > budget:
            raise ValueError(
                f"{flags[tier]} {format_size(budget)} is too small: this model needs "
                f"{format_size(est.home[tier])} ({est.home[tier]} bytes) on {tier} with params={cfg.params}, "
                f"grads={cfg.grads}, optimizer_states={cfg.optimizer_states}; raise {flags[tier]} "
                "or move state to a lower tier (--params/--grads/--optimizer-states nvme)")
    if est.home["nvme"]:
        root = Path(cfg.nvme_dir).resolve()
        while not root.exists():
            root = root.parent
        free = shutil.disk_usage(root).free
        if est.home["nvme"] > free:
            raise OSError(
                f"--nvme-dir {cfg.nvme_dir}: the disk holding it has {format_size(free)} free but "
                f"the state placed on NVMe needs {format_size(est.home['nvme'])} "
                f"({est.home['nvme']} bytes); free space there or pick a larger disk")
    return est


def _lr_lambda(warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


class _Progress:
    """A status line on stderr: rewritten in place on a terminal, one line per step otherwise
    (so logs keep it)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.tty = total, enabled, sys.stderr.isatty()

    def update(self, step: int, text: str) -> None:
        if not self.enabled:
            return
        width = 24
        filled = int(width * step / max(1, self.total))
        line = f"[{'#' * filled}{'.' * (width - filled)}] {step}/{self.total} {text}"
        sys.stderr.write(f"\r{line}" if self.tty else f"{line}\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            sys.stderr.write("\n")


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # kilobytes on Linux


def run(args: argparse.Namespace) -> dict:
    from tierzero.runtime import close, placement_manager, step_stats

    for name in ("steps", "batch", "seq"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}: expected an int >= 1, got {getattr(args, name)}")
    run_dir = Path(args.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = _config(args)
    corpus = tzdata.file_corpus(args.data) if args.data else tzdata.stdlib_corpus()
    sampler = tzdata.BatchSampler(corpus, batch=args.batch, seq=args.seq, seed=args.seed)

    torch.manual_seed(args.seed)
    seq_len = max(args.seq, 1)
    model = build(args.model, device="meta", vocab_size=tzdata.VOCAB_SIZE, seq_len=seq_len)
    n_params = model.num_params()
    est = check_room(model, cfg)
    model = tz.wrap(model, cfg)
    try:
        pm = placement_manager(model)
        opt = tz.AdamW(model, lr=args.lr, weight_decay=args.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(args.warmup, args.steps))

        progress = _Progress(args.steps, not args.no_progress)
        tokens = args.batch * args.seq
        started = time.perf_counter()
        last_loss = float("nan")
        with open(run_dir / "metrics.jsonl", "w") as metrics:
            for step in range(args.steps):
                t0 = time.perf_counter()
                x, y = sampler.next()
                x, y = x.to(pm.device), y.to(pm.device)
                loss = model(x, y).loss
                loss.backward()
                if args.clip > 0:
                    tz.clip_grad_norm_(model, args.clip)
                opt.step()
                opt.zero_grad()
                sched.step()
                last_loss = loss.item()
                step_s = time.perf_counter() - t0
                stats = step_stats(model)
                row = {
                    "step": step, "loss": last_loss, "lr": sched.get_last_lr()[0], "step_s": step_s,
                    "tokens_per_s": tokens / step_s, "stall_s": sum(stats.stall_s.values()),
                    "stall_s_by_tier": stats.stall_s, "prefetch_hits": stats.prefetch_hits,
                    "prefetch_misses": stats.prefetch_misses,
                    "bytes": {t: pm.bytes_used(t) for t in TIER_NAMES},
                    "moved_bytes": stats.bytes_moved, "nvme_read_bytes": stats.nvme_read_bytes,
                }
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
                nvme_gbps = (stats.nvme_read_bytes + stats.bytes_moved["nvme"]) / step_s / 1e9
                progress.update(step + 1, f"loss {last_loss:.4f} {row['tokens_per_s']:.0f} tok/s "
                                f"dev {format_size(row['bytes']['device'])} "
                                f"host {format_size(row['bytes']['host'])} "
                                f"nvme {format_size(row['bytes']['nvme'])} io {nvme_gbps:.2f} GB/s")
                if not math.isfinite(last_loss):
                    raise FloatingPointError(f"step {step}: loss is {last_loss}; lower --lr or check the data")
        progress.close()
        pm.flush()
        pm.telemetry.write_chrome_trace(run_dir / "trace.json")
        state_bytes = est.state_bytes
        summary = {
            "model": args.model, "params": n_params, "steps": args.steps, "batch": args.batch,
            "seq": args.seq, "final_loss": last_loss, "wall_s": time.perf_counter() - started,
            "state_bytes": state_bytes,
            "budgets": {t: pm.budget(t) for t in TIER_NAMES},
            "peak_bytes": {t: pm.peak_bytes(t) for t in TIER_NAMES},
            "peak_rss": _peak_rss(),
            "config": cfg.to_dict(),
        }
        (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
        plot_run(run_dir)
        return summary
    finally:
        close(model)  # frees host memory and removes the swap files


def plot_run(run_dir: str | os.PathLike[str]) -> Path:
    """tiers.png from a run folder's trace.json and metrics.jsonl."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    trace = json.loads((run_dir / "trace.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((run_dir / "summary.json").read_text())
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(10, 7))
    end = max((e["ts"] + e.get("dur", 0)) / 1e6 for e in trace["traceEvents"] if "ts" in e)
    for tier in TIER_NAMES:
        pts = [(e["ts"] / 1e6, e["args"]["bytes"] / 2**20) for e in trace["traceEvents"]
               if e.get("ph") == "C" and e.get("name") == f"{tier} bytes"]
        if pts:
            pts.append((end, pts[-1][1]))  # a counter is recorded on change: hold it to the end
            ts, mib = zip(*pts)
            line, = ax1.step(ts, mib, where="post", label=f"{tier}")
            ax1.axhline(summary["budgets"][tier] / 2**20, color=line.get_color(), ls="--", lw=0.8)
    ax1.set_xlabel("seconds")
    ax1.set_ylabel("MiB reserved (dashed: budget)")
    ax1.set_yscale("symlog")
    ax1.legend(loc="upper right")
    ax1.set_title(f"tierzero train --model {summary['model']}: bytes per tier")
    steps = [r["step"] for r in rows]
    ax2.bar(steps, [r["step_s"] for r in rows], color="lightgray", label="step s")
    ax2.bar(steps, [r["stall_s"] for r in rows], color="tab:red", label="stall s")
    ax2.set_xlabel("step")
    ax2.set_ylabel("seconds")
    ax2.legend(loc="upper right")
    fig.tight_layout()
    out = run_dir / "tiers.png"
    fig.savefig(out, dpi=90)
    plt.close(fig)
    return out


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        summary = run(args)
    except (ValueError, OSError) as e:
        print(f"tierzero train: error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({k: summary[k] for k in ("model", "params", "steps", "final_loss",
                                              "wall_s", "state_bytes", "budgets", "peak_bytes",
                                              "peak_rss")}, indent=2))
    return 0

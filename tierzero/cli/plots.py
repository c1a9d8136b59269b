"""tiers.png: a run folder's per-tier bytes over time and stall per step, drawn with matplotlib
from its trace.json, metrics.jsonl and summary.json."""

from __future__ import annotations

import json
import os
from pathlib import Path

from matplotlib.figure import Figure

from tierzero.config import TIER_NAMES


def plot_run(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None, *,
             trace: dict | None = None, summary: dict | None = None) -> Path:
    """tiers.png (or `out`) from a run folder's metrics.jsonl and its trace and summary (given,
    or read from trace.json and summary.json)."""
    run_dir = Path(run_dir)
    trace = trace if trace is not None else json.loads((run_dir / "trace.json").read_text())
    summary = summary if summary is not None else json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    fig = Figure(figsize=(10, 7))  # no pyplot: no global backend, nothing left open
    ax1, ax2 = fig.subplots(2, 1)
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
    out = Path(out) if out is not None else run_dir / "tiers.png"
    fig.savefig(out, dpi=90, format="png")
    return out

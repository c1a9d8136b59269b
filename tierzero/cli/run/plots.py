"""tiers.png: a run folder's story in one picture, drawn with matplotlib from its trace.json,
metrics.jsonl and summary.json.

Left, one panel per tier (device, host, NVMe), on a common time axis: the bytes reserved there
over time on a linear axis of the tier's own scale, and its budget as a dashed line. A budget far
above what the run used (an NVMe budget is the free disk) would flatten the curve against the
axis, so the axis then stops short of it and the panel says the budget and the share of it the
peak took. Right: the loss per step; the step time with the stall in it; the NVMe bytes read and
written per step.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from matplotlib.axes import Axes
from matplotlib.figure import Figure

from tierzero.config import TIER_NAMES, format_size

OFF_SCALE = 4.0
"""A budget more than this many times a tier's peak is written, not drawn."""
COLORS = {"device": "tab:green", "host": "tab:blue", "nvme": "tab:purple"}


def plot_run(run_dir: str | os.PathLike[str], out: str | os.PathLike[str] | None = None, *,
             trace: dict | None = None, summary: dict | None = None) -> Path:
    """tiers.png (or `out`) from a run folder's metrics.jsonl and its trace and summary (given,
    or read from trace.json and summary.json)."""
    run_dir = Path(run_dir)
    trace = trace if trace is not None else json.loads((run_dir / "trace.json").read_text())
    summary = summary if summary is not None else json.loads((run_dir / "summary.json").read_text())
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    fig = Figure(figsize=(13, 8.5))  # no pyplot: no global backend, nothing left open
    grid = fig.add_gridspec(3, 2, width_ratios=(3, 2))
    end = max(((e["ts"] + e.get("dur", 0)) / 1e6 for e in trace["traceEvents"] if "ts" in e), default=0.0)
    tiers = [fig.add_subplot(grid[i, 0]) for i in range(3)]
    for ax, tier in zip(tiers, TIER_NAMES):
        tier_panel(ax, tier, trace, summary, end)
    for ax in tiers[:-1]:
        ax.sharex(tiers[-1])
        ax.tick_params(labelbottom=False)
    tiers[-1].set_xlabel("seconds since the start of training")
    steps = [r["step"] for r in rows]
    loss, times, nvme = (fig.add_subplot(grid[i, 1]) for i in range(3))
    loss.plot(steps, [r["loss"] for r in rows], color="tab:orange", lw=1.5)
    loss.set_ylabel("loss")
    loss.set_title("training loss per step", fontsize=10)
    times.bar(steps, [r["step_s"] for r in rows], color="lightgray", label="step time")
    times.bar(steps, [r["stall_s"] for r in rows], color="tab:red", label="of which stalled on data")
    times.set_ylabel("seconds")
    times.set_title("step time and stall", fontsize=10)
    times.legend(loc="upper right", fontsize=8)
    mib = 2**20
    nvme.plot(steps, [r.get("nvme_read_bytes", 0) / mib for r in rows], color="tab:purple", label="read")
    nvme.plot(steps, [r.get("nvme_write_bytes", 0) / mib for r in rows], color="tab:purple", ls="--", label="written")
    nvme.set_ylim(bottom=0)
    nvme.set_ylabel("MiB per step")
    nvme.set_xlabel("step")
    nvme.set_title("NVMe traffic", fontsize=10)
    nvme.legend(loc="lower right", fontsize=8)
    for ax in (loss, times):
        ax.sharex(nvme)
        ax.tick_params(labelbottom=False)
    fig.suptitle(f"tierzero train --model {summary['model']}: bytes on each tier against its budget, and the steps")
    fig.tight_layout()
    out = Path(out) if out is not None else run_dir / "tiers.png"
    fig.savefig(out, dpi=90, format="png")
    return out


def tier_panel(ax: Axes, tier: str, trace: dict[str, Any], summary: dict[str, Any], end: float) -> None:
    """One tier's reserved bytes over time against its budget (module docstring)."""
    pts = [(e["ts"] / 1e6, e["args"]["bytes"]) for e in trace["traceEvents"]
           if e.get("ph") == "C" and e.get("name") == f"{tier} bytes"]
    if pts:
        pts.append((end, pts[-1][1]))  # a counter is recorded on change: hold it to the end
    budget = summary["budgets"][tier]
    peak = max(summary.get("peak_bytes", {}).get(tier, 0), max((b for _, b in pts), default=0))
    drawn = budget <= OFF_SCALE * max(peak, 1)
    top = max(budget if drawn else 0, peak, 1)
    unit, scale = ("GiB", 2**30) if top >= 2**31 else ("MiB", 2**20) if top >= 2**21 else ("KiB", 2**10)
    color = COLORS[tier]
    if pts:
        ts, nbytes = zip(*pts)
        ax.step(ts, [b / scale for b in nbytes], where="post", color=color, lw=1.2)
        ax.fill_between(ts, [b / scale for b in nbytes], step="post", color=color, alpha=0.25)
    ax.set_ylim(0, top / scale * 1.12)
    if drawn:
        ax.axhline(budget / scale, color=color, ls="--", lw=1.2)
        ax.text(0.01, budget / scale, f" budget {format_size(budget)}", transform=ax.get_yaxis_transform(),
                va="bottom", fontsize=8, color=color)
        title = f"{tier}: peak {format_size(peak)} of the {format_size(budget)} budget (dashed)"
    else:
        title = (f"{tier}: peak {format_size(peak)}; budget {format_size(budget)}, off the axis "
                 f"(the peak is {100 * peak / budget:.2g} % of it)")
    ax.set_ylabel(f"{tier}, {unit}")
    ax.set_title(title, fontsize=10, loc="left")

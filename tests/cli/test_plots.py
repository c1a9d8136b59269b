"""tiers.png's tier panels: each tier on a linear axis of its own scale, its budget drawn when it
is near what the run used and written in the title when it is far above (the free disk)."""

from __future__ import annotations

from matplotlib.figure import Figure

from tierzero.cli.run.plots import tier_panel

MIB = 2**20


def panel(budget: int, peak: int) -> tuple[str, tuple[float, float], int]:
    trace = {"traceEvents": [{"ph": "C", "name": "nvme bytes", "ts": 0, "args": {"bytes": peak // 2}},
                             {"ph": "C", "name": "nvme bytes", "ts": 1e6, "args": {"bytes": peak}}]}
    summary = {"budgets": {"nvme": budget}, "peak_bytes": {"nvme": peak}}
    ax = Figure().add_subplot()
    tier_panel(ax, "nvme", trace, summary, 2.0)
    dashed = [line for line in ax.get_lines() if line.get_linestyle() == "--"]
    return ax.get_title(loc="left"), ax.get_ylim(), len(dashed)


def test_a_budget_near_the_peak_is_drawn_and_one_far_above_is_written() -> None:
    title, (lo, hi), dashed = panel(budget=16 * MIB, peak=13 * MIB)
    assert dashed == 1 and lo == 0 and 16 <= hi < 20 and "of the 16.00 MiB budget" in title
    title, (lo, hi), dashed = panel(budget=256 * 2**30, peak=13 * MIB)
    assert dashed == 0 and 13 <= hi < 15  # the curve fills the panel, in MiB
    assert "budget 256.00 GiB, off the axis (the peak is 0.005 % of it)" in title

"""`tierzero tune`'s optimizer-state splits: "auto"'s choice and its neighbours, each predicted by
the tier model from the recording under the chosen prefetch setting and ranked by the predicted
step (tierzero.planning.split_tuning, [Note: splits predicted from a recording])."""

from __future__ import annotations

import argparse
from typing import Any

import tierzero as tz
from tierzero.cli.harness import meta_model
from tierzero.config import format_size
from tierzero.planning import Recording, TierModel, simulate, split_candidates, update_reads, with_split
from tierzero.prefetch import policy_from_config


def split_rows(args: argparse.Namespace, base: tz.Config, setting: tz.Config, recording: Recording,
               bench: dict | None) -> list[dict[str, Any]]:
    """Each candidate split of the optimizer states with its predicted stall and step under the
    prefetch `setting` (a Config with the chosen prefetch and io), least predicted step first."""
    model, _ = meta_model(args)
    workers = max(2, setting.prefetch.nvme_depth)
    rates = TierModel.calibrate(recording, bench, io_threads=setting.io.threads, workers=workers)
    rows = []
    for name, split, grads in split_candidates(model, base):
        cfg = setting.replace(optimizer_states=split, grads=grads)
        reads = update_reads(model, cfg)
        pred = simulate(with_split(recording, reads), policy_from_config(cfg), rates, workers=workers,
                        speedup=args.compute_speedup, nvme_depth=setting.prefetch.nvme_depth, as_recorded=recording)
        rows.append({"name": name, "optimizer_states": split, "update_nvme_read_bytes": sum(reads.values()),
                     "predicted_stall_s": round(pred.stall_s, 5), "predicted_step_s": round(pred.step_s, 5)})
    return sorted(rows, key=lambda r: (r["predicted_step_s"], r["update_nvme_read_bytes"]))


def split_lines(rows: list[dict[str, Any]], updates: bool) -> list[str]:
    """The splits' table for the report (`updates`: whether the recording has the step's updates)."""
    if not rows:
        return []
    lines = ["", "optimizer-state splits under the chosen prefetch setting (predicted from the recording: the "
             "updates' NVMe reads; their writes and a GPU's update speed are not modelled):",
             f"  {'split':<40} {'update reads':>12} {'pred stall s':>12} {'pred step s':>11}"]
    for r in rows:
        split = r["optimizer_states"]
        what = split if isinstance(split, str) else " ".join(f"{t}={f:.2f}" for t, f in split.items() if f)
        lines.append(f"  {r['name'] + ' (' + what + ')':<40} {format_size(r['update_nvme_read_bytes']):>12} "
                     f"{r['predicted_stall_s']:>12.4f} {r['predicted_step_s']:>11.3f}")
    if not updates:
        lines.append("  (the recording has no overlapped step's updates: the splits differ in none of it)")
    return lines

"""What `tierzero train` reports: each step's metrics.jsonl row, the run's summary.json (from
every rank's peaks), and the summary of a run that failed or was stopped. The fields are listed
in docs/cli.md ("The run folder")."""

from __future__ import annotations

import argparse
import contextlib
import json
import signal
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

from tierzero.cli.harness import peak_rss
from tierzero.cli.run.folder import RunDir
from tierzero.cli.run.stop import Stopped
from tierzero.cli.run.loop import Outcome, Run
from tierzero.config import TIER_NAMES
from tierzero.planning import step_traffic
from tierzero.runtime import step_comm_bytes, step_stats, tier_bytes


def step_row(r: Run, step: int, loss: float, step_s: float) -> dict:
    """The metrics.jsonl row of a step that took `step_s` and reached `loss` (the global mean);
    reading the step's counters resets them for the next."""
    args, pm = r.args, r.pm
    stats = step_stats(r.model)
    return {
        "step": step, "loss": loss, "lr": r.sched.get_last_lr()[0], "step_s": step_s,
        "tokens_per_s": args.micro_batches * args.batch * args.seq / step_s, "stall_s": sum(stats.stall_s.values()),
        "stall_s_by_tier": stats.stall_s, "stall_s_by_source": stats.stall_s_by_source,
        "background_wait_s": stats.background_wait_s,
        "prefetch_hits": stats.prefetch_hits,
        "prefetch_misses": stats.prefetch_misses,
        "bytes": {t: pm.bytes_used(t) for t in TIER_NAMES},
        "moved_bytes": stats.bytes_moved, "nvme_read_bytes": stats.nvme_read_bytes,
        "nvme_write_bytes": stats.nvme_write_bytes, "nvme_busy_s": stats.nvme_busy_s,
        "nvme_bytes": stats.nvme_by_kind, "comm_bytes": step_comm_bytes(r.model).as_dict(),
        "activation_bytes": stats.activation_bytes, "activation_stall_s": stats.activation_stall_s,
    }


def run_summary(r: Run, state_bytes: int, n_params: int, last_loss: float, started: float) -> dict:
    """The run's summary.json (less "files_not_written"), from every rank's peaks: every rank
    calls it."""
    args, pm, world_size = r.args, r.pm, r.world_size
    peaks = per_rank({t: pm.peak_bytes(t) for t in TIER_NAMES}, world_size)
    return {
        "model": args.model, "params": n_params, "steps": args.steps,
        "trainable_params": sum(p.numel() for p in r.model.parameters() if p.requires_grad),
        "batch": args.batch, "micro_batches": args.micro_batches,
        "seq": args.seq, "final_loss": last_loss, "wall_s": time.perf_counter() - started,
        "world_size": world_size, "state_bytes": state_bytes,
        "budgets": {t: pm.budget(t) for t in TIER_NAMES},
        "peak_bytes": {t: max(p[t] for p in peaks) for t in TIER_NAMES},
        "peak_bytes_per_rank": peaks,
        "peak_rss": max(per_rank(peak_rss(), world_size)),
        "nvme": _nvme_summary(r, n_params),
        "config": r.cfg.to_dict(),
        "placement": tier_bytes(r.model),  # each kind's bytes per tier on this rank (split placement)
    }


def _nvme_summary(r: Run, n_params: int) -> dict:
    """This rank's NVMe traffic per step (the mean over the steps after the first, which also
    writes the zero moments: all steps when there is one), the least traffic the placement
    needs (tierzero.traffic), and with the drive's rates the floor and step / floor."""
    rows = r.io_rows[1:] or r.io_rows
    mean = {k: sum(row[k] for row in rows) / len(rows) for k in rows[0]} if rows else {}
    least = step_traffic(n_params, r.cfg, world_size=r.world_size)
    out: dict = {"steps_measured": len(rows), "step_s": mean.get("step_s"),
                 "read_bytes": mean.get("nvme_read_bytes"), "write_bytes": mean.get("nvme_write_bytes"),
                 "busy_s": mean.get("nvme_busy_s"), "least": least.to_json(),
                 "drive": None if r.rates is None else r.rates.to_json(), "floor_s": None, "step_over_floor": None}
    if rows and r.rates is not None:
        floor = r.rates.floor_s(mean["nvme_read_bytes"], mean["nvme_write_bytes"])
        out["floor_s"] = floor
        out["step_over_floor"] = mean["step_s"] / floor if floor > 0 else None
    return out


def write_failure(folder: RunDir, args: argparse.Namespace, outcome: Outcome, e: BaseException) -> None:
    """summary.json of a run that failed or was stopped (what it got to, and why), and the
    traceback in error.log; best effort: the error itself is what the user must see."""
    stopped = isinstance(e, Stopped)
    summary = {"model": args.model, "steps": args.steps, "steps_completed": outcome.step,
               "checkpoint": str(outcome.checkpoint) if outcome.checkpoint else None,
               "stopped_by": signal.Signals(e.signum).name if stopped else None,
               "error": None if stopped else f"{type(e).__name__}: {e}"}
    files: dict[str, str] = {"summary.json": json.dumps(summary, indent=2)}
    if not stopped:
        files["error.log"] = "".join(traceback.format_exception(e))
    with contextlib.suppress(Exception):
        folder.write_each(files)


def dump_json(obj: object, path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f)


def global_mean(loss: torch.Tensor, world_size: int) -> float:
    """The loss over the global batch: the mean of the ranks' losses on equal slices."""
    if world_size > 1:
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
        loss = loss / world_size
    return loss.item()


def per_rank(value: object, world_size: int) -> list:
    """`value` of every rank, in rank order."""
    if world_size == 1:
        return [value]
    out: list = [None] * world_size
    dist.all_gather_object(out, value)
    return out

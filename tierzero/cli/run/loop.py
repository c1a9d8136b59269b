"""The step loop of `tierzero train`: a metrics row and a progress line per step, checkpoints
every --checkpoint-every steps and at a stop, and --resume from the newest one."""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Callable

import torch

import tierzero as tz
from io_engine import Progress
from tierzero.checkpoint import latest_checkpoint
from tierzero.cli.run.folder import METRICS, RunFolders, checkpoint_dir, disk_error
from tierzero.cli.run.stop import Stopped, StopSignals
from tierzero.config import format_size
from tierzero.formats import corpus as tzdata
from tierzero.placement import PlacementManager
from tierzero.planning import DriveRates
from tierzero.runtime import step_comm_bytes, step_stats


@dataclass
class Run:
    """A `tierzero train` run once its model is wrapped: what the steps, the checkpoints and the
    end of the run work with."""

    args: argparse.Namespace
    cfg: tz.Config
    rank: int
    world_size: int
    run_dir: Path
    sampler: tzdata.BatchSampler
    model: torch.nn.Module
    pm: PlacementManager
    """The model's PlacementManager."""
    opt: torch.optim.Optimizer
    sched: torch.optim.lr_scheduler.LRScheduler
    folders: RunFolders
    stop: StopSignals
    rates: DriveRates | None = None
    """The drive's rates (--bench-io or --read/--write-gbps), for the NVMe floor."""
    io_rows: list[dict] = field(default_factory=list)
    """Per step run: its time and this rank's NVMe bytes and busy time."""

    @property
    def ckpt_dir(self) -> Path:
        return checkpoint_dir(self.args)


@dataclass
class Outcome:
    """How far a run got, for the summary.json written when it fails or is stopped."""

    step: int = 0
    """Steps completed."""
    checkpoint: Path | None = None
    """The last checkpoint saved."""
    owns_folder: bool = False
    """The run folder is this run's to write (a failure's summary.json with it): at once for a new
    run (the folder was new, empty, or --overwrite), only once --resume has accepted the checkpoint
    for a resumed one. A refused --resume changes nothing in the folder it refused."""


def lr_lambda(warmup: int, total: int) -> Callable[[int], float]:
    """Linear warm-up over `warmup` steps, then cosine decay to a tenth at step `total`."""
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


RESUME_MUST_MATCH = ("model", "steps", "batch", "micro_batches", "seq", "seed", "data", "lr", "weight_decay", "warmup",
                     "clip")
"""The flags a resumed run must give as the run that saved the checkpoint did."""


def train_state(r: Run, step: int) -> dict:
    """What a checkpoint needs besides the model and optimizer to continue bit-identically."""
    return {"step": step, "sampler": r.sampler.state_dict(), "scheduler": r.sched.state_dict(),
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "run": {k: getattr(r.args, k) for k in RESUME_MUST_MATCH}}


def resume(r: Run) -> int:
    """Load the newest checkpoint and the training state saved with it; the step to continue at
    (0 when there is none). metrics.jsonl (rank 0's) keeps the rows of the steps before it."""
    ckpt_dir = r.ckpt_dir
    if latest_checkpoint(ckpt_dir) is None:
        print(f"tierzero train: --resume: no checkpoint in {str(ckpt_dir)!r}; starting at step 0", file=sys.stderr)
        return 0
    state = tz.load_checkpoint(ckpt_dir, r.model, r.opt)
    differ = {k: (v, getattr(r.args, k)) for k, v in state["run"].items() if getattr(r.args, k) != v}
    if differ:
        raise ValueError(f"--resume: the checkpoint in {str(ckpt_dir)!r} was saved by a run with other settings "
                         f"(name: (saved, given)) {differ}; resume with the same flags or start a new --run-dir")
    r.sampler.load_state_dict(state["sampler"])
    r.sched.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    if state["cuda_rng"]:
        torch.cuda.set_rng_state_all(state["cuda_rng"])
    if r.folders.run is not None:
        r.folders.run.keep_metrics_before(state["step"])
    return state["step"]


def train_steps(r: Run, start: int, outcome: Outcome, step: Callable[[Run, int], dict]) -> float:
    """Steps `start` to --steps, each run by `step` (which returns its metrics row): a
    metrics.jsonl row (rank 0) and a progress line each, a checkpoint every --checkpoint-every
    steps and at a stop ([Note: stopping at a step boundary] in stop.py); the last step's loss."""
    args = r.args
    last_loss = float("nan")
    # Each row counts its own step: the wrap's and the optimizer's first writes (and a resumed
    # checkpoint's reads) are not the first step's traffic, nor within the run's wall time.
    step_stats(r.model)
    step_comm_bytes(r.model)
    with Progress(args.steps, enabled=not args.no_progress and r.rank == 0, initial=start) as progress, \
            _metrics_file(r, start) as metrics:
        for i in range(start, args.steps):
            row = step(r, i)
            outcome.step = i + 1
            r.io_rows.append({k: row[k] for k in ("step_s", "nvme_read_bytes", "nvme_write_bytes", "nvme_busy_s")})
            last_loss = row["loss"]
            if metrics is not None:
                try:
                    metrics.write(json.dumps(row) + "\n")
                    metrics.flush()
                except OSError as e:
                    raise disk_error(e, r.folders.run.path / METRICS, r.folders.run.path, "--run-dir") from e
            progress.advance(_progress_text(row))
            if not math.isfinite(last_loss):
                raise FloatingPointError(f"step {i}: loss is {last_loss}; lower --lr or check the data")
            stop = r.stop.agreed(r.world_size) if args.checkpoint_every else None
            if stop is not None or (args.checkpoint_every and (i + 1) % args.checkpoint_every == 0):
                if metrics is not None:
                    os.fsync(metrics.fileno())  # the rows up to a checkpoint survive what kills the run
                try:
                    outcome.checkpoint = tz.save_checkpoint(r.ckpt_dir, r.model, r.opt, extra=train_state(r, i + 1),
                                                            keep_last=args.keep_last)
                except OSError as e:
                    raise disk_error(e, r.ckpt_dir, r.ckpt_dir, "--checkpoint-dir") from e
            if stop is not None:
                raise Stopped(stop, i + 1)
    return last_loss


def _metrics_file(r: Run, start: int) -> contextlib.AbstractContextManager[IO[str] | None]:
    """Rank 0: metrics.jsonl, appended to when resuming; other ranks: nothing."""
    if r.folders.run is None:
        return contextlib.nullcontext()
    return r.folders.run.open_metrics(resume=start > 0)


def _progress_text(row: dict) -> str:
    nvme_gbps = (row["nvme_read_bytes"] + row["nvme_write_bytes"]) / row["step_s"] / 1e9
    return (f"loss {row['loss']:.4f} {row['tokens_per_s']:.0f} tok/s "
            f"dev {format_size(row['bytes']['device'])} "
            f"host {format_size(row['bytes']['host'])} "
            f"nvme {format_size(row['bytes']['nvme'])} io {nvme_gbps:.2f} GB/s")

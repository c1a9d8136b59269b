"""`tierzero train`: train a model with tiered state and write a complete run folder.

`--model` is a built-in GPT (tiny ... 7b, on bytes of text) or a transformers model folder
(config.json + safetensors; built on the meta device and streamed in block by block, its own
tokenizer for `--data`); `--lora R` trains LoRA adapters over it, the base frozen (on `--frozen`'s
tier, read from its own files when that is nvme); `--export DIR` writes the trained model as a
transformers folder (with --lora, the adapters merged in).

The run folder holds:
- metrics.jsonl: one JSON object per step ("step", "loss", "lr", "step_s", "tokens_per_s",
  "stall_s", "prefetch_hits", "prefetch_misses", "bytes" {"device", "host", "nvme"} in use at
  the step's end, "moved_bytes" per destination tier, "nvme_read_bytes", "nvme_write_bytes"
  and "nvme_busy_s" (time with a swap file read or write in flight), "nvme_bytes" by kind
  {"params", "frozen", "grads", "master", "moments", "activations", "other"}: {"read", "write"}
  (frozen: the reads of a frozen base, such as LoRA's), "comm_bytes"
  {"all_gather", "reduce_scatter", "all_reduce"}: the bytes rank 0's collectives covered,
  "activation_bytes" {"device", "host", "nvme"}: what the step's forward saved for backward, by the
  tier it was kept on (--activations), and "activation_stall_s": the time compute waited for them);
- trace.json: the Chrome trace of every move (open in https://ui.perfetto.dev);
- tiers.png: per-tier bytes over time against the budgets, the loss, step time and stall, NVMe
  traffic per step;
- summary.json: "state_bytes" (params + grads + optimizer states), "nvme" (the mean step's NVMe
  bytes and busy time, the least traffic the placement needs, and with --bench-io FILE or
  --read-gbps/--write-gbps the floor: those bytes / the drive's rates, and step / floor), "budgets" and
  "peak_bytes" (each {"device", "host", "nvme"}, budgets and peaks per rank, peaks the largest
  over ranks), "peak_bytes_per_rank", "peak_rss", "placement" (tz.tier_bytes: each kind's bytes per
  tier on rank 0, a split's shares included), the model and the run's settings.

Under `torchrun --nproc-per-node N` (environment WORLD_SIZE > 1) the ranks form a process group
(NCCL with CUDA, gloo otherwise; --collective-timeout bounds every collective, so a rank that
raised or died stops the others with an error instead of a hang) and train with ZeRO
(--zero-stage, 3 by default): --batch is the global batch, split evenly over the ranks; rank 0
writes the run folder.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import torch
import torch.distributed as dist

import tierzero as tz
from io_engine import Progress
from tierzero.checkpoint import latest_checkpoint
from tierzero.cli.estimate import run_config
from tierzero.cli.flags import (activations_from_flags, add_activation_flags, add_placement_flags, add_rate_flags,
                                add_zero_flags, placement_from_flags, rates_from_flags, zero_from_flags)
from tierzero.cli.harness import (check_room, corpus, heads, meta_model, peak_rss, pretrained,
                                  with_lora)
from tierzero.cli.micro_batches import add_micro_batch_flag, check_micro_batches, forward_backward
from tierzero.cli.outputs import check_outputs
from tierzero.cli.plots import plot_run
from tierzero.cli.run_dir import RunDir, not_written
from tierzero.cli.stop import Stopped, StopSignals
from tierzero.config import TIER_NAMES, format_size
from tierzero.formats import corpus as tzdata
from tierzero.models import CONFIGS
from tierzero.placement import MAX_EVENTS, PlacementManager
from tierzero.planning import DriveRates, Estimate, step_traffic
from tierzero.runtime import RankRuntimeError, close, placement_manager, settle, step_comm_bytes, step_stats, tier_bytes


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierzero train", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="tiny", help=f"a built-in GPT ({', '.join(CONFIGS)}) or a "
                   "transformers model folder (config.json + safetensors) to fine-tune")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--compile", action="store_true", help="compile each block's forward with torch.compile "
                   "(tz.compile: inductor, the tiering hooks outside the graphs; docs/compile.md)")
    p.add_argument("--device-budget", default="1GiB")
    p.add_argument("--host-budget", default="4GiB")
    p.add_argument("--nvme-dir", default=None, help="folder for swap files (on the fastest disk)")
    p.add_argument("--nvme-budget", default="256GiB")
    add_placement_flags(p)
    add_zero_flags(p)
    add_activation_flags(p)
    add_micro_batch_flag(p)
    p.add_argument("--run-dir", default="runs/train")
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup", type=int, default=10, help="linear warm-up steps before cosine decay")
    p.add_argument("--clip", type=float, default=1.0, help="gradient norm clip (0 = off)")
    p.add_argument("--step-in-backward", action="store_true", help="update each block as soon as "
                   "backward has made its gradient final (gradients never reach NVMe; needs --clip 0)")
    add_rate_flags(p)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", default=None, help="text file, or JSONL with a \"text\" field per line, "
                   "to train on (default: the Python standard library's source, read as bytes); "
                   "tokenized by the model folder's tokenizer when it has one")
    p.add_argument("--export", default=None, metavar="DIR", help="at the end, write the trained model "
                   "as a transformers folder (config.json, safetensors shards, tokenizer) to DIR (with --lora: "
                   "the adapters merged in)")
    p.add_argument("--lora", type=int, default=0, metavar="R", help="train LoRA adapters of rank R on every "
                   "linear layer of a transformers folder's model, the base frozen (needs peft: the lora extra)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--file-mode", choices=("private", "umask"), default="private", help="permissions of the run "
                   "folder, checkpoints and export: private (0700 / 0600, the default) or umask (docs/safety.md)")
    p.add_argument("--collective-timeout", type=float, default=tz.Config.collective_timeout_s,
                   help="seconds a collective waits for the other ranks before the run fails "
                        "(under torchrun)")
    p.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="save a checkpoint every K steps (0 = never)")
    p.add_argument("--checkpoint-dir", default=None, help="where checkpoints go (default: RUN_DIR/checkpoints)")
    p.add_argument("--keep-last", type=int, default=2, help="checkpoints to keep (the newest)")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint, exactly "
                   "(model, optimizer, LR schedule, data position, RNG); starts afresh when there is none")
    return p


def _check_args(args: argparse.Namespace) -> None:
    if args.model not in CONFIGS and not Path(args.model).is_dir():
        raise ValueError(f"--model {args.model!r}: expected a built-in model ({', '.join(CONFIGS)}) or a "
                         "transformers model folder (config.json + model.safetensors or shards)")
    for name in ("steps", "batch", "seq"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}: expected an int >= 1, got {getattr(args, name)}")
    check_micro_batches(args)
    if args.step_in_backward and args.clip > 0:
        raise ValueError(f"--step-in-backward updates each block during backward, before the gradient norm "
                         f"is known, so it cannot clip: give --clip 0 with it (got --clip {args.clip})")
    if args.export and not pretrained(args):
        raise ValueError(f"--export writes a transformers model folder, and the built-in {args.model!r} GPT has no "
                         "transformers config; export its checkpoint instead: tierzero export CKPT --to "
                         "model.safetensors")
    if args.lora < 0 or (args.lora and not pretrained(args)):
        raise ValueError(f"--lora: expected a rank >= 1 with a transformers model folder, got --lora {args.lora} "
                         f"with --model {args.model!r}")
    if args.checkpoint_every < 0 or args.keep_last < 1:
        raise ValueError(f"--checkpoint-every: expected an int >= 0 and --keep-last an int >= 1, got "
                         f"{args.checkpoint_every} and {args.keep_last}")


def _config(args: argparse.Namespace) -> tz.Config:
    return tz.Config(device_budget=args.device_budget, host_budget=args.host_budget,
                     nvme_dir=args.nvme_dir, nvme_budget=args.nvme_budget,
                     collective_timeout_s=args.collective_timeout, step_in_backward=args.step_in_backward,
                     file_mode=args.file_mode,
                     **placement_from_flags(args), **zero_from_flags(args), **activations_from_flags(args))


def _init_distributed(cfg: tz.Config) -> tuple[int, int]:
    """(rank, world size); joins the process group torchrun describes in the environment."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    if world_size == 1:
        return 0, 1
    if not dist.is_initialized():
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",
                                timeout=datetime.timedelta(seconds=cfg.collective_timeout_s))
    return dist.get_rank(), dist.get_world_size()


def _lr_lambda(warmup: int, total: int):
    def f(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return f


@dataclass
class _Run:
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
    folders: "_Folders"
    stop: StopSignals
    rates: DriveRates | None = None
    """The drive's rates (--bench-io or --read/--write-gbps), for the NVMe floor."""
    io_rows: list[dict] = field(default_factory=list)
    """Per step run: its time and this rank's NVMe bytes and busy time."""

    @property
    def ckpt_dir(self) -> Path:
        return _ckpt_dir(self.args)


def _ckpt_dir(args: argparse.Namespace) -> Path:
    return Path(args.checkpoint_dir) if args.checkpoint_dir else Path(args.run_dir) / "checkpoints"


@dataclass
class _Folders:
    """Rank 0's locked run folder, and the checkpoint folder when it is elsewhere (other ranks:
    none; they only read checkpoints)."""

    run: RunDir | None = None
    ckpt: RunDir | None = None

    @classmethod
    def open(cls, args: argparse.Namespace, rank: int, *, private: bool = True) -> "_Folders":
        if rank != 0:
            return cls()
        folders = cls(RunDir(args.run_dir, private=private))
        try:
            ckpt = _ckpt_dir(args).absolute()
            if args.checkpoint_every and not ckpt.is_relative_to(folders.run.path.absolute()):
                folders.ckpt = RunDir(ckpt, flag="--checkpoint-dir", private=private)
        except BaseException:
            folders.close()
            raise
        return folders

    def check_room(self, args: argparse.Namespace, est: Estimate) -> None:
        """The disks under the folders hold what the run writes there (module docstring of run_dir.py)."""
        if self.run is None:
            return
        files = args.steps * METRICS_ROW_BYTES + min(args.steps * TRACE_EVENTS_PER_STEP, MAX_EVENTS) * TRACE_EVENT_BYTES
        checkpoints = (args.keep_last + 1) * est.state_bytes if args.checkpoint_every else 0
        if self.ckpt is None:
            self.run.check_room(files + checkpoints, "the run folder (metrics, trace, plot, checkpoints)")
        else:
            self.run.check_room(files, "the run folder (metrics, trace, plot)")
            self.ckpt.check_room(checkpoints, f"{args.keep_last + 1} checkpoints")

    def close(self) -> None:
        for folder in (self.ckpt, self.run):
            if folder is not None:
                folder.close()


METRICS_ROW_BYTES = 2048
TRACE_EVENTS_PER_STEP, TRACE_EVENT_BYTES = 4096, 200
"""What the room check counts for a step's metrics row and trace (generous: it guards a full disk)."""


def _train_state(r: _Run, step: int) -> dict:
    """What a checkpoint needs besides the model and optimizer to continue bit-identically."""
    return {"step": step, "sampler": r.sampler.state_dict(), "scheduler": r.sched.state_dict(),
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
            "run": {k: getattr(r.args, k) for k in _RESUME_MUST_MATCH}}


_RESUME_MUST_MATCH = ("model", "steps", "batch", "micro_batches", "seq", "seed", "data", "lr", "weight_decay", "warmup", "clip")


def _resume(r: _Run) -> int:
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


@dataclass
class _Outcome:
    """How far a run got, for the summary.json written when it fails or is stopped."""

    step: int = 0
    """Steps completed."""
    checkpoint: Path | None = None
    """The last checkpoint saved."""


def run(args: argparse.Namespace, outcome: _Outcome | None = None) -> dict:
    """Train as the flags say and write the run folder (rank 0); the run's summary. Everything
    the run needs is checked before its first step: flags, budgets, disks, the run folder's lock,
    the --export target. A failure (or a stop) leaves summary.json saying so."""
    outcome = outcome if outcome is not None else _Outcome()
    _check_args(args)
    rates = rates_from_flags(args)
    cfg = _config(args)
    rank, world_size = _init_distributed(cfg)
    if args.batch % world_size:  # main() prefixes the rank
        raise ValueError(f"--batch {args.batch} is the global batch and must split evenly "
                         f"over {world_size} ranks; give a multiple of {world_size}")
    check_outputs(args, _ckpt_dir(args))
    folders = _Folders.open(args, rank, private=cfg.private_files)
    try:
        return _run(args, cfg, rank, world_size, rates, folders, outcome)
    except BaseException as e:
        if folders.run is not None:
            _write_failure(folders.run, args, outcome, e)
        raise
    finally:
        folders.close()


def _run(args: argparse.Namespace, cfg: tz.Config, rank: int, world_size: int, rates: DriveRates | None,
         folders: _Folders, outcome: _Outcome) -> dict:
    torch.manual_seed(args.seed)
    model, tokenizer = meta_model(args)
    if args.lora:
        model = with_lora(model, args.lora)
    cfg = run_config(cfg, model, batch=args.batch // world_size, seq=args.seq, micro_batches=args.micro_batches,
                     chunked=args.chunked_loss, world_size=world_size)  # "auto" with the step's working set aside
    if rank == 0:
        print(f"tierzero train: training {heads(model)}", file=sys.stderr)
    sampler = tzdata.BatchSampler(corpus(args, tokenizer, model), batch=args.micro_batches * args.batch,
                                  seq=args.seq, seed=args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    est = check_room(model, cfg, world_size)
    folders.check_room(args, est)
    model = tz.wrap(model, cfg, weights=args.model if pretrained(args) else None)
    if args.compile:
        tz.compile(model)
    try:
        opt = tz.AdamW(model, lr=args.lr, weight_decay=args.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(args.warmup, args.steps))
        with StopSignals(at_step_boundary=bool(args.checkpoint_every)) as stop:
            r = _Run(args, cfg, rank, world_size, Path(args.run_dir), sampler, model, placement_manager(model),
                     opt, sched, folders, stop, rates)
            start = outcome.step = _resume(r) if args.resume else 0
            started = time.perf_counter()
            last_loss = _train(r, start, outcome)
            stop.at_step_boundary = False  # past the last step: a signal stops what follows at once
            if stop.requested is not None:
                raise Stopped(stop.requested)
            # The export first (a full disk under the run folder cannot lose the model), then the
            # run folder's files whatever the export did; summary.json names what failed.
            failed = _export(r, tokenizer) if args.export else []
            return _finish(r, est, n_params, last_loss, started, failed)
    finally:
        close(model)  # frees host memory and removes the swap files


def _write_failure(folder: RunDir, args: argparse.Namespace, outcome: _Outcome, e: BaseException) -> None:
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


def _export(r: _Run, tokenizer: tzdata.Tokenizer | None) -> list[dict[str, str]]:
    """--export: the trained model as a transformers folder (every rank gathers, rank 0 writes);
    a failure is returned (for summary.json), not raised."""
    try:
        out = tz.save_pretrained(r.model, r.args.export, merge_adapters=bool(r.args.lora))
        if r.rank == 0 and tokenizer is not None:
            tokenizer.save_pretrained(out)
    except Exception as e:
        return [not_written("export", Path(r.args.export).absolute(), e)]
    if r.rank == 0:
        print(f"tierzero train: exported the model to {out}", file=sys.stderr)
    return []


def _train(r: _Run, start: int, outcome: _Outcome) -> float:
    """Steps `start` to --steps: a metrics.jsonl row (rank 0) and a progress line each, a
    checkpoint every --checkpoint-every steps and at a stop ([Note: stopping at a step boundary]
    in stop.py); the last step's loss."""
    args = r.args
    last_loss = float("nan")
    # Each row counts its own step: the wrap's and the optimizer's first writes (and a resumed
    # checkpoint's reads) are not the first step's traffic, nor within the run's wall time.
    step_stats(r.model)
    step_comm_bytes(r.model)
    with Progress(args.steps, enabled=not args.no_progress and r.rank == 0, initial=start) as progress, \
            _metrics_file(r, start) as metrics:
        for step in range(start, args.steps):
            row = _step(r, step)
            outcome.step = step + 1
            r.io_rows.append({k: row[k] for k in ("step_s", "nvme_read_bytes", "nvme_write_bytes", "nvme_busy_s")})
            last_loss = row["loss"]
            if metrics is not None:
                metrics.write(json.dumps(row) + "\n")
                metrics.flush()
            progress.advance(_progress_text(row))
            if not math.isfinite(last_loss):
                raise FloatingPointError(f"step {step}: loss is {last_loss}; lower --lr or check the data")
            stop = r.stop.agreed(r.world_size) if args.checkpoint_every else None
            if stop is not None or (args.checkpoint_every and (step + 1) % args.checkpoint_every == 0):
                if metrics is not None:
                    os.fsync(metrics.fileno())  # the rows up to a checkpoint survive what kills the run
                outcome.checkpoint = tz.save_checkpoint(r.ckpt_dir, r.model, r.opt, extra=_train_state(r, step + 1),
                                                        keep_last=args.keep_last)
            if stop is not None:
                raise Stopped(stop, step + 1)
    return last_loss


def _metrics_file(r: _Run, start: int) -> contextlib.AbstractContextManager[IO[str] | None]:
    """Rank 0: metrics.jsonl, appended to when resuming; other ranks: nothing."""
    if r.folders.run is None:
        return contextlib.nullcontext()
    return r.folders.run.open_metrics(resume=start > 0)


def _step(r: _Run, step: int) -> dict:
    """One training step on this rank's slice of the global batch; its metrics.jsonl row."""
    args, pm = r.args, r.pm
    t0 = time.perf_counter()
    x, y = r.sampler.next()
    rows = args.micro_batches * args.batch
    local = slice(r.rank * rows // r.world_size, (r.rank + 1) * rows // r.world_size)
    x, y = x[local].to(pm.device), y[local].to(pm.device)
    loss = forward_backward(r.model, x, y, args.micro_batches, chunked=args.chunked_loss)
    if args.clip > 0:
        tz.clip_grad_norm_(r.model, args.clip)
    r.opt.step()
    r.opt.zero_grad()
    r.sched.step()
    last_loss = _global_mean(loss.detach(), r.world_size)
    step_s = time.perf_counter() - t0
    stats = step_stats(r.model)
    return {
        "step": step, "loss": last_loss, "lr": r.sched.get_last_lr()[0], "step_s": step_s,
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


def _progress_text(row: dict) -> str:
    nvme_gbps = (row["nvme_read_bytes"] + row["nvme_write_bytes"]) / row["step_s"] / 1e9
    return (f"loss {row['loss']:.4f} {row['tokens_per_s']:.0f} tok/s "
            f"dev {format_size(row['bytes']['device'])} "
            f"host {format_size(row['bytes']['host'])} "
            f"nvme {format_size(row['bytes']['nvme'])} io {nvme_gbps:.2f} GB/s")


def _finish(r: _Run, est: Estimate, n_params: int, last_loss: float, started: float,
            failed: list[dict[str, str]]) -> dict:
    """The run's summary, from every rank's peaks; rank 0 writes trace.json, summary.json and
    tiers.png, each whatever the others (and the export: `failed`) did."""
    args, pm, world_size = r.args, r.pm, r.world_size
    settle(r.model)  # the last step's overlapped updates, and every write
    peaks = _per_rank({t: pm.peak_bytes(t) for t in TIER_NAMES}, world_size)
    summary = {
        "model": args.model, "params": n_params, "steps": args.steps,
        "trainable_params": sum(p.numel() for p in r.model.parameters() if p.requires_grad),
        "batch": args.batch, "micro_batches": args.micro_batches,
        "seq": args.seq, "final_loss": last_loss, "wall_s": time.perf_counter() - started,
        "world_size": world_size, "state_bytes": est.state_bytes,
        "budgets": {t: pm.budget(t) for t in TIER_NAMES},
        "peak_bytes": {t: max(p[t] for p in peaks) for t in TIER_NAMES},
        "peak_bytes_per_rank": peaks,
        "peak_rss": max(_per_rank(peak_rss(), world_size)),
        "nvme": _nvme_summary(r, n_params),
        "config": r.cfg.to_dict(),
        "placement": tier_bytes(r.model),  # each kind's bytes per tier on this rank (split placement)
    }
    if r.folders.run is not None:
        run_dir = r.folders.run.path
        trace = pm.telemetry.chrome_trace()
        failed = failed + r.folders.run.write_each({
            "trace.json": lambda out: _dump_json(trace, out),
            "tiers.png": lambda out: plot_run(run_dir, out, trace=trace, summary=summary)})
        summary["files_not_written"] = failed  # summary.json last: it lists what the others lacked
        failed += r.folders.run.write_each({"summary.json": json.dumps(summary, indent=2, default=str)})
    else:
        summary["files_not_written"] = failed
    return summary


def _dump_json(obj: object, path: Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f)


def _nvme_summary(r: _Run, n_params: int) -> dict:
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


def _global_mean(loss: torch.Tensor, world_size: int) -> float:
    """The loss over the global batch: the mean of the ranks' losses on equal slices."""
    if world_size > 1:
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
        loss = loss / world_size
    return loss.item()


def _per_rank(value: object, world_size: int) -> list:
    """`value` of every rank, in rank order."""
    if world_size == 1:
        return [value]
    out: list = [None] * world_size
    dist.all_gather_object(out, value)
    return out


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    owns_group = not dist.is_initialized()  # run() joins torchrun's group; leave a caller's alone
    outcome = _Outcome()
    try:
        summary = run(args, outcome)
    except Stopped as e:
        where = f" at step {e.step}, checkpoint {outcome.checkpoint} saved (continue with --resume)" if e.step else ""
        print(f"tierzero train: {_rank()}{e}{where}; swap files removed", file=sys.stderr)
        return e.exit_code
    except Exception as e:
        log = f"; traceback in {Path(args.run_dir) / 'error.log'}" if not dist.is_initialized() or dist.get_rank() == 0 else ""
        bad_input = isinstance(e, (ValueError, OSError))
        rank = "" if isinstance(e, RankRuntimeError) else _rank()  # its message names the rank
        print(f"tierzero train: error: {rank}{e if bad_input else f'{type(e).__name__}: {e}'}"
              f"{'' if bad_input else log}", file=sys.stderr)
        return 2 if bad_input else 1
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()
    if any(f["file"] != "tiers.png" for f in summary["files_not_written"]):
        return 1  # the run folder lacks a file its contract promises (a plot that failed is a notice only)
    if summary["world_size"] > 1 and int(os.environ.get("RANK", "0")) != 0:
        return 0
    print(json.dumps({k: summary[k] for k in ("model", "params", "steps", "final_loss",
                                              "wall_s", "state_bytes", "budgets", "peak_bytes",
                                              "peak_rss")}, indent=2))
    return 0


def _rank() -> str:
    return f"rank {dist.get_rank()}: " if dist.is_initialized() else ""

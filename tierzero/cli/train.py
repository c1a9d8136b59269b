"""`tierzero train`: train a model with tiered state and write a complete run folder.

The flags and the Config they build, and one run: the model wrapped, the steps (run/loop.py),
the export, the run folder's end files (run/report.py). What the run folder holds, and the
exit codes: docs/cli.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

import tierzero as tz
from io_engine import replace_file
from tierzero.cli.caches import check_compile_cache, compile_cache
from tierzero.cli.estimate import run_config
from tierzero.cli.flags import (activations_from_flags, add_activation_flags, add_placement_flags, add_rate_flags,
                                add_state_format_flags, add_zero_flags, join_negative_values, placement_from_flags,
                                rates_from_flags, state_format_from_flags, zero_from_flags)
from tierzero.cli.harness import check_room, corpus, heads, meta_model, pretrained, with_lora
from tierzero.cli.micro_batches import add_micro_batch_flag, check_micro_batches, check_step_memory, forward_backward
from tierzero.cli.run.outputs import check_outputs
from tierzero.cli.run.plots import plot_run
from tierzero.cli.run.folder import DISK_ERRNOS, DISK_EXIT, RunFolders, checkpoint_dir, not_written
from tierzero.cli.run.stop import Stopped, StopSignals
from tierzero.cli.run.loop import Outcome, Run, lr_lambda, resume, train_steps
from tierzero.cli.run.report import dump_json, global_mean, run_summary, step_row, write_failure
from tierzero.formats import corpus as tzdata
from tierzero.models import CONFIGS
from tierzero.planning import DriveRates
from tierzero.runtime import RankRuntimeError, close, placement_manager, settle


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
    add_state_format_flags(p)
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
    p.add_argument("--overwrite", action="store_true", help="start again in a --run-dir that holds an earlier "
                   "run: its files and checkpoints are removed (only those; without it such a folder is refused)")
    return p


def _check_args(args: argparse.Namespace) -> None:
    if args.model not in CONFIGS and not Path(args.model).is_dir():
        raise ValueError(f"--model {args.model!r}: expected a built-in model ({', '.join(CONFIGS)}) or a "
                         "transformers model folder (config.json + model.safetensors or shards)")
    for name in ("steps", "batch", "seq"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}: expected an int >= 1, got {getattr(args, name)}")
    for flag in BUDGET_FLAGS:
        value = getattr(args, flag[2:].replace("-", "_"))
        if str(value).strip().startswith("-"):
            raise ValueError(f"{flag}: a budget cannot be negative, got {value!r}; give a byte count such as 8GiB")
    _check_numbers(args)
    check_micro_batches(args)
    if args.resume and args.overwrite:
        raise ValueError("--resume continues the run in --run-dir and --overwrite removes it: give one of them")
    if args.compile:
        check_compile_cache(compile_cache())
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


BUDGET_FLAGS = ("--device-budget", "--host-budget", "--nvme-budget")
MAX_COLLECTIVE_TIMEOUT_S = 30 * 86400
"""The longest --collective-timeout taken: a collective that waits longer than 30 days is a hang."""


def _check_numbers(args: argparse.Namespace) -> None:
    """The optimizer's numbers and the timeout: finite, not negative (ValueError naming the flag)."""
    for flag, value in (("--clip", args.clip), ("--lr", args.lr), ("--weight-decay", args.weight_decay)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{flag}: expected a finite number >= 0, got {value}"
                             f"{' (0 turns clipping off)' if flag == '--clip' else ''}")
    if args.warmup < 0:
        raise ValueError(f"--warmup: expected a number of steps >= 0, got {args.warmup}")
    if not 0 < args.collective_timeout <= MAX_COLLECTIVE_TIMEOUT_S:  # False for NaN too
        raise ValueError(f"--collective-timeout: expected seconds > 0 and at most {MAX_COLLECTIVE_TIMEOUT_S} "
                         f"(30 days), got {args.collective_timeout}")


def _config(args: argparse.Namespace) -> tz.Config:
    """The run's Config, from the flags (placement, ZeRO and activation flags: flags.py)."""
    return tz.Config(device_budget=args.device_budget, host_budget=args.host_budget,
                     nvme_dir=args.nvme_dir, nvme_budget=args.nvme_budget,
                     collective_timeout_s=args.collective_timeout, step_in_backward=args.step_in_backward,
                     file_mode=args.file_mode,
                     **placement_from_flags(args), **zero_from_flags(args), **activations_from_flags(args),
                     **state_format_from_flags(args))


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


def run(args: argparse.Namespace, outcome: Outcome | None = None) -> dict:
    """Train as the flags say and write the run folder (rank 0); the run's summary. Everything
    the run needs is checked before its first step: flags, budgets, disks, the run folder's lock,
    the --export target. A failure (or a stop) leaves summary.json saying so."""
    outcome = outcome if outcome is not None else Outcome()
    _check_args(args)
    rates = rates_from_flags(args)
    cfg = _config(args)
    rank, world_size = _init_distributed(cfg)
    if args.batch % world_size:  # main() prefixes the rank
        raise ValueError(f"--batch {args.batch} is the global batch and must split evenly "
                         f"over {world_size} ranks; give a multiple of {world_size}")
    check_outputs(args, checkpoint_dir(args))
    folders = RunFolders.open(args, rank, private=cfg.private_files)
    outcome.owns_folder = not args.resume
    try:
        return _run(args, cfg, rank, world_size, rates, folders, outcome)
    except BaseException as e:
        if folders.run is not None and outcome.owns_folder:
            write_failure(folders.run, args, outcome, e)
        raise
    finally:
        folders.close()


def _run(args: argparse.Namespace, cfg: tz.Config, rank: int, world_size: int, rates: DriveRates | None,
         folders: RunFolders, outcome: Outcome) -> dict:
    torch.manual_seed(args.seed)
    model, tokenizer = meta_model(args)
    if args.lora:
        model = with_lora(model, args.lora)
    check_step_memory(args, model)
    cfg = run_config(cfg, model, batch=args.batch // world_size, seq=args.seq, micro_batches=args.micro_batches,
                     chunked=args.chunked_loss, world_size=world_size)  # "auto" with the step's working set aside
    if rank == 0:
        print(f"tierzero train: training {heads(model)}", file=sys.stderr)
    sampler = tzdata.BatchSampler(corpus(args, tokenizer, model), batch=args.micro_batches * args.batch,
                                  seq=args.seq, seed=args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    est = check_room(model, cfg, world_size)
    folders.check_room(args, est.state_bytes)
    model = tz.wrap(model, cfg, weights=args.model if pretrained(args) else None)
    if args.compile:
        tz.compile(model)
    try:
        opt = tz.AdamW(model, lr=args.lr, weight_decay=args.weight_decay)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(args.warmup, args.steps))
        with StopSignals(at_step_boundary=bool(args.checkpoint_every)) as stop:
            r = Run(args, cfg, rank, world_size, Path(args.run_dir), sampler, model, placement_manager(model),
                    opt, sched, folders, stop, rates)
            start = outcome.step = resume(r) if args.resume else 0
            outcome.owns_folder = True
            started = time.perf_counter()
            last_loss = train_steps(r, start, outcome, _step)
            stop.at_step_boundary = False  # past the last step: a signal stops what follows at once
            if stop.requested is not None:
                raise Stopped(stop.requested)
            # The export first (a full disk under the run folder cannot lose the model), then the
            # run folder's files whatever the export did; summary.json names what failed.
            failed = _export(r, tokenizer) if args.export else []
            return _finish(r, est.state_bytes, n_params, last_loss, started, failed)
    finally:
        close(model)  # frees host memory and removes the swap files


def _step(r: Run, step: int) -> dict:
    """One training step on this rank's slice of the global batch; its metrics.jsonl row."""
    args = r.args
    t0 = time.perf_counter()
    x, y = r.sampler.next()
    rows = args.micro_batches * args.batch
    local = slice(r.rank * rows // r.world_size, (r.rank + 1) * rows // r.world_size)
    x, y = x[local].to(r.pm.device), y[local].to(r.pm.device)
    loss = forward_backward(r.model, x, y, args.micro_batches, chunked=args.chunked_loss)
    if args.clip > 0:
        tz.clip_grad_norm_(r.model, args.clip)
    r.opt.step()
    r.opt.zero_grad()
    r.sched.step()
    mean_loss = global_mean(loss.detach(), r.world_size)
    return step_row(r, step, mean_loss, time.perf_counter() - t0)


def _export(r: Run, tokenizer: tzdata.Tokenizer | None) -> list[dict[str, str]]:
    """--export: the trained model as a transformers folder (every rank gathers, rank 0 writes);
    a failure is returned (for summary.json), not raised."""
    try:
        out = tz.save_pretrained(r.model, r.args.export, merge_adapters=bool(r.args.lora))
        if r.rank == 0 and tokenizer is not None:
            _save_tokenizer(tokenizer, Path(out), private=r.cfg.private_files)
    except Exception as e:
        return [not_written("export", Path(r.args.export).absolute(), e)]
    if r.rank == 0:
        print(f"tierzero train: exported the model to {out}", file=sys.stderr)
    return []


def _save_tokenizer(tokenizer: tzdata.Tokenizer, out: Path, *, private: bool) -> None:
    """The tokenizer's files into the export folder as the model's are written (0600 unless
    --file-mode umask; each under a fresh name renamed into place: a link left in the folder is
    replaced, not written through), from a private temporary folder transformers writes into."""
    with tempfile.TemporaryDirectory(prefix="tierzero-tokenizer-") as tmp:
        tokenizer.save_pretrained(tmp)
        for f in sorted(Path(tmp).iterdir()):
            if f.is_file():
                replace_file(out / f.name, f.read_bytes(), private=private)


def _finish(r: Run, state_bytes: int, n_params: int, last_loss: float, started: float,
            failed: list[dict[str, str]]) -> dict:
    """The run's summary, from every rank's peaks; rank 0 writes trace.json, summary.json and
    tiers.png, each whatever the others (and the export: `failed`) did."""
    settle(r.model)  # the last step's overlapped updates, and every write
    summary = run_summary(r, state_bytes, n_params, last_loss, started)
    if r.folders.run is None:
        summary["files_not_written"] = failed
        return summary
    run_dir = r.folders.run.path
    trace = r.pm.telemetry.chrome_trace()
    failed = failed + r.folders.run.write_each({
        "trace.json": lambda out: dump_json(trace, out),
        "tiers.png": lambda out: plot_run(run_dir, out, trace=trace, summary=summary)})
    summary["files_not_written"] = failed  # summary.json last: it lists what the others lacked
    failed += r.folders.run.write_each({"summary.json": json.dumps(summary, indent=2, default=str)})
    return summary


def main(argv: list[str]) -> int:
    args = parser().parse_args(join_negative_values(argv, BUDGET_FLAGS))
    owns_group = not dist.is_initialized()  # run() joins torchrun's group; leave a caller's alone
    outcome = Outcome()
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
        if isinstance(e, OSError) and e.errno in DISK_ERRNOS:
            return DISK_EXIT  # a disk full or failing: not the flags' fault
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

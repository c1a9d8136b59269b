"""`tierzero tune`: measure prefetch settings on a model and say which to use.

    tierzero tune --model NAME_OR_FOLDER --device-budget X --host-budget Y --nvme-dir D
                  [--measure-top K] [--steps N] [--simulate] [--compute-speedup F] [--json]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

import tierzero as tz
from io_engine import Progress, bench, parse_size
from tierzero.cli.estimate import reserve_working_set
from tierzero.cli.flags import (activations_from_flags, add_activation_flags, add_placement_flags,
                                add_state_format_flags, placement_from_flags, state_format_from_flags)
from tierzero.cli.harness import batch_loss, check_room, corpus, meta_model, peak_rss, release_memory
from tierzero.cli.tune_splits import split_lines, split_rows
from tierzero.config import format_size
from tierzero.formats import corpus as tzdata
from tierzero.models import CONFIGS
from tierzero.planning import (CHANNELS, Measured, Option, Rate, Recording, TierModel, choose, explain, simplicity,
                               simulate)
from tierzero.prefetch import policy_from_config
from tierzero.runtime import close, placement_manager, step_stats

# [Note: how tune chooses]
# Candidates are policy x its knobs x NVMe read-ahead depth x io threads (`--policies`,
# `--nvme-depths`, `--io-threads`). A few steps are recorded (policy none, no read-ahead: every
# copy on demand, so its copy times are clean), or a run's trace is read (`--trace`); the tier
# model (tier_model.py) replays the recording under every candidate and predicts its stall.
# Unless `--simulate`, the `--measure-top` best predicted candidates train the model for real,
# each torn down completely before the next (placement manager, pools, threads, memory): a fresh
# wrap, the same batches, `--warmup` steps (the first records the block order) and `--steps`
# measured ones, whose stall and step time give a median and a spread. Then steps are recorded
# again and merged with the first recording, so that drift of a shared machine evens out in the
# predictions. The choice follows [Note: equivalent candidates] (tierzero/planning/tuning.py):
# of the candidates within noise of the least median stall, the simplest and least
# memory-hungry. The report says which candidates are equivalent, what the chosen one's stall is
# made of and what would reduce it, the wall time and the peak memory; it prints the table and
# config snippets (TOML and Python), or with `--json` one object: {"candidates": [{"policy",
# "settings", "stall_s", "stall_range_s", "step_s", "predicted_stall_s", ...}], "best", ...}.
#
# `--compute-speedup F` divides the recorded compute times by F in the predictions, so on a slow
# machine the tuner answers what a GPU F times faster would need from the same disk.
# Each measured candidate is also predicted at the disk's rates each of its measured steps had
# (`predicted_stall_at_its_disk_rate_each_s` beside `measured_disk_gbps_each`, and their median
# `predicted_stall_at_its_disk_rate_s`): a shared disk's rate drifts within and between runs, and
# those predictions tell the model's own error apart from the drift. `--keep-traces DIR` keeps the
# recordings' and the measured candidates' traces, for `--simulate --trace` later.
# How the disk's rate changes with io threads the model learns from a short read sweep of the
# NVMe folder at each `--io-threads` count, run after the first recording (a few seconds), or from
# `--bench-io FILE` (the output of `tierzero bench-io --json`) instead.
POLICIES = "none,lookahead:1,lookahead:2,lookahead:4,bytes,adaptive"
DISK_SWEEP_BYTES = 256 << 20
"""Bytes of the file the disk sweep writes and reads at each io thread count (O_DIRECT: the page
cache plays no part; ~0.1 s per read on a 3 GB/s disk)."""
DISK_SWEEP_REPEAT = 3
RECORD_STEPS = 6
"""Steps of the recording run: the first records the block order, the last closes the
iterations replayed (the four between, merged: see Recording.from_trace)."""
CLOSING_STEPS = 1
"""Steps a candidate runs after its measured ones, not measured: an iteration is replayed up to
the next one's first fetch, so this makes the last measured step one the tier model can be
checked against at its own disk rate (predicted_stall_at_its_disk_rate_each_s)."""


@dataclass(frozen=True)
class Candidate:
    """One prefetch setting: a built-in policy with its knob, NVMe read-ahead depth, io threads."""

    policy: str
    knob: int | None
    """depth for lookahead, reserve bytes for bytes (None: half the device budget), else None."""
    nvme_depth: int
    io_threads: int

    def settings(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.policy == "lookahead":
            out["depth"] = self.knob
        if self.policy == "bytes" and self.knob:
            out["reserve"] = self.knob
        return out | {"nvme_depth": self.nvme_depth, "io_threads": self.io_threads}

    def config(self, base: tz.Config) -> tz.Config:
        prefetch = {"policy": self.policy, "nvme_depth": self.nvme_depth}
        if self.policy == "lookahead":
            prefetch["depth"] = self.knob
        if self.policy == "bytes":
            prefetch["reserve"] = self.knob or 0
        return base.replace(prefetch=tz.PrefetchConfig(**prefetch),
                            io=dataclasses.replace(base.io, threads=self.io_threads))

    def label(self) -> str:
        return " ".join(f"{k}={v}" for k, v in self.settings().items())

    def snippets(self) -> dict[str, str]:
        s = self.settings()
        io_threads = s.pop("io_threads")
        prefetch = {"policy": self.policy, **s}
        toml = "\n".join(["[prefetch]"] + [f"{k} = {json.dumps(v)}" for k, v in prefetch.items()]
                         + ["[io]", f"threads = {io_threads}"])
        args = ", ".join(f"{k}={v!r}" for k, v in prefetch.items())
        return {"toml": toml, "python": f"tz.Config(..., prefetch=tz.PrefetchConfig({args}), "
                                        f"io=tz.IOConfig(threads={io_threads}))"}


def candidates(policies: str, nvme_depths: list[int], io_threads: list[int]) -> list[Candidate]:
    out = []
    for spec in policies.split(","):
        name, _, knob = spec.strip().partition(":")
        if name not in ("none", "lookahead", "bytes", "adaptive"):
            raise ValueError(f"--policies: unknown policy {name!r} in {spec!r}; expected none, lookahead:DEPTH, "
                             "bytes[:RESERVE] or adaptive, comma separated")
        if name == "lookahead":
            if not knob.isdigit() or int(knob) < 1:
                raise ValueError(f"--policies: {spec!r}: expected lookahead:DEPTH with DEPTH an int >= 1")
            value: int | None = int(knob)
        elif name == "bytes":
            value = parse_size(knob, what=f"--policies {spec!r} reserve") if knob else None
        elif knob:
            raise ValueError(f"--policies: {spec!r}: {name} takes no knob")
        else:
            value = None
        out += [Candidate(name, value, d, t) for d in nvme_depths for t in io_threads]
    return out


def _ints(minimum: int) -> Callable[[str], list[int]]:
    def parse(text: str) -> list[int]:
        try:
            values = [int(v) for v in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated ints, got {text!r}") from None
        if any(v < minimum for v in values):
            raise argparse.ArgumentTypeError(f"expected ints >= {minimum}, got {text!r}")
        return values
    return parse


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tierzero tune", description=__doc__.splitlines()[0])
    p.add_argument("--model", help=f"a built-in GPT ({', '.join(CONFIGS)}) or a transformers model folder")
    p.add_argument("--n-layer", type=int, default=None, help="blocks of a built-in GPT (its shape otherwise)")
    p.add_argument("--n-embd", type=int, default=None, help="width of a built-in GPT")
    p.add_argument("--device-budget", default="1GiB")
    p.add_argument("--host-budget", default="4GiB")
    p.add_argument("--nvme-dir", default=None, help="folder for swap files (on the disk to tune for)")
    p.add_argument("--nvme-budget", default="256GiB")
    add_placement_flags(p)
    add_activation_flags(p)
    add_state_format_flags(p)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--steps", type=int, default=5, help="measured steps per candidate (a median and a spread)")
    p.add_argument("--measure-top", type=int, default=4, metavar="K",
                   help="measure the K best predicted candidates (0: all)")
    p.add_argument("--warmup", type=int, default=2, help="steps before measuring (the first records the trace)")
    p.add_argument("--policies", default=POLICIES, help=f"comma list (default {POLICIES}); bytes:RESERVE "
                   "sets its reserve (default half the device budget)")
    p.add_argument("--nvme-depths", type=_ints(0), default=[2, 4, 8])
    p.add_argument("--io-threads", type=_ints(1), default=[2, 4])
    p.add_argument("--simulate", action="store_true", help="predict only, from the recording: no candidate runs")
    p.add_argument("--trace", default=None, help="replay this run folder's trace.json (or a trace.json) instead "
                   "of recording steps (with --simulate, --model is then not needed)")
    p.add_argument("--keep-traces", default=None, metavar="DIR", help="write the recordings' and each "
                   "measured candidate's Chrome traces into DIR (a new or empty folder), to replay later "
                   "with --trace or open in a trace viewer")
    p.add_argument("--compute-speedup", type=float, default=1.0, metavar="F",
                   help="predict for compute F times faster than recorded (e.g. 50: a GPU)")
    p.add_argument("--bench-io", default=None, metavar="FILE", help="`tierzero bench-io --json` output: the "
                   "disk's rate per io threads for the predictions (default: a short sweep of --nvme-dir)")
    p.add_argument("--data", default=None, help="text or JSONL file to train on (default: the Python standard "
                   "library's source, as tierzero train)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    return p


def _check(args: argparse.Namespace) -> None:
    if args.model is None and not (args.simulate and args.trace):
        raise ValueError("--model is required (a built-in GPT or a model folder), except with --simulate --trace")
    if args.model is not None and args.model not in CONFIGS and not Path(args.model).is_dir():
        raise ValueError(f"--model {args.model!r}: expected a built-in model ({', '.join(CONFIGS)}) or a "
                         "transformers model folder")
    if args.model not in CONFIGS and (args.n_layer or args.n_embd):
        raise ValueError("--n-layer / --n-embd change a built-in GPT's shape; a model folder has its own")
    for name in ("steps", "batch", "seq"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}: expected an int >= 1, got {getattr(args, name)}")
    if args.warmup < 2:
        raise ValueError(f"--warmup: expected >= 2 (the first step records the block order, the second "
                         f"is the first to prefetch), got {args.warmup}")
    if args.compute_speedup <= 0:
        raise ValueError(f"--compute-speedup: expected a number > 0, got {args.compute_speedup}")
    if args.keep_traces is not None:
        keep = Path(args.keep_traces)
        if keep.exists() and (not keep.is_dir() or any(keep.iterdir())):
            raise ValueError(f"--keep-traces {args.keep_traces!r}: expected a new or empty folder (tune writes "
                             "its traces there and overwrites nothing)")
        if not keep.parent.is_dir():
            raise ValueError(f"--keep-traces {args.keep_traces!r}: its parent folder does not exist")


def _keep(args: argparse.Namespace, name: str, trace: dict) -> None:
    """Write a Chrome trace into --keep-traces (if given)."""
    if args.keep_traces is not None:
        Path(args.keep_traces).mkdir(exist_ok=True)
        (Path(args.keep_traces) / f"{name}.json").write_text(json.dumps(trace))


# ------------------------------------------------------------------------------ real steps


class Trainer:
    """Builds the model and its batches the same way for every candidate."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.base = tz.Config(device_budget=args.device_budget, host_budget=args.host_budget,
                              nvme_dir=args.nvme_dir, nvme_budget=args.nvme_budget, **placement_from_flags(args),
                              **activations_from_flags(args), **state_format_from_flags(args))
        model, self.tokenizer = self._meta_model()
        # with a kind "auto", the step's working set set aside as `tierzero train` sets it
        self.base, _ = reserve_working_set(self.base, model, batch=args.batch, seq=args.seq)
        self.corpus = corpus(args, self.tokenizer, model)

    def _meta_model(self) -> tuple[torch.nn.Module, Any]:
        torch.manual_seed(self.args.seed)
        return meta_model(self.args)

    def run(self, cfg: tz.Config, steps: int, step_done: Callable[[int, float, float], None]) -> tuple[list, dict]:
        """Train `steps` steps with `cfg`; per step (stall_s, step_s, stall by source), and the
        Chrome trace. Everything the run made is gone when it returns (`release_memory`)."""
        try:
            return self._steps(cfg, steps, step_done)
        finally:  # the model, its state and optimizer (a reference cycle) are unreachable now
            release_memory()

    def _steps(self, cfg: tz.Config, steps: int, step_done: Callable[[int, float, float], None]) -> tuple[list, dict]:
        model, _ = self._meta_model()
        check_room(model, cfg)
        model = tz.wrap(model, cfg, weights=None if self.args.model in CONFIGS else self.args.model)
        sampler = tzdata.BatchSampler(self.corpus, batch=self.args.batch, seq=self.args.seq, seed=self.args.seed)
        try:
            opt = tz.AdamW(model, lr=1e-4)
            device = placement_manager(model).device
            out = []
            for i in range(steps):
                x, y = (t.to(device) for t in sampler.next())
                t0 = time.perf_counter()
                batch_loss(model, x, y, chunked=self.args.chunked_loss).backward()
                opt.step()
                opt.zero_grad()
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                step_s = time.perf_counter() - t0
                stats = step_stats(model)
                stall_s = sum(stats.stall_s.values())
                out.append((stall_s, step_s, dict(stats.stall_s_by_source)))
                step_done(i, stall_s, step_s)
            return out, placement_manager(model).telemetry.chrome_trace()
        finally:
            close(model)


# ----------------------------------------------------------------------------- the command


def tune(args: argparse.Namespace) -> dict[str, Any]:
    """Record (or read) steps, predict every candidate, measure the best predicted unless
    --simulate, record again after them, choose; the report."""
    _check(args)
    started = time.perf_counter()
    cands = candidates(args.policies, args.nvme_depths, args.io_threads)
    bench = _read_json(args.bench_io, "--bench-io") if args.bench_io else None
    trainer = Trainer(args) if args.model is not None else None
    rows = [{"policy": c.policy, "settings": c.settings(), "stall_s": None, "step_s": None,
             "predicted_stall_s": None} for c in cands]
    traces = []
    with Progress(_total_steps(args, len(cands)), enabled=not args.no_progress) as bar:
        if not args.trace:
            traces.append(_record(trainer, args, bar, "before"))
            bench = bench or _disk_sweep(args, trainer)
        recording = Recording.load(args.trace) if args.trace else Recording.from_traces(traces, where="the recording")
        for c, row in zip(cands, rows):
            row.update(_predict(c, recording, bench, args, trainer))
        if not args.simulate:
            ranked = sorted(range(len(cands)), key=lambda i: (rows[i]["predicted_stall_s"],
                                                              simplicity(_option(cands[i], rows[i], True))))
            top = ranked[:args.measure_top] if args.measure_top else ranked
            rates = _measure(trainer, args, [(cands[i], rows[i]) for i in sorted(top)], bar)
            if not args.trace:  # before and after the candidates: drift of the machine evens out
                traces.append(_record(trainer, args, bar, "after"))
                recording = Recording.from_traces(traces, where="the recordings")
            for c, row in zip(cands, rows):  # (a read trace is the same recording: only the measured again)
                if not args.trace or id(row) in rates:
                    row.update(_predict(c, recording, bench, args, trainer, rates.get(id(row))))
    key = "predicted_stall_s" if args.simulate else "stall_s"
    options = [(i, _option(c, row, args.simulate)) for i, (c, row) in enumerate(zip(cands, rows))
               if row[key] is not None]
    if not options:
        raise ValueError(f"every candidate was refused; the first: {rows[0].get('error')}")
    chosen, tied = choose([o for _, o in options])
    best = options[chosen][0]
    for j in tied:
        rows[options[j][0]]["equivalent_to_best"] = True
    summary = recording.summary() | {"updates": len(recording.updates)}
    if len(traces) > 1:  # the same setting's stall at each recording: how much the machine drifted
        summary["stall_s_each_recording"] = [round(Recording.from_trace(t).summary()["stall_s"], 4) for t in traces]
    splits = [] if trainer is None else split_rows(args, trainer.base, cands[best].config(trainer.base), recording, bench)
    left = rows[best].get("stall_by_source") or {}
    step = rows[best]["step_s"] or rows[best]["predicted_step_s"]
    return {"candidates": rows, "best": rows[best], "best_index": best, "chosen_by": key,
            "equivalent": [options[j][0] for j in tied], "stall_left": explain(left, step) if left else [],
            "recording": summary, "splits": splits, "compute_speedup": args.compute_speedup, "snippets": cands[best].snippets(),
            "setup": _setup(args, trainer), "wall_s": round(time.perf_counter() - started, 1),
            "peak_rss_bytes": peak_rss()}


def _total_steps(args: argparse.Namespace, n: int) -> int:
    measured = 0 if args.simulate else min(n, args.measure_top or n) * (args.warmup + args.steps + CLOSING_STEPS)
    recordings = 0 if args.trace else 1 if args.simulate else 2
    return measured + recordings * RECORD_STEPS


def _option(c: Candidate, row: dict[str, Any], predicted: bool) -> Option:
    """The candidate as the choice sees it: measured steps, or the prediction (no spread)."""
    if predicted:
        measured = Measured([row["predicted_stall_s"]], [row["predicted_step_s"]])
    else:
        measured = Measured(row["stall_s_each"], row["step_s_each"])
    return Option(c.policy, c.knob or 0, c.nvme_depth, c.io_threads, measured)


def _record(trainer: Trainer | None, args: argparse.Namespace, bar: Progress, when: str) -> dict:
    """The Chrome trace of RECORD_STEPS steps fetching on demand (policy none, no read-ahead)."""
    assert trainer is not None
    base = Candidate("none", None, 0, args.io_threads[0])
    _, trace = trainer.run(base.config(trainer.base), RECORD_STEPS,
                           lambda i, stall, step: bar.advance(f"recording ({when}) step {i + 1}: step {step:.3f} s"))
    _keep(args, f"recording-{when}", trace)
    return trace


def _disk_sweep(args: argparse.Namespace, trainer: Trainer | None) -> dict | None:
    """GB/s of the NVMe folder at each io thread count the candidates use (a bench-io result
    without fio; the model takes its reads): without it the model gives every io thread count the recording's
    disk rate. None when the candidates use one count or nothing is on NVMe."""
    if trainer is None or args.nvme_dir is None or len(set(args.io_threads)) < 2:
        return None
    report = bench.measure(args.nvme_dir, DISK_SWEEP_BYTES, block_sizes=(trainer.base.io.block_size,),
                           threads=tuple(sorted(set(args.io_threads))), fio_grid=(), repeat=DISK_SWEEP_REPEAT,
                           use_fio=False, checksum_reps=0, progress=False)
    return bench.to_json(report)


def _measure(trainer: Trainer | None, args: argparse.Namespace, todo: list[tuple[Candidate, dict]],
             bar: Progress) -> dict[int, list[dict[tuple[str, str], Rate]]]:
    """Each candidate's real steps into its row: medians, ranges, stall by source; returns the
    disk's rates at each of its measured steps that can be replayed, by id of its row."""
    assert trainer is not None
    rates = {}
    for i, (c, row) in enumerate(todo):
        label = f"{i + 1}/{len(todo)} {c.policy} {c.label()}"
        try:
            measured, trace = trainer.run(c.config(trainer.base), args.warmup + args.steps + CLOSING_STEPS,
                                          lambda k, stall, step:
                                          bar.advance(f"{label} step {k + 1}: stall {stall:.4f} s step {step:.3f} s"))
        except ValueError as e:  # a setting this model or budget refuses (a reserve too large)
            row["error"] = str(e)
            for _ in range(args.warmup + args.steps + CLOSING_STEPS):
                bar.advance(f"{label}: refused")
            continue
        _keep(args, f"candidate-{c.policy}-{c.label()}".replace(" ", "-").replace("/", "-"), trace)
        kept = measured[args.warmup:args.warmup + args.steps]
        stalls, steps = [s for s, _, _ in kept], [t for _, t, _ in kept]
        row["stall_s"] = statistics.median(stalls)
        row["stall_range_s"] = [round(min(stalls), 5), round(max(stalls), 5)]
        row["step_s"] = statistics.median(steps)
        row["stall_s_each"] = [round(s, 5) for s in stalls]
        row["step_s_each"] = [round(t, 4) for t in steps]
        row["stall_by_source"] = {k: round(statistics.median(src[k] for _, _, src in kept), 5) for k in kept[0][2]}
        each = disk_rates(trace, since_step=args.warmup)
        if each:
            rates[id(row)] = [rate for _, rate in each]
            row["measured_disk_gbps_each"] = [{CHANNELS[leg]: round(1 / r.seconds_per_byte / 1e9, 3)
                                               for leg, r in rate.items() if r.seconds_per_byte} for _, rate in each]
            row["measured_disk_gbps"] = {ch: statistics.median(d[ch] for d in row["measured_disk_gbps_each"] if ch in d)
                                         for ch in ("read", "write")
                                         if any(ch in d for d in row["measured_disk_gbps_each"])}
    return rates


def disk_rates(trace: dict, *, since_step: int = 0) -> list[tuple[int, dict[tuple[str, str], Rate]]]:
    """The disk's read and write rates at each of a run's replayable steps from `since_step`
    (0-based) on, as the tier model calibrates them (bytes over the time such legs ran): (step,
    rates) pairs, none where the trace has no such step. On a shared machine the disk's rate
    drifts: on the built-in 350m it fell from 1.2-1.3 to 0.8 GB/s from one step to the next
    with the same bytes moved, and the overlapped step's waits rose from 0.2 to 2.3 s. Predicted
    at the rate each step had, the model's error shows apart from that drift (350m, lookahead 1:
    2.31 s predicted against 2.66 s measured at 0.79 GB/s, 0.40 against 0.37 at 1.30)."""
    try:
        each = Recording.disk_rates_each(trace)
    except ValueError:
        return []
    out = []
    for iteration, busy in sorted(each.items()):
        rates = {leg: Rate(sec / nbytes) for leg, (nbytes, sec) in busy.items() if nbytes and sec}
        if iteration - 1 >= since_step and rates:
            out.append((iteration - 1, rates))
    return out


def _predict(c: Candidate, recording: Recording, bench: dict | None, args: argparse.Namespace,
             trainer: Trainer | None, disk: list[dict[tuple[str, str], Rate]] | None = None) -> dict[str, Any]:
    workers = max(2, c.nvme_depth)
    model = TierModel.calibrate(recording, bench, io_threads=c.io_threads, workers=workers)
    cfg = c.config(trainer.base if trainer else tz.Config(device_budget=recording.device_room))
    pred = simulate(recording, policy_from_config(cfg), model, workers=workers, speedup=args.compute_speedup,
                    nvme_depth=c.nvme_depth)
    out = {}
    if disk:  # the same replay at the disk's rates of each step of the candidate's own run
        each = [simulate(recording, policy_from_config(cfg),
                         dataclasses.replace(model, rates={**model.rates, **rates}, source="the candidate's own run"),
                         workers=workers, speedup=args.compute_speedup, nvme_depth=c.nvme_depth,
                         recorded_model=model).stall_s for rates in disk]
        out["predicted_stall_at_its_disk_rate_s"] = round(statistics.median(each), 5)
        out["predicted_stall_at_its_disk_rate_each_s"] = [round(p, 5) for p in each]
    return out | {"predicted_stall_s": round(pred.stall_s, 5), "predicted_step_s": round(pred.step_s, 5),
            "predicted_disk_busy_s": round(pred.disk_s, 5), "predicted_device_copies": pred.copies,
            "model": {"disk_read_gbps": _gbps(model, ("nvme", "host")), "h2d_gbps": _gbps(model, ("host", "device")),
                      "move_overhead_s": round(model.overhead_s, 6), "disk_rate_from": model.source}}


def _gbps(model: TierModel, leg: tuple[str, str]) -> float | None:
    spb = model.rates[leg].seconds_per_byte
    return round(1 / spb / 1e9, 3) if spb else None


def _setup(args: argparse.Namespace, trainer: Trainer | None) -> dict[str, Any]:
    keys = ("model", "n_layer", "n_embd", "batch", "seq", "steps", "warmup", "simulate", "trace", "bench_io",
            "activations", "activation_checkpointing", "chunked_loss")
    out = {k: getattr(args, k) for k in keys}
    if trainer is not None:
        b = trainer.base
        out |= {"device_budget": b.device_budget, "host_budget": b.host_budget, "params": b.params,
                "grads": b.grads, "optimizer_states": b.optimizer_states}
    return out


def _read_json(path: str, flag: str) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{flag} {path!r}: no such file") from None
    except ValueError as e:
        raise ValueError(f"{flag} {path!r}: not JSON ({e})") from e


def format_table(report: dict[str, Any]) -> str:
    rec, setup = report["recording"], report["setup"]
    speed = report["compute_speedup"]
    lines = [f"tierzero tune: {setup['model'] or setup['trace']}, recorded step: {rec['fetches']} fetches of "
             f"{rec['units']} blocks, compute {rec['compute_s']:.3f} s, device room "
             f"{format_size(rec['device_room'])}, host room {format_size(rec['host_room'])}"
             + (f"; predictions for compute {speed:g}x faster" if speed != 1 else "")
             + ("; recorded on-demand stall before / after the candidates: "
                + " / ".join(f"{x:.4f}" for x in rec["stall_s_each_recording"]) + " s"
                if "stall_s_each_recording" in rec else ""),
             f"{'policy':<10} {'settings':<34} {'stall s [min-max]':>22} {'step s':>8} {'pred stall s':>12} "
             f"{'pred step s':>11} {'disk busy s':>11} {'pred at its disk':>16}"]
    for i, r in enumerate(report["candidates"]):
        settings = " ".join(f"{k}={format_size(v) if k == 'reserve' else v}" for k, v in r["settings"].items())
        if r.get("error"):
            stall = "refused"
        elif r["stall_s"] is None:
            stall = "(not measured)"
        else:
            lo, hi = r["stall_range_s"]
            stall = f"{r['stall_s']:.4f} [{lo:.4f}-{hi:.4f}]"
        step = "-" if r["step_s"] is None else f"{r['step_s']:.3f}"
        mark = "  <- chosen" if i == report["best_index"] else "  = (within noise)" if r.get("equivalent_to_best") else ""
        again = r.get("predicted_stall_at_its_disk_rate_s")
        again = "-" if again is None else f"{again:.4f}"
        lines.append(f"{r['policy']:<10} {settings:<34} {stall:>22} {step:>8} {r['predicted_stall_s']:>12.4f} "
                     f"{r['predicted_step_s']:>11.3f} {r['predicted_disk_busy_s']:>11.3f} {again:>16}{mark}")
    how = ("of the candidates within noise of the least measured stall, the simplest and least memory-hungry"
           if report["chosen_by"] == "stall_s" else "the least predicted stall (the simplest of equal ones)")
    lines += [f"refused: {r['policy']} {' '.join(f'{k}={v}' for k, v in r['settings'].items())}: {r['error']}"
              for r in report["candidates"] if r.get("error")]
    best = report["best"]
    lines += ["", f"chosen: {best['policy']} " + " ".join(f"{k}={v}" for k, v in best["settings"].items())
              + f" ({how}; {len(report['equivalent'])} within noise)"]
    if report["stall_left"]:
        lines.append("its stall left, by source:")
        lines += [f"  {x['source']}: {x['stall_s']:.4f} s ({100 * x['share_of_step']:.1f} % of the step): "
                  f"{x['what_reduces_it']}" for x in report["stall_left"]]
    lines += split_lines(report["splits"], report["recording"].get("updates", 0) > 0)
    lines += ["TOML (a config file for tz.Config.from_file):"]
    lines += ["  " + line for line in report["snippets"]["toml"].splitlines()]
    lines += ["Python:", "  " + report["snippets"]["python"],
              f"wall time {report['wall_s']:.1f} s; peak resident memory {format_size(report['peak_rss_bytes'])}"]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    args = parser().parse_args(argv)
    try:
        report = tune(args)
    except (ValueError, OSError) as e:
        print(f"tierzero tune: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({k: v for k, v in report.items() if k not in ("best_index",)}, indent=2))
    else:
        print(format_table(report))
    return 0


__all__ = ["Candidate", "candidates", "tune", "main"]

"""Gradient accumulation layer by layer (tz.accumulate) against the plain accumulation loop: the
built-in GPT with parameters, gradients and optimizer states on NVMe (fp32), activations on
NVMe, k micro-batches per optimizer step. Per configuration: parameter bytes read from NVMe per
step, tokens per second (forward + backward, and the whole step with the optimizer's), peak RSS
against the budgets.

Every configuration runs in a child process of its own: one step to warm up (the first records
the block order; pools fill), then the peak-RSS mark is reset (/proc/self/clear_refs) and
`--steps` steps are measured; the child's peak RSS is read from outside (/proc/PID/status VmHWM)
while it waits to exit. `--malloc returned` (the default, as in benchmarks/activations.py) fixes
glibc's mmap threshold at 128 KiB, so every freed tensor goes back to the system and the peak RSS
follows what is live; each large tensor is then a fresh mapping whose pages fault in when first
written (on the CPU stand-in for the device, every micro-batch's weight gradients: see
docs/accumulate.md "Where the time goes"). `--malloc glibc` leaves glibc's own threshold (freed
blocks up to 32 MiB are reused, as a user's process runs). The minor page faults and the system
CPU time of forward and backward are reported. The host budget is below the parameters' bytes, so a parameter used
again later is read from NVMe again (as on a machine whose model does not fit in RAM). The
configurations run in rounds, A B A B: each round runs every schedule at every k.

Two step times per configuration:
- "step": one step with its optimizer's updates, settled (`runtime.settle`) before the clock
  stops; its parameter bytes are that step's own.
- "steady": `--steady N` more steps back to back, as a training loop runs them, settled once at
  the end (that wait counted): the overlapped step's updates run under the next step's forward,
  as they do in training. Steady tokens/s = N steps' tokens over that whole time.

Schedules (`--modes`): "layer-major" is `tz.accumulate` then `opt.step()`; "plain" is the plain
loop then `opt.step()`; "layer-major-sib" is `tz.accumulate` under
`Config(step_in_backward=True)`, where each block is updated at its k-th backward (the plain
loop cannot: its gradients are final only in the last micro-batch's backward).

    flock /tmp/tierzero-bench.lock python benchmarks/layer_major.py --nvme-dir DIR \\
        [--model 350m] [--ks 1,4,8] [--batch 1] [--seq 64] [--steps 1] [--steady 2] [--rounds 2] \\
        [--modes layer-major,plain[,layer-major-sib]] [--malloc returned|glibc] [--profile] [--json]

`--profile`: each configuration runs one more step under torch.profiler (not timed) and the
operators that took the most CPU time in its forward and backward are listed.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import tierzero as tz  # noqa: E402
from tierzero import runtime  # noqa: E402
from tierzero.config import format_size, parse_size  # noqa: E402
from tierzero.models import build  # noqa: E402

TIERS = ("device", "host", "nvme")
MODES = ("layer-major", "plain", "layer-major-sib")
MALLOC = {"returned": {"MALLOC_MMAP_THRESHOLD_": "131072"}, "glibc": {}}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvme-dir", default="runs/bench-layer-major", help="swap folder (removed afterwards)")
    p.add_argument("--model", default="350m", help="a built-in GPT size (tiny, 125m, 350m, ...)")
    p.add_argument("--ks", default="1,4,8", help="micro-batches per step")
    p.add_argument("--batch", type=int, default=1, help="rows per micro-batch")
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--steps", type=int, default=1, help="measured steps per configuration (after one warm-up)")
    p.add_argument("--steady", type=int, default=2,
                   help="steps run back to back after the measured ones, settled once at the end (0: none)")
    p.add_argument("--rounds", type=int, default=2, help="A B A B rounds over every configuration")
    p.add_argument("--modes", default="layer-major,plain", help=f"schedules, from {', '.join(MODES)}")
    p.add_argument("--device-budget", default="1GiB")
    p.add_argument("--host-budget", default="1GiB")
    p.add_argument("--malloc", choices=MALLOC, default="returned",
                   help="returned: glibc's mmap threshold fixed at 128 KiB (freed tensors go back to the system); "
                        "glibc: glibc's defaults")
    p.add_argument("--profile", action="store_true", help="list the top operators of one more step's fwd+bwd")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def config(args: argparse.Namespace, mode: str) -> tz.Config:
    return tz.Config(device_budget=args.device_budget, host_budget=args.host_budget, nvme_dir=args.nvme_dir,
                     nvme_budget="64GiB", params="nvme", grads="nvme", optimizer_states="nvme",
                     compute_dtype="float32", activations="nvme", step_in_backward=mode == "layer-major-sib")


# ------------------------------------------------------------------------------------ child


def child(args: argparse.Namespace) -> None:
    spec = json.loads(args.child)
    k, mode = spec["k"], spec["mode"]
    torch.manual_seed(0)
    model = build(args.model, device="meta", vocab_size=256, seq_len=args.seq)
    tz.wrap(model, config(args, mode))
    opt = tz.AdamW(model, lr=1e-4)
    pm = runtime.placement_manager(model)
    g = torch.Generator().manual_seed(1)
    loss_fn = lambda out, mb: out.loss / k  # noqa: E731
    rows = []
    for step in range(1 + args.steps):
        if step == 1:
            Path("/proc/self/clear_refs").write_text("5")  # the peak RSS from here on
        mbs = [(x, x) for x in torch.randint(0, 256, (k, args.batch, args.seq), generator=g)]
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        losses = forward_backward(model, mbs, loss_fn, mode)
        t1, r1 = time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
        opt.step()
        opt.zero_grad()
        runtime.settle(model)  # this step's updates and writes belong to its time
        t2 = time.perf_counter()
        stats = runtime.step_stats(model)
        rows.append({"fb_s": t1 - t0, "step_s": t2 - t0, "loss": float(sum(losses)),
                     "params_read": stats.nvme_by_kind["params"]["read"], "nvme_read": stats.nvme_read_bytes,
                     "nvme_write": stats.nvme_write_bytes, "by_kind": stats.nvme_by_kind,
                     "stall_s": sum(stats.stall_s.values()), "fb_faults": r1.ru_minflt - r0.ru_minflt,
                     "fb_sys_s": r1.ru_stime - r0.ru_stime, "fb_user_s": r1.ru_utime - r0.ru_utime})
    steady = steady_time(model, opt, mode, loss_fn, [
        [(x, x) for x in torch.randint(0, 256, (k, args.batch, args.seq), generator=g)] for _ in range(args.steady)])
    top = profile(model, opt, mode, loss_fn, [(x, x) for x in torch.randint(0, 256, (k, args.batch, args.seq),
                                                                          generator=g)]) if args.profile else []
    out = {"rows": rows[1:], "top_ops": top, "steady_s": steady, "peaks": {t: pm.peak_bytes(t) for t in TIERS},
           "budgets": {t: pm.budget(t) for t in TIERS},
           "params_bytes": sum(p.numel() for p in model.parameters()) * 4}
    runtime.close(model)
    print(json.dumps(out), flush=True)
    sys.stdin.readline()  # the parent reads this process's peak RSS meanwhile


def forward_backward(model: torch.nn.Module, mbs: list[Any], loss_fn: Any, mode: str) -> list[torch.Tensor]:
    if mode.startswith("layer-major"):
        return tz.accumulate(model, mbs, loss_fn)
    losses = []
    for mb in mbs:
        loss = loss_fn(model(*mb), mb)
        loss.backward()
        losses.append(loss.detach())
    return losses


def steady_time(model: torch.nn.Module, opt: Any, mode: str, loss_fn: Any, steps: list[list[Any]]) -> float | None:
    """Seconds of `steps` run back to back (each one's updates under the next one's forward, as
    in training), settled once at the end."""
    if not steps:
        return None
    t0 = time.perf_counter()
    for mbs in steps:
        forward_backward(model, mbs, loss_fn, mode)
        opt.step()
        opt.zero_grad()
    runtime.settle(model)
    return time.perf_counter() - t0


def profile(model: torch.nn.Module, opt: Any, mode: str, loss_fn: Any, mbs: list[Any]) -> list[list[Any]]:
    """One more step, its forward and backward under torch.profiler: the 10 operators of most
    self CPU time, as [name, seconds, calls]."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        forward_backward(model, mbs, loss_fn, mode)
    opt.step()
    opt.zero_grad()
    runtime.settle(model)
    ops = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:10]
    return [[e.key, e.self_cpu_time_total / 1e6, e.count] for e in ops]


def _status(key: str, pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no {key}")


def run_child(args: argparse.Namespace, k: int, mode: str) -> dict[str, Any]:
    spec = json.dumps({"k": k, "mode": mode})
    cmd = [sys.executable, __file__, "--child", spec, "--nvme-dir", args.nvme_dir, "--model", args.model,
           "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
           "--steady", str(args.steady), "--device-budget", args.device_budget, "--host-budget", args.host_budget]
    cmd += ["--profile"] if args.profile else []
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update({"PYTHONPATH": str(REPO), **MALLOC[args.malloc]})
    load = os.getloadavg()[0]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    assert proc.stdout is not None
    line = proc.stdout.readline()
    peak = _status("VmHWM", proc.pid) if line else 0
    _, err = proc.communicate("exit\n")
    if proc.returncode != 0 or not line:
        raise RuntimeError(f"child {spec} failed:\n{err}")
    got = json.loads(line)
    rows = got["rows"]
    tokens = k * args.batch * args.seq
    return {"k": k, "mode": mode, "peak_rss": peak, "load": load,
            "fb_faults": statistics.median(r["fb_faults"] for r in rows),
            "fb_sys_s": statistics.median(r["fb_sys_s"] for r in rows),
            "fb_user_s": statistics.median(r["fb_user_s"] for r in rows),
            "budgets": got["budgets"], "peaks": got["peaks"],
            "params_bytes": got["params_bytes"],
            "params_read": statistics.median(r["params_read"] for r in rows),
            "nvme_read": statistics.median(r["nvme_read"] for r in rows),
            "stall_s": statistics.median(r["stall_s"] for r in rows),
            "fb_s": statistics.median(r["fb_s"] for r in rows), "step_s": statistics.median(r["step_s"] for r in rows),
            "fb_tokens_per_s": tokens / statistics.median(r["fb_s"] for r in rows),
            "tokens_per_s": tokens / statistics.median(r["step_s"] for r in rows),
            "steady_step_s": got["steady_s"] / args.steady if got["steady_s"] else None,
            "steady_tokens_per_s": tokens * args.steady / got["steady_s"] if got["steady_s"] else None,
            "loss": [r["loss"] for r in rows], "by_kind": rows[-1]["by_kind"], "top_ops": got.get("top_ops", [])}


# ----------------------------------------------------------------------------------- parent


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        child(args)
        return 0
    ks = [int(k) for k in args.ks.split(",")]
    modes = args.modes.split(",")
    if not set(modes) <= set(MODES) or "plain" not in modes:
        raise SystemExit(f"--modes: {args.modes!r}: give plain and any of {', '.join(m for m in MODES if m != 'plain')}")
    shutil.rmtree(args.nvme_dir, ignore_errors=True)
    Path(args.nvme_dir).parent.mkdir(parents=True, exist_ok=True)
    runs = []
    try:
        for r in range(args.rounds):
            for k in ks:
                for mode in modes:
                    runs.append({"round": r, **run_child(args, k, mode)})
                    _progress(runs[-1])
    finally:
        shutil.rmtree(args.nvme_dir, ignore_errors=True)
    summary = {"malloc": args.malloc, **_summary(runs, ks, modes)}
    print(json.dumps({"runs": runs, "summary": summary}, indent=1) if args.json else _table(runs, summary))
    return 0


def _progress(run: dict[str, Any]) -> None:
    print(f"round {run['round']} k={run['k']} {run['mode']}: params read {format_size(run['params_read'])}, "
          f"{run['fb_s']:.1f} s fwd+bwd, {run['step_s']:.1f} s step, {_steady(run)} s steady step, "
          f"peak RSS {format_size(run['peak_rss'])}, "
          f"{run['fb_faults']:.0f} page faults, load {run['load']:.1f}",
          file=sys.stderr, flush=True)


def _steady(run: dict[str, Any]) -> str:
    return "-" if run["steady_step_s"] is None else f"{run['steady_step_s']:.1f}"


def _summary(runs: list[dict[str, Any]], ks: list[int], modes: list[str]) -> dict[str, Any]:
    def med(mode: str, k: int, key: str) -> float:
        return statistics.median(r[key] for r in runs if r["mode"] == mode and r["k"] == k)

    def over_plain(key: str) -> dict[str, dict[int, float]]:
        """Each layer-major schedule's `key` (a tokens/s) over the plain loop's, per k (medians)."""
        if any(r[key] is None for r in runs):
            return {}
        return {mode: {k: med(mode, k, key) / med("plain", k, key) for k in ks} for mode in modes if mode != "plain"}

    lead = "layer-major" if "layer-major" in modes else modes[0]
    base = max(med(lead, ks[0], "params_read"), 1)
    budget = max(sum(r["budgets"][t] for t in ("device", "host")) for r in runs)
    return {
        "params_read_vs_k1": {mode: {k: med(mode, k, "params_read") / base for k in ks} for mode in modes},
        "tokens_per_s_ratio": over_plain("tokens_per_s"),
        "fb_tokens_per_s_ratio": over_plain("fb_tokens_per_s"),
        "steady_tokens_per_s_ratio": over_plain("steady_tokens_per_s"),
        "peak_rss_max": max(r["peak_rss"] for r in runs if r["mode"] != "plain"),
        "device_plus_host_budget": budget,
        "rss_room": budget + parse_size("1.5GiB"),
    }


def _table(runs: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    lines = ["| round | k | schedule | params read / step | NVMe read / step | fwd+bwd s | step s | steady step s "
             "| tokens/s (fwd+bwd) | tokens/s (step) | tokens/s (steady) | peak RSS | fwd+bwd page faults "
             "| fwd+bwd sys CPU s | load |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in runs:
        lines.append(f"| {r['round']} | {r['k']} | {r['mode']} | {format_size(r['params_read'])} | "
                     f"{format_size(r['nvme_read'])} | {r['fb_s']:.1f} | {r['step_s']:.1f} | {_steady(r)} | "
                     f"{r['fb_tokens_per_s']:.1f} | {r['tokens_per_s']:.1f} | "
                     f"{'-' if r['steady_tokens_per_s'] is None else format(r['steady_tokens_per_s'], '.1f')} | "
                     f"{format_size(r['peak_rss'])} | "
                     f"{r['fb_faults']:.0f} | {r['fb_sys_s']:.1f} | {r['load']:.1f} |")
    for r in runs:
        if r["top_ops"]:
            lines.append(f"\nround {r['round']} k={r['k']} {r['mode']}, fwd+bwd of one more step, self CPU s (calls): "
                         + ", ".join(f"{name} {s:.2f} ({n})" for name, s, n in r["top_ops"]))
    lines.append("")
    lines.append(json.dumps(summary, indent=1))
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())

"""Placed activations: peak RSS, step time, activation bytes by tier and stall of a transformers
GPT-2 124M shape (fp32, parameters and optimizer states on NVMe, gradients on host, batch 1)
at several sequence lengths, with Config.activations device / host / nvme, each with and
without activation checkpointing. The loss is the chunked one (`--loss chunked`, tierzero.hf.
causal_lm_loss: never the whole sequence's logits, inside the model's forward) unless `--loss
plain` (cross_entropy over the model's logits, after its forward).

Every configuration runs in a child process of its own: one step to warm up (the first records
the block order; pools fill), then the peak-RSS mark is reset (/proc/self/clear_refs) and
`--steps` steps are measured. The child's peak RSS over them is read from outside, from
/proc/PID/status VmHWM while the child waits to exit. The children share one allocator setting
(MALLOC_MMAP_THRESHOLD_, so freed tensors go back to the system and RSS follows what is live).
The budgets are the same for every run but "host" mode's, whose host budget also holds every
activation of the longest sequence. After the sweep, device and nvme alternate at the longest
sequence (A B A B) for the step-time ratio. The activation bytes `tierzero estimate` computes
(tierzero.planning: one forward on fake tensors) are set beside the measured ones.

    flock /tmp/tierzero-bench.lock python benchmarks/activations.py --nvme-dir DIR \\
        [--seqs 256,512,1024,2048] [--steps 2] [--ab-rounds 2] [--loss chunked|plain] [--json]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
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
from tierzero.cli.estimate import measured_loss  # noqa: E402
from tierzero.cli.harness import batch_loss  # noqa: E402
from tierzero.config import format_size, parse_size  # noqa: E402
from tierzero.layout import ROOT, blocks_of  # noqa: E402
from tierzero.planning import estimate, measure_activations  # noqa: E402

TIERS = ("device", "host", "nvme")
MODES = ("device", "host", "nvme")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nvme-dir", default="runs/bench-activations", help="swap folder (removed afterwards)")
    p.add_argument("--seqs", default="256,512,1024,2048")
    p.add_argument("--steps", type=int, default=2, help="measured steps per configuration (after one warm-up)")
    p.add_argument("--ab-rounds", type=int, default=2, help="device / nvme pairs at the longest sequence")
    p.add_argument("--device-budget", default="1GiB")
    p.add_argument("--layers", type=int, default=12, help="GPT-2 124M: 12 (fewer, narrower: a quick dry run)")
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--loss", default="chunked", choices=("chunked", "plain"))
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def gpt2(args: argparse.Namespace, seq: int) -> Any:
    import transformers

    return transformers.GPT2Config(n_positions=seq, n_layer=args.layers, n_embd=args.width, attn_pdrop=0.0,
                                   resid_pdrop=0.0, embd_pdrop=0.0)


def budgets(args: argparse.Namespace, max_seq: int) -> dict[str, Any]:
    """The budgets of every run. Host: the gradients homed there, the optimizer's update of
    the root block (the embedding) beside two others (gradient, master weights, moments: 16
    bytes a parameter), NVMe read-ahead of parameters, and two of the longest sequence's packs
    (NVMe writes staged in host memory); "host" mode's also holds all of that sequence's
    activations."""
    import transformers

    with torch.device("meta"):
        model = transformers.GPT2LMHeadModel(gpt2(args, max_seq))
    cfg = config(args, "nvme", False, host_budget="1TiB")
    est = estimate(model, cfg)
    sizes = {name: sum(p.numel() for _, p in ps) for name, _, ps in blocks_of(model, cfg)}
    root, block = sizes.pop(ROOT), max(sizes.values())
    acts = measure_activations(model, cfg, loss_of(args), batch=1, seq=max_seq)
    host = (est.home["host"] + 16 * (root + 2 * block) + 4 * block * cfg.prefetch.nvme_depth + 2 * acts.largest
            + (128 << 20))
    return {"state_bytes": est.state_bytes, "host": host, "host_mode_host": host + acts.blocks}


def loss_of(args: argparse.Namespace) -> Any:
    """The loss as `tierzero estimate` measures it on fake tensors."""
    return functools.partial(measured_loss, chunked=args.loss == "chunked")


def config(args: argparse.Namespace, activations: str, ckpt: bool, *, host_budget: int | str) -> tz.Config:
    return tz.Config(device_budget=args.device_budget, host_budget=host_budget, nvme_dir=args.nvme_dir,
                     nvme_budget="64GiB", params="nvme", optimizer_states="nvme", grads="host",
                     compute_dtype="float32", activations=activations, activation_checkpointing=ckpt)


# ------------------------------------------------------------------------------------ child


def child(args: argparse.Namespace) -> None:
    import transformers

    spec = json.loads(args.child)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(gpt2(args, spec["seq"])).train()
    tz.wrap(model, config(args, spec["activations"], spec["ckpt"], host_budget=spec["host_budget"]))
    opt = tz.AdamW(model, lr=1e-4)
    pm = runtime.placement_manager(model)
    g = torch.Generator().manual_seed(1)
    rows = []
    for step in range(1 + args.steps):
        if step == 1:
            runtime.settle(model)
            Path("/proc/self/clear_refs").write_text("5")  # the peak RSS from here on
            base = _status("VmRSS")
        x = torch.randint(0, 50257, (1, spec["seq"]), generator=g)
        t0 = time.perf_counter()
        loss = batch_loss(model, x, x, chunked=args.loss == "chunked")
        loss.backward()
        opt.step()
        opt.zero_grad()
        runtime.settle(model)  # this step's updates and writes belong to its time
        step_s = time.perf_counter() - t0
        stats = runtime.step_stats(model)
        rows.append({"step_s": step_s, "loss": loss.item(), "stall_s": sum(stats.stall_s.values()),
                     "activation_bytes": stats.activation_bytes, "activation_stall_s": stats.activation_stall_s,
                     "nvme_activation_bytes": stats.nvme_by_kind["activations"]})
    out = {"rows": rows[1:], "base_rss": base, "peaks": {t: pm.peak_bytes(t) for t in TIERS},
           "budgets": {t: pm.budget(t) for t in TIERS}}
    runtime.close(model)
    print(json.dumps(out), flush=True)
    sys.stdin.readline()  # the parent reads this process's peak RSS meanwhile


def _status(key: str, pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no {key}")


def run_child(args: argparse.Namespace, seq: int, activations: str, ckpt: bool, host_budget: int) -> dict:
    spec = json.dumps({"seq": seq, "activations": activations, "ckpt": ckpt, "host_budget": host_budget})
    cmd = [sys.executable, __file__, "--child", spec, "--nvme-dir", args.nvme_dir, "--steps", str(args.steps),
           "--device-budget", args.device_budget, "--layers", str(args.layers), "--width", str(args.width),
           "--loss", args.loss]
    env = {**os.environ, "PYTHONPATH": str(REPO), "MALLOC_MMAP_THRESHOLD_": "131072"}
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=env)
    line = proc.stdout.readline()
    peak = _status("VmHWM", proc.pid) if line else 0
    _, err = proc.communicate("exit\n")
    if proc.returncode != 0 or not line:
        raise RuntimeError(f"child {spec} failed:\n{err}")
    got = json.loads(line)
    rows = got["rows"]
    return {"seq": seq, "activations": activations, "checkpointing": ckpt, "peak_rss": peak,
            "base_rss": got["base_rss"], "step_s": statistics.median(r["step_s"] for r in rows),
            "step_s_all": [r["step_s"] for r in rows], "loss": [r["loss"] for r in rows],
            "activation_bytes": rows[-1]["activation_bytes"],
            "activation_stall_s": statistics.median(r["activation_stall_s"] for r in rows),
            "stall_s": statistics.median(r["stall_s"] for r in rows),
            "nvme_activation_bytes": rows[-1]["nvme_activation_bytes"], "peaks": got["peaks"],
            "budgets": got["budgets"]}


# ----------------------------------------------------------------------------------- parent


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        child(args)
        return 0
    import transformers

    seqs = [int(s) for s in args.seqs.split(",")]
    shutil.rmtree(args.nvme_dir, ignore_errors=True)
    Path(args.nvme_dir).parent.mkdir(parents=True, exist_ok=True)
    b = budgets(args, max(seqs))
    runs = []
    for seq in seqs:
        for ckpt in (False, True):
            for mode in MODES:
                host = b["host_mode_host"] if mode == "host" else b["host"]
                runs.append(run_child(args, seq, mode, ckpt, host))
                _progress(runs[-1])
    ab = []
    for _ in range(args.ab_rounds):
        for mode in ("device", "nvme"):
            ab.append(run_child(args, max(seqs), mode, False, b["host"]))
            _progress(ab[-1])
    estimates = {}
    for seq in seqs:
        with torch.device("meta"):
            model = transformers.GPT2LMHeadModel(gpt2(args, seq))
        acts = measure_activations(model, config(args, "nvme", False, host_budget=b["host"]), loss_of(args),
                                   batch=1, seq=seq)  # as `tierzero estimate --batch 1 --seq S` measures them
        estimates[seq] = {"blocks": acts.blocks, "outside": acts.outside, "after": acts.after,
                          "inputs": acts.kept(True),
                          "per_block": acts.largest,
                          "need": {m: {"plain": acts.need(m, False), "checkpointed": acts.need(m, True)}
                                   for m in MODES}}
    shutil.rmtree(args.nvme_dir, ignore_errors=True)
    result = summarize(runs, ab, estimates, seqs, b, args)
    if args.json:
        print(json.dumps(result))
    else:
        report(result)
    return 0


def _progress(run: dict) -> None:
    print(f"  seq {run['seq']:5d} {run['activations']:6s} ckpt={run['checkpointing']!s:5s} "
          f"step {run['step_s']:.2f} s  peak RSS {format_size(run['peak_rss'])}", file=sys.stderr, flush=True)


def summarize(runs: list[dict], ab: list[dict], estimates: dict, seqs: list[int], b: dict,
              args: argparse.Namespace) -> dict:
    lo, hi = min(seqs), max(seqs)
    by = {(r["seq"], r["activations"], r["checkpointing"]): r for r in runs}
    growth = {f"{m}{' ckpt' if c else ''}": by[(hi, m, c)]["peak_rss"] - by[(lo, m, c)]["peak_rss"]
              for m in MODES for c in (False, True)}
    device_budget = parse_size(args.device_budget)
    pairs = [(ab[i]["step_s"], ab[i + 1]["step_s"]) for i in range(0, len(ab), 2)]
    est_vs = []
    for r in runs:
        e = estimates[r["seq"]]
        # what the runtime sees: the model's forward (with the chunked loss inside; a plain loss after it is not)
        want = e["outside"] + (e["inputs"] if r["checkpointing"] else e["blocks"])
        got = sum(r["activation_bytes"].values())
        est_vs.append({"seq": r["seq"], "activations": r["activations"], "checkpointing": r["checkpointing"],
                       "measured": got, "estimated": want, "ratio": want / got if got else None})
    return {
        "runs": runs, "ab": ab, "estimates": estimates, "budgets": b, "device_budget": device_budget, "loss": args.loss,
        "rss_growth": growth,
        "targets": {
            "nvme_growth_within_device_budget": growth["nvme"] <= device_budget,
            "nvme_growth_over_device_growth": growth["nvme"] / growth["device"],
            "nvme_at_most_a_third": growth["nvme"] <= growth["device"] / 3,
            "nvme_ckpt_less_again": growth["nvme ckpt"] < growth["nvme"],
            "nvme_over_device_step": [n / d for d, n in pairs],
            "nvme_step_at_most_1_25x": all(n / d <= 1.25 for d, n in pairs),
            "estimate_within_10pct": all(abs(x["ratio"] - 1) <= 0.10 for x in est_vs if x["ratio"] is not None),
        },
        "estimate_vs_measured": est_vs,
        "identical_losses": all(by[(s, m, c)]["loss"] == by[(s, "device", False)]["loss"]
                                for s in seqs for m in MODES for c in (False, True)),
    }


def report(res: dict) -> None:
    print("| seq | activations | ckpt | step s | peak RSS MiB | act bytes device / host / nvme MiB | act stall s "
          "| stall s | PM peak device / host / nvme MiB (budgets) | estimate / measured act bytes |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    est = {(x["seq"], x["activations"], x["checkpointing"]): x for x in res["estimate_vs_measured"]}
    mib = lambda n: f"{n / 2**20:.0f}"  # noqa: E731
    for r in res["runs"]:
        a = r["activation_bytes"]
        e = est[(r["seq"], r["activations"], r["checkpointing"])]
        print(f"| {r['seq']} | {r['activations']} | {'yes' if r['checkpointing'] else 'no'} | {r['step_s']:.2f} "
              f"| {mib(r['peak_rss'])} | {' / '.join(mib(a[t]) for t in TIERS)} | {r['activation_stall_s']:.2f} "
              f"| {r['stall_s']:.2f} | {' / '.join(mib(r['peaks'][t]) for t in TIERS)} "
              f"({' / '.join(mib(r['budgets'][t]) for t in TIERS)}) | {e['ratio']:.3f} |")
    print(f"\nRSS growth seq {res['runs'][0]['seq']} -> {res['runs'][-1]['seq']}: "
          + ", ".join(f"{k} {v / 2**20:.0f} MiB" for k, v in res["rss_growth"].items()))
    print("A B A B at the longest sequence, step s (device, nvme): "
          + ", ".join(f"{r['activations']} {r['step_s']:.2f}" for r in res["ab"]))
    print(json.dumps(res["targets"], indent=1))
    print(f"loss: {res['loss']}; losses identical in every mode: {res['identical_losses']}")


if __name__ == "__main__":
    sys.exit(main())

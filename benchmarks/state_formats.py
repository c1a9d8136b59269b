"""The CPU's update of one block per optimizer state format: seconds per parameter of
tz.AdamW's step on a block homed on the host tier (gradient, master weights and moments in
memory), "float32" (torch's fused AdamW) against "bfloat16" and "int8" (a window at a time in
one pass of the fused window kernel, [Note: fused state windows] in
tierzero/optim/window_kernel.py; with --eager also its eager torch path, the same bits),
beside torch.optim.AdamW(fused=True) and, when torchao is installed, torchao's AdamW8bit on a
plain tensor of the same size. The entries alternate within each round (A B A B), so the
machine's drift hits them alike.

`--converge N` instead trains the built-in "tiny" GPT N steps on the default corpus (the
Python standard library's source bytes) from the same weights and batches with tz.AdamW in each
format (every state on the host tier) and with torchao's AdamW8bit on the plain model in
memory, and prints the loss curve and the final loss (the mean of the last 10% of steps).

    python benchmarks/state_formats.py [--sizes 1M,4M,16M] [--rounds 5] [--steps 3] [--eager] [--json]
    python benchmarks/state_formats.py --converge 500 [--batch 8] [--seq 128] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Callable

import torch
from torch import nn

import tierzero as tz
from tierzero import runtime
from tierzero.optim import window_kernel

FORMATS = ("float32", "bfloat16", "int8")


def _elements(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text[:-1]) * units[text[-1]]) if text[-1] in units else int(text)


def tiered(numel: int, fmt: str) -> tuple[Callable[[], None], Callable[[], None]]:
    """(one step, close) of tz.AdamW on one block of `numel` parameters, all on the host tier."""
    torch.manual_seed(0)
    model = nn.Linear(1024, numel // 1024, bias=False)
    tz.wrap(model, tz.Config(device_budget="8GiB", host_budget="16GiB", compute_dtype="float32",
                             optimizer_state_dtype=fmt, overlap_step=False))
    opt = tz.AdamW(model, lr=1e-4)
    model(torch.randn(2, 1024)).square().mean().backward()
    return opt.step, lambda: runtime.close(model)


def eager(step: Callable[[], None]) -> Callable[[], None]:
    """`step` on the fused window kernel's eager path (as where no C++ compiler is found)."""
    def run() -> None:
        with window_kernel.built_with(None):
            step()
    return run


def plain(numel: int, kind: str) -> Callable[[], None] | None:
    """One step of a torch or torchao optimizer on a plain fp32 tensor of `numel` elements."""
    p = nn.Parameter(torch.randn(numel // 1024, 1024))
    p.grad = torch.randn_like(p)
    if kind == "torch-fused":
        opt = torch.optim.AdamW([p], lr=1e-4, fused=True)
    else:
        try:
            from torchao.optim import AdamW8bit
        except ImportError:
            return None
        opt = AdamW8bit([p], lr=1e-4, block_size=256)
    opt.step()  # states made (and torchao's step compiled) before the clock starts
    return opt.step


def converge(steps: int, batch: int, seq: int) -> dict:
    """Loss curves of the formats (and torchao's AdamW8bit in memory) on the same run."""
    import copy

    from tierzero.formats.corpus import BatchSampler, stdlib_corpus
    from tierzero.models import build

    torch.manual_seed(0)
    base = build("tiny", seq_len=seq)
    data = stdlib_corpus(8 << 20)
    runs: dict[str, list[float]] = {}
    entries = [f"tz {fmt}" for fmt in FORMATS] + ["torch AdamW", "torchao AdamW8bit"]
    for name in entries:
        model = copy.deepcopy(base)
        if name.startswith("tz "):
            tz.wrap(model, tz.Config(device_budget="1GiB", host_budget="4GiB", compute_dtype="float32",
                                     optimizer_state_dtype=name[3:]))
            opt = tz.AdamW(model, lr=1e-3, weight_decay=0.1)
        elif name == "torch AdamW":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1, fused=True)
        else:
            try:
                from torchao.optim import AdamW8bit
            except ImportError:
                continue
            opt = AdamW8bit(model.parameters(), lr=1e-3, weight_decay=0.1, block_size=256)
        sampler, losses = BatchSampler(data, batch, seq, seed=0), []
        for _ in range(steps):
            x, y = sampler.next()
            loss = model(x, y).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # tiered too: its GradViews, exact
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        if name.startswith("tz "):
            runtime.close(model)
        runs[name] = losses
        print(f"  {name}: final {statistics.mean(losses[-max(1, steps // 10):]):.4f}", flush=True)
    tail = max(1, steps // 10)
    final = {n: statistics.mean(ls[-tail:]) for n, ls in runs.items()}
    return {"steps": steps, "batch": batch, "seq": seq, "final_loss": final,
            "vs_tz_float32": {n: v / final["tz float32"] - 1 for n, v in final.items()},
            "curve": {n: [round(statistics.mean(ls[i:i + 50]), 4) for i in range(0, steps, 50)] for n, ls in runs.items()}}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/state_formats.py", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="1M,4M,16M", help="block sizes in parameters")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="steps timed per round and entry")
    p.add_argument("--eager", action="store_true", help="also the low-bit formats on the eager path")
    p.add_argument("--json", action="store_true")
    p.add_argument("--converge", type=int, default=0, metavar="N", help="the loss curves of N steps instead")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    args = p.parse_args(argv)
    if args.converge:
        out = converge(args.converge, args.batch, args.seq)
        print(json.dumps(out, indent=None if not args.json else 1))
        return 0
    t0 = time.perf_counter()
    built = all(window_kernel.library("adamw", "float32", fmt) is not None for fmt in ("bfloat16", "int8"))
    out = {"threads": torch.get_num_threads(), "torch": torch.__version__, "kernel_built": built,
           "kernel_build_s": round(time.perf_counter() - t0, 2), "sizes": {}}
    if not args.json:
        print(f"fused window kernel: {'built' if built else 'NOT built'} in {out['kernel_build_s']} s")
    for size in args.sizes.split(","):
        numel = _elements(size)
        entries: dict[str, Callable[[], None]] = {}
        closers = []
        for fmt in FORMATS:
            step, close = tiered(numel, fmt)
            step()  # warm: states allocated, pages touched
            entries[f"tz {fmt}"] = step
            closers.append(close)
        if args.eager:
            for fmt in FORMATS[1:]:
                entries[f"tz {fmt} eager"] = eager(entries[f"tz {fmt}"])
        for kind in ("torch-fused", "torchao-AdamW8bit"):
            step = plain(numel, kind)
            if step is not None:
                entries[kind] = step
        times: dict[str, list[float]] = {name: [] for name in entries}
        cpu: dict[str, list[float]] = {name: [] for name in entries}
        for _ in range(args.rounds):
            for name, step in entries.items():  # A B A B
                t0, c0 = time.perf_counter(), time.process_time()
                for _ in range(args.steps):
                    step()
                times[name].append((time.perf_counter() - t0) / args.steps / numel * 1e9)
                cpu[name].append((time.process_time() - c0) / args.steps / numel * 1e9)
        for close in closers:
            close()
        med = {name: statistics.median(ts) for name, ts in times.items()}
        med_cpu = {name: statistics.median(ts) for name, ts in cpu.items()}
        out["sizes"][size] = {"numel": numel, "ns_per_param": med, "cpu_ns_per_param": med_cpu,
                              "speedup_vs_tz_float32": {n: med["tz float32"] / v for n, v in med.items()}}
        if not args.json:
            print(f"{size} ({numel} parameters), ns per parameter (wall; CPU time of all threads), "
                  f"median of {args.rounds} rounds:")
            for name, v in med.items():
                print(f"  {name:<20} {v:7.3f}   x{med['tz float32'] / v:5.2f} of tz float32's speed   "
                      f"cpu {med_cpu[name]:7.3f}")
    if args.json:
        print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

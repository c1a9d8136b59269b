"""The device's working set of a step, measured against what "auto" reserves for it.

The built-in GPT (default: 125m, GPT-2 124M's shape) in fp32 on the CPU. Per --seqs: the reserve
`tierzero.planning.working_set` measures on fake tensors ([Note: measuring the working set];
activations="device", so the reserve is the peak with every block's saves off the device plus
the activations the blocks keep), and one real forward, loss and backward of plain PyTorch in a
fresh process: its resident memory's peak over what the process held before the step (the
parameters built, a small step run first for the kernels' and the engine's first use, each
gradient dropped once accumulated, as the runtime moves it to the grads tier), read as VmHWM
after resetting it (/proc/self/clear_refs). Each seq runs in a process of its own.

    .venv/bin/python benchmarks/working_set.py [--model 125m] [--batch 1] [--seqs 256,512,1024] [--json]
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import torch

import tierzero as tz
from tierzero import formats
from tierzero.cli.harness import batch_loss
from tierzero.models import build
from tierzero.planning import working_set


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def _hwm() -> int:
    """This process's peak resident memory since the last reset (VmHWM)."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


def real_peak(model_name: str, batch: int, seq: int) -> int:
    """Resident peak of one real step over the resident memory before it (this process)."""
    torch.manual_seed(0)
    model = build(model_name, vocab_size=formats.VOCAB_SIZE, seq_len=seq).train()
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    ids = torch.randint(0, formats.VOCAB_SIZE, (batch, seq))
    batch_loss(model, ids[:, :8], ids[:, :8]).backward()  # first use of the kernels and the engine, small
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the resident memory now
    before = _rss()
    batch_loss(model, ids, ids).backward()
    return _hwm() - before


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="125m")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seqs", default="256,512,1024")
    p.add_argument("--json", action="store_true")
    p.add_argument("--real", type=int, default=None, help=argparse.SUPPRESS)  # the child: one real step at seq
    args = p.parse_args()
    if args.real is not None:
        print(real_peak(args.model, args.batch, args.real))
        return
    rows = []
    for seq in (int(s) for s in args.seqs.split(",")):
        model = build(args.model, device="meta", vocab_size=formats.VOCAB_SIZE, seq_len=seq)
        t0 = time.perf_counter()
        ws = working_set(model, tz.Config(compute_dtype="float32"), batch_loss, batch=args.batch, seq=seq)
        took = time.perf_counter() - t0
        child = subprocess.run([sys.executable, __file__, "--model", args.model, "--batch", str(args.batch),
                                "--real", str(seq)], capture_output=True, text=True)
        if child.returncode:
            raise SystemExit(f"the real step at seq {seq} failed:\n{child.stderr}")
        real = int(child.stdout)
        rows.append({"seq": seq, "batch": args.batch, "peak": ws.peak, "activations": ws.activations,
                     "reserve": ws.reserve, "real_step_peak": real, "reserve_over_real": round(ws.reserve / real, 3),
                     "measure_s": round(took, 2)})
    if args.json:
        print(json.dumps(rows))
        return
    print(f"{args.model}, batch {args.batch}, fp32, CPU")
    print(f"{'seq':>6} {'peak (saves off)':>17} {'activations':>12} {'reserve':>10} {'real step':>10} {'ratio':>6}")
    for r in rows:
        print(f"{r['seq']:>6} {tz.format_size(r['peak']):>17} {tz.format_size(r['activations']):>12} "
              f"{tz.format_size(r['reserve']):>10} {tz.format_size(r['real_step_peak']):>10} "
              f"{r['reserve_over_real']:>6}")


if __name__ == "__main__":
    main()

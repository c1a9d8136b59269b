"""Step time of a tiered model eager against compiled (tz.compile, inductor), in one process.

The built-in GPT (125m by default: 12 layers x 768, vocabulary 50304) wrapped twice from the
same weights, with parameters, gradients and optimizer states on the host tier and fp32
compute; one copy's blocks compiled with tz.compile. Both see the same batches and their steps
alternate in pairs (eager, compiled, eager, compiled, ...), each timed from forward to
zero_grad (AdamW included) after --warmup steps each (the compile happens there; its time is
printed). Prints each pair, the medians, the ratio compiled / eager and the largest loss
difference between the two.

    flock /tmp/tierzero-bench.lock .venv/bin/python benchmarks/compile.py [--model 125m] [--batch 1]
        [--seq 256] [--pairs 4] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

import tierzero as tz
from tierzero import runtime
from tierzero.models import GPT, gpt_config


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/compile.py", description=__doc__.splitlines()[0])
    p.add_argument("--model", default="125m", help="a built-in GPT size")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--pairs", type=int, default=4, help="timed (eager, compiled) pairs after --warmup")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps of each (the first one compiles)")
    p.add_argument("--host-budget", default="8GiB")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def build(args: argparse.Namespace, compiled: bool) -> tuple[GPT, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = GPT(gpt_config(args.model, seq_len=args.seq))
    n_params = sum(p.numel() for p in model.parameters())
    cfg = tz.Config(device_budget=n_params * 4, host_budget=args.host_budget, params="host", grads="host",
                    optimizer_states="host", compute_dtype="float32")
    tz.wrap(model, cfg)
    if compiled:
        tz.compile(model)
    return model, tz.AdamW(model, lr=3e-4, weight_decay=0.1)


def step(model: GPT, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """(seconds, loss) of one training step."""
    t0 = time.perf_counter()
    loss = model(x, y).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    runtime.settle(model)  # the overlapped step's update is timed in the step that queued it
    return time.perf_counter() - t0, loss.item()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    runs = {"eager": build(args, False), "compiled": build(args, True)}
    vocab = runs["eager"][0].config.vocab_size
    g = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, vocab, (args.batch, args.seq + 1), generator=g)
               for _ in range(args.warmup + args.pairs)]
    times: dict[str, list[float]] = {k: [] for k in runs}
    losses: dict[str, list[float]] = {k: [] for k in runs}
    warmup_s: dict[str, float] = {k: 0.0 for k in runs}
    try:
        for i, b in enumerate(batches):
            for name, (model, opt) in runs.items():
                s, loss = step(model, opt, b[:, :-1], b[:, 1:])
                losses[name].append(loss)
                if i < args.warmup:
                    warmup_s[name] += s
                else:
                    times[name].append(s)
            if i >= args.warmup and not args.json:
                print(f"pair {i - args.warmup + 1}: eager {times['eager'][-1]:.3f} s, "
                      f"compiled {times['compiled'][-1]:.3f} s", file=sys.stderr)
    finally:
        for model, _ in runs.values():
            runtime.close(model)
    med = {k: statistics.median(v) for k, v in times.items()}
    result = {"model": args.model, "batch": args.batch, "seq": args.seq, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "warmup_s": warmup_s, "step_s": times, "median_s": med,
              "ratio": med["compiled"] / med["eager"],
              "pair_ratios": [c / e for e, c in zip(times["eager"], times["compiled"])],
              "max_loss_diff": max(abs(a - b) for a, b in zip(losses["eager"], losses["compiled"]))}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.model} batch {args.batch} x seq {args.seq}: eager {med['eager']:.3f} s, compiled "
              f"{med['compiled']:.3f} s a step (median of {args.pairs}), compiled / eager {result['ratio']:.3f}; "
              f"warmup (compile) {warmup_s['compiled']:.1f} s against {warmup_s['eager']:.1f} s; "
              f"losses {result['max_loss_diff']:.2e} apart at most")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Loss curves of the optimizer state formats on a transformers Llama (issue 53, item 3).

A small `transformers.LlamaForCausalLM` built from a config (bytes as tokens: vocabulary 256) is
trained N steps on real text, the default corpus of `tierzero train` and of
`benchmarks/state_formats.py --converge` (the Python standard library's source files read as
bytes), from the same weights and the same batches, by:

    torch AdamW        torch.optim.AdamW(fused=True), fp32 states, the plain model in memory
    tz float32         tz.AdamW, fp32 states (bit for bit torch's fused AdamW)
    tz bfloat16        tz.AdamW, both moments in bf16
    tz int8            tz.AdamW, both moments in blockwise 8 bits (Config.optimizer_state_dtype)
    torchao AdamW8bit  torchao.optim.AdamW8bit (block 256), the plain model in memory, where
                       torchao imports

all with lr 1e-3 (linear warm-up over the first 5 % of steps, then cosine to 10 %), weight decay
0.1 and the gradients clipped to norm 1.0; fp32 compute. Per run: the final loss (the mean of
the last 10 % of steps), the loss on 16 held-out batches of the corpus's last 10 % after
training, the curve (means of 50 steps) and the seconds it took; each format's final and
held-out loss against torch AdamW's and torchao's.

    python benchmarks/converge_llama.py [--steps 500] [--batch 8] [--seq 128] [--threads 1] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
import time
from typing import Any

import torch

import tierzero as tz
from tierzero import runtime

ENTRIES = ("torch AdamW", "tz float32", "tz bfloat16", "tz int8", "torchao AdamW8bit")
LLAMA = dict(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=False)
EVAL_BATCHES = 16


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/converge_llama.py", description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--corpus-bytes", default="16MiB", help="bytes of the corpus read")
    p.add_argument("--entries", default=",".join(ENTRIES), help="comma-separated, of: " + ", ".join(ENTRIES))
    p.add_argument("--threads", type=int, default=1,
                   help="torch's CPU threads (1: on a shared machine OpenMP's threads wait on each other)")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def llama(seq: int) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(max_position_embeddings=seq, **LLAMA))


def optimizer(name: str, model: torch.nn.Module, lr: float) -> Any:
    if name.startswith("tz "):
        tz.wrap(model, tz.Config(device_budget="1GiB", host_budget="4GiB", compute_dtype="float32",
                                 optimizer_state_dtype=name[3:]))
        return tz.AdamW(model, lr=lr, weight_decay=0.1)
    if name == "torch AdamW":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, fused=True)
    from torchao.optim import AdamW8bit

    return AdamW8bit(model.parameters(), lr=lr, weight_decay=0.1, block_size=256)


def schedule(step: int, steps: int) -> float:
    """The learning rate's factor at `step`: linear warm-up over 5 % of the steps, then cosine
    down to 10 %."""
    warm = max(1, steps // 20)
    if step < warm:
        return (step + 1) / warm
    return 0.1 + 0.45 * (1 + math.cos(math.pi * (step - warm) / max(1, steps - warm)))


def train(name: str, base: torch.nn.Module, data: Any, held_out: Any, args: argparse.Namespace) -> dict:
    from tierzero.formats.corpus import BatchSampler

    model = copy.deepcopy(base)
    opt = optimizer(name, model, args.lr)
    sampler, losses = BatchSampler(data, args.batch, args.seq, seed=0), []
    t0 = time.perf_counter()
    for step in range(args.steps):
        for group in opt.param_groups:  # torchao keeps lr as a tensor, changed in place
            lr = args.lr * schedule(step, args.steps)
            group["lr"].fill_(lr) if isinstance(group["lr"], torch.Tensor) else group.__setitem__("lr", lr)
        x, _ = sampler.next()
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # tiered too: its GradViews, exact
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    seconds = time.perf_counter() - t0
    evaluator = BatchSampler(held_out, args.batch, args.seq, seed=1)
    with torch.no_grad():
        held = statistics.mean(model(input_ids=x, labels=x).loss.item()
                               for x, _ in (evaluator.next() for _ in range(EVAL_BATCHES)))
    if name.startswith("tz "):
        runtime.close(model)
    tail = max(1, args.steps // 10)
    return {"final_loss": statistics.mean(losses[-tail:]), "held_out_loss": held, "seconds": seconds,
            "curve": [round(statistics.mean(losses[i:i + 50]), 4) for i in range(0, args.steps, 50)]}


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.set_num_threads(args.threads)
    names = args.entries.split(",")
    unknown = [n for n in names if n not in ENTRIES]
    if unknown:
        raise SystemExit(f"--entries: {unknown} unknown; give some of {', '.join(ENTRIES)}")
    from tierzero.config import parse_size
    from tierzero.formats.corpus import stdlib_corpus

    corpus = stdlib_corpus(parse_size(args.corpus_bytes, what="--corpus-bytes"))
    cut = len(corpus) * 9 // 10
    data, held_out = corpus[:cut], corpus[cut:]
    base = llama(args.seq)
    runs: dict[str, dict] = {}
    for name in names:
        if name == "torchao AdamW8bit":
            try:
                import torchao.optim  # noqa: F401
            except ImportError:
                print(f"  {name}: torchao does not import, left out", flush=True)
                continue
        runs[name] = train(name, base, data, held_out, args)
        r = runs[name]
        print(f"  {name}: final {r['final_loss']:.4f}, held-out {r['held_out_loss']:.4f}, {r['seconds']:.0f} s",
              flush=True)

    def against(ref: str, key: str) -> dict[str, float]:
        return {} if ref not in runs else {n: r[key] / runs[ref][key] - 1 for n, r in runs.items()}

    out = {"model": {**LLAMA, "params": sum(p.numel() for p in base.parameters())}, "steps": args.steps,
           "batch": args.batch, "seq": args.seq, "lr": args.lr, "torch": torch.__version__,
           "threads": torch.get_num_threads(), "runs": runs,
           "final_vs_torch_adamw": against("torch AdamW", "final_loss"),
           "final_vs_torchao": against("torchao AdamW8bit", "final_loss"),
           "held_out_vs_torch_adamw": against("torch AdamW", "held_out_loss"),
           "held_out_vs_torchao": against("torchao AdamW8bit", "held_out_loss")}
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"Llama of {out['model']['params'] / 1e6:.2f} M parameters, {args.steps} steps of {args.batch} x {args.seq} "
          "bytes of the stdlib corpus")
    print(f"{'':20s} {'final':>8s} {'held-out':>9s} {'vs AdamW':>9s} {'vs torchao':>11s} {'seconds':>8s}")
    for n, r in runs.items():
        vs = out["final_vs_torch_adamw"].get(n)
        ao = out["final_vs_torchao"].get(n)
        print(f"{n:20s} {r['final_loss']:8.4f} {r['held_out_loss']:9.4f} "
              f"{'-' if vs is None else f'{vs:+.2%}':>9s} {'-' if ao is None else f'{ao:+.2%}':>11s} {r['seconds']:8.0f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Step overhead of tiering: a ~90M-parameter GPT in fp32 with params and optimizer states homed
on NVMe (fp32 gradients on host) and a device budget of a quarter of the parameters, against
the same model held in memory and trained with torch.optim.AdamW, in one process.

The model is transformers' GPT2LMHeadModel (12 layers x 768, vocabulary 8192: 92M parameters;
--model gpt2, the default) or tierzero's built-in GPT of the same depth and width (vocabulary
256; --model gpt, the figures before 2026-11-24). Three copies start from the same weights and
see the same batches; their steps alternate (tiered, in memory with torch.optim.AdamW's
default for-loop implementation, in memory with AdamW(fused=True), tiered, ...), each timed
from forward to zero_grad (clipping and AdamW included). Prints the median step time of each,
the ratios tiered / in-memory (target <= 1.10 against the default), and where the tiered
step's time goes: forward + backward, optimizer step, stall waiting for copies, bytes read from
/ written to NVMe.

    .venv/bin/python benchmarks/step_overhead.py --nvme-dir runs/step-overhead [--steps 6] [--json]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time

import torch

import tierzero as tz
from tierzero import runtime
from tierzero.models import GPT, GPTConfig


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/step_overhead.py", description=__doc__.splitlines()[0])
    p.add_argument("--nvme-dir", default="runs/step-overhead")
    p.add_argument("--model", default="gpt2", choices=("gpt2", "gpt"),
                   help="transformers GPT2LMHeadModel (vocabulary 8192) or the built-in GPT (vocabulary 256)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--steps", type=int, default=6, help="timed steps of each (after --warmup)")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--host-budget", default="1GiB",
                   help="less than the state homed on NVMe, so it streams rather than stays cached")
    p.add_argument("--step-in-backward", action="store_true",
                   help="tiered: update each block during backward (no clipping then)")
    p.add_argument("--json", action="store_true")
    return p.parse_args(argv)


def build(args: argparse.Namespace) -> tuple[torch.nn.Module, int]:
    """The model and its vocabulary size."""
    if args.model == "gpt":
        return GPT(GPTConfig(vocab_size=256, seq_len=args.seq, n_layer=args.layers, n_head=args.heads,
                             n_embd=args.width)), 256
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(vocab_size=8192, n_positions=args.seq, n_embd=args.width, n_layer=args.layers,
                     n_head=args.heads, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                     eos_token_id=0)
    return GPT2LMHeadModel(cfg).float().train(), 8192


def loss_of(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if isinstance(model, GPT):
        return model(x, y).loss
    return model(input_ids=x, labels=y).loss


def timed_step(model: torch.nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor,
               clip: bool, tiered: bool) -> tuple[float, float, float]:
    """(step seconds, forward+backward seconds, loss) of one training step."""
    t0 = time.perf_counter()
    loss = loss_of(model, x, y)
    loss.backward()
    t1 = time.perf_counter()
    if clip:
        if tiered:
            tz.clip_grad_norm_(model, 1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad()
    return time.perf_counter() - t0, t1 - t0, loss.item()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    torch.manual_seed(0)
    ref, vocab = build(args)
    n_params = sum(p.numel() for p in ref.parameters())
    model = copy.deepcopy(ref)
    fused_ref = copy.deepcopy(ref)
    tcfg = tz.Config(device_budget=n_params * 4 // 4, host_budget=args.host_budget,
                     nvme_dir=args.nvme_dir, params="nvme", grads="host", optimizer_states="nvme",
                     compute_dtype="float32", step_in_backward=args.step_in_backward)
    tz.wrap(model, tcfg)
    opt = tz.AdamW(model, lr=3e-4, weight_decay=0.1)
    ropt = torch.optim.AdamW(ref.parameters(), lr=3e-4, weight_decay=0.1)
    fopt = torch.optim.AdamW(fused_ref.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    clip = not args.step_in_backward
    g = torch.Generator().manual_seed(1)
    pm = runtime.placement_manager(model)
    rows: list[dict] = []
    try:
        for i in range(args.warmup + args.steps):
            x = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
            y = torch.randint(0, vocab, (args.batch, args.seq), generator=g)
            runtime.step_stats(model)
            t0 = time.perf_counter()
            _, t_fb, loss = timed_step(model, opt, x, y, clip, tiered=True)
            pm.flush()  # the step's write-backs are timed in the step that made them
            t_step = time.perf_counter() - t0
            stats = runtime.step_stats(model)
            r_step, r_fb, rloss = timed_step(ref, ropt, x, y, clip, tiered=False)
            f_step, _, floss = timed_step(fused_ref, fopt, x, y, clip, tiered=False)
            if i >= args.warmup:
                rows.append(dict(tiered_s=t_step, tiered_fb_s=t_fb, ref_s=r_step, ref_fb_s=r_fb, fused_s=f_step,
                                 stall_s=sum(stats.stall_s.values()), nvme_read=stats.nvme_read_bytes,
                                 nvme_write=stats.nvme_write_bytes, loss=loss, ref_loss=rloss, fused_loss=floss))
    finally:
        runtime.close(model)
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    result = {
        "model": args.model, "params": n_params, "batch": args.batch, "seq": args.seq, "steps": args.steps,
        "device_budget": tcfg.device_budget, "host_budget": tcfg.host_budget,
        "step_in_backward": args.step_in_backward,
        "tiered_step_s": med["tiered_s"], "in_memory_step_s": med["ref_s"],
        "ratio": med["tiered_s"] / med["ref_s"],
        "in_memory_fused_step_s": med["fused_s"], "ratio_vs_fused": med["tiered_s"] / med["fused_s"],
        "tiered_fwd_bwd_s": med["tiered_fb_s"], "in_memory_fwd_bwd_s": med["ref_fb_s"],
        "tiered_optimizer_s": med["tiered_s"] - med["tiered_fb_s"],
        "in_memory_optimizer_s": med["ref_s"] - med["ref_fb_s"],
        "stall_s": med["stall_s"], "nvme_read_gb": med["nvme_read"] / 1e9,
        "nvme_write_gb": med["nvme_write"] / 1e9,
        "max_loss_rel_diff": max(abs(r["loss"] - r["ref_loss"]) / abs(r["ref_loss"]) for r in rows),
        "max_loss_rel_diff_fused": max(abs(r["loss"] - r["fused_loss"]) / abs(r["fused_loss"]) for r in rows),
        "peak_bytes": {t: pm.peak_bytes(t) for t in ("device", "host", "nvme")},
    }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.model} {n_params / 1e6:.1f}M params fp32, batch {args.batch} x seq {args.seq}, "
              f"median of {args.steps} steps each")
        print(f"  in memory (torch.optim.AdamW): step {result['in_memory_step_s']:.3f} s "
              f"(fwd+bwd {result['in_memory_fwd_bwd_s']:.3f} s, optimizer {result['in_memory_optimizer_s']:.3f} s)")
        print(f"  in memory (torch.optim.AdamW(fused=True)): step {result['in_memory_fused_step_s']:.3f} s")
        print(f"  tiered (params+states on nvme): step {result['tiered_step_s']:.3f} s "
              f"(fwd+bwd {result['tiered_fwd_bwd_s']:.3f} s, optimizer {result['tiered_optimizer_s']:.3f} s, "
              f"stall {result['stall_s']:.3f} s, nvme read {result['nvme_read_gb']:.2f} GB "
              f"write {result['nvme_write_gb']:.2f} GB)")
        print(f"  ratio tiered / in memory: {result['ratio']:.3f} (target <= 1.10), against the fused "
              f"AdamW {result['ratio_vs_fused']:.3f}; losses agree within {result['max_loss_rel_diff']:.1e} "
              f"(default) and {result['max_loss_rel_diff_fused']:.1e} (fused) relative")
    return 0


if __name__ == "__main__":
    sys.exit(main())

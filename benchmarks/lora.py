"""LoRA over a ~1B Llama whose frozen base stays on NVMe in its own checkpoint files.

A transformers Llama of ~1.1B parameters (TinyLlama's shape: hidden 2048, 22 layers, MLP 5632,
32 heads with 4 KV heads, vocabulary 32000) is built from its config, saved as a bfloat16 model
folder once (reused when it exists), and fine-tuned with LoRA r=16 on every linear layer (peft,
"all-linear": q, k, v, o, gate, up, down), sequence 512, batch 1, bfloat16 compute, tz.AdamW on
the adapters. Two runs, each in a process of its own (so that each has its own peak RSS), with the
same seed and batches:

    nvme    Config(frozen="nvme"): the base's homes are the folder's safetensors files
            (copy-on-write homes: nothing copied at load, never written); the adapters, their
            gradients and AdamW state on the host
    memory  Config(frozen="host"): the same, with the base copied into host memory at load

For each: load seconds, step seconds (the first step records the block order and is reported
apart), NVMe bytes read and written per step by kind (tierzero's telemetry; "frozen" is the
base), the tiers' peaks against their budgets, the process's peak RSS, and the losses (equal in
both runs: the same values are computed). Activations are the caller's (outside the budgets).

    flock /tmp/tierzero-bench.lock python benchmarks/lora.py --dir /mnt/nvme/tz-lora [--steps 3]
        [--prefetch adaptive] [--runs nvme,memory] [--json]
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

RUNS = {"nvme": "nvme", "memory": "host"}
"""Run name -> Config.frozen."""


def llama_config(layers: int) -> Any:
    import transformers

    return transformers.LlamaConfig(hidden_size=2048, intermediate_size=5632, num_hidden_layers=layers,
                                    num_attention_heads=32, num_key_value_heads=4, vocab_size=32000,
                                    max_position_embeddings=2048, tie_word_embeddings=False)


def make_folder(folder: Path, layers: int) -> float:
    """The bfloat16 model folder (built from the config, random weights); seconds it took (0 if kept)."""
    import transformers

    if (folder / "config.json").is_file():
        return 0.0
    start = time.perf_counter()
    torch.manual_seed(0)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = transformers.LlamaForCausalLM(llama_config(layers))
    finally:
        torch.set_default_dtype(old)
    model.save_pretrained(folder)
    return time.perf_counter() - start


def run(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """One run in this process (see the module docstring)."""
    import peft
    import transformers

    import tierzero as tz
    from tierzero import runtime
    from tierzero.hf import meta_model

    folder = Path(args.dir) / f"llama-{args.layers}"
    cfg = tz.Config(device_budget=args.device_budget, host_budget=args.host_budget if name == "nvme"
                    else args.host_budget_memory, nvme_dir=str(Path(args.dir) / f"swap-{name}"), nvme_budget="64GiB",
                    params="host", grads="host", optimizer_states="host", frozen=RUNS[name], compute_dtype="bfloat16",
                    prefetch=tz.PrefetchConfig(policy=args.prefetch))
    start = time.perf_counter()
    base = meta_model(folder)  # bfloat16, from config.json, on the meta device
    torch.manual_seed(1)
    lora = peft.LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
    model = tz.wrap(peft.get_peft_model(base, lora), cfg, weights=folder)
    load_s = time.perf_counter() - start
    opt = tz.AdamW(model, lr=1e-4, weight_decay=0.0)
    pm = runtime.placement_manager(model)
    runtime.step_stats(model)  # the load's reads are not a step's
    g = torch.Generator().manual_seed(2)
    steps = []
    try:
        for _ in range(args.steps):
            x = torch.randint(0, 32000, (1, args.seq), generator=g)
            t = time.perf_counter()
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            tz.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
            runtime.settle(model)
            stats = runtime.step_stats(model)
            steps.append({"s": time.perf_counter() - t, "loss": loss.item(), "nvme_read": stats.nvme_read_bytes,
                          "nvme_write": stats.nvme_write_bytes, "stall_s": sum(stats.stall_s.values()),
                          "by_kind": {k: v for k, v in stats.nvme_by_kind.items() if v["read"] or v["write"]}})
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in model.parameters())
        return {"run": name, "frozen": RUNS[name], "params": total, "trainable": trainable, "load_s": load_s,
                "steps": steps, "budgets": {t: pm.budget(t) for t in ("device", "host", "nvme")},
                "peaks": {t: pm.peak_bytes(t) for t in ("device", "host", "nvme")},
                "base_bytes": sum(h.nbytes for h in pm.handles if h.kind is tz.Kind.FROZEN),
                "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
                "transformers": transformers.__version__, "peft": peft.__version__}
    finally:
        runtime.close(model)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="/tmp/tierzero-bench-lora", help="the model folder and the swap files go here")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--layers", type=int, default=22, help="decoder layers (22: ~1.1B parameters)")
    p.add_argument("--device-budget", default="1GiB")
    p.add_argument("--host-budget", default="1536MiB", help="of the nvme run (the base stays on NVMe)")
    p.add_argument("--host-budget-memory", default="4GiB", help="of the memory run (the base is in it)")
    p.add_argument("--prefetch", default="adaptive", help="the prefetch policy (tz.PrefetchConfig.policy)")
    p.add_argument("--runs", default=",".join(RUNS), help=f"which runs, of {', '.join(RUNS)}")
    p.add_argument("--run", choices=list(RUNS), help=argparse.SUPPRESS)  # one run, in a subprocess
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    if args.run:
        print(json.dumps(run(args.run, args)))
        return 0
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    built = make_folder(Path(args.dir) / f"llama-{args.layers}", args.layers)
    forwarded = [a for a in sys.argv[1:] if a != "--json"]
    results = []
    for name in args.runs.split(","):
        proc = subprocess.run([sys.executable, __file__, *forwarded, "--run", name], capture_output=True, text=True)
        if proc.returncode != 0:
            sys.exit(f"benchmarks/lora.py: the {name} run failed:\n{proc.stderr}")
        results.append(json.loads(proc.stdout.splitlines()[-1]))
    if args.json:
        print(json.dumps({"folder_built_s": built, "runs": results}))
        return 0
    gib = 2**30
    for r in results:
        later = r["steps"][1:] or r["steps"]
        step = statistics.median(s["s"] for s in later)
        reads = statistics.median(s["nvme_read"] for s in later)
        writes = max(s["nvme_write"] for s in r["steps"])
        print(f"{r['run']:7s} (frozen={r['frozen']}): {r['params'] / 1e9:.2f}B parameters, {r['trainable'] / 1e6:.1f}M "
              f"trainable; load {r['load_s']:.1f} s; first step {r['steps'][0]['s']:.1f} s, then {step:.1f} s "
              f"(median of {len(later)}, stall {statistics.median(s['stall_s'] for s in later):.2f} s)")
        print(f"        NVMe per step: read {reads / gib:.2f} GiB ({reads / r['base_bytes']:.2f}x the "
              f"{r['base_bytes'] / gib:.2f} GiB base), written {writes} bytes at most; by kind {later[-1]['by_kind']}")
        print("        peaks / budgets: " + ", ".join(f"{t} {r['peaks'][t] / gib:.2f} / {r['budgets'][t] / gib:.2f} GiB"
                                               for t in ("device", "host", "nvme"))
              + f"; peak RSS {r['peak_rss'] / gib:.2f} GiB; losses {[round(s['loss'], 4) for s in r['steps']]}")
    if len(results) > 1:
        same = len({tuple(s["loss"] for s in r["steps"]) for r in results}) == 1
        print(f"the same losses in every run: {same}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

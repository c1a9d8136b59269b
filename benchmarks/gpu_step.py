"""A training step on a GPU: a transformers Llama of ~1B parameters, bf16 compute with fp32
master weights, seq 1024, trained by tierzero and by the offloading baselines beside plain PyTorch.

Configurations (each in a child process of its own, the same batches):

    a  tierzero, parameters, gradients and optimizer states on the pinned host tier, a device
       budget of a quarter of the bf16 parameters
    b  the same with parameters, gradients and optimizer states on NVMe (--nvme-dir)
    f  tierzero, parameters and gradients on the pinned host tier, optimizer states (fp32
       master weights and moments) on NVMe: state split over host and disk, for a model whose
       training state is larger than the GPU (`--size 5b --device-budget 16GiB`)
    g  tierzero "auto": parameters and optimizer states placed by `"auto"` (device first, then
       host, then NVMe) under the GPU's own memory (a device budget of 85 % of it; the step's
       working set reserved as `tierzero train` reserves it), gradients with their updates
    c  FSDP2, fully_shard(offload_policy=CPUOffloadPolicy()) on one rank, bf16 mixed precision
    d  torchao's CPUOffloadOptimizer (AdamW), when torchao imports
    e  plain PyTorch on the GPU: fp32 parameters and AdamW(fused=True), bf16 autocast

A configuration may carry modifiers: `-compiled` (tierzero's: each block compiled with
tz.compile; e: torch.compile of the model), with `--micro-batches K` above 1, `-plain`, and on
tierzero's `-bf16` or `-int8`: the optimizer's moments in that format
(Config.optimizer_state_dtype; fp32 master weights), so `--configs g,g-bf16,g-int8` is "auto"
with each state format, and the result records where each kind lives (`tier_bytes`, as
tz.tier_bytes counts it) and the GPU's share of the state.
Each step is K micro-batches of --batch rows: tierzero's configurations run them through
tz.accumulate (layer by layer, each block fetched once for the K forwards and once for the K
backwards), a `-plain` one and the baselines through the plain accumulation loop. So
`--configs a,a-plain --micro-batches 8` is the layer-major schedule against the plain loop, and
`--configs e,e-compiled,a,a-compiled` is torch.compile against eager.

Per configuration, over the steps after --warmup: tokens/s, step seconds (median), the GPU busy
fraction, tierzero's stall seconds, peak GPU memory (torch.cuda.max_memory_allocated) and peak
pinned host bytes (tierzero: its pinned region; the others: torch's pinned allocator's peak).
The GPU busy fraction is the GPU time of one forward and backward with everything resident (e's
kernels, timed with CUDA events around them) over the configuration's step time: the share of
its step the GPU could not have been shorter. A table, or --json.

Without CUDA, `--device cpu --streams async` runs a, b and e with the CPU as device and the
asynchronous stream stand-in (tierzero/placement/storage/stand_in.py), so the script's logic is
exercised on every machine; `--size tiny` makes it quick. The GPU figures need a GPU.

    python benchmarks/gpu_step.py --nvme-dir /mnt/nvme/gpu-step [--configs a,b,c,d,e] [--steps 5] [--json]
    python benchmarks/gpu_step.py --device cpu --streams async --size tiny --seq 128 --nvme-dir /tmp/gs
    python benchmarks/gpu_step.py --configs a,a-plain --micro-batches 8 [...]

benchmarks/gpu_checks.sh runs ../shared/GPU.md's list with these commands.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

SIZES = {
    # TinyLlama-1.1B's shape: 1.10 B parameters
    "1b": dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
               num_attention_heads=32, num_key_value_heads=4),
    # a 5.11 B Llama (Llama-2-7B's widths, 24 layers): 92 GB of training state at 18 B/param,
    # more than an H100's 80 GB
    "5b": dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=24,
               num_attention_heads=32, num_key_value_heads=32),
    "tiny": dict(vocab_size=1024, hidden_size=128, intermediate_size=344, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2),
}
NAMES = {"a": "tierzero host", "b": "tierzero NVMe", "f": "tierzero host + NVMe states", "g": "tierzero auto",
         "c": "FSDP2 CPUOffloadPolicy", "d": "torchao CPUOffloadOptimizer", "e": "plain PyTorch"}
TIERZERO = ("a", "b", "f", "g")
MODIFIERS = ("compiled", "plain", "bf16", "int8")
STATE_DTYPE = {"bf16": "bfloat16", "int8": "int8"}
"""The state-format modifiers: Config.optimizer_state_dtype (without one: float32)."""


def parse_name(name: str) -> tuple[str, set[str]]:
    """A --configs entry as (configuration, modifiers): "a-plain" -> ("a", {"plain"})."""
    which, *mods = name.split("-")
    return which, set(mods)

PLACEMENT = {"a": ("host", "host", "host"), "b": ("nvme", "nvme", "nvme"), "f": ("host", "host", "nvme")}
"""tierzero's configurations: the tiers of the parameters, gradients and optimizer states."""
STATE_BYTES = (2, 4, 12)
"""Bytes per parameter of each: bf16 parameters, fp32 gradients, fp32 master weights and moments."""


def state_bytes(spec: dict) -> tuple[float, float, float]:
    """STATE_BYTES with the moments in the configuration's format (scales included)."""
    from tierzero.config import state_bytes_per_param

    return STATE_BYTES[0], STATE_BYTES[1], 4 + 2 * state_bytes_per_param(spec["state_dtype"])


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/gpu_step.py", description=__doc__.splitlines()[0])
    p.add_argument("--device", default=None, choices=("cuda", "cpu"), help="default: cuda when there is one")
    p.add_argument("--streams", default="sync", choices=("sync", "async"), help="the CPU's copy streams")
    p.add_argument("--size", default="1b", choices=tuple(SIZES))
    p.add_argument("--configs", default="a,b,c,d,e")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=1, help="rows per micro-batch")
    p.add_argument("--micro-batches", type=int, default=1, metavar="K",
                   help="micro-batches per step (gradient accumulation; see the configurations' -plain)")
    p.add_argument("--steps", type=int, default=5, help="timed steps, after --warmup")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--host-budget", default=None, help="tierzero's host budget (default: a: the whole "
                   "state and staging, b: 4 GiB, f: the parameters and gradients and staging)")
    p.add_argument("--device-budget", default=None, help="tierzero's device budget (default: a quarter of "
                   "the bf16 parameters, or the root block and two of the largest where that is more)")
    p.add_argument("--nvme-dir", default="runs/gpu-step")
    p.add_argument("--json", action="store_true")
    p.add_argument("--timeout", type=float, default=None, help="seconds one configuration may run "
                   "(default: no limit); one that runs longer is reported as timed out")
    p.add_argument("--log-dir", default=None, help="keep each configuration's stdout and stderr here")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


# --------------------------------------------------------------------------- one configuration

def _model(spec: dict) -> Any:
    import torch
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(max_position_embeddings=max(spec["seq"], 128), tie_word_embeddings=False,
                                   **SIZES[spec["size"]])
    return transformers.LlamaForCausalLM(cfg)


def _pinned_peak() -> int | None:
    """Peak bytes of torch's pinned host allocator (None where torch does not report it)."""
    import torch

    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is None or not torch.cuda.is_available():
        return None
    return next((v for k, v in stats().items() if "allocated_bytes" in k and k.endswith("peak")), None)


def _peak_rss() -> int:
    """This process's peak resident bytes."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _device_budget(model: Any, n: int) -> int:
    """A quarter of the bf16 parameters, or the root block and two of the largest where that is
    more (a small model's embeddings)."""
    import torch

    import tierzero as tz
    from tierzero.layout import ROOT, block_fetch_bytes, blocks_of

    sizes = {name: block_fetch_bytes(ps, torch.bfloat16, 1) for name, _, ps in blocks_of(model, tz.Config())}
    root = sizes.pop(ROOT)
    return max(2 * n // 4, root + 2 * max(sizes.values()))


def _auto(model: Any, spec: dict, n: int) -> Any:
    """Configuration g's Config: "auto" under 85 % of the GPU's memory (without CUDA: the step's
    working set and the bf16 parameters' bytes, so that "auto" splits), a host budget of the
    whole state and staging within 60 % of the RAM, NVMe for the rest; the step's working set
    reserved as `tierzero train` reserves it."""
    import psutil
    import torch

    import tierzero as tz
    from tierzero.cli.estimate import reserve_working_set

    per = sum(state_bytes(spec))
    host = spec["host_budget"] or int(min(psutil.virtual_memory().total * 0.6, n * per * 1.25 + (2 << 30)))
    cfg = tz.Config(device_budget=spec["device_budget"] or 1 << 50, host_budget=host, params="auto",
                    optimizer_states="auto", compute_dtype="bfloat16", device=spec["device"], streams=spec["streams"],
                    nvme_dir=spec["nvme_dir"], nvme_budget=int(n * per) + (1 << 30),
                    optimizer_state_dtype=spec["state_dtype"])
    cfg, _ = reserve_working_set(cfg, model, batch=spec["batch"], seq=spec["seq"], micro_batches=spec["micro_batches"])
    if spec["device_budget"]:
        return cfg
    return cfg.replace(device_budget=int(torch.cuda.mem_get_info()[1] * 0.85) if spec["device"] == "cuda"
                       else cfg.device_reserve + 2 * n)


def _tierzero(model: Any, spec: dict, which: str) -> tuple[Any, Any, Any]:
    import tierzero as tz
    from tierzero import runtime

    n = sum(p.numel() for p in model.parameters())
    if which == "g":
        tz.wrap(model, _auto(model, spec, n))
        print(f"auto placed: {json.dumps(tz.tier_bytes(model))}", file=sys.stderr, flush=True)
        return model, tz.AdamW(model, lr=1e-4), runtime.placement_manager(model)
    tiers = PLACEMENT[which]  # of the bf16 params, fp32 grads, fp32 master weights and moments
    on = {t: n * sum(b for b, at in zip(state_bytes(spec), tiers) if at == t) for t in ("host", "nvme")}
    host = spec["host_budget"] or {"a": int(on["host"] * 1.25) + (256 << 20), "b": 4 << 30,
                                   "f": int(on["host"] * 1.25) + (2 << 30)}[which]
    cfg = tz.Config(device_budget=spec["device_budget"] or _device_budget(model, n), host_budget=host,
                    params=tiers[0], grads=tiers[1], optimizer_states=tiers[2], compute_dtype="bfloat16",
                    device=spec["device"], streams=spec["streams"], optimizer_state_dtype=spec["state_dtype"],
                    nvme_dir=spec["nvme_dir"] if on["nvme"] else None, nvme_budget=int(on["nvme"] * 1.05) + (1 << 30))
    tz.wrap(model, cfg)
    return model, tz.AdamW(model, lr=1e-4), runtime.placement_manager(model)


def _baseline(model: Any, spec: dict, which: str) -> tuple[Any, Any]:
    import torch

    device = spec["device"]
    if which == "c":
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        try:
            from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        except ImportError:  # torch < 2.6
            from torch.distributed._composable.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("nccl", rank=0, world_size=1)
        mesh = init_device_mesh("cuda", (1,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy())
        fully_shard(model, mesh=mesh, mp_policy=mp, offload_policy=CPUOffloadPolicy())
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    model = model.to(device)
    if spec["compiled"]:
        model = torch.compile(model)
    if which == "d":
        from torchao.optim import CPUOffloadOptimizer
        return model, CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, fused=True, lr=1e-4)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)


def child(spec: dict) -> None:
    """Train one configuration; one JSON line with its per-step figures."""
    import torch

    import tierzero as tz
    from tierzero import runtime

    which, cuda = spec["config"], spec["device"] == "cuda"
    k = spec["micro_batches"]
    model = _model(spec)
    n_params = sum(p.numel() for p in model.parameters())
    pm = None
    t0 = time.perf_counter()
    if which in TIERZERO:
        model, opt, pm = _tierzero(model, spec, which)
        if spec["compiled"]:
            tz.compile(model)
    else:
        model, opt = _baseline(model, spec, which)
    placed = tz.tier_bytes(model) if pm is not None else None  # where each kind lives (the optimizer built)
    layer_major = which in TIERZERO and k > 1 and not spec["plain"]
    print(f"set up in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    autocast = torch.autocast(spec["device"], dtype=torch.bfloat16, enabled=which in ("d", "e"))
    g = torch.Generator().manual_seed(1)
    steps, stalls, compute, sources, moved, losses = [], [], [], [], [], []
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        getattr(torch.cuda, "reset_peak_host_memory_stats", lambda: None)()
    for step in range(spec["warmup"] + spec["steps"]):
        xs = [torch.randint(0, SIZES[spec["size"]]["vocab_size"], (spec["batch"], spec["seq"]), generator=g)
              .to(spec["device"]) for _ in range(k)]
        t0 = time.perf_counter()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        if layer_major:
            mb_losses = tz.accumulate(model, [{"input_ids": x, "labels": x} for x in xs], lambda out, mb: out.loss / k)
        else:
            mb_losses = []
            for x in xs:  # the plain accumulation loop (k = 1: one forward and backward)
                with autocast:
                    loss = model(input_ids=x, labels=x).loss / k
                loss.backward()
                mb_losses.append(loss.detach())
        if cuda:
            end.record()
        opt.step()
        opt.zero_grad()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        print(f"step {step}: {wall:.3f} s", file=sys.stderr, flush=True)  # progress, in the log
        losses.append(float(sum(mb_losses)))
        if step >= spec["warmup"]:
            steps.append(wall)
            if cuda:
                compute.append(start.elapsed_time(end) / 1e3)
            if pm is not None:
                stats = runtime.step_stats(model)
                stalls.append(sum(stats.stall_s.values()))
                sources.append(stats.stall_s_by_source)
                moved.append({**{f"to_{t}": b for t, b in stats.bytes_moved.items()},
                              "nvme_read": stats.nvme_read_bytes, "nvme_write": stats.nvme_write_bytes})
        elif pm is not None:
            runtime.step_stats(model)
    pinned = _pinned_peak()
    if pm is not None and pm.pool.pinned:
        pinned = pm.pool.size + (pinned or 0)
    print(json.dumps({
        "config": spec["name"], "params": n_params, "micro_batches": k, "losses": losses,
        "optimizer_state_dtype": spec["state_dtype"] if pm is not None else None, "tier_bytes": placed,
        "step_s": statistics.median(steps), "steps_s": steps,
        "fwd_bwd_gpu_s": statistics.median(compute) if compute else None,
        "stall_s": statistics.median(stalls) if stalls else None,
        "stall_s_by_source": {k: statistics.median(d.get(k, 0.0) for d in sources)
                              for k in sorted({k for d in sources for k in d})},
        "bytes_per_step": {k: statistics.median(d[k] for d in moved) for k in moved[0]} if moved else None,
        "peak_gpu_bytes": torch.cuda.max_memory_allocated() if cuda else None, "peak_pinned_bytes": pinned,
        "peak_rss_bytes": _peak_rss(),
        "streams": None if pm is None else pm.streams.mode}), flush=True)
    if pm is not None:
        runtime.close(model)


# ----------------------------------------------------------------------------------- the runs

def run(args: argparse.Namespace, name: str) -> dict:
    which, mods = parse_name(name)
    nvme = Path(args.nvme_dir).resolve() / name
    spec = {"config": which, "name": name, "compiled": "compiled" in mods, "plain": "plain" in mods,
            "state_dtype": next((STATE_DTYPE[m] for m in mods if m in STATE_DTYPE), "float32"),
            "micro_batches": args.micro_batches, "size": args.size, "seq": args.seq, "batch": args.batch,
            "steps": args.steps,
            "warmup": args.warmup, "device": args.device, "streams": args.streams,
            "host_budget": args.host_budget, "device_budget": args.device_budget, "nvme_dir": str(nvme)}
    if which in ("b", "f", "g"):
        nvme.mkdir(parents=True, exist_ok=True)
    try:
        proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)],
                              capture_output=True, text=True, timeout=args.timeout)
    except subprocess.TimeoutExpired as e:
        proc = subprocess.CompletedProcess(e.cmd, -9, _text(e.stdout), _text(e.stderr) + f"\ntimed out after {args.timeout:g} s")
    finally:
        shutil.rmtree(nvme, ignore_errors=True)
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
        Path(args.log_dir, f"gpu_step_{name}.log").write_text(proc.stdout + "\n--- stderr\n" + proc.stderr)
    if proc.returncode != 0:
        return {"config": name, "error": proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else "failed"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _text(out: bytes | str | None) -> str:
    return out.decode(errors="replace") if isinstance(out, bytes) else (out or "")


def skipped(args: argparse.Namespace, name: str) -> str | None:
    """Why a configuration cannot run here (None: it can)."""
    which, _ = parse_name(name)
    if which in ("c", "d") and args.device != "cuda":
        return "needs CUDA"
    if which == "d":
        try:
            import torchao.optim  # noqa: F401
        except ImportError:
            return "torchao does not import"
    return None


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        child(json.loads(args.child))
        return 0
    import torch

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("--device cuda: torch sees no CUDA device", file=sys.stderr)
        return 2
    names = args.configs.split(",")
    for name in names:
        which, mods = parse_name(name)
        if which not in NAMES or not mods <= set(MODIFIERS) or (mods - {"compiled"} and which not in TIERZERO) \
                or len(mods & set(STATE_DTYPE)) > 1:
            print(f"--configs: {name!r}: give a configuration of {', '.join(NAMES)}, with -compiled, and -plain and "
                  f"one of -bf16 or -int8 for tierzero's ({', '.join(TIERZERO)})", file=sys.stderr)
            return 2
    if args.micro_batches < 1:
        print(f"--micro-batches: {args.micro_batches}: give 1 or more", file=sys.stderr)
        return 2
    results = []
    for name in names:
        why = skipped(args, name)
        results.append({"config": name, "skipped": why} if why else run(args, name))
    plain = next((r.get("fwd_bwd_gpu_s") for r in results if r["config"] == "e" and "step_s" in r), None)
    tokens = args.batch * args.seq * args.micro_batches
    for r in results:
        if "step_s" in r:
            r["tokens_per_s"] = tokens / r["step_s"]
            r["gpu_busy_frac"] = None if plain is None else plain / r["step_s"]
    device = torch.cuda.get_device_name() if args.device == "cuda" else f"cpu, {args.streams} streams"
    report = {"device": device, "size": args.size, "seq": args.seq, "batch": args.batch,
              "micro_batches": args.micro_batches, "steps": args.steps,
              "runs": results, "note": None if args.device == "cuda" else
              "no GPU here: the GPU figures (busy fraction, peak GPU memory, pinned bytes) need one"}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"{args.size} Llama, seq {args.seq}, batch {args.batch} x {args.micro_batches} micro-batches, on {device}")
    print(f"{'':>12} {'configuration':>28} {'tokens/s':>9} {'step s':>7} {'GPU busy':>8} {'stall s':>7} "
          f"{'peak GPU':>9} {'pinned':>9}")
    gib = lambda v: "-" if v is None else f"{v / 2**30:.2f}Gi"  # noqa: E731
    for r in results:
        name = NAMES[parse_name(r["config"])[0]]
        if "step_s" not in r:
            print(f"{r['config']:>12} {name:>28}  {r.get('skipped') or 'failed: ' + r.get('error', '')}")
            continue
        busy = "-" if r["gpu_busy_frac"] is None else f"{r['gpu_busy_frac']:.0%}"
        stall = "-" if r["stall_s"] is None else f"{r['stall_s']:.3f}"
        print(f"{r['config']:>12} {name:>28} {r['tokens_per_s']:>9.0f} {r['step_s']:>7.3f} {busy:>8} {stall:>7} "
              f"{gib(r['peak_gpu_bytes']):>9} {gib(r['peak_pinned_bytes']):>9}")
    for r in results:
        if r.get("tier_bytes"):
            on = {kind: ", ".join(f"{t} {b / 2**30:.2f}Gi" for t, b in tiers.items() if b)
                  for kind, tiers in r["tier_bytes"].items() if any(tiers.values())}
            print(f"{r['config']:>12} {r['optimizer_state_dtype']} states; lives on: "
                  + "; ".join(f"{kind} {where}" for kind, where in on.items()))
    for r in results:
        if r.get("bytes_per_step"):
            b = r["bytes_per_step"]
            print(f"{r['config']:>12} bytes a step: " + ", ".join(f"{k} {v / 1e9:.2f} GB" for k, v in b.items())
                  + f"; steps {', '.join(f'{s:.2f}' for s in r['steps_s'])} s; peak RSS {gib(r['peak_rss_bytes'])}")
    if report["note"]:
        print(report["note"])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""A pretrained transformers checkpoint larger than the budgets, streamed in and out.

Makes a sharded bf16 Llama checkpoint (config.json, shards, index; random values written
straight to the shards, so no model is ever built in RAM) at least `--factor` times the host +
device budgets, then, in a child process whose peak RSS this one reads from outside (its
VmHWM in /proc, while it waits to exit): `tz.from_pretrained` with the parameters homed on NVMe
in bf16 (the model built on the meta device, its blocks streamed from the shards
into the swap files), then `tz.save_pretrained(..., dtype=bfloat16)` to a new folder. The same
run measures io_engine alone on the same disk (O_DIRECT sequential read and write of a file as
large as the checkpoint; and reading the checkpoint's own files just before the load:
"ckpt_read_gbps"), with the checkpoint's pages dropped from the page cache before the load, so
all of them read the disk. Prints the load and export rates (checkpoint bytes / seconds) next
to io_engine's, the same against what each phase really moves (an export reads the parameters
back and writes the folder: "floor" = io_engine's time for those bytes, one after the other),
and the peak RSS growth over the child's RSS before loading (target: at most the budgets + 1
GiB; load >= 0.7x io_engine's sequential read rate).

What the load's time covers: `tz.from_pretrained` from the call to its return (the model's
Python modules, which transformers imports on first use, imported just before and timed apart:
"import_s", and the ratio with them, "load_with_imports_vs_read"), which reads
every parameter byte of the checkpoint from the disk (io_engine, O_DIRECT) and hashes it (an
xxh3 per tensor part, verified on every later read), registers the shards (a shard homed in
the checkpoint keeps no copy: the first forward reads it from the files) and waits for any swap
write. The parameters' NVMe homes are the checkpoint's
files until their first write (copy-on-write homes, tierzero/cow_home.py), so it writes nothing
to the swap files ("swap writes" counts what it does write); the export reads the parameters
from the checkpoint's files (through the same homes, verified).

    .venv/bin/python benchmarks/pretrained_io.py [--dir runs/bench-pretrained] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from checkpoint_io import sequential as io_engine_sequential, read_through  # this folder's sibling script
from io_engine import IOEngine, aligned_empty
from tierzero.config import format_size, parse_size

ROOT = Path(__file__).resolve().parents[1]


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks/pretrained_io.py", description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=str(ROOT / "runs" / "bench-pretrained"))
    p.add_argument("--device-budget", default="256MiB")
    p.add_argument("--host-budget", default="512MiB")
    p.add_argument("--factor", type=float, default=4.0, help="checkpoint bytes / (host + device budgets)")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--intermediate", type=int, default=5504)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--shard", default="512MiB", help="max shard size of the checkpoint")
    p.add_argument("--json", action="store_true")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args(argv)


def llama_config(args: argparse.Namespace, layers: int):
    import transformers

    return transformers.LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden,
                                    intermediate_size=args.intermediate, num_hidden_layers=layers,
                                    num_attention_heads=args.hidden // 128, num_key_value_heads=args.hidden // 128,
                                    max_position_embeddings=2048, tie_word_embeddings=False, dtype="bfloat16")


def make_checkpoint(args: argparse.Namespace, folder: Path) -> int:
    """The checkpoint, layers enough for --factor x the budgets; its bytes."""
    import transformers
    from safetensors.torch import save_file

    want = args.factor * (parse_size(args.device_budget) + parse_size(args.host_budget))
    probe = llama_config(args, 1)
    with torch.device("meta"):
        one = transformers.LlamaForCausalLM(probe)
    per_layer = sum(p.numel() for n, p in one.named_parameters() if ".layers.0." in n) * 2
    rest = sum(p.numel() for n, p in one.named_parameters() if ".layers." not in n) * 2
    layers = max(1, int(-(-(want - rest) // per_layer)))
    config = llama_config(args, layers)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    folder.mkdir(parents=True)
    config.save_pretrained(folder)
    shard_bytes, shards, current, size = parse_size(args.shard), [], {}, 0
    for name, p in model.named_parameters():
        nbytes = p.numel() * 2
        if current and size + nbytes > shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = tuple(p.shape)
        size += nbytes
    shards.append(current)
    gen = torch.Generator().manual_seed(0)
    weight_map, total = {}, 0
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16) for n, shape in names.items()}
        save_file(tensors, str(folder / file), metadata={"format": "pt"})
        total += sum(t.numel() * 2 for t in tensors.values())
        weight_map.update(dict.fromkeys(names, file))
    (folder / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    return total


def drop_cache(folder: Path) -> None:
    """Evict the folder's files from the page cache (written and fsynced pages go)."""
    for f in folder.iterdir():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def child(args: argparse.Namespace) -> None:
    """In the measured process: RSS before, then load and export, timed."""
    import psutil

    import tierzero as tz
    from tierzero import runtime

    work = Path(args.dir)
    import transformers  # noqa: F401  (imported before the baseline: its import is not the load)

    base = psutil.Process().memory_info().rss
    # transformers imports a model's modules on first use, inside the load: imported here (after
    # the RSS baseline, so their memory still counts), timed apart as import_s
    t0 = time.perf_counter()
    import transformers.conversion_mapping  # noqa: F401  (the load's key renaming)
    import transformers.core_model_loading  # noqa: F401
    transformers.AutoConfig.from_pretrained(work / "ckpt")
    transformers.LlamaForCausalLM  # noqa: B018  (imports the model's module)
    import_s = time.perf_counter() - t0
    cfg = tz.Config(device_budget=args.device_budget, host_budget=args.host_budget,
                    nvme_dir=str(work / "nvme"), params="nvme", grads="nvme", optimizer_states="nvme",
                    compute_dtype="bfloat16")
    t0 = time.perf_counter()
    model = tz.from_pretrained(work / "ckpt", cfg)  # every parameter byte read and hashed, swap writes landed
    load_s = time.perf_counter() - t0
    pm = runtime.placement_manager(model)
    load_moved = pm.telemetry.reset_step().bytes_moved
    t0 = time.perf_counter()
    tz.save_pretrained(model, work / "export", dtype=torch.bfloat16)
    export_s = time.perf_counter() - t0
    export_read = pm.telemetry.reset_step().nvme_read_bytes  # from the checkpoint's files (borrowed homes)
    peaks = {t: pm.peak_bytes(t) for t in ("device", "host", "nvme")}
    runtime.close(model)
    print(json.dumps({"base_rss": base, "import_s": import_s, "load_s": load_s, "export_s": export_s, "peaks": peaks,
                      "load_nvme_write": load_moved["nvme"], "export_nvme_read": export_read}), flush=True)
    sys.stdin.readline()  # the parent reads this process's peak RSS meanwhile


def read_files_gbps(engine: IOEngine, files: list[Path], request: int = 64 << 20) -> float:
    """io_engine alone reading `files` (the checkpoint's own shards) start to end, O_DIRECT,
    `request`-sized reads 4 in flight into reused buffers: the disk's read rate for the very
    bytes the load reads, at that moment (their pages dropped before)."""
    bufs = [aligned_empty(request) for _ in range(4)]
    for b in bufs:
        b[:] = 0  # touched: a first read into fresh pages would also time their page faults
    sized = [(str(p), p.stat().st_size) for p in files]
    return sum(n for _, n in sized) / read_through(engine, sized, bufs) / 1e9


def _vm_hwm(pid: int) -> int:
    """Peak resident bytes of process `pid` since its exec (/proc/PID/status VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/status has no VmHWM")


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.child:
        child(args)
        return 0
    work = Path(args.dir)
    shutil.rmtree(work, ignore_errors=True)
    ckpt_bytes = make_checkpoint(args, work / "ckpt")
    budgets = parse_size(args.device_budget) + parse_size(args.host_budget)
    with IOEngine(threads=4, block_size=4 << 20, direct=True) as engine:  # the same yardstick as checkpoint_io
        seq_write, _, seq_read = io_engine_sequential(engine, work / "yardstick.bin", ckpt_bytes)
        # A second yardstick: the checkpoint's own files, read the same way just before the load.
        # (The first one runs right after the checkpoint and its own file were written, which
        # can slow the disk's reads for a while: a yardstick that slow flatters the load.)
        drop_cache(work / "ckpt")
        ckpt_read = read_files_gbps(engine, sorted((work / "ckpt").glob("*.safetensors")))
    drop_cache(work / "ckpt")
    cmd = [sys.executable, __file__, "--child", "1", *[a for a in (argv or sys.argv[1:]) if a != "--json"]]
    # The child's peak RSS is its VmHWM, read from /proc while it waits to exit. (Not
    # getrusage(RUSAGE_CHILDREN): exec records the peak of the address space it replaces, which
    # after subprocess's vfork is this process's own peak, that of making the checkpoint.)
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    line = proc.stdout.readline()
    peak_rss = _vm_hwm(proc.pid) if line else 0
    _, err = proc.communicate("exit\n")
    if proc.returncode != 0 or not line:
        print(err, file=sys.stderr)
        return 1
    got = json.loads(line)
    exported = sum(f.stat().st_size for f in (work / "export").glob("*.safetensors"))
    result = {
        "checkpoint_bytes": ckpt_bytes, "budgets": budgets, "factor": ckpt_bytes / budgets,
        "load_s": got["load_s"], "export_s": got["export_s"], "import_s": got["import_s"],
        "load_gbps": ckpt_bytes / got["load_s"] / 1e9, "export_gbps": exported / got["export_s"] / 1e9,
        "seq_read_gbps": seq_read, "seq_write_gbps": seq_write,
        "load_vs_read": ckpt_bytes / got["load_s"] / 1e9 / seq_read,
        "ckpt_read_gbps": ckpt_read, "load_vs_ckpt_read": ckpt_bytes / got["load_s"] / 1e9 / ckpt_read,
        # the same had the model's modules been imported inside the load (as before this was split)
        "load_with_imports_vs_read": ckpt_bytes / (got["load_s"] + got["import_s"]) / 1e9 / seq_read,
        "export_vs_write": exported / got["export_s"] / 1e9 / seq_write,
        # what each phase must move through the disk, and the time io_engine alone needs for it
        # one after the other (reads at the sequential read rate, writes at the write rate)
        "load_swap_write_bytes": got["load_nvme_write"],
        "load_floor_s": ckpt_bytes / seq_read / 1e9 + got["load_nvme_write"] / seq_write / 1e9,
        "export_swap_read_bytes": got["export_nvme_read"],
        "export_floor_s": got["export_nvme_read"] / seq_read / 1e9 + exported / seq_write / 1e9,
        "base_rss": got["base_rss"], "peak_rss": peak_rss, "rss_growth": peak_rss - got["base_rss"],
        "rss_limit": budgets + (1 << 30), "peaks": got["peaks"],
    }
    result["rss_ok"] = result["rss_growth"] <= result["rss_limit"]
    result["load_vs_floor"] = result["load_floor_s"] / result["load_s"]
    result["export_vs_floor"] = result["export_floor_s"] / result["export_s"]
    shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"checkpoint {format_size(ckpt_bytes)} bf16 = {result['factor']:.1f}x the budgets "
              f"({format_size(budgets)})")
        print(f"load   {result['load_s']:.1f} s  {result['load_gbps']:.2f} GB/s = {result['load_vs_read']:.2f}x "
              f"io_engine's sequential read ({seq_read:.2f} GB/s); with the model's first-use imports "
              f"({result['import_s']:.1f} s) {result['load_with_imports_vs_read']:.2f}x; "
              f"{result['load_vs_ckpt_read']:.2f}x io_engine reading the checkpoint's own files "
              f"({ckpt_read:.2f} GB/s)")
        print(f"       it writes {format_size(result['load_swap_write_bytes'])} to the swap files: io_engine "
              f"alone needs {result['load_floor_s']:.1f} s for its reads and writes = {result['load_vs_floor']:.2f}x")
        print(f"export {result['export_s']:.1f} s  {result['export_gbps']:.2f} GB/s = "
              f"{result['export_vs_write']:.2f}x io_engine's sequential write ({seq_write:.2f} GB/s); "
              f"with its swap reads io_engine alone needs {result['export_floor_s']:.1f} s = "
              f"{result['export_vs_floor']:.2f}x")
        print(f"peak RSS {format_size(peak_rss)}, growth {format_size(result['rss_growth'])} "
              f"(limit budgets + 1 GiB = {format_size(result['rss_limit'])}): "
              f"{'ok' if result['rss_ok'] else 'OVER'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Checkpoint save and load of NVMe-resident state against io_engine's sequential throughput.

A stack of bias-free Linear layers is wrapped with parameters and optimizer states homed on
NVMe (a small host budget, so nothing is cached in RAM), tz.AdamW is built on it, and then, in
one run: io_engine alone writes and reads a file as large as the checkpoint's data (O_DIRECT,
64 MiB requests, the same threads and block size); tz.save_checkpoint and tz.load_checkpoint run
`--repeat` times each. A save reads every stored tensor from the swap files and writes it to the
checkpoint; a load reads the checkpoint and writes the swap files (the fp32 master weights and,
the compute dtype being fp32 here, the parameters too). The yardstick for each is the time
io_engine alone needs for the same bytes, one after the other: read_bytes / read_GBps +
write_bytes / write_GBps, with the write rate of a new file for a save (its files are new) and
of an overwrite for a load (the swap extents exist);
ratio = yardstick / measured time (>= 0.7 is the goal; > 1 means reads and writes overlapped).

    .venv/bin/python benchmarks/checkpoint_io.py [--dir runs/bench-checkpoint] [--state 1.5GiB] [--repeat 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import tierzero as tz
from io_engine import IOEngine, PreallocatedFile, aligned_empty
from tierzero import runtime
from tierzero.config import parse_size
from tierzero.placement.handles import Kind


def read_through(engine: IOEngine, files: list[tuple[Any, int]], bufs: list) -> float:
    """Seconds io_engine takes to read each (file, size) of `files` start to end, in requests of
    one buffer's size, len(bufs) in flight, each into the next of `bufs` in turn."""
    request = bufs[0].nbytes
    pending: list = []
    i = 0
    t0 = time.perf_counter()
    for f, size in files:
        for off in range(0, size, request):
            if len(pending) == len(bufs):
                pending.pop(0).result()
            pending.append(engine.pread(f, bufs[i % len(bufs)][:min(request, size - off)], off))
            i += 1
    for fut in pending:
        fut.result()
    return time.perf_counter() - t0


def sequential(engine: IOEngine, path: Path, nbytes: int, request: int = 64 << 20) -> tuple[float, float, float]:
    """io_engine alone, `request`-sized O_DIRECT requests over `nbytes`: GB/s writing a new
    preallocated file (as a save does) and fsyncing it, overwriting it (as a load's swap writes
    do), and reading it."""
    buf = aligned_empty(request)
    buf[:] = 7
    with PreallocatedFile(path, nbytes) as f:
        write_s = []
        for _ in range(2):
            t0 = time.perf_counter()
            futures = [engine.pwrite(f, buf[:min(request, nbytes - off)], off) for off in range(0, nbytes, request)]
            for fut in futures:
                fut.result()
            os.fsync(f.handle.fd)
            write_s.append(time.perf_counter() - t0)
        read_s = read_through(engine, [(f, nbytes)], [aligned_empty(request) for _ in range(4)])
    path.unlink()
    return nbytes / write_s[0] / 1e9, nbytes / write_s[1] / 1e9, nbytes / read_s / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/checkpoint_io.py", description=__doc__.splitlines()[0])
    p.add_argument("--dir", default="runs/bench-checkpoint", help="folder on the NVMe drive (swap and checkpoints)")
    p.add_argument("--state", default="1.5GiB", help="checkpointed bytes (fp32 master + two moments)")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    root = Path(args.dir)
    shutil.rmtree(root, ignore_errors=True)
    root.mkdir(parents=True)
    layers = max(1, round(parse_size(args.state) / (12 * args.width * args.width)))
    with torch.device("meta"):
        model = nn.Sequential(nn.Sequential(*(nn.Linear(args.width, args.width, bias=False) for _ in range(layers))))
    block = args.width * args.width * 4
    cfg = tz.Config(device_budget=4 * block, host_budget=max(8 * block, 256 << 20), nvme_dir=str(root / "nvme"),
                    params="nvme", grads="nvme", optimizer_states="nvme", compute_dtype="float32")
    t0 = time.perf_counter()
    tz.wrap(model, cfg)
    opt = tz.AdamW(model, lr=1e-3)
    setup_s = time.perf_counter() - t0
    pm = runtime.placement_manager(model)
    state_bytes = sum(h.nbytes for h in pm.handles if h.kind not in (Kind.GRAD, Kind.PARAM))
    param_bytes = sum(h.nbytes for h in pm.handles if h.kind is Kind.PARAM)
    try:
        with IOEngine(threads=cfg.io.threads, block_size=cfg.io.block_size, direct=cfg.io.direct) as engine:
            before = sequential(engine, root / "sequential.bin", state_bytes)
        saves, loads = [], []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            folder = tz.save_checkpoint(root / "ckpt", model, opt, keep_last=1)
            saves.append(time.perf_counter() - t0)
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            tz.load_checkpoint(root / "ckpt", model, opt)
            pm.flush()
            loads.append(time.perf_counter() - t0)
        with IOEngine(threads=cfg.io.threads, block_size=cfg.io.block_size, direct=cfg.io.direct) as engine:
            after = sequential(engine, root / "sequential.bin", state_bytes)
        write_gbps, overwrite_gbps, read_gbps = ((a + b) / 2 for a, b in zip(before, after))
        ckpt_bytes = sum(f.stat().st_size for f in folder.iterdir())
    finally:
        runtime.close(model)
    save_s, load_s = statistics.median(saves), statistics.median(loads)
    save_yard = state_bytes / 1e9 / read_gbps + state_bytes / 1e9 / write_gbps
    load_yard = state_bytes / 1e9 / read_gbps + (state_bytes + param_bytes) / 1e9 / overwrite_gbps
    out = {
        "layers": layers, "width": args.width, "state_bytes": state_bytes, "param_bytes": param_bytes,
        "checkpoint_bytes": ckpt_bytes, "setup_s": round(setup_s, 2),
        "seq_write_new_gbps": round(write_gbps, 3), "seq_overwrite_gbps": round(overwrite_gbps, 3),
        "seq_read_gbps": round(read_gbps, 3), "seq_before": [round(x, 3) for x in before],
        "seq_after": [round(x, 3) for x in after],
        "save_s": [round(s, 3) for s in saves], "load_s": [round(s, 3) for s in loads],
        "save_gbps": round(state_bytes / save_s / 1e9, 3), "load_gbps": round(state_bytes / load_s / 1e9, 3),
        "save_ratio": round(save_yard / save_s, 3), "load_ratio": round(load_yard / load_s, 3),
        "save_vs_write_only": round(state_bytes / save_s / 1e9 / write_gbps, 3),
        "load_vs_read_only": round(state_bytes / load_s / 1e9 / read_gbps, 3),
    }
    shutil.rmtree(root, ignore_errors=True)
    if args.json:
        print(json.dumps(out))
    else:
        print(f"state {state_bytes / 2**30:.2f} GiB on NVMe ({layers} x Linear({args.width}, {args.width}), "
              f"fp32 master + 2 moments); io_engine sequential: write new file {write_gbps:.2f} GB/s, overwrite "
              f"{overwrite_gbps:.2f} GB/s, read {read_gbps:.2f} GB/s")
        print(f"save: median {save_s:.2f} s = {out['save_gbps']:.2f} GB/s of state; yardstick {save_yard:.2f} s "
              f"-> ratio {out['save_ratio']:.2f} (vs write alone {out['save_vs_write_only']:.2f})")
        print(f"load: median {load_s:.2f} s = {out['load_gbps']:.2f} GB/s of state; yardstick {load_yard:.2f} s "
              f"-> ratio {out['load_ratio']:.2f} (vs read alone {out['load_vs_read_only']:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

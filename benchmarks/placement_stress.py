"""Stress the placement manager: move many GiB of NVMe-homed tensors through small budgets.

N tensors (default 64 x 64 MiB, home NVMe) are acquired on the device tier in order, pass after
pass, with the prefetch schedule the runtime uses (device copies `--depth` blocks ahead, NVMe
reads into host copies `--nvme-depth` ahead). Phases:

    register  every tensor written to NVMe once, through a host staging buffer (writes only)
    mixed     `--passes` passes; half the tensors are modified and released dirty, so they are
              written back to NVMe while the next ones are read (reads and writes share the drive)
    clean     one more pass with clean releases (reads only)

NVMe GB/s of a phase = bytes / time at least one such IO was in flight. io_engine's own
sequential read and write rates are measured on the same folder with the same settings before
and after the stress (the drive is shared; the mean is the yardstick). `mixed_efficiency` =
(time io_engine alone needs for the mixed phase's bytes) / (time NVMe was busy in it).
Prints one JSON object with `--json` (else a summary); exits 1 if a peak or the RSS limit
(both budgets + 512 MiB) is exceeded.

    .venv/bin/python benchmarks/placement_stress.py --json [--nvme-dir DIR]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tierzero.config.config import Config, IOConfig
from tierzero.config import format_size, parse_size
from tierzero.placement.handles import Kind
from tierzero.placement.manager import PlacementManager
from tierzero.config.tiernames import Tier
from tierzero.planning.recording import busy_seconds


def phase(moves, t0: float, t1: float) -> dict:
    """NVMe figures of the moves that started in [t0, t1): bytes, and GB/s while busy (reads
    alone, writes alone, and the time either was running)."""
    moves = [m for m in moves if t0 <= m.start < t1]
    reads = [(m.start, m.end) for m in moves if m.src == "nvme"]
    writes = [(m.start, m.end) for m in moves if m.dst == "nvme"]
    rb = sum(m.nbytes for m in moves if m.src == "nvme")
    wb = sum(m.nbytes for m in moves if m.dst == "nvme")
    r_busy, w_busy, busy = busy_seconds(reads), busy_seconds(writes), busy_seconds(reads + writes)
    return {"wall_s": t1 - t0, "moved_bytes": sum(m.nbytes for m in moves), "read_bytes": rb,
            "write_bytes": wb, "busy_s": busy, "read_gbps": rb / r_busy / 1e9 if r_busy else 0.0,
            "write_gbps": wb / w_busy / 1e9 if w_busy else 0.0}


def sequential_gbps(nvme_dir: Path, io: IOConfig, request: int, total: int) -> tuple[float, float]:
    """io_engine alone: sequential writes then reads of `total` bytes in `request`-byte calls,
    one call in flight at a time as a plain sequential copy does, on a file in `nvme_dir`."""
    from io_engine import IOEngine, PreallocatedFile, aligned_empty

    path = nvme_dir / f"seq-{os.getpid()}.bin"
    buf = aligned_empty(request)
    buf[:] = 7
    try:
        with IOEngine(threads=io.threads, block_size=io.block_size, direct=io.direct) as eng, \
                PreallocatedFile(str(path), total) as f:
            rates = []
            for op in (eng.write, eng.read):
                t0 = time.perf_counter()
                for off in range(0, total, request):
                    op(f, buf, off)
                rates.append(total / (time.perf_counter() - t0) / 1e9)
    finally:
        path.unlink(missing_ok=True)
    return rates[1], rates[0]


def run(args: argparse.Namespace) -> dict:
    nvme_dir = Path(args.nvme_dir)
    nvme_dir.mkdir(parents=True, exist_ok=True)
    size = parse_size(args.tensor_size)
    numel = size // 4
    io = IOConfig(threads=args.threads, block_size=args.block_size, direct="auto")
    cfg = Config(device_budget=args.device_budget, host_budget=args.host_budget, nvme_dir=str(nvme_dir),
                 nvme_budget=args.tensors * size + (64 << 20), io=io, checksums=not args.no_checksums,
                 prefetch={"depth": args.depth, "nvme_depth": args.nvme_depth})
    # The drive is shared and its speed drifts: measure io_engine alone before and after the
    # stress, and compare with the mean.
    bench_before = sequential_gbps(nvme_dir, io, size, args.bench_size)
    base = torch.arange(numel, dtype=torch.int32)  # tensor i holds base + i (+1 per dirty release)
    offsets = [7 * i for i in range(args.tensors)]

    with PlacementManager(cfg, device=args.device) as pm:
        t_reg = time.perf_counter()
        params = []
        for i, off in enumerate(offsets):
            base.add_(off)
            params.append(pm.register(f"layers.{i}", base, Tier.NVME, kind=Kind.PARAM))
            base.sub_(off)
        pm.flush()
        register = phase(pm.telemetry.moves, t_reg, time.perf_counter())
        pm.telemetry.reset_step()
        t_start = time.perf_counter()
        for p in range(args.passes + 1):
            clean = p == args.passes  # the last pass only reads: NVMe reads alone
            if clean:
                t_clean = time.perf_counter()
            for i, param in enumerate(params):
                for j in range(i + 1, min(i + 1 + args.nvme_depth, len(params))):
                    pm.prefetch(params[j], Tier.HOST if j > i + args.depth else Tier.DEVICE)
                t = pm.acquire(param, Tier.DEVICE)
                dirty = not clean and (i + p) % 2 == 0
                if dirty:
                    t.add_(1)  # compute stands in: modify in place, write back
                    offsets[i] += 1
                pm.release(param, Tier.DEVICE, dirty=dirty)
            pm.flush()
        t_end = time.perf_counter()
        mixed = phase(pm.telemetry.moves, t_start, t_clean)
        reads_only = phase(pm.telemetry.moves, t_clean, t_end)
        step = pm.telemetry.reset_step()
        for i in range(0, args.tensors, max(1, args.tensors // 8)):  # spot-check contents
            out = pm.read(params[i]).sub_(offsets[i])
            if not torch.equal(out, base):
                raise SystemExit(f"placement_stress: {params[i].name} differs from its expected contents")
            del out
        peaks = {t.value: pm.peak_bytes(t) for t in Tier}
        budgets = {t.value: pm.budget(t) for t in Tier}
    bench_after = sequential_gbps(nvme_dir, io, size, args.bench_size)
    bench_read, bench_write = ((a + b) / 2 for a, b in zip(bench_before, bench_after))
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rss_limit = budgets["host"] + budgets["device"] + (512 << 20)
    # Seconds io_engine alone would need for the same NVMe bytes: the yardstick of each phase.
    def efficiency(ph: dict) -> float:
        ideal = ph["read_bytes"] / 1e9 / bench_read + ph["write_bytes"] / 1e9 / bench_write
        return ideal / ph["busy_s"] if ph["busy_s"] else 0.0

    result = {
        "tensors": args.tensors, "tensor_bytes": size, "passes": args.passes,
        "host_budget": budgets["host"], "device_budget": budgets["device"],
        "peak_host": peaks["host"], "peak_device": peaks["device"], "peak_nvme": peaks["nvme"],
        "moved_bytes": mixed["moved_bytes"] + reads_only["moved_bytes"],
        "nvme_read_gbps": mixed["read_gbps"], "nvme_write_gbps": mixed["write_gbps"],
        "bench_read_gbps": bench_read, "bench_write_gbps": bench_write,
        "bench_before_gbps": {"read": bench_before[0], "write": bench_before[1]},
        "bench_after_gbps": {"read": bench_after[0], "write": bench_after[1]},
        "read_ratio": mixed["read_gbps"] / bench_read, "write_ratio": mixed["write_gbps"] / bench_write,
        "mixed_efficiency": efficiency(mixed),
        "clean_pass_read_gbps": reads_only["read_gbps"], "clean_pass_read_ratio": reads_only["read_gbps"] / bench_read,
        "register_write_gbps": register["write_gbps"], "register_write_ratio": register["write_gbps"] / bench_write,
        "phases": {"register": register, "mixed": mixed, "clean": reads_only},
        "stall_s": step.stall_s["device"], "prefetch_hits": step.prefetch_hits,
        "prefetch_misses": step.prefetch_misses,
        "peak_rss": peak_rss, "rss_limit": rss_limit,
        "io": {"threads": io.threads, "block_size": io.block_size, "direct": io.direct},
        "checksums": cfg.checksums, "nvme_dir": str(nvme_dir), "device": args.device,
    }
    result["within_budgets"] = peaks["host"] <= budgets["host"] and peaks["device"] <= budgets["device"]
    result["rss_ok"] = peak_rss <= rss_limit
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--nvme-dir", default=str(ROOT / "runs" / "placement-stress"),
                   help="folder on the drive under test (default: runs/placement-stress in the checkout)")
    p.add_argument("--tensors", type=int, default=64)
    p.add_argument("--tensor-size", default="64MiB")
    p.add_argument("--passes", type=int, default=3)
    p.add_argument("--host-budget", default="512MiB")
    p.add_argument("--device-budget", default="256MiB")
    p.add_argument("--depth", type=int, default=2, help="device copies prefetched ahead")
    # 6 x 64 MiB reads in flight keep this drive busy while dirty write-backs share it (4 left it
    # idle between reads: mixed efficiency 0.77-0.83 against 0.90-0.99; benchmarks/RESULTS.md).
    p.add_argument("--nvme-depth", type=int, default=6, help="NVMe reads into host copies ahead")
    p.add_argument("--threads", type=int, default=IOConfig().threads)
    p.add_argument("--block-size", default=IOConfig().block_size)
    p.add_argument("--bench-size", type=parse_size, default=parse_size("2GiB"),
                   help="bytes io_engine writes and reads sequentially for the comparison figures")
    p.add_argument("--no-checksums", action="store_true")
    p.add_argument("--device", default="cpu",
                   help="device tier: cpu (the stand-in used without CUDA) or cuda")
    args = p.parse_args(argv)
    r = run(args)
    if args.json:
        print(json.dumps(r))
    else:
        print(f"moved {format_size(r['moved_bytes'])} in {r['phases']['mixed']['wall_s'] + r['phases']['clean']['wall_s']:.1f} s; "
              f"peaks host {format_size(r['peak_host'])}/{format_size(r['host_budget'])}, "
              f"device {format_size(r['peak_device'])}/{format_size(r['device_budget'])}; "
              f"peak RSS {format_size(r['peak_rss'])} (limit {format_size(r['rss_limit'])})")
        print(f"NVMe read {r['nvme_read_gbps']:.2f} GB/s (io_engine sequential {r['bench_read_gbps']:.2f}, "
              f"x{r['read_ratio']:.2f}); write {r['nvme_write_gbps']:.2f} GB/s "
              f"(sequential {r['bench_write_gbps']:.2f}, x{r['write_ratio']:.2f})")
    return 0 if r["within_budgets"] and r["rss_ok"] else 1


if __name__ == "__main__":
    sys.exit(main())

"""The drive's rate when it reads and writes at once, as tierzero's optimizer step makes it do.

io_engine reads one file while it writes another, in requests of one block tensor's size
(`--request`, default 200 MiB: a 1b block's fp32 state tensor), `--in-flight` of each kind
queued at a time, checksums on (as the swap files use them), O_DIRECT; per round, once for each
thread count in `--threads`, alternated so that a disturbance hits every count. Prints GB/s of
reads + writes per round and count, and the median per count. The pure sequential rates
(benchmarks/io_throughput.py, `tierzero bench-io`) are what the NVMe floor assumes; this is what
a step that must read and write together can get.

    .venv/bin/python benchmarks/mixed_io.py --dir /tmp/mixed-io [--size 2GiB] [--threads 4,8,16]
        [--rounds 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from io_engine import IOEngine, PreallocatedFile, aligned_empty, parse_size


def mixed_gbps(src: PreallocatedFile, dst: PreallocatedFile, bufs: list, size: int, request: int,
               in_flight: int, threads: int) -> float:
    """Read `src` and write `dst`, `size` bytes each, `in_flight` requests of each kind queued."""
    n = size // request
    with IOEngine(threads=threads, block_size=4 << 20, direct=True) as engine:
        t0 = time.perf_counter()
        queued: list = []
        for i in range(n):
            queued.append(engine.pread(src, bufs[i % in_flight], i * request, checksum=True))
            queued.append(engine.pwrite(dst, bufs[in_flight + i % in_flight], i * request, checksum=True))
            while len(queued) > 2 * in_flight:
                queued.pop(0).result()
        for fut in queued:
            fut.result()
        return 2 * n * request / (time.perf_counter() - t0) / 1e9


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/mixed_io.py", description=__doc__.splitlines()[0])
    p.add_argument("--dir", required=True, help="a folder on the drive under test")
    p.add_argument("--size", default="2GiB", help="bytes read and bytes written per measurement")
    p.add_argument("--request", default="200MiB")
    p.add_argument("--in-flight", type=int, default=4)
    p.add_argument("--threads", default="4,8,16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    size, request = parse_size(args.size, what="--size"), parse_size(args.request, what="--request")
    if request % 4096 or request > size:
        raise SystemExit(f"--request: expected a multiple of 4096 bytes no larger than --size, got {args.request}")
    counts = [int(t) for t in args.threads.split(",")]
    folder = Path(args.dir)
    folder.mkdir(parents=True, exist_ok=True)
    bufs = [aligned_empty(request) for _ in range(2 * args.in_flight)]
    for b in bufs:
        b[:] = 7
    runs: dict[int, list[float]] = {t: [] for t in counts}
    src_path, dst_path = folder / "mixed-src.bin", folder / "mixed-dst.bin"
    try:
        with PreallocatedFile(str(src_path), size) as src, PreallocatedFile(str(dst_path), size) as dst:
            with IOEngine(threads=4, block_size=4 << 20, direct=True) as engine:  # the source's bytes
                for i in range(size // request):
                    engine.pwrite(src, bufs[0], i * request).result()
            for rnd in range(args.rounds):
                for t in counts:
                    runs[t].append(mixed_gbps(src, dst, bufs, size, request, args.in_flight, t))
                    if not args.json:
                        print(f"round {rnd}, {t} threads: {runs[t][-1]:.2f} GB/s read + write", flush=True)
    finally:
        src_path.unlink(missing_ok=True)
        dst_path.unlink(missing_ok=True)
    medians = {t: statistics.median(v) for t, v in runs.items()}
    if args.json:
        print(json.dumps({"size": size, "request": request, "in_flight": args.in_flight,
                          "gbps": {str(t): [round(x, 3) for x in v] for t, v in runs.items()},
                          "median_gbps": {str(t): round(m, 3) for t, m in medians.items()}}))
    else:
        print("median: " + ", ".join(f"{t} threads {m:.2f} GB/s" for t, m in medians.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

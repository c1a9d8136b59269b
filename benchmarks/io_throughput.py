"""io_engine vs fio on the NVMe directory: sequential O_DIRECT write and read of a 1 GiB file.

Each round sweeps IOEngine block size x threads, then fio (ioengine=libaio, direct=1, same file,
bs 1M/8M x iodepth 8/32 x numjobs 1/4) in the same run, and compares the engine's best with fio's
best for write and read (ratio = engine / fio, per round and median). Then checksum=True against
plain at the best setting. All of it is io_engine.bench; this script only sets the defaults.

    .venv/bin/python benchmarks/io_throughput.py [--dir /tmp/io-bench] [--size 1GiB] [--repeat 3] [--json]
"""

from __future__ import annotations

import sys
import tempfile

from io_engine import bench


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    defaults = {"--dir": tempfile.gettempdir(), "--size": "1GiB", "--repeat": "3"}
    for flag, value in defaults.items():
        if not any(a == flag or a.startswith(flag + "=") for a in argv):
            argv += [flag, value]
    return bench.main(argv, prog="benchmarks/io_throughput.py")


if __name__ == "__main__":
    sys.exit(main())

"""The path of one fetch through placement's modules: which module runs, in order, while one
`acquire` of an NVMe-homed tensor on the device tier fetches it (and its move commits).

Every Python call and return on every thread is traced (sys.setprofile, threading.setprofile);
the module running is that of the innermost frame in tierzero.placement (or io_engine), and
a visit is a call that enters a module from another one (returns are not counted). Prints
the visits in order, per module and in all (with `--json` one object). Handle and config
properties are data reads: `--skip` leaves such modules out of the path (default: handles).

    PYTHONPATH=TREE .venv/bin/python benchmarks/placement_path.py [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
from collections import Counter

import torch

from tierzero.config import Config
from tierzero.placement.manager import PlacementManager

_PACKAGES = ("tierzero.placement.", "io_engine")


def _module(frame) -> str | None:  # type: ignore[no-untyped-def]
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name.startswith(_PACKAGES):
            return name.rsplit(".", 1)[-1] if name.startswith("tierzero.") else "io_engine"
        frame = frame.f_back
    return None


def trace_acquire(skip: set[str]) -> tuple[list[str], Counter[str]]:
    """The modules entered, in order, by calls from another module (each thread's first entry
    from outside is the call that starts its work) during one acquire and its move's commit;
    and the count per module."""
    entries: list[str] = []
    tracing = threading.Event()

    def profile(frame, event, arg):  # type: ignore[no-untyped-def]
        if not tracing.is_set() or event != "call":
            return
        callee = _module(frame)
        if callee is None or callee in skip or _module(frame.f_back) == callee:
            return
        caller = _module(frame.f_back)
        thread = threading.current_thread().name.split("_")[0]
        entries.append(f"{thread}:{caller or '-'}>{callee}")

    threading.setprofile(profile)  # the workers start with the manager: profiled, not yet traced
    sys.setprofile(profile)
    try:
        with tempfile.TemporaryDirectory() as nvme:
            cfg = Config(device_budget="64MiB", host_budget="64MiB", nvme_dir=nvme, nvme_budget="256MiB")
            with PlacementManager(cfg) as pm:
                h = pm.register("w", torch.randn(1 << 16), "nvme")
                pm.flush()
                tracing.set()
                pm.acquire(h, "device")
                sys.setprofile(None)  # this thread's part ends here; the worker's at its commit
                pm.settle()
                tracing.clear()
                pm.release(h, "device")
    finally:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
    return entries, Counter(e.rsplit(">", 1)[1] for e in entries)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--json", action="store_true")
    p.add_argument("--skip", default="handles", help="modules left out of the path, comma-separated")
    args = p.parse_args(argv)
    entries, visits = trace_acquire({s for s in args.skip.split(",") if s})
    out = {"entries": entries, "visits": dict(visits.most_common()), "crossings": len(entries)}
    if args.json:
        print(json.dumps(out))
    else:
        print("\n".join(entries))
        print("visits:", ", ".join(f"{m} {n}" for m, n in visits.most_common()), f"; crossings {len(entries)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The rates of the tiers' channels a replay moves bytes at (`TierModel`), calibrated from a
recording and scaled by a `tierzero bench-io` result."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Mapping, NamedTuple

from tierzero.planning.recording import Recording

CHANNELS = {("nvme", "host"): "read", ("host", "nvme"): "write", ("host", "device"): "h2d",
            ("device", "host"): "d2h"}
"""The channel each leg (src, dst) queues on."""
COPY_WORKERS = 2
"""The placement manager's threads for copies between memories (its io workers are `workers`)."""


class Rate(NamedTuple):
    seconds_per_byte: float
    latency_s: float = 0.0

    def seconds(self, nbytes: int) -> float:
        return self.latency_s + nbytes * self.seconds_per_byte


@dataclass(frozen=True)
class TierModel:
    """Rates per leg and per-move overhead.

    How the tiers are modelled: a move takes one of the placement manager's workers for its whole
    life (a move that reads or writes NVMe one of its io workers, a copy between memories one of its
    two copy workers) and goes through its legs in order; each leg queues on its channel (NVMe
    reads, NVMe writes, one copy channel toward the device, one back), first come first served,
    taking `bytes * seconds_per_byte`: a disk reads while it writes (measured on 350m: the reads'
    and writes' busy times overlap by a fifth of their sum), and each direction's rate, calibrated
    from the recording, is the one it had beside the other's traffic; a move ends `overhead_s` after
    its last leg (thread hand-off, commit). The rates come from the recording's own moves (bytes
    over the seconds such legs ran); the overhead from its on-demand fetches (their wait less their
    legs); a `tierzero bench-io --json` result scales the disk's rates by read concurrency: the
    pieces of reads in flight at once (workers x pieces per unit read, at most io threads), its
    sequential GB/s at the candidate's concurrency over that at the recording's. Compute is the
    recording's, divided by `speedup` (e.g. 50: "what would a GPU fifty times faster need from this
    disk?").
    """

    rates: Mapping[tuple[str, str], Rate]
    overhead_s: float
    source: str
    """Where the disk's rates came from, for the report."""

    @classmethod
    def calibrate(cls, rec: Recording, bench: Mapping[str, Any] | None = None, *,
                  io_threads: int | None = None, workers: int | None = None) -> "TierModel":
        """Rates from the time the recording's legs were busy; the disk's scaled by `bench` (a
        bench-io --json result) from the recording's read concurrency to that of `io_threads`
        and `workers` (see `read_concurrency`)."""
        rates = {}
        for leg in CHANNELS:
            nbytes, busy = rec.busy.get(leg, (0, 0.0))
            rates[leg] = Rate(busy / nbytes if nbytes else 0.0)
        source = "the recording"
        was = read_concurrency(rec, rec.io_threads, rec.workers)
        now = read_concurrency(rec, io_threads or rec.io_threads, workers or rec.workers)
        if bench is not None and now != was:
            at = _bench_read_gbps(bench, was, rec.io_block_size)
            to = _bench_read_gbps(bench, now, rec.io_block_size)
            for leg in (("nvme", "host"), ("host", "nvme")):
                rates[leg] = Rate(rates[leg].seconds_per_byte * at / to)
            source = f"the recording, scaled by bench-io ({at:.2f} -> {to:.2f} GB/s, {was} -> {now} requests at once)"
        overhead = statistics.median(rec.miss_overheads) if rec.miss_overheads else 0.0002
        return cls(rates, max(0.0, overhead), source)

    def leg_seconds(self, src: str, dst: str, nbytes: int) -> float:
        return self.rates[(src, dst)].seconds(nbytes)


def read_concurrency(rec: Recording, io_threads: int, workers: int) -> int:
    """Pieces of NVMe reads that can be in flight at once: each worker reads one unit at a time,
    split into io block_size pieces, served by io_threads threads."""
    sizes = sorted(u.nbytes for u in rec.units.values() if u.nvme) or [rec.io_block_size]
    pieces = -(-sizes[len(sizes) // 2] // rec.io_block_size)
    return max(1, min(io_threads, workers * pieces))


def _bench_read_gbps(bench: Mapping[str, Any], threads: int, block_size: int) -> float:
    """Mean read GB/s of a bench-io result at `threads` (the nearest thread count and block size
    it measured)."""
    rows = [r for r in bench.get("engine", []) if r.get("op") == "read"]
    if not rows:
        raise ValueError("--bench-io: no engine read results in it; give the output of `tierzero bench-io --json`")
    t = min({r["threads"] for r in rows}, key=lambda x: (abs(x - threads), x))
    bs = min({r["block_size"] for r in rows if r["threads"] == t}, key=lambda x: (abs(x - block_size), x))
    return statistics.mean(r["gbps"] for r in rows if r["threads"] == t and r["block_size"] == bs)



__all__ = ["CHANNELS", "COPY_WORKERS", "Rate", "TierModel", "read_concurrency"]

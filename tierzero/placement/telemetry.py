"""What moved where and when: move events, stall time, per-tier bytes over time, Chrome traces.

The placement manager reports every finished move (`record_move`), every wait of a caller of
acquire (`record_stall`), every change of a tier's reserved bytes (`on_bytes`, a budget hook) and
whether an acquire found its data already there or on its way (`record_prefetch`); the
prefetcher adds one span per block fetch (`record_span`) and what the trace needs to be replayed
(`info`, written as the trace's "otherData"). Counters of
the current step are returned and cleared by `reset_step()`; `write_chrome_trace(path)` writes
the whole run for chrome://tracing or https://ui.perfetto.dev; `plot_run(run_dir)` draws a
`tierzero train` run folder's tiers.png.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, ContextManager, Iterator, NamedTuple, Protocol

from tierzero.config import TIER_NAMES
from tierzero.placement.handles import TRAFFIC_GROUPS

STALL_SOURCES = ("update", "room", "queued", "write", "read", "copy")
"""What a stall waited for: the overlapped step's update of a block ("update"), room on a tier
("room"), a move waiting for a worker ("queued"), an earlier write of what it reads ("write"),
an NVMe read ("read"), a copy between memories ("copy")."""
UPDATES_TRACK = "updates"
"""The trace track of the optimizer's block updates on their own thread (span args: block,
wait_s, overlapped: the overlapped step's, else step_in_backward's)."""
ACTIVATIONS_TRACK = "activations"
"""The trace track of placed activations (runtime/activations.py): "save BLOCK@N" spans of the
forward's writes, "fetch BLOCK" spans of backward's acquires (args: bytes, stall_s, tier, ahead)."""
MAX_EVENTS = 1_000_000
"""Moves and timeline points kept per run (the oldest are dropped past this)."""


class MoveEvent(NamedTuple):
    """One finished copy of a tensor between two tiers (times from time.perf_counter())."""

    tensor: str
    src: str
    dst: str
    nbytes: int
    start: float
    end: float


class Span(NamedTuple):
    """Something that took time on a named track of the Chrome trace (a block fetch)."""

    track: str
    name: str
    start: float
    end: float
    args: dict


@dataclass
class StepStats:
    """Counters of one step, as returned by `Telemetry.reset_step()` (tiers keyed by name)."""

    stall_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TIER_NAMES, 0.0))
    """Seconds callers of acquire() waited for data, by the tier they acquired on."""
    stall_s_by_source: dict[str, float] = field(default_factory=lambda: dict.fromkeys(STALL_SOURCES, 0.0))
    """The same seconds by what they waited for (STALL_SOURCES)."""
    bytes_moved: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIER_NAMES, 0))
    """Bytes copied toward each tier."""
    nvme_read_bytes: int = 0
    """Bytes read from the swap files (every read: fetches, pm.read, checkpoints)."""
    nvme_write_bytes: int = 0
    """Bytes written to the swap files."""
    nvme_busy_s: float = 0.0
    """Seconds with at least one swap file read or write in flight."""
    nvme_by_kind: dict[str, dict[str, int]] = field(
        default_factory=lambda: {g: {"read": 0, "write": 0} for g in TRAFFIC_GROUPS})
    """NVMe bytes read and written, by what the tensors hold (Kind.traffic)."""
    background_wait_s: float = 0.0
    """Seconds threads working beside compute (the overlapped step's updates) waited for data:
    not stalls of the training loop, which count its own waits (for such an update too)."""
    prefetch_hits: int = 0
    """Acquires that found their copy resident or already in flight."""
    prefetch_misses: int = 0
    """Acquires that had to start the copy themselves."""
    activation_bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIER_NAMES, 0))
    """Bytes of the activations this step's forward saved, by the tier they were kept on."""
    activation_stall_s: float = 0.0
    """Seconds compute waited on saved activations: to place them (forward) or to have them back
    on the device (backward); the backward's waits are also in `stall_s`."""


class StepRecorder(Protocol):
    """What the runtime records of a step in placement's telemetry (PlacementManager.recorder):
    its moves, stalls, activation bytes and spans of the trace; the step's figures are read with
    `reset_step`. The move and byte accounting of placement's own work stays Telemetry's."""

    info: dict[str, object]

    def record_move(self, tensor: str, src: str, dst: str, nbytes: int, start: float, end: float) -> None: ...

    def record_stall(self, tier: str, seconds: float, sources: dict[str, float]) -> None: ...

    def record_activations(self, tier: str, nbytes: int) -> None: ...

    def record_activation_stall(self, seconds: float) -> None: ...

    def record_span(self, track: str, name: str, start: float, end: float, args: dict) -> None: ...

    def background(self) -> ContextManager[Callable[[], float]]: ...

    def reset_step(self) -> StepStats: ...


class Telemetry:
    """Move events, stalls, prefetch hits and per-tier bytes of one PlacementManager."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.t0 = time.perf_counter()
        self.moves: deque[MoveEvent] = deque(maxlen=MAX_EVENTS)
        self.timeline: dict[str, deque[tuple[float, int]]] = {t: deque(maxlen=MAX_EVENTS) for t in TIER_NAMES}
        """Per tier, (time, reserved bytes) after every change."""
        self.stall_s: dict[str, float] = dict.fromkeys(TIER_NAMES, 0.0)
        self.stall_s_by_source: dict[str, float] = dict.fromkeys(STALL_SOURCES, 0.0)
        self.background_wait_s = 0.0
        self._local = threading.local()
        """Seconds callers of acquire() waited, by destination tier, over the whole run."""
        self.bytes_moved: dict[str, int] = dict.fromkeys(TIER_NAMES, 0)
        self.current: dict[str, int] = dict.fromkeys(TIER_NAMES, 0)
        self.peak: dict[str, int] = dict.fromkeys(TIER_NAMES, 0)
        self.prefetch_hits = 0
        self.prefetch_misses = 0
        self._step = StepStats()
        self.spans: deque[Span] = deque(maxlen=MAX_EVENTS)
        self.info: dict[str, object] = {}
        """Facts about the run for readers of the trace (units, budgets), its "otherData"."""
        self._nvme_inflight = 0
        self._nvme_busy_since = 0.0

    def nvme_started(self) -> None:
        """A swap file read or write was issued (the NVMe busy clock runs while any is)."""
        with self._lock:
            if self._nvme_inflight == 0:
                self._nvme_busy_since = time.perf_counter()
            self._nvme_inflight += 1

    def nvme_finished(self, op: str, traffic: str, nbytes: int) -> None:
        """A swap file read or write (op "read" or "write") of `nbytes` finished or failed."""
        with self._lock:
            self._nvme_inflight -= 1
            if self._nvme_inflight == 0:
                self._step.nvme_busy_s += time.perf_counter() - self._nvme_busy_since
            step = self._step
            if op == "read":
                step.nvme_read_bytes += nbytes
            else:
                step.nvme_write_bytes += nbytes
            step.nvme_by_kind[traffic][op] += nbytes

    def on_bytes(self, tier: str, used: int) -> None:
        """Budget hook: a tier's reserved bytes changed."""
        tier = str(tier)
        with self._lock:
            self.current[tier] = used
            self.peak[tier] = max(self.peak[tier], used)
            self.timeline[tier].append((time.perf_counter(), used))

    def record_move(self, tensor: str, src: str, dst: str, nbytes: int, start: float, end: float) -> None:
        src, dst = str(src), str(dst)
        with self._lock:
            self.moves.append(MoveEvent(tensor, src, dst, nbytes, start, end))
            self.bytes_moved[dst] += nbytes
            self._step.bytes_moved[dst] += nbytes

    @contextlib.contextmanager
    def background(self) -> Iterator[Callable[[], float]]:
        """The calling thread works beside compute until the block ends: its waits are not
        stalls. Yields a function that says how long this thread has waited in the block."""
        self._local.background = True
        self._local.waited = 0.0
        try:
            yield lambda: self._local.waited
        finally:
            self._local.background = False

    def record_stall(self, tier: str, seconds: float, sources: dict[str, float]) -> None:
        """A caller waited `seconds` for data on `tier`, split by `sources` (STALL_SOURCES); from
        a thread working beside compute (`background`), a wait of that thread, not a stall."""
        tier = getattr(tier, "value", tier)  # a Tier's name, without a call into config
        if getattr(self._local, "background", False):
            self._local.waited += seconds
            with self._lock:
                self.background_wait_s += seconds
                self._step.background_wait_s += seconds
            return
        with self._lock:
            self.stall_s[tier] += seconds
            self._step.stall_s[tier] += seconds
            for source, s in sources.items():
                self.stall_s_by_source[source] += s
                self._step.stall_s_by_source[source] += s

    def record_acquire(self, hit: bool, tier: str, seconds: float, sources: dict[str, float]) -> None:
        """An acquire found its copy there or on its way (`hit`: a prefetch hit) or not, and
        waited `seconds` for room and its move (split by `sources`; 0: no stall)."""
        self.record_prefetch(hit)
        if seconds:
            self.record_stall(tier, seconds, sources)

    def record_prefetch(self, hit: bool) -> None:
        with self._lock:
            if hit:
                self.prefetch_hits += 1
                self._step.prefetch_hits += 1
            else:
                self.prefetch_misses += 1
                self._step.prefetch_misses += 1

    def record_activations(self, tier: str, nbytes: int) -> None:
        """A forward saved `nbytes` of activations that are kept on `tier`."""
        with self._lock:
            self._step.activation_bytes[str(tier)] += nbytes

    def record_activation_stall(self, seconds: float) -> None:
        with self._lock:
            self._step.activation_stall_s += seconds

    def record_span(self, track: str, name: str, start: float, end: float, args: dict) -> None:
        with self._lock:
            self.spans.append(Span(track, name, start, end, args))

    def stall_by_source(self) -> dict[str, float]:
        """Seconds callers waited over the whole run, by source (a snapshot)."""
        with self._lock:
            return dict(self.stall_s_by_source)

    def total_stall_s(self) -> float:
        """Seconds callers of acquire() waited, over the whole run."""
        with self._lock:
            return sum(self.stall_s.values())

    def moves_since(self, t: float) -> list[MoveEvent]:
        """The moves that started at or after `t` (time.perf_counter()), oldest first."""
        with self._lock:
            out = []
            for m in reversed(self.moves):
                if m.end < t:
                    break
                if m.start >= t:
                    out.append(m)
        return out[::-1]

    def reset_step(self) -> StepStats:
        """Return this step's counters and start counting the next step."""
        with self._lock:
            step, self._step = self._step, StepStats()
            if self._nvme_inflight:  # the busy time so far belongs to the step that ends
                now = time.perf_counter()
                step.nvme_busy_s += now - self._nvme_busy_since
                self._nvme_busy_since = now
        return step

    def chrome_trace(self) -> dict:
        """The run as a Chrome trace: one track per copy direction, one counter per tier."""
        with self._lock:
            moves = list(self.moves)
            spans = list(self.spans)
            timeline = {t: list(v) for t, v in self.timeline.items()}
        pid = os.getpid()
        us = lambda t: (t - self.t0) * 1e6  # noqa: E731 - trace times are microseconds from start
        tracks: dict[str, int] = {}
        events: list[dict] = [{"ph": "M", "pid": pid, "name": "process_name", "args": {"name": "tierzero"}}]
        for m in moves:
            track = f"{m.src} -> {m.dst}"
            if track not in tracks:
                tracks[track] = len(tracks) + 1
                events.append({"ph": "M", "pid": pid, "tid": tracks[track], "name": "thread_name",
                               "args": {"name": track}})
            events.append({"ph": "X", "pid": pid, "tid": tracks[track], "name": m.tensor, "cat": "move",
                           "ts": us(m.start), "dur": max(us(m.end) - us(m.start), 0.001),
                           "args": {"bytes": m.nbytes}})
        for s in spans:
            if s.track not in tracks:
                tracks[s.track] = len(tracks) + 1
                events.append({"ph": "M", "pid": pid, "tid": tracks[s.track], "name": "thread_name",
                               "args": {"name": s.track}})
            events.append({"ph": "X", "pid": pid, "tid": tracks[s.track], "name": s.name, "cat": s.track,
                           "ts": us(s.start), "dur": max(us(s.end) - us(s.start), 0.001), "args": s.args})
        for tier, points in timeline.items():
            for t, used in points:
                events.append({"ph": "C", "pid": pid, "name": f"{tier} bytes", "ts": us(t),
                               "args": {"bytes": used}})
        return {"traceEvents": events, "displayTimeUnit": "ms", "otherData": {"tierzero": dict(self.info)}}

    def write_chrome_trace(self, path: str | os.PathLike[str]) -> None:
        """Write the Chrome trace JSON (open in https://ui.perfetto.dev or chrome://tracing)."""
        with open(path, "w") as f:
            json.dump(self.chrome_trace(), f)

    def __repr__(self) -> str:
        return (f"Telemetry(moves={len(self.moves)}, stall_s={self.stall_s}, "
                f"peak={self.peak}, prefetch hits/misses={self.prefetch_hits}/{self.prefetch_misses})")

"""Trace-based prefetch: record the block order of one step, fetch ahead of it in later steps
(the phases: beside `Prefetcher`).

Speculative reads past the first unit of a plan: [Note: read further ahead only into free room].

Eviction: the prefetcher is also the placement manager's eviction policy. Tensors of no unit go
first; units follow in the policy's `victims` order (by default the copy whose next use in the
trace is farthest away: Belady's rule). Whatever this order, the placement manager offers a
prefetched copy not used yet last (eviction.py).
"""

from __future__ import annotations

import threading
import time
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable, Iterable, NamedTuple, Sequence

from tierzero.config import Tier
from tierzero.placement import PlacementManager, Residency, TensorHandle
from tierzero.prefetch.policies import (BlockTimes, FetchPhase, PrefetchPolicy, PrefetchView, TraceEvent,
                                        Unit, describe, next_use_order, policy_from_config)

__all__ = ["FetchPhase", "Prefetcher", "TraceEvent", "Unit", "fitting", "policy_from_config", "prefetch_unit",
           "prefetch_units"]

_clock = time.perf_counter
"""The prefetcher's clock (tests replace it)."""

TRACK = "blocks"
"""The Chrome trace track of block fetches (one span per fetch, to the next)."""


def prefetch_unit(pm: PlacementManager, unit: Unit, tier: Tier, *, speculative: bool = False) -> bool:
    """Start copies of a unit's tensors toward `tier` (module level so tests can patch it);
    `speculative`: only into room that pushes out no copy still to be used and waits for no
    write-back (PlacementManager.prefetch)."""
    return pm.prefetch(unit.tensors, tier, speculative=speculative)


def fitting(units: Sequence[Unit], room: int) -> list[Unit]:
    """The units in order while their bytes together fit `room`: how a plan is clipped to a
    tier's room (the prefetcher, and the tier model replaying it)."""
    out = []
    for unit in units:
        if unit.nbytes > room:
            break
        out.append(unit)
        room -= unit.nbytes
    return out


_bringing = threading.local()
"""`unit`: the name of the unit a speculative fetch on this thread brings now (None: none), so
that `Prefetcher.order` offers only copies used after it
(see [Note: read further ahead only into free room])."""


# [Note: read further ahead only into free room]
# Of the units a plan brings toward a tier, the first is fetched for sure and the ones after it
# speculatively: into room that pushes out no copy still to be used and starts no write-back, nor
# any copy whose next use in the trace comes before the unit's own (Belady: bringing it would
# evict what is read again first; with a frozen base on NVMe and room below it, Adaptive's deep
# plans read blocks twice in one pass that way, tiny runs with a slow disk's times 1.3-2.0x the
# base a step, see tests/prefetch/test_read_once.py). A read into host memory is for sure only
# when the next fetch needs its unit: one further ahead, for sure, took the host copy of a unit
# due before it (the host arena's free bytes lie in pieces, so a room the policy counted as enough
# did not hold it beside the copies it kept). The first is what the next fetch needs; the others
# would take room the overlapped step's updates need for their state (they read and write ~200 MB
# a block on the built-in 350m, beside a host room of ~60 MiB for blocks) and wait for its
# write-backs: measured there with lookahead depth 4, the forward waited 1.4 s a step for the
# updates, against 0.2 s one block ahead.
def prefetch_units(pm: PlacementManager, units: Sequence[Unit], tier: Tier, *, first_sure: bool = True) -> None:
    """Start bringing `units` toward `tier`: the first for sure (unless not `first_sure`), the
    ones after it speculatively (see [Note: read further ahead only into free room])."""
    for i, unit in enumerate(units):
        speculative = i > 0 or not first_sure
        _bringing.unit = unit.name if speculative else None
        try:
            prefetch_unit(pm, unit, tier, speculative=speculative)
        finally:
            _bringing.unit = None


class _Mark(NamedTuple):
    """One fetch of an iteration, as timed: when it was asked for, the run's stall seconds then
    and once the block was fetched (in all, and by source), the units held beside it."""

    event: TraceEvent
    start: float
    stall0: float
    stall1: float | None
    held: tuple[str, ...]
    sources0: dict[str, float]
    sources1: dict[str, float] | None = None
    host_room: int = 0
    """Host bytes for unit copies when it was asked for (see Prefetcher._free_bytes)."""
    device_beside: int = 0
    """Device bytes taken beside homes, held units and acquired packs then (Prefetcher.device_beside)."""
    begun: Any = None
    """CUDA: a timing event on the compute stream before the fetch (None on the CPU)."""
    ready: Any = None
    """CUDA: a timing event once compute waits for the block's copy."""


@dataclass
class _Iteration:
    key: Hashable
    trace: tuple[TraceEvent, ...] | None
    """The trace followed (None: none recorded for this key yet)."""
    recording: list[TraceEvent] = field(default_factory=list)
    marks: list[_Mark] = field(default_factory=list)
    pos: int = 0
    deviated: bool = False
    start: float = field(default_factory=lambda: _clock())
    gap_stall: float = 0.0
    """Stall seconds between the previous iteration's end and this one's first fetch."""
    held: set[str] | None = None
    """The units held at the last fetch the trace followed (what `reissue` plans beside)."""


class _Pending(NamedTuple):
    """An iteration's last fetch, whose compute (to the next iteration's first fetch, the
    optimizer step included) is known once the next iteration of the same key starts."""

    key: Hashable
    length: int
    start: float
    stall: float


# Phases of one iteration (a forward and its backward):
#
# 1. The runtime calls `Prefetcher.begin(key)` at the root module's forward; `key` tells apart
#    traces that differ by mode (training with grad, inference).
# 2. Before each block is fetched it calls `on_fetch(event, held)`, and `fetched()` once the block
#    is on the device. The event (phase, unit) is recorded and timed. When a trace of this key
#    exists and the event is the one it expects next, the policy (policies.py) is shown a
#    `PrefetchView` of the trace at this position and answers what to fetch toward which tier;
#    the prefetcher starts the device copies that fit the device room left beside the held
#    blocks (copies, or all-gathers across ranks) and the reads into host memory that fit the
#    host room. The placement manager reserves every byte before a copy starts.
# 3. `end()` at the end of the backward (or of an inference forward) adopts the new recording
#    when it differs, writes one span per fetch to the telemetry's Chrome trace (track "blocks":
#    each fetch to the next, with its stall), and learns the iteration's times (`BlockTimes`):
#    compute per trace position (the span less the stalls in it; on CUDA, where the host only
#    queues kernels, the GPU's time from the block's copy landing to the next fetch, between
#    timing events on the compute stream) and copy time per unit and tier (from the
#    telemetry's moves). A fetch that deviates from the trace (dynamic control
#    flow) warns once and turns this iteration into on-demand fetching.
class Prefetcher:
    """Records traces and times, asks the policy what to fetch, and orders eviction victims."""

    def __init__(self, pm: PlacementManager, units: Sequence[Unit], policy: PrefetchPolicy, *,
                 device_free: Callable[[], int], fetch_ahead: Callable[[list[Unit]], object] | None = None,
                 device_wraps: bool = True, busy: Callable[[tuple[TensorHandle, ...]], bool] | None = None,
                 device_beside: Callable[[], int] | None = None) -> None:
        self.pm = pm
        self.units = {u.name: u for u in units}
        self.policy = policy
        self.device_free = device_free
        """Bytes of the device budget not taken by homes and held units."""
        self.fetch_ahead = fetch_ahead or (lambda units: prefetch_units(pm, units, Tier.DEVICE))
        """Starts bringing the units the policy chose to the device (the runtime's block
        prefetch: `prefetch_units`, or all-gathers across ranks)."""
        self.device_wraps = device_wraps
        """Device prefetches look past the end of an iteration into the next one (False where
        what they bring cannot outlive the optimizer step: blocks all-gathered across ranks)."""
        self.busy = busy or (lambda handles: False)
        """Whether a unit's tensors (its handles) are still being written (the overlapped step's
        update, tierzero/runtime/step/step_queue.py): it is not prefetched until they are done."""
        self.device_beside = device_beside or (lambda: 0)
        """Device bytes taken beside the homes, held units and backward's acquired activations
        (early capture's buffers, activations homed on the device): recorded at each fetch for
        the tier model."""
        self._lock = threading.Lock()
        """Plans are made one at a time: at each fetch (the training loop) and at each update's
        end (the overlapped step's thread, `reissue`)."""
        self._unit_of = {t: u.name for u in units for t in u.tensors}
        self._unit_of_name = {t.name: u.name for u in units for t in u.tensors}
        self._nvme_tensors = tuple(t for u in units if u.nvme for t in u.tensors)
        """The tensors of NVMe-homed units: those whose host copies `_free_bytes` counts as room."""
        self._traces: dict[Hashable, tuple[TraceEvent, ...]] = {}
        self._uses: dict[Hashable, dict[str, list[int]]] = {}
        self._times: dict[Hashable, BlockTimes] = {}
        self._it: _Iteration | None = None
        self._pending: _Pending | None = None
        self._ended: tuple[float, float] | None = None
        """(time, run's stall seconds) at the last end()."""
        self._iterations = 0
        self._warned = False
        self.deviations = 0
        """Iterations that deviated from their trace (each re-recorded)."""
        cfg = pm.config
        pm.telemetry.info.update(
            units={u.name: {"bytes": u.nbytes, "nvme": u.nvme, "tensors": [t.name for t in u.tensors]} for u in units},
            policy=describe(policy),
            device_room=device_free(), device_wraps=device_wraps, workers=max(2, cfg.prefetch.nvme_depth),
            io_threads=cfg.io.threads, io_block_size=cfg.io.block_size, nvme_depth=cfg.prefetch.nvme_depth)

    # --------------------------------------------------------------------- iteration lifecycle

    def begin(self, key: Hashable) -> None:
        if self._it is not None:
            self.end()
        self._it = _Iteration(key, self._traces.get(key))

    def on_fetch(self, event: TraceEvent, held: Iterable[str]) -> None:
        it = self._it
        if it is None:
            return  # a block run outside the root module's forward: on demand
        held = set(held) | {event.unit}
        now, stall = _clock(), self.pm.telemetry.total_stall_s()
        if not it.marks:
            self._learn_last(it.key, now, stall)
            it.gap_stall = stall - self._ended[1] if self._ended is not None else 0.0
        it.marks.append(_Mark(event, now, stall, None, tuple(sorted(held - {event.unit})),
                              self.pm.telemetry.stall_by_source(), host_room=self._free_bytes(Tier.HOST),
                              device_beside=self.device_beside(), begun=self._stamp()))
        it.recording.append(event)
        if it.trace is None or it.deviated:
            return
        if it.pos >= len(it.trace) or it.trace[it.pos] != event:
            self._deviate(it, f"expected {it.trace[it.pos] if it.pos < len(it.trace) else 'the end'}, "
                              f"got {event}")
            return
        it.pos += 1
        it.held = held
        with self._lock:
            self._issue(it, held, self.fetch_ahead)

    def reissue(self) -> None:
        """Plan again from the fetch the iteration is at (thread-safe): an update of the
        overlapped step ended, and a unit it was writing may be brought now. Copies only
        (`prefetch_units`, no all-gathers or activation packs): this runs off the training
        loop's thread."""
        it = self._it
        if it is None or it.trace is None or it.deviated or it.held is None:
            return
        with self._lock:
            self._issue(it, it.held, lambda units: prefetch_units(self.pm, units, Tier.DEVICE))

    def fetched(self) -> None:
        """The block of the last on_fetch is on the device (its stall is over)."""
        it = self._it
        if it is not None and it.marks:
            it.marks[-1] = it.marks[-1]._replace(stall1=self.pm.telemetry.total_stall_s(),
                                                 sources1=self.pm.telemetry.stall_by_source(), ready=self._stamp())

    def end(self, *, learn: bool = True) -> None:
        """The iteration is over; learn=False: it was cut short (a backward that raised), its
        fetches are neither a trace nor timings."""
        it, self._it = self._it, None
        if it is None or not it.recording or not learn:
            return
        now, stall = _clock(), self.pm.telemetry.total_stall_s()
        self._ended = (now, stall)
        new = tuple(it.recording)
        if it.trace is not None and not it.deviated and new != it.trace:
            self._deviate(it, f"the iteration ended after {len(new)} of {len(it.trace)} fetches")
        if new != it.trace:
            self._traces[it.key] = new
            uses: dict[str, list[int]] = {}
            for i, ev in enumerate(new):
                uses.setdefault(ev.unit, []).append(i)
            self._uses[it.key] = uses
        self._record(it, now, stall)

    def trace(self, key: Hashable) -> tuple[TraceEvent, ...] | None:
        return self._traces.get(key)

    def times(self, key: Hashable) -> BlockTimes | None:
        """The times learned for the iterations of `key` (None before one was measured)."""
        return self._times.get(key)

    def next_unit(self) -> str | None:
        """The unit the followed trace fetches next (None: no trace followed, or at its end)."""
        it = self._it
        if it is None or it.trace is None or it.deviated or it.pos >= len(it.trace):
            return None
        return it.trace[it.pos].unit

    def next_units(self, count: int) -> tuple[str, ...]:
        """The units the followed trace fetches next, nearest first, at most `count` (none when
        no trace is followed)."""
        it = self._it
        if it is None or it.trace is None or it.deviated:
            return ()
        return tuple(ev.unit for ev in it.trace[it.pos:it.pos + count])

    def _deviate(self, it: _Iteration, why: str) -> None:
        it.deviated = True
        self.deviations += 1
        if not self._warned:
            self._warned = True
            warnings.warn(f"tierzero: the block order differs from the recorded trace ({why}); "
                          "fetching on demand for this step and recording the trace again. "
                          "Dynamic control flow makes prefetching less effective.", stacklevel=4)

    # ------------------------------------------------------------------------- times learned

    def _record(self, it: _Iteration, now: float, stall: float) -> None:
        """An iteration is over: its fetches go to the Chrome trace (one span each, to the next
        fetch), and when it followed the trace now kept its compute and copy times are learned."""
        self._iterations += 1
        marks = it.marks
        ends = [(m.start, m.stall0) for m in marks[1:]] + [(now, stall)]
        stamps = [m.begun for m in marks[1:]] + [self._stamp()]
        compute = []
        for i, (m, (end, stall_end)) in enumerate(zip(marks, ends)):
            own = (m.stall1 if m.stall1 is not None else m.stall0) - m.stall0
            if m.ready is not None and stamps[i] is not None:
                compute.append(self.pm.streams.seconds(m.ready, stamps[i]))
            else:
                compute.append(max(0.0, end - m.start - (stall_end - m.stall0)))
            self.pm.telemetry.record_span(TRACK, f"{m.event.phase} {m.event.unit}", m.start, end, {
                "iteration": self._iterations, "key": repr(it.key), "pos": i, "phase": str(m.event.phase),
                "unit": m.event.unit, "held": list(m.held), "stall_s": own,
                "stall_by_source": {k: round(v - m.sources0[k], 6) for k, v in (m.sources1 or m.sources0).items()
                                    if v - m.sources0[k] > 0},
                "other_stall_s": stall_end - m.stall0 - own, "host_room": m.host_room,
                "device_beside": m.device_beside,
                **({"gap_stall_s": it.gap_stall} if i == 0 else {})})
        self._pending = None
        if tuple(it.recording) != self._traces.get(it.key):
            return
        times = self._times.setdefault(it.key, BlockTimes(sizes={n: u.nbytes for n, u in self.units.items()}))
        times.learn_compute(compute)
        self._pending = _Pending(it.key, len(marks), marks[-1].start, marks[-1].stall0)
        legs = {(Tier.NVME, Tier.HOST): Tier.HOST, (Tier.HOST, Tier.DEVICE): Tier.DEVICE}
        spent: dict[tuple[str, Tier], list[float]] = {}
        for move in self.pm.telemetry.moves_since(it.start):
            unit, tier = self._unit_of_name.get(move.tensor), legs.get((Tier(move.src), Tier(move.dst)))
            if unit is not None and tier is not None:
                spent.setdefault((unit, tier), []).append(move.end - move.start)
        for (unit, tier), seconds in spent.items():
            per_tensor = sum(seconds) / len(seconds) * len(self.units[unit].tensors)
            times.learn_fetch(unit, tier, per_tensor, self.units[unit].nbytes)

    def _stamp(self) -> Any:
        """A timing event on the compute stream with CUDA, where the host clock measures only
        kernel launches; None on the CPU, whose compute the host clock measures."""
        return self.pm.streams.stamp() if self.pm.streams.cuda else None

    def _learn_last(self, key: Hashable, now: float, stall: float) -> None:
        """The first fetch of an iteration: the previous one's last compute is known now."""
        p, self._pending = self._pending, None
        if p is None or p.key != key:
            return
        compute = [0.0] * p.length
        compute[-1] = max(0.0, now - p.start - (stall - p.stall))
        self._times[key].learn_compute(compute, last=True)

    # ----------------------------------------------------------------------------- prefetch

    def _view(self, it: _Iteration) -> PrefetchView:
        assert it.trace is not None
        held = frozenset(it.marks[-1].held) | {it.marks[-1].event.unit} if it.marks else frozenset()
        times = self._times.get(it.key) or BlockTimes()
        return PrefetchView(it.trace, it.pos - 1, self.units, held, self.device_wraps, times,
                            self._free_bytes, self._where, self._uses.get(it.key, {}))

    def _issue(self, it: _Iteration, held: set[str], fetch_ahead: Callable[[list[Unit]], object]) -> None:
        view = self._view(it)
        device: list[Unit] = []
        host: list[Unit] = []
        for f in self.policy.plan(view):
            unit, tier = self._check(f)
            chosen = device if tier is Tier.DEVICE else host
            if unit.name not in held and unit not in chosen and not self.busy(unit.tensors):
                chosen.append(unit)
        device = fitting(device, self.device_free())
        fetch_ahead(device)
        # A read of a unit the device copy above reads itself would read it twice.
        host = [u for u in host if u.nvme and (u not in device or Tier.HOST in self._where(u.name))]
        if host:  # the first for sure only when the next fetch needs it: see the note
            prefetch_units(self.pm, fitting(host, self._free_bytes(Tier.HOST)), Tier.HOST,
                           first_sure=view.next_use(host[0].name) == 1)

    def _check(self, f: Any) -> tuple[Unit, Tier]:
        """A Fetch from the policy, checked: a unit of the trace toward the device or host."""
        try:
            name, tier = f
            unit, tier = self.units[name], Tier(tier)
        except (TypeError, ValueError, KeyError):
            unit, tier = None, None
        if unit is None or tier not in (Tier.DEVICE, Tier.HOST):
            raise ValueError(f"prefetch policy {self.policy!r}: plan() gave {f!r}; expected "
                             f"Fetch(unit, tier) with a unit name of the trace (e.g. {next(iter(self.units))!r}) "
                             "and tier Tier.DEVICE or Tier.HOST")
        return unit, tier

    def _free_bytes(self, tier: Tier) -> int:
        if tier is Tier.DEVICE:
            return self.device_free()
        if tier is Tier.HOST:  # the NVMe units' host copies count: the prefetcher evicts them first
            return self.pm.free_bytes(Tier.HOST, self._nvme_tensors)
        return 0

    def _where(self, name: str) -> frozenset[Tier]:
        handles = self.units[name].tensors
        records = self.pm.record(handles)
        return frozenset(tier for tier in (Tier.DEVICE, Tier.HOST)
                         if all(h.home is not tier and rec.residency[tier] is not Residency.ABSENT
                                for h, rec in zip(handles, records)))

    # ----------------------------------------------------------------------------- eviction

    def order(self, candidates: list[TensorHandle]) -> list[TensorHandle]:
        """Eviction victims first: tensors of no unit, then units in the policy's order (by
        default the farthest next use in the trace first)."""
        it = self._it
        if it is None or it.trace is None or it.deviated:
            return list(candidates)
        others: list[TensorHandle] = []
        by_unit: dict[str, list[TensorHandle]] = {}
        for h in candidates:
            name = self._unit_of.get(h)
            if name is None:
                others.append(h)
            else:
                by_unit.setdefault(name, []).append(h)
        if not by_unit:
            return others
        victims = getattr(self.policy, "victims", None)
        names = list(by_unit)
        view = self._view(it)
        ranked = victims(view, names) if callable(victims) else next_use_order(view, names)
        ordered = list(dict.fromkeys(n for n in ranked if n in by_unit))
        ordered += [n for n in names if n not in ordered]  # left out: last
        bringing = getattr(_bringing, "unit", None)
        if bringing is not None:  # a speculative fetch evicts no copy used before the unit it brings
            due = view.next_use(bringing)
            ordered = [n for n in ordered if due is None or (d := view.next_use(n)) is None or d > due]
        return others + [h for n in ordered for h in by_unit[n]]

    def __repr__(self) -> str:
        return (f"Prefetcher(policy={self.policy}, units={len(self.units)}, traces={len(self._traces)}, "
                f"deviations={self.deviations})")


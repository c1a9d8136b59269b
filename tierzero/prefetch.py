"""Trace-based prefetch: record the block order of one step, fetch ahead of it in later steps.

Phases of one iteration (a forward and its backward):

1. The runtime calls `Prefetcher.begin(key)` at the root module's forward; `key` tells apart
   traces that differ by mode (training with grad, inference).
2. Before each block is fetched it calls `on_fetch(event, held)`. The event (phase, unit) is
   recorded. When a trace of this key exists and the event is the one it expects next, the
   policy picks upcoming units (the trace read cyclically, so the end of a backward looks ahead
   to the next forward) that fit the device room left beside the held ones, and the prefetcher
   starts their device copies; NVMe-homed units further ahead are read into host staging.
3. `end()` at the end of the backward (or of an inference forward) adopts the new recording
   when it differs. A fetch that deviates from the trace (dynamic control flow) warns once and
   turns this iteration into on-demand fetching.

Eviction: the prefetcher is also the placement manager's eviction policy. Victims are the
copies whose next use in the trace is farthest away (Belady's rule), unused ones first.
"""

from __future__ import annotations

import bisect
import warnings
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Callable, Hashable, Iterable, NamedTuple, Protocol, Sequence

from tierzero.config import Config
from tierzero.handles import TensorHandle
from tierzero.tiers import Tier

if TYPE_CHECKING:
    from tierzero.placement import PlacementManager


class Unit(NamedTuple):
    """What is fetched as one: a block's flat tensors in the placement manager."""

    name: str
    tensors: tuple[TensorHandle, ...]
    nbytes: int
    nvme: bool
    """Its tensors live on NVMe, so a read into host staging can run further ahead."""


class FetchPhase(str, Enum):
    """Why a block is fetched: a str enum, so traces print and compare as plain words."""

    FORWARD = "forward"
    BACKWARD = "backward"
    RECOMPUTE = "recompute"
    """A forward run again inside backward (activation checkpointing)."""

    def __str__(self) -> str:
        return self.value


class TraceEvent(NamedTuple):
    phase: FetchPhase
    unit: str


class PrefetchPolicy(Protocol):
    def select(self, upcoming: Iterable[Unit], room: int) -> list[Unit]:
        """Units to copy to the device now, nearest first, out of `upcoming` (distinct, not held,
        nearest first) whose bytes together fit `room`."""
        ...


def _fitting(upcoming: Iterable[Unit], room: int, limit: int | None) -> list[Unit]:
    chosen: list[Unit] = []
    for unit in upcoming:
        if limit is not None and len(chosen) >= limit or unit.nbytes > room:
            break
        chosen.append(unit)
        room -= unit.nbytes
    return chosen


@dataclass(frozen=True)
class NoPrefetch:
    """Fetch on demand only."""

    def select(self, upcoming: Iterable[Unit], room: int) -> list[Unit]:
        return []


@dataclass(frozen=True)
class Lookahead:
    """The next `depth` units (fewer when they do not fit the device room)."""

    depth: int = 2

    def select(self, upcoming: Iterable[Unit], room: int) -> list[Unit]:
        return _fitting(upcoming, room, self.depth)


@dataclass(frozen=True)
class BytesAhead:
    """As many upcoming units as fit `reserve` bytes of the device budget."""

    reserve: int

    def select(self, upcoming: Iterable[Unit], room: int) -> list[Unit]:
        return _fitting(upcoming, min(room, self.reserve), None)


def policy_from_config(config: Config) -> PrefetchPolicy:
    p = config.prefetch
    if p.policy == "none":
        return NoPrefetch()
    if p.policy == "lookahead":
        return Lookahead(p.depth)
    return BytesAhead(p.reserve or config.device_budget // 2)


def prefetch_unit(pm: "PlacementManager", unit: Unit, tier: Tier) -> bool:
    """Start copies of a unit's tensors toward `tier` (module level so tests can patch it)."""
    return all([pm.prefetch(handle, tier) for handle in unit.tensors])


@dataclass
class _Iteration:
    key: Hashable
    trace: tuple[TraceEvent, ...] | None
    """The trace followed (None: none recorded for this key yet)."""
    recording: list[TraceEvent] = field(default_factory=list)
    pos: int = 0
    deviated: bool = False


class Prefetcher:
    """Records traces, issues prefetches from them, and orders eviction victims by next use."""

    def __init__(self, pm: "PlacementManager", units: Sequence[Unit], policy: PrefetchPolicy, *,
                 nvme_depth: int, device_room: Callable[[], int],
                 fetch_ahead: Callable[[list[Unit]], object] | None = None, device_wraps: bool = True) -> None:
        self.pm = pm
        self.units = {u.name: u for u in units}
        self.policy = policy
        self.nvme_depth = nvme_depth
        self.device_room = device_room
        """Bytes of the device budget not taken by homes and held units."""
        self.fetch_ahead = fetch_ahead or (lambda units: [prefetch_unit(pm, u, Tier.DEVICE) for u in units])
        """Starts bringing the units the policy chose to the device (the runtime's block
        prefetch: copies, or all-gathers across ranks)."""
        self.device_wraps = device_wraps
        """Device prefetches look past the end of an iteration into the next one (False where
        what they bring cannot outlive the optimizer step: blocks all-gathered across ranks)."""
        self._unit_of = {t: u.name for u in units for t in u.tensors}
        self._traces: dict[Hashable, tuple[TraceEvent, ...]] = {}
        self._uses: dict[Hashable, dict[str, list[int]]] = {}
        self._it: _Iteration | None = None
        self._warned = False
        self.deviations = 0
        """Iterations that deviated from their trace (each re-recorded)."""

    # --------------------------------------------------------------------- iteration lifecycle

    def begin(self, key: Hashable) -> None:
        if self._it is not None:
            self.end()
        self._it = _Iteration(key, self._traces.get(key))

    def on_fetch(self, event: TraceEvent, held: Iterable[str]) -> None:
        it = self._it
        if it is None:
            return  # a block run outside the root module's forward: on demand
        it.recording.append(event)
        if it.trace is None or it.deviated:
            return
        if it.pos >= len(it.trace) or it.trace[it.pos] != event:
            self._deviate(it, f"expected {it.trace[it.pos] if it.pos < len(it.trace) else 'the end'}, "
                              f"got {event}")
            return
        it.pos += 1
        self._issue(it, set(held) | {event.unit})

    def end(self) -> None:
        it, self._it = self._it, None
        if it is None or not it.recording:
            return
        new = tuple(it.recording)
        if it.trace is not None and not it.deviated and new != it.trace:
            self._deviate(it, f"the iteration ended after {len(new)} of {len(it.trace)} fetches")
        if new != it.trace:
            self._traces[it.key] = new
            uses: dict[str, list[int]] = {}
            for i, ev in enumerate(new):
                uses.setdefault(ev.unit, []).append(i)
            self._uses[it.key] = uses

    def trace(self, key: Hashable) -> tuple[TraceEvent, ...] | None:
        return self._traces.get(key)

    def next_unit(self) -> str | None:
        """The unit the followed trace fetches next (None: no trace followed, or at its end)."""
        it = self._it
        if it is None or it.trace is None or it.deviated or it.pos >= len(it.trace):
            return None
        return it.trace[it.pos].unit

    def _deviate(self, it: _Iteration, why: str) -> None:
        it.deviated = True
        self.deviations += 1
        if not self._warned:
            self._warned = True
            warnings.warn(f"tierzero: the block order differs from the recorded trace ({why}); "
                          "fetching on demand for this step and recording the trace again. "
                          "Dynamic control flow makes prefetching less effective.", stacklevel=4)

    # ----------------------------------------------------------------------------- prefetch

    def _upcoming(self, it: _Iteration, exclude: set[str], *, wrap: bool = True) -> Iterable[Unit]:
        """Distinct units in trace order from the current position, wrapping around (or not)."""
        assert it.trace is not None
        seen = set(exclude)
        n = len(it.trace)
        for i in range(n if wrap else max(0, n - it.pos)):
            name = it.trace[(it.pos + i) % n].unit
            if name not in seen:
                seen.add(name)
                yield self.units[name]

    def _issue(self, it: _Iteration, held: set[str]) -> None:
        self.fetch_ahead(self.policy.select(self._upcoming(it, held, wrap=self.device_wraps), self.device_room()))
        if self.nvme_depth:
            ahead = [u for u in _take(self._upcoming(it, held), self.nvme_depth) if u.nvme]
            for unit in ahead:
                prefetch_unit(self.pm, unit, Tier.HOST)

    # ----------------------------------------------------------------------------- eviction

    def order(self, candidates: list[TensorHandle]) -> list[TensorHandle]:
        """Eviction victims first: farthest next use in the trace (none at all: first)."""
        it = self._it
        if it is None or it.trace is None or it.deviated:
            return list(candidates)
        uses = self._uses[it.key]
        n = len(it.trace)

        def distance(handle: TensorHandle) -> int:
            positions = uses.get(self._unit_of.get(handle, ""), ())
            if not positions:
                return 2 * n
            i = bisect.bisect_left(positions, it.pos)
            return positions[i] - it.pos if i < len(positions) else positions[0] + n - it.pos

        return sorted(candidates, key=distance, reverse=True)  # stable: LRU among ties

    def __repr__(self) -> str:
        return (f"Prefetcher(policy={self.policy}, units={len(self.units)}, traces={len(self._traces)}, "
                f"deviations={self.deviations})")


def _take(items: Iterable[Unit], n: int) -> list[Unit]:
    out = []
    for item in items:
        if len(out) >= n:
            break
        out.append(item)
    return out

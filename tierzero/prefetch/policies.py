"""Prefetch policies: what to fetch next and to which tier, and what to evict first.

Built-ins: `NoPrefetch` (on demand), `Lookahead(depth)` (the next `depth` blocks), `BytesAhead
(reserve)` (as many blocks as fit `reserve` bytes), and `Adaptive` (from the learned times, each
copy just early enough; see its docstring). Each built-in also reads the next `nvme_depth`
NVMe-homed units into host memory (Adaptive: those its times say are needed). A user's class is
given as an object, `Config(prefetch=MyPolicy())`, or by dotted path in a config file,
`[prefetch] policy = "mypkg.policies.MyPolicy"` with keyword arguments in `[prefetch.options]`.

What a policy sees and answers: see PrefetchPolicy; why no answer can put a tier over budget:
[Note: a policy only asks]."""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Callable, Iterable, Iterator, Mapping, NamedTuple, Protocol, Sequence

from tierzero.config import Config, Tier, load_policy_class
from tierzero.placement import TensorHandle


class Unit(NamedTuple):
    """What is fetched as one: a block's flat tensors in the placement manager."""

    name: str
    tensors: tuple[TensorHandle, ...]
    nbytes: int
    nvme: bool
    """Its tensors live on NVMe, so a read into host memory can run further ahead."""


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


class Fetch(NamedTuple):
    """A copy a policy asks for: the unit named `unit` toward `tier` (Tier.DEVICE, or Tier.HOST
    for a read of an NVMe-homed unit into host memory)."""

    unit: str
    tier: Tier


class Upcoming(NamedTuple):
    """A unit fetched later in the trace, `distance` fetches from now (1: the next one)."""

    unit: Unit
    distance: int


class BlockTimes:
    """Seconds learned from earlier iterations (exponential averages; `known` once one whole
    iteration was measured).

    compute_s(pos)       compute from the fetch at trace position `pos` to the next fetch (for
                         the last position: to the next iteration's first fetch, so it holds the
                         optimizer step), stalls left out
    fetch_s(unit, tier)  one copy of the unit toward `tier`: DEVICE from host memory, HOST from
                         NVMe; a unit never seen moving is estimated from the bytes per second
                         of the others
    """

    def __init__(self, compute_s: Sequence[float] = (), fetch_s: Mapping[tuple[str, Tier], float] | None = None,
                 *, sizes: Mapping[str, int] | None = None, alpha: float = 0.5) -> None:
        self._compute = list(compute_s)
        self._fetch: dict[tuple[str, Tier], float] = dict(fetch_s or {})
        self._sizes = dict(sizes or {})
        self._alpha = alpha

    @property
    def known(self) -> bool:
        return bool(self._compute)

    def compute_s(self, pos: int) -> float:
        return self._compute[pos % len(self._compute)] if self._compute else 0.0

    def fetch_s(self, unit: str, tier: Tier) -> float | None:
        t = self._fetch.get((unit, tier))
        if t is not None or unit not in self._sizes:
            return t
        rates = [s / self._sizes[u] for (u, k), s in self._fetch.items() if k is tier and self._sizes.get(u)]
        return sorted(rates)[len(rates) // 2] * self._sizes[unit] if rates else None

    def learn_compute(self, compute_s: Sequence[float], *, last: bool = False) -> None:
        """Average in one iteration's compute per position; `last`: only the final position's
        (known once the next iteration starts). A trace of another length starts afresh."""
        if last:
            if self._compute:
                self._compute[-1] = self._mix(self._compute[-1], compute_s[-1])
            return
        if len(compute_s) != len(self._compute):
            self._compute = list(compute_s)
            return
        keep = self._compute[-1]
        self._compute = [self._mix(a, b) for a, b in zip(self._compute, compute_s)]
        self._compute[-1] = keep  # the last position is learned separately (last=True)

    def learn_fetch(self, unit: str, tier: Tier, seconds: float, nbytes: int) -> None:
        old = self._fetch.get((unit, tier))
        self._fetch[(unit, tier)] = seconds if old is None else self._mix(old, seconds)
        self._sizes[unit] = nbytes

    def _mix(self, old: float, new: float) -> float:
        return (1 - self._alpha) * old + self._alpha * new

    def __repr__(self) -> str:
        return f"BlockTimes(positions={len(self._compute)}, fetches={len(self._fetch)})"


@dataclass(frozen=True, eq=False)
class PrefetchView:
    """What a policy sees at one fetch (see PrefetchPolicy). Read-only."""

    trace: tuple[TraceEvent, ...]
    """The recorded block order of one iteration; read cyclically (the end of a backward looks
    ahead to the next forward)."""
    pos: int
    """Index in `trace` of the fetch happening now."""
    units: Mapping[str, Unit]
    held: frozenset[str]
    """Units on the device for compute now (the one fetched now among them)."""
    wraps: bool
    """Device copies may look past the trace's end into the next iteration (False where what
    they bring cannot outlive the optimizer step: blocks all-gathered across ranks)."""
    times: BlockTimes
    room_of: Callable[[Tier], int] = field(repr=False)
    where_of: Callable[[str], frozenset[Tier]] = field(repr=False)
    uses: Mapping[str, Sequence[int]] = field(repr=False, default_factory=dict)
    """Unit name -> its positions in `trace`, ascending."""

    def room(self, tier: Tier) -> int:
        """Bytes fetched units may take on `tier`: DEVICE: the budget less device homes and held
        blocks; HOST: free bytes plus the units' evictable host copies."""
        return self.room_of(Tier(tier))

    def cached(self, unit: str) -> frozenset[Tier]:
        """Tiers other than its home holding a copy of the unit, or fetching one."""
        return self.where_of(unit)

    def upcoming(self, *, wrap: bool = True) -> Iterator[Upcoming]:
        """Distinct units not held, nearest first, from the next fetch on; `wrap` reads on into
        the next iteration (up to a whole trace)."""
        seen = set(self.held)
        n = len(self.trace)
        for d in range(1, n + 1 if wrap else n - self.pos):
            name = self.trace[(self.pos + d) % n].unit
            if name not in seen:
                seen.add(name)
                yield Upcoming(self.units[name], d)

    def next_use(self, unit: str) -> int | None:
        """Fetches from now until the unit's next use in the trace (0: now); None if unused."""
        positions = self.uses.get(unit)
        if not positions:
            return None
        n = len(self.trace)
        return min((p - self.pos) % n for p in positions)

    def until(self, distance: int) -> float:
        """Learned compute seconds from now until the fetch `distance` positions ahead (0.0
        before anything is learned)."""
        return sum(self.times.compute_s(self.pos + i) for i in range(distance))


# What a policy sees and answers: a policy is a small object implementing `PrefetchPolicy`
# (`tz.PrefetchPolicy`). At every block fetch that follows the recorded trace, the prefetcher
# (prefetcher.py) hands it a `PrefetchView`: the trace (the block order of one iteration,
# recorded in the first), the position of the fetch happening now, the units (blocks) with their
# bytes, the blocks held on the device, the room on the device and host tiers, which tiers
# already hold a copy of a unit, and the times learned from earlier iterations (`BlockTimes`).
# `plan(view)` answers with `Fetch(unit, tier)` records, nearest first: copies toward the device,
# and reads of NVMe-homed units into host memory (so the device copy later starts from host).
# `victims(view, candidates)` orders cached copies for eviction, victims first (by default the
# copy used farthest in the future goes first: Belady's rule on the trace).
#
# [Note: a policy only asks]
# A policy only asks. The prefetcher drops device fetches past the device room (budget minus
# device homes minus held blocks) and host fetches past the host room (free host bytes plus the
# evictable host copies of units), and the placement manager reserves every byte before a copy
# starts, evicting only unpinned cached copies: no answer of a policy can put a tier over budget.
class PrefetchPolicy(Protocol):
    """What a prefetch policy implements (`tz.PrefetchPolicy`; see the comment above).

    Subclass it (to inherit `victims`), or implement `plan` on any class.
    """

    def plan(self, view: PrefetchView) -> Iterable[Fetch]:
        """Copies to start now, nearest first: Fetch(unit name, Tier.DEVICE or Tier.HOST).
        Units already there are kept there (and count in the room); device fetches past the
        device room and host fetches past the host room are dropped, in order."""
        ...

    def victims(self, view: PrefetchView, candidates: Sequence[str]) -> Sequence[str]:
        """The units among `candidates` (names of units with an evictable cached copy on the
        tier that needs room) in eviction order, victims first; left-out ones go last."""
        return next_use_order(view, candidates)


def next_use_order(view: PrefetchView, candidates: Sequence[str]) -> list[str]:
    """Farthest next use in the trace first, units the trace does not use before them."""
    n = len(view.trace)

    def distance(name: str) -> int:
        d = view.next_use(name)
        return 2 * n if d is None else d

    return sorted(candidates, key=distance, reverse=True)  # stable: LRU among ties


def _device_ahead(view: PrefetchView, limit: int | None, reserve: int | None) -> list[Fetch]:
    """The nearest upcoming units, at most `limit` of them, while they fit `reserve` bytes."""
    out: list[Fetch] = []
    room = view.room(Tier.DEVICE) if reserve is None else min(reserve, view.room(Tier.DEVICE))
    for up in view.upcoming(wrap=view.wraps):
        if limit is not None and len(out) >= limit or up.unit.nbytes > room:
            break
        out.append(Fetch(up.unit.name, Tier.DEVICE))
        room -= up.unit.nbytes
    return out


def _read_ahead(view: PrefetchView, depth: int) -> list[Fetch]:
    """Host reads of the NVMe-homed units among the next `depth` upcoming units."""
    out: list[Fetch] = []
    for i, up in enumerate(view.upcoming()):
        if i >= depth:
            break
        if up.unit.nvme:
            out.append(Fetch(up.unit.name, Tier.HOST))
    return out


@dataclass(frozen=True)
class NoPrefetch(PrefetchPolicy):
    """Device copies on demand only; NVMe-homed units may still be read ahead into host."""

    nvme_depth: int = 0

    def plan(self, view: PrefetchView) -> list[Fetch]:
        return _read_ahead(view, self.nvme_depth)


@dataclass(frozen=True)
class Lookahead(PrefetchPolicy):
    """The next `depth` units to the device (fewer when they do not fit the device room), the
    next `nvme_depth` NVMe-homed ones into host."""

    depth: int = 2
    nvme_depth: int = 4

    def plan(self, view: PrefetchView) -> list[Fetch]:
        return _device_ahead(view, self.depth, None) + _read_ahead(view, self.nvme_depth)


@dataclass(frozen=True)
class BytesAhead(PrefetchPolicy):
    """As many upcoming units to the device as fit `reserve` bytes of the device budget; the
    next `nvme_depth` NVMe-homed ones into host."""

    reserve: int
    nvme_depth: int = 4

    def plan(self, view: PrefetchView) -> list[Fetch]:
        return _device_ahead(view, None, self.reserve) + _read_ahead(view, self.nvme_depth)


@dataclass(frozen=True)
class Adaptive(PrefetchPolicy):
    """Each copy just early enough, from the times learned in earlier iterations; no depth.

    At the fetch of position p the policy decides again at every later fetch. A unit must be
    asked for now if, left to the decision after next (after two blocks of compute: one of
    slack against compute and copy times that vary), its copy would land after its use: the
    compute until its use, less those two blocks', is shorter than `margin` times the copy time
    of it and of the nearer units that also need copies (they queue on the same workers and
    disk), plus `slack_s`. A device copy of an NVMe-homed unit not in host memory counts its
    read too. The device plan runs up to the farthest unit that must start now (nearer ones
    stay, or come, on the device), within the device room; so with compute much slower than
    copies it keeps two blocks coming, and more as compute gets faster. NVMe-homed units are
    read into host by the same rule, so the read lands before the device copy must start: the
    slower the disk against compute, the further ahead, within the host room; and at least the
    unit after the device plan, so device copies start from a host copy (which stays cached,
    evictable, and saves the next read of it), and the next `nvme_depth` units, so reads stay
    in flight beside compute when the times say they could wait (host room is cheaper than a
    stall). Until one iteration is measured it acts as Lookahead(1, nvme_depth). Host reads stop
    at the host room: see [Note: read ahead only what Belady would keep].
    """

    margin: float = 1.5
    """Copy times are multiplied by this, for their noise."""
    slack_s: float = 0.001
    """Seconds added to every copy time (thread hand-offs)."""
    nvme_depth: int = 4
    """The least read-ahead from NVMe, in units (more when the times ask for it)."""

    def plan(self, view: PrefetchView) -> list[Fetch]:
        times = view.times
        if not times.known:
            return Lookahead(1, self.nvme_depth).plan(view)
        # Units are asked for unless the decision after next (two blocks of compute from now:
        # one of slack against times that vary) still leaves their copies time to land.
        later = times.compute_s(view.pos) + times.compute_s(view.pos + 1)
        rooms = {Tier.DEVICE: view.room(Tier.DEVICE), Tier.HOST: view.room(Tier.HOST)}
        in_iteration = len(view.trace) - view.pos  # device copies stop here unless view.wraps
        ups: list[tuple[Upcoming, frozenset[Tier]]] = []
        copy_q = read_q = 0.0
        device_far = 1
        host_far = 0
        seen = 0
        for up in view.upcoming():
            name = up.unit.name
            where = view.cached(name)
            copy = 0.0 if Tier.DEVICE in where else (times.fetch_s(name, Tier.DEVICE) or 0.0)
            read_q += (times.fetch_s(name, Tier.HOST) or 0.0) if up.unit.nvme and not where else 0.0
            copy_q += copy
            ups.append((up, where))
            ahead = view.until(up.distance) - later
            if (view.wraps or up.distance < in_iteration) and ahead < self.margin * (copy_q + read_q) + self.slack_s:
                device_far = len(ups)
            if up.unit.nvme and ahead < self.margin * (read_q + copy) + self.slack_s:
                host_far = len(ups)
            seen += up.unit.nbytes
            if seen > max(rooms.values()):
                break  # nothing further fits either tier
        device: list[Fetch] = []
        room = rooms[Tier.DEVICE]
        for up, _ in ups[:device_far]:
            if up.unit.nbytes > room or not (view.wraps or up.distance < in_iteration):
                break
            device.append(Fetch(up.unit.name, Tier.DEVICE))
            room -= up.unit.nbytes
        # At least the unit after the device plan (its next copy then starts from host) and
        # the next nvme_depth units: reads in flight beside compute guard against noisy times.
        host_far = max(host_far, len(device) + 1, self.nvme_depth)
        return device + _reads_in_room(ups[:host_far], {f.unit for f in device}, rooms[Tier.HOST])


# [Note: read ahead only what Belady would keep]
# A read into host memory that the room holds only by evicting a copy used sooner is undone
# before its use: the evicted copy is read again first, and it pushes the read-ahead out in turn.
# With a host room below a frozen base on NVMe (benchmarks/lora.py) the reads ran as far as the
# times asked, evicting the host copies of blocks due sooner: with a slow disk's times the base
# was read more than once a step, some blocks twice in one pass, where Lookahead(2) read less
# (tests/prefetch/test_read_once.py). So reads stop where
# the host copies of every unit up to the next one, cached or read now, no longer fit the host
# room together: eviction (farthest next use first) then only takes copies used later.
def _reads_in_room(ups: Sequence[tuple[Upcoming, frozenset[Tier]]], chosen: set[str], room: int) -> list[Fetch]:
    """Host reads of the NVMe-homed units among `ups` (nearest first, with the tiers caching
    each) that the device plan (`chosen`) does not bring, while the host copies of every unit
    up to each, read now or cached already, fit the host `room` together
    (see [Note: read ahead only what Belady would keep])."""
    out: list[Fetch] = []
    for up, where in ups:
        unit = up.unit
        if not unit.nvme:
            continue
        if Tier.HOST in where:  # cached: its copy stays, nearer than the reads after it
            room -= unit.nbytes
            if unit.name not in chosen:
                out.append(Fetch(unit.name, Tier.HOST))
            continue
        if where or unit.name in chosen:
            continue  # on the device only, or brought there by the device plan
        if unit.nbytes > room:
            break
        room -= unit.nbytes
        out.append(Fetch(unit.name, Tier.HOST))
    return out


# ------------------------------------------------------------------------------ choosing one


def policy_from_config(config: Config) -> PrefetchPolicy:
    """The policy object `config.prefetch` names (a new one for a dotted path)."""
    p = config.prefetch
    policy = p.policy
    if not isinstance(policy, str):
        return policy
    if policy == "none":
        return NoPrefetch(p.nvme_depth)
    if policy == "lookahead":
        return Lookahead(p.depth, p.nvme_depth)
    if policy == "bytes":
        return BytesAhead(p.reserve or config.device_budget // 2, p.nvme_depth)
    if policy == "adaptive":
        return Adaptive(nvme_depth=p.nvme_depth)
    cls = load_policy_class(policy, p.options)
    try:
        return cls(**p.options)
    except Exception as e:
        raise ValueError(f"prefetch.policy {policy!r}: {cls.__name__}(**{dict(p.options)!r}) failed: "
                         f"{type(e).__name__}: {e}") from e


def describe(policy: PrefetchPolicy) -> str:
    """A short name for tables and traces: the built-in's name with its knobs, or the class."""
    names = {NoPrefetch: "none", Lookahead: "lookahead", BytesAhead: "bytes", Adaptive: "adaptive"}
    return names.get(type(policy), f"{type(policy).__module__}.{type(policy).__qualname__}")

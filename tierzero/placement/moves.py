"""Moves between tiers: the copies they fill, their typed plans, the table of moves in flight,
and the worker bodies that run them.

PlacementManager plans a move under its lock: it reserves every buffer the move needs (its
destination and any host staging buffer), pins the source, and bundles all of it in a plan (a
`FetchPlan`, `WritebackPlan` or `StorePlan`). A worker thread runs the plan's body (`run_fetch`,
`run_writeback`, `run_store`: plain functions, without the lock, so tests can patch the IO they
call), which returns a `Done` (the copy's event and its legs for telemetry) or raises; the
manager turns that into an `Outcome` and commits it under its lock. The body's legs:

    fetch       NVMe -> host (io_engine read into the destination host copy, or into a staging
                buffer when the destination is the device), then host or device -> the
                destination (copy stream); a copy toward the device is announced as issued
                (`FetchPlan.issued`, its event) as soon as it is queued: acquire() then orders
                compute after the event instead of waiting on the host for the copy to land
    write-back  the cached copy -> its home (copy stream); for an NVMe home, device -> host
                staging (copy stream), then host -> NVMe (io_engine write)
    store       a host staging copy of the caller's data -> the NVMe home (io_engine write)

Moves of one tensor that touch its home run in order: a plan lists the earlier moves it waits for.
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from dataclasses import dataclass, field
from typing import NamedTuple, Union

import torch

from tierzero.config import Tier
from tierzero.placement.handles import TensorHandle
from tierzero.placement.nvme import SwapSpace
from tierzero.placement.streams import DONE, MUTATIONS, CopyEvent, CopyStreams
from tierzero.placement.tier_store import Buffer, flat, region, typed


@dataclass(eq=False)
class Copy:
    """One tensor's bytes on one tier (a TensorRecord keeps one per tier it is on)."""

    buffer: Buffer
    """What holds the reservation: a host pool buffer, a device buffer, or an NVMe region."""
    tensor: torch.Tensor | None
    """The bytes viewed with the registered shape and dtype (None for an NVMe region)."""
    pins: int = 0
    """Acquires not yet released, plus moves in flight reading from this copy."""
    holders: list[int] = field(default_factory=list)
    """The threads (idents) of the acquires not yet released: a wait for room that only this
    thread's own copies block can never end (PlacementManager tells it at once)."""
    stale: bool = False
    """Another copy was written back while this one was pinned or in flight: drop it when free."""
    used: bool = False
    """Acquired since it was fetched: a prefetched copy not yet used is evicted last."""
    dirty: bool = False
    """Newer than the home (released dirty with lazy=True): written back before it is evicted,
    or dropped unwritten by discard()."""
    event: CopyEvent = DONE
    """The copy that filled it; compute waits on it before using the tensor."""


class Leg(NamedTuple):
    """A stretch of a move's time, by what it was doing: "queued" (waiting for a worker),
    "write" (waiting for an earlier move of the tensor that writes what it reads), "read" (an
    NVMe read), "copy" (a copy between memories), "write" again for an NVMe write."""

    source: str
    start: float
    end: float


def stall_sources(legs: list[Leg], start: float, end: float) -> dict[str, float]:
    """A wait from `start` to `end` for a move with these legs, split by what the move was doing
    meanwhile (the part no leg covers, such as its commit, counts as "copy")."""
    out: dict[str, float] = {}
    for leg in legs:
        overlap = min(end, leg.end) - max(start, leg.start)
        if overlap > 0:
            out[leg.source] = out.get(leg.source, 0.0) + overlap
    rest = (end - start) - sum(out.values())
    if rest > 0:
        out["copy"] = out.get("copy", 0.0) + rest
    return out


class Move(NamedTuple):
    """One copy in flight; `future` completes when the copy is done and committed, by which
    time `legs` says where its time went (for the stall attribution of whoever waited on it)."""

    tensor: TensorHandle
    src: Tier
    dst: Tier
    nbytes: int
    future: cf.Future[None]
    start: float
    legs: list[Leg]
    issued: cf.Future[CopyEvent] | None = None
    """A fetch's: done once its last copy is queued, with that copy's event (toward the device:
    compute may order itself after it while the move waits for the copy to land)."""


class MoveTable:
    """Every move in flight, in one place, keyed by (tensor, tier of its cached copy): the tier
    a fetch fills or a write-back copies from (a store, which targets the NVMe home, is keyed by
    NVMe: no other move is). A cached copy has at most one move at a time."""

    def __init__(self) -> None:
        self._moves: dict[tuple[TensorHandle, Tier], Move] = {}

    def add(self, tier: Tier, move: Move) -> None:
        assert (move.tensor, tier) not in self._moves, f"{move.tensor.name} already moving on {tier}"
        self._moves[(move.tensor, tier)] = move

    def pop(self, handle: TensorHandle, tier: Tier) -> Move:
        return self._moves.pop((handle, tier))

    def get(self, handle: TensorHandle, tier: Tier) -> Move | None:
        return self._moves.get((handle, tier))

    def for_tensor(self, handle: TensorHandle) -> tuple[Move, ...]:
        return tuple(m for (h, _), m in tuple(self._moves.items()) if h is handle)

    def all(self) -> tuple[Move, ...]:
        return tuple(self._moves.values())

    def __len__(self) -> int:
        return len(self._moves)


def staging_needs(src: Tier | None, dst: Tier, nbytes: int) -> list[tuple[Tier, int]]:
    """The host staging buffer that `nbytes` moved from `src` (None: a caller's tensor) to `dst`
    pass through, as a reservation need, or none: NVMe IO needs page-aligned host bytes, and
    only a cached host copy already is."""
    return [(Tier.HOST, nbytes)] if Tier.NVME in (src, dst) and Tier.HOST not in (src, dst) else []


class Span(NamedTuple):
    """One leg of a move, for telemetry."""

    src: Tier
    dst: Tier
    start: float
    end: float


class Landing(NamedTuple):
    """The last copy of a body, queued on a copy stream and not waited for: the move commits
    once its event completes, and its leg (`src` -> `dst`, from `start`) ends then."""

    src: Tier
    dst: Tier
    start: float


class Done(NamedTuple):
    """A body finished: the event of its last copy (complete once it returns, unless `landing`
    says the commit waits for it), its legs, the time it first waited for earlier moves of the
    tensor writing what it reads, and then for the fetch still filling its source (each
    (start, end))."""

    event: CopyEvent
    spans: list[Span]
    waited: tuple[float, float] | None = None
    source_read: tuple[float, float] | None = None
    landing: Landing | None = None

    def legs(self) -> list[Leg]:
        """Where the body's time went, as stall sources."""
        out = [Leg("write", *self.waited)] if self.waited is not None else []
        if self.source_read is not None:
            out.append(Leg("read", *self.source_read))
        for s in self.spans:
            source = "read" if s.src is Tier.NVME else "write" if s.dst is Tier.NVME else "copy"
            out.append(Leg(source, s.start, s.end))
        return out


class Failed(NamedTuple):
    """A body raised `error`; the manager commits the move as failed, then re-raises it."""

    error: BaseException


Outcome = Union[Done, Failed]


class MoveIO(NamedTuple):
    """What worker bodies copy with: the device tier's copy streams and this rank's swap files."""

    streams: CopyStreams
    swap: SwapSpace | None

    def nvme(self) -> SwapSpace:
        assert self.swap is not None, "an NVMe move without swap files"
        return self.swap


class FetchPlan(NamedTuple):
    """A copy toward a cached copy's tier, every buffer it needs already reserved."""

    handle: TensorHandle
    src: Tier
    """Where the bytes come from: the home, or a cached host copy of an NVMe-homed tensor."""
    dst: Tier
    source: Copy
    """The copy read; pinned from the start of the move until its commit."""
    copy: Copy
    """The copy filled (its bytes reserved on `dst`)."""
    staging: torch.Tensor | None
    """Host bytes between the NVMe read and the device copy (NVMe -> device only)."""
    ready: CopyEvent | None
    """Compute's work queued on a device source when the move started: copied after it."""
    after: tuple[cf.Future[None], ...]
    """Earlier moves of this tensor writing what it reads: the home, or the cached copy it
    copies from (a cached host copy is current before its home's write lands: a fetch from it
    does not wait for that write)."""
    source_fetch: cf.Future[None] | None
    """The fetch still filling `source`, when there is one: its failure fails this fetch."""
    issued: cf.Future[CopyEvent]
    """Set by the body once the copy toward the device is queued (else when the move ends)."""


class WritebackPlan(NamedTuple):
    """A copy of a cached copy's contents to the home (released dirty)."""

    handle: TensorHandle
    src: Tier
    copy: Copy
    """The cached copy written back; WRITING_BACK until the commit."""
    home: Copy
    staging: torch.Tensor | None
    """Host bytes between the device copy and the NVMe write (device -> NVMe only)."""
    ready: CopyEvent | None
    """Compute's work on a device copy when it was released: copied after it."""
    after: tuple[cf.Future[None], ...]
    """Every earlier move of this tensor."""


class StorePlan(NamedTuple):
    """A write of a host staging copy of stored data to the NVMe home."""

    handle: TensorHandle
    home: Copy
    staging: torch.Tensor


def run_fetch(plan: FetchPlan, io: MoveIO) -> Done:
    waited = time.perf_counter()
    cf.wait(plan.after)
    waited_until = time.perf_counter()
    error = plan.source_fetch.exception() if plan.source_fetch is not None else None  # waits for it
    read_until = time.perf_counter()
    if error is not None:
        raise error  # the copy this fetch reads failed, and is gone
    h, spans = plan.handle, []
    with torch.profiler.record_function(f"tierzero::fetch {h.name}"), io.streams.context():
        t0 = time.perf_counter()
        if plan.src is Tier.NVME:
            landing = plan.staging if plan.staging is not None else flat(plan.copy.buffer)
            io.nvme().read(region(plan.source.buffer), landing.numpy(), h.name, h.kind.traffic)
            spans.append(Span(Tier.NVME, Tier.HOST, t0, time.perf_counter()))
            if plan.dst is Tier.HOST:
                return Done(DONE, spans, (waited, waited_until), (waited_until, read_until))
            t0 = time.perf_counter()
        copy_src = plan.source.tensor if plan.staging is None else typed(plan.staging, h)
        event = io.streams.copy(plan.copy.tensor, copy_src, after=plan.ready)
        src = plan.src if plan.staging is None else Tier.HOST
        if io.streams.asynchronous:
            if plan.dst is Tier.DEVICE:
                plan.issued.set_result(event)
            # The source and staging are freed at commit, after the copy: the commit waits for
            # it, not this worker, which goes on to its next NVMe read (ResidencyTable._land).
            return Done(event, spans, (waited, waited_until), (waited_until, read_until), Landing(src, plan.dst, t0))
        spans.append(Span(src, plan.dst, t0, time.perf_counter()))
    return Done(event, spans, (waited, waited_until), (waited_until, read_until))


def run_writeback(plan: WritebackPlan, io: MoveIO) -> Done:
    cf.wait(plan.after)
    plan.copy.event.synchronize()  # the last write into the copy (a gradient's device-to-host copy)
    h, spans = plan.handle, []
    with torch.profiler.record_function(f"tierzero::writeback {h.name}"), io.streams.context():
        t0 = time.perf_counter()
        if h.home is not Tier.NVME:
            io.streams.copy(plan.home.tensor, plan.copy.tensor, after=plan.ready).synchronize()
            spans.append(Span(plan.src, h.home, t0, time.perf_counter()))
            return Done(DONE, spans)
        landing = flat(plan.copy.buffer)
        if plan.staging is not None:
            event = io.streams.copy(typed(plan.staging, h), plan.copy.tensor, after=plan.ready)
            if "writeback_wait" not in MUTATIONS:
                event.synchronize()  # the staging buffer's bytes go to NVMe next
            spans.append(Span(plan.src, Tier.HOST, t0, time.perf_counter()))
            landing, t0 = plan.staging, time.perf_counter()
        io.nvme().write(region(plan.home.buffer), landing.numpy(), h.name, h.kind.traffic)
        spans.append(Span(Tier.HOST, Tier.NVME, t0, time.perf_counter()))
    return Done(DONE, spans)


def run_store(plan: StorePlan, io: MoveIO) -> Done:
    t0 = time.perf_counter()
    with torch.profiler.record_function(f"tierzero::store {plan.handle.name}"):
        io.nvme().write(region(plan.home.buffer), plan.staging.numpy(), plan.handle.name,
                        plan.handle.kind.traffic)
    return Done(DONE, [Span(Tier.HOST, Tier.NVME, t0, time.perf_counter())])

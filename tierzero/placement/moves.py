"""Moves between tiers: the copies they fill, their typed plans, the table of moves in flight,
the worker bodies that run them and the executor that runs the bodies on worker threads.

ResidencyTable plans a move under the lock, every buffer it needs reserved (a `FetchPlan`,
`WritebackPlan` or `StorePlan`), and hands it to `MoveExecutor.submit` with the transition
that commits it. A worker runs the plan's body (`run_fetch`, `run_writeback`, `run_store`:
plain functions, without the lock, so tests can patch the IO they call), which returns a
`Done` or raises; the executor commits the `Outcome` under the lock. See [Note: move legs].
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from dataclasses import dataclass, field
import contextlib
import threading
from typing import Callable, NamedTuple, TypeVar, Union

import torch

from tierzero.config import Tier
from tierzero.placement.handles import TensorHandle
from tierzero.placement.nvme import SwapSpace
from tierzero.placement.streams import DONE, CopyEvent, CopyStreams
from tierzero.placement.tier_store import Buffer, as_memory, region, typed


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


def wait_for_staging(event: CopyEvent) -> None:
    """A write-back's device-to-host copy has landed: the staging buffer's bytes go to NVMe next."""
    event.synchronize()


# [Note: move legs]
# The legs of each body:
#   fetch       NVMe -> host (io_engine read into the destination host copy, or into a staging
#               buffer when the destination is the device), then host or device -> the
#               destination (copy stream); a copy toward the device is announced as issued
#               (`FetchPlan.issued`, its event) as soon as it is queued: acquire() then orders
#               compute after the event instead of waiting on the host for the copy to land
#   write-back  the cached copy -> its home (copy stream); for an NVMe home, device -> host
#               staging (copy stream), then host -> NVMe (io_engine write)
#   store       a host staging copy of the caller's data -> the NVMe home (io_engine write)
# Moves of one tensor that touch its home run in order: a plan lists the earlier moves it
# waits for.


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
            landing = plan.staging if plan.staging is not None else as_memory(plan.copy.buffer)
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
            # it, not this worker, which goes on to its next NVMe read (MoveExecutor._commit_once_landed).
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
        landing = as_memory(plan.copy.buffer)
        if plan.staging is not None:
            event = io.streams.copy(typed(plan.staging, h), plan.copy.tensor, after=plan.ready)
            wait_for_staging(event)
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


PlanT = TypeVar("PlanT", FetchPlan, WritebackPlan, StorePlan)
Body = Callable[[PlanT, MoveIO], Done]
Commit = Callable[[PlanT, Outcome], None]


class MoveExecutor:
    """Runs move bodies on worker threads and commits their outcomes under `cond`.

    Every move is in `table`, under (tensor, key), from `submit` until its commit ran; the
    commit (a transition of ResidencyTable) runs under `cond`, which then notifies waiters.
    """

    def __init__(self, cond: threading.Condition, io: MoveIO, *, workers: int, rank: int) -> None:
        self.cond = cond
        self.io = io
        self.table = MoveTable()
        # Moves that read or write the swap files run on `workers` threads (the NVMe reads in
        # flight, sized to the read-ahead depth); copies between memories on threads of their
        # own, so that a block's copy to the device never queues behind the optimizer's or the
        # prefetcher's disk reads.
        self._nvme = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"tierzero-io-r{rank}")
        self._copier = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"tierzero-copy-r{rank}")
        # With asynchronous copies, a move whose last copy is queued commits once the copy's
        # event completes, and a write-back starts once the copy into its source landed: these
        # threads wait for the events, so that no worker above sleeps on a copy stream. A worker
        # that did held an NVMe read slot idle: on the CPU's stream stand-in (1.3 B model, 4
        # workers) the NVMe workers slept 7.2 s in 57 waits over 3 steps.
        self._waiter = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"tierzero-land-r{rank}")

    def submit(self, plan: PlanT, src: Tier, dst: Tier, body: Body[PlanT], commit: Commit[PlanT], *,
               key: Tier) -> None:
        """Run `body(plan)` on a worker, then `commit(plan, outcome)` under the lock."""
        legs: list[Leg] = []
        submitted = time.perf_counter()
        pool = self._nvme if Tier.NVME in (src, dst) else self._copier
        future: cf.Future[None] = cf.Future()  # done at the commit, which a waiter may make
        source = plan.copy.event if isinstance(plan, WritebackPlan) else DONE
        if source.query():
            pool.submit(self._run_body, plan, body, commit, legs, submitted, future)
        else:  # the copy into the source is still queued: a waiter starts the body once it landed
            self._run_on(self._waiter, self._start_once_landed, source, pool, plan, body, commit, legs, submitted,
                         future)
        issued = plan.issued if isinstance(plan, FetchPlan) else None
        self.table.add(key, Move(plan.handle, src, dst, plan.handle.nbytes, future, submitted, legs, issued))

    def close(self) -> None:
        """Join the workers (moves handed on after this run on the thread handing them)."""
        self._nvme.shutdown(wait=True)
        self._copier.shutdown(wait=True)
        self._waiter.shutdown(wait=True)

    @staticmethod
    def _run_on(pool: cf.ThreadPoolExecutor, fn: Callable[..., None], *args: object) -> None:
        """Run `fn(*args)` on `pool`, or here once the pool is shut down (close())."""
        try:
            pool.submit(fn, *args)
        except RuntimeError:
            fn(*args)

    def _start_once_landed(self, event: CopyEvent, pool: cf.ThreadPoolExecutor, *args: object) -> None:
        """(On a waiter) submit a move's body to `pool` once `event` completed; an error of the
        copy is left for the body's own wait to raise."""
        with contextlib.suppress(Exception):
            event.synchronize()
        self._run_on(pool, self._run_body, *args)

    def _run_body(self, plan: PlanT, body: Body[PlanT], commit: Commit[PlanT], legs: list[Leg], submitted: float,
                  future: cf.Future[None]) -> None:
        outcome: Outcome
        legs.append(Leg("queued", submitted, time.perf_counter()))
        try:
            outcome = body(plan, self.io)
        except BaseException as e:
            outcome = Failed(e)
        if isinstance(outcome, Done) and outcome.landing is not None and not outcome.event.query():
            self._run_on(self._waiter, self._commit_once_landed, plan, outcome, commit, legs, future)
        else:
            self._commit_once_landed(plan, outcome, commit, legs, future)

    def _commit_once_landed(self, plan: PlanT, outcome: Outcome, commit: Commit[PlanT], legs: list[Leg],
                            future: cf.Future[None]) -> None:
        """Once the body's last copy ran (a waiter waits for it), commit the move under the lock."""
        if isinstance(outcome, Done):
            outcome = _landed(outcome)
        if isinstance(outcome, Done):
            legs.extend(outcome.legs())
        error = outcome.error if isinstance(outcome, Failed) else None
        with self.cond:
            try:
                commit(plan, outcome)
            except BaseException as e:
                error = error or e
            finally:  # waiters wake even if the commit itself failed
                self.cond.notify_all()
                if isinstance(plan, FetchPlan) and not plan.issued.done():  # not issued early: now
                    if isinstance(outcome, Failed):
                        plan.issued.set_exception(outcome.error)
                    else:
                        plan.issued.set_result(DONE)
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(None)


def _landed(done: Done) -> Outcome:
    """`done` once its last copy landed (its span then ends), or Failed if that copy failed."""
    if done.landing is None:
        return done
    try:
        done.event.synchronize()
    except BaseException as e:
        return Failed(e)
    landing = done.landing
    done.spans.append(Span(landing.src, landing.dst, landing.start, time.perf_counter()))
    return done

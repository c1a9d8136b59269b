"""Where placed tensors are: the state machine of their cached copies (records.py).

`ResidencyTable` holds every `TensorRecord` and carries out each call on the cached copies
(prefetch, acquire, release, discard, drop, flush) in one method: under the lock, its checks,
its waits for room or moves (waiting.py) and its transitions; `Homes` (homes.py) does the same
for the calls on the home copies (register, unregister, relabel, store, read). Their transition
methods are the only code that changes residency or a copy; everyone else reads the
`residency`, `pins` and `in_flight` views that `PlacementManager.record(handle)` returns.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections import OrderedDict
from typing import Callable, Literal, Mapping, Sequence, TypeVar

import torch

from tierzero.config import Tier
from tierzero.placement.eviction import Room, Shortfall
from tierzero.placement.handles import TensorHandle
from tierzero.placement.executor import MoveExecutor, MoveTable
from tierzero.placement.moves import Done, Outcome, stall_sources
from tierzero.placement.plans import FetchPlan, MoveIO, WritebackPlan, run_fetch, run_writeback
from tierzero.placement.records import Content, Copy, Residency, TensorRecord
from tierzero.placement.storage.nvme import SwapSpace
from tierzero.placement.storage.streams import CopyEvent, CopyStreams
from tierzero.placement.telemetry import Telemetry
from tierzero.placement.storage.tier_store import Buffer, TierStore, as_memory
from tierzero.placement.storage.tiers import HostPool
from tierzero.placement.waiting import Waits

MOVING = (Residency.FETCHING, Residency.WRITING_BACK)
T = TypeVar("T")


class CopyStates:
    """The records of the placed tensors and the state machine of their copies.

    Its transition methods are the only writers of residency and copies (with Homes' for the
    homes: to_home, forget, and store's overwrite of every copy); each writes the residency it
    moves to as its last line. Moves run on the
    executor's workers (plans.py) and commit here under `cond`, which guards everything here
    and in `room`; every commit notifies waiters.

        start_fetch        ABSENT -> FETCHING           a copy toward a tier, submitted
        install_blank      ABSENT -> RESIDENT           an uninitialised copy (overwrite)
        _finish_fetch      FETCHING -> RESIDENT         committed (-> ABSENT: failed or stale)
        start_writeback    RESIDENT -> WRITING_BACK     a dirty release, submitted
        _finish_writeback  WRITING_BACK -> RESIDENT     committed (-> ABSENT: stale, unpinned)
        release            RESIDENT -> WRITING_BACK     a dirty release (lazy: content DIRTY)
        free               RESIDENT -> ABSENT           evicted, dropped, or stale and unpinned
    and in Homes: to_home (unregistered -> HOME), forget (every tier -> ABSENT). A copy's
    content (records.Content), pins and move change only here too.
    """

    def __init__(self, stores: Mapping[Tier, TierStore], streams: CopyStreams, pool: HostPool,
                 swap: SwapSpace | None, telemetry: Telemetry, *, workers: int, rank: int) -> None:
        self.cond = threading.Condition(threading.RLock())
        """Guards every record, copy and move, and the room; every commit notifies its waiters."""
        self.stores = stores
        self.room = Room(stores, self, self.cond)
        self.errors: list[BaseException] = []
        """Errors of writes to homes since the last flush()."""
        self.index: dict[TensorHandle, TensorRecord] = {}
        """Every record, in registration order (Homes adds and removes them)."""
        self.names: dict[str, TensorHandle] = {}
        self.recency: OrderedDict[tuple[TensorHandle, Tier], None] = OrderedDict()
        """The cached copies, least recently used first (Room evicts in this order, by policy)."""
        self.streams = streams
        self.pool = pool
        self.telemetry = telemetry
        self.io = MoveIO(streams, swap)
        self.executor = MoveExecutor(self.cond, self.io, workers=workers, rank=rank)
        self.moves: MoveTable = self.executor.table

    def start_fetch(self, rec: TensorRecord, tier: Tier, speculative: bool) -> Literal[True] | Shortfall:
        """ABSENT -> FETCHING if there is room now: the source chosen, the buffers reserved, the
        copy submitted."""
        _expect(rec, tier, Residency.ABSENT)
        h, src = rec.handle, rec.home
        host = rec._copies.get(Tier.HOST)
        if tier is Tier.DEVICE and h.home is Tier.NVME and host is not None and host.content is not Content.STALE:
            src = Tier.HOST  # a cached host copy saves the NVMe read and the staging buffer
        if src is rec.home:
            check_home(rec)
        bufs = self.room.take([(tier, h.nbytes)] + staging_needs(src, tier, h.nbytes), h, speculative=speculative)
        if isinstance(bufs, Shortfall):
            return bufs
        source = rec._copies[src]
        source_fetch = source.move
        if source_fetch is not None and source_fetch.dst is not src:
            source_fetch = None  # the source's own write-back: it reads what this fetch reads
        plan = FetchPlan(h, src, tier, source, Copy(bufs[0], self.stores[tier].view(bufs[0], h)),
                         as_memory(bufs[1]) if len(bufs) > 1 else None,
                         self.streams.compute_ready() if src is Tier.DEVICE else source.event,
                         tuple(m.future for m in rec.in_flight if m.dst is src),  # not the home's write
                         source_fetch.future if source_fetch is not None else None, cf.Future())
        source.pins += 1  # keeps the source from being evicted while the move reads it
        source.used = True  # a prefetched copy that a move reads has served its read
        rec._copies[tier] = plan.copy
        self.recency[(h, tier)] = None
        plan.copy.move = self.executor.submit(plan, src, tier, run_fetch, self._finish_fetch, key=tier)
        rec._residency[tier] = Residency.FETCHING
        return True

    def install_blank(self, rec: TensorRecord, tier: Tier, buf: Buffer) -> None:
        """ABSENT -> RESIDENT: an uninitialised copy in the reserved `buf`, for a caller that
        overwrites it whole and releases it dirty (acquire(overwrite=True)); no move. Stale
        until then: never a fetch's source, and dropped if released clean (the caller failed)."""
        _expect(rec, tier, Residency.ABSENT)
        assert tier is not rec.home, rec
        rec._copies[tier] = Copy(buf, self.stores[tier].view(buf, rec.handle), Content.STALE)
        self.recency[(rec.handle, tier)] = None
        rec._residency[tier] = Residency.RESIDENT

    def _finish_fetch(self, plan: FetchPlan, outcome: Outcome) -> None:
        """FETCHING -> RESIDENT, or -> ABSENT when the copy failed or went stale."""
        rec = self.index[plan.handle]
        self.moves.pop(plan.handle, plan.dst)
        plan.copy.move = None
        if plan.staging is not None:
            self.pool.free(plan.staging)
        self.unpin(rec, plan.src, plan.source)
        if not isinstance(outcome, Done) or (plan.copy.content is Content.STALE and plan.copy.pins == 0):
            self.free(plan.handle, plan.dst)
            return
        _record_spans(self.telemetry, plan.handle, outcome)
        plan.copy.event = outcome.event
        rec._residency[plan.dst] = Residency.RESIDENT

    def start_writeback(self, rec: TensorRecord, tier: Tier, staging: torch.Tensor | None) -> None:
        """RESIDENT -> WRITING_BACK: submit the copy of this cached copy to the home tier (through
        the reserved host `staging` buffer for device -> NVMe)."""
        _expect(rec, tier, Residency.RESIDENT)
        h = rec.handle
        rec._copies[tier].content = Content.CURRENT  # this write takes its contents home
        plan = WritebackPlan(h, tier, rec._copies[tier], rec._copies[h.home], staging,
                             self.streams.compute_ready() if tier is Tier.DEVICE else None,
                             tuple(m.future for m in rec.in_flight))
        self.invalidate(rec, keep=tier)
        plan.copy.move = self.executor.submit(plan, tier, h.home, run_writeback, self._finish_writeback, key=tier)
        rec._residency[tier] = Residency.WRITING_BACK

    def _finish_writeback(self, plan: WritebackPlan, outcome: Outcome) -> None:
        """WRITING_BACK -> RESIDENT (or ABSENT when it went stale meanwhile and is unpinned)."""
        rec = self.index[plan.handle]
        self.moves.pop(plan.handle, plan.src)
        plan.copy.move = None
        if plan.staging is not None:
            self.pool.free(plan.staging)
        self.commit_home(plan.handle, outcome)
        if plan.copy.content is Content.STALE and plan.copy.pins == 0:
            self.free(plan.handle, plan.src)
            return
        rec._residency[plan.src] = Residency.RESIDENT

    def free(self, h: TensorHandle, tier: Tier) -> None:
        """RESIDENT / failed FETCHING -> ABSENT: free the cached copy's bytes."""
        rec = self.index[h]
        assert tier is not h.home and rec._copies[tier].move is None, (rec, tier)
        del self.recency[(h, tier)]
        copy = rec._copies.pop(tier)
        copy.event.synchronize()  # the last write into it has landed before its memory goes
        self.stores[tier].free(copy.buffer)
        rec._residency[tier] = Residency.ABSENT

    def write_back(self, h: TensorHandle, tier: Tier) -> bool:
        """Start writing the copy on `tier` home if it is dirty, unpinned and resident; whether
        it started (lazy releases leave dirty copies: room, drop() and flush() take them home)."""
        rec = self.index[h]
        copy = rec._copies.get(tier)
        if (copy is None or copy.content is not Content.DIRTY or copy.pins
                or rec._residency[tier] is not Residency.RESIDENT):
            return False
        self.start_writeback(rec, tier, None)
        return True

    def write_back_dirty(self) -> None:
        """`write_back` every cached copy of every tensor (flush())."""
        for rec in self.index.values():
            for tier in [t for t in rec._copies if t is not rec.home]:
                self.write_back(rec.handle, tier)

    def commit_home(self, h: TensorHandle, outcome: Outcome) -> None:
        """A write to the home finished: its legs go to telemetry, its error to the next flush()
        and to the record (reads of the home refuse until the next write succeeds)."""
        rec = self.index[h]
        if isinstance(outcome, Done):
            _record_spans(self.telemetry, h, outcome)
            rec._home_error = None
        else:
            self.errors.append(outcome.error)
            rec._home_error = outcome.error

    def release(self, rec: TensorRecord, tier: Tier, *, dirty: bool, lazy: bool, staging: torch.Tensor | None,
                written: CopyEvent | None) -> None:
        """An acquire's pin given back, the copy now the most recently used; a dirty cached copy
        RESIDENT -> WRITING_BACK (through `staging` for device -> NVMe), or with `lazy` only
        DIRTY; a dirty home invalidates the cached copies. `written`: the copy's last write,
        still in flight, which its readers and its free wait for."""
        copy = rec._copies[tier]
        me = threading.get_ident()
        copy.holders.remove(me if me in copy.holders else copy.holders[0])  # released by another thread
        self.touch(rec.handle, tier)
        if written is not None:
            copy.event = written
        if dirty and tier is not rec.home:
            copy.pins -= 1
            if lazy:
                copy.content = Content.DIRTY
                self.invalidate(rec, keep=tier)
            else:
                self.start_writeback(rec, tier, staging)
        else:
            self.unpin(rec, tier, copy)
            if dirty:
                self.invalidate(rec, keep=tier)

    def pin(self, rec: TensorRecord, tier: Tier) -> Copy:
        copy = rec._copies[tier]
        copy.pins += 1
        copy.holders.append(threading.get_ident())
        copy.used = True
        self.touch(rec.handle, tier)
        return copy

    def touch(self, h: TensorHandle, tier: Tier) -> None:
        """The copy on `tier` is now the most recently used (a home is in no order)."""
        if tier is not h.home:
            self.recency.move_to_end((h, tier))

    def invalidate(self, rec: TensorRecord, *, keep: Tier) -> None:
        """The copy on `keep` was written: other cached copies hold old data."""
        for tier in [t for t in rec._copies if t is not keep and t is not rec.home]:
            if rec._residency[tier] is Residency.RESIDENT and rec._copies[tier].pins == 0:
                self.free(rec.handle, tier)
            else:
                rec._copies[tier].content = Content.STALE

    def unpin(self, rec: TensorRecord, tier: Tier, copy: Copy) -> None:
        copy.pins -= 1
        if (rec._copies.get(tier) is copy and copy.content is Content.STALE and copy.pins == 0
                and rec._residency[tier] is Residency.RESIDENT):
            self.free(rec.handle, tier)

    def __repr__(self) -> str:
        return f"CopyStates(tensors={len(self.index)}, in_flight={len(self.moves)}, {self.room!r})"


class ResidencyTable:
    """The calls on placed tensors' cached copies: prefetch, acquire, release, discard, drop.

    Each call looks its records up, checks (open, registered, its arguments against the
    state), waits under the lock for room or moves (waiting.py) and changes the copies only
    through the transitions of `states` (CopyStates). Homes (homes.py) makes the calls on the
    home copies the same way.
    """

    def __init__(self, states: CopyStates, *, timeout_s: float, stuck_after_s: float) -> None:
        self.states = states
        self.cond = states.cond
        self.room = states.room
        self.index = states.index
        self.stores = states.stores
        self.streams = states.streams
        self.telemetry = states.telemetry
        self.scratch: dict[int, tuple[Tier, int]] = {}
        """Scratch buffers handed out: data_ptr -> (tier, the thread holding it)."""
        self.waits = Waits(self, timeout_s=timeout_s, stuck_after_s=stuck_after_s)
        self.closed = False
        """Set by PlacementManager.close(): every call and every wait fails."""

    def record_of(self, h: TensorHandle, what: str, tier: Tier | None = None) -> TensorRecord:
        """The record of a registered handle; RuntimeError once closed, TypeError for what is no
        handle, KeyError for one not registered here; with `tier`, a call on its copy there
        (ValueError: no copy lives on NVMe but an NVMe home)."""
        if self.closed:
            raise RuntimeError("PlacementManager is closed")
        rec = self.index.get(h)
        if rec is None:
            if not isinstance(h, TensorHandle):
                raise TypeError(f"{what}: expected the TensorHandle that register() returned, got {h!r}")
            raise KeyError(f"{what}: no tensor named {h.name!r} is registered (unregistered, or "
                           "registered with another PlacementManager)")
        if tier is Tier.NVME and tier is not h.home:
            raise ValueError(f"{what}({h.name!r}, 'nvme'): only tensors homed on NVMe live there; "
                             "use 'host' or 'device'")
        return rec

    def records_of(self, h: TensorHandle | Sequence[TensorHandle]) -> TensorRecord | tuple[TensorRecord, ...]:
        """PlacementManager.record: the record of `h`, or of each of a sequence of handles."""
        if isinstance(h, TensorHandle):
            return self.record_of(h, "record")
        return tuple(self.record_of(x, "record") for x in h)

    def check(self, subject: TensorRecord | str, what: str = "") -> None:
        """Under the lock: the manager is open, and the tensor still registered."""
        if self.closed:
            raise RuntimeError("PlacementManager is closed")
        if not isinstance(subject, str) and self.index.get(subject.handle) is not subject:
            raise KeyError(f"{what or subject.name}: {subject.name!r} was unregistered by another thread meanwhile")

    def until(self, attempt: Callable[[], T | Shortfall | None], subject: TensorRecord | str, what: str) -> T:
        """Waits.until, each attempt after `check(subject)`."""
        return self.waits.until(lambda: self.check(subject, what) or attempt(), subject, what)

    def prefetch(self, pairs: Sequence[tuple[TensorHandle, Tier]], *, speculative: bool = False) -> bool:
        """PlacementManager.prefetch of each (handle, tier): a copy there or on its way is
        touched; else one is started if there is room now; whether all of them are there, on
        their way or started."""
        every = True
        with self.cond:
            for h, tier in pairs:
                rec = self.record_of(h, "prefetch", tier)
                if tier is rec.home or rec._residency[tier] is not Residency.ABSENT:
                    self.states.touch(h, tier)
                    continue
                started = self.states.start_fetch(rec, tier, speculative)
                if isinstance(started, Shortfall):
                    self.room.check_fits(rec.name, rec.nbytes, tier)  # (ValueError: it never can)
                    every = False
        return every

    def acquire(self, pairs: Sequence[tuple[TensorHandle, Tier]], *, overwrite: bool = False) -> list[torch.Tensor]:
        """PlacementManager.acquire of each (handle, tier) in turn, pinned; on a failure the
        ones taken are released and the error raised."""
        taken: list[tuple[CopyEvent | None, torch.Tensor]] = []
        try:
            for h, tier in pairs:
                rec = self.record_of(h, "acquire", tier)
                taken.append(self._acquire_home(rec) if tier is h.home else self._acquire(rec, tier, overwrite))
        except BaseException:
            self.release(pairs[:len(taken)], dirty=False)
            raise
        self._compute_after(taken)
        return [tensor for _, tensor in taken]

    def _acquire(self, rec: TensorRecord, tier: Tier, overwrite: bool) -> tuple[CopyEvent, torch.Tensor]:
        """A cached copy: there, on its way or started now (with `overwrite` an uninitialised
        one: nothing read), pinned; and the copy that fills it, which compute is to wait for."""
        h = rec.handle
        with torch.profiler.record_function(f"tierzero::acquire {h.name}"):
            asked = time.perf_counter()
            with self.cond:
                self.check(rec)
                hit = rec._residency[tier] is not Residency.ABSENT
                if not hit and isinstance(self._begin_copy(rec, tier, overwrite), Shortfall):  # no room now
                    self.room.check_fits(h.name, h.nbytes, tier)  # (ValueError: it never can)
                    what = f"acquire({h.name!r}, {tier.value!r}{', overwrite=True' if overwrite else ''})"
                    self.until(lambda: self._begin_copy(rec, tier, overwrite), rec, what)
                copy = self.states.pin(rec, tier)
                move = copy.move
            t0 = t1 = time.perf_counter()
            room_s = t0 - asked if t0 - asked > 1e-3 else 0.0  # time spent waiting for room (or another's move)
            sources = {"room": room_s} if room_s else {}
            event, error = copy.event, None
            if move is not None:
                # A fetch toward the device is waited for on the host only until its copy is
                # queued; compute then waits for the copy's event on its own stream.
                waited = move.issued if move.dst is tier and move.issued is not None else move.future
                cf.wait([waited])
                t1 = time.perf_counter()
                for source, s in stall_sources(move.legs, t0, t1).items():
                    sources[source] = sources.get(source, 0.0) + s
                error = waited.exception() if move.dst is tier else None
                if error is None and waited is move.issued:
                    event = move.issued.result()
            self.telemetry.record_acquire(hit, tier, room_s + (t1 - t0), sources)
            if error is not None:
                raise error  # the fetch failed; its copy is gone
            return event, copy.tensor

    def _compute_after(self, waits: Sequence[tuple[CopyEvent | None, torch.Tensor]]) -> None:
        """Order compute after the copies that filled the acquired tensors (on the host, no wait)."""
        self.streams.compute_after(waits)

    def _begin_copy(self, rec: TensorRecord, tier: Tier, overwrite: bool) -> Literal[True] | Shortfall:
        """A copy on `tier` started (a blank one with `overwrite`), or there already (another
        thread started it while this one waited); a Shortfall while there is no room."""
        if rec._residency[tier] is not Residency.ABSENT:
            return True
        if not overwrite:
            return self.states.start_fetch(rec, tier, False)
        bufs = self.room.take([(tier, rec.nbytes)], rec.handle)
        if isinstance(bufs, Shortfall):
            return bufs
        self.states.install_blank(rec, tier, bufs[0])
        return True

    def _acquire_home(self, rec: TensorRecord) -> tuple[CopyEvent, torch.Tensor]:
        h = rec.handle
        if h.home is Tier.NVME:
            raise ValueError(f"acquire({h.name!r}, 'nvme'): NVMe holds bytes, not tensors; "
                             "acquire it on 'host' or 'device'")
        with torch.profiler.record_function(f"tierzero::acquire {h.name}"):
            with self.cond:
                if home_written(rec) is None:
                    self.until(lambda: home_written(rec), rec,
                               f"acquire({h.name!r}) waiting for write-backs to its home")
                check_home(rec)
                copy = self.states.pin(rec, h.home)
            return copy.event, copy.tensor

    def release(self, pairs: Sequence[tuple[TensorHandle, Tier]], *, dirty: bool | Sequence[bool],
                lazy: bool = False, written: CopyEvent | None = None) -> None:
        """PlacementManager.release of each (handle, tier) (`dirty` for all, or one for each);
        every one is released even when an earlier one fails (the first error is raised)."""
        error: BaseException | None = None
        dirties = [dirty] * len(pairs) if isinstance(dirty, bool) else dirty
        for (h, tier), d in zip(pairs, dirties):
            try:
                self._release(self.record_of(h, "release", tier), tier, d, lazy, written)
            except BaseException as e:
                error = error or e
        if error is not None:
            raise error

    def _release(self, rec: TensorRecord, tier: Tier, dirty: bool, lazy: bool, written: CopyEvent | None) -> None:
        """Checked, and once the copy's move and a staging buffer allow it, CopyStates.release:
        a dirty cached copy is written back, or with `lazy` only marked dirty (written back when
        its room is needed, or never if discarded first)."""
        h = rec.handle
        lazy = lazy and dirty and tier is not h.home and not staging_needs(tier, h.home, h.nbytes)
        with self.cond:
            self.check(rec)
            copy = rec._copies.get(tier)
            if copy is None or copy.pins == 0 or not copy.holders:
                raise RuntimeError(f"release({h.name!r}, {tier.value!r}) without a matching acquire()")
            staging = None
            if lazy and _still(rec, tier) is None:  # (a fetch commits after its copy is queued: waited for too)
                self.until(lambda: _still(rec, tier), rec,
                                 f"release({h.name!r}, {tier.value!r}, lazy=True) waiting for its move")
            elif dirty and tier is not h.home:
                # Still pinned while waiting (for an earlier move of this copy to finish, and
                # for a staging buffer), so the dirty copy cannot be evicted meanwhile.
                needs = staging_needs(tier, h.home, h.nbytes)
                take = lambda: None if _still(rec, tier) is None else self.room.take(needs, h)  # noqa: E731
                bufs = take()
                if bufs is None or isinstance(bufs, Shortfall):
                    bufs = self.until(take, rec, f"release({h.name!r}, {tier.value!r}, dirty=True)")
                staging = as_memory(bufs[0]) if bufs else None
            self.states.release(rec, tier, dirty=dirty, lazy=lazy, staging=staging, written=written)
            self.cond.notify_all()

    def discard(self, rec: TensorRecord) -> None:
        """The contents are no longer needed (a gradient set to None): every cached copy ->
        ABSENT unwritten, dirty ones too; a pinned or moving copy is dropped when free. The
        home keeps whatever it held last."""
        with self.cond:
            self.check(rec)
            self.states.invalidate(rec, keep=rec.home)  # (the home's contents stay)
            self.cond.notify_all()

    def drop(self, rec: TensorRecord, tier: Tier) -> None:
        """PlacementManager.drop: free an unpinned cached copy now, after its write-back."""
        h = rec.handle
        with self.cond:
            self.until(lambda: self._settled_clean(rec, tier), rec, f"drop({h.name!r}) waiting for its move")
            if rec._residency[tier] is Residency.ABSENT:
                return
            if rec._copies[tier].pins:
                raise RuntimeError(f"drop({h.name!r}, {tier.value!r}): the copy is pinned by "
                                   f"{rec._copies[tier].pins} acquire(s); release it first")
            self.states.free(h, tier)
            self.cond.notify_all()

    def _settled_clean(self, rec: TensorRecord, tier: Tier) -> Literal[True] | None:
        """True when no move is on the copy and nothing unwritten is in it (None while not);
        starts the write-back of an unpinned dirty copy (the caller waits for it)."""
        self.states.write_back(rec.handle, tier)
        copy = rec._copies.get(tier)
        return None if rec._residency[tier] in MOVING or (copy is not None and copy.content is Content.DIRTY) else True

    def close(self) -> None:
        """Join the workers: every move committed (Homes.close then forgets every record)."""
        self.states.executor.close()

    def in_flight(self) -> int:
        """Moves in flight, of every tensor."""
        return len(self.states.moves)

    def __repr__(self) -> str:
        return f"ResidencyTable(tensors={len(self.index)}, {self.states!r})"


def staging_needs(src: Tier | None, dst: Tier, nbytes: int) -> list[tuple[Tier, int]]:
    """The host staging buffer that `nbytes` moved from `src` (None: a caller's tensor) to `dst`
    pass through, as a reservation need, or none: NVMe IO needs page-aligned host bytes, and
    only a cached host copy already is."""
    return [(Tier.HOST, nbytes)] if Tier.NVME in (src, dst) and Tier.HOST not in (src, dst) else []


# What a call checks and the conditions its waits end on (None while the wait goes on).

def check_home(rec: TensorRecord) -> None:
    """Refuse to read a home whose last write failed (its error also went to flush())."""
    if rec._home_error is not None:
        raise RuntimeError(
            f"tensor {rec.name!r}: its last write to the {rec.home.value} tier failed "
            f"({rec._home_error}); the values there are lost: store new values (or load a "
            "checkpoint) before reading it") from rec._home_error


def home_written(rec: TensorRecord) -> Literal[True] | None:
    """No write toward the tensor's home in flight."""
    return None if any(c.move is not None and c.move.dst is rec.home for c in rec._copies.values()) else True


def _still(rec: TensorRecord, tier: Tier) -> Literal[True] | None:
    """No fetch filling, nor write-back reading, the copy on `tier`."""
    return True if rec._residency[tier] not in MOVING else None


def _expect(rec: TensorRecord, tier: Tier, *states: Residency) -> None:
    assert rec._residency[tier] in states, (
        f"{rec.name} on {tier}: expected {[s.value for s in states]}, is {rec._residency[tier].value}")


def _record_spans(telemetry: Telemetry, h: TensorHandle, done: Done) -> None:
    for span in done.spans:
        telemetry.record_move(h.name, span.src, span.dst, h.nbytes, span.start, span.end)

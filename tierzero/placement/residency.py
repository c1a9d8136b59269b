"""Where placed tensors are: `Residency` per tier, the records, and the only writers of both.

A `TensorRecord` is one tensor's state: its handle, its copies (one per tier it is on) and the
residency of each tier. `ResidencyTable` holds every record and the transition methods, the
only code that changes residency, each as its last step:

    to_home            (unregistered) -> HOME       register: the data written to its home
                                                    (or kept dirty on HOST: RESIDENT)
    start_fetch        ABSENT -> FETCHING           a copy toward a tier, submitted to a worker
    _finish_fetch      FETCHING -> RESIDENT         committed (-> ABSENT: failed or went stale)
    start_writeback    RESIDENT -> WRITING_BACK     a dirty release, submitted to a worker
    _finish_writeback  WRITING_BACK -> RESIDENT     committed (-> ABSENT: went stale, unpinned)
    drop               RESIDENT -> ABSENT           evicted, dropped, or stale and unpinned
    forget             every tier -> ABSENT         unregister and close (the handle forgotten)

Everyone else reads the `residency`, `pins` and `in_flight` views that
`PlacementManager.record(handle)` returns.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
import time
from enum import Enum
from types import MappingProxyType
from typing import Callable, Collection, Literal, Mapping, TypeVar

import torch

from io_engine import aligned_empty
from tierzero.config import Tier
from tierzero.placement.cow_home import CheckpointHome
from tierzero.placement.eviction import Room, Shortfall
from tierzero.placement.handles import Kind, TensorHandle
from tierzero.placement.moves import (Copy, Done, Failed, FetchPlan, Leg, Move, MoveIO, MoveTable, Outcome, Span,
                                      StorePlan, WritebackPlan, run_fetch, run_store, run_writeback,
                                      staging_needs)
from tierzero.placement.nvme import SwapSpace
from tierzero.placement.streams import DONE, CopyEvent, CopyStreams
from tierzero.placement.telemetry import Telemetry
from tierzero.placement.tier_store import Buffer, TierStore, flat, region, typed
from tierzero.placement.tiers import HostPool

_P = TypeVar("_P", FetchPlan, WritebackPlan, StorePlan)


class Residency(Enum):
    """State of one tensor on one tier, and what it costs there.

    HOME          the tensor's home copy: its bytes are reserved on the tier from register to
                  unregister (or close).
    ABSENT        no copy on this tier: costs nothing.
    FETCHING      a copy toward this tier is in flight: its bytes are reserved here (plus a host
                  staging buffer while an NVMe read feeds a device copy).
    RESIDENT      a valid cached copy: its bytes are reserved; evictable when unpinned.
    WRITING_BACK  a cached copy whose contents are being written to the home tier: bytes reserved
                  (plus a host staging buffer for device -> NVMe); not evictable until done.
    """

    HOME = "home"
    ABSENT = "absent"
    FETCHING = "fetching"
    RESIDENT = "resident"
    WRITING_BACK = "writing_back"


class TensorRecord:
    """A registered tensor: its handle (name, shape, dtype, bytes, home tier) and where it is now.

    `residency` (per tier), `pins(tier)` and `in_flight` are read-only views; only
    PlacementManager's transition methods change them.
    """

    def __init__(self, handle: TensorHandle, moves: MoveTable) -> None:
        self.handle = handle
        self.nbytes = handle.nbytes
        self._residency = {t: Residency.ABSENT for t in Tier}
        self._view = MappingProxyType(self._residency)
        self._copies: dict[Tier, Copy] = {}
        self._moves = moves
        self._home_error: BaseException | None = None
        """The last write to the home failed: its contents there are lost until the next write."""

    @property
    def name(self) -> str:
        return self.handle.name

    @property
    def shape(self) -> torch.Size:
        return self.handle.shape

    @property
    def dtype(self) -> torch.dtype:
        return self.handle.dtype

    @property
    def home(self) -> Tier:
        return self.handle.home

    @property
    def residency(self) -> Mapping[Tier, Residency]:
        return self._view

    @property
    def in_flight(self) -> tuple[Move, ...]:
        return self._moves.for_tensor(self.handle)

    def pins(self, tier: Tier | str) -> int:
        copy = self._copies.get(Tier.parse(tier))
        return copy.pins if copy is not None else 0

    def __repr__(self) -> str:
        where = ", ".join(f"{t.value}: {r.value}" for t, r in self._residency.items() if r is not Residency.ABSENT)
        return (f"TensorRecord({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"nbytes={self.nbytes}, home={self.home.value}, {{{where}}})")


def assert_in_states(rec: TensorRecord, tier: Tier, *states: Residency) -> None:
    assert rec._residency[tier] in states, (
        f"{rec.name} on {tier}: expected {[s.value for s in states]}, is {rec._residency[tier].value}")


class ResidencyTable:
    """Every placed tensor's record, and the transition methods: the only writers of residency.

    PlacementManager validates calls and waits for room; a transition here gets the buffers it
    needs already reserved, changes the copies, starts or commits a move, and writes the
    residency it moves to as its last line. Moves run on worker threads (the bodies in moves.py,
    without the lock) and commit here under `cond`, which guards everything in this table and
    in `room`; every commit notifies waiters.
    """

    def __init__(self, stores: Mapping[Tier, TierStore], streams: CopyStreams, pool: HostPool,
                 swap: SwapSpace | None, telemetry: Telemetry, *, workers: int, rank: int) -> None:
        self.cond = threading.Condition(threading.RLock())
        self.stores = stores
        self.room = Room(stores, self._evictable, self.drop, self._clean,
                         lambda h, t: self._records[h]._copies[t].buffer,
                         lambda h, t: not self._records[h]._copies[t].used)
        self.moves = MoveTable()
        self.errors: list[BaseException] = []
        """Errors of writes to homes since the last flush()."""
        self._records: dict[TensorHandle, TensorRecord] = {}  # registration order
        self._names: dict[str, TensorHandle] = {}
        self._streams = streams
        self._pool = pool
        self._telemetry = telemetry
        self._io = MoveIO(streams, swap)
        # Workers run copies and IO so callers never block on them; sized to keep the NVMe
        # read-ahead depth in flight while earlier blocks copy to the device.
        # Moves that read or write the swap files run on `workers` threads (the NVMe reads in
        # flight); copies between memories on threads of their own, so that a block's copy to the
        # device never queues behind the optimizer's or the prefetcher's disk reads.
        self._executor = cf.ThreadPoolExecutor(max_workers=workers, thread_name_prefix=f"tierzero-io-r{rank}")
        self._copier = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"tierzero-copy-r{rank}")
        # With asynchronous copies, a move whose last copy is queued commits once the copy's
        # event completes, and a write-back starts once the copy into its source landed: these
        # threads wait for the events, so that no worker above sleeps on a copy stream. A worker
        # that did held an NVMe read slot idle: on the CPU's stream stand-in (1.3 B model, 4
        # workers) the NVMe workers slept 7.2 s in 57 waits over 3 steps.
        self._waiter = cf.ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"tierzero-land-r{rank}")

    def get(self, handle: TensorHandle) -> TensorRecord | None:
        return self._records.get(handle)

    def named(self, name: str) -> bool:
        return name in self._names

    def records(self) -> tuple[TensorRecord, ...]:
        return tuple(self._records.values())

    def __len__(self) -> int:
        return len(self._records)

    def check_home(self, rec: TensorRecord) -> None:
        """Refuse to read a home whose last write failed (its error also went to flush())."""
        if rec._home_error is not None:
            raise RuntimeError(
                f"tensor {rec.name!r}: its last write to the {rec.home.value} tier failed "
                f"({rec._home_error}); the values there are lost: store new values (or load a "
                "checkpoint) before reading it") from rec._home_error

    def read_home(self, rec: TensorRecord, out: torch.Tensor | None) -> torch.Tensor:
        """The home's contents on the CPU: fresh, or in `out` (flat uint8, page-aligned)."""
        dirty = next((c for c in rec._copies.values() if c.dirty), None)
        if dirty is not None:  # newer than the home
            dirty.event.synchronize()
            return dirty.tensor.detach().to("cpu", copy=True) if out is None else typed(out, rec.handle).copy_(dirty.tensor)
        self.check_home(rec)
        h, home = rec.handle, rec._copies[rec.home]
        home.event.synchronize()
        if home.tensor is not None:
            if out is None:
                return home.tensor.detach().to("cpu", copy=True)
            return typed(out, h).copy_(home.tensor)
        where = region(home.buffer)
        buf = torch.from_numpy(aligned_empty(where.length)) if out is None else out
        self._io.nvme().read(where, buf.numpy(), h.name, h.kind.traffic)
        return typed(buf, h)

    def pin(self, rec: TensorRecord, tier: Tier) -> Copy:
        copy = rec._copies[tier]
        copy.pins += 1
        copy.holders.append(threading.get_ident())
        copy.used = True
        self.room.touch(rec.handle, tier)
        return copy

    def pinned_by_others(self, tier: Tier, threads: Collection[int]) -> bool:
        """Whether a cached copy on `tier` is pinned by a thread not in `threads`, or by a move
        (which will unpin it when it ends)."""
        for rec in self._records.values():
            copy = rec._copies.get(tier) if tier is not rec.home else None
            if copy is not None and copy.pins and (copy.pins != len(copy.holders) or not set(copy.holders) <= threads):
                return True
        return False

    def home_buffer(self, rec: TensorRecord) -> Buffer:
        """What holds the tensor's home bytes (a SwapRegion for an NVMe home)."""
        return rec._copies[rec.home].buffer

    def releasing(self, rec: TensorRecord, tier: Tier) -> Copy:
        """A release begins: the copy on `tier`, pinned by an acquire() (RuntimeError otherwise),
        now the most recently used."""
        copy = rec._copies.get(tier)
        if copy is None or copy.pins == 0 or not copy.holders:
            raise RuntimeError(f"release({rec.name!r}, {tier.value!r}) without a matching acquire()")
        me = threading.get_ident()
        copy.holders.remove(me if me in copy.holders else copy.holders[0])  # released by another thread
        self.room.touch(rec.handle, tier)
        return copy

    def release(self, rec: TensorRecord, tier: Tier, *, dirty: bool, staging: torch.Tensor | None,
                lazy: bool = False, written: CopyEvent | None = None) -> None:
        """Unpin (after releasing()); a dirty cached copy is written back (through `staging` for
        device -> NVMe), or with `lazy` only marked dirty (written back when its room is needed,
        or never if discarded first); a dirty home invalidates the cached copies. `written`:
        the copy's last write, still in flight, which its readers and its free wait for."""
        copy = rec._copies[tier]
        if written is not None:
            copy.event = written
        if dirty and lazy:
            assert tier is not rec.home and staging is None, (rec, tier)
            copy.pins -= 1
            copy.stale = False
            copy.dirty = True
            self._invalidate_cached(rec, keep=tier)
            return
        if dirty and tier is not rec.home:
            copy.pins -= 1
            copy.stale = False
            self.start_writeback(rec, tier, staging)
            return
        self._unpin(rec, tier, copy)
        if dirty:
            self._invalidate_cached(rec, keep=tier)

    def store(self, rec: TensorRecord, data: torch.Tensor, staging: torch.Tensor | None) -> None:
        """Overwrite the home (an NVMe home asynchronously, from `staging`) and the cached copies:
        an unpinned device copy is dropped (the next fetch brings the new values on the copy
        stream); a device home or pinned device copy is written from `data` on the device, else
        through `staging` on the copy stream (see `store_staging`)."""
        h, home = rec.handle, rec._copies[rec.home]
        if staging is not None:
            typed(staging, h).copy_(data)
        pending = []
        try:
            for tier, copy in list(rec._copies.items()):
                if tier is Tier.NVME:
                    continue
                if tier is not rec.home and tier is Tier.DEVICE and copy.pins == 0:
                    self.drop(h, tier)
                    continue
                copy.event.synchronize()  # a copy still landing in it would overwrite the new values
                if tier is Tier.DEVICE and not self._streams.is_device(data) and staging is not None:
                    copy.event = self._streams.copy(copy.tensor, typed(staging, h))
                    pending.append(copy.event)
                else:
                    copy.tensor.copy_(data)
                    self._streams.compute_wait(None, copy.tensor)  # written on the compute stream
                copy.stale = False
                copy.dirty = False
            for event in pending:  # the staging buffer is freed or written to NVMe next
                event.synchronize()
        except BaseException:
            if staging is not None:
                self._pool.free(staging)
            raise
        if home.tensor is None:
            self._submit(StorePlan(h, home, flat(staging)), Tier.HOST, Tier.NVME, run_store, self._finish_store,
                         key=Tier.NVME)
        else:
            rec._home_error = None
            if staging is not None:
                self._pool.free(staging)

    def store_staging(self, rec: TensorRecord, data: torch.Tensor) -> bool:
        """Whether store() needs a host staging buffer: an NVMe home's write, or a device home
        or pinned device copy written from host data on the copy stream (CUDA's non-blocking
        copies need pinned memory)."""
        if rec.home is Tier.NVME:
            return True
        device = rec._copies.get(Tier.DEVICE)
        return (self._streams.asynchronous and not self._streams.is_device(data) and device is not None
                and (rec.home is Tier.DEVICE or device.pins > 0))

    def plan_fetch(self, rec: TensorRecord, tier: Tier, *, speculative: bool = False) -> FetchPlan | Shortfall:
        """Choose the source of a copy toward `tier` and reserve its buffers."""
        assert_in_states(rec, tier, Residency.ABSENT)
        h, src = rec.handle, rec.home
        host = rec._copies.get(Tier.HOST)
        if tier is Tier.DEVICE and h.home is Tier.NVME and host is not None and not host.stale:
            src = Tier.HOST  # a cached host copy saves the NVMe read and the staging buffer
        if src is rec.home:
            self.check_home(rec)
        needs = [(tier, h.nbytes)] + staging_needs(src, tier, h.nbytes)
        bufs = self.room.take(needs, h, speculative=speculative)
        if isinstance(bufs, Shortfall):
            return bufs
        source_fetch = self.moves.get(h, src)
        if source_fetch is not None and source_fetch.dst is not src:
            source_fetch = None  # the source's own write-back: it reads what this fetch reads
        source = rec._copies[src]
        return FetchPlan(h, src, tier, source, Copy(bufs[0], self.stores[tier].view(bufs[0], h)),
                         flat(bufs[1]) if len(bufs) > 1 else None,
                         self._streams.compute_ready() if src is Tier.DEVICE else source.event,
                         tuple(m.future for m in rec.in_flight if m.dst is src),  # not the home's write
                         source_fetch.future if source_fetch is not None else None, cf.Future())

    def try_fetch(self, rec: TensorRecord, tier: Tier, *, speculative: bool = False) -> Literal[True] | Shortfall:
        """Start a copy toward `tier` if there is room now; True if started or already there or
        on its way (another thread may have started it while the caller waited)."""
        if rec._residency[tier] is not Residency.ABSENT:
            return True
        plan = self.plan_fetch(rec, tier, speculative=speculative)
        if isinstance(plan, Shortfall):
            return plan
        self.start_fetch(rec, plan)
        return True

    def close(self) -> None:
        """Join the workers, then take every tensor to ABSENT (pinned copies too)."""
        self._executor.shutdown(wait=True)
        self._copier.shutdown(wait=True)
        self._waiter.shutdown(wait=True)  # what it hands to the pools now runs on it (`_hand`)
        with self.cond:
            for rec in tuple(self._records.values()):
                self.forget(rec)

    # ---------------------------------------------------------------------- transition methods
    # Each ends by writing the residency it moves to; only these write rec._residency.

    def to_home(self, h: TensorHandle, data: torch.Tensor, buf: Buffer, staging: Buffer | None, *,
                lazy: bool = False, borrowed: CheckpointHome | None = None) -> TensorRecord:
        """(unregistered) -> HOME: write `data` into the reserved home `buf` (an NVMe home through
        the host `staging` buffer, by a worker: its error goes to flush(); with `lazy` the staging
        buffer stays as a dirty cached host copy, HOST -> RESIDENT, and nothing is written yet;
        with `borrowed`, checkpoint bytes equal to `data`, the NVMe home is adopted unwritten,
        nothing copied); nothing for a meta `data`."""
        rec = TensorRecord(h, self.moves)
        staging = None if staging is None else flat(staging)
        home = Copy(buf, self.stores[h.home].view(buf, h))
        try:
            if data.is_meta or borrowed is not None:
                pass  # room reserved, nothing to write (a borrowed home holds the bytes)
            elif home.tensor is not None:
                home.tensor.copy_(data)
                self._streams.compute_wait(None, home.tensor)  # written on the compute stream
            else:
                typed(flat(staging), h).copy_(data)
        except BaseException:
            self.stores[h.home].free(buf)
            if staging is not None:
                self._pool.free(staging)
            raise
        rec._copies[h.home] = home
        self.room.add_home(h)
        self._records[h] = rec
        self._names[h.name] = h
        if borrowed is not None:
            self._io.nvme().adopt(region(buf), borrowed, h.name)
        if staging is not None and lazy:
            rec._copies[Tier.HOST] = Copy(staging, self.stores[Tier.HOST].view(staging, h), used=True,
                                          dirty=True)
            self.room.cached(h, Tier.HOST)
            rec._residency[Tier.HOST] = Residency.RESIDENT
        elif staging is not None:  # the NVMe write runs on a worker, as a store's does
            self._submit(StorePlan(h, home, staging), Tier.HOST, Tier.NVME, run_store, self._finish_store,
                         key=Tier.NVME)
        rec._residency[h.home] = Residency.HOME
        return rec

    def relabel(self, rec: TensorRecord, kind: Kind) -> TensorHandle:
        """The record under a new handle of another kind (only its home: no copy elsewhere)."""
        h = rec.handle
        assert set(rec._copies) == {h.home} and not rec.in_flight, h.name
        new = TensorHandle(h.owner, kind, h.shape, h.dtype, h.home)
        del self._records[h], self._names[h.name]
        rec.handle = self._names[new.name] = new
        self._records[new] = rec
        return new

    def forget(self, rec: TensorRecord) -> None:
        """Every tier -> ABSENT: drop the cached copies, free the home, forget the handle."""
        h = rec.handle
        for tier in [t for t in rec._copies if t is not h.home]:
            self.drop(h, tier)
        assert_in_states(rec, h.home, Residency.HOME)
        home = rec._copies.pop(h.home)
        home.event.synchronize()
        self.stores[h.home].free(home.buffer)
        self.room.remove_home(h)
        del self._records[h], self._names[h.name]
        rec._residency[h.home] = Residency.ABSENT

    def start_fetch(self, rec: TensorRecord, plan: FetchPlan) -> None:
        """ABSENT -> FETCHING: submit the copy into the reserved buffers."""
        assert_in_states(rec, plan.dst, Residency.ABSENT)
        plan.source.pins += 1  # keeps the source from being evicted while the move reads it
        plan.source.used = True  # a prefetched copy that a move reads has served its read
        rec._copies[plan.dst] = plan.copy
        self.room.cached(rec.handle, plan.dst)
        self._submit(plan, plan.src, plan.dst, run_fetch, self._finish_fetch, key=plan.dst)
        rec._residency[plan.dst] = Residency.FETCHING

    def install_blank(self, rec: TensorRecord, tier: Tier, buf: Buffer) -> None:
        """ABSENT -> RESIDENT: an uninitialised copy in the reserved `buf`, for a caller that
        overwrites it whole and releases it dirty (acquire(overwrite=True)); no move. Stale
        until then: never a fetch's source, and dropped if released clean (the caller failed)."""
        assert_in_states(rec, tier, Residency.ABSENT)
        assert tier is not rec.home, rec
        rec._copies[tier] = Copy(buf, self.stores[tier].view(buf, rec.handle), stale=True)
        self.room.cached(rec.handle, tier)
        rec._residency[tier] = Residency.RESIDENT

    def _finish_fetch(self, plan: FetchPlan, outcome: Outcome) -> None:
        """FETCHING -> RESIDENT, or -> ABSENT when the copy failed or went stale."""
        rec = self._records[plan.handle]
        self.moves.pop(plan.handle, plan.dst)
        if plan.staging is not None:
            self._pool.free(plan.staging)
        self._unpin(rec, plan.src, plan.source)
        if not isinstance(outcome, Done) or (plan.copy.stale and plan.copy.pins == 0):
            self.drop(plan.handle, plan.dst)
            return
        self._record(plan.handle, outcome)
        plan.copy.event = outcome.event
        rec._residency[plan.dst] = Residency.RESIDENT

    def start_writeback(self, rec: TensorRecord, tier: Tier, staging: torch.Tensor | None) -> None:
        """RESIDENT -> WRITING_BACK: submit the copy of this cached copy to the home tier (through
        the reserved host `staging` buffer for device -> NVMe)."""
        assert_in_states(rec, tier, Residency.RESIDENT)
        h = rec.handle
        rec._copies[tier].dirty = False  # this write takes its contents home
        plan = WritebackPlan(h, tier, rec._copies[tier], rec._copies[h.home], staging,
                             self._streams.compute_ready() if tier is Tier.DEVICE else None,
                             tuple(m.future for m in rec.in_flight))
        self._invalidate_cached(rec, keep=tier)
        self._submit(plan, tier, h.home, run_writeback, self._finish_writeback, key=tier)
        rec._residency[tier] = Residency.WRITING_BACK

    def _finish_writeback(self, plan: WritebackPlan, outcome: Outcome) -> None:
        """WRITING_BACK -> RESIDENT (or ABSENT when it went stale meanwhile and is unpinned)."""
        rec = self._records[plan.handle]
        self.moves.pop(plan.handle, plan.src)
        if plan.staging is not None:
            self._pool.free(plan.staging)
        self._commit(plan.handle, outcome)
        if plan.copy.stale and plan.copy.pins == 0:
            self.drop(plan.handle, plan.src)
            return
        rec._residency[plan.src] = Residency.RESIDENT

    def discard(self, rec: TensorRecord) -> None:
        """The contents are no longer needed (a gradient set to None): every cached copy ->
        ABSENT unwritten, dirty ones too; a pinned or moving copy is dropped when free. The
        home keeps whatever it held last."""
        for tier in [t for t in rec._copies if t is not rec.home]:
            copy = rec._copies[tier]
            copy.dirty = False
            if rec._residency[tier] is Residency.RESIDENT and copy.pins == 0:
                self.drop(rec.handle, tier)
            else:
                copy.stale = True

    def drop(self, h: TensorHandle, tier: Tier) -> None:
        """RESIDENT / failed FETCHING -> ABSENT: free the cached copy's bytes."""
        rec = self._records[h]
        assert tier is not h.home and self.moves.get(h, tier) is None, (rec, tier)
        self.room.forget(h, tier)
        copy = rec._copies.pop(tier)
        copy.event.synchronize()  # the last write into it has landed before its memory goes
        self.stores[tier].free(copy.buffer)
        rec._residency[tier] = Residency.ABSENT

    # ----------------------------------------------------------------------------- moves

    def _submit(self, plan: _P, src: Tier, dst: Tier, body: Callable[[_P, MoveIO], Done],
                finish: Callable[[_P, Outcome], None], *, key: Tier) -> None:
        """Run `body(plan)` on a worker, then `finish(plan, outcome)` under the lock; the move is
        in the table, under (tensor, key), until then."""
        legs: list[Leg] = []
        submitted = time.perf_counter()
        pool = self._executor if Tier.NVME in (src, dst) else self._copier
        future: cf.Future[None] = cf.Future()  # done at the commit, which a waiter may make
        source = plan.copy.event if isinstance(plan, WritebackPlan) else DONE
        if source.query():
            pool.submit(self._run, plan, body, finish, legs, submitted, future)
        else:  # the copy into the source is still queued: a waiter starts the body once it landed
            self._hand(self._waiter, self._after, source, pool, plan, body, finish, legs, submitted, future)
        issued = plan.issued if isinstance(plan, FetchPlan) else None
        self.moves.add(key, Move(plan.handle, src, dst, plan.handle.nbytes, future, submitted, legs, issued))

    @staticmethod
    def _hand(pool: cf.ThreadPoolExecutor, fn: Callable[..., None], *args: object) -> None:
        """Run `fn(*args)` on `pool`, or here once the pool is shut down (close())."""
        try:
            pool.submit(fn, *args)
        except RuntimeError:
            fn(*args)

    def _after(self, event: CopyEvent, pool: cf.ThreadPoolExecutor, *args: object) -> None:
        """(On a waiter) submit a move's body to `pool` once `event` completed; an error of the
        copy is left for the body's own wait to raise."""
        with contextlib.suppress(Exception):
            event.synchronize()
        self._hand(pool, self._run, *args)

    def _run(self, plan: _P, body: Callable[[_P, MoveIO], Done], finish: Callable[[_P, Outcome], None],
             legs: list[Leg], submitted: float, future: cf.Future[None]) -> None:
        outcome: Outcome
        legs.append(Leg("queued", submitted, time.perf_counter()))
        try:
            outcome = body(plan, self._io)
        except BaseException as e:
            outcome = Failed(e)
        if isinstance(outcome, Done) and outcome.landing is not None and not outcome.event.query():
            self._hand(self._waiter, self._land, plan, outcome, finish, legs, future)
        else:
            self._land(plan, outcome, finish, legs, future)

    def _land(self, plan: _P, outcome: Outcome, finish: Callable[[_P, Outcome], None], legs: list[Leg],
              future: cf.Future[None]) -> None:
        """Once the body's last copy ran (a waiter waits for it), commit the move under the lock."""
        if isinstance(outcome, Done):
            if outcome.landing is not None:
                try:
                    outcome.event.synchronize()
                except BaseException as e:
                    outcome = Failed(e)
                else:
                    landing = outcome.landing
                    outcome.spans.append(Span(landing.src, landing.dst, landing.start, time.perf_counter()))
            if isinstance(outcome, Done):
                legs.extend(outcome.legs())
        error = outcome.error if isinstance(outcome, Failed) else None
        with self.cond:
            try:
                finish(plan, outcome)
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

    def _finish_store(self, plan: StorePlan, outcome: Outcome) -> None:
        self.moves.pop(plan.handle, Tier.NVME)
        self._pool.free(plan.staging)
        self._commit(plan.handle, outcome)

    def _commit(self, h: TensorHandle, outcome: Outcome) -> None:
        """A write to the home finished: its legs go to telemetry, its error to the next flush()
        and to the record (reads of the home refuse until the next write succeeds)."""
        rec = self._records[h]
        if isinstance(outcome, Done):
            self._record(h, outcome)
            rec._home_error = None
        else:
            self.errors.append(outcome.error)
            rec._home_error = outcome.error

    def _record(self, h: TensorHandle, done: Done) -> None:
        for span in done.spans:
            self._telemetry.record_move(h.name, span.src, span.dst, h.nbytes, span.start, span.end)

    # ----------------------------------------------------------------------------- helpers

    def _invalidate_cached(self, rec: TensorRecord, *, keep: Tier) -> None:
        """The copy on `keep` was written: other cached copies hold old data."""
        for tier in [t for t in rec._copies if t is not keep and t is not rec.home]:
            copy = rec._copies[tier]
            if rec._residency[tier] is Residency.RESIDENT and copy.pins == 0:
                self.drop(rec.handle, tier)
            else:
                copy.stale = True

    def _unpin(self, rec: TensorRecord, tier: Tier, copy: Copy) -> None:
        copy.pins -= 1
        if (rec._copies.get(tier) is copy and copy.stale and copy.pins == 0
                and rec._residency[tier] is Residency.RESIDENT):
            self.drop(rec.handle, tier)

    def _evictable(self, h: TensorHandle, tier: Tier) -> bool:
        rec = self._records[h]
        copy = rec._copies[tier]
        return rec._residency[tier] is Residency.RESIDENT and copy.pins == 0 and not copy.dirty

    def _clean(self, tier: Tier, nbytes: int) -> None:
        """Room on `tier` fell `nbytes` short: start writing back unpinned dirty copies there,
        least recently used first, until that many bytes are on their way to becoming
        evictable (counting those already being written back). On a tier whose memory is one
        region, only a window of `nbytes` serves: the dirty copies of one window are written
        back, and none where the copies being written back open one (`_clean_window`)."""
        if self._clean_window(tier, nbytes):
            return
        coming = sum(self.stores[tier].reserved(m.nbytes) for m in self.moves.all() if m.src is tier and m.dst is m.tensor.home)
        for h in self.room.cached_on(tier):
            if coming >= nbytes:
                return
            if self.write_back_dirty(self._records[h], tier):
                coming += self.stores[tier].reserved(h.nbytes)

    def _clean_window(self, tier: Tier, nbytes: int) -> bool:
        """`_clean` on a tier of one region ([Note: arena windows] in tiers.py); False where the
        tier has no windows or no window serves. Writing back the least recently used dirty
        copies until `nbytes` are on their way frees bytes that need not lie together: each
        copy written may sit between copies that stay, the request still finds no window when
        they land, and the next shortfall writes more (on a 1.3 B model with a 4 GiB host tier,
        gradients were written home and read back 0.7-1.2 bytes per parameter more than with a
        pool of separate buffers). Here the window is chosen among the unpinned copies that are
        clean (cannot open one: the room would have evicted them), being written back, then
        dirty, each group least recently used first: the window with the least recent latest
        member, so the fewest and oldest dirty copies are written."""
        clean: list[TensorHandle] = []
        writing: list[TensorHandle] = []
        dirty: list[TensorHandle] = []
        for h in self.room.cached_on(tier):
            rec = self._records[h]
            copy, state = rec._copies[tier], rec._residency[tier]
            if state is Residency.WRITING_BACK:
                writing.append(h)
            elif state is Residency.RESIDENT and copy.pins == 0:
                (dirty if copy.dirty else clean).append(h)
        order = clean + writing + dirty
        picks = self.stores[tier].victims(nbytes, [self._records[h]._copies[tier].buffer for h in order])
        if not picks:  # None: any bytes serve; []: pinned copies block every window
            return False
        if max(picks) < len(clean):
            return False  # clean copies alone open it: not what a shortfall asks here
        for i in picks:
            self.write_back_dirty(self._records[order[i]], tier)
        return True

    def write_back_dirty(self, rec: TensorRecord, tier: Tier) -> bool:
        """Start writing the copy on `tier` home if it is dirty, unpinned and resident; whether
        it started. (Lazy releases leave dirty copies; room, drop() and flush() take them home.)"""
        copy = rec._copies.get(tier)
        if copy is None or not copy.dirty or copy.pins or rec._residency[tier] is not Residency.RESIDENT:
            return False
        self.start_writeback(rec, tier, None)
        return True

    def write_back_all_dirty(self) -> None:
        """write_back_dirty() every cached copy (flush())."""
        for rec in self._records.values():
            for tier in [t for t in rec._copies if t is not rec.home]:
                self.write_back_dirty(rec, tier)

    def settled_clean(self, rec: TensorRecord, tier: Tier) -> bool:
        """No move on the copy and nothing unwritten in it; starts the write-back of an unpinned
        dirty copy (a caller waits for it)."""
        self.write_back_dirty(rec, tier)
        copy = rec._copies.get(tier)
        return rec._residency[tier] not in (Residency.FETCHING, Residency.WRITING_BACK) and not (
            copy is not None and copy.dirty)

    def __repr__(self) -> str:
        return f"ResidencyTable(tensors={len(self._records)}, in_flight={len(self.moves)}, {self.room!r})"

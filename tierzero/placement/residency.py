"""Where placed tensors are: the state machine of their records (records.py).

`ResidencyTable` holds every `TensorRecord`; its transition methods are the only code that
changes residency or a copy (the table of them is in its docstring). It also answers what a
PlacementManager call checks first (open, still registered) and the conditions its waits end on
(waiting.py). Everyone else reads the `residency`, `pins` and `in_flight` views that
`PlacementManager.record(handle)` returns.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
from typing import Collection, Literal, Mapping

import torch

from io_engine import aligned_empty
from tierzero.config import Tier
from tierzero.placement.cow_home import CheckpointHome
from tierzero.placement.eviction import Room, Shortfall
from tierzero.placement.handles import Kind, TensorHandle
from tierzero.placement.executor import MoveExecutor
from tierzero.placement.moves import Done, Move, MoveTable, Outcome, staging_needs
from tierzero.placement.plans import (FetchPlan, MoveIO, StorePlan, WritebackPlan, run_fetch, run_store,
                                      run_writeback)
from tierzero.placement.records import Copy, Residency, TensorRecord, assert_in_states
from tierzero.placement.nvme import SwapSpace
from tierzero.placement.streams import CopyEvent, CopyStreams
from tierzero.placement.telemetry import Telemetry
from tierzero.placement.tier_store import Buffer, TierStore, as_memory, region, typed
from tierzero.placement.tiers import HostPool


class ResidencyTable:
    """Every placed tensor's record, and the transition methods: the only writers of residency.

    PlacementManager validates calls and waits for room; a transition here gets the buffers it
    needs already reserved (or reserves them, answering a `Shortfall` the manager waits on),
    changes the copies, starts or commits a move, and writes the residency it moves to as its
    last line. Moves run on the executor's workers (moves.py) and commit here under `cond`,
    which guards everything in this table and in `room`; every commit notifies waiters.

        to_home            (unregistered) -> HOME       the data written to its home
                                                        (or kept dirty on HOST: RESIDENT)
        start_fetch        ABSENT -> FETCHING           a copy toward a tier, submitted
        install_blank      ABSENT -> RESIDENT           an uninitialised copy (overwrite)
        _finish_fetch      FETCHING -> RESIDENT         committed (-> ABSENT: failed or stale)
        start_writeback    RESIDENT -> WRITING_BACK     a dirty release, submitted
        _finish_writeback  WRITING_BACK -> RESIDENT     committed (-> ABSENT: stale, unpinned)
        drop               RESIDENT -> ABSENT           evicted, dropped, or stale and unpinned
        forget             every tier -> ABSENT         unregister and close
    """

    def __init__(self, stores: Mapping[Tier, TierStore], streams: CopyStreams, pool: HostPool,
                 swap: SwapSpace | None, telemetry: Telemetry, *, workers: int, rank: int) -> None:
        self.cond = threading.Condition(threading.RLock())
        self.stores = stores
        self.room = Room(stores, self)
        self.errors: list[BaseException] = []
        """Errors of writes to homes since the last flush()."""
        self._records: dict[TensorHandle, TensorRecord] = {}  # registration order
        self._names: dict[str, TensorHandle] = {}
        self._streams = streams
        self._pool = pool
        self._telemetry = telemetry
        self._io = MoveIO(streams, swap)
        self._executor = MoveExecutor(self.cond, self._io, workers=workers, rank=rank)
        self.moves: MoveTable = self._executor.table
        self.closed = False
        """Set by PlacementManager.close(): every call and every wait fails."""

    # ---------------------------- what a call checks, and the conditions Waits.until waits on
    # (each answers None while the wait goes on)

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("PlacementManager is closed")

    def record_of(self, h: TensorHandle, what: str) -> TensorRecord:
        """The record of a registered handle; TypeError for what is no handle, KeyError for one
        not registered here."""
        self.check_open()
        rec = self._records.get(h)
        if rec is None:
            if not isinstance(h, TensorHandle):
                raise TypeError(f"{what}: expected the TensorHandle that register() returned, got {h!r}")
            raise KeyError(f"{what}: no tensor named {h.name!r} is registered (unregistered, or "
                           "registered with another PlacementManager)")
        return rec

    def check_held(self, rec: TensorRecord, tier: Tier) -> None:
        """`check(rec)`, and an acquire() not yet released pins the copy on `tier`."""
        self.check(rec)
        rec.check_acquired(tier)

    def check(self, subject: TensorRecord | str, what: str = "") -> None:
        """Under the lock: the manager is open, and the tensor still registered."""
        self.check_open()
        if not isinstance(subject, str) and self._records.get(subject.handle) is not subject:
            raise KeyError(f"{what or subject.name}: {subject.name!r} was unregistered by another thread meanwhile")

    @staticmethod
    def unmoved(rec: TensorRecord) -> Literal[True] | None:
        """No move of the tensor in flight."""
        return True if not rec._moves.for_tensor(rec.handle) else None

    @staticmethod
    def home_written(rec: TensorRecord) -> Literal[True] | None:
        """No write toward the tensor's home in flight."""
        return True if not any(m.dst is rec.home for m in rec._moves.for_tensor(rec.handle)) else None

    @staticmethod
    def still(rec: TensorRecord, tier: Tier) -> Literal[True] | None:
        """No fetch filling, nor write-back reading, the copy on `tier`."""
        return True if rec._residency[tier] not in (Residency.FETCHING, Residency.WRITING_BACK) else None

    def take_when_still(self, rec: TensorRecord, tier: Tier,
                        needs: list[tuple[Tier, int]]) -> list[Buffer] | Shortfall | None:
        """`needs` reserved once the copy on `tier` is still: a dirty release's staging."""
        return None if self.still(rec, tier) is None else self.room.take(needs, rec.handle)

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

    def release(self, rec: TensorRecord, tier: Tier, *, dirty: bool, staging: Buffer | None,
                lazy: bool = False, written: CopyEvent | None = None) -> None:
        """Unpin an acquire's pin, the copy now the most recently used; a dirty cached copy is
        written back (through `staging` for device -> NVMe), or with `lazy` only marked dirty
        (written back when its room is needed, or never if discarded first); a dirty home
        invalidates the cached copies. `written`: the copy's last write, still in flight, which
        its readers and its free wait for."""
        rec.check_acquired(tier)
        copy = rec._copies[tier]
        me = threading.get_ident()
        copy.holders.remove(me if me in copy.holders else copy.holders[0])  # released by another thread
        self.room.touch(rec.handle, tier)
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
            self.start_writeback(rec, tier, None if staging is None else as_memory(staging))
            return
        self._unpin(rec, tier, copy)
        if dirty:
            self._invalidate_cached(rec, keep=tier)

    def store(self, rec: TensorRecord, data: torch.Tensor, buf: Buffer | None) -> None:
        """Overwrite the home (an NVMe home asynchronously, from the host staging `buf`) and the
        cached copies: an unpinned device copy is dropped (the next fetch brings the new values
        on the copy stream); a device home or pinned device copy is written from `data` on the
        device, else through the staging buffer on the copy stream."""
        h, home = rec.handle, rec._copies[rec.home]
        staging = None if buf is None else as_memory(buf)
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
            self._executor.submit(StorePlan(h, home, staging), Tier.HOST, Tier.NVME, run_store, self._finish_store,
                         key=Tier.NVME)
        else:
            rec._home_error = None
            if staging is not None:
                self._pool.free(staging)

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
                         as_memory(bufs[1]) if len(bufs) > 1 else None,
                         self._streams.compute_ready() if src is Tier.DEVICE else source.event,
                         tuple(m.future for m in rec.in_flight if m.dst is src),  # not the home's write
                         source_fetch.future if source_fetch is not None else None, cf.Future())

    def acquire(self, rec: TensorRecord, tier: Tier, *, overwrite: bool) -> tuple[Copy, Move | None] | Shortfall:
        """The copy on `tier`, pinned: there, on its way or started now (with `overwrite` an
        uninitialised one: nothing read), and the move still filling it; a Shortfall while
        there is no room for it."""
        if rec._residency[tier] is Residency.ABSENT:
            if overwrite:
                bufs = self.room.take([(tier, rec.nbytes)], rec.handle)
                if isinstance(bufs, Shortfall):
                    return bufs
                self.install_blank(rec, tier, bufs[0])
            else:
                started = self.try_fetch(rec, tier)
                if isinstance(started, Shortfall):
                    return started
        return self.pin(rec, tier), self.moves.get(rec.handle, tier)

    def prefetch(self, rec: TensorRecord, tier: Tier, *, speculative: bool = False) -> bool:
        """PlacementManager.prefetch under the lock: a copy there or on its way is touched (True);
        else one is started if there is room now (`try_fetch`)."""
        self.check(rec)
        if tier is rec.home or rec._residency[tier] is not Residency.ABSENT:
            self.room.touch(rec.handle, tier)
            return True
        self.room.check_fits(rec.name, rec.nbytes, tier)
        return self.try_fetch(rec, tier, speculative=speculative) is True

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
        self._executor.close()
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
        staging = None if staging is None else as_memory(staging)
        home = Copy(buf, self.stores[h.home].view(buf, h))
        try:
            if data.is_meta or borrowed is not None:
                pass  # room reserved, nothing to write (a borrowed home holds the bytes)
            elif home.tensor is not None:
                home.tensor.copy_(data)
                self._streams.compute_wait(None, home.tensor)  # written on the compute stream
            else:
                typed(staging, h).copy_(data)
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
            self._executor.submit(StorePlan(h, home, staging), Tier.HOST, Tier.NVME, run_store, self._finish_store,
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
        rec.name = new.name
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
        self._executor.submit(plan, plan.src, plan.dst, run_fetch, self._finish_fetch, key=plan.dst)
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
        self._executor.submit(plan, tier, h.home, run_writeback, self._finish_writeback, key=tier)
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

    # ---------------------------------------------------------------- commits of the moves

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

    # ------------------------------------------------- what Room asks of the cached copies

    def evictable(self, h: TensorHandle, tier: Tier) -> bool:
        rec = self._records[h]
        copy = rec._copies[tier]
        return rec._residency[tier] is Residency.RESIDENT and copy.pins == 0 and not copy.dirty

    def buffer(self, h: TensorHandle, tier: Tier) -> Buffer:
        return self._records[h]._copies[tier].buffer

    def unused(self, h: TensorHandle, tier: Tier) -> bool:
        return not self._records[h]._copies[tier].used

    def cleaning(self, h: TensorHandle, tier: Tier) -> Literal["clean", "writing", "dirty"] | None:
        """What writing back the unpinned copy on `tier` would do: nothing ("clean"), it is
        being written ("writing"), start a write ("dirty"); None where it is pinned or fetching."""
        rec = self._records[h]
        copy, state = rec._copies[tier], rec._residency[tier]
        if state is Residency.WRITING_BACK:
            return "writing"
        if state is Residency.RESIDENT and copy.pins == 0:
            return "dirty" if copy.dirty else "clean"
        return None

    def writing_back(self, tier: Tier) -> int:
        """Bytes reserved on `tier` by copies being written to their homes."""
        return sum(self.stores[tier].reserved(m.nbytes) for m in self.moves.all()
                   if m.src is tier and m.dst is m.tensor.home)

    def write_back(self, h: TensorHandle, tier: Tier) -> bool:
        """Start writing the copy on `tier` home if it is dirty, unpinned and resident; whether
        it started. (Lazy releases leave dirty copies; room, drop() and flush() take them home.)"""
        rec = self._records[h]
        copy = rec._copies.get(tier)
        if copy is None or not copy.dirty or copy.pins or rec._residency[tier] is not Residency.RESIDENT:
            return False
        self.start_writeback(rec, tier, None)
        return True

    def write_back_all_dirty(self) -> None:
        """write_back() every cached copy (flush())."""
        for rec in self._records.values():
            for tier in [t for t in rec._copies if t is not rec.home]:
                self.write_back(rec.handle, tier)

    def settled_clean(self, rec: TensorRecord, tier: Tier) -> Literal[True] | None:
        """True when no move is on the copy and nothing unwritten is in it (None while not);
        starts the write-back of an unpinned dirty copy (a caller waits for it)."""
        self.write_back(rec.handle, tier)
        copy = rec._copies.get(tier)
        settled = rec._residency[tier] not in (Residency.FETCHING, Residency.WRITING_BACK) and not (
            copy is not None and copy.dirty)
        return True if settled else None

    def __repr__(self) -> str:
        return f"ResidencyTable(tensors={len(self._records)}, in_flight={len(self.moves)}, {self.room!r})"

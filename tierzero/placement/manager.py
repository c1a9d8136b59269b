"""PlacementManager: the public API of placement, and the waiting.

Each registered tensor, named by the `TensorHandle` register() returns, has a home tier that
holds it for its whole life and, on the other tiers, at most one cached copy whose state is a
`Residency` (records.py). The manager parses each call, has the ResidencyTable check it (open,
still registered), waits (waiting.py) on the table's conditions for room and for moves under the
table's lock, and hands each change to the table in one call. See [Note: a placed tensor's life].
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
import time
from functools import partial
from typing import Callable, Collection, Sequence

import numpy as np
import torch

from tierzero.config import Config, Tier, format_size
from tierzero.placement.cow_home import CheckpointHome, Segment
from tierzero.placement.eviction import EvictionPolicy, LeastRecentlyUsed, Shortfall
from tierzero.placement.handles import Kind, TensorHandle
from tierzero.placement.moves import Move, stall_sources, staging_needs
from tierzero.placement.nvme import SwapRegion, SwapSpace
from tierzero.placement.residency import Residency, ResidencyTable, TensorRecord
from tierzero.placement.streams import CopyEvent, CopyStreams, DeviceCopies, resolve_device
from tierzero.placement.swap_dirs import close_at_exit, closed, exit_on_sigterm
from tierzero.placement.telemetry import StepRecorder, Telemetry
from tierzero.placement.tier_store import as_memory, tier_stores
from tierzero.placement.tiers import Budget, HostPool, PinnedArena, round_up
from tierzero.placement.waiting import Waits

__all__ = ["PlacementManager", "Residency", "TensorRecord", "EvictionPolicy", "LeastRecentlyUsed", "Move"]


# [Note: a placed tensor's life]
#   register    copy the data to its home tier, synchronously (lazy: an NVMe home's staging
#               copy stays as a dirty host copy, written like a lazy release's)
#   prefetch    start a copy toward a tier, best effort: reserve room there (evicting unpinned
#               cached copies by the eviction policy), then a worker thread runs the copy
#   acquire     wait for that copy, or start it and wait; pin it; order compute after its event
#               (overwrite=True: a caller that writes it whole gets a fresh copy, nothing read)
#   release     unpin; dirty: write the copy back to its home (async) and invalidate the other
#               cached copies, which now hold old data
#   store       overwrite the contents: every cached copy now, the home too (an NVMe home
#               asynchronously, from a host staging copy)
#   evict       an unpinned cached copy is dropped when its tier needs the room
#   unregister  wait for its moves, free every copy and the home, forget the handle
# A copy toward the device from NVMe goes NVMe -> host staging buffer (io_engine read, checksum
# verified) -> device (copy stream); a write-back goes device -> host staging (copy stream) ->
# NVMe. A cached HOST copy is used instead of staging when there is one. Every reservation a
# move needs is taken in the caller's thread before the move starts, never holding one while
# waiting for another, so worker threads never wait for memory. One condition variable (the
# table's) guards all records, copies, room and moves; workers run copies and IO without it and
# take it to commit; every commit notifies waiters.


class PlacementManager:
    """Places registered tensors on the device, host and NVMe tiers within their budgets.

    See the module docstring for the data flow. Thread-safe. `wait_timeout_s` bounds how long a
    call waits for room that only a release by another thread could make (everything on the tier
    pinned): past it the call raises instead of hanging. A wait that nothing but the waiting
    thread itself could end (its own pins, nothing moving) raises after `stuck_after_s` without a
    change (a release may still come from another thread that was handed the pin).
    """

    def __init__(self, config: Config, rank: int = 0, device: torch.device | str | None = None, *,
                 world_size: int = 1, wait_timeout_s: float = 60.0, stuck_after_s: float = 2.0) -> None:
        self.config = config
        self.rank = rank
        local_rank = os.environ.get("LOCAL_RANK")
        self.device = resolve_device(device if device is not None else config.device, world_size=world_size,
                                     rank=rank, local_rank=None if local_rank is None else int(local_rank))
        self.telemetry = Telemetry()
        self.streams = CopyStreams(self.device, config.stream_settings())
        self.copies: DeviceCopies = self.streams
        """The device's copy streams, as compute-side code (the runtime) uses them."""
        self.recorder: StepRecorder = self.telemetry
        """The step's record in the telemetry (the runtime's): moves, stalls, activations, spans."""
        # the device's working set (Config.device_reserve) is no tier's: placed tensors never take it
        self.budgets = {t: Budget(t, config.budget(t.value) - (config.device_reserve if t is Tier.DEVICE else 0))
                        for t in Tier}
        for b in self.budgets.values():
            b.add_hook(self.telemetry.on_bytes)
        # Asynchronous copies need pinned host memory: one region, pinned once (tiers.py).
        self.pool: HostPool | PinnedArena = (
            PinnedArena(self.budgets[Tier.HOST], pin=self.streams.cuda, on_free=self.streams.host_freeing)
            if self.streams.asynchronous else HostPool(self.budgets[Tier.HOST]))
        if isinstance(self.pool, PinnedArena):
            self.streams.register_pinned(self.pool.base, self.pool.size)
        self.device_pool = None if self.streams.cuda else HostPool(self.budgets[Tier.DEVICE])
        self.swap = None
        if config.nvme_dir is not None:
            self.swap = SwapSpace(config.nvme_dir, rank, self.budgets[Tier.NVME], config.io,
                                  checksums=config.checksums, telemetry=self.telemetry)
        try:
            self._tiers = tier_stores(self.budgets, self.streams, self.pool, self.device_pool, self.swap)
            self._table = ResidencyTable(self._tiers, self.streams, self.pool, self.swap, self.telemetry,
                                         workers=max(2, config.prefetch.nvme_depth), rank=rank)
        except BaseException:
            if self.swap is not None:
                self.swap.close()
            self.streams.close()
            raise
        self._room = self._table.room
        self._cond = self._table.cond
        self._scratch: dict[int, tuple[Tier, int]] = {}
        """Scratch buffers handed out: data_ptr -> (tier, the thread holding it)."""
        self._waits = Waits(self._table, self._scratch, timeout_s=wait_timeout_s, stuck_after_s=stuck_after_s)
        close_at_exit(self)
        exit_on_sigterm()

    # ----------------------------------------------------------------------------- public API

    def register(self, owner: str, data: torch.Tensor, home: Tier | str, *, kind: Kind = Kind.TENSOR,
                 dtype: torch.dtype | None = None, lazy: bool = False,
                 borrowed: CheckpointHome | None = None) -> TensorHandle:
        """Copy `data` (cast to `dtype`) to its home tier, where its bytes stay reserved; the
        handle names the tensor in every other call. An NVMe home is written asynchronously from
        a host staging copy (later reads wait for it; `flush()` raises its error), so a caller
        registering many tensors reads the next while this one is written. lazy=True keeps that
        host copy instead, dirty, as a lazy release leaves one: written home only when its room
        is needed or by flush(), so what fits the host budget is not written yet (a load's last
        blocks). `data` on the meta device reserves the room without writing anything: the
        contents are undefined until the first store or dirty release (a gradient before its
        first backward).

        borrowed: checkpoint bytes equal to `data`'s, read by `SwapSpace.borrow`, that serve as
        the NVMe home until its first write (see [Note: copy-on-write home] in tierzero/placement/cow_home.py): the home's swap extent is
        reserved all the same, so that write can never lack room, but nothing is written now,
        nor copied anywhere: `data` may be meta (its shape and dtype). Closed if the register
        fails."""
        try:
            return self._register(owner, data, home, kind, dtype, lazy, borrowed)
        except BaseException:
            if borrowed is not None:
                borrowed.close()
            raise

    def _register(self, owner: str, data: torch.Tensor, home: Tier | str, kind: Kind, dtype: torch.dtype | None,
                  lazy: bool, borrowed: CheckpointHome | None) -> TensorHandle:
        h = TensorHandle(owner, kind, torch.Size(data.shape), dtype or data.dtype,
                         Tier.parse(home, what=f"register({owner!r}) home"))
        if borrowed is not None and (h.home is not Tier.NVME or borrowed.nbytes != h.nbytes or data.dtype != h.dtype):
            raise ValueError(f"register({h.name!r}, borrowed={borrowed!r}): a checkpoint home serves only an "
                             f"NVMe home of the same bytes; got home {h.home.value}, {h.nbytes} bytes of "
                             f"{h.dtype} from {data.dtype} data")
        with self._cond:
            self._check_open()
            if self._table.named(h.name):
                raise ValueError(f"register: a tensor named {h.name!r} is already registered; "
                                 "unregister it first, or give another owner or kind")
            if h.home is Tier.NVME and self.swap is None:
                raise ValueError(f"register({h.name!r}, home='nvme'): config.nvme_dir is not set; "
                                 "give nvme_dir or choose another home tier")
            self._room.check_fits(h.name, h.nbytes, h.home)
            staging = [] if data.is_meta or borrowed is not None else staging_needs(None, h.home, h.nbytes)
            for tier, nbytes in staging:
                self._room.check_fits(h.name, nbytes, tier, why="NVMe-homed tensors are staged through host memory")
            needs = [(h.home, h.nbytes)] + staging
            buf, *staged = self._waits.until(lambda: self._room.take(needs, h, home=True), h.name,
                                             f"register({h.name!r})")
            self._table.to_home(h, data, buf, staged[0] if staged else None, lazy=lazy, borrowed=borrowed)
            return h

    def unregister(self, h: TensorHandle) -> None:
        """Take the handle back: wait for its moves in flight, free every cached copy and its home
        (budgets given back, an NVMe region freed) and forget it; any later call with it raises
        KeyError. RuntimeError while a copy is pinned (acquired and not released). An error of
        its last write-back stays for flush() to raise."""
        rec = self._table.record_of(h, "unregister")
        with self._cond:
            self._check_open()
            self._table.check(rec)
            self._waits.until(partial(self._table.unmoved, rec), rec, f"unregister({h.name!r}) waiting for its moves")
            pinned = {t.value: rec.pins(t) for t in Tier if rec.pins(t)}
            if pinned:
                raise RuntimeError(f"unregister({h.name!r}): copies are still pinned (tier: pins) {pinned}; "
                                   "release() every acquire() first")
            self._table.forget(rec)
            self._cond.notify_all()

    def relabel(self, h: TensorHandle, kind: Kind) -> TensorHandle:
        """The same tensor as another kind (parameters frozen after they were registered), under
        the handle returned, which replaces `h`; its cached copies are dropped (dirty ones
        written home first). RuntimeError while it is pinned or moving; ValueError on a name clash."""
        for tier in (Tier.DEVICE, Tier.HOST):
            if tier is not h.home:
                self.drop(h, tier)
        rec = self._table.record_of(h, "relabel")
        with self._cond:
            name = f"{h.owner}.{kind.value}"
            if self._table.named(name):
                raise ValueError(f"relabel({h.name!r}): a tensor named {name!r} is already registered")
            if rec.in_flight or any(rec.pins(t) for t in Tier):
                raise RuntimeError(f"relabel({h.name!r}): the tensor is pinned or moving; relabel it between steps")
            return self._table.relabel(rec, kind)

    def prefetch(self, h: TensorHandle, tier: Tier | str = Tier.DEVICE, *, speculative: bool = False) -> bool:
        """Start a copy toward `tier` without waiting. True if it is there, on its way, or was
        started; False if there is no room without evicting a pinned copy (or, speculative,
        without writing back a dirty one or evicting a prefetched copy not used yet: a read
        further ahead never pushes out data that is still to be used)."""
        rec, tier = self._lookup(h, tier, "prefetch")
        with self._cond:
            return self._table.prefetch(rec, tier, speculative=speculative)

    def acquire(self, h: TensorHandle, tier: Tier | str = Tier.DEVICE, *, overwrite: bool = False) -> torch.Tensor:
        """The tensor on `tier` (registered shape and dtype), pinned until release().

        overwrite=True: the caller will write every element and release(dirty=True), so when
        there is no copy on `tier` yet its bytes are not read: a fresh uninitialised copy is
        made there (no NVMe read; a gradient's first write in a step, say)."""
        rec, tier = self._lookup(h, tier, "acquire")
        with torch.profiler.record_function(f"tierzero::acquire {h.name}"):
            if tier is h.home:
                return self._acquire_home(rec)
            asked = time.perf_counter()
            with self._cond:
                self._check_open()
                hit = rec.residency[tier] is not Residency.ABSENT  # (all ABSENT once unregistered)
                attempt = partial(self._table.acquire, rec, tier, overwrite=overwrite)
                if hit:  # there or on its way: no room to wait for
                    self._table.check(rec)
                    got = attempt()
                    assert not isinstance(got, Shortfall), got
                    copy, move = got
                else:
                    self._room.check_fits(h.name, h.nbytes, tier)
                    what = f"acquire({h.name!r}, {tier.value!r}{', overwrite=True' if overwrite else ''})"
                    copy, move = self._waits.until(attempt, rec, what)
            t0 = time.perf_counter()
            self.telemetry.record_prefetch(hit)
            if t0 - asked > 1e-3:  # time spent waiting for room (or for another copy's move)
                self.telemetry.record_stall(tier, t0 - asked, {"room": t0 - asked})
            event = copy.event
            if move is not None:
                # A fetch toward the device is waited for on the host only until its copy is
                # queued; compute then waits for the copy's event on its own stream.
                waited = move.issued if move.dst is tier and move.issued is not None else move.future
                cf.wait([waited])
                t1 = time.perf_counter()
                self.telemetry.record_stall(tier, t1 - t0, stall_sources(move.legs, t0, t1))
                error = waited.exception() if move.dst is tier else None
                if error is not None:
                    raise error  # the fetch failed; its copy is gone
                if waited is move.issued:
                    event = move.issued.result()
            self._compute_after(event, copy.tensor)
            return copy.tensor

    def _compute_after(self, event: CopyEvent, tensor: torch.Tensor) -> None:
        """Order compute after the copy that filled an acquired tensor (on the host, no wait)."""
        self.streams.compute_wait(event, tensor)

    def release(self, h: TensorHandle, tier: Tier | str = Tier.DEVICE, *, dirty: bool = False,
                lazy: bool = False, written: CopyEvent | None = None) -> None:
        """Unpin; dirty=True writes this copy's contents back to the home tier (async).

        lazy=True (with dirty, for a host copy of an NVMe home): keep the copy dirty instead; it
        is written home only when its room is needed (or by flush()), and never if discard()
        comes first: a gradient used and cleared within a step never reaches the disk. Where a
        write-back would need a staging buffer (a device copy of an NVMe home) it is eager.
        written: the caller's last write into the copy is a copy still in flight (a gradient's
        device-to-host copy); every reader, write-back and free of the copy waits for it."""
        rec, tier = self._lookup(h, tier, "release")
        lazy = lazy and dirty and tier is not h.home and not staging_needs(tier, h.home, h.nbytes)
        with self._cond:
            self._table.check_held(rec, tier)
            staging = None
            if lazy:  # (a fetch commits after its copy is queued: waited for too)
                self._waits.until(partial(self._table.still, rec, tier), rec,
                                  f"release({h.name!r}, {tier.value!r}, lazy=True) waiting for its move")
            elif dirty and tier is not h.home:
                # Still pinned while waiting (for an earlier move of this copy to finish, and
                # for a staging buffer), so the dirty copy cannot be evicted meanwhile.
                needs = staging_needs(tier, h.home, h.nbytes)
                bufs = self._waits.until(partial(self._table.take_when_still, rec, tier, needs),
                                         rec, f"release({h.name!r}, {tier.value!r}, dirty=True)")
                staging = bufs[0] if bufs else None
            self._table.release(rec, tier, dirty=dirty, staging=staging, lazy=lazy, written=written)
            self._cond.notify_all()

    def discard(self, h: TensorHandle) -> None:
        """Forget the tensor's contents: its cached copies are dropped unwritten, dirty ones too
        (a pinned or moving copy when it is free); the home keeps whatever it held last. For
        data that is dead, such as a gradient set to None; read it again only after writing it."""
        rec = self._table.record_of(h, "discard")
        with self._cond:
            self._table.check(rec)
            self._table.discard(rec)
            self._cond.notify_all()

    def drop(self, h: TensorHandle, tier: Tier | str) -> None:
        """Free an unpinned cached copy now (after its write-back, if one is in flight or it is
        dirty)."""
        rec, tier = self._lookup(h, tier, "drop")
        if tier is h.home:
            raise ValueError(f"drop({h.name!r}, {tier.value!r}): {tier.value} is the tensor's home; "
                             "only cached copies on other tiers can be dropped")
        with self._cond:
            self._table.check(rec)
            self._waits.until(partial(self._table.settled_clean, rec, tier),
                              rec, f"drop({h.name!r}) waiting for its move")
            if rec.residency[tier] is Residency.ABSENT:
                return
            if rec.pins(tier):
                raise RuntimeError(f"drop({h.name!r}, {tier.value!r}): the copy is pinned by "
                                   f"{rec.pins(tier)} acquire(s); release it first")
            self._table.drop(h, tier)
            self._cond.notify_all()

    def store(self, h: TensorHandle, data: torch.Tensor) -> None:
        """Overwrite the tensor's contents: its home and every cached copy. An NVMe home is
        written asynchronously from a host staging copy of `data` (later reads wait for it;
        `flush()` raises its error), so the caller may reuse `data` at once."""
        rec = self._table.record_of(h, "store")
        if tuple(data.shape) != tuple(h.shape):
            raise ValueError(f"store({h.name!r}): expected shape {tuple(h.shape)}, got {tuple(data.shape)}")
        with self._cond:
            self._check_open()
            self._table.check(rec)
            bufs = self._waits.until(lambda: None if rec.in_flight else self._room.take(
                [(Tier.HOST, h.nbytes)] if self._store_staged(rec, data) else [], h),
                rec, f"store({h.name!r}) waiting for its moves")
            self._table.store(rec, data, bufs[0] if bufs else None)
            self._cond.notify_all()

    def _store_staged(self, rec: TensorRecord, data: torch.Tensor) -> bool:
        """Whether store() writes through a host staging buffer: an NVMe home's write, or a
        device home or pinned device copy written from host data on the copy stream (CUDA's
        non-blocking copies need pinned memory)."""
        if rec.home is Tier.NVME:
            return True
        on_device = rec.home is Tier.DEVICE or rec.pins(Tier.DEVICE) > 0
        return self.streams.asynchronous and not self.streams.is_device(data) and on_device

    def read(self, h: TensorHandle, out: np.ndarray | None = None) -> torch.Tensor:
        """A CPU copy of the tensor's current contents (its home, after write-backs): fresh, or in
        `out` (a page-aligned uint8 numpy buffer of at least `io_bytes(h)`; reused buffers save
        the page faults of fresh ones when a caller streams many tensors)."""
        rec = self._table.record_of(h, "read")
        if out is not None and out.nbytes < self.io_bytes(h):
            raise ValueError(f"read({h.name!r}): out holds {out.nbytes} bytes, expected at least {self.io_bytes(h)}")
        with self._cond:
            self._check_open()
            self._table.check(rec)
            self._waits.until(partial(self._table.home_written, rec),
                              rec, f"read({h.name!r}) waiting for its write-backs")
            return self._table.read_home(rec, None if out is None else torch.from_numpy(out))

    def reserve_scratch(self, nbytes: int, tier: Tier | str = Tier.DEVICE, *, what: str,
                        wait: bool = True) -> torch.Tensor | None:
        """A uint8 buffer of at least `nbytes` on `tier` that the caller fills and computes on
        itself (a block gathered from every rank's shards), reserved within the tier's budget
        like any copy (evicting unpinned cached copies, waiting up to wait_timeout_s for
        releases; wait=False: None when there is no room now); give it back with
        free_scratch(). The calling thread's compute stream is recorded as its user, so its
        memory is not handed out again before that compute is done. `what` names it in errors."""
        tier = Tier.parse(tier, what=f"reserve_scratch({what!r}) tier")
        if tier is Tier.NVME:
            raise ValueError(f"reserve_scratch({what!r}, 'nvme'): scratch buffers live on 'device' or 'host'")
        with self._cond:
            self._check_open()
            self._room.check_fits(what, nbytes, tier)
            if wait:
                (buf,) = self._waits.until(lambda: self._room.take([(tier, nbytes)], None), what,
                                           f"reserve_scratch({what!r}, {tier.value!r})")
            else:
                got = self._room.take([(tier, nbytes)], None, speculative=True)
                if isinstance(got, Shortfall):
                    return None
                (buf,) = got
            scratch = as_memory(buf)
            self._scratch[scratch.data_ptr()] = (tier, threading.get_ident())
        if tier is Tier.DEVICE:
            self.streams.lend(scratch, what)
            self.streams.compute_wait(None, scratch)
        return scratch

    def free_scratch(self, buf: torch.Tensor, tier: Tier | str = Tier.DEVICE) -> None:
        """Give back a buffer from reserve_scratch()."""
        with self._cond:
            self._scratch.pop(buf.data_ptr(), None)
            self._tiers[Tier.parse(tier)].free(buf)
            self._cond.notify_all()

    def io_bytes(self, h: TensorHandle) -> int:
        """Bytes a buffer given to read(h, out=...) must hold (NVMe regions are whole pages)."""
        self._table.record_of(h, "io_bytes")
        return round_up(h.nbytes) if h.home is Tier.NVME else h.nbytes

    def record(self, h: TensorHandle) -> TensorRecord:
        """The read-only view of where the tensor is: residency per tier, pins(tier), in_flight."""
        return self._table.record_of(h, "record")

    def nvme_location(self, h: TensorHandle) -> tuple[str, int]:
        """(file, byte offset) where an NVMe-homed tensor's bytes start: a swap file, or the
        checkpoint file of a copy-on-write home ([Note: copy-on-write home]); for tools and tests."""
        rec = self._table.record_of(h, "nvme_location")
        if h.home is not Tier.NVME or self.swap is None:
            raise ValueError(f"nvme_location({h.name!r}): the tensor is homed on {h.home.value}, not nvme")
        with self._cond:
            region = self._table.home_buffer(rec)
        assert isinstance(region, SwapRegion), region
        return self.swap.location(region)

    def check_staging(self) -> None:
        """ValueError when an NVMe-homed tensor's host staging buffer can never fit beside the
        tensors now homed on the host tier: its first fetch would wait for room nothing can make.
        (register() checks each tensor against the homes registered before it; call this once
        the homes are all there: at the end of wrap, and of an optimizer's construction.)"""
        with self._cond:
            self._check_open()
            for rec in self._table.records():
                h = rec.handle
                if h.home is Tier.NVME:
                    self._room.check_fits(h.name, h.nbytes, Tier.HOST,
                                          why="NVMe-homed tensors are staged through host memory")

    @property
    def handles(self) -> tuple[TensorHandle, ...]:
        """Every registered tensor's handle, in registration order."""
        with self._cond:
            return tuple(rec.handle for rec in self._table.records())

    def flush(self) -> None:
        """Write every dirty cached copy home, wait for every move in flight; raise the first
        write-back error since the last flush."""
        with self._cond:
            self._table.write_back_all_dirty()
        self.settle()

    def settle(self) -> None:
        """Wait for every move in flight (dirty cached copies stay dirty) and for the streams to
        pass the device buffers freed; raise the first write-back error since the last flush or
        settle."""
        while True:
            with self._cond:
                futures = [m.future for m in self._table.moves.all()]
            if not futures:
                break
            cf.wait(futures)
        with self._cond:
            for store in self._tiers.values():
                store.settle()
            errors, self._table.errors = self._table.errors, []
        if errors:
            raise errors[0]

    def trim(self, tier: Tier | str, sizes: Collection[int]) -> int:
        """Give back the free buffers `tier`'s pool caches for requests of `sizes` bytes (a
        HostPool's: the device tier on the CPU, the host tier without CUDA; memory the system
        gets back) and return their bytes: for sizes the caller knows nobody asks for soon."""
        with self._cond:
            freed = self._tiers[Tier.parse(tier)].trim(sizes)
            self._cond.notify_all()
        return freed

    def set_eviction_policy(self, policy: EvictionPolicy) -> None:
        """Choose victims with `policy.order(candidates)` (handles, least recently used first)."""
        if not callable(getattr(policy, "order", None)):
            raise ValueError(f"set_eviction_policy: expected an object with order(candidates), got {policy!r}")
        with self._cond:
            self._room.policy = policy

    def bytes_used(self, tier: Tier | str) -> int:
        return self.budgets[Tier.parse(tier)].used

    def peak_bytes(self, tier: Tier | str) -> int:
        return self.budgets[Tier.parse(tier)].peak

    def budget(self, tier: Tier | str) -> int:
        return self.budgets[tier if isinstance(tier, Tier) else Tier.parse(tier)].limit

    # ------------------------------------------------------- the runtime's narrow interface
    # The runtime reaches the streams, the telemetry, the host pool and the swap space only
    # through these and `copies` and `recorder` (tests/test_architecture.py): the protocols say
    # what it may ask of them.

    def host_room(self) -> int:
        """Bytes a host copy could take now: the budget's free bytes and the pool's cached ones."""
        return self.budgets[Tier.HOST].free + self.pool.cached_bytes

    @property
    def borrow(self) -> Callable[[list[Segment], int], CheckpointHome] | None:
        """SwapSpace.borrow (a checkpoint's bytes read and hashed as a home); None without an
        NVMe tier."""
        return None if self.swap is None else self.swap.borrow

    def close(self, *, flush: bool = True) -> None:
        """Finish in-flight work, free every copy, remove the swap files, join threads; idempotent.
        flush=False: dirty cached copies are dropped, not written home first (at interpreter
        exit, when concurrent.futures already refuses new work and the files are going anyway)."""
        if self._table.closed:
            return
        closed(self)
        error: BaseException | None = None
        try:
            if flush:
                self.flush()
        except BaseException as e:  # still free everything, then report
            error = e
        with self._cond:
            self._table.closed = True
        self._table.close()  # joins the workers, which take the lock to commit
        with self._cond:
            self._cond.notify_all()  # a call still waiting for room fails now, not after its timeout
        # Every store closes whatever another raised: the swap files go even when a host buffer
        # is still held (a frame of an exception at exit keeps one alive).
        for store in sorted(self._tiers.values(), key=lambda st: st.tier is not Tier.NVME):
            try:
                store.close()
            except BaseException as e:
                error = error or e
        self.streams.close()
        if error is not None:
            raise error

    def __enter__(self) -> "PlacementManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        used = ", ".join(f"{t.value}={format_size(b.used)}/{format_size(b.limit)}" for t, b in self.budgets.items())
        return (f"PlacementManager(rank={self.rank}, device={self.device}, tensors={len(self._table)}, "
                f"in_flight={len(self._table.moves)}, {used})")

    # ----------------------------------------------------------------------------- helpers

    def _acquire_home(self, rec: TensorRecord) -> torch.Tensor:
        h = rec.handle
        if h.home is Tier.NVME:
            raise ValueError(f"acquire({h.name!r}, 'nvme'): NVMe holds bytes, not tensors; "
                             "acquire it on 'host' or 'device'")
        with self._cond:
            self._check_open()
            self._table.check(rec)
            self._waits.until(partial(self._table.home_written, rec),
                              rec, f"acquire({h.name!r}) waiting for write-backs to its home")
            self._table.check_home(rec)
            copy = self._table.pin(rec, h.home)
        self.streams.compute_wait(copy.event, copy.tensor)
        return copy.tensor

    def check_working_set(self, what: str, handles: Sequence[TensorHandle],
                          extra: Sequence[tuple[Tier, int]] = ()) -> None:
        """ValueError when `handles` acquired on their staging tiers at once (plus `extra`) can
        never fit beside the tensors homed there: checked at construction by a caller that holds
        them together (an optimizer's update of one block), not at its first step."""
        with self._cond:
            self._room.check_working_set(what, handles, extra)

    def _lookup(self, h: TensorHandle, tier: Tier | str, what: str) -> tuple[TensorRecord, Tier]:
        rec = self._table.record_of(h, what)
        if not isinstance(tier, Tier):  # a Tier as given: the hot paths pass one
            tier = Tier.parse(tier, what=f"{what}({h.name!r}) tier")
        if tier is Tier.NVME and tier is not h.home:
            raise ValueError(f"{what}({h.name!r}, 'nvme'): only tensors homed on NVMe live there; "
                             "use 'host' or 'device'")
        return rec, tier

    def _check_open(self) -> None:
        if self._table.closed:
            raise RuntimeError("PlacementManager is closed")

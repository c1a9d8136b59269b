"""PlacementManager: the public API of placement, and the waiting.

Each registered tensor, named by the `TensorHandle` register() returns, has a home tier that
holds it for its whole life and, on the other tiers, at most one cached copy whose state is a
`Residency` (records.py). The manager parses each call, has the ResidencyTable check it (open,
still registered), waits (waiting.py) on the table's conditions for room and for moves under the
table's lock, and hands each change to the table in one call. See [Note: a placed tensor's life].
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import os
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from tierzero.config import Config, Tier, format_size
from tierzero.placement.storage.cow_home import CheckpointHome, Segment
from tierzero.placement.eviction import EvictionPolicy, LeastRecentlyUsed, Room
from tierzero.placement.handles import Kind, TensorHandle
from tierzero.placement.homes import Homes
from tierzero.placement.moves import Move
from tierzero.placement.storage.nvme import SwapSpace
from tierzero.placement.records import Residency, TensorRecord
from tierzero.placement.residency import CopyStates, ResidencyTable
from tierzero.placement.scratch import Scratch
from tierzero.placement.storage.streams import CopyEvent, CopyStreams, DeviceCopies, resolve_device
from tierzero.placement.storage.swap_dirs import close_at_exit, closed, exit_on_sigterm
from tierzero.placement.telemetry import StepRecorder, Telemetry
from tierzero.placement.storage.tier_store import tier_stores
from tierzero.placement.storage.tiers import Budget, HostPool, PinnedArena

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


class PlacementManager(contextlib.AbstractContextManager):
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
            states = CopyStates(self._tiers, self.streams, self.pool, self.swap, self.telemetry,
                                workers=max(2, config.prefetch.nvme_depth), rank=rank)
            self._table = ResidencyTable(states, timeout_s=wait_timeout_s, stuck_after_s=stuck_after_s)
        except BaseException:
            if self.swap is not None:
                self.swap.close()
            self.streams.close()
            raise
        self._homes = Homes(self._table)
        self.room: Room = self._table.room
        """The tiers' room: its eviction `policy` (settable), `trim`, `check_staging`,
        `check_working_set`."""
        self.scratch = Scratch(self._table)
        """Scratch buffers: `scratch.reserve(nbytes, tier, what=...)`, `scratch.free(buf, tier)`."""
        self.borrow: Callable[[list[Segment], int], CheckpointHome] | None = (
            None if self.swap is None else self.swap.borrow)
        """SwapSpace.borrow (a checkpoint's bytes read and hashed as a home); None without an
        NVMe tier."""
        close_at_exit(self)
        exit_on_sigterm()

    # ----------------------------------------------------------------------------- public API
    # Each call parses its arguments and hands the rest to the table (cached copies) or the
    # homes in one call: the checks, waits and transitions live there.

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
        the NVMe home until its first write (see [Note: copy-on-write home] in
        tierzero/placement/storage/cow_home.py): the home's swap extent is reserved all the same, so that write can never lack room, but nothing is written now,
        nor copied anywhere: `data` may be meta (its shape and dtype). Closed if the register
        fails."""
        try:
            h = TensorHandle(owner, kind, torch.Size(data.shape), dtype or data.dtype,
                             Tier.parse(home, what=f"register({owner!r}) home"))
            if borrowed is not None and (h.home is not Tier.NVME or borrowed.nbytes != h.nbytes
                                         or data.dtype != h.dtype):
                raise ValueError(f"register({h.name!r}, borrowed={borrowed!r}): a checkpoint home serves only an "
                                 f"NVMe home of the same bytes; got home {h.home.value}, {h.nbytes} bytes of "
                                 f"{h.dtype} from {data.dtype} data")
            return self._homes.register(h, data, lazy=lazy, borrowed=borrowed)
        except BaseException:
            if borrowed is not None:
                borrowed.close()
            raise

    def unregister(self, h: TensorHandle) -> None:
        """Take the handle back: wait for its moves in flight, free every cached copy and its home
        (budgets given back, an NVMe region freed) and forget it; any later call with it raises
        KeyError. RuntimeError while a copy is pinned (acquired and not released). An error of
        its last write-back stays for flush() to raise."""
        self._homes.unregister(self._table.record_of(h, "unregister"))

    def relabel(self, h: TensorHandle, kind: Kind) -> TensorHandle:
        """The same tensor as another kind (parameters frozen after they were registered), under
        the handle returned, which replaces `h`; its cached copies are dropped (dirty ones
        written home first). RuntimeError while it is pinned or moving; ValueError on a name clash."""
        return self._homes.relabel(self._table.record_of(h, "relabel"), kind)

    def prefetch(self, h: TensorHandle | Sequence[TensorHandle | tuple[TensorHandle, Tier]],
                 tier: Tier | str = Tier.DEVICE, *, speculative: bool = False) -> bool:
        """Start a copy toward `tier` without waiting (of each of `h`, given a sequence of
        handles, or of (handle, tier) pairs each toward its own tier: every one is tried). True
        if it is there, on its way, or was started (all of them); False if there is no room
        without evicting a pinned copy (or, speculative, without writing back a dirty one or
        evicting a prefetched copy not used yet: a read further ahead never pushes out data that
        is still to be used)."""
        items = (h,) if isinstance(h, TensorHandle) else h
        at = _tier(tier, "prefetch", h)
        pairs = [(x, at) if isinstance(x, TensorHandle) else (x[0], _tier(x[1], "prefetch", x[0])) for x in items]
        return self._table.prefetch(pairs, speculative=speculative)

    def acquire(self, h: TensorHandle, tier: Tier | str = Tier.DEVICE, *, overwrite: bool = False) -> torch.Tensor:
        """The tensor on `tier` (registered shape and dtype), pinned until release().

        overwrite=True: the caller will write every element and release(dirty=True), so when
        there is no copy on `tier` yet its bytes are not read: a fresh uninitialised copy is
        made there (no NVMe read; a gradient's first write in a step, say)."""
        return self._table.acquire([(h, _tier(tier, "acquire", h))], overwrite=overwrite)[0]

    def release(self, h: TensorHandle, tier: Tier | str = Tier.DEVICE, *, dirty: bool = False,
                lazy: bool = False, written: CopyEvent | None = None) -> None:
        """Unpin; dirty=True writes this copy's contents back to the home tier (async).

        lazy=True (with dirty, for a host copy of an NVMe home): keep the copy dirty instead; it
        is written home only when its room is needed (or by flush()), and never if discard()
        comes first: a gradient used and cleared within a step never reaches the disk. Where a
        write-back would need a staging buffer (a device copy of an NVMe home) it is eager.
        written: the caller's last write into the copy is a copy still in flight (a gradient's
        device-to-host copy); every reader, write-back and free of the copy waits for it."""
        self._table.release([(h, _tier(tier, "release", h))], dirty=dirty, lazy=lazy, written=written)

    @contextlib.contextmanager
    def hold(self, pairs: Sequence[tuple[TensorHandle, Tier | str]], *,
             dirty: bool | Sequence[bool] = False) -> Iterator[list[torch.Tensor]]:
        """acquire() each (handle, tier) in turn, then release() every one on leaving (`dirty`
        as release takes it, for all or one for each pair, on an error too); if an acquire
        fails, those taken are released clean and the error raised."""
        parsed = [(h, _tier(tier, "hold", h)) for h, tier in pairs]
        tensors = self._table.acquire(parsed)
        try:
            yield tensors
        finally:
            self._table.release(parsed, dirty=dirty)

    def discard(self, h: TensorHandle) -> None:
        """Forget the tensor's contents: its cached copies are dropped unwritten, dirty ones too
        (a pinned or moving copy when it is free); the home keeps whatever it held last. For
        data that is dead, such as a gradient set to None; read it again only after writing it."""
        self._table.discard(self._table.record_of(h, "discard"))

    def drop(self, h: TensorHandle, tier: Tier | str) -> None:
        """Free an unpinned cached copy now (after its write-back, if one is in flight or it is
        dirty)."""
        tier = _tier(tier, "drop", h)
        rec = self._table.record_of(h, "drop", tier)
        if tier is h.home:
            raise ValueError(f"drop({h.name!r}, {tier.value!r}): {tier.value} is the tensor's home; "
                             "only cached copies on other tiers can be dropped")
        self._table.drop(rec, tier)

    def store(self, h: TensorHandle, data: torch.Tensor) -> None:
        """Overwrite the tensor's contents: its home and every cached copy. An NVMe home is
        written asynchronously from a host staging copy of `data` (later reads wait for it;
        `flush()` raises its error), so the caller may reuse `data` at once."""
        if isinstance(h, TensorHandle) and tuple(data.shape) != tuple(h.shape):
            raise ValueError(f"store({h.name!r}): expected shape {tuple(h.shape)}, got {tuple(data.shape)}")
        self._homes.store(h, data)

    def read(self, h: TensorHandle, out: np.ndarray | None = None) -> torch.Tensor:
        """A CPU copy of the tensor's current contents (its home, after write-backs): fresh, or in
        `out` (a page-aligned uint8 numpy buffer of at least `h.io_bytes`; reused buffers save
        the page faults of fresh ones when a caller streams many tensors)."""
        if out is not None and isinstance(h, TensorHandle) and out.nbytes < h.io_bytes:
            raise ValueError(f"read({h.name!r}): out holds {out.nbytes} bytes, expected at least {h.io_bytes}")
        return self._homes.read(h, None if out is None else torch.from_numpy(out))

    def record(self, h: TensorHandle | Sequence[TensorHandle]) -> TensorRecord | tuple[TensorRecord, ...]:
        """The read-only view of where the tensor is: residency per tier, pins(tier), in_flight
        (given a sequence of handles, the views of each)."""
        return self._table.records_of(h)

    @property
    def handles(self) -> tuple[TensorHandle, ...]:
        """Every registered tensor's handle, in registration order."""
        with self._table.cond:
            return tuple(self._table.index)

    def nvme_location(self, h: TensorHandle) -> tuple[str, int]:
        """(file, byte offset) where an NVMe-homed tensor's bytes start: a swap file, or the
        checkpoint file of a copy-on-write home ([Note: copy-on-write home]); for tools and tests."""
        rec = self._table.record_of(h, "nvme_location")
        if h.home is not Tier.NVME or self.swap is None:
            raise ValueError(f"nvme_location({h.name!r}): the tensor is homed on {h.home.value}, not nvme")
        return self.swap.location(self._homes.location(rec))

    def flush(self) -> None:
        """Write every dirty cached copy home, wait for every move in flight; raise the first
        write-back error since the last flush."""
        with self._table.cond:
            self._table.states.write_back_dirty()
        self.settle()

    def settle(self) -> None:
        """Wait for every move in flight (dirty cached copies stay dirty) and for the streams to
        pass the device buffers freed; raise the first write-back error since the last flush or
        settle."""
        table = self._table
        while True:
            with table.cond:
                futures = [m.future for m in table.states.moves.all()]
            if not futures:
                break
            cf.wait(futures)
        with table.cond:
            for store in self._tiers.values():
                store.settle()
            errors, table.states.errors = table.states.errors, []
        if errors:
            raise errors[0]

    def bytes_used(self, tier: Tier | str) -> int:
        return self.budgets[Tier.parse(tier)].used

    def peak_bytes(self, tier: Tier | str) -> int:
        return self.budgets[Tier.parse(tier)].peak

    def budget(self, tier: Tier | str) -> int:
        return self.budgets[tier if isinstance(tier, Tier) else Tier.parse(tier)].limit

    def free_bytes(self, tier: Tier | str, counting: Sequence[TensorHandle] = ()) -> int:
        """Bytes of `tier`'s budget not reserved now, plus those of the resident cached copies
        of `counting` there (what evicting them would give back): a prefetcher's room."""
        tier = _tier(tier, "free_bytes", counting)
        budget = self.budgets[tier]
        index = self._table.index  # (the records' read-only views, as record() hands them out)
        return budget.limit - budget.used + sum(h.nbytes for h in counting
                                                if index[h].residency[tier] is Residency.RESIDENT)

    def host_room(self) -> int:
        """Bytes a host copy could take now: the budget's free bytes and the pool's cached ones.
        (The runtime reaches the streams, telemetry, pool and swap only through this, `copies`,
        `recorder` and `borrow`: tests/test_architecture.py.)"""
        return self.budgets[Tier.HOST].free + self.pool.cached_bytes

    def close(self, *, flush: bool = True) -> None:
        """Finish in-flight work, free every copy, remove the swap files, join threads; idempotent.
        flush=False: dirty cached copies are dropped, not written home first (at interpreter
        exit, when concurrent.futures already refuses new work and the files are going anyway)."""
        table = self._table
        if table.closed:
            return
        closed(self)
        error: BaseException | None = None
        try:
            if flush:
                self.flush()
        except BaseException as e:  # still free everything, then report
            error = e
        with table.cond:
            table.closed = True
        self._homes.close()  # joins the workers, which take the lock to commit
        with table.cond:
            table.cond.notify_all()  # a call still waiting for room fails now, not after its timeout
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

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        used = ", ".join(f"{t.value}={format_size(b.used)}/{format_size(b.limit)}" for t, b in self.budgets.items())
        return (f"PlacementManager(rank={self.rank}, device={self.device}, tensors={len(self._table.index)}, "
                f"in_flight={len(self._table.states.moves)}, {used})")


def _tier(tier: Tier | str, what: str, h: TensorHandle | Sequence[TensorHandle]) -> Tier:
    """A tier as given (the hot paths pass a Tier), or parsed."""
    if isinstance(tier, Tier):
        return tier
    name = h.name if isinstance(h, TensorHandle) else "..."
    return Tier.parse(tier, what=f"{what}({name!r}) tier")

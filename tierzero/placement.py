"""PlacementManager: where every registered tensor lives, and the only writer of residency.

Each tensor has a home tier that holds it for its whole life (bytes reserved there at
register) and, on the other tiers, at most one cached copy whose state is a `Residency`.
The data flow of one tensor:

    register  copy the data to its home tier, synchronously
    prefetch  start a copy toward a tier, best effort: reserve room there (evicting unpinned
              cached copies by the eviction policy), then a worker thread runs the copy
    acquire   wait for that copy, or start it and wait; pin it; order compute after its event
    release   unpin; dirty: write the copy back to its home (async) and invalidate the other
              cached copies, which now hold old data
    store     overwrite the contents: every cached copy now, the home too (an NVMe home
              asynchronously, from a host staging copy)
    evict     an unpinned cached copy is dropped when its tier needs the room

A copy toward the device from NVMe goes NVMe -> host staging buffer (io_engine read, checksum
verified) -> device (copy stream); a write-back goes device -> host staging (copy stream) ->
NVMe. A cached HOST copy is used instead of staging when there is one. Every reservation a move
needs (its destination and any staging buffer) is taken in the caller's thread before the move
starts, never holding one while waiting for another, so worker threads never wait for memory.
Moves of one tensor that touch its home run in order: each waits for the earlier ones.

Locking: one condition variable guards all records, copies and the move table; worker threads
run copies and IO without it and take it to commit; every commit notifies waiters.
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType
from typing import Any, Callable, Mapping, NamedTuple, Protocol, TypeVar

import numpy as np
import torch

from tierzero.config import Config, format_size
from tierzero.streams import DONE, CopyEvent, CopyStreams
from tierzero.telemetry import Telemetry
from tierzero.tiers import Budget, HostPool, Tier, round_up


_T = TypeVar("_T")


class Residency(Enum):
    """State of one tensor on one tier, and what it costs there.

    HOME          the tensor's home copy: its bytes are reserved on the tier from register to close.
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


class Move(NamedTuple):
    """One copy in flight; `future` completes when the copy is done and committed."""

    tensor: str
    src: Tier
    dst: Tier
    nbytes: int
    future: cf.Future
    start: float


class _FetchPlan(NamedTuple):
    """The buffers reserved for a fetch before it starts."""

    src: Tier
    buffer: Any
    staging: torch.Tensor | None


class _Span(NamedTuple):
    """One leg of a move, for telemetry."""

    src: Tier
    dst: Tier
    start: float
    end: float


class EvictionPolicy(Protocol):
    def order(self, candidates: list[str]) -> list[str]:
        """Victims first, from names of tensors with an evictable copy on the tier that needs room."""
        ...


class LeastRecentlyUsed:
    """The default policy: candidates arrive least recently used first, and are kept so."""

    def order(self, candidates: list[str]) -> list[str]:
        return list(candidates)

    def __repr__(self) -> str:
        return "LeastRecentlyUsed()"


class MoveTable:
    """Every move in flight, in one place, keyed by (tensor, tier of its cached copy): the tier
    a fetch fills or a write-back copies from. A cached copy has at most one move at a time."""

    def __init__(self) -> None:
        self._moves: dict[tuple[str, Tier], Move] = {}

    def add(self, tier: Tier, move: Move) -> None:
        assert (move.tensor, tier) not in self._moves, f"{move.tensor} already moving on {tier}"
        self._moves[(move.tensor, tier)] = move

    def pop(self, name: str, tier: Tier) -> Move:
        return self._moves.pop((name, tier))

    def get(self, name: str, tier: Tier) -> Move | None:
        return self._moves.get((name, tier))

    def for_tensor(self, name: str) -> tuple[Move, ...]:
        return tuple(m for (n, _), m in tuple(self._moves.items()) if n == name)

    def all(self) -> tuple[Move, ...]:
        return tuple(self._moves.values())

    def __len__(self) -> int:
        return len(self._moves)


@dataclass(eq=False)
class _Copy:
    """One tensor's bytes on one tier (side table entry of its TensorRecord)."""

    buffer: Any
    """What holds the reservation: a host pool buffer, a device buffer, or an NVMe Extent."""
    tensor: torch.Tensor | None
    """The bytes viewed with the registered shape and dtype (None for an NVMe extent)."""
    pins: int = 0
    """Acquires not yet released, plus moves in flight reading from this copy."""
    stale: bool = False
    """Another copy was written back while this one was pinned or in flight: drop it when free."""
    event: CopyEvent = DONE
    """The copy that filled it; compute waits on it before using the tensor."""


class TensorRecord:
    """A registered tensor: name, shape, dtype, bytes, home tier and where it is now.

    `residency` (per tier) and `in_flight` are read-only views; only PlacementManager's
    transition methods change them.
    """

    def __init__(self, name: str, shape: torch.Size, dtype: torch.dtype, home: Tier, moves: MoveTable) -> None:
        self.name = name
        self.shape = shape
        self.dtype = dtype
        self.nbytes = shape.numel() * dtype.itemsize
        self.home = home
        self._residency = {t: Residency.ABSENT for t in Tier}
        self._copies: dict[Tier, _Copy] = {}
        self._moves = moves

    @property
    def residency(self) -> Mapping[Tier, Residency]:
        return MappingProxyType(self._residency)

    @property
    def in_flight(self) -> tuple[Move, ...]:
        return self._moves.for_tensor(self.name)

    def pins(self, tier: Tier | str) -> int:
        copy = self._copies.get(Tier.parse(tier))
        return copy.pins if copy is not None else 0

    def __repr__(self) -> str:
        where = ", ".join(f"{t.value}: {r.value}" for t, r in self._residency.items() if r is not Residency.ABSENT)
        return (f"TensorRecord({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"nbytes={self.nbytes}, home={self.home.value}, {{{where}}})")


def _assert_in_states(rec: TensorRecord, tier: Tier, *states: Residency) -> None:
    assert rec._residency[tier] in states, (
        f"{rec.name} on {tier}: expected {[s.value for s in states]}, is {rec._residency[tier].value}")


class PlacementManager:
    """Places registered tensors on the device, host and NVMe tiers within their budgets.

    See the module docstring for the data flow. Thread-safe. `wait_timeout_s` bounds how long a
    call waits for room that only a release by another thread could make (everything on the tier
    pinned): past it the call raises instead of hanging.
    """

    def __init__(self, config: Config, rank: int = 0, device: torch.device | str | None = None, *,
                 wait_timeout_s: float = 60.0) -> None:
        self.config = config
        self.rank = rank
        self.device = _resolve_device(device)
        self.wait_timeout_s = wait_timeout_s
        self.telemetry = Telemetry()
        self.streams = CopyStreams(self.device)
        self.budgets = {t: Budget(t, config.budget(t.value)) for t in Tier}
        for b in self.budgets.values():
            b.add_hook(self.telemetry.on_bytes)
        self.pool = HostPool(self.budgets[Tier.HOST], pinned=self.streams.cuda)
        # Without CUDA the device tier is CPU memory too: reuse its buffers the way CUDA's caching
        # allocator reuses device blocks, rather than page-faulting fresh memory on every copy.
        self.device_pool = None if self.streams.cuda else HostPool(self.budgets[Tier.DEVICE], pinned=False)
        self.swap = None
        if config.nvme_dir is not None:
            from tierzero.nvme import SwapSpace

            self.swap = SwapSpace(config.nvme_dir, rank, self.budgets[Tier.NVME], config.io,
                                  checksums=config.checksums)
        self.records: dict[str, TensorRecord] = {}
        self._moves = MoveTable()
        self._home_bytes = dict.fromkeys(Tier, 0)
        self._lru: OrderedDict[tuple[str, Tier], None] = OrderedDict()
        self._policy: EvictionPolicy = LeastRecentlyUsed()
        self._errors: list[BaseException] = []
        self._shortfall: tuple[Tier, int] | None = None  # what the last _try_room lacked
        self._cond = threading.Condition(threading.RLock())
        # Workers run copies and IO so callers never block on them; sized to keep the NVMe
        # read-ahead depth in flight while earlier blocks copy to the device.
        self._executor = cf.ThreadPoolExecutor(max_workers=max(2, config.prefetch.nvme_depth),
                                               thread_name_prefix=f"tierzero-move-r{rank}")
        self._closed = False

    # ----------------------------------------------------------------------------- public API

    def register(self, name: str, data: torch.Tensor, home: Tier | str, *,
                 dtype: torch.dtype | None = None) -> TensorRecord:
        """Copy `data` (cast to `dtype`) to its home tier, where its bytes stay reserved."""
        home = Tier.parse(home, what=f"register({name!r}) home")
        with self._cond:
            self._check_open()
            if name in self.records:
                raise ValueError(f"register: a tensor named {name!r} is already registered")
            if home is Tier.NVME and self.swap is None:
                raise ValueError(f"register({name!r}, home='nvme'): config.nvme_dir is not set; "
                                 "give nvme_dir or choose another home tier")
            rec = TensorRecord(name, torch.Size(data.shape), dtype or data.dtype, home, self._moves)
            self._check_fits(rec, home)
            if home is Tier.NVME:
                self._check_fits(rec, Tier.HOST, why="NVMe-homed tensors are staged through host memory")
            self._to_home(rec, data)
            return rec

    def prefetch(self, name: str, tier: Tier | str = Tier.DEVICE) -> bool:
        """Start a copy toward `tier` without waiting. True if it is there, on its way, or was
        started; False if there is no room without evicting a pinned copy."""
        rec, tier = self._lookup(name, tier, "prefetch")
        with self._cond:
            self._check_open()
            if tier is rec.home or rec._residency[tier] is not Residency.ABSENT:
                self._touch(rec, tier)
                return True
            self._check_fits(rec, tier)
            return self._try_fetch(rec, tier) is not None

    def acquire(self, name: str, tier: Tier | str = Tier.DEVICE) -> torch.Tensor:
        """The tensor on `tier` (registered shape and dtype), pinned until release()."""
        rec, tier = self._lookup(name, tier, "acquire")
        with torch.profiler.record_function(f"tierzero::acquire {name}"):
            if tier is rec.home:
                return self._acquire_home(rec)
            with self._cond:
                self._check_open()
                hit = rec._residency[tier] is not Residency.ABSENT
                if not hit:
                    self._check_fits(rec, tier)
                    self._wait_until(lambda: self._try_fetch(rec, tier), rec, f"acquire({name!r}, {tier.value!r})")
                copy = rec._copies[tier]
                copy.pins += 1
                self._touch(rec, tier)
                move = self._moves.get(name, tier)
            self.telemetry.record_prefetch(hit)
            if move is not None:
                t0 = time.perf_counter()
                cf.wait([move.future])
                self.telemetry.record_stall(tier, time.perf_counter() - t0)
                if move.dst is tier and move.future.exception() is not None:
                    raise move.future.exception()  # the fetch failed; its copy is gone, pin with it
            with self._cond:
                _assert_in_states(rec, tier, Residency.RESIDENT, Residency.WRITING_BACK)
            self.streams.compute_wait(copy.event, copy.tensor)
            return copy.tensor

    def release(self, name: str, tier: Tier | str = Tier.DEVICE, *, dirty: bool = False) -> None:
        """Unpin; dirty=True writes this copy's contents back to the home tier (async)."""
        rec, tier = self._lookup(name, tier, "release")
        with self._cond:
            self._check_open()
            copy = rec._copies.get(tier)
            if copy is None or copy.pins == 0:
                raise RuntimeError(f"release({name!r}, {tier.value!r}) without a matching acquire()")
            self._touch(rec, tier)
            if dirty and tier is not rec.home:
                # Still pinned while waiting (for an earlier write-back of this copy to finish,
                # and for a staging buffer), so the dirty copy cannot be evicted meanwhile.
                staging_needs = [(Tier.HOST, rec.nbytes)] if rec.home is Tier.NVME and tier is Tier.DEVICE else []
                bufs = self._wait_until(
                    lambda: None if rec._residency[tier] is Residency.WRITING_BACK else self._try_room(staging_needs, rec),
                    rec, f"release({name!r}, {tier.value!r}, dirty=True)")
                copy.pins -= 1
                copy.stale = False
                self._start_writeback(rec, tier, bufs[0] if bufs else None)
            else:
                copy.pins -= 1
                if dirty:
                    self._invalidate_cached(rec, keep=tier)
                if copy.stale and copy.pins == 0 and rec._residency[tier] is Residency.RESIDENT:
                    self._drop(rec, tier)
            self._cond.notify_all()

    def drop(self, name: str, tier: Tier | str) -> None:
        """Free an unpinned cached copy now (after its write-back, if one is in flight)."""
        rec, tier = self._lookup(name, tier, "drop")
        if tier is rec.home:
            raise ValueError(f"drop({name!r}, {tier.value!r}): {tier.value} is the tensor's home; "
                             "only cached copies on other tiers can be dropped")
        with self._cond:
            self._wait_until(lambda: rec._residency[tier] not in (Residency.FETCHING, Residency.WRITING_BACK) or None,
                             rec, f"drop({name!r}) waiting for its move")
            if rec._residency[tier] is Residency.ABSENT:
                return
            if rec._copies[tier].pins:
                raise RuntimeError(f"drop({name!r}, {tier.value!r}): the copy is pinned by "
                                   f"{rec._copies[tier].pins} acquire(s); release it first")
            self._drop(rec, tier)
            self._cond.notify_all()

    def store(self, name: str, data: torch.Tensor) -> None:
        """Overwrite the tensor's contents: its home and every cached copy. An NVMe home is
        written asynchronously from a host staging copy of `data` (later reads wait for it;
        `flush()` raises its error), so the caller may reuse `data` at once."""
        rec = self._record_of(name, "store")
        if tuple(data.shape) != tuple(rec.shape):
            raise ValueError(f"store({name!r}): expected shape {tuple(rec.shape)}, got {tuple(data.shape)}")
        with self._cond:
            self._check_open()
            staging_needs = [(Tier.HOST, rec.nbytes)] if rec.home is Tier.NVME else []
            bufs = self._wait_until(lambda: None if self._moves.for_tensor(name) else self._try_room(staging_needs, rec),
                                    rec, f"store({name!r}) waiting for its moves")
            if rec.home is Tier.NVME:
                staging = bufs[0]
                try:
                    _typed(staging, rec).copy_(data)
                except BaseException:
                    self.pool.free(staging)
                    raise
                move = self._submit(rec, Tier.HOST, Tier.NVME, self._run_store, rec, staging)
                self._moves.add(Tier.NVME, move)  # the key of a store: no other move targets the home
            else:
                self._write_home(rec, data, None)
            for tier, copy in rec._copies.items():
                if tier is not rec.home:
                    copy.tensor.copy_(data)
                    copy.stale = False
                    self.streams.compute_wait(None, copy.tensor)
            self._cond.notify_all()

    def read(self, name: str, out: np.ndarray | None = None) -> torch.Tensor:
        """A CPU copy of the tensor's current contents (its home, after write-backs): fresh, or in
        `out` (a page-aligned uint8 numpy buffer of at least `io_bytes(name)`; reused buffers save
        the page faults of fresh ones when a caller streams many tensors)."""
        rec = self._record_of(name, "read")
        if out is not None and out.nbytes < self.io_bytes(name):
            raise ValueError(f"read({name!r}): out holds {out.nbytes} bytes, expected at least "
                             f"{self.io_bytes(name)}")
        with self._cond:
            self._check_open()
            self._wait_until(lambda: not any(m.dst is rec.home for m in rec.in_flight) or None,
                             rec, f"read({name!r}) waiting for its write-backs")
            home = rec._copies[rec.home]
            if rec.home is not Tier.NVME:
                if out is None:
                    return home.tensor.detach().to("cpu", copy=True)
                dst = _typed(torch.from_numpy(out), rec)
                dst.copy_(home.tensor)
                return dst
            from io_engine import aligned_empty

            buf = torch.from_numpy(aligned_empty(home.buffer.length) if out is None else out)
            self.swap.read(home.buffer, buf.numpy(), name)
            return _typed(buf, rec)

    def reserve_scratch(self, nbytes: int, tier: Tier | str = Tier.DEVICE, *, what: str) -> torch.Tensor:
        """A uint8 buffer of at least `nbytes` on `tier` that the caller fills itself (a block
        gathered from every rank's shards), reserved within the tier's budget like any copy
        (evicting unpinned cached copies, waiting up to wait_timeout_s for releases); give it
        back with free_scratch(). `what` names it in errors."""
        tier = Tier.parse(tier, what=f"reserve_scratch({what!r}) tier")
        if tier is Tier.NVME:
            raise ValueError(f"reserve_scratch({what!r}, 'nvme'): scratch buffers live on 'device' or 'host'")
        rec = TensorRecord(what, torch.Size([nbytes]), torch.uint8, tier, self._moves)  # names it in errors
        with self._cond:
            self._check_open()
            self._check_fits(rec, tier)
            (buf,) = self._wait_until(lambda: self._try_room([(tier, nbytes)], rec), rec,
                                      f"reserve_scratch({what!r}, {tier.value!r})")
        return buf

    def free_scratch(self, buf: torch.Tensor, tier: Tier | str = Tier.DEVICE) -> None:
        """Give back a buffer from reserve_scratch()."""
        with self._cond:
            self._free(Tier.parse(tier), buf)
            self._cond.notify_all()

    def io_bytes(self, name: str) -> int:
        """Bytes a buffer given to read(name, out=...) must hold (NVMe regions are whole pages)."""
        rec = self._record_of(name, "io_bytes")
        return round_up(rec.nbytes) if rec.home is Tier.NVME else rec.nbytes

    def flush(self) -> None:
        """Wait for every move in flight; raise the first write-back error since the last flush."""
        while True:
            with self._cond:
                futures = [m.future for m in self._moves.all()]
            if not futures:
                break
            cf.wait(futures)
        with self._cond:
            errors, self._errors = self._errors, []
        if errors:
            raise errors[0]

    def set_eviction_policy(self, policy: EvictionPolicy) -> None:
        """Choose victims with `policy.order(candidates)` (given least recently used first)."""
        if not callable(getattr(policy, "order", None)):
            raise ValueError(f"set_eviction_policy: expected an object with order(candidates), got {policy!r}")
        with self._cond:
            self._policy = policy

    def bytes_used(self, tier: Tier | str) -> int:
        return self.budgets[Tier.parse(tier)].used

    def peak_bytes(self, tier: Tier | str) -> int:
        return self.budgets[Tier.parse(tier)].peak

    def budget(self, tier: Tier | str) -> int:
        return self.budgets[Tier.parse(tier)].limit

    def close(self) -> None:
        """Finish in-flight work, free every copy, remove the swap files, join threads; idempotent."""
        if self._closed:
            return
        error: BaseException | None = None
        try:
            self.flush()
        except BaseException as e:  # still free everything, then report
            error = e
        self._executor.shutdown(wait=True)
        with self._cond:
            self._closed = True
            for rec in self.records.values():
                for tier in [t for t in rec._copies if t is not rec.home]:
                    self._drop(rec, tier)
                self._free(rec.home, rec._copies.pop(rec.home).buffer)
                rec._residency[rec.home] = Residency.ABSENT
            self._home_bytes = dict.fromkeys(Tier, 0)
        self.pool.close()
        if self.device_pool is not None:
            self.device_pool.close()
        if self.swap is not None:
            self.swap.close()
        if error is not None:
            raise error

    def __enter__(self) -> "PlacementManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        used = ", ".join(f"{t.value}={format_size(b.used)}/{format_size(b.limit)}" for t, b in self.budgets.items())
        return (f"PlacementManager(rank={self.rank}, device={self.device}, tensors={len(self.records)}, "
                f"in_flight={len(self._moves)}, {used})")

    # ---------------------------------------------------------------------- transition methods
    # Each ends by writing the residency it moves to; only these write rec._residency.

    def _to_home(self, rec: TensorRecord, data: torch.Tensor) -> None:
        needs = [(rec.home, rec.nbytes)] + ([(Tier.HOST, rec.nbytes)] if rec.home is Tier.NVME else [])
        buf, *staging = self._wait_until(lambda: self._try_room(needs, rec), rec, f"register({rec.name!r})")
        rec._copies[rec.home] = _Copy(buf, None if rec.home is Tier.NVME else _typed(buf, rec))
        try:
            self._write_home(rec, data, staging[0] if staging else None)
        except BaseException:
            self._free(rec.home, rec._copies.pop(rec.home).buffer)
            raise
        self._home_bytes[rec.home] += self._reserved(rec.home, rec.nbytes)
        self.records[rec.name] = rec
        rec._residency[rec.home] = Residency.HOME

    def _try_fetch(self, rec: TensorRecord, tier: Tier) -> bool | None:
        """Start a copy toward `tier` if there is room now; True if started or already there or
        on its way (another thread may have started it while the caller waited), None if no room."""
        if rec._residency[tier] is not Residency.ABSENT:
            return True
        plan = self._plan_fetch(rec, tier)
        if plan is None:
            return None
        self._start_fetch(rec, tier, plan)
        return True

    def _plan_fetch(self, rec: TensorRecord, tier: Tier) -> _FetchPlan | None:
        """Choose the source of a copy toward `tier` and reserve its buffers (None: no room)."""
        _assert_in_states(rec, tier, Residency.ABSENT)
        src = rec.home
        host = rec._copies.get(Tier.HOST)
        if tier is Tier.DEVICE and rec.home is Tier.NVME and host is not None and not host.stale:
            src = Tier.HOST  # a cached host copy saves the NVMe read and the staging buffer
        needs = [(tier, rec.nbytes)]
        if src is Tier.NVME and tier is Tier.DEVICE:
            needs.append((Tier.HOST, rec.nbytes))
        bufs = self._try_room(needs, rec)
        if bufs is None:
            return None
        return _FetchPlan(src, bufs[0], bufs[1] if len(bufs) > 1 else None)

    def _start_fetch(self, rec: TensorRecord, tier: Tier, plan: _FetchPlan) -> None:
        """ABSENT -> FETCHING: submit the copy into the reserved buffers."""
        _assert_in_states(rec, tier, Residency.ABSENT)
        copy = _Copy(plan.buffer, _typed(plan.buffer, rec))
        source = rec._copies[plan.src]
        source.pins += 1  # keeps the source from being evicted while the move reads it
        after = [m.future for m in rec.in_flight if m.dst is rec.home or m.dst is plan.src]
        source_fetch = self._moves.get(rec.name, plan.src)
        ready = self.streams.compute_ready() if plan.src is Tier.DEVICE else None
        rec._copies[tier] = copy
        self._lru[(rec.name, tier)] = None
        move = self._submit(rec, plan.src, tier, self._run_fetch, rec, plan.src, tier, copy, source,
                            plan.staging, ready, after, source_fetch)
        self._moves.add(tier, move)
        rec._residency[tier] = Residency.FETCHING

    def _finish_fetch(self, rec: TensorRecord, src: Tier, tier: Tier, copy: _Copy, source: _Copy,
                      staging: torch.Tensor | None, event: CopyEvent | None, spans: list[_Span]) -> None:
        """FETCHING -> RESIDENT, or -> ABSENT when the copy failed (event None) or went stale."""
        self._moves.pop(rec.name, tier)
        if staging is not None:
            self.pool.free(staging)
        self._unpin(rec, src, source)
        self._cond.notify_all()
        if event is None or (copy.stale and copy.pins == 0):
            self._drop(rec, tier)
            return
        self._record(rec, spans)
        copy.event = event
        rec._residency[tier] = Residency.RESIDENT

    def _start_writeback(self, rec: TensorRecord, tier: Tier, staging: torch.Tensor | None) -> None:
        """RESIDENT -> WRITING_BACK: submit the copy of this cached copy to the home tier (through
        the reserved host `staging` buffer for device -> NVMe)."""
        _assert_in_states(rec, tier, Residency.RESIDENT)
        copy = rec._copies[tier]
        after = [m.future for m in rec.in_flight]
        ready = self.streams.compute_ready() if tier is Tier.DEVICE else None
        self._invalidate_cached(rec, keep=tier)
        move = self._submit(rec, tier, rec.home, self._run_writeback, rec, tier, copy, staging, ready, after)
        self._moves.add(tier, move)
        rec._residency[tier] = Residency.WRITING_BACK

    def _finish_writeback(self, rec: TensorRecord, tier: Tier, copy: _Copy, staging: torch.Tensor | None,
                          error: BaseException | None, spans: list[_Span]) -> None:
        """WRITING_BACK -> RESIDENT (or ABSENT when it went stale meanwhile and is unpinned)."""
        self._moves.pop(rec.name, tier)
        if staging is not None:
            self.pool.free(staging)
        self._cond.notify_all()
        if error is not None:
            self._errors.append(error)
        else:
            self._record(rec, spans)
        if copy.stale and copy.pins == 0:
            self._drop(rec, tier)
            return
        rec._residency[tier] = Residency.RESIDENT

    def _drop(self, rec: TensorRecord, tier: Tier) -> None:
        """RESIDENT / failed FETCHING -> ABSENT: free the cached copy's bytes."""
        assert tier is not rec.home and self._moves.get(rec.name, tier) is None, (rec, tier)
        copy = rec._copies.pop(tier)
        self._lru.pop((rec.name, tier), None)
        self._free(tier, copy.buffer)
        rec._residency[tier] = Residency.ABSENT

    # ------------------------------------------------------------------------- worker bodies

    def _run_fetch(self, rec: TensorRecord, src: Tier, tier: Tier, copy: _Copy, source: _Copy,
                   staging: torch.Tensor | None, ready: CopyEvent | None, after: list[cf.Future],
                   source_fetch: Move | None) -> None:
        done: CopyEvent | None = None
        spans: list[_Span] = []
        try:
            cf.wait(after)
            if source_fetch is not None and source_fetch.future.exception() is not None:
                raise source_fetch.future.exception()
            with torch.profiler.record_function(f"tierzero::fetch {rec.name}"), self.streams.context():
                t0 = time.perf_counter()
                if src is Tier.NVME:
                    io_buf = copy.buffer if staging is None else staging
                    self.swap.read(source.buffer, io_buf.numpy(), rec.name)
                    spans.append(_Span(Tier.NVME, Tier.HOST, t0, time.perf_counter()))
                    t0 = time.perf_counter()
                event = DONE
                if tier is not Tier.HOST or src is not Tier.NVME:
                    event = self.streams.copy(copy.tensor, source.tensor if staging is None
                                              else _typed(staging, rec), after=ready)
                    # The source and staging are freed at commit: they must outlive the copy.
                    event.synchronize()
                    spans.append(_Span(src if staging is None else Tier.HOST, tier, t0, time.perf_counter()))
            done = event
        finally:
            with self._cond:
                self._finish_fetch(rec, src, tier, copy, source, staging, done, spans)

    def _run_writeback(self, rec: TensorRecord, tier: Tier, copy: _Copy, staging: torch.Tensor | None,
                       ready: CopyEvent | None, after: list[cf.Future]) -> None:
        error: BaseException | None = None
        spans: list[_Span] = []
        try:
            cf.wait(after)
            home = rec._copies[rec.home]
            with torch.profiler.record_function(f"tierzero::writeback {rec.name}"), self.streams.context():
                t0 = time.perf_counter()
                if rec.home is not Tier.NVME:
                    self.streams.copy(home.tensor, copy.tensor, after=ready).synchronize()
                    spans.append(_Span(tier, rec.home, t0, time.perf_counter()))
                else:
                    io_buf = copy.buffer
                    if staging is not None:
                        self.streams.copy(_typed(staging, rec), copy.tensor, after=ready).synchronize()
                        spans.append(_Span(tier, Tier.HOST, t0, time.perf_counter()))
                        io_buf, t0 = staging, time.perf_counter()
                    self.swap.write(home.buffer, io_buf.numpy(), rec.name)
                    spans.append(_Span(Tier.HOST, Tier.NVME, t0, time.perf_counter()))
        except BaseException as e:
            error = e
            raise
        finally:
            with self._cond:
                self._finish_writeback(rec, tier, copy, staging, error, spans)

    def _run_store(self, rec: TensorRecord, staging: torch.Tensor) -> None:
        error: BaseException | None = None
        t0 = time.perf_counter()
        try:
            with torch.profiler.record_function(f"tierzero::store {rec.name}"):
                self.swap.write(rec._copies[rec.home].buffer, staging.numpy(), rec.name)
        except BaseException as e:
            error = e
            raise
        finally:
            with self._cond:
                self._moves.pop(rec.name, Tier.NVME)
                self.pool.free(staging)
                if error is not None:
                    self._errors.append(error)
                else:
                    self._record(rec, [_Span(Tier.HOST, Tier.NVME, t0, time.perf_counter())])
                self._cond.notify_all()

    # ----------------------------------------------------------------------------- helpers

    def _acquire_home(self, rec: TensorRecord) -> torch.Tensor:
        if rec.home is Tier.NVME:
            raise ValueError(f"acquire({rec.name!r}, 'nvme'): NVMe holds bytes, not tensors; "
                             "acquire it on 'host' or 'device'")
        with self._cond:
            self._check_open()
            self._wait_until(lambda: not any(m.dst is rec.home for m in rec.in_flight) or None,
                             rec, f"acquire({rec.name!r}) waiting for write-backs to its home")
            copy = rec._copies[rec.home]
            copy.pins += 1
        self.streams.compute_wait(None, copy.tensor)
        return copy.tensor

    def _write_home(self, rec: TensorRecord, data: torch.Tensor, staging: torch.Tensor | None) -> None:
        """Synchronously overwrite the home copy (an NVMe home through the reserved `staging`)."""
        home = rec._copies[rec.home]
        if rec.home is not Tier.NVME:
            home.tensor.copy_(data)
            self.streams.compute_wait(None, home.tensor)  # written on the compute stream
            return
        try:
            _typed(staging, rec).copy_(data)
            t0 = time.perf_counter()
            self.swap.write(home.buffer, staging.numpy(), rec.name)
            self._record(rec, [_Span(Tier.HOST, Tier.NVME, t0, time.perf_counter())])
        finally:
            self.pool.free(staging)

    def _invalidate_cached(self, rec: TensorRecord, *, keep: Tier) -> None:
        """The copy on `keep` was written: other cached copies hold old data."""
        for tier in [t for t in rec._copies if t is not keep and t is not rec.home]:
            copy = rec._copies[tier]
            if rec._residency[tier] is Residency.RESIDENT and copy.pins == 0:
                self._drop(rec, tier)
            else:
                copy.stale = True

    def _unpin(self, rec: TensorRecord, tier: Tier, copy: _Copy) -> None:
        copy.pins -= 1
        if (rec._copies.get(tier) is copy and copy.stale and copy.pins == 0
                and rec._residency[tier] is Residency.RESIDENT):
            self._drop(rec, tier)

    def _try_room(self, needs: list[tuple[Tier, int]], rec: TensorRecord) -> list[Any] | None:
        """Buffers for every (tier, nbytes) in `needs`, evicting unpinned cached copies by policy;
        all or nothing (so no reservation is ever held while waiting for another), None if no room."""
        got: list[Any] = []
        for tier, nbytes in needs:
            buf = self._alloc_evicting(tier, nbytes, rec.name)
            if buf is None:
                for (t, _), b in zip(needs, got):
                    self._free(t, b)
                self._shortfall = (tier, nbytes)
                return None
            got.append(buf)
        return got

    def _wait_until(self, attempt: Callable[[], _T | None], rec: TensorRecord, what: str) -> _T:
        """Call `attempt` (under the lock) until it returns non-None, sleeping until the next
        change in between; past wait_timeout_s raise, naming what was missing."""
        deadline = time.monotonic() + self.wait_timeout_s
        while True:
            self._shortfall = None
            result = attempt()
            if result is not None:
                return result
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if self._shortfall is None:
                    raise RuntimeError(f"{what}: nothing changed for {self.wait_timeout_s} s")
                raise RuntimeError(f"{what}: {self._no_room_message(rec, *self._shortfall)}")
            self._cond.wait(remaining)

    def _alloc_evicting(self, tier: Tier, nbytes: int, exclude: str) -> Any | None:
        buf = self._alloc(tier, nbytes)
        if buf is not None or tier is Tier.NVME:
            return buf
        evictable = [n for (n, t) in self._lru if t is tier and n != exclude
                     and self.records[n]._residency[tier] is Residency.RESIDENT
                     and self.records[n]._copies[tier].pins == 0]
        allowed = set(evictable)
        for victim in self._policy.order(evictable):
            if victim not in allowed or self.records[victim]._residency[tier] is not Residency.RESIDENT:
                continue
            self._drop(self.records[victim], tier)
            buf = self._alloc(tier, nbytes)
            if buf is not None:
                return buf
        return None

    def _alloc(self, tier: Tier, nbytes: int) -> Any | None:
        if tier is Tier.HOST:
            return self.pool.try_alloc(nbytes)
        if tier is Tier.NVME:
            return self.swap.try_alloc(nbytes)
        if self.device_pool is not None:
            return self.device_pool.try_alloc(nbytes)
        if not self.budgets[Tier.DEVICE].try_reserve(nbytes):
            return None
        try:
            with self.streams.alloc_context():
                return torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        except BaseException:
            self.budgets[Tier.DEVICE].release(nbytes)
            raise

    def _free(self, tier: Tier, buf: Any) -> None:
        if tier is Tier.HOST:
            self.pool.free(buf)
        elif tier is Tier.NVME:
            self.swap.free(buf)
        elif self.device_pool is not None:
            self.device_pool.free(buf)
        else:
            self.budgets[Tier.DEVICE].release(buf.numel())

    def _reserved(self, tier: Tier, nbytes: int) -> int:
        """Bytes a tensor of `nbytes` reserves on `tier` (buffers are rounded up)."""
        if tier is Tier.HOST:
            return self.pool.bucket(nbytes)
        if tier is Tier.NVME:
            return round_up(nbytes)
        return nbytes if self.device_pool is None else self.device_pool.bucket(nbytes)

    def _check_fits(self, rec: TensorRecord, tier: Tier, *, why: str = "") -> None:
        need = self._reserved(tier, rec.nbytes)
        limit = self.budgets[tier].limit
        homes = self._home_bytes[tier]
        if need <= limit - homes:
            return
        because = f" ({why})" if why else ""
        if need > limit:
            raise ValueError(
                f"tensor {rec.name!r} ({rec.nbytes} bytes) needs {format_size(need)} ({need} bytes) on the {tier.value} tier"
                f"{because} but the {tier.value} budget is {format_size(limit)} ({limit} bytes); raise "
                f"{tier.value}_budget to at least {need} bytes or split the tensor into smaller blocks")
        raise ValueError(
            f"tensor {rec.name!r} ({rec.nbytes} bytes) needs {format_size(need)} ({need} bytes) on the "
            f"{tier.value} tier{because} but tensors homed there already hold {format_size(homes)} of its "
            f"{format_size(limit)} budget; raise {tier.value}_budget or home some tensors on another tier")

    def _no_room_message(self, rec: TensorRecord, tier: Tier, nbytes: int) -> str:
        pinned = [(n, r._copies[tier].pins) for n, r in self.records.items()
                  if tier in r._copies and r._copies[tier].pins]
        b = self.budgets[tier]
        return (f"tensor {rec.name!r}: no room for {format_size(self._reserved(tier, nbytes))} on the "
                f"{tier.value} tier after waiting {self.wait_timeout_s} s: {format_size(b.used)} of "
                f"{format_size(b.limit)} reserved, {len(self._moves)} moves in flight, pinned copies "
                f"(name, pins): {pinned[:8]}{' ...' if len(pinned) > 8 else ''}; release tensors "
                f"before acquiring more, or raise {tier.value}_budget")

    def _submit(self, rec: TensorRecord, src: Tier, dst: Tier, fn: Any, *args: Any) -> Move:
        future = self._executor.submit(fn, *args)
        return Move(rec.name, src, dst, rec.nbytes, future, time.perf_counter())

    def _record(self, rec: TensorRecord, spans: list[_Span]) -> None:
        for span in spans:
            self.telemetry.record_move(rec.name, span.src, span.dst, rec.nbytes, span.start, span.end)

    def _touch(self, rec: TensorRecord, tier: Tier) -> None:
        if (rec.name, tier) in self._lru:
            self._lru.move_to_end((rec.name, tier))

    def _record_of(self, name: str, what: str) -> TensorRecord:
        rec = self.records.get(name)
        if rec is None:
            raise KeyError(f"{what}: no tensor named {name!r} is registered")
        return rec

    def _lookup(self, name: str, tier: Tier | str, what: str) -> tuple[TensorRecord, Tier]:
        tier = Tier.parse(tier, what=f"{what}({name!r}) tier")
        rec = self._record_of(name, what)
        if tier is Tier.NVME and tier is not rec.home:
            raise ValueError(f"{what}({name!r}, 'nvme'): only tensors homed on NVMe live there; "
                             "use 'host' or 'device'")
        return rec, tier

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("PlacementManager is closed")


def _typed(buf: torch.Tensor, rec: TensorRecord) -> torch.Tensor:
    """The first nbytes of a flat uint8 buffer viewed with the record's dtype and shape."""
    return buf[: rec.nbytes].view(rec.dtype).view(rec.shape)


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device

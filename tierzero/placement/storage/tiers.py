"""Tiers, byte budgets and the host tier's memory.

Every byte a tier holds is reserved from that tier's `Budget` before the memory is allocated or
the move that fills it starts, and is given back when the memory is freed, so a budget is never
exceeded, not even for a moment. Host memory is page-aligned always (so NVMe reads and writes
can use O_DIRECT) and comes from one of two pools with the same interface:

    HostPool     buffers allocated as needed, a free one cached for the next request of its
                 size (cached buffers count in the budget: the memory is still held); the
                 host tier of a CPU run, and the device tier's memory on the CPU
    PinnedArena  one region the size of the budget, pinned once with CUDA (exactly its pages),
                 handed out in 4 KiB-aligned slices, in huge pages where the kernel gives
                 them; the host tier with CUDA and in the stream stand-in
"""

from __future__ import annotations

import bisect
import contextlib
import mmap
import threading
from collections.abc import Collection, Sequence
from typing import Callable

import torch

from io_engine import aligned_empty
from tierzero.config import PAGE, Tier, windowed_bytes

ALIGNMENT = PAGE
"""Alignment (bytes) of host buffers and NVMe extents: the page size O_DIRECT needs
(tierzero/config/pages.py, with the rounding and the working set's room: one rule each)."""

HUGE_PAGE = 2 << 20
"""Where the host arena's region starts (x86-64's transparent huge page)."""

BudgetHook = Callable[[Tier, int], None]


def round_up(nbytes: int, multiple: int = ALIGNMENT) -> int:
    """tierzero.config.round_up, on the fetch path: kept inside placement so that a fetch crosses
    no package for arithmetic (tests/benchmarks/test_crossings.py)."""
    return -(-nbytes // multiple) * multiple


class Budget:
    """The byte account of one tier: reservations are taken before memory is used.

    Thread-safe. `used` never exceeds `limit` (reserve refuses or waits instead); `peak` is the
    highest `used` seen since creation or `reset_peak()`. Hooks run after every change, under the
    budget's lock, with (tier, used); they must be cheap and must not call back into the budget.
    """

    def __init__(self, tier: Tier, limit: int) -> None:
        if limit < 0:
            raise ValueError(f"{tier} budget: expected a non-negative byte count, got {limit}")
        self.tier = tier
        self.limit = int(limit)
        self._used = 0
        self._peak = 0
        self._hooks: list[BudgetHook] = []
        self._cond = threading.Condition(threading.Lock())

    @property
    def used(self) -> int:
        return self._used

    @property
    def peak(self) -> int:
        return self._peak

    @property
    def free(self) -> int:
        return self.limit - self._used

    def add_hook(self, hook: BudgetHook) -> None:
        with self._cond:
            self._hooks.append(hook)

    def try_reserve(self, nbytes: int) -> bool:
        """Reserve `nbytes` if they fit now; False (and nothing reserved) otherwise."""
        with self._cond:
            return self._reserve_locked(nbytes)

    def reserve(self, nbytes: int, timeout: float | None = None) -> None:
        """Reserve `nbytes`, waiting for releases; TimeoutError after `timeout` seconds."""
        if nbytes > self.limit:
            raise ValueError(f"{self.tier} budget: {nbytes} bytes can never fit a budget of {self.limit} bytes")
        with self._cond:
            if not self._cond.wait_for(lambda: self._reserve_locked(nbytes), timeout):
                raise TimeoutError(
                    f"{self.tier} budget: {nbytes} bytes did not become free within {timeout} s "
                    f"({self._used} of {self.limit} bytes reserved)")

    def release(self, nbytes: int) -> None:
        with self._cond:
            assert 0 <= nbytes <= self._used, f"{self.tier}: releasing {nbytes} of {self._used} bytes"
            self._used -= nbytes
            self._changed()
            self._cond.notify_all()

    def reset_peak(self) -> None:
        with self._cond:
            self._peak = self._used

    def _reserve_locked(self, nbytes: int) -> bool:
        assert nbytes >= 0, nbytes
        if self._used + nbytes > self.limit:
            return False
        self._used += nbytes
        self._peak = max(self._peak, self._used)
        self._changed()
        return True

    def _changed(self) -> None:
        for hook in self._hooks:
            hook(self.tier, self._used)

    def __repr__(self) -> str:
        return f"Budget({self.tier.value}, used={self._used}, peak={self._peak}, limit={self.limit})"


class HostPool:
    """Reusable page-aligned host buffers, all counted in their budget.

    Buffers are flat uint8 tensors whose size is a bucket: a multiple of 4096 bytes. A freed
    buffer is cached for the next request of the same bucket; cached buffers are dropped,
    largest first, when a request does not fit otherwise.
    """

    pinned = False

    def __init__(self, budget: Budget) -> None:
        self.budget = budget
        self._lock = threading.Lock()
        self._free: dict[int, list[torch.Tensor]] = {}
        self._cached_bytes = 0
        self._in_use: dict[int, int] = {}  # data_ptr -> bucket size of buffers handed out

    def bucket(self, nbytes: int) -> int:
        return round_up(max(nbytes, 1))

    @property
    def cached_bytes(self) -> int:
        return self._cached_bytes

    @property
    def in_use_bytes(self) -> int:
        with self._lock:
            return sum(self._in_use.values())

    @property
    def in_use_count(self) -> int:
        return len(self._in_use)

    def try_alloc(self, nbytes: int, *, home: bool = False) -> torch.Tensor | None:
        """A buffer of bucket(nbytes) bytes, or None when the host budget cannot hold it (`home`
        makes no difference: buffers are reused by size)."""
        size = self.bucket(nbytes)
        with self._lock:
            cached = self._free.get(size)
            if cached:
                buf = cached.pop()
                self._cached_bytes -= size
            else:
                if not self.budget.try_reserve(size):
                    self._trim_locked(size - self.budget.free)
                    if not self.budget.try_reserve(size):
                        return None
                try:
                    buf = self._new_buffer(size)
                except BaseException:
                    self.budget.release(size)
                    raise
            self._in_use[buf.data_ptr()] = size
            return buf

    def free(self, buf: torch.Tensor) -> None:
        """Give a buffer back; it is cached for reuse and still counted in the budget."""
        with self._lock:
            size = self._in_use.pop(buf.data_ptr())
            self._free.setdefault(size, []).append(buf)
            self._cached_bytes += size

    def victims(self, nbytes: int, candidates: Sequence[torch.Tensor]) -> None:
        """None: any bytes given back serve a request (the memory is not one region)."""

    def bytes_for(self, sizes: Sequence[int]) -> int:
        """Bytes the pool needs to hold buffers of `sizes` at once: their buckets."""
        return sum(self.bucket(n) for n in sizes)

    def trim(self, sizes: Collection[int] | None = None) -> int:
        """Drop every cached buffer (or those of the buckets of `sizes` bytes), giving its bytes
        back to the budget and its memory to the system; returns the bytes."""
        with self._lock:
            return self._trim_locked(self._cached_bytes, None if sizes is None else {self.bucket(n) for n in sizes})

    def close(self) -> None:
        """Drop the cache; every buffer handed out must have been freed."""
        self.trim()
        if self._in_use:
            raise RuntimeError(f"HostPool closed with {len(self._in_use)} buffers "
                               f"({sum(self._in_use.values())} bytes) still in use")

    def _trim_locked(self, want: int, buckets: set[int] | None = None) -> int:
        """Drop cached buffers, largest first (of `buckets` only, if given), until `want` bytes
        are given back or none is left; returns the bytes."""
        freed = 0
        for size in sorted(self._free.keys() if buckets is None else self._free.keys() & buckets, reverse=True):
            bufs = self._free[size]
            while bufs and freed < want:
                bufs.pop()
                self._cached_bytes -= size
                self.budget.release(size)
                freed += size
        self._free = {s: b for s, b in self._free.items() if b}
        return freed

    def _new_buffer(self, size: int) -> torch.Tensor:
        buf = torch.from_numpy(aligned_empty(size, ALIGNMENT))
        if buf.data_ptr() % ALIGNMENT:
            raise RuntimeError(f"host buffer of {size} bytes at {buf.data_ptr():#x} is not "
                               f"{ALIGNMENT}-byte aligned; O_DIRECT IO needs page-aligned buffers")
        return buf

    def __repr__(self) -> str:
        return (f"HostPool(in_use={self.in_use_bytes}, cached={self._cached_bytes}, "
                f"budget={self.budget!r})")


# [Note: arena windows] A slice needs one free extent, not just budget: freeing cached copies in
# least-recently-used order until one opens up gives back far more than the request (each freed
# slice may sit between slices that stay), and a copy given back is usually read again. So the
# arena picks its victims itself (`victims`): the window of the request's size, made of free
# extents and slices offered for eviction, whose most recent victim is least recent (what LRU
# alone would reach at best), and of those the one that gives back the fewest bytes. When no
# window opens without dirty copies, those of one window are written home, the same way
# (Room._clean_window in eviction.py), not the least recently used ones. A HostPool has no windows:
# any bytes given back serve.
class PinnedArena:
    """The host tier's memory as one region the size of its budget (see the module docstring),
    pinned at construction with CUDA (`cudaHostRegister`: the pinned bytes are the region's,
    never more than the budget) and unpinned at close. Slices are 4 KiB-aligned, the smallest
    free extent that fits (best fit), merged with their free neighbours when given back; a
    request that fits the budget but no free extent (fragmentation) gets None, as a full budget
    does, so the caller evicts or waits. `on_free` sees every buffer given back (the stream
    stand-in checks no copy is still queued on it). Homes (alive as long as their tensors) are
    cut from the top of the highest free extent that fits, everything else from the bottom, so
    that buffers that come and go do not leave holes between the ones that stay. Thread-safe."""

    def __init__(self, budget: Budget, *, pin: bool, on_free: Callable[[torch.Tensor], None] | None = None) -> None:
        self.budget = budget
        self.pinned = pin
        self.size = budget.limit // ALIGNMENT * ALIGNMENT
        self._on_free = on_free
        self._lock = threading.Lock()
        # An anonymous mapping, its pages untouched until used, in huge pages where the kernel
        # gives them on request (transparent_hugepage "madvise", the usual default): the region
        # starts on a huge page. With 4 KiB pages, the copies in and out of the tier and the
        # optimizer's updates over it cost a fifth more CPU: 16.1-17.6 CPU s a step at 1b
        # against 13.4 (nvme_floor on a 2-core VM, benchmarks/RESULTS.md). numpy's large
        # buffers, a HostPool's, get huge pages the same way.
        self._map = mmap.mmap(-1, max(self.size, ALIGNMENT) + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if hasattr(mmap, "MADV_HUGEPAGE"):
            with contextlib.suppress(OSError):  # a kernel built without them refuses (EINVAL)
                self._map.madvise(mmap.MADV_HUGEPAGE)
        whole = torch.frombuffer(self._map, dtype=torch.uint8)
        skip = -whole.data_ptr() % HUGE_PAGE
        self.region = whole[skip: skip + self.size]
        self.base = self.region.data_ptr()
        if pin and self.size:
            error = int(torch.cuda.cudart().cudaHostRegister(self.base, self.size, 0))
            if error:
                raise RuntimeError(f"pinning the host tier's {self.size} bytes failed (cudaHostRegister error "
                                   f"{error}); lower host_budget, or raise the locked-memory limit (ulimit -l)")
        self._starts: list[int] = [0] if self.size else []
        """Offsets of the free extents, sorted; `_lengths` holds each one's length."""
        self._lengths: dict[int, int] = {0: self.size} if self.size else {}
        self._in_use: dict[int, tuple[int, int]] = {}  # data_ptr -> (offset, length)

    def bucket(self, nbytes: int) -> int:
        """Bytes a buffer of `nbytes` takes: whole pages."""
        return round_up(max(nbytes, 1))

    cached_bytes = 0
    """Nothing is cached: given-back bytes return to the budget at once."""

    @property
    def in_use_bytes(self) -> int:
        with self._lock:
            return sum(length for _, length in self._in_use.values())

    @property
    def in_use_count(self) -> int:
        return len(self._in_use)

    def try_alloc(self, nbytes: int, *, home: bool = False) -> torch.Tensor | None:
        """A slice of bucket(nbytes) bytes, or None when the budget or the free extents lack room."""
        size = self.bucket(nbytes)
        with self._lock:
            fits = [s for s in self._starts if self._lengths[s] >= size]
            if not fits or not self.budget.try_reserve(size):
                return None
            extent = fits[-1] if home else min(fits, key=lambda s: (self._lengths[s], s))
            length = self._lengths.pop(extent)
            self._starts.remove(extent)
            start = extent + length - size if home else extent
            rest = extent if home else extent + size
            if length > size:
                bisect.insort(self._starts, rest)
                self._lengths[rest] = length - size
            buf = self.region[start: start + size]
            self._in_use[buf.data_ptr()] = (start, size)
            return buf

    def free(self, buf: torch.Tensor) -> None:
        """Give a slice back: its bytes return to the budget and its extent to the free ones."""
        if self._on_free is not None:
            self._on_free(buf)
        with self._lock:
            start, size = self._in_use.pop(buf.data_ptr())
            self.budget.release(size)
            i = bisect.bisect(self._starts, start)
            if i < len(self._starts) and self._starts[i] == start + size:  # merge the next extent
                size += self._lengths.pop(self._starts.pop(i))
            if i > 0 and self._starts[i - 1] + self._lengths[self._starts[i - 1]] == start:  # and the previous
                start = self._starts[i - 1]
                size += self._lengths[start]
            else:
                self._starts.insert(i, start)
            self._lengths[start] = size

    def victims(self, nbytes: int, candidates: Sequence[torch.Tensor]) -> list[int]:
        """Which of `candidates` (slices that may be given back, victims first) to give back so
        that a slice of `nbytes` fits, in their order; [] when no choice of them makes room.
        See [Note: arena windows]."""
        size, stays = self.bucket(nbytes), len(candidates)
        rank = {c.data_ptr(): i for i, c in enumerate(candidates)}
        with self._lock:
            # The arena in address order, as (length, rank): -1 free, `stays` a slice not offered.
            pieces = [(n, r) for _, n, r in sorted(
                [(s, n, -1) for s, n in self._lengths.items()]
                + [(s, n, rank.get(p, stays)) for p, (s, n) in self._in_use.items()])]

        def window(latest: int) -> tuple[int, int, int] | None:
            """(bytes given back, first, last piece) of the window of `size` bytes that gives back
            the fewest, among those whose victims all rank at most `latest`."""
            found, lo, length, given = None, 0, 0, 0
            for hi, (n, r) in enumerate(pieces):
                if r > latest:
                    lo, length, given = hi + 1, 0, 0
                    continue
                length, given = length + n, given + (n if r >= 0 else 0)
                while length - pieces[lo][0] >= size:  # the shortest window ending here
                    length -= pieces[lo][0]
                    given -= pieces[lo][0] if pieces[lo][1] >= 0 else 0
                    lo += 1
                if length >= size and (found is None or given < found[0]):
                    found = (given, lo, hi)
            return found

        if window(stays - 1) is None:
            return []
        lo, hi = -1, stays - 1  # bisect for the least recent latest victim that opens a window
        while lo < hi:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if window(mid) is not None else (mid + 1, hi)
        found = window(lo)
        assert found is not None
        return sorted(r for _, r in pieces[found[1]: found[2] + 1] if r >= 0)

    # [Note: working set windows] A working set acquired one tensor at a time (a block's update:
    # gradient, master weights, moments, beside the root's gradient backward holds) needs, for
    # its last slice, one gap of that slice's size between the slices held already, not just free
    # bytes. Where those were cut depends on what was cached when they were read (a read-ahead
    # copy is pinned where it lies) and no pinned slice can move, so the sum of the sizes is not
    # enough: the built-in tiny model at exactly that sum (3330048 bytes, everything on NVMe,
    # step_in_backward) failed under the stream stand-in for 8 of 10 delay seeds, its last 776
    # KiB moment facing 480 KiB free and 444 KiB of evictable copies on either side of the three
    # slices it held. With k slices held, k + 1 gaps (between them and at the region's ends)
    # share what is left; when it is at least (k + 1) * (last - 4 KiB) + 4 KiB, one gap takes the
    # last slice, evicting and writing back what lies there. The largest slice counts as the last
    # (the worst order). Homes are not among the k: cut from the top first, at wrap, they stay
    # together at the region's end. The construction check asks for this (Room.check_working_set),
    # so an accepted budget trains whatever the placement; the price is about twice the working
    # set's bytes on the host tier of CUDA and of the stand-in (a HostPool needs only the sum).
    def bytes_for(self, sizes: Sequence[int]) -> int:
        """Bytes of region in which slices of `sizes`, taken one at a time and held together,
        always find a window, wherever the ones taken first were cut. See [Note: working set
        windows]."""
        return windowed_bytes(sizes)

    def trim(self, sizes: Collection[int] | None = None) -> int:
        """Nothing: the arena caches no buffers (its region stays, pinned, the budget's size)."""
        return 0

    def close(self) -> None:
        """Unpin the region; every slice must have been given back."""
        if self._in_use:
            raise RuntimeError(f"PinnedArena closed with {len(self._in_use)} buffers "
                               f"({sum(n for _, n in self._in_use.values())} bytes) still in use")
        if self.pinned and self.size and self.base:
            torch.cuda.cudart().cudaHostUnregister(self.base)
            self.base = 0

    def __repr__(self) -> str:
        kind = "pinned" if self.pinned else "pageable"
        return f"PinnedArena({kind}, {self.size} bytes, in_use={self.in_use_bytes}, budget={self.budget!r})"

"""The tiers' memory: one store per tier hands out buffers within that tier's budget.

PlacementManager asks a store for a copy's bytes (`alloc`: a buffer, or None when the budget
has no room now), gives them back (`free`) and learns what a tensor really reserves there
(`reserved`: buffers are rounded up). DEVICE: `CudaTier` (torch's caching allocator, its freed
bytes back in the budget once the streams are past them) or, without CUDA, a `PoolTier` over
a HostPool of its own (reused as CUDA reuses blocks; in the stand-in held back after a free
until the copies queued on them ran); HOST: a `PoolTier` over the host pool (a PinnedArena
with CUDA and in the stand-in, else a HostPool); NVME: `NvmeTier`, regions of the swap files.
A store's budget counts everything it holds (a pool's cached free buffers too); the stores are
not thread-safe on their own: PlacementManager calls them under its lock.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Sequence
from typing import Any, Callable, Protocol, TypeVar, Union

import torch

from tierzero.config import Tier
from tierzero.placement.handles import TensorHandle
from tierzero.placement.storage.nvme import SwapRegion, SwapSpace
from tierzero.placement.storage.streams import CopyStreams
from tierzero.placement.storage.tiers import Budget, HostPool, PinnedArena, round_up

T = TypeVar("T")

Buffer = Union[torch.Tensor, SwapRegion]
"""What holds one copy's reservation: a flat uint8 tensor (device or host) or an NVMe region."""


class TierStore(Protocol):
    """One tier's memory, as PlacementManager uses it."""

    tier: Tier
    budget: Budget

    def alloc(self, nbytes: int, *, home: bool = False) -> Buffer | None:
        """A buffer of at least `nbytes`, reserved from the budget; None when it has no room.
        `home`: it lives as long as its tensor (a pinned arena keeps those apart)."""
        ...

    def free(self, buffer: Buffer) -> None:
        """Give back a buffer from alloc()."""
        ...

    def reserved(self, nbytes: int) -> int:
        """Bytes a buffer of `nbytes` takes from the budget."""
        ...

    def victims(self, nbytes: int, candidates: Sequence[Buffer]) -> list[int] | None:
        """Which of `candidates` (victims first) to free so that `nbytes` fit, in their order;
        None where any bytes freed serve (see [Note: arena windows] in tiers.py)."""
        ...

    def bytes_for(self, sizes: Sequence[int]) -> int:
        """Bytes of budget in which buffers of `sizes`, taken one at a time and held together,
        always fit (more than their sum where the memory is one region)."""
        ...

    def view(self, buffer: Buffer, handle: TensorHandle) -> torch.Tensor | None:
        """The buffer as the handle's tensor (shape, dtype); None on a tier of bytes (NVMe)."""
        ...

    def settle(self) -> None:
        """Wait until what was freed is free for real (CUDA: the streams that used it are past it)."""
        ...

    def trim(self, sizes: Collection[int]) -> int:
        """Give back the free buffers the store caches for requests of `sizes` bytes (memory
        no request will ask for soon); returns the bytes given back to the budget."""
        ...

    def close(self) -> None:
        """Give back what the store still caches; every buffer must have been freed."""
        ...


def typed(buf: torch.Tensor, handle: TensorHandle) -> torch.Tensor:
    """The first nbytes of a flat uint8 buffer viewed with the handle's dtype and shape."""
    return buf[: handle.nbytes].view(handle.dtype).view(handle.shape)


def as_memory(buffer: Buffer) -> torch.Tensor:
    """A buffer known to be memory (not an NVMe region)."""
    assert isinstance(buffer, torch.Tensor), f"expected a memory buffer, got {buffer!r}"
    return buffer


def region(buffer: Buffer) -> SwapRegion:
    """A buffer known to be an NVMe region."""
    assert isinstance(buffer, SwapRegion), f"expected an NVMe region, got {type(buffer).__name__}"
    return buffer


class HeldFrees:
    """Frees held back until the streams that used the memory are past it (`CudaTier`, and a
    `PoolTier` of the stream stand-in): each is given back once all its events completed, as
    torch's caching allocator holds a block back from reuse without blocking the host."""

    def __init__(self, give_back: Callable[[Any], None]) -> None:
        self._give_back = give_back
        self._held: list[tuple[Any, list[Any]]] = []

    def hold(self, what: Any, events: list[Any]) -> None:
        self._held.append((what, events))

    def take(self, attempt: Callable[[], T]) -> T:
        """`attempt()` (a reservation: None or False when there is no room) after giving back
        what the streams are past; where it finds no room and frees are held, again once they
        are all given back (the room is short: wait for the streams to pass the freed memory)."""
        self.reap(wait=False)
        got = attempt()
        if (got is None or got is False) and self._held:
            self.reap(wait=True)
            got = attempt()
        return got

    def reap(self, *, wait: bool) -> None:
        """Give back what its streams are past (wait: all of it, once they are)."""
        if not self._held:
            return
        keep = []
        for what, events in self._held:
            if wait:
                for e in events:
                    with contextlib.suppress(Exception):  # an error surfaces where its own event is awaited
                        e.synchronize()
            if wait or all(e.query() for e in events):
                self._give_back(what)
            else:
                keep.append((what, events))
        self._held = keep


class PoolTier:
    """A tier whose memory comes from a host pool: the host tier, and the device tier on the
    CPU (see the module docstring), whose buffers `streams` registers and announces freed."""

    def __init__(self, tier: Tier, pool: HostPool | PinnedArena, streams: CopyStreams | None = None) -> None:
        self.tier = tier
        self.pool = pool
        self.budget = pool.budget
        self.streams = streams
        self._held = HeldFrees(self._give_back)
        """Device buffers freed while copies queued on them had not run (the stream stand-in):
        the pool's and the budget's until the copies ran. Waiting at the free instead held the
        placement lock for a whole copy, where CUDA's host goes on."""

    def alloc(self, nbytes: int, *, home: bool = False) -> torch.Tensor | None:
        buf = self._held.take(lambda: self.pool.try_alloc(nbytes, home=home))
        if buf is not None and self.streams is not None:
            self.streams.register(buf)
        return buf

    def free(self, buffer: Buffer) -> None:
        buf = as_memory(buffer)
        if self.streams is None:
            self.pool.free(buf)
            return
        events, unrecorded = self.streams.freeing(buf)
        if events:
            self._held.hold(buf, events)
        else:
            self._give_back(buf)
        if unrecorded is not None:
            raise RuntimeError(
                f"tierzero (stream stand-in): the device buffer {unrecorded!r} was handed to compute and "
                "freed without compute recording its use (CopyStreams.compute_wait): on CUDA the caching "
                "allocator could hand its memory to the next copy while kernels still read it")

    def reserved(self, nbytes: int) -> int:
        return self.pool.bucket(nbytes)

    def victims(self, nbytes: int, candidates: Sequence[Buffer]) -> list[int] | None:
        return self.pool.victims(nbytes, [as_memory(c) for c in candidates])

    def bytes_for(self, sizes: Sequence[int]) -> int:
        return self.pool.bytes_for(sizes)

    def view(self, buffer: Buffer, handle: TensorHandle) -> torch.Tensor:
        return typed(as_memory(buffer), handle)

    def _give_back(self, buf: torch.Tensor) -> None:
        assert self.streams is not None
        self.streams.freed(buf)
        self.pool.free(buf)

    def settle(self) -> None:
        self._held.reap(wait=True)

    def trim(self, sizes: Collection[int]) -> int:
        self._held.reap(wait=False)
        return self.pool.trim(sizes)

    def close(self) -> None:
        self._held.reap(wait=True)
        self.pool.close()

    def __repr__(self) -> str:
        return f"PoolTier({self.tier.value}, {self.pool!r})"


class CudaTier:
    """The device tier on CUDA: exact-size buffers from torch's caching allocator. A freed
    buffer that other streams used (compute, d2h) stays in the budget until events recorded on
    those streams at the free complete: until then the allocator keeps the memory too."""

    def __init__(self, budget: Budget, streams: CopyStreams) -> None:
        self.tier = Tier.DEVICE
        self.budget = budget
        self.streams = streams
        self._held = HeldFrees(self.budget.release)
        """The bytes of freed buffers whose streams may still use them."""

    def alloc(self, nbytes: int, *, home: bool = False) -> torch.Tensor | None:
        if not self._held.take(lambda: self.budget.try_reserve(nbytes)):
            return None
        try:
            with self.streams.alloc_context():
                buf = torch.empty(nbytes, dtype=torch.uint8, device=self.streams.device)
        except BaseException:
            self.budget.release(nbytes)
            raise
        self.streams.register(buf)
        return buf

    def free(self, buffer: Buffer) -> None:
        buf = as_memory(buffer)
        events, _ = self.streams.freeing(buf)
        if events:
            self._held.hold(buf.numel(), events)
        else:
            self.budget.release(buf.numel())

    def reserved(self, nbytes: int) -> int:
        return nbytes

    def victims(self, nbytes: int, candidates: Sequence[Buffer]) -> None:
        return None  # the caching allocator's memory: any bytes freed serve

    def bytes_for(self, sizes: Sequence[int]) -> int:
        return sum(sizes)

    def view(self, buffer: Buffer, handle: TensorHandle) -> torch.Tensor:
        return typed(as_memory(buffer), handle)

    def settle(self) -> None:
        self._held.reap(wait=True)

    def trim(self, sizes: Collection[int]) -> int:
        return 0  # a freed buffer left the budget already; torch's caching allocator keeps it

    def close(self) -> None:
        self._held.reap(wait=True)

    def __repr__(self) -> str:
        return f"CudaTier({self.streams.device}, {self.budget!r})"


class NvmeTier:
    """The NVMe tier: 4 KiB-aligned regions of this rank's swap files."""

    def __init__(self, swap: SwapSpace) -> None:
        self.tier = Tier.NVME
        self.swap = swap
        self.budget = swap.budget

    def alloc(self, nbytes: int, *, home: bool = False) -> SwapRegion | None:
        return self.swap.try_alloc(nbytes)

    def free(self, buffer: Buffer) -> None:
        self.swap.free(region(buffer))

    def reserved(self, nbytes: int) -> int:
        return round_up(nbytes)

    def victims(self, nbytes: int, candidates: Sequence[Buffer]) -> None:
        return None  # a region may be pieces of several holes: any bytes freed serve

    def bytes_for(self, sizes: Sequence[int]) -> int:
        return sum(round_up(n) for n in sizes)

    def view(self, buffer: Buffer, handle: TensorHandle) -> None:
        return None

    def settle(self) -> None:
        return None

    def trim(self, sizes: Collection[int]) -> int:
        return 0  # a freed region is free at once

    def close(self) -> None:
        self.swap.close()

    def __repr__(self) -> str:
        return f"NvmeTier({self.swap!r})"


def tier_stores(budgets: dict[Tier, Budget], streams: CopyStreams, pool: HostPool | PinnedArena,
                device_pool: HostPool | None, swap: SwapSpace | None) -> dict[Tier, TierStore]:
    """The store of every tier this manager has (no NVMe store without swap files)."""
    stores: dict[Tier, TierStore] = {
        Tier.DEVICE: CudaTier(budgets[Tier.DEVICE], streams) if device_pool is None
        else PoolTier(Tier.DEVICE, device_pool, streams),
        Tier.HOST: PoolTier(Tier.HOST, pool),
    }
    if swap is not None:
        stores[Tier.NVME] = NvmeTier(swap)
    return stores

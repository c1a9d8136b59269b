"""The asynchronous stand-in for the device's copy streams on the CPU (Config.streams="async"):
serial copy workers, poison, and the checks of a device ledger (see [Note: stream stand-in]).
"""

from __future__ import annotations

import queue
import random
import threading
import time
from typing import Callable

import torch
from torch.multiprocessing.reductions import StorageWeakRef

# [Note: stream stand-in] On the CPU without it every copy runs at once and every event is
# complete before anyone asks, so a missing wait, an event recorded on the wrong stream or a
# buffer reused while its copy is in flight can never show in a test; those are exactly the bugs a
# GPU produces. The stand-in makes them show:
#
#     copies    each copy stream is a serial worker that runs its copies later, in order, each
#               after the event it was told to wait for (and a seeded random delay); its event
#               completes only once the copy ran
#     poison    a copy's destination is filled with 0xFF bytes (NaN in every float dtype) when
#               the copy is queued, a device buffer when it is freed: a read before the event, or
#               after the free, gives values the parity tests catch
#     compute   CPU compute runs on the calling thread at once, so each thread is its own compute
#               stream, as each thread has its own current CUDA stream: `compute_wait` blocks that
#               thread until the event, and what another thread (an update thread) queued on the
#               copy streams reaches it only through the events it waits for
#     checks    (the `DeviceLedger`) what asynchrony alone does not show: a collective given a
#               tensor that is not device memory (NCCL refuses host tensors); a device buffer
#               handed to compute freed before compute recorded its use (CUDA's caching allocator
#               would hand it out while kernels still read it); a copy whose host side is not from
#               the pinned pool (CUDA runs it synchronously, or from memory that may move); a host
#               buffer given back while a copy still reads or writes it
#
# A device buffer freed while a copy queued on it has not run waits for the copy, as the caching
# allocator does for a stream recorded on it.
POISON = 0xFF
"""The byte poisoned memory is filled with: NaN in float32, bfloat16 and float16, -1 in integers."""


def poison(t: torch.Tensor) -> None:
    """Fill `t`'s bytes (contiguous) with POISON."""
    if t.numel():
        t.reshape(-1).view(torch.uint8).fill_(POISON)


class StandInEvent:
    """A copy event of the stand-in: complete once its copy ran (`synchronize` raises the copy's
    error, as a CUDA error surfaces at a synchronize)."""

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None

    def synchronize(self) -> None:
        self._done.wait()
        if self._error is not None:
            raise self._error

    def query(self) -> bool:
        return self._done.is_set()

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def __repr__(self) -> str:
        return f"StandInEvent({'done' if self.query() else 'pending'})"


class StandInStream:
    """One copy stream: a worker thread that runs the copies queued on it in order, each after
    the event it waits for and a random delay (seeded per stream)."""

    def __init__(self, name: str, *, delay_seed: int | None, max_delay_s: float) -> None:
        self.name = name
        self._rng = None if delay_seed is None else random.Random(f"{delay_seed}:{name}")
        self._max_delay_s = max_delay_s
        self._queue: queue.SimpleQueue[tuple[Callable[[], None], StandInEvent] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=f"tierzero-standin-{name}", daemon=True)
        self._thread.start()

    def submit(self, work: Callable[[], None]) -> StandInEvent:
        event = StandInEvent()
        self._queue.put((work, event))
        return event

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            work, event = item
            if self._rng is not None:
                time.sleep(self._rng.random() * self._max_delay_s)
            try:
                work()
            except BaseException as e:  # the copy's error surfaces at its event
                event._finish(e)
            else:
                event._finish()

    def __repr__(self) -> str:
        return f"StandInStream({self.name})"


def _ptr(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _start(t: torch.Tensor) -> int:
    """Where a buffer (or a view from its first byte) starts: pool buffers may share a storage."""
    return t.data_ptr()


class DeviceLedger:
    """What the stand-in knows of memory, for its checks (see the module docstring): which
    storages are device memory, the pinned pool's range, the device buffers handed to compute
    and not yet recorded by it, and the copies in flight on each buffer. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._device: dict[int, StorageWeakRef] = {}
        self._pinned: list[tuple[int, int]] = []
        self._lent: dict[int, str] = {}
        """Device buffers handed to a caller (scratch), by storage: compute must record its use."""
        self._copies: dict[int, list[StandInEvent]] = {}
        self._adds = 0

    def add_device(self, t: torch.Tensor) -> None:
        """`t`'s storage is device memory (a device tier buffer, a tensor made on the device)."""
        with self._lock:
            self._device[_ptr(t)] = StorageWeakRef(t.untyped_storage())
            self._prune()

    def _prune(self) -> None:
        """Now and then, forget storages that died and copies that ran (under the lock)."""
        self._adds += 1
        if self._adds % 512 == 0:
            self._device = {p: r for p, r in self._device.items() if not r.expired()}
            self._copies = {p: es for p, es in self._copies.items() if not all(e.query() for e in es)}

    def is_device(self, t: torch.Tensor) -> bool:
        with self._lock:
            ref = self._device.get(_ptr(t))
            return ref is not None and not ref.expired()

    def add_pinned(self, base: int, nbytes: int) -> None:
        """[base, base + nbytes) is the pinned pool."""
        with self._lock:
            self._pinned.append((base, base + nbytes))

    def is_pinned(self, t: torch.Tensor) -> bool:
        lo = t.data_ptr()
        hi = lo + t.numel() * t.element_size()
        return any(a <= lo and hi <= b for a, b in self._pinned)

    def lend(self, t: torch.Tensor, what: str) -> None:
        with self._lock:
            self._lent[_start(t)] = what

    def record(self, t: torch.Tensor) -> None:
        """Compute recorded its use of `t` (compute_wait)."""
        with self._lock:
            self._lent.pop(_start(t), None)

    def copying(self, event: StandInEvent, *tensors: torch.Tensor) -> None:
        with self._lock:
            for t in tensors:
                pending = [e for e in self._copies.get(_start(t), ()) if not e.query()]
                self._copies[_start(t)] = pending + [event]
            self._prune()

    def in_flight(self, t: torch.Tensor) -> list[StandInEvent]:
        with self._lock:
            return [e for e in self._copies.pop(_start(t), ()) if not e.query()]

    def unrecorded(self, t: torch.Tensor) -> str | None:
        """What a lent buffer was lent as, when compute never recorded it; forgets it either way."""
        with self._lock:
            return self._lent.pop(_start(t), None)

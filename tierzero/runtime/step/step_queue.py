"""`StepQueue`: the optimizer step's block updates running under the next forward."""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
import time
import weakref
from typing import Callable, Iterable, Optional

from tierzero.placement import TensorHandle

Collectives = Optional[Callable[[], None]]
"""What an update returns: its collectives, to run on the thread that drives the model's."""


class StepFailed(RuntimeError):
    """An update of an overlapped step raised; the model holds a partial step."""


# [Note: overlapped step]
# With params, gradients and optimizer states on NVMe, a step is a
# stream of reads and writes (26-28 bytes per parameter at 1b) during which the compute sits
# idle, and the next forward (compute, few bytes) cannot start until the step returns. Yet
# forward needs block k only once block k is updated, and the step updates the blocks in
# forward order. So `opt.step()` queues one update per block on a thread of its own and
# returns; the next forward computes block k as soon as block k's update is done, while the
# updates of the blocks after it read and write the drive. The values are those of a step that
# ran to the end before the forward: every read of an updated tensor waits for its update.
#
# Who waits, and for what (the queue is FIFO on one thread, so updates finish in step order):
#
#     a block's fetch            its flats' updates (Block.hold; the wait counts as a host stall)
#     a prefetch                 none: a unit whose update is queued is not prefetched yet; the
#                                prefetcher plans again as each update ends (`on_done`), so the
#                                block is brought while the one before it computes
#     zero_grad                  none: a flat whose update is queued clears its gradient right
#                                after the update (`clear_after`)
#     backward, clipping, the    every update (`drain`): their reads span all blocks, and a flat
#     next step, state dicts,    no forward fetched (its block skipped) may still be queued
#     checkpoints, close
#
# An update that raises stops the queue: the updates after it are not run (the model holds a
# partial step), and every later wait raises an error naming the block that failed, from the
# update's error, until the model is closed.
#
# Any world size, any device. An update's collectives (across ranks: the all-gather of the new
# parameters at stages 1 and 2, dropping an all-gather started ahead at stage 3) are not run on
# the update thread: the update returns them, and the thread that waits for the update (a
# fetch, a drain: the one that drives the model's collectives) runs them, in step order, so that
# every rank issues the same collectives in the same order, never beside the training loop's own.
# A flat whose collectives are still to run counts as updating. The update's device work runs on
# the copy streams (its thread makes the device current) and is ordered against the next
# forward's compute by their events.
class StepQueue:
    """The FIFO of block updates of the current step, keyed by each flat's parameter handle."""

    def __init__(self, on_wait: Callable[[float], None] | None = None,
                 on_done: Callable[[], None] | None = None) -> None:
        self._worker: int | None = None
        self._pool = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierzero-step", initializer=self._started)
        self._lock = threading.Lock()
        self._pending: dict[TensorHandle, cf.Future[None]] = {}
        """Queued or running updates, by parameter handle (removed once they end)."""
        self._clear: dict[TensorHandle, Callable[[], None]] = {}
        """Gradient clears zero_grad asked for while the flat's update was queued."""
        self._collectives: dict[TensorHandle, tuple[str, Callable[[], None]]] = {}
        """Finished updates' collectives still to run, in step order (see [Note: overlapped step])."""
        self._failed: StepFailed | None = None
        self._on_wait = on_wait
        """Told the seconds a fetch waited for updates (the telemetry's host stall)."""
        self._on_done = on_done
        """Called on the update thread after each update that ended well, once its flat is no
        longer busy (the prefetcher plans again: StepContext.update_done)."""
        self._closed = False
        _finish_at_exit(self)

    def finish_queued(self) -> None:
        """Wait for every queued or running update to end (at interpreter exit: see
        `_finish_at_exit`); a failure stays recorded, as for any update."""
        with self._lock:
            futures = list(self._pending.values())
        cf.wait(futures)

    def __repr__(self) -> str:
        return f"StepQueue(pending={[h.name for h in self._pending]}, failed={self._failed is not None})"

    def submit(self, key: TensorHandle, name: str, update: Callable[[], Collectives]) -> None:
        """Queue `update` of the flat whose parameter handle is `key` (`name` for errors)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("tierzero: the model was closed; it cannot be stepped")
            assert key not in self._pending and key not in self._collectives, f"{name}: queued twice in one step"
            self._pending[key] = self._pool.submit(self._run, key, name, update)

    def _run(self, key: TensorHandle, name: str, update: Callable[[], Collectives]) -> None:
        collectives = self._attempt(name, update)
        if collectives is not None:
            with self._lock:
                self._collectives[key] = (name, collectives)
        while True:  # zero_grad's clear (one may come while another runs) before the flat is free
            with self._lock:
                clear = self._clear.pop(key, None)
                if clear is None:
                    del self._pending[key]
                    break
            self._attempt(name, clear, after_failure=True)  # a gradient is dead data either way
        if self._on_done is not None and self._failed is None:
            self._attempt(name, self._on_done)

    def _attempt(self, name: str, work: Callable[[], Collectives], *, after_failure: bool = False) -> Collectives:
        if self._failed is not None and not after_failure:
            return None
        try:
            return work()
        except BaseException as e:
            failed = StepFailed(
                f"tierzero: opt.step() failed while updating block {name!r} on its update thread "
                f"({type(e).__name__}: {e}); the blocks after it were not updated, so the model "
                "holds a partial step: load a checkpoint (tz.load_checkpoint) if you saved one, or wrap "
                "the model again")
            failed.__cause__ = e
            if self._failed is None:
                self._failed = failed
            return None

    def busy(self, keys: Iterable[TensorHandle]) -> bool:
        """Whether any of these flats has an update queued or running, or collectives to run."""
        with self._lock:
            return any(k in self._pending or k in self._collectives for k in keys)

    def wait(self, keys: Iterable[TensorHandle]) -> None:
        """Return once these flats' updates are done and their collectives ran (here); raise
        StepFailed if an update failed."""
        keys = list(keys)
        with self._lock:
            futures = [self._pending[k] for k in keys if k in self._pending]
        self._wait(futures)
        self._run_collectives(keys)

    def drain(self, *, forget_failure: bool = False) -> None:
        """Return once every queued update is done and every collective ran (here); raise
        StepFailed if one failed, unless `forget_failure` (a checkpoint load is about to replace
        the partial step)."""
        with self._lock:
            futures = list(self._pending.values())
        if forget_failure:
            cf.wait(futures)
            self._failed = None
            self._collectives.clear()
        self._wait(futures)
        with self._lock:
            keys = list(self._collectives)
        self._run_collectives(keys)

    def _run_collectives(self, keys: list[TensorHandle]) -> None:
        for key in keys:
            with self._lock:
                entry = self._collectives.pop(key, None)
            if entry is not None:
                self._attempt(entry[0], entry[1])
        if self._failed is not None:
            raise StepFailed(str(self._failed)) from self._failed.__cause__

    def clear_after(self, key: TensorHandle, clear: Callable[[], None]) -> bool:
        """Run `clear` (a gradient's zero_grad) right after the flat's update if one is queued
        (True), else leave it to the caller (False)."""
        with self._lock:
            if key not in self._pending:
                return False
            self._clear[key] = clear
            return True

    def clears(self, key: TensorHandle) -> bool:
        """Whether a clear waits for `key`'s update (clear_after)."""
        with self._lock:
            return key in self._clear

    def _started(self) -> None:
        self._worker = threading.get_ident()

    def close(self) -> None:
        """Wait for what is queued (errors are dropped: the model is going away), then stop.
        Called on the update thread itself (the optimizer collected there), it only stops: the
        thread ends once its update returns."""
        with self._lock:
            self._closed = True
            futures = list(self._pending.values())
        if threading.get_ident() == self._worker:
            self._pool.shutdown(wait=False)
            return
        cf.wait(futures)
        self._pool.shutdown(wait=True)
        self._collectives.clear()

    def _wait(self, futures: list[cf.Future[None]]) -> None:
        if futures and not all(f.done() for f in futures):
            t0 = time.perf_counter()
            cf.wait(futures)
            if self._on_wait is not None:
                self._on_wait(time.perf_counter() - t0)
        if self._failed is not None:  # a fresh error each time: raising one object again grows its traceback
            raise StepFailed(str(self._failed)) from self._failed.__cause__


def _finish_at_exit(queue: StepQueue) -> None:
    """A script may end right after `opt.step()`, its last step's updates still queued. They
    finish before the interpreter tells waiting threads it is exiting (placement's `exiting()`,
    which fails a wait for room or a move), so the step completes and the close at exit finds
    every buffer given back. threading's exit hooks run newest first: this one, registered after
    placement's, runs before it."""
    ref = weakref.ref(queue)

    def finish() -> None:
        q = ref()
        if q is not None:
            q.finish_queued()

    with contextlib.suppress(RuntimeError):  # registered during the interpreter's shutdown: too late
        threading._register_atexit(finish)  # noqa: SLF001 (as placement's swap_dirs and concurrent.futures do)

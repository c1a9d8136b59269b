"""IOFuture: the handle of one pread/pwrite, waitable from threads and awaitable from asyncio."""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Callable

log = logging.getLogger(__name__)


class IOFuture:
    """Completion of one request: `result(timeout)` returns the bytes transferred or raises
    IOEngineError; `done()`; `checksum` (xxh3_64 int, when requested, else None); `await fut`
    from asyncio suspends only the awaiting task (completion is handed to the loop with
    call_soon_threadsafe)."""

    __slots__ = ("op", "path", "offset", "nbytes", "checksum", "_event", "_lock", "_error",
                 "_callbacks", "__weakref__")

    def __init__(self, op: str, path: str, offset: int, nbytes: int) -> None:
        self.op = op
        self.path = path
        self.offset = offset
        self.nbytes = nbytes
        self.checksum: int | None = None
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[IOFuture], None]] | None = []

    def done(self) -> bool:
        return self._event.is_set()

    def result(self, timeout: float | None = None) -> int:
        """Bytes transferred (the buffer's size); raises IOEngineError on failure, TimeoutError
        when not done within `timeout` seconds."""
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self!r} not done after {timeout} s")
        if self._error is not None:
            raise self._error
        return self.nbytes

    def exception(self, timeout: float | None = None) -> BaseException | None:
        if not self._event.wait(timeout):
            raise TimeoutError(f"{self!r} not done after {timeout} s")
        return self._error

    def add_done_callback(self, fn: Callable[[IOFuture], None]) -> None:
        """Call fn(self) when done: at once if already done, else in the worker thread that
        completes the request (keep it short)."""
        with self._lock:
            if self._callbacks is not None:
                self._callbacks.append(fn)
                return
        _run_callback(fn, self)

    def __await__(self):
        if not self.done():
            loop = asyncio.get_running_loop()
            waiter = loop.create_future()

            def wake(_: IOFuture) -> None:
                try:
                    loop.call_soon_threadsafe(_resolve, waiter)
                except RuntimeError:  # the loop was closed meanwhile: nobody is waiting
                    pass

            self.add_done_callback(wake)
            yield from waiter.__await__()
        return self.result()

    def _finish(self, error: BaseException | None, checksum: int | None) -> None:
        """Called once, by the engine, when the request has completed."""
        self._error = error
        if error is None:
            self.checksum = checksum
        with self._lock:
            callbacks, self._callbacks = self._callbacks, None
        self._event.set()
        for fn in callbacks or ():
            _run_callback(fn, self)

    def __repr__(self) -> str:
        state = "pending" if not self.done() else ("failed" if self._error is not None else "done")
        return f"<IOFuture {self.op} {self.path!r} offset={self.offset} nbytes={self.nbytes} {state}>"


def _resolve(waiter: asyncio.Future) -> None:
    if not waiter.done():
        waiter.set_result(None)


def _run_callback(fn: Callable[[IOFuture], None], fut: IOFuture) -> None:
    try:
        fn(fut)
    except Exception:  # a caller's callback must not kill an IO worker
        log.exception("io_engine: done-callback %r of %r raised", fn, fut)

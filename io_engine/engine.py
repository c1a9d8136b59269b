"""IOEngine: pread/pwrite of any buffer, split into blocks served by a persistent thread pool;
IOFuture, the caller's handle of one request; the xxh3_64 digest the requests compute.

How one request flows, and why buffered and O_DIRECT IO never disagree: the comment
blocks above `_Request` ([Note: page-cache coherence]).
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import queue
import threading
import weakref
from typing import Callable, NamedTuple

import numpy as np
import xxhash

from .buffers import PAGE
from .errors import IOEngineError, io_error
from .files import FileHandle, PreallocatedFile, ReadOnlyFile, close_fd, open_handle, raw_handle
from .sizes import exact_size, parse_size

log = logging.getLogger(__name__)


def byte_view(buf, *, writable: bool) -> np.ndarray:
    """A flat uint8 numpy view sharing `buf`'s memory (no copy).

    Raises TypeError for objects without the buffer protocol, ValueError for non-contiguous
    buffers and for read-only buffers when `writable`.
    """
    if isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.ndim == 1 and buf.flags.c_contiguous:
        arr = buf
    else:
        try:
            arr = np.frombuffer(buf, dtype=np.uint8)
        except TypeError:
            raise TypeError(
                f"io_engine: expected a buffer-protocol object (numpy array, memoryview, bytearray, "
                f"mmap), got {type(buf).__name__}; for a CPU torch tensor pass `t.numpy()` or "
                f"`t.view(torch.uint8).numpy()`") from None
        except ValueError as e:
            raise ValueError(f"io_engine: the buffer must be C-contiguous ({e}); pass a contiguous "
                             f"copy or a contiguous slice") from None
    if writable and not arr.flags.writeable:
        raise ValueError(f"io_engine: pread needs a writable buffer, got a read-only "
                         f"{type(buf).__name__} of {arr.nbytes} bytes")
    return arr


def checksum(buf) -> int:
    """xxh3_64 of the buffer's bytes (any C-contiguous buffer-protocol object), as an int.

    Equal to `IOFuture.checksum` of a `pread`/`pwrite` of the same bytes with checksum=True
    (which feeds the pieces in order to one streaming xxh3_64 state).
    """
    return xxhash.xxh3_64_intdigest(byte_view(buf, writable=False))


def preadv_into(fd: int, view: memoryview, offset: int) -> int:
    """One read syscall into view; bytes read (0 at end of file)."""
    return os.preadv(fd, (view,), offset)


def pwritev_from(fd: int, view: memoryview, offset: int) -> int:
    """One write syscall from view; bytes written."""
    return os.pwritev(fd, (view,), offset)


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
                    loop.call_soon_threadsafe(_set_waiter, waiter)
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


def _set_waiter(waiter: asyncio.Future) -> None:
    """On the loop: the awaiting task may go on (unless it was cancelled meanwhile)."""
    if not waiter.done():
        waiter.set_result(None)


def _run_callback(fn: Callable[[IOFuture], None], fut: IOFuture) -> None:
    try:
        fn(fut)
    except Exception:  # a caller's callback must not kill an IO worker
        log.exception("io_engine: done-callback %r of %r raised", fn, fut)


class _Piece(NamedTuple):
    """One block of a request, as queued to the workers."""

    request: "_Request"
    index: int
    fd: int
    view: memoryview
    offset: int
    """Absolute file offset of view[0]."""


# Data flow of one request:
# 1. Submit (caller thread): the buffer becomes a flat byte view (no copy); the file is resolved to
#    a FileHandle (paths are opened once and cached; PreallocatedFile and ReadOnlyFile bring their
#    own fds; raw fds are used as given). The byte range is planned as pieces: when O_DIRECT is on and the buffer's
#    memory and the file offset agree modulo 4096, the page-aligned middle goes through the
#    O_DIRECT fd in `block_size` pieces and the unaligned head and tail (< 4096 bytes each) through
#    the buffered fd; otherwise every piece is buffered. Pieces are queued as typed records.
# 2. Transfer (worker threads): each piece is one os.preadv/os.pwritev straight into/out of the
#    caller's memory (the GIL is released for the syscall). Short transfers are retried until
#    complete, the remainder through the buffered fd (it may no longer be aligned); a read that
#    returns 0 bytes is a read past end of file and fails the request.
# 3. Checksum (worker threads): with checksum=True, pieces are fed in buffer order to one
#    streaming xxh3_64 state by whichever worker completes the next piece in order, so the digest
#    overlaps with the transfer of later pieces and the caller never pays for it.
# 4. Completion: the last piece (or the last hash update) completes the IOFuture.
#
# [Note: page-cache coherence]
# One request never puts buffered and O_DIRECT IO on the same page (the split is at page
# boundaries). Across requests, Linux's direct-IO path writes back dirty cached pages of the
# range before an O_DIRECT read or write and invalidates them after an O_DIRECT write
# (filemap_write_and_wait_range / invalidate_inode_pages2_range), so an O_DIRECT read sees data
# written buffered before it, and a buffered read sees data written with O_DIRECT
# (tests/io_engine/test_io_engine.py checks both).
class _Request:
    """One pread/pwrite in flight: pieces outstanding, first error, checksum progress."""

    __slots__ = ("future", "write", "handle", "offset", "nbytes", "strict", "state", "lock", "remaining",
                 "error", "hasher", "views", "finished", "next_hash", "hashing", "completed")

    def __init__(self, future: IOFuture, write: bool, handle: FileHandle, offset: int, nbytes: int,
                 strict: bool, state: "_State", views: list[memoryview], hashed: bool) -> None:
        self.future = future
        self.write = write
        self.handle = handle
        self.offset = offset
        self.nbytes = nbytes
        self.strict = strict
        self.state = state
        self.lock = threading.Lock()
        self.remaining = len(views)
        self.error: IOEngineError | None = None
        self.hasher = xxhash.xxh3_64() if hashed else None
        """One streaming xxh3_64 state fed the pieces in buffer order: `checksum` of the whole."""
        self.views: list[memoryview] | None = views if hashed else None
        self.finished = bytearray(len(views)) if hashed else None
        self.next_hash = 0
        self.hashing = False
        self.completed = False

    def piece_done(self, index: int, error: IOEngineError | None) -> None:
        """Record one piece's outcome; hash what is now hashable in order; complete when all done."""
        with self.lock:
            if error is not None and self.error is None:
                self.error = error
            self.remaining -= 1
            feed = self.hasher is not None and self.error is None and not self.hashing
            if self.hasher is not None:
                self.finished[index] = 1
            if feed:
                self.hashing = True  # this thread holds the hashing token now
                complete = False
            else:  # no hashing, or another worker is feeding the hasher and will pick this up
                complete = self._take_completion()
        if feed:
            complete = self._feed_hasher()
        if complete:
            self._complete()

    def _feed_hasher(self) -> bool:
        """Hash consecutive finished pieces (this thread holds the hashing token); True when the
        request is now complete."""
        views, n = self.views, len(self.finished)
        while True:
            with self.lock:
                j = self.next_hash
                if self.error is not None or j >= n or not self.finished[j]:
                    self.hashing = False
                    return self._take_completion()
                self.next_hash = j + 1
            self.hasher.update(views[j])

    def _take_completion(self) -> bool:
        # Caller holds self.lock.
        if self.completed or self.remaining or self.hashing:
            return False
        if self.hasher is not None and self.error is None and self.next_hash < len(self.finished):
            return False
        self.completed = True
        return True

    def _complete(self) -> None:
        digest = self.hasher.intdigest() if self.hasher is not None and self.error is None else None
        self.views = None  # drop buffer exports so the caller may free/close its buffer
        self.future._finish(self.error, digest)
        self.state.request_done()

    def failure(self, err: int, pos: int, left: int) -> IOEngineError:
        op = "pwrite" if self.write else "pread"
        where = f"{op} of {self.nbytes} bytes at offset {self.offset} {'to' if self.write else 'from'} {self.handle.path!r}"
        if err == errno.ENODATA and not self.write:
            try:
                size = f"the file is {os.fstat(self.handle.fd).st_size} bytes long"
            except OSError:
                size = "the file is shorter"
            return io_error(err, f"{where}: read past end of file at offset {pos} ({left} bytes missing; {size})",
                            op=op, path=self.handle.path, offset=self.offset, nbytes=self.nbytes,
                            hint="read only what was written, or write/preallocate the file first")
        return io_error(err, f"{where} failed at offset {pos} ({left} bytes of that block not transferred)",
                        op=op, path=self.handle.path, offset=self.offset, nbytes=self.nbytes)


def _run_piece(piece: _Piece) -> IOEngineError | None:
    """Transfer one piece completely, or return the error that stopped it."""
    req = piece.request
    if req.error is not None:  # a sibling piece failed: the request fails anyway
        return None
    fd, view, pos = piece.fd, piece.view, piece.offset
    left = len(view)
    buffered_fd = req.handle.fd
    while True:
        try:
            done = pwritev_from(fd, view, pos) if req.write else preadv_into(fd, view, pos)
        except OSError as e:
            if e.errno == errno.EINVAL and fd != buffered_fd and not req.strict:
                fd = buffered_fd  # this file system refused O_DIRECT for the piece: go buffered
                continue
            return req.failure(e.errno or errno.EIO, pos, left)
        if done >= left:
            return None
        if done <= 0:
            return req.failure(errno.EIO if req.write else errno.ENODATA, pos, left)
        view, pos, left = view[done:], pos + done, left - done
        fd = buffered_fd  # the rest may be unaligned for O_DIRECT


def _worker(q: "queue.SimpleQueue[_Piece | None]") -> None:
    get = q.get
    while True:
        piece = get()
        if piece is None:
            return
        try:
            error = _run_piece(piece)
        except BaseException as e:  # a bug here must still complete the request
            error = io_error(errno.EIO, f"io_engine worker failed: {e!r}", op="io", path=piece.request.handle.path)
        piece.request.piece_done(piece.index, error)
        del piece  # release the buffer view before blocking in get()


class _State:
    """What the workers, in-flight requests and the finalizer share (never the engine itself, so an
    engine nobody closed is still collected and its finalizer shuts the pool down)."""

    def __init__(self, threads: int) -> None:
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)
        self.inflight = 0
        self.closed = False
        self.queue: queue.SimpleQueue[_Piece | None] = queue.SimpleQueue()
        self.handles: dict[str, FileHandle] = {}
        self.threads = [threading.Thread(target=_worker, args=(self.queue,), name=f"io_engine-{i}", daemon=True)
                        for i in range(threads)]
        for t in self.threads:
            t.start()

    def request_done(self) -> None:
        with self.lock:
            self.inflight -= 1
            if not self.inflight:
                self.idle.notify_all()


def _shutdown(state: _State) -> None:
    """Refuse new work, wait for in-flight requests, stop and join the workers, close cached fds."""
    me = threading.current_thread()
    with state.lock:
        state.closed = True
        if me not in state.threads:
            while state.inflight:
                state.idle.wait()
    for _ in state.threads:
        state.queue.put(None)
    for t in state.threads:
        if t is not me:
            t.join()
    with state.lock:
        handles, state.handles = list(state.handles.values()), {}
    for h in handles:
        close_fd(h.dfd)
        close_fd(h.fd)


class IOEngine:
    """Asynchronous pread/pwrite on files, into/out of any writable buffer, without copies.

    threads: worker threads issuing syscalls concurrently. block_size: requests are split into
    pieces of this many bytes (a multiple of 4096; int or "8MiB"). direct: "auto" uses O_DIRECT
    where the file system and the request's alignment allow; True requires the file system to
    accept O_DIRECT (unaligned heads/tails still go buffered); False never uses it.

    `file` is a path (opened once and cached until close()), a PreallocatedFile or ReadOnlyFile,
    or a raw fd / object with fileno() (used as it is). Errors in the arguments, in opening the file or on a
    closed engine are raised by pread/pwrite at once; transfer errors by the future's result().
    """

    def __init__(self, threads: int = 4, block_size: int | str = 4 << 20,
                 direct: bool | str = "auto") -> None:
        if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
            raise ValueError(f"IOEngine: expected threads as an int >= 1, got {threads!r}")
        bs = parse_size(block_size, what="IOEngine block_size")
        if bs < PAGE or bs % PAGE:
            raise ValueError(f"IOEngine: expected block_size as a multiple of {PAGE} bytes, got {block_size!r}")
        if direct not in ("auto", True, False) or isinstance(direct, int) and not isinstance(direct, bool):
            raise ValueError(f'IOEngine: expected direct as "auto", True or False, got {direct!r}')
        self.threads = threads
        self.block_size = bs
        self.direct = direct
        self._state = _State(threads)
        self._close = weakref.finalize(self, _shutdown, self._state)

    # -- public API ---------------------------------------------------------------------------

    def pread(self, file, buf, offset: int = 0, *, checksum: bool = False) -> IOFuture:
        """Start reading len(buf) bytes at `offset` of `file` into `buf` (writable, contiguous)."""
        return self._submit(False, file, buf, offset, checksum)

    def pwrite(self, file, buf, offset: int = 0, *, checksum: bool = False) -> IOFuture:
        """Start writing `buf` (contiguous) at `offset` of `file` (a path is created if missing)."""
        return self._submit(True, file, buf, offset, checksum)

    def read(self, file, buf, offset: int = 0, *, checksum: bool = False) -> int:
        """pread(...).result(): bytes read."""
        return self.pread(file, buf, offset, checksum=checksum).result()

    def write(self, file, buf, offset: int = 0, *, checksum: bool = False) -> int:
        """pwrite(...).result(): bytes written."""
        return self.pwrite(file, buf, offset, checksum=checksum).result()

    @property
    def closed(self) -> bool:
        return self._state.closed

    def close(self, *, cancel: bool = False) -> None:
        """Wait for outstanding requests (cancel=True: fail those not yet started with ECANCELED),
        stop and join the worker threads, close cached fds. Idempotent."""
        state = self._state
        if threading.current_thread() in state.threads:
            raise RuntimeError("IOEngine.close() called from one of its own worker threads (a done-callback); "
                               "close it from another thread")
        with state.lock:
            state.closed = True
        if cancel:
            self._cancel_queued()
        self._close()

    def forget(self, path: str | os.PathLike[str]) -> None:
        """Close the cached fds of `path` (e.g. before deleting and re-creating it). Only call it
        when no request on that path is in flight."""
        with self._state.lock:
            h = self._state.handles.pop(os.path.abspath(os.fspath(path)), None)
        if h is not None:
            close_fd(h.dfd)
            close_fd(h.fd)

    def __enter__(self) -> "IOEngine":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else f"{self._state.inflight} in flight"
        return (f"IOEngine(threads={self.threads}, block_size={exact_size(self.block_size)!r}, "
                f"direct={self.direct!r}; {state})")

    # -- internals ----------------------------------------------------------------------------

    def _submit(self, write: bool, file, buf, offset: int, want_checksum: bool) -> IOFuture:
        op = "pwrite" if write else "pread"
        if self._state.closed:
            raise self._closed_error(op, file)
        arr = byte_view(buf, writable=not write)
        if not isinstance(offset, (int, np.integer)) or isinstance(offset, bool) or offset < 0:
            raise ValueError(f"IOEngine.{op}: expected offset as an int >= 0, got {offset!r}")
        offset = int(offset)
        handle = self._resolve(file, write, op)
        nbytes = arr.nbytes
        fut = IOFuture(op, handle.path, offset, nbytes)
        if nbytes == 0:
            fut._finish(None, checksum(arr) if want_checksum else None)
            return fut
        view = memoryview(arr)
        spans = self._plan(handle, arr.ctypes.data, offset, nbytes)
        views = [view[start:stop] for _, start, stop in spans]
        req = _Request(fut, write, handle, offset, nbytes, self.direct is True, self._state, views, want_checksum)
        state = self._state
        with state.lock:
            if state.closed:
                raise self._closed_error(op, file)
            state.inflight += 1
        put = state.queue.put
        for i, (fd, start, _) in enumerate(spans):
            put(_Piece(req, i, fd, views[i], offset + start))
        return fut

    def _plan(self, handle: FileHandle, addr: int, offset: int, nbytes: int) -> list[tuple[int, int, int]]:
        """(fd, start, stop) pieces of the buffer, in buffer order."""
        bs = self.block_size
        dfd = handle.dfd if self.direct else -1
        if dfd >= 0 and (addr - offset) % PAGE == 0:
            head = min(-offset % PAGE, nbytes)
            tail = max(head, nbytes - (offset + nbytes) % PAGE)
        else:
            head = tail = nbytes
        spans = [(handle.fd, s, min(s + bs, head)) for s in range(0, head, bs)]
        spans += [(dfd, s, min(s + bs, tail)) for s in range(head, tail, bs)]
        if tail < nbytes:
            spans.append((handle.fd, tail, nbytes))
        return spans

    def _resolve(self, file, create: bool, op: str) -> FileHandle:
        if isinstance(file, (PreallocatedFile, ReadOnlyFile)):
            h = file.handle
            if self.direct is True and h.dfd < 0:
                raise io_error(errno.EINVAL, f"{op}: {file.path!r} has no O_DIRECT fd but this engine has "
                                             f"direct=True", op=op, path=file.path,
                               hint='open the engine with direct="auto", or the file on a file '
                                    'system that accepts O_DIRECT')
            return h
        if isinstance(file, (int, np.integer)) and not isinstance(file, bool):
            return raw_handle(int(file))
        if hasattr(file, "fileno") and not isinstance(file, (str, bytes, os.PathLike)):
            return raw_handle(file.fileno())
        try:
            path = os.fsdecode(os.fspath(file))
        except TypeError:
            raise TypeError(f"IOEngine.{op}: expected file as a path, PreallocatedFile or fd, got "
                            f"{type(file).__name__}") from None
        key = os.path.abspath(path)
        state = self._state
        h = state.handles.get(key)
        if h is not None:
            return h
        with state.lock:  # one open per path even when threads race
            h = state.handles.get(key)
            if h is None:
                if state.closed:
                    raise self._closed_error(op, file)
                h = open_handle(path, create=create, direct=self.direct, op=op)
                state.handles[key] = h
        return h

    def _cancel_queued(self) -> None:
        q = self._state.queue
        while True:
            try:
                piece = q.get_nowait()
            except queue.Empty:
                return
            if piece is None:
                continue
            req = piece.request
            op = "pwrite" if req.write else "pread"
            piece.request.piece_done(piece.index, io_error(
                errno.ECANCELED, f"{op} of {req.nbytes} bytes at offset {req.offset} of {req.handle.path!r} "
                                 f"cancelled: the IOEngine was closed with cancel=True before it ran",
                op=op, path=req.handle.path, offset=req.offset, nbytes=req.nbytes, hint=""))

    def _closed_error(self, op: str, file) -> IOEngineError:
        path = getattr(file, "path", file)
        return io_error(errno.EBADF, f"{op} on {path!r}: this IOEngine is closed and accepts no new work",
                        op=op, path=str(path), hint="create a new IOEngine (or keep this one open until done)")

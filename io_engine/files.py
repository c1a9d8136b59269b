"""Opening files for io_engine: a buffered fd plus an O_DIRECT fd where the file system allows,
PreallocatedFile, a file whose space is reserved up front, and ReadOnlyFile, an existing file
held open for reading.

The OS calls are small module-level functions so tests can patch them (e.g. to make a file
system refuse O_DIRECT, as tmpfs did before Linux 6.6).
"""

from __future__ import annotations

import errno
import fcntl
import os
from typing import NamedTuple

from .errors import IOEngineError, errno_text, io_error
from .sizes import format_size

O_DIRECT = getattr(os, "O_DIRECT", 0)


class FileHandle(NamedTuple):
    """The fds io_engine transfers through for one file."""

    path: str
    """For error messages ("<fd 7>" for a raw fd)."""
    fd: int
    """Buffered fd: unaligned heads/tails, and everything when O_DIRECT is off or refused."""
    dfd: int
    """O_DIRECT fd, or -1 when not opened/refused."""


def open_fd(path: str, flags: int, mode: int = 0o644) -> int:
    return os.open(path, flags | os.O_CLOEXEC, mode)


def open_direct_fd(path: str, flags: int) -> int:
    """An O_DIRECT fd; OSError(EINVAL) where the file system refuses O_DIRECT."""
    if not O_DIRECT:
        raise OSError(errno.EINVAL, "O_DIRECT is not available on this platform")
    return os.open(path, (flags & ~os.O_CREAT) | O_DIRECT | os.O_CLOEXEC)


def close_fd(fd: int) -> None:
    if fd >= 0:
        os.close(fd)


def fallocate(fd: int, offset: int, nbytes: int) -> None:
    os.posix_fallocate(fd, offset, nbytes)


def free_bytes(path: str) -> int:
    """Bytes an unprivileged user may still allocate on path's file system."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def free_disk_bytes(path: str | os.PathLike[str]) -> int:
    """free_bytes of the file system that holds, or would hold, `path`: a folder not made yet is
    measured at its nearest existing parent."""
    p = os.path.abspath(path)
    while not os.path.exists(p) and p != os.path.dirname(p):
        p = os.path.dirname(p)
    return free_bytes(p)


def open_error(e: OSError, path: str, *, op: str) -> IOEngineError:
    """An IOEngineError for a failed open, saying a missing directory apart from a missing file."""
    err = e.errno or errno.EIO
    if err == errno.ENOENT:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            return io_error(err, f"{op}: cannot open {path!r}: directory {parent!r} does not exist",
                            op=op, path=path,
                            hint="create it first (os.makedirs) or pass a path in an existing directory")
        return io_error(err, f"{op}: cannot open {path!r}: no such file", op=op, path=path,
                        hint="write it first, or check the path")
    return io_error(err, f"{op}: cannot open {path!r}", op=op, path=path)


def open_handle(path: str, *, create: bool, direct: bool | str, op: str, mode: int = 0o644) -> FileHandle:
    """Open `path` read-write (read-only if that is refused and not `create`) plus an O_DIRECT twin;
    a file it creates gets permission bits `mode` (less the umask).

    direct: False: no O_DIRECT fd; "auto": O_DIRECT where the file system accepts it; True: O_DIRECT
    required (IOEngineError EINVAL naming the path otherwise).
    """
    flags = os.O_RDWR | (os.O_CREAT if create else 0)
    try:
        try:
            fd = open_fd(path, flags, mode)
        except (PermissionError, OSError) as e:
            if create or e.errno not in (errno.EACCES, errno.EROFS, errno.EPERM):
                raise
            flags = os.O_RDONLY
            fd = open_fd(path, flags)
    except OSError as e:
        raise open_error(e, path, op=op) from e
    dfd = -1
    if direct:
        try:
            dfd = open_direct_fd(path, flags)
        except OSError as e:
            if direct is True:
                close_fd(fd)
                raise io_error(e.errno or errno.EINVAL,
                               f"{op}: the file system of {path!r} refuses O_DIRECT", op=op, path=path,
                               hint='use direct="auto" (falls back to buffered IO) or direct=False') from e
    return FileHandle(path, fd, dfd)


def raw_handle(fd: int) -> FileHandle:
    """A caller's fd, used as it is: O_DIRECT only if the caller opened it so (then requests on it
    must be aligned)."""
    try:
        flags = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError as e:
        raise io_error(e.errno or errno.EBADF, f"fd {fd} is not an open file descriptor", op="open",
                       path=f"<fd {fd}>") from e
    try:
        name = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        name = f"<fd {fd}>"
    if O_DIRECT and flags & O_DIRECT:
        return FileHandle(name, fd, fd)
    return FileHandle(name, fd, -1)


class _OpenFile:
    """What an open file object of this module shares: its fd pair (a FileHandle), the error
    for use after close, closing both fds once, the context manager."""

    path: str
    _handle: FileHandle | None

    @property
    def handle(self) -> FileHandle:
        if self._handle is None:
            name = type(self).__name__
            raise io_error(errno.EBADF, f"{name} {self.path!r} is closed", op="io", path=self.path,
                           hint=f"open a new {name}")
        return self._handle

    @property
    def closed(self) -> bool:
        return self._handle is None

    @property
    def direct(self) -> bool:
        """Whether an O_DIRECT fd is open."""
        return self._handle is not None and self._handle.dfd >= 0

    def _close_fds(self) -> None:
        h, self._handle = self._handle, None
        if h is not None:
            close_fd(h.dfd)
            close_fd(h.fd)

    def close(self) -> None:
        """Close both fds; idempotent."""
        self._close_fds()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class ReadOnlyFile(_OpenFile):
    """An existing file opened read-only, a buffered fd plus an O_DIRECT twin where the file system
    allows and `direct` is not False, both kept open until close(): reads through it (pass the
    object as `file` to IOEngine.pread) see the file that was opened even after its path is
    renamed or removed. Never creates or changes the file."""

    def __init__(self, path: str | os.PathLike[str], *, direct: bool | str = "auto") -> None:
        self.path = os.fspath(path)
        try:
            fd = open_fd(self.path, os.O_RDONLY)
        except OSError as e:
            raise open_error(e, self.path, op="open") from e
        dfd = -1
        if direct:
            try:
                dfd = open_direct_fd(self.path, os.O_RDONLY)
            except OSError as e:
                if direct is True:
                    close_fd(fd)
                    raise io_error(e.errno or errno.EINVAL, f"open: the file system of {self.path!r} refuses "
                                   "O_DIRECT", op="open", path=self.path,
                                   hint='use direct="auto" (falls back to buffered IO) or direct=False') from e
        self._handle: FileHandle | None = FileHandle(self.path, fd, dfd)

    def stat(self) -> os.stat_result:
        """fstat of the open file (the file opened, whatever its path names now)."""
        return os.fstat(self.handle.fd)

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("O_DIRECT" if self.direct else "buffered")
        return f"ReadOnlyFile({self.path!r}, {state})"


class PreallocatedFile(_OpenFile):
    """A file of `nbytes` whose space is reserved with posix_fallocate at creation, so a full disk
    fails here, with a clear error, rather than in the middle of training.

    Creates the file (permission bits `mode`, less the umask) or opens an existing one (never
    shrinking it). Holds a buffered fd and, where
    the file system allows and `direct` is not False, an O_DIRECT fd, both opened once; pass the
    object as `file` to IOEngine.pread/pwrite. Close it after its IO has completed.
    """

    def __init__(self, path: str | os.PathLike[str], nbytes: int, *, direct: bool | str = "auto",
                 remove_on_close: bool = False, mode: int = 0o644) -> None:
        self.path = os.fspath(path)
        if not isinstance(nbytes, int) or nbytes < 0:
            raise ValueError(f"PreallocatedFile({self.path!r}): expected nbytes as an int >= 0, got {nbytes!r}")
        self.remove_on_close = remove_on_close
        existed = os.path.exists(self.path)
        self._handle: FileHandle | None = open_handle(self.path, create=True, direct=direct, op="preallocate",
                                                      mode=mode)
        try:
            self._preallocate(nbytes)
        except BaseException:
            self._close_fds()
            if not existed:
                os.unlink(self.path)
            raise
        self.size = os.fstat(self._handle.fd).st_size
        """The file's size in bytes (>= nbytes)."""

    def _preallocate(self, nbytes: int) -> None:
        fd = self.handle.fd
        st = os.fstat(fd)
        needed = max(0, nbytes - st.st_blocks * 512)
        free = free_bytes(self.path)
        if needed > free:
            raise self._full(errno.ENOSPC, nbytes, free)
        if nbytes == 0:
            return
        try:
            fallocate(fd, 0, nbytes)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                raise self._full(e.errno, nbytes, free_bytes(self.path)) from e
            raise io_error(e.errno or errno.EIO, f"preallocating {nbytes} bytes for {self.path!r} failed",
                           op="preallocate", path=self.path, offset=0, nbytes=nbytes) from e

    def _full(self, err: int, nbytes: int, free: int) -> IOEngineError:
        return IOEngineError(
            err, f"cannot preallocate {nbytes} bytes ({format_size(nbytes, digits=1)}) for {self.path!r}: its file "
                 f"system has {free} bytes ({format_size(free, digits=1)}) free [{errno_text(err)}]; free space, use "
                 f"a directory on a larger drive, or lower the NVMe budget",
            op="preallocate", path=self.path, offset=0, nbytes=nbytes)

    def close(self) -> None:
        """Close both fds (idempotent); removes the file if `remove_on_close`."""
        was_open = self._handle is not None
        self._close_fds()
        if was_open and self.remove_on_close:
            self.unlink(missing_ok=True)

    def unlink(self, *, missing_ok: bool = False) -> None:
        """Remove the file from its directory (open fds keep working until close)."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            if not missing_ok:
                raise

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("O_DIRECT" if self.direct else "buffered")
        return f"PreallocatedFile({self.path!r}, size={self.size if hasattr(self, 'size') else '?'}, {state})"


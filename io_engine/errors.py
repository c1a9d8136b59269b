"""IOEngineError: every IO failure, naming the operation, path, offset, byte count and OS error."""

from __future__ import annotations

import errno as _errno
import os

# What to do about the common failures, keyed by errno.
_HINTS = {
    _errno.ENOSPC: "the file system is full: free space or use a directory on a larger drive",
    _errno.EDQUOT: "the disk quota is exhausted: free space or raise the quota",
    _errno.EFBIG: "the file would exceed the file size limit (ulimit -f / RLIMIT_FSIZE) or the file "
                  "system's maximum file size",
    _errno.ENOENT: "the file or its directory does not exist: create the directory first",
    _errno.EACCES: "permission denied: check the file's and directory's permissions",
    _errno.EROFS: "the file system is read-only: choose a writable directory",
    _errno.EBADF: "the file descriptor is closed or not open for this operation (a PreallocatedFile "
                  "closed while IO was in flight, or a read-only fd used for writing)",
    _errno.EINVAL: "O_DIRECT refused the request (file system or alignment): use direct=\"auto\" or "
                   "direct=False",
    _errno.EIO: "the drive reported an IO error: check `dmesg` and the drive's health",
}


class IOEngineError(OSError):
    """An IO request failed. `errno`, `strerror` as for OSError; `path`, `offset`, `nbytes` and `op`
    ("pread", "pwrite", "open", "preallocate", ...) say which request."""

    def __init__(self, err: int, message: str, *, op: str = "", path: str | None = None,
                 offset: int | None = None, nbytes: int | None = None) -> None:
        super().__init__(err, message)
        self.op = op
        self.path = path
        self.offset = offset
        self.nbytes = nbytes


def errno_text(err: int) -> str:
    """'ENOSPC: No space left on device'."""
    return f"{_errno.errorcode.get(err, 'errno ' + str(err))}: {os.strerror(err)}"


def io_error(err: int, what: str, *, op: str, path: str | None, offset: int | None = None,
             nbytes: int | None = None, hint: str | None = None) -> IOEngineError:
    """An IOEngineError whose message reads: what failed, the OS error, and how to fix it."""
    hint = _HINTS.get(err) if hint is None else hint
    message = f"{what}: {errno_text(err)}" + (f"; {hint}" if hint else "")
    return IOEngineError(err, message, op=op, path=path, offset=offset, nbytes=nbytes)

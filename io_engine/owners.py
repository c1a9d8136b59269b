"""Files and folders owned by a process: a temporary name that ends in its owner's PID, a lock
file holding it. Whoever finds one left behind may remove it only when that process is gone."""

from __future__ import annotations

import os
import stat


def pid_alive(pid: int) -> bool:
    """Whether a process with this PID exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def not_own(st: os.stat_result, *, folder: bool) -> str:
    """Why the entry `st` (its lstat) is not a regular file (`folder`: a folder) of this user's,
    which tierzero may write or remove, in words; "" when it is. A link is never followed."""
    if stat.S_ISLNK(st.st_mode):
        return "a symbolic link"
    if not (stat.S_ISDIR(st.st_mode) if folder else stat.S_ISREG(st.st_mode)):
        return "not a folder" if folder else "not a regular file"
    if st.st_uid != os.geteuid():
        return f"owned by uid {st.st_uid}, not this user"
    return ""


def temp_name(prefix: str, name: str, pid: int | None = None) -> str:
    """A temporary file or folder name ending in its owner's PID (this process by default)."""
    return f"{prefix}{name}-{os.getpid() if pid is None else pid}"


def owner_gone(name: str) -> bool:
    """Whether the process named at the end of `name` (`temp_name`) is gone; False when the name
    ends in no PID."""
    pid = name.rpartition("-")[2]
    return pid.isdigit() and not pid_alive(int(pid))


def read_pid(fd: int) -> int | None:
    """The PID a lock file holds (its first line), or None when it holds none."""
    text = os.pread(fd, 32, 0).decode("ascii", errors="replace").strip()
    return int(text) if text.isdigit() else None

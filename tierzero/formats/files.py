"""Whether a file of a model folder can be read as one: a regular file (or a link to one) this
user may read, told apart from a FIFO, a device, a socket or a folder under the same name, which
would block a reader, stream endless bytes, or fail with an error naming something else."""

from __future__ import annotations

import os
import stat
from pathlib import Path


def readable_file(path: str | os.PathLike[str]) -> bool:
    """True when `path` is a regular file (a link to one counts: the transformers cache links its
    files) that this user can read; False when nothing is there; ValueError naming it otherwise."""
    path = Path(path)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if os.path.islink(path):
            raise ValueError(f"{str(path)!r} is a symbolic link to {os.readlink(path)!r}, which does not exist; "
                             "restore the file it names or replace the link with the file") from None
        return False
    except OSError as e:
        raise ValueError(f"{str(path)!r} cannot be read ({e.strerror}); give this user read access to it") from None
    if not stat.S_ISREG(st.st_mode):
        kind = ("a FIFO (named pipe)" if stat.S_ISFIFO(st.st_mode) else "a device file"
                if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode) else "a socket" if stat.S_ISSOCK(st.st_mode)
                else "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file")
        link = f" (a link to {os.path.realpath(path)!r})" if os.path.islink(path) else ""
        raise ValueError(f"{str(path)!r} is {kind}{link}, not a regular file; put the real file there")
    if not os.access(path, os.R_OK):
        raise ValueError(f"{str(path)!r} cannot be read by this user (mode {stat.S_IMODE(st.st_mode):04o}, owner uid "
                         f"{st.st_uid}); give this user read access to it")
    return True

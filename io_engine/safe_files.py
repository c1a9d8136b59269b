"""Files and folders made so that nothing is written through a link someone else planted, and
private unless asked otherwise. See [Note: no write through a link].

- `file_mode(private)` / `folder_mode(private)`: 0600 / 0700, or 0666 / 0777 (the umask then
  decides), the modes everything here creates with.
- `open_own(path, ...)`: a file this process may write in place (a lock, a log appended to): a
  symlink is refused by O_NOFOLLOW, a file with other hard links or not regular is refused.
- `replace_file(path, content)`: the file written whole under a fresh temporary name (created
  with O_EXCL | O_NOFOLLOW), fsynced, renamed over `path`: a link at `path` is replaced, never
  written through.
- `make_folder(path)`: a folder made with the mode (and its missing parents); an existing one is
  left as it is.
- `mark_own(folder)` / `marked_own(folder)`: the marker file that says a folder is tierzero's
  temporary folder of process <pid>, made by this user: what a later cleanup may remove.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from pathlib import Path
from typing import Callable

# [Note: no write through a link]
# A folder a user shares (a run folder, a scratch disk) may hold a symlink or a hard link
# someone planted where tierzero writes (`.lock`, `metrics.jsonl`); opening it for writing
# would overwrite the file it names. So a file written in place is opened with O_NOFOLLOW and
# refused when it has other links; a file written whole is made under a fresh name with
# O_EXCL (which never follows a link) and renamed over the old name (a rename replaces the
# link itself). Folders tierzero made for itself carry a marker file: cleanups remove only
# marked folders, of this user, whose process is gone.

MARKER = ".tierzero-staging"
"""The marker file of a temporary folder tierzero made (its PID inside)."""


def file_mode(private: bool = True) -> int:
    return 0o600 if private else 0o666


def folder_mode(private: bool = True) -> int:
    return 0o700 if private else 0o777


def open_own(path: str | os.PathLike[str], flags: int, *, private: bool = True) -> int:
    """A descriptor of `path` (created when missing) for writing in place; OSError naming the
    file when it is a symlink, a hard link of another file, or not a regular file."""
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, file_mode(private))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, f"{str(path)!r} is a symbolic link; tierzero does not write through a "
                          "link it did not make: remove the link (or give another folder)") from None
        raise
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        os.close(fd)
        what = "not a regular file" if not stat.S_ISREG(st.st_mode) else f"a hard link ({st.st_nlink} names)"
        raise OSError(errno.EMLINK, f"{str(path)!r} is {what}; tierzero does not write through a file another name "
                      "shares: remove it (or give another folder)")
    return fd


def replace_file(path: str | os.PathLike[str], content: str | bytes | Callable[[Path], None], *,
                 private: bool = True) -> None:
    """Write `path` whole or not at all: a fresh temporary file beside it (O_EXCL | O_NOFOLLOW),
    fsynced, renamed over `path`. `content` is text, bytes, or a function that writes the file
    at the path it is given (the temporary file, already created)."""
    final = Path(path)
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a killed run's, or a planted link: removed, never followed
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, file_mode(private))
    try:
        with os.fdopen(fd, "wb") as f:
            if not callable(content):
                f.write(content.encode() if isinstance(content, str) else content)
        if callable(content):
            content(tmp)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, final)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def make_folder(path: str | os.PathLike[str], *, private: bool = True) -> Path:
    """`path` made as a folder with `folder_mode(private)` (its missing parents too); an
    existing folder is left as it is."""
    path = Path(path)
    missing = [p for p in (path, *path.parents) if not os.path.lexists(p)]
    for p in reversed(missing):
        with contextlib.suppress(FileExistsError):
            os.mkdir(p, folder_mode(private))
            if private:
                os.chmod(p, folder_mode(private))  # the umask may have taken bits (p: the folder just made)
    return path


def mark_own(folder: str | os.PathLike[str]) -> None:
    """Mark `folder` as this process's temporary folder (see `marked_own`)."""
    fd = os.open(Path(folder) / MARKER, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"{os.getpid()}\n")


def marked_own(folder: str | os.PathLike[str]) -> bool:
    """Whether `folder` is a real folder (not a link) holding tierzero's marker as a regular file,
    both owned by this user (root counts only its own: another user's folder is theirs)."""
    try:
        st_dir = os.lstat(folder)
        st = os.lstat(Path(folder) / MARKER)
    except OSError:
        return False
    uid = os.geteuid()
    return (stat.S_ISDIR(st_dir.st_mode) and stat.S_ISREG(st.st_mode)
            and st_dir.st_uid == uid and st.st_uid == uid)


def remove_if_empty_own(folder: str | os.PathLike[str]) -> None:
    """Remove `folder` when it is a real folder this user owns and it is empty: what a kill between
    a temporary folder's mkdir and its marker (`mark_own`) leaves. rmdir removes no content, so a
    folder holding anything stays; a link is not followed (rmdir refuses it)."""
    with contextlib.suppress(OSError):
        st = os.lstat(folder)
        if stat.S_ISDIR(st.st_mode) and st.st_uid == os.geteuid():
            os.rmdir(folder)


def make_private(folder: str | os.PathLike[str]) -> None:
    """A folder this process just wrote, made private: it and every folder in it 0700, every
    regular file 0600 (links are not followed; their targets are not this folder's)."""
    for root, dirs, files in os.walk(folder):
        os.chmod(root, 0o700)
        for name in files:
            p = os.path.join(root, name)
            if not os.path.islink(p):
                os.chmod(p, 0o600)

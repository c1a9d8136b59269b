"""This run's folder of swap files on one rank, and the reclaimer of dead runs' folders.

Layout: nvme_dir/rank{r}/run-<time>-<pid>-<random>/ holds a `.lock` file, flocked by the run
for its lifetime and holding its PID, and the run's swap files `swapNNNN.bin`. The folder is
0700 and its files 0600 (they hold a model's weights and optimizer state); it is made under a
hidden name and renamed once locked, so that a reclaimer in another process never sees a run
folder whose owner has not locked it yet.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import re
import signal
import stat
import sys
import threading
import time
import uuid
import weakref
from pathlib import Path
from typing import Any

from io_engine import pid_alive, read_pid
from tierzero.config import format_size

LOCK = ".lock"
"""A run folder's lock file: flocked by the process that owns the folder, holding its PID."""
RUN_PREFIX = "run-"
SWAP_FILE = re.compile(r"swap\d{4}\.bin")
"""The names of the swap files a run folder holds (SwapSpace names them so)."""
FOLDER_MODE, FILE_MODE = 0o700, 0o600
SHARED_MODE = 0o1777
"""nvme_dir and its rank folders when tierzero makes them: shared, sticky (see `_shared_folder`)."""
_OPEN_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def swap_file_name(chunk: int) -> str:
    return f"swap{chunk:04d}.bin"


def check_nvme_dir(nvme_dir: Path) -> None:
    """OSError naming what is wrong with `nvme_dir` and how to fix it, before anything is made:
    a file where a folder is wanted, a missing parent, a parent that is a file."""
    if nvme_dir.exists() and not nvme_dir.is_dir():
        raise NotADirectoryError(f"nvme_dir {str(nvme_dir)!r} is a file, not a folder; give a folder for the swap "
                                 "files (it is created when missing, inside an existing folder)")
    if nvme_dir.is_dir():
        return
    parent = nvme_dir.parent
    for p in (parent, *parent.parents):
        if p.exists():
            if not p.is_dir():
                raise NotADirectoryError(f"nvme_dir {str(nvme_dir)!r}: {str(p)!r} is a file, not a folder; give "
                                         "nvme_dir inside an existing folder on the NVMe drive")
            break
    if not parent.is_dir():
        raise FileNotFoundError(f"nvme_dir {str(nvme_dir)!r}: its parent folder {str(parent)!r} does not exist; "
                                "give nvme_dir inside an existing folder on the NVMe drive")


class RunFolder:
    """This run's locked folder of swap files on one rank (see the module docstring)."""

    def __init__(self, nvme_dir: str | os.PathLike[str], rank: int) -> None:
        base = Path(nvme_dir)
        check_nvme_dir(base)
        rank_dir = base / f"rank{rank}"
        try:
            _shared_folder(base)
            _shared_folder(rank_dir)
        except PermissionError as e:
            raise PermissionError(e.errno, f"nvme_dir {str(base)!r}: cannot create {str(e.filename)!r} (permission "
                                  "denied); give a folder this user can write") from e
        reclaim_dead_runs(rank_dir)
        name = f"{RUN_PREFIX}{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        making = rank_dir / f".{name}"
        try:
            making.mkdir(mode=FOLDER_MODE, parents=True)  # the rank folder again, if another run just removed it
        except PermissionError as e:
            raise PermissionError(e.errno, f"nvme_dir {str(base)!r}: cannot create a run folder in {str(rank_dir)!r} "
                                  "(permission denied: another user's rank folder?); give a folder this user can "
                                  "write") from e
        self._lock = os.open(making / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, FILE_MODE)
        fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.write(self._lock, f"{os.getpid()}\n".encode())
        self.path = rank_dir / name
        making.rename(self.path)

    def file(self, chunk: int) -> Path:
        """The path of swap file number `chunk`."""
        return self.path / swap_file_name(chunk)

    def remove(self) -> None:
        """Remove the swap files, the lock and the folder (what is already gone is no error), then
        let the lock go; the rank folder too when no other run uses it. Idempotent."""
        if self._lock < 0:
            return
        with contextlib.suppress(FileNotFoundError):
            for entry in os.scandir(self.path):
                if SWAP_FILE.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                    os.unlink(entry.path)
        # The lock is held until the folder is gone: a reclaimer in another process never takes
        # a live run's lock (it skips a lock file already unlinked, too).
        (self.path / LOCK).unlink(missing_ok=True)
        with contextlib.suppress(FileNotFoundError):
            self.path.rmdir()
        os.close(self._lock)  # lets the flock go
        self._lock = -1
        with contextlib.suppress(OSError):  # other runs (other processes) may still use it
            self.path.parent.rmdir()

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"


def _shared_folder(path: Path) -> None:
    """`path` made, when missing, as a folder every user of a shared scratch disk can make their
    own run folders in and none can remove another's (1777, as /tmp); an existing one is left."""
    try:
        path.mkdir(mode=SHARED_MODE)
    except FileExistsError:
        return
    os.chmod(path, SHARED_MODE)  # past the umask


# [Note: reclaiming dead runs] A run killed before it could remove its swap files (SIGKILL, a
# power loss) leaves its folder behind; the next run on the same rank folder removes it. It
# removes only what tierzero made, and only where it is sure the owner is dead:
#
# - every step works relative to a directory opened with O_NOFOLLOW: no symlink is followed,
#   at any level (a rank folder or a `run-*` entry that is a symlink is left alone);
# - a folder is a dead run's when its `.lock` is a regular file that no process holds (flock)
#   and whose PID names no live process; a folder that cannot be opened or locked, or that
#   another user owns (root opens any folder), is skipped: on a shared scratch disk (nvme_dir
#   and its rank folders are made 1777 when tierzero makes them, as /tmp) each user reclaims
#   their own;
# - only `.lock` and `swapNNNN.bin` regular files are removed, then the folder if that emptied it
#   (a folder holding anything else stays, and the reclaimer says so).
def reclaim_dead_runs(rank_dir: Path) -> None:
    """Remove what dead runs left in `rank_dir` ([Note: reclaiming dead runs]); a line on stderr
    for each folder removed or left."""
    try:
        parent = os.open(rank_dir, _OPEN_DIR)
    except OSError:
        return  # a symlink, gone, or not ours to read: nothing to reclaim here
    try:
        for entry in os.scandir(parent):
            if entry.name.startswith(RUN_PREFIX) and entry.is_dir(follow_symlinks=False):
                _reclaim(parent, entry.name, rank_dir)
    finally:
        os.close(parent)


def _reclaim(parent: int, name: str, rank_dir: Path) -> None:
    try:
        run = os.open(name, _OPEN_DIR, dir_fd=parent)
    except OSError:
        return  # not a folder we may open (another user's), or gone
    try:
        if os.fstat(run).st_uid != os.geteuid():
            return  # another user's (root opens any folder): theirs to reclaim
        try:
            lock = os.open(LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=run)
        except OSError:
            return  # no lock (being made or removed by its owner), or not ours
        try:
            if not stat.S_ISREG(os.fstat(lock).st_mode):
                return
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return  # a live run holds it
            if os.fstat(lock).st_nlink == 0:
                return  # its owner is removing the folder right now
            pid = read_pid(lock)
            if pid is None or pid_alive(pid):
                return  # not a tierzero lock, or its process lives on (it let the lock go itself)
            freed = 0
            for entry in os.scandir(run):
                if SWAP_FILE.fullmatch(entry.name) and entry.is_file(follow_symlinks=False):
                    freed += entry.stat(follow_symlinks=False).st_size
                    os.unlink(entry.name, dir_fd=run)
            os.unlink(LOCK, dir_fd=run)
        finally:
            os.close(lock)
        others = sorted(e.name for e in os.scandir(run))
    finally:
        os.close(run)
    where = rank_dir / name
    if others:
        print(f"tierzero: removed {format_size(freed)} of swap files left in {where} by process {pid}, which is "
              f"gone; left the folder, which holds files tierzero did not make: {others[:5]}", file=sys.stderr)
        return
    with contextlib.suppress(OSError):
        os.rmdir(name, dir_fd=parent)
    print(f"tierzero: removed {format_size(freed)} of swap files left in {where} by process {pid}, which is gone",
          file=sys.stderr)


# ------------------------------------------------------------------ no swap file left at exit

_OPEN: "weakref.WeakSet[Any]" = weakref.WeakSet()
"""Placement managers not closed yet: closed at interpreter exit, so a script that ends
without closing its model leaves no swap files behind."""


def close_at_exit(owner: Any) -> None:
    """`owner.close(flush=False)` at interpreter exit unless `closed(owner)` came first."""
    _OPEN.add(owner)


def closed(owner: Any) -> None:
    _OPEN.discard(owner)


def exit_on_sigterm() -> None:
    """SIGTERM (what schedulers and torchrun send to stop a process) ends it the way SIGINT
    does: an exception unwinds the program, so `finally` blocks and the close at exit run and no
    swap file stays behind. Installed once, from the main thread, and only over the default
    handler: a program's own SIGTERM handler is left alone."""
    if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
        signal.signal(signal.SIGTERM, _raise_exit)


def _raise_exit(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


@atexit.register
def _close_at_exit() -> None:
    for owner in list(_OPEN):
        try:
            owner.close(flush=False)  # the swap files go: writing dirty copies into them is waste
        except Exception as e:  # the interpreter is exiting: report, close the others
            print(f"tierzero: closing {owner!r} at exit failed: {e}", file=sys.stderr)


_EXITING = threading.Event()


def exiting() -> bool:
    """Whether the interpreter is exiting: set before it joins the threads still running (a
    thread waiting for room then fails instead of keeping the process alive)."""
    return _EXITING.is_set()


# threading's own at-exit hook runs before the interpreter joins non-daemon threads (the
# updater's thread pool among them); atexit's run only after they are joined.
threading._register_atexit(_EXITING.set)  # noqa: SLF001 (what concurrent.futures uses for the same)

"""The run folder of `tierzero train`: locked by its run, written so that nothing is lost.

- Lock: `R/.lock`, flocked for the run's life and holding its PID. A second run on the same
  folder (or the same checkpoint folder) is refused at once, naming that PID.
- Room: the disk under R must hold what the run will write there (metrics, trace, plot, and
  the checkpoints kept), checked before the first step.
- metrics.jsonl: a row appended and flushed per step, fsynced with every checkpoint; reading
  it back for `--resume` drops a torn last line (a kill mid-write) and says so.
- End-of-run files (trace.json, summary.json, tiers.png) are each written under a temporary
  name, fsynced, then renamed: a failure leaves no partial file, names its file, and does not
  stop the others.
- Links: never written through ([Note: no write through a link] in io_engine/safe_files.py);
  private (0700 / 0600) unless `private=False`. What is already there: [Note: a run folder
  holds one run] (`check_contents`).
"""

from __future__ import annotations

import argparse
import errno
import fcntl
import json
import os
import re
import shutil
import stat
import sys
from pathlib import Path
from typing import IO, Callable

from io_engine import (free_disk_bytes, make_folder, mark_own, marked_own, not_own, open_own, read_pid,
                       replace_file, temp_name)
from tierzero.checkpoint import PREFIX, TMP_PREFIX, TRASH_PREFIX, checkpoints, not_own_checkpoint
from tierzero.config import format_size
from tierzero.placement import MAX_EVENTS

LOCK = ".lock"
METRICS = "metrics.jsonl"
END_FILES = ("summary.json", "trace.json", "tiers.png", "error.log")
"""The files a run writes at its end (or when it fails)."""
CHECKPOINTS = "checkpoints"
"""The checkpoint folder inside a run folder (when --checkpoint-dir is not given)."""
_CKPT = re.compile(re.escape(PREFIX) + r"\d{8}")
_OWN_TEMP = re.compile(r"\.(" + "|".join(map(re.escape, (LOCK[1:], METRICS, *END_FILES))) + r")\.tmp-\d+"
                       r"|\.tierzero-probe-\d+")
"""The temporary name of a file the run writes whole (`replace_file`), or of its write probe
(outputs.py), left by a killed run."""


# [Note: a run folder holds one run]
# A run folder is the record of one run: its metrics, its checkpoints, its end files. A new run
# (no --resume) on a folder that holds an earlier run would replace its metrics.jsonl and, through
# keep_last, delete its checkpoints: the hours that run trained, lost without a word. So before the
# folder is locked or written, its entries are read (lstat: no link followed) and sorted:
# - tierzero's: `.lock`, metrics.jsonl and the end files as regular files of this user, their
#   temporary names, `checkpoints/` as a folder of this user holding `ckpt-N` folders of this user
#   with a manifest (and save leftovers); the folders this command names (--nvme-dir, --export,
#   --checkpoint-dir) inside the run folder;
# - anything else (a link, another user's file, a name tierzero never writes) is not tierzero's:
#   the run is refused whatever the flags, naming it; nothing is moved.
# An earlier run's files refuse a run without --resume, naming them and the ways on: --resume, a
# new --run-dir, or --overwrite, which removes that run's files and checkpoints (only those) once
# the folder is locked. The checkpoint folder of --checkpoint-dir is read the same way for its
# `ckpt-N` entries (other files there are not the run's and are left alone).


class RunDir:
    """One locked folder of a run (the run folder, or a checkpoint folder outside it)."""

    def __init__(self, path: str | os.PathLike[str], *, flag: str = "--run-dir", private: bool = True) -> None:
        self.path = Path(path)
        self.flag = flag
        self.private = private
        if self.path.exists() and not self.path.is_dir():
            raise NotADirectoryError(f"{flag} {str(self.path)!r} is a file; give a folder")
        make_folder(self.path, private=private)
        fd = open_own(self.path / LOCK, os.O_RDWR, private=private)
        try:
            _lock(fd, self.path, flag)
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock = fd

    def close(self) -> None:
        """Let the lock go (the lock file stays: a dead run's holds no flock). Idempotent."""
        if self._lock >= 0:
            os.close(self._lock)
            self._lock = -1

    def check_room(self, nbytes: int, what: str) -> None:
        """OSError now when the disk under this folder has less than `nbytes` free."""
        free = free_disk_bytes(self.path)
        if free < nbytes:
            raise OSError(f"{self.flag} {str(self.path)!r}: the disk has {format_size(free)} free but {what} needs "
                          f"about {format_size(nbytes)}; free space there or give a folder on a larger disk")

    # ------------------------------------------------------------------------------ metrics

    def open_metrics(self, *, resume: bool) -> IO[str]:
        """metrics.jsonl for appending rows (a new empty file unless resuming; never a link's target)."""
        if not resume:
            replace_file(self.path / METRICS, b"", private=self.private)
        fd = open_own(self.path / METRICS, os.O_WRONLY | os.O_APPEND, private=self.private)
        return os.fdopen(fd, "a", encoding="utf-8")

    def keep_metrics_before(self, step: int) -> None:
        """Resuming at `step`: keep the rows of the steps before it (the rows after it belong to
        steps that will run again); a torn last line is dropped, and said so."""
        path = self.path / METRICS
        if not path.exists():
            return
        text = path.read_text(encoding="utf-8", errors="replace")
        lines = text.split("\n")
        rows = []
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError:
                if i < len(lines) - 1 and any(rest.strip() for rest in lines[i + 1:]):
                    raise ValueError(f"{str(path)!r} line {i + 1} is not JSON ({line[:60]!r}...); it was not written "
                                     "by a tierzero run alone: move it away to resume") from None
                print(f"tierzero train: --resume: dropped a torn last line of {path} (the run was stopped while "
                      f"writing it: {line[:40]!r}...)", file=sys.stderr)
                break
            if row.get("step", step) < step:
                rows.append(line)
        self.write(METRICS, "".join(r + "\n" for r in rows))

    # --------------------------------------------------------------------- end-of-run files

    def write(self, name: str, content: str | bytes | Callable[[Path], None]) -> None:
        """Write `name` whole or not at all: under a fresh temporary name, fsynced, then renamed
        (`replace_file`). `content` is the text or bytes, or a function that writes the file at
        the path it is given."""
        replace_file(self.path / name, content, private=self.private)

    def write_each(self, files: dict[str, str | bytes | Callable[[Path], None]]) -> list[dict[str, str]]:
        """`write` every file, each independently of the others; one {"file", "path", "error"}
        per failure (returned, and printed on stderr)."""
        failed = []
        for name, content in files.items():
            try:
                self.write(name, content)
            except Exception as e:
                failed.append(not_written(name, self.path / name, e))
        return failed

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"


def _lock(fd: int, folder: Path, flag: str) -> None:
    """flock `fd` (the folder's `.lock`); ValueError naming the PID in it when a live run holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        pid = read_pid(fd) or "?"
        raise ValueError(f"{flag} {str(folder)!r} is in use by process {pid} (it holds {str(folder / LOCK)!r}); wait "
                         f"for that run to end, or give another {flag}") from None


def check_not_in_use(folder: Path, flag: str) -> None:
    """ValueError when a live run holds `folder`'s lock (read without writing anything; a link
    or a file that is not a regular one is left to `check_contents`)."""
    try:
        fd = os.open(folder / LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    except OSError:
        return
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            _lock(fd, folder, flag)
    finally:
        os.close(fd)  # lets the flock go


DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO)
"""A disk full (or over quota, or failing): the run exits with DISK_EXIT, naming the file."""
DISK_EXIT = 3


def disk_error(e: OSError, file: Path, folder: Path, flag: str) -> OSError:
    """`e` (a disk full while the run wrote `file`) as an error naming the file and the folder to
    free; other errors as they are."""
    if e.errno not in DISK_ERRNOS:
        return e
    text = str(e) if str(file) in str(e) else f"{str(file)!r}: {e.strerror or e}"
    return OSError(e.errno, f"{text}. Free space on the disk of {flag} {str(folder)!r} (or give a folder on "
                   "another disk), then continue with --resume from the last checkpoint")


def not_written(name: str, path: Path, e: BaseException) -> dict[str, str]:
    """summary.json's record of an end-of-run file that failed (printed on stderr too)."""
    print(f"tierzero train: error: {path}: not written ({type(e).__name__}: {e})", file=sys.stderr)
    return {"file": name, "path": str(path), "error": f"{type(e).__name__}: {e}"}


def checkpoint_dir(args: argparse.Namespace) -> Path:
    """Where `tierzero train` saves its checkpoints: --checkpoint-dir, or RUN_DIR/checkpoints."""
    return Path(args.checkpoint_dir) if args.checkpoint_dir else Path(args.run_dir) / CHECKPOINTS


class Contents:
    """What a run folder (or a checkpoint folder) holds, sorted as [Note: a run folder holds one
    run] says: the earlier run's files and checkpoints, and what is not tierzero's (with why)."""

    def __init__(self) -> None:
        self.files: list[Path] = []
        self.checkpoints: list[Path] = []
        self.foreign: list[str] = []

    def read_checkpoints(self, folder: Path) -> None:
        """The `ckpt-N` entries of a checkpoint folder (only those: its other files are left alone)."""
        for entry in sorted(os.scandir(folder), key=lambda e: e.name):
            if _CKPT.fullmatch(entry.name):
                why = not_own_checkpoint(Path(entry.path))
                if why:
                    self.foreign.append(f"{entry.path} ({why})")
                else:
                    self.checkpoints.append(Path(entry.path))

    @property
    def earlier_run(self) -> list[str]:
        """The earlier run's files, in words, when it trained (metrics rows or checkpoints); empty
        when there is none, or it stopped before its first step (its summary.json is replaced)."""
        rows = sum(sum(1 for _ in f.open("rb")) for f in self.files if f.name == METRICS)
        if not rows and not self.checkpoints:
            return []
        out = [f"{METRICS} ({rows} rows)"] if rows else []
        out += [f.name for f in self.files if f.name in END_FILES]
        if self.checkpoints:
            out.append(f"{len(self.checkpoints)} checkpoint(s) in {self.checkpoints[0].parent} "
                       f"({', '.join(p.name for p in self.checkpoints[-3:])})")
        return out


def _not_own(entry: os.DirEntry, *, folder: bool) -> str:
    """Why `entry` is not a file (folder) this user's tierzero wrote, or "" when it may be."""
    st = entry.stat(follow_symlinks=False)
    why = not_own(st, folder=folder)
    if why and stat.S_ISLNK(st.st_mode):
        return f"{why}: tierzero follows no link in a run folder"
    return "a folder" if why and not folder and stat.S_ISDIR(st.st_mode) else why


def check_contents(path: Path, *, flag: str, named: set[str], in_run: bool) -> Contents:
    """The contents of the run folder (`in_run`) or the checkpoint folder `path` (see [Note: a
    run folder holds one run]); `named`: the names in it of the folders this command gives.
    ValueError naming what is not tierzero's."""
    found = Contents()
    if not os.path.isdir(path):
        return found
    if not in_run:
        found.read_checkpoints(path)
    else:
        for entry in sorted(os.scandir(path), key=lambda e: e.name):
            name = entry.name
            if name in named or (name.startswith((".tmp-", ".old-")) and marked_own(entry.path)):
                continue  # the command's own folders; an export's staging folder (marked, this user's)
            if name == CHECKPOINTS:
                why = _not_own(entry, folder=True)
                if not why:
                    found.read_checkpoints(Path(entry.path))
                    why = _foreign_in_checkpoints(Path(entry.path))
            elif name in (LOCK, METRICS, *END_FILES) or _OWN_TEMP.fullmatch(name):
                why = _not_own(entry, folder=False)
                if not why and name != LOCK and not name.startswith("."):
                    found.files.append(Path(entry.path))
            else:
                why = "not a file tierzero writes"
            if why:
                found.foreign.append(f"{entry.path} ({why})")
    if found.foreign:
        raise ValueError(f"{flag} {str(path)!r} holds what tierzero did not write: {'; '.join(found.foreign[:5])}"
                         f"{f' and {len(found.foreign) - 5} more' if len(found.foreign) > 5 else ''}. A run writes "
                         f"only into a new or empty folder or one an earlier run of this user's made, and replaces "
                         f"nothing else: give a new {flag}, or move those away")
    return found


def _foreign_in_checkpoints(folder: Path) -> str:
    """Why the run folder's checkpoints/ holds something a save did not make ("" when not)."""
    for entry in os.scandir(folder):
        if not (_CKPT.fullmatch(entry.name) or entry.name.startswith((TMP_PREFIX, TRASH_PREFIX))):
            return f"holds {entry.name!r}, which no checkpoint save writes"
    return ""


def remove_earlier_run(found: Contents) -> None:
    """--overwrite, the folder locked: the earlier run's files and checkpoints removed (only
    those `check_contents` found to be tierzero's; a checkpoint renamed away first, so that a
    crash leaves no half checkpoint under its name)."""
    for f in found.files:
        f.unlink(missing_ok=True)
    for ckpt in found.checkpoints:
        trash = ckpt.with_name(temp_name(TRASH_PREFIX, ckpt.name))
        mark_own(ckpt)
        os.rename(ckpt, trash)
        shutil.rmtree(trash)


def new_checkpoints(args: argparse.Namespace) -> tuple[int, int]:
    """(checkpoints the run adds to its disk at most, checkpoints of this user's already there).
    The disk holds --keep-last of them and the one being saved before the oldest is pruned, so a
    resumed run needs room for those beyond what is there (and always for the one being saved)."""
    if not args.checkpoint_every:
        return 0, 0
    folder = checkpoint_dir(args)
    there = len([p for p in checkpoints(folder) if not not_own_checkpoint(p)]) if folder.is_dir() else 0
    return max(1, args.keep_last + 1 - there), there


METRICS_ROW_BYTES = 2048
TRACE_EVENTS_PER_STEP, TRACE_EVENT_BYTES = 4096, 200
"""What the room check counts for a step's metrics row and trace (generous: it guards a full disk)."""


def _named(args: argparse.Namespace) -> set[str]:
    """The names in the run folder of the folders this command gives (--nvme-dir, --export,
    --checkpoint-dir inside it): the run's own, whatever they hold."""
    run = Path(args.run_dir).absolute()
    names = set()
    for given in (args.nvme_dir, args.export, args.checkpoint_dir):
        if given and (p := Path(given).absolute()).is_relative_to(run) and p != run:
            names.add(p.relative_to(run).parts[0])
    return names


class RunFolders:
    """Rank 0's locked run folder, and the checkpoint folder when it is elsewhere (other ranks:
    none; they only read checkpoints)."""

    def __init__(self, run: RunDir | None = None, ckpt: RunDir | None = None) -> None:
        self.run = run
        self.ckpt = ckpt

    @classmethod
    def open(cls, args: argparse.Namespace, rank: int, *, private: bool = True) -> "RunFolders":
        """Rank 0's folders, read first ([Note: a run folder holds one run]: refused before
        anything is made or written when they hold what is not tierzero's, or an earlier run
        and neither --resume nor --overwrite is given), then locked; --overwrite then removes
        the earlier run."""
        if rank != 0:
            return cls()
        run = Path(args.run_dir)
        ckpt = checkpoint_dir(args).absolute()
        outside = bool(args.checkpoint_every or args.resume) and not ckpt.is_relative_to(run.absolute())
        check_not_in_use(run, "--run-dir")
        found = [check_contents(run, flag="--run-dir", named=_named(args), in_run=True)]
        if outside:
            found.append(check_contents(ckpt, flag="--checkpoint-dir", named=set(), in_run=False))
        earlier = [w for f in found for w in f.earlier_run]
        if earlier and not (args.resume or args.overwrite):
            raise ValueError(f"--run-dir {str(run)!r} holds an earlier run: {', '.join(earlier)}. A new run would "
                             "replace it; continue it with --resume, give a new --run-dir, or give --overwrite to "
                             "remove that run's files and checkpoints (only those) and start again")
        folders = cls(RunDir(run, private=private))
        try:
            if outside and args.checkpoint_every:
                folders.ckpt = RunDir(ckpt, flag="--checkpoint-dir", private=private)
            if args.overwrite and not args.resume:
                for f in found:
                    remove_earlier_run(f)
        except BaseException:
            folders.close()
            raise
        return folders

    def check_room(self, args: argparse.Namespace, state_bytes: int) -> None:
        """The disks under the folders hold what the run writes there: each step's metrics row
        and trace, and the checkpoints to come (`state_bytes` each; `new_checkpoints`)."""
        if self.run is None:
            return
        files = args.steps * METRICS_ROW_BYTES + min(args.steps * TRACE_EVENTS_PER_STEP, MAX_EVENTS) * TRACE_EVENT_BYTES
        n, there = new_checkpoints(args)
        checkpoints = n * state_bytes
        what = f"{n} more checkpoint(s){f' beside the {there} there' if there else ''}"
        if self.ckpt is None:
            self.run.check_room(files + checkpoints, f"the run folder (metrics, trace, plot, {what})")
        else:
            self.run.check_room(files, "the run folder (metrics, trace, plot)")
            self.ckpt.check_room(checkpoints, what)

    def close(self) -> None:
        for folder in (self.ckpt, self.run):
            if folder is not None:
                folder.close()

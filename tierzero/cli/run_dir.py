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
- Links: `.lock` and `metrics.jsonl` are never written through a symlink or a hard link
  someone planted ([Note: no write through a link] in io_engine/safe_files.py); the folder and
  its files are private (0700 / 0600) unless `private=False` (`--file-mode umask`).
"""

from __future__ import annotations

import argparse
import fcntl
import json
import os
import sys
from pathlib import Path
from typing import IO, Callable

from io_engine import free_disk_bytes, make_folder, open_own, replace_file
from tierzero.config import format_size
from tierzero.placement import MAX_EVENTS

LOCK = ".lock"
METRICS = "metrics.jsonl"


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
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ValueError(f"{flag} {str(self.path)!r} is in use by process {pid} (it holds "
                             f"{str(self.path / LOCK)!r}); wait for that run to end, or give another {flag}") from None
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


def not_written(name: str, path: Path, e: BaseException) -> dict[str, str]:
    """summary.json's record of an end-of-run file that failed (printed on stderr too)."""
    print(f"tierzero train: error: {path}: not written ({type(e).__name__}: {e})", file=sys.stderr)
    return {"file": name, "path": str(path), "error": f"{type(e).__name__}: {e}"}


def checkpoint_dir(args: argparse.Namespace) -> Path:
    """Where `tierzero train` saves its checkpoints: --checkpoint-dir, or RUN_DIR/checkpoints."""
    return Path(args.checkpoint_dir) if args.checkpoint_dir else Path(args.run_dir) / "checkpoints"


METRICS_ROW_BYTES = 2048
TRACE_EVENTS_PER_STEP, TRACE_EVENT_BYTES = 4096, 200
"""What the room check counts for a step's metrics row and trace (generous: it guards a full disk)."""


class RunFolders:
    """Rank 0's locked run folder, and the checkpoint folder when it is elsewhere (other ranks:
    none; they only read checkpoints)."""

    def __init__(self, run: RunDir | None = None, ckpt: RunDir | None = None) -> None:
        self.run = run
        self.ckpt = ckpt

    @classmethod
    def open(cls, args: argparse.Namespace, rank: int, *, private: bool = True) -> "RunFolders":
        if rank != 0:
            return cls()
        folders = cls(RunDir(args.run_dir, private=private))
        try:
            ckpt = checkpoint_dir(args).absolute()
            if args.checkpoint_every and not ckpt.is_relative_to(folders.run.path.absolute()):
                folders.ckpt = RunDir(ckpt, flag="--checkpoint-dir", private=private)
        except BaseException:
            folders.close()
            raise
        return folders

    def check_room(self, args: argparse.Namespace, state_bytes: int) -> None:
        """The disks under the folders hold what the run writes there: each step's metrics row
        and trace, and the checkpoints kept (`state_bytes` each)."""
        if self.run is None:
            return
        files = args.steps * METRICS_ROW_BYTES + min(args.steps * TRACE_EVENTS_PER_STEP, MAX_EVENTS) * TRACE_EVENT_BYTES
        checkpoints = (args.keep_last + 1) * state_bytes if args.checkpoint_every else 0
        if self.ckpt is None:
            self.run.check_room(files + checkpoints, "the run folder (metrics, trace, plot, checkpoints)")
        else:
            self.run.check_room(files, "the run folder (metrics, trace, plot)")
            self.ckpt.check_room(checkpoints, f"{args.keep_last + 1} checkpoints")

    def close(self) -> None:
        for folder in (self.ckpt, self.run):
            if folder is not None:
                folder.close()

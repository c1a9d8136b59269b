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

import fcntl
import json
import os
import sys
from pathlib import Path
from typing import IO, Callable

from io_engine import free_disk_bytes, make_folder, open_own, replace_file
from tierzero.config import format_size

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

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
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import sys
from pathlib import Path
from typing import IO, Callable

from io_engine import free_disk_bytes
from tierzero.config import format_size

LOCK = ".lock"
METRICS = "metrics.jsonl"


class RunDir:
    """One locked folder of a run (the run folder, or a checkpoint folder outside it)."""

    def __init__(self, path: str | os.PathLike[str], *, flag: str = "--run-dir") -> None:
        self.path = Path(path)
        self.flag = flag
        if self.path.exists() and not self.path.is_dir():
            raise NotADirectoryError(f"{flag} {str(self.path)!r} is a file; give a folder")
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
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
        """metrics.jsonl for appending rows (emptied first unless resuming)."""
        return open(self.path / METRICS, "a" if resume else "w", encoding="utf-8")

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
        """Write `name` whole or not at all: under a temporary name, fsynced, then renamed.
        `content` is the text or bytes, or a function that writes the file at the path it is given."""
        final = self.path / name
        tmp = self.path / f".{name}.tmp-{os.getpid()}"
        try:
            if callable(content):
                content(tmp)
            else:
                with open(tmp, "wb") as f:
                    f.write(content.encode() if isinstance(content, str) else content)
            with open(tmp, "rb") as f:
                os.fsync(f.fileno())
            os.replace(tmp, final)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise

    def write_each(self, files: dict[str, str | bytes | Callable[[Path], None]]) -> list[str]:
        """`write` every file, each independently of the others; one line per failure, naming the
        file (returned, and printed on stderr)."""
        failed = []
        for name, content in files.items():
            try:
                self.write(name, content)
            except Exception as e:
                failed.append(f"{self.path / name}: not written ({type(e).__name__}: {e})")
                print(f"tierzero train: error: {failed[-1]}", file=sys.stderr)
        return failed

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

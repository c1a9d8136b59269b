"""SIGTERM and SIGINT during `tierzero train`: stop at the next step boundary, or at once
(see [Note: stopping at a step boundary])."""

from __future__ import annotations

import signal
import threading
from types import FrameType, TracebackType

import torch
import torch.distributed as dist


class Stopped(BaseException):
    """The run was stopped by a signal (a BaseException, as KeyboardInterrupt is: no `except
    Exception` in the way swallows it)."""

    def __init__(self, signum: int, step: int | None = None) -> None:
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum
        self.step = step
        """The step boundary it stopped at, when it stopped at one (a checkpoint was saved)."""

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


# [Note: stopping at a step boundary]
# Schedulers preempt a job with SIGTERM and a grace period. When the run checkpoints
# (--checkpoint-every K), the first SIGTERM or SIGINT asks it to stop at the end of the step under
# way: it saves a checkpoint there, removes its swap files and exits 143 (SIGTERM) or 130 (SIGINT),
# so that `--resume` continues exactly where it stopped. With several ranks they agree at every
# step boundary (an all-reduce of one flag), so all save the same step. A second signal, or the
# first when the run does not checkpoint, stops the run at once: an exception that unwinds it
# (swap files removed, summary.json written), as Ctrl-C does.
class StopSignals:
    """Handlers for SIGTERM and SIGINT while a run trains (see [Note: stopping at a step boundary])."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self, *, at_step_boundary: bool) -> None:
        self.at_step_boundary = at_step_boundary
        self.requested: int | None = None
        """The first signal received, waiting for the step boundary."""
        self._old: dict[int, object] = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self._old[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, kind: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        for sig, old in self._old.items():
            signal.signal(sig, old)  # type: ignore[arg-type]
        self._old.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.requested is not None or not self.at_step_boundary:
            raise Stopped(signum)
        self.requested = signum

    def agreed(self, world_size: int) -> int | None:
        """At a step boundary: the signal to stop for, agreed by every rank (a collective when
        there are several), or None to go on."""
        if world_size == 1:
            return self.requested
        device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
        flag = torch.tensor([self.requested or 0], dtype=torch.int64, device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item()) or None

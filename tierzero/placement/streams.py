"""Copy streams and events of the device tier, with synchronous stand-ins on CPU.

With CUDA, copies between host and device run on two dedicated streams so they overlap compute
on the default stream; consumers order themselves after a copy with its event. Without CUDA
the device tier is the CPU: copies run at once on the calling thread and every event is already
complete, so the placement code is the same on both and is tested on machines with no GPU.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import ContextManager, Protocol

import torch


class CopyEvent(Protocol):
    """What placement needs of an event: torch.cuda.Event has this shape."""

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class DoneEvent:
    """The CPU stand-in for a CUDA event: the work it marks finished before it was made."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "DoneEvent()"


DONE = DoneEvent()


class CopyStreams:
    """The device tier's copy streams (CUDA) or their synchronous stand-ins (CPU).

    `copy(dst, src)` picks the stream by direction and returns the event recorded after the copy;
    `compute_ready()` marks the compute stream's pending work (taken before copying out a tensor
    compute wrote); `compute_wait(event, tensor)` orders the compute stream after a copy.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        if self.cuda:
            # h2d: fetches toward the device run here so they overlap compute on the default
            # stream instead of queueing behind it.
            self.h2d = torch.cuda.Stream(device)
            # d2h: write-backs run on their own stream so a dirty block's copy-out does not wait
            # behind prefetches queued on h2d (and vice versa).
            self.d2h = torch.cuda.Stream(device)

    def context(self) -> ContextManager[object]:
        """Make this device current on the calling (worker) thread; CUDA's current device is
        per thread, and worker threads start on device 0."""
        return torch.cuda.device(self.device) if self.cuda else nullcontext()

    def alloc_context(self) -> ContextManager[object]:
        """Allocate device tensors that copies will fill on the h2d stream, so the caching
        allocator never hands the copy stream a block compute is still using."""
        return torch.cuda.stream(self.h2d) if self.cuda else nullcontext()

    def compute_ready(self) -> CopyEvent:
        """An event after the work queued so far on the caller's current (compute) stream."""
        if not self.cuda:
            return DONE
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, after: CopyEvent | None = None) -> CopyEvent:
        """dst.copy_(src) on the copy stream of its direction, after `after`; returns its event."""
        if not self.cuda:
            dst.copy_(src)
            return DONE
        stream = self.h2d if dst.device.type == "cuda" else self.d2h
        with torch.cuda.stream(stream):
            if after is not None and not isinstance(after, DoneEvent):
                stream.wait_event(after)
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def compute_wait(self, event: CopyEvent | None, tensor: torch.Tensor) -> None:
        """Order the current (compute) stream after `event`, and tell the caching allocator that
        compute uses `tensor`, so its memory is not reused before compute is done with it."""
        if not self.cuda or tensor.device.type != "cuda":
            return
        stream = torch.cuda.current_stream(self.device)
        if event is not None and not isinstance(event, DoneEvent):
            stream.wait_event(event)
        tensor.record_stream(stream)

    def __repr__(self) -> str:
        return f"CopyStreams({self.device}, {'cuda h2d+d2h' if self.cuda else 'synchronous'})"


def resolve_device(device: torch.device | str | None) -> torch.device:
    """The device a placement manager works with: `device`, else the current CUDA device, else the CPU."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device

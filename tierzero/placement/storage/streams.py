"""Copy streams and events of the device tier: CUDA's, or their stand-ins on the CPU.

With CUDA, copies between host and device run on two dedicated streams so they overlap compute
on each thread's current stream; consumers order themselves after a copy with its event. On the
CPU the device tier is CPU memory and `Config.streams` picks the stand-in: "sync" runs each copy
at once with every event already complete; "async" runs copies later on a worker per stream,
checked and poisoned (see [Note: stream stand-in] in stand_in.py), so the ordering the GPU
depends on is exercised on every machine. The placement code above is the same in all three.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from typing import Any, ContextManager, Literal, Protocol, Sequence

import torch

from tierzero.config import StandInConfig, StreamSettings
from tierzero.placement.storage.stand_in import DeviceLedger, StandInStream, poison

Mode = Literal["cuda", "sync", "async"]


class CopyEvent(Protocol):
    """What placement needs of an event: torch.cuda.Event has this shape."""

    def synchronize(self) -> None: ...

    def query(self) -> bool: ...


class DeviceCopies(Protocol):
    """What the runtime may ask of the device's copy streams (PlacementManager.copies): move a
    tensor to the device, copy and order copies against compute, allocate for a collective.
    Registering, lending and freeing buffers stay placement's (CopyStreams)."""

    asynchronous: bool
    """Copies run beside compute (CUDA streams or the asynchronous stand-in)."""

    def context(self) -> ContextManager[object]: ...

    def compute_ready(self) -> CopyEvent: ...

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, after: CopyEvent | None = None) -> CopyEvent: ...

    def compute_wait(self, event: CopyEvent | None, tensor: torch.Tensor) -> None: ...

    def is_device(self, t: torch.Tensor) -> bool: ...

    def to_device(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor: ...

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor: ...

    def check_collective(self, t: torch.Tensor, what: str) -> None: ...


class DoneEvent:
    """The event of synchronous work: finished before it was made."""

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def __repr__(self) -> str:
        return "DoneEvent()"


DONE = DoneEvent()


class CopyStreams:
    """The device tier's copy streams: CUDA's, or the CPU's stand-ins (module docstring).

    `copy(dst, src)` picks the stream by direction and returns the event recorded after the copy;
    `compute_ready()` marks the calling thread's compute work so far (taken before copying out a
    tensor compute wrote); `compute_wait(event, tensor)` orders the calling thread's compute after
    a copy and records that compute uses `tensor`. Device buffers are registered when allocated
    (`register`) and announced before they are freed (`freeing`), so that the caching allocator's
    rule holds: memory is not reused before the streams that used it are past it.
    """

    def __init__(self, device: torch.device, settings: StreamSettings | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.mode: Mode = "cuda" if self.cuda else (settings.mode if settings is not None else "sync")
        self.asynchronous = self.mode != "sync"
        """Copies complete later than they are issued (CUDA, the stand-in): the fast paths that
        overlap copies with compute are on."""
        options = settings.stand_in if settings is not None else StandInConfig()
        self._poison = self.mode == "async" and options.poison
        self._checks = self.mode == "async" and options.checks
        self.ledger = DeviceLedger() if self.mode == "async" else None
        self._uses: dict[int, set[Any]] = {}
        """CUDA: device buffers of the tier by storage pointer -> the streams other than h2d that used them."""
        if self.cuda:
            # h2d: fetches toward the device run here so they overlap compute on the default
            # stream instead of queueing behind it.
            self.h2d: Any = torch.cuda.Stream(device)
            # d2h: write-backs run on their own stream so a dirty block's copy-out does not wait
            # behind prefetches queued on h2d (and vice versa).
            self.d2h: Any = torch.cuda.Stream(device)
        elif self.mode == "async":
            self.h2d = StandInStream("h2d", delay_seed=options.delay_seed, max_delay_s=options.max_delay_s)
            self.d2h = StandInStream("d2h", delay_seed=options.delay_seed, max_delay_s=options.max_delay_s)

    def context(self) -> ContextManager[object]:
        """Make this device current on the calling (worker) thread; CUDA's current device is
        per thread, and worker threads start on device 0."""
        return torch.cuda.device(self.device) if self.cuda else nullcontext()

    def alloc_context(self) -> ContextManager[object]:
        """Allocate device tensors that copies will fill on the h2d stream, so the caching
        allocator never hands the copy stream a block compute is still using."""
        return torch.cuda.stream(self.h2d) if self.cuda else nullcontext()

    def current(self) -> Any:
        """CUDA: the calling thread's compute stream (each thread has its own current stream;
        on the CPU each thread computes at once, its own stream in effect)."""
        return torch.cuda.current_stream(self.device)

    def compute_ready(self) -> CopyEvent:
        """An event after the work queued so far on the calling thread's compute stream (the
        CPU's compute has run by the time the thread goes on)."""
        if not self.cuda:
            return DONE
        event = torch.cuda.Event(blocking=True)
        event.record(self.current())
        return event

    # ------------------------------------------------------------------------------ copies

    def copy(self, dst: torch.Tensor, src: torch.Tensor, *, after: CopyEvent | None = None) -> CopyEvent:
        """dst.copy_(src) on the copy stream of its direction, after `after`; returns its event.
        One side is device memory, the other the pinned pool's (a non-blocking copy from other
        host memory runs synchronously on CUDA; the stand-in refuses it)."""
        if self.mode == "sync":
            dst.copy_(src)
            return DONE
        to_device = self.is_device(dst)
        host, device = (src, dst) if to_device else (dst, src)
        if self.cuda:
            return self._cuda_copy(dst, src, device, host, to_device, after)
        assert self.ledger is not None
        if self._checks and not self.ledger.is_pinned(host):
            raise RuntimeError(
                f"tierzero (stream stand-in): a non-blocking {'host-to-device' if to_device else 'device-to-host'} "
                f"copy of {src.numel() * src.element_size()} bytes has its host side outside the pinned pool; "
                "CUDA runs such a copy synchronously (or from memory that may move): copy through a buffer "
                "of the host tier")
        if self._poison:
            poison(dst)
        wait = after

        def run() -> None:
            if wait is not None:
                wait.synchronize()
            dst.copy_(src)

        event = (self.h2d if to_device else self.d2h).submit(run)
        self.ledger.copying(event, dst, src)
        return event

    def _cuda_copy(self, dst: torch.Tensor, src: torch.Tensor, device: torch.Tensor, host: torch.Tensor,
                   to_device: bool, after: CopyEvent | None) -> CopyEvent:
        if not host.is_pinned():
            raise RuntimeError(f"tierzero: a non-blocking copy's host side ({host.numel() * host.element_size()} "
                               "bytes) is not pinned memory; copy through a buffer of the host tier")
        stream = self.h2d if to_device else self.d2h
        with torch.cuda.stream(stream):
            if after is not None and not isinstance(after, DoneEvent):
                stream.wait_event(after)
            dst.copy_(src, non_blocking=True)
            if not to_device:  # the source may be freed before the copy ran: the allocator waits
                device.record_stream(stream)
                self._note_use(device, stream)
            event = torch.cuda.Event(blocking=True)  # waited on by workers: sleep, never spin
            event.record(stream)
        return event

    def compute_after(self, waits: Sequence[tuple[CopyEvent | None, torch.Tensor]]) -> None:
        """`compute_wait` of each (event, tensor): tensors acquired together."""
        for event, tensor in waits:
            self.compute_wait(event, tensor)

    def compute_wait(self, event: CopyEvent | None, tensor: torch.Tensor) -> None:
        """Order the calling thread's compute after `event`, and record that compute uses
        `tensor`: a device buffer is not reused before compute is done with it. For host memory
        the CPU is the compute: it waits for the event."""
        if not self.is_device(tensor):
            if event is not None:
                event.synchronize()
            return
        if self.cuda:
            stream = self.current()
            if event is not None and not isinstance(event, DoneEvent):
                stream.wait_event(event)
            tensor.record_stream(stream)
            self._note_use(tensor, stream)
        elif self.ledger is not None:
            if event is not None:
                event.synchronize()
            self.ledger.record(tensor)

    # ------------------------------------------------------------------------ device memory

    def is_device(self, t: torch.Tensor) -> bool:
        """Whether `t` is device memory (in the stand-in: a device tier buffer or a tensor made
        on the device by `to_device` / `empty`)."""
        if self.ledger is not None:
            return self.ledger.is_device(t)
        return t.device == self.device or (self.cuda and t.device.type == "cuda")

    def register(self, buf: torch.Tensor) -> None:
        """A device tier buffer was allocated."""
        if self.ledger is not None:
            self.ledger.add_device(buf)
        elif self.cuda:
            self._uses[buf.untyped_storage().data_ptr()] = set()

    def register_pinned(self, base: int, nbytes: int) -> None:
        """[base, base + nbytes) is the pinned pool (the stand-in checks copies against it)."""
        if self.ledger is not None:
            self.ledger.add_pinned(base, nbytes)

    def lend(self, buf: torch.Tensor, what: str) -> None:
        """A device buffer is handed to a caller that computes on it (a scratch buffer): its
        free must come after compute recorded the use (compute_wait)."""
        if self.ledger is not None and self._checks:
            self.ledger.lend(buf, what)

    def to_device(self, t: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """`t` (in `dtype`) on the device: what collectives are given."""
        if self.ledger is None:
            return t.to(self.device, dtype)
        out = t.to(dtype, copy=True) if dtype is not None else t.clone()
        self.ledger.add_device(out)
        return out

    def empty(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """A new device tensor (outside the tier's buffers: compute's own memory)."""
        out = torch.empty(numel, dtype=dtype, device=self.device)
        if self.ledger is not None:
            self.ledger.add_device(out)
        return out

    def check_collective(self, t: torch.Tensor, what: str) -> None:
        """A collective's tensor must be device memory, as NCCL requires."""
        if self.is_device(t) or (self.ledger is not None and not self._checks):
            return
        raise RuntimeError(
            f"tierzero: {what} was given a tensor that is not on the device {self.device} "
            f"({t.device}, {t.numel() * t.element_size()} bytes{', host memory' if self.ledger is not None else ''}); "
            "collectives run on the process group's device (NCCL refuses host tensors): move it there "
            "first (CopyStreams.to_device)")

    def freeing(self, buf: torch.Tensor) -> tuple[list[Any], str | None]:
        """A device tier buffer is about to be given back: the events after which its memory is
        really free, none if it is free now, and (the stand-in's check) what a lent buffer freed
        without compute's record of its use was, else None. The caller keeps the buffer (and its
        budget) until the events completed, then calls `freed`; nobody waits at the free, as the
        caching allocator holds a block back from reuse without blocking the host. CUDA: one
        event per stream other than h2d that used it. The stand-in: the copies still queued on
        it (a device-to-host copy out of a gradient buffer freed right after it was queued)."""
        if self.cuda:
            streams = self._uses.pop(buf.untyped_storage().data_ptr(), set())
            events = []
            for stream in streams:
                event = torch.cuda.Event(blocking=True)
                event.record(stream)
                events.append(event)
            return events, None
        if self.ledger is not None:
            return self.ledger.in_flight(buf), self.ledger.unrecorded(buf) if self._checks else None
        return [], None

    def freed(self, buf: torch.Tensor) -> None:
        """(After `freeing`'s events) the buffer's memory goes back for reuse: the stand-in
        poisons it, so a read after the free gives wrong values."""
        if self._poison:
            poison(buf)

    def host_freeing(self, buf: torch.Tensor) -> None:
        """A pinned pool buffer is about to be given back: no copy may still read or write it."""
        if self.ledger is not None and self._checks and self.ledger.in_flight(buf):
            raise RuntimeError(f"tierzero (stream stand-in): a host buffer of {buf.numel()} bytes was given back "
                               "while a copy on it was still queued; wait for the copy's event first")

    def _note_use(self, t: torch.Tensor, stream: Any) -> None:
        uses = self._uses.get(t.untyped_storage().data_ptr())
        if uses is not None and stream != self.h2d:
            uses.add(stream)

    # ------------------------------------------------------------------------------ timing

    def stamp(self) -> Any:
        """A point in the calling thread's compute (CUDA: a timing event on its stream)."""
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True, blocking=True)
            event.record(self.current())
            return event
        return time.perf_counter()

    def seconds(self, start: Any, end: Any) -> float:
        """Compute seconds between two stamps (waits for `end` on CUDA)."""
        if self.cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start

    def close(self) -> None:
        if self.mode == "async":
            self.h2d.close()
            self.d2h.close()

    def __repr__(self) -> str:
        kind = {"cuda": "cuda h2d+d2h", "sync": "synchronous", "async": "asynchronous stand-in"}[self.mode]
        return f"CopyStreams({self.device}, {kind})"


def resolve_device(device: torch.device | str | None, *, world_size: int = 1, rank: int = 0,
                   local_rank: int | None = None) -> torch.device:
    """The device a placement manager works with: `device`, else the current CUDA device, else
    the CPU. With several ranks an unindexed CUDA device is refused where it may be another
    rank's: LOCAL_RANK names another GPU, or there are several and LOCAL_RANK is unknown."""
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        current = torch.cuda.current_device()
        if world_size > 1 and (local_rank != current if local_rank is not None else torch.cuda.device_count() > 1):
            raise ValueError(
                f"rank {rank}: which GPU is this rank's? The current CUDA device is cuda:{current} "
                f"(LOCAL_RANK={local_rank}) among {torch.cuda.device_count()}, and {world_size} ranks would share "
                "it; give Config(device=f'cuda:{local_rank}') or call torch.cuda.set_device(local_rank) "
                "before tz.wrap")
        device = torch.device("cuda", current)
    return device

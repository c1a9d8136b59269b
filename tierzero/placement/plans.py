"""What a move's worker runs: the typed plans (`FetchPlan`, `WritebackPlan`, `StorePlan`, each
with every buffer it needs already reserved) and the bodies that carry them out (`run_fetch`,
`run_writeback`, `run_store`: plain functions, run without the lock, so tests can patch the IO
they call). See [Note: move legs].
"""

from __future__ import annotations

import concurrent.futures as cf
import time
from typing import NamedTuple

import torch

from tierzero.config import Tier
from tierzero.placement.handles import TensorHandle
from tierzero.placement.moves import Done, Landing, Span
from tierzero.placement.storage.nvme import SwapSpace
from tierzero.placement.records import Copy
from tierzero.placement.storage.streams import DONE, CopyEvent, CopyStreams
from tierzero.placement.storage.tier_store import as_memory, region, typed


class MoveIO(NamedTuple):
    """What worker bodies copy with: the device tier's copy streams and this rank's swap files."""

    streams: CopyStreams
    swap: SwapSpace | None

    def nvme(self) -> SwapSpace:
        assert self.swap is not None, "an NVMe move without swap files"
        return self.swap


class FetchPlan(NamedTuple):
    """A copy toward a cached copy's tier, every buffer it needs already reserved."""

    handle: TensorHandle
    src: Tier
    """Where the bytes come from: the home, or a cached host copy of an NVMe-homed tensor."""
    dst: Tier
    source: Copy
    """The copy read; pinned from the start of the move until its commit."""
    copy: Copy
    """The copy filled (its bytes reserved on `dst`)."""
    staging: torch.Tensor | None
    """Host bytes between the NVMe read and the device copy (NVMe -> device only)."""
    ready: CopyEvent | None
    """Compute's work queued on a device source when the move started: copied after it."""
    after: tuple[cf.Future[None], ...]
    """Earlier moves of this tensor writing what it reads: the home, or the cached copy it
    copies from (a cached host copy is current before its home's write lands: a fetch from it
    does not wait for that write)."""
    source_fetch: cf.Future[None] | None
    """The fetch still filling `source`, when there is one: its failure fails this fetch."""
    issued: cf.Future[CopyEvent]
    """Set by the body once the copy toward the device is queued (else when the move ends)."""


class WritebackPlan(NamedTuple):
    """A copy of a cached copy's contents to the home (released dirty)."""

    handle: TensorHandle
    src: Tier
    copy: Copy
    """The cached copy written back; WRITING_BACK until the commit."""
    home: Copy
    staging: torch.Tensor | None
    """Host bytes between the device copy and the NVMe write (device -> NVMe only)."""
    ready: CopyEvent | None
    """Compute's work on a device copy when it was released: copied after it."""
    after: tuple[cf.Future[None], ...]
    """Every earlier move of this tensor."""


class StorePlan(NamedTuple):
    """A write of a host staging copy of stored data to the NVMe home."""

    handle: TensorHandle
    home: Copy
    staging: torch.Tensor


def wait_for_staging(event: CopyEvent) -> None:
    """A write-back's device-to-host copy has landed: the staging buffer's bytes go to NVMe next."""
    event.synchronize()


# [Note: move legs]
# The legs of each body:
#   fetch       NVMe -> host (io_engine read into the destination host copy, or into a staging
#               buffer when the destination is the device), then host or device -> the
#               destination (copy stream); a copy toward the device is announced as issued
#               (`FetchPlan.issued`, its event) as soon as it is queued: acquire() then orders
#               compute after the event instead of waiting on the host for the copy to land
#   write-back  the cached copy -> its home (copy stream); for an NVMe home, device -> host
#               staging (copy stream), then host -> NVMe (io_engine write)
#   store       a host staging copy of the caller's data -> the NVMe home (io_engine write)
# Moves of one tensor that touch its home run in order: a plan lists the earlier moves it
# waits for.


def run_fetch(plan: FetchPlan, io: MoveIO) -> Done:
    waited = time.perf_counter()
    cf.wait(plan.after)
    waited_until = time.perf_counter()
    error = plan.source_fetch.exception() if plan.source_fetch is not None else None  # waits for it
    read_until = time.perf_counter()
    if error is not None:
        raise error  # the copy this fetch reads failed, and is gone
    h, spans = plan.handle, []
    with torch.profiler.record_function(f"tierzero::fetch {h.name}"), io.streams.context():
        t0 = time.perf_counter()
        if plan.src is Tier.NVME:
            landing = plan.staging if plan.staging is not None else as_memory(plan.copy.buffer)
            io.nvme().read(region(plan.source.buffer), landing.numpy(), h.name, h.traffic)
            spans.append(Span(Tier.NVME, Tier.HOST, t0, time.perf_counter()))
            if plan.dst is Tier.HOST:
                return Done(DONE, spans, (waited, waited_until), (waited_until, read_until))
            t0 = time.perf_counter()
        copy_src = plan.source.tensor if plan.staging is None else typed(plan.staging, h)
        event = io.streams.copy(plan.copy.tensor, copy_src, after=plan.ready)
        src = plan.src if plan.staging is None else Tier.HOST
        if io.streams.asynchronous:
            if plan.dst is Tier.DEVICE:
                plan.issued.set_result(event)
            # The source and staging are freed at commit, after the copy: the commit waits for
            # it, not this worker, which goes on to its next NVMe read (MoveExecutor._commit_once_landed).
            return Done(event, spans, (waited, waited_until), (waited_until, read_until), Landing(src, plan.dst, t0))
        spans.append(Span(src, plan.dst, t0, time.perf_counter()))
    return Done(event, spans, (waited, waited_until), (waited_until, read_until))


def run_writeback(plan: WritebackPlan, io: MoveIO) -> Done:
    cf.wait(plan.after)
    plan.copy.event.synchronize()  # the last write into the copy (a gradient's device-to-host copy)
    h, spans = plan.handle, []
    with torch.profiler.record_function(f"tierzero::writeback {h.name}"), io.streams.context():
        t0 = time.perf_counter()
        if h.home is not Tier.NVME:
            io.streams.copy(plan.home.tensor, plan.copy.tensor, after=plan.ready).synchronize()
            spans.append(Span(plan.src, h.home, t0, time.perf_counter()))
            return Done(DONE, spans)
        landing = as_memory(plan.copy.buffer)
        if plan.staging is not None:
            event = io.streams.copy(typed(plan.staging, h), plan.copy.tensor, after=plan.ready)
            wait_for_staging(event)
            spans.append(Span(plan.src, Tier.HOST, t0, time.perf_counter()))
            landing, t0 = plan.staging, time.perf_counter()
        io.nvme().write(region(plan.home.buffer), landing.numpy(), h.name, h.traffic)
        spans.append(Span(Tier.HOST, Tier.NVME, t0, time.perf_counter()))
    return Done(DONE, spans)


def run_store(plan: StorePlan, io: MoveIO) -> Done:
    t0 = time.perf_counter()
    with torch.profiler.record_function(f"tierzero::store {plan.handle.name}"):
        io.nvme().write(region(plan.home.buffer), plan.staging.numpy(), plan.handle.name,
                        plan.handle.traffic)
    return Done(DONE, [Span(Tier.HOST, Tier.NVME, t0, time.perf_counter())])

"""CUDA-only checks of the copy streams and of placement on a real device (`make test-gpu`)."""

import time

import pytest
import torch

from tierzero.config.config import Config
from tierzero.placement.handles import Kind
from tierzero.placement.manager import PlacementManager
from tierzero.placement.residency import Residency
from tierzero.placement.storage.streams import CopyStreams
from tierzero.placement.storage.tiers import PinnedArena
from tierzero.config.tiernames import Tier

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def _elapsed_ms(start, end):
    end.synchronize()
    return start.elapsed_time(end)


def _timed(stream, fn):
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    with torch.cuda.stream(stream):
        fn()
    end.record(stream)
    return start, end


def test_h2d_on_copy_stream_overlaps_matmuls_on_default_stream():
    dev = torch.device("cuda", torch.cuda.current_device())
    streams = CopyStreams(dev)
    src = torch.empty(512 * MiB, dtype=torch.uint8, pin_memory=True).fill_(7)
    dst = torch.empty_like(src, device=dev)
    a = torch.randn(4096, 4096, device=dev)
    compute = torch.cuda.current_stream(dev)

    def copy():
        streams.copy(dst, src)

    def matmuls(n):
        for _ in range(n):
            a @ a

    for _ in range(2):  # warm up cuBLAS and the copy path
        copy()
        matmuls(2)
    torch.cuda.synchronize()
    t_copy = _elapsed_ms(*_timed(streams.h2d, copy))
    t_one = _elapsed_ms(*_timed(compute, lambda: matmuls(4))) / 4
    n = max(2, round(t_copy / t_one))  # compute about as long as the copy
    t_compute = _elapsed_ms(*_timed(compute, lambda: matmuls(n)))

    torch.cuda.synchronize()
    begin = torch.cuda.Event(enable_timing=True)
    begin.record(compute)
    streams.h2d.wait_event(begin)  # both streams start from the same point
    c_start, c_end = _timed(streams.h2d, copy)
    m_start, m_end = _timed(compute, lambda: matmuls(n))
    torch.cuda.synchronize()
    total = max(begin.elapsed_time(c_end), begin.elapsed_time(m_end))
    # The copy's and the compute's intervals intersect, and together they take clearly less than
    # one after the other.
    assert begin.elapsed_time(c_start) < begin.elapsed_time(m_end)
    assert begin.elapsed_time(m_start) < begin.elapsed_time(c_end)
    assert total < 0.85 * (t_copy + t_compute), (total, t_copy, t_compute)
    assert torch.equal(dst[:: 64 * MiB].cpu(), src[:: 64 * MiB])


def test_compute_waits_on_copy_event_before_using_the_tensor():
    dev = torch.device("cuda", torch.cuda.current_device())
    streams = CopyStreams(dev)
    src = torch.arange(64 * MiB // 4, dtype=torch.int32).pin_memory()
    expected = int(src.sum(dtype=torch.int64))
    for _ in range(5):
        with streams.alloc_context():
            dst = torch.empty(src.shape, dtype=src.dtype, device=dev)
        event = streams.copy(dst, src)
        streams.compute_wait(event, dst)
        assert int(dst.sum(dtype=torch.int64)) == expected


@pytest.mark.parametrize("home", ["nvme", "host", "device"])
def test_placement_roundtrip_on_cuda_is_bit_exact(tmp_path, home):
    cfg = Config(device_budget="64MiB", host_budget="64MiB", nvme_dir=str(tmp_path / "nvme"),
                 nvme_budget="256MiB")
    data = torch.randn(1023, 517).to(torch.bfloat16)
    with PlacementManager(cfg) as pm:
        assert pm.device.type == "cuda" and pm.pool.pinned
        p = pm.register("layers.0", data, home, kind=Kind.PARAM)
        t = pm.acquire(p, "device")
        assert t.is_cuda and t.dtype is torch.bfloat16 and torch.equal(t.cpu(), data)
        t.mul_(-2).add_(1)  # modified by compute on the default stream, then written back
        expected = (data * -2 + 1)
        pm.release(p, "device", dirty=True)
        pm.flush()
        assert torch.equal(pm.read(p).view(torch.int16), expected.view(torch.int16))
        h = pm.acquire(p, "host")
        assert torch.equal(h.view(torch.int16), expected.view(torch.int16))
        assert home == "device" or h.is_pinned()
        pm.release(p, "host")
        # Evicted and fetched again: still the written-back contents.
        if home != "device":
            pm.drop(p, "device")
            assert pm.record(p).residency[Tier.DEVICE] is Residency.ABSENT
            t = pm.acquire(p, "device")
            assert torch.equal(t.cpu().view(torch.int16), expected.view(torch.int16))
            pm.release(p, "device")
        pm.unregister(p)
        pm.settle()  # the streams that used its device copy are past it
        assert pm.bytes_used("device") == 0  # exact-size CUDA buffers: nothing cached


def test_placement_pipeline_with_prefetch_and_eviction_on_cuda(tmp_path):
    cfg = Config(device_budget="48MiB", host_budget="96MiB", nvme_dir=str(tmp_path / "nvme"),
                 nvme_budget="1GiB")
    blocks = [torch.randn(4 * MiB // 4 + 13 * i) for i in range(16)]  # ~4 MiB each, uneven
    with PlacementManager(cfg) as pm:
        params = [pm.register(f"layers.{i}", b, "nvme" if i % 2 else "host", kind=Kind.PARAM)
                  for i, b in enumerate(blocks)]
        for step in range(3):
            pm.prefetch(params[0])
            for i in range(len(blocks)):
                for j in (i + 1, i + 2):
                    if j < len(blocks):
                        pm.prefetch(params[j])
                t = pm.acquire(params[i])
                t.add_(1.0)
                blocks[i] += 1.0
                pm.release(params[i], dirty=True)
            pm.flush()
            assert pm.peak_bytes("device") <= pm.budget("device")
            assert pm.peak_bytes("host") <= pm.budget("host")
        for p, b in zip(params, blocks):
            assert torch.equal(pm.read(p), b)
        assert pm.telemetry.prefetch_hits > 0


def _spin(seconds: float) -> None:
    """Keep the current stream busy for at least `seconds`: torch.cuda._sleep spins in clock
    cycles, and 2 GHz bounds the SM clock of the GPUs this runs on (an H100 boosts to 1.98 GHz).
    Timing a calibration spin instead does not hold: it runs at the idle clock (345 MHz seen on an
    H100) and the spin after it at the boost clock, 5-12x shorter than asked."""
    torch.cuda._sleep(int(seconds * 2.0e9))


def test_copy_events_block_the_waiting_thread_instead_of_spinning():
    dev = torch.device("cuda", torch.cuda.current_device())
    streams = CopyStreams(dev)
    src = torch.empty(MiB, dtype=torch.uint8).pin_memory()
    dst = torch.empty(MiB, dtype=torch.uint8, device=dev)
    with torch.cuda.stream(streams.h2d):
        _spin(0.5)  # the copy queues behind half a second of GPU work
    event = streams.copy(dst, src)
    cpu, wall = time.process_time(), time.perf_counter()
    event.synchronize()
    cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
    assert wall > 0.3 and cpu < 0.3 * wall, (cpu, wall)  # a blocking event: the thread slept


def test_host_tier_is_one_region_pinned_once_within_its_budget(tmp_path):
    stats = getattr(torch.cuda, "host_memory_stats", lambda: {})
    before = stats().get("num_host_alloc")
    cfg = Config(device_budget="64MiB", host_budget=48 * MiB + 123, nvme_dir=str(tmp_path / "nvme"))
    with PlacementManager(cfg) as pm:
        arena = pm.pool
        assert isinstance(arena, PinnedArena) and arena.pinned and arena.size <= cfg.host_budget
        assert arena.region.is_pinned()  # registered: exactly its pages are pinned
        handles = [pm.register(f"layers.{i}", torch.randn(1000 * i + 17), "host") for i in range(1, 40)]
        for h in handles:
            t = pm.acquire(h, "host")
            assert t.is_pinned() and arena.base <= t.data_ptr() < arena.base + arena.size
            pm.release(h, "host")
            pm.acquire(h, "device")  # a non-blocking copy from the region: accepted
            pm.release(h, "device")
        assert pm.peak_bytes("host") <= arena.size
    if before is not None:
        assert stats().get("num_host_alloc") == before  # torch's pinned allocator was never asked


def test_a_device_budget_returns_once_the_streams_that_used_the_buffer_pass_it(tmp_path):
    cfg = Config(device_budget="64MiB", host_budget="64MiB")
    with PlacementManager(cfg) as pm:
        buf = pm.scratch.reserve(8 * MiB, "device", what="scratch")  # its user: this stream
        _spin(0.3)
        total = buf.view(torch.float32).fill_(1.0).sum()  # queued behind the spin
        used = pm.bytes_used("device")
        pm.scratch.free(buf, "device")
        assert pm.bytes_used("device") == used  # compute has not passed it: the bytes stay reserved
        torch.cuda.synchronize()
        again = pm.scratch.reserve(MiB, "device", what="next")
        assert pm.bytes_used("device") == MiB and total.item() == 2 * MiB
        pm.scratch.free(again, "device")


def test_scratch_freed_under_queued_compute_is_not_overwritten_by_the_next_fetch(tmp_path):
    """The finding of a scratch reused while the GPU still reads it: reserve_scratch records the
    compute stream, so the caching allocator keeps the block until compute is past it."""
    cfg = Config(device_budget="64MiB", host_budget="64MiB")
    n = 4 * MiB
    with PlacementManager(cfg) as pm:
        h = pm.register("layers.0", torch.full((n,), 2.0), "host")
        scratch = pm.scratch.reserve(4 * n, "device", what="layers.1 (gathered)")
        full = scratch.view(torch.float32).fill_(1.0)
        _spin(0.3)
        total = full.sum()  # reads the scratch after the spin
        pm.scratch.free(scratch, "device")
        fetched = pm.acquire(h, "device")  # same size, on the h2d stream: must not land in the scratch
        assert total.item() == n and torch.equal(fetched, torch.full((n,), 2.0, device=fetched.device))
        pm.release(h, "device")


def test_a_non_blocking_copy_from_unpinned_memory_is_refused():
    dev = torch.device("cuda", torch.cuda.current_device())
    streams = CopyStreams(dev)
    with pytest.raises(RuntimeError, match="not pinned memory"):
        streams.copy(torch.empty(64, device=dev), torch.zeros(64))

"""The asynchronous stand-in for the device's streams (tierzero/placement/storage/stand_in.py): selected by
the environment or the Config, copies that land later than they are queued, poison, and the
checks of what asynchrony alone does not show, each failing on an instance planted here."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from tierzero.config import Config, PrefetchConfig, StandInConfig
from tierzero.config.stand_in import stream_settings
from tierzero.config.tiernames import Tier
from tierzero.placement import Kind, PlacementManager, Residency
from tierzero.placement.storage.streams import resolve_device
from tierzero.layout import CommBytes, FlatLayout
from tierzero.runtime.flat import collectives

SLOW = StandInConfig(poison=True, delay_seed=3, max_delay_s=0.05)


def manager(tmp_path, stand_in: StandInConfig = SLOW, **kw) -> PlacementManager:
    cfg = Config(device_budget="1MiB", host_budget="1MiB", nvme_dir=str(tmp_path / "nvme"), nvme_budget="4MiB",
                 streams="async", stand_in=stand_in, **kw)
    return PlacementManager(cfg, wait_timeout_s=5)


def test_selected_by_the_environment_or_the_config(monkeypatch) -> None:
    env = {"TIERZERO_STREAMS": "async", "TIERZERO_POISON": "0", "TIERZERO_DELAY_SEED": "7"}
    got = stream_settings("auto", StandInConfig(), env)
    assert got.mode == "async" and not got.stand_in.poison and got.stand_in.delay_seed == 7
    assert stream_settings("auto", StandInConfig(), {}).mode == "sync"
    assert stream_settings("sync", StandInConfig(), env).mode == "sync"  # the Config's own choice wins
    with pytest.raises(ValueError, match="TIERZERO_STREAMS='fast': expected 'sync' or 'async'"):
        stream_settings("auto", StandInConfig(), {"TIERZERO_STREAMS": "fast"})
    monkeypatch.setenv("TIERZERO_STREAMS", "async")
    with PlacementManager(Config(device_budget="64KiB", host_budget="64KiB")) as pm:
        assert pm.streams.mode == "async" and pm.streams.asynchronous and type(pm.pool).__name__ == "PinnedArena"
    with PlacementManager(Config(device_budget="64KiB", host_budget="64KiB", streams="sync")) as pm:
        assert pm.streams.mode == "sync" and not pm.streams.asynchronous


def test_a_copy_lands_later_poisoned_until_then_and_compute_wait_blocks(tmp_path) -> None:
    with manager(tmp_path) as pm:
        streams = pm.streams
        dev, host = pm.scratch.reserve(4096, "device", what="d"), pm.scratch.reserve(4096, "host", what="h")
        src = host.view(torch.float32).copy_(torch.arange(1024.0))
        dst = dev.view(torch.float32)
        events = [streams.copy(dst, src) for _ in range(3)]  # serial: the last lands last
        assert not events[-1].query() and torch.isnan(dst).all()  # queued: poisoned, not landed
        streams.compute_wait(events[-1], dst)
        assert all(e.query() for e in events) and torch.equal(dst, torch.arange(1024.0))
        pm.scratch.free(host, "host")
        pm.scratch.free(dev, "device")
        assert torch.isnan(dst).all()  # a freed device buffer is poisoned


def test_acquire_waits_on_the_host_only_until_the_copy_is_queued(tmp_path, monkeypatch) -> None:
    """A fetch toward the device: acquire hands compute the copy's event before it landed (the
    host waited for nothing but the queueing); compute's wait then gives the right values."""
    seen = []
    with manager(tmp_path) as pm:
        wait = pm.streams.compute_wait
        monkeypatch.setattr(pm.streams, "compute_wait", lambda e, t: (seen.append(e is None or e.query()), wait(e, t)))
        data = [torch.randn(3000) for _ in range(6)]
        handles = [pm.register(f"b{i}", d, "host" if i % 2 else "nvme", kind=Kind.PARAM) for i, d in enumerate(data)]
        for h, d in zip(handles, data):
            assert torch.equal(pm.acquire(h, "device"), d)
            pm.release(h, "device")
    assert False in seen, seen


def test_planted_collective_on_host_memory_is_an_error(tmp_path) -> None:
    with manager(tmp_path) as pm:
        on_host = torch.zeros(16)
        with pytest.raises(RuntimeError, match="a broadcast was given a tensor that is not on the device"):
            collectives.broadcast_from_first_(on_host, None, 2, pm.streams)
        layout = FlatLayout.build(["w"], [torch.Size([16])], 2)
        with pytest.raises(RuntimeError, match="a reduce-scatter was given a tensor that is not on the device"):
            collectives.reduce_scatter_flat(on_host, layout, None, CommBytes(), pm.streams)
        on_device = pm.streams.to_device(on_host)
        pm.streams.check_collective(on_device, "a broadcast")  # made on the device: fine
        pm.streams.check_collective(on_device[4:], "a broadcast")  # and its views


def test_planted_scratch_freed_without_compute_recording_it_is_an_error(tmp_path, monkeypatch) -> None:
    """reserve_scratch records the caller's compute as the buffer's user (the fix of a scratch
    reused while the GPU still read it); without that record its free is refused."""
    with manager(tmp_path) as pm:
        buf = pm.scratch.reserve(8192, "device", what="layers.0 (gathered)")
        pm.scratch.free(buf, "device")  # recorded at hand-out: fine
        monkeypatch.setattr(pm.streams, "compute_wait", lambda event, tensor: None)  # the record removed
        buf = pm.scratch.reserve(8192, "device", what="layers.0 (gathered)")
        with pytest.raises(RuntimeError, match="'layers.0 \\(gathered\\)' was handed to compute and freed without"):
            pm.scratch.free(buf, "device")
        assert pm.bytes_used("device") == pm.device_pool.cached_bytes  # given back all the same


def test_planted_copy_from_unpinned_host_memory_is_an_error(tmp_path) -> None:
    with manager(tmp_path) as pm:
        dev = pm.scratch.reserve(4096, "device", what="d")
        with pytest.raises(RuntimeError, match="host side outside the pinned pool"):
            pm.streams.copy(dev, torch.zeros(4096, dtype=torch.uint8))
        pm.scratch.free(dev, "device")


def test_planted_host_buffer_given_back_under_a_queued_copy_is_an_error(tmp_path) -> None:
    with manager(tmp_path) as pm:
        dev, host = pm.scratch.reserve(4096, "device", what="d"), pm.scratch.reserve(4096, "host", what="h")
        event = pm.streams.copy(dev, host)
        with pytest.raises(RuntimeError, match="host buffer of 4096 bytes was given back while a copy on it"):
            pm.scratch.free(host, "host")
        event.synchronize()
        pm.scratch.free(host, "host")
        pm.scratch.free(dev, "device")


def test_poison_is_nan_in_every_float_dtype_and_a_pattern_in_integers(tmp_path) -> None:
    with manager(tmp_path, StandInConfig(delay_seed=1, max_delay_s=0.05)) as pm:
        for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int32):
            dev, host = pm.scratch.reserve(4096, "device", what="d"), pm.scratch.reserve(4096, "host", what="h")
            event = pm.streams.copy(dev.view(dtype), host.view(dtype).zero_())
            assert dev.view(dtype).isnan().all() if dtype.is_floating_point else (dev.view(dtype) == -1).all()
            pm.streams.compute_wait(event, dev)
            pm.scratch.free(host, "host")
            pm.scratch.free(dev, "device")


def test_device_choice_refuses_a_gpu_that_may_be_another_ranks(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert resolve_device(None) == torch.device("cuda", 0)  # one process: the current device
    assert resolve_device("cuda:2", world_size=4, rank=2) == torch.device("cuda", 2)
    assert resolve_device("cuda", world_size=4, rank=0, local_rank=0) == torch.device("cuda", 0)
    with pytest.raises(ValueError, match="rank 1: which GPU is this rank's.*LOCAL_RANK=1.*set_device"):
        resolve_device(None, world_size=4, rank=1, local_rank=1)  # set_device was not called
    with pytest.raises(ValueError, match="rank 3: which GPU"):
        resolve_device(None, world_size=4, rank=3)  # several GPUs, LOCAL_RANK unknown
    assert Config(device="cuda:1").device == "cuda:1"
    with pytest.raises(ValueError, match="device: expected None, 'cpu', 'cuda' or 'cuda:N', got 'tpu'"):
        Config(device="tpu")


def test_store_writes_device_copies_on_the_copy_stream_or_drops_them(tmp_path, monkeypatch) -> None:
    """store() no longer copies host data into device memory on the compute stream (a host wait on
    CUDA): an unpinned cached device copy is dropped (the next fetch runs on the copy stream), a
    device home is written from a pinned staging buffer by the h2d stream."""
    copies = []
    with manager(tmp_path) as pm:
        copy = pm.streams.copy
        monkeypatch.setattr(pm.streams, "copy", lambda dst, src, **kw: (copies.append(pm.streams.is_device(dst)),
                                                                        copy(dst, src, **kw))[1])
        cached = pm.register("cached", torch.zeros(3000), "host")
        pm.acquire(cached, "device")
        pm.release(cached, "device")
        homed = pm.register("homed", torch.zeros(3000), "device")
        copies.clear()
        pm.store(cached, torch.ones(3000))
        pm.store(homed, torch.full((3000,), 2.0))
        assert pm.record(cached).residency[Tier.DEVICE] is Residency.ABSENT and copies == [True]
        assert torch.equal(pm.acquire(cached, "device"), torch.ones(3000))
        assert torch.equal(pm.acquire(homed, "device"), torch.full((3000,), 2.0))
        pm.release(cached, "device")
        pm.release(homed, "device")


def test_a_fetch_whose_copy_has_not_landed_holds_no_nvme_worker(tmp_path) -> None:
    """NVMe -> device fetches whose copies wait on the copy stream commit once the copies land,
    on a waiter: the NVMe workers go on reading meanwhile (before, each slept on its copy's
    event, and with every worker asleep no read could start)."""
    gate = threading.Event()
    with manager(tmp_path, StandInConfig(poison=True), prefetch=PrefetchConfig(nvme_depth=2)) as pm:
        data = [torch.randn(1000) for _ in range(3)]
        handles = [pm.register(f"p{i}", d, "nvme", kind=Kind.PARAM) for i, d in enumerate(data)]
        pm.flush()
        pm.streams.h2d.submit(gate.wait)  # the copy stream is busy until the gate opens
        try:
            assert pm.prefetch(handles[0], "device") and pm.prefetch(handles[1], "device")  # two workers
            assert pm.prefetch(handles[2], "host")
            deadline = time.monotonic() + 5
            while pm.record(handles[2]).residency[Tier.HOST] is not Residency.RESIDENT:
                assert time.monotonic() < deadline, "the NVMe read waited for the copies of the fetches before it"
                time.sleep(0.01)
            assert all(pm.record(h).residency[Tier.DEVICE] is Residency.FETCHING for h in handles[:2])
        finally:
            gate.set()
        for h, d in zip(handles, data):
            assert torch.equal(pm.acquire(h, "device"), d)
            pm.release(h, "device")


def test_a_device_buffer_freed_under_a_queued_copy_is_given_back_once_the_copy_ran(tmp_path) -> None:
    """Freeing a device buffer whose device-to-host copy is still queued returns at once, as
    CUDA's caching allocator holds such a block back without blocking the host (the stand-in
    waited there, under the placement lock): its bytes stay in the budget until the copy ran,
    and the copy reads its values, not the free's poison."""
    gate = threading.Event()
    with manager(tmp_path) as pm:
        dev, host = pm.scratch.reserve(4096, "device", what="d"), pm.scratch.reserve(4096, "host", what="h")
        dev.fill_(7)
        pm.streams.d2h.submit(gate.wait)  # the copy stream is busy until the gate opens
        event = pm.streams.copy(host, dev, after=pm.streams.compute_ready())
        free = threading.Thread(target=pm.scratch.free, args=(dev, "device"))
        free.start()
        free.join(timeout=2)
        try:
            assert not free.is_alive(), "the free waited for the copy"
            assert pm.bytes_used("device") == 4096 and pm.device_pool.cached_bytes == 0
        finally:
            gate.set()
        free.join()
        event.synchronize()
        assert torch.all(host == 7)
        pm.settle()
        assert pm.device_pool.cached_bytes == 4096  # given back once the copy ran
        assert torch.all(dev == 0xFF)  # and poisoned then
        pm.scratch.free(host, "host")

"""PlacementManager's public calls (tierzero/placement/manager.py): every home and dtype round
trips bit for bit, bad calls fail at once naming the fix, close and unregister give everything back."""

import threading

import pytest
import torch

from placement_builders import make, same
from tierzero.config.config import Config
from tierzero.placement.handles import Kind, TensorHandle
from tierzero.placement.manager import PlacementManager
from tierzero.placement.residency import Residency
from tierzero.config.tiernames import Tier


@pytest.mark.parametrize("home", ["device", "host", "nvme"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_roundtrip_every_home_and_dtype(tmp_path, home, dtype):
    data = torch.randn(37, 29).to(dtype)
    with make(tmp_path) as pm:
        p = pm.register("layers.0", data, home, kind=Kind.PARAM)
        rec = pm.record(p)
        assert p.name == "layers.0.param" and rec.handle is p
        assert rec.residency[Tier(home)] is Residency.HOME and rec.nbytes == data.numel() * data.element_size()
        assert same(pm.read(p), data)
        for tier in ("device", "host"):
            t = pm.acquire(p, tier)
            assert same(t, data) and t.device == (pm.device if tier == "device" else torch.device("cpu"))
            t.add_(1)
            pm.release(p, tier, dirty=True)
            data = data + 1
            assert same(pm.read(p), data)
        if home != "nvme":
            home_t = pm.acquire(p, home)
            assert home_t is pm.acquire(p, home)  # the home tensor itself, nested
            pm.release(p, home)
            pm.release(p, home)


def test_register_casts_and_rejects_duplicates(tmp_path):
    with make(tmp_path) as pm:
        w = pm.register("w", torch.randn(5, 3), "host", dtype=torch.bfloat16)
        assert pm.record(w).dtype is torch.bfloat16 and pm.acquire(w, "host").dtype is torch.bfloat16
        with pytest.raises(ValueError, match="'w' is already registered"):
            pm.register("w", torch.randn(2), "host")
        with pytest.raises(ValueError, match="expected one of"):
            pm.register("v", torch.randn(2), "gpu")
        nope = TensorHandle("nope", Kind.TENSOR, torch.Size([2]), torch.float32, Tier.HOST)  # never registered
        with pytest.raises(KeyError, match="no tensor named 'nope'"):
            pm.acquire(nope)
        with pytest.raises(TypeError, match="expected the TensorHandle that register"):
            pm.acquire("w")


def test_too_big_fails_at_once_naming_everything(tmp_path):
    with make(tmp_path, device="16KiB", host="64KiB") as pm:
        with pytest.raises(ValueError, match=r"'big' \(80000 bytes\) needs .* on the host tier .* host budget is "
                                             r"64.00 KiB \(65536 bytes\); raise host_budget"):
            pm.register("big", torch.zeros(20000), "host")
        mid = pm.register("mid", torch.zeros(8000), "nvme")  # 32000 bytes: fits host staging, not the device
        with pytest.raises(ValueError, match=r"'mid' \(32000 bytes\) needs .* on the device tier .* device budget is 16.00 KiB"):
            pm.acquire(mid, "device")
        with pytest.raises(ValueError, match="staged through host memory"):
            pm.register("huge", torch.zeros(20000), "nvme")
        pm.register("h1", torch.zeros(9000), "host")
        with pytest.raises(ValueError, match="tensors homed there already hold"):
            pm.register("h2", torch.zeros(9000), "host")
        names = [h.name for h in pm.handles]
        assert "big" not in names and "h2" not in names
        assert pm.bytes_used("host") - pm.pool.cached_bytes == pm.pool.bucket(36000)


def test_release_errors_and_drop(tmp_path):
    with make(tmp_path) as pm:
        a = pm.register("a", torch.randn(100), "nvme")
        with pytest.raises(RuntimeError, match="without a matching acquire"):
            pm.release(a)
        pm.acquire(a)
        with pytest.raises(RuntimeError, match="pinned"):
            pm.drop(a, "device")
        with pytest.raises(ValueError, match="home"):
            pm.drop(a, "nvme")
        with pytest.raises(ValueError, match="NVMe"):
            pm.acquire(a, "nvme")
        pm.release(a)
        cached = lambda: pm.device_pool.cached_bytes if pm.device_pool else 0  # noqa: E731
        reserved = pm.device_pool.bucket(400) if pm.device_pool else 400  # what 400 bytes take there
        held = pm.bytes_used("device") - cached()
        pm.drop(a, "device")
        pm.drop(a, "device")  # absent: no-op
        assert pm.bytes_used("device") - cached() == held - reserved


def test_trim_gives_back_the_cached_buffers_of_the_sizes_asked_for(tmp_path):
    """A dropped device copy's buffer stays cached in the CPU's device pool, counted in the
    budget; trim gives back those of the sizes asked for and no others (on CUDA the freed bytes
    left the budget at once: torch's allocator caches them)."""
    with make(tmp_path) as pm:
        a, b = pm.register("a", torch.randn(1000), "host"), pm.register("b", torch.randn(3000), "host")
        for h in (a, b):
            pm.acquire(h, "device")
            pm.release(h, "device")
            pm.drop(h, "device")
        pm.settle()
        small, big = (pm.device_pool.bucket(n) if pm.device_pool else 0 for n in (4000, 12000))
        assert pm.bytes_used("device") == small + big
        assert pm.room.trim("device", [12000, 50_000]) == big and pm.bytes_used("device") == small
        assert pm.room.trim("device", [12000]) == 0


def test_close_frees_everything_joins_threads_and_removes_files(tmp_path):
    before = set(threading.enumerate())
    pm = make(tmp_path)
    run_dir = pm.swap.run_dir
    a = pm.register("a", torch.randn(5000), "nvme")
    b = pm.register("b", torch.randn(50), "host")
    pm.prefetch(a)
    pm.acquire(b)
    assert "PlacementManager(rank=0" in repr(pm) and "'a'" in repr(pm.record(a))
    pm.close()
    pm.close()
    assert not run_dir.exists() and pm.swap.allocator.used_bytes == 0
    assert all(pm.bytes_used(t) == 0 for t in Tier) and pm.pool.in_use_count == 0
    assert set(threading.enumerate()) <= before
    with pytest.raises(RuntimeError, match="closed"):
        pm.acquire(a)


def test_missing_nvme_parent_is_a_clear_error(tmp_path):
    cfg = Config(nvme_dir=str(tmp_path / "missing" / "nvme"), optimizer_states="nvme")
    with pytest.raises(FileNotFoundError, match="parent folder"):
        PlacementManager(cfg)
    with PlacementManager(Config()) as pm:  # no nvme_dir: NVMe homes are refused clearly
        with pytest.raises(ValueError, match="nvme_dir is not set"):
            pm.register("a", torch.zeros(3), "nvme")


def test_unregister_gives_everything_back(tmp_path):
    with make(tmp_path, nvme_budget="16KiB") as pm:
        a = pm.register("layers.0", torch.randn(3000), "nvme", kind=Kind.PARAM)  # 12000 bytes: 3 pages
        b = pm.register("layers.0", torch.randn(700), "host", kind=Kind.GRAD)
        used = {t: pm.bytes_used(t) for t in Tier}
        pm.acquire(a, "host")
        pm.acquire(a, "device")
        pm.release(a, "host")
        pm.release(a, "device", dirty=True)  # a write-back in flight: unregister waits for it
        pm.acquire(b, "device")
        with pytest.raises(RuntimeError, match=r"unregister\('layers.0.grad'\): copies are still pinned .*'device': 1"):
            pm.unregister(b)
        assert pm.record(b).residency[Tier.HOST] is Residency.HOME  # refused: nothing changed
        pm.release(b, "device")
        pm.unregister(a)
        pm.unregister(b)
        assert pm.handles == () and pm.swap.allocator.used_bytes == 0
        cached = {Tier.DEVICE: pm.device_pool.cached_bytes if pm.device_pool else 0, Tier.HOST: pm.pool.cached_bytes,
                  Tier.NVME: 0}
        assert all(pm.bytes_used(t) == cached[t] for t in Tier), (used, cached)
        for h, what in ((a, "acquire"), (b, "read"), (a, "unregister"), (b, "record")):
            with pytest.raises(KeyError, match=f"{what}: no tensor named '{h.name}' is registered"):
                getattr(pm, what)(h)
        # The name and the NVMe region are free again: 4 pages fit a 4-page budget only if the
        # old region went back.
        again = pm.register("layers.0", torch.arange(4096, dtype=torch.int32), "nvme", kind=Kind.PARAM)
        assert again is not a and pm.bytes_used("nvme") == 16384
        assert torch.equal(pm.read(again), torch.arange(4096, dtype=torch.int32))
        assert pm.handles == (again,)

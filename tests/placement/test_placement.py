import json
import threading
import time

import pytest
import torch

import tierzero.placement.nvme as nvme
from tierzero.config.config import Config
from tierzero.placement.nvme import ChecksumError
from tierzero.placement.handles import Kind, TensorHandle
from tierzero.placement.manager import PlacementManager
from tierzero.placement.residency import Residency
from tierzero.config.tiernames import Tier


def make(tmp_path, *, device="64KiB", host="64KiB", nvme_budget="1MiB", **kw):
    cfg = Config(device_budget=device, host_budget=host, nvme_dir=str(tmp_path / "nvme"),
                 nvme_budget=nvme_budget, checksums=True)
    return PlacementManager(cfg, wait_timeout_s=kw.pop("wait_timeout_s", 0.3), **kw)


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.detach().cpu().reshape(-1).view(torch.uint8), b.detach().cpu().reshape(-1).view(torch.uint8))


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


def test_eviction_is_lru_by_default_and_policy_pluggable(tmp_path):
    with make(tmp_path, device="32KiB", host="256KiB") as pm:
        t = [pm.register(f"t{i}", torch.full((2048,), float(i)), "host") for i in range(4)]  # 8 KiB each: 4 fit the device
        for i in range(4):
            pm.acquire(t[i])
            pm.release(t[i])
        pm.acquire(t[0])  # t0 is now the most recently used
        pm.release(t[0])
        pm.acquire(t[1])
        pm.release(t[1])
        t.append(pm.register("t4", torch.full((2048,), 4.0), "host"))
        assert same(pm.acquire(t[4]), torch.full((2048,), 4.0))  # evicts the LRU copy: t2
        pm.release(t[4])
        res = {h.name: pm.record(h).residency[Tier.DEVICE] for h in t}
        assert res["t2"] is Residency.ABSENT and all(r is Residency.RESIDENT for n, r in res.items() if n != "t2")

        seen = []

        class Biggest:
            def order(self, candidates):
                seen.append(list(candidates))
                return sorted(candidates, key=lambda h: h.name, reverse=True)

        pm.set_eviction_policy(Biggest())
        pm.acquire(t[2])
        pm.release(t[2])
        assert seen and all(isinstance(h, TensorHandle) for h in seen[0])
        assert pm.record(t[4]).residency[Tier.DEVICE] is Residency.ABSENT
        with pytest.raises(ValueError, match="order"):
            pm.set_eviction_policy(object())


def test_budgets_never_exceeded_and_everything_pinned_raises(tmp_path):
    with make(tmp_path, device="24KiB", wait_timeout_s=0.2) as pm:
        over = []
        for b in pm.budgets.values():
            b.add_hook(lambda tier, used, b=b: over.append((tier, used)) if used > b.limit else None)
        t = [pm.register(f"t{i}", torch.randn(2500), "host") for i in range(3)]
        pm.acquire(t[0])
        pm.acquire(t[1])
        assert pm.prefetch(t[2]) is False  # no room without evicting a pinned copy
        with pytest.raises(RuntimeError, match=r"'t2': no room .* device tier .* pinned copies .*'t0', 1"):
            pm.acquire(t[2])
        pm.release(t[0])
        assert pm.prefetch(t[2]) is True and pm.prefetch(t[2]) is True
        pm.flush()
        assert pm.record(t[0]).residency[Tier.DEVICE] is Residency.ABSENT
        assert not over and pm.peak_bytes("device") <= pm.budget("device")


def test_acquire_waits_for_a_release_by_another_thread(tmp_path):
    with make(tmp_path, device="12KiB", wait_timeout_s=10) as pm:
        a = pm.register("a", torch.randn(2500), "host")
        b = pm.register("b", torch.randn(2500), "host")
        pm.acquire(a)
        threading.Timer(0.1, pm.release, args=(a,)).start()
        t0 = time.monotonic()
        assert same(pm.acquire(b), pm.read(b))
        assert time.monotonic() - t0 >= 0.05
        pm.release(b)


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
        assert pm.trim("device", [12000, 50_000]) == big and pm.bytes_used("device") == small
        assert pm.trim("device", [12000]) == 0


def test_dirty_release_invalidates_other_copies_and_store_updates_all(tmp_path):
    data = torch.arange(1000, dtype=torch.int64)
    with make(tmp_path) as pm:
        x = pm.register("x", data, "nvme")
        pm.acquire(x, "host")
        pm.release(x, "host")
        d = pm.acquire(x, "device")  # comes from the cached host copy
        assert pm.telemetry.moves[-1].src == "host"
        d.mul_(3)
        pm.release(x, "device", dirty=True)
        assert pm.record(x).residency[Tier.HOST] is Residency.ABSENT  # the old host copy is gone
        assert same(pm.acquire(x, "host"), data * 3)
        pm.release(x, "host")
        pm.store(x, data - 7)
        for tier in ("device", "host"):
            assert same(pm.acquire(x, tier), data - 7)
            pm.release(x, tier)
        assert same(pm.read(x), data - 7)
        with pytest.raises(ValueError, match="expected shape"):
            pm.store(x, torch.zeros(3))


def test_lazy_register_keeps_a_dirty_host_copy_until_room_or_flush(tmp_path, monkeypatch):
    """register(lazy=True) of an NVMe home writes nothing: the host copy it leaves is dirty, read
    and fetched from there, written home when the host room is needed or by flush(), never by
    settle(); an error of that write is raised by flush."""
    a_data, b_data = torch.randn(5000), torch.arange(6000, dtype=torch.int32)  # 20 KB + 24 KB
    with make(tmp_path) as pm:
        a = pm.register("a", a_data, "nvme", lazy=True)
        b = pm.register("b", b_data, "nvme", lazy=True)
        pm.settle()
        assert pm.telemetry.reset_step().bytes_moved["nvme"] == 0
        assert pm.record(a).residency[Tier.HOST] is Residency.RESIDENT
        assert same(pm.read(a), a_data) and same(pm.acquire(a, "device"), a_data)
        pm.release(a, "device")
        assert pm.telemetry.moves[-1].src == "host"  # fetched from the dirty copy, nothing read
        c = pm.register("c", torch.randn(6000), "nvme")  # its 24 KB of staging: the 64 KiB host room is short
        pm.settle()
        written = pm.telemetry.reset_step().bytes_moved["nvme"]
        assert written >= a.nbytes  # the shortfall wrote dirty copies home
        pm.flush()
        assert written + pm.telemetry.reset_step().bytes_moved["nvme"] == a.nbytes + b.nbytes + c.nbytes
        pm.drop(b, "host")
        assert same(pm.read(b), b_data) and same(pm.read(a), a_data)  # from the swap file now
        pm.register("d", torch.randn(100), "nvme", lazy=True)

        def broken(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(nvme, "write_extent", broken)
        pm.settle()  # nothing written, nothing failed
        with pytest.raises(OSError, match="No space left"):
            pm.flush()


def test_checksum_mismatch_surfaces_in_acquire(tmp_path):
    with make(tmp_path) as pm:
        m = pm.register("layers.1", torch.randn(3000), "nvme", kind=Kind.EXP_AVG)
        pm.flush()  # the register's NVMe write is asynchronous: let it land before damaging it
        # The only tensor: its region starts the first swap file.
        with open(pm.swap.run_dir / "swap0000.bin", "r+b") as f:
            f.seek(7)
            f.write(b"\xff\xfe")
        with pytest.raises(ChecksumError, match=r"'layers.1.exp_avg' from .*swap0000.bin at offset 0"):
            pm.acquire(m, "device")
        assert pm.record(m).residency[Tier.DEVICE] is Residency.ABSENT
        assert pm.pool.in_use_count == 0  # the staging buffer went back


def test_writeback_failure_is_raised_by_flush(tmp_path, monkeypatch):
    with make(tmp_path) as pm:
        a = pm.register("a", torch.randn(100), "nvme")
        pm.acquire(a, "device")

        def broken(*args, **kwargs):
            raise OSError(28, "No space left on device")

        monkeypatch.setattr(nvme, "write_extent", broken)
        pm.release(a, "device", dirty=True)
        with pytest.raises(OSError, match="No space left"):
            pm.flush()
        pm.flush()  # reported once


def test_telemetry_moves_stalls_and_chrome_trace(tmp_path):
    with make(tmp_path) as pm:
        b = [pm.register(f"b{i}", torch.randn(1000 + i), "nvme") for i in range(3)]
        pm.flush()  # the registers' NVMe writes are asynchronous
        assert pm.telemetry.reset_step().bytes_moved["nvme"] == 4000 + 4004 + 4008  # the initial writes
        pm.prefetch(b[0])
        pm.flush()
        for i in range(3):
            pm.acquire(b[i])
            pm.release(b[i], dirty=i == 1)
        pm.flush()
        step = pm.telemetry.reset_step()
        assert step.prefetch_hits == 1 and step.prefetch_misses == 2
        assert step.bytes_moved["device"] == 4000 + 4004 + 4008 and step.bytes_moved["nvme"] == 4004
        assert set(step.stall_s) == {"device", "host", "nvme"}
        assert pm.telemetry.reset_step().prefetch_hits == 0
        assert {m.tensor for m in pm.telemetry.moves} == {"b0", "b1", "b2"}  # traces get names
        kinds = {(m.src, m.dst) for m in pm.telemetry.moves}
        assert {("nvme", "host"), ("host", "device"), ("device", "host"), ("host", "nvme")} <= kinds
        path = tmp_path / "trace.json"
        pm.telemetry.write_chrome_trace(path)
        trace = json.loads(path.read_text())
        tracks = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
        assert "nvme -> host" in tracks and "host -> device" in tracks
        assert any(e["ph"] == "C" and e["name"] == "device bytes" for e in trace["traceEvents"])
        assert pm.telemetry.peak["device"] == pm.peak_bytes("device")


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


def test_in_flight_moves_are_typed_records(tmp_path, monkeypatch):
    gate = threading.Event()
    real_read = nvme.read_extent

    def slow_read(*args, **kwargs):
        gate.wait(5)
        return real_read(*args, **kwargs)

    monkeypatch.setattr(nvme, "read_extent", slow_read)
    with make(tmp_path) as pm:
        a = pm.register("a", torch.randn(300), "nvme")
        pm.flush()  # its asynchronous first write
        assert pm.prefetch(a, "host")
        (move,) = pm.record(a).in_flight
        assert (move.tensor, move.src, move.dst, move.nbytes) == (a, Tier.NVME, Tier.HOST, 1200)
        assert pm.record(a).residency[Tier.HOST] is Residency.FETCHING and not move.future.done()
        gate.set()
        pm.flush()
        assert pm.record(a).in_flight == () and pm.record(a).residency[Tier.HOST] is Residency.RESIDENT


def test_threads_sharing_tight_budgets(tmp_path):
    errors = []
    with make(tmp_path, device="40KiB", host="160KiB", wait_timeout_s=30) as pm:
        over = []
        for b in pm.budgets.values():
            b.add_hook(lambda tier, used, limit=b.limit: over.append(tier) if used > limit else None)
        expected = {}
        handles = []
        for i in range(24):
            data = torch.randn(1000 + 37 * i)
            handles.append(pm.register(f"t{i}", data, ("nvme", "host")[i % 2]))
            expected[handles[i]] = data

        def worker(k):
            try:
                g = torch.Generator().manual_seed(k)
                mine = [handles[i] for i in range(k, 24, 3)]  # each thread writes only its own tensors
                for _ in range(60):
                    name = mine[int(torch.randint(len(mine), (1,), generator=g))]
                    other = handles[int(torch.randint(24, (1,), generator=g))]
                    pm.prefetch(other, "device")
                    t = pm.acquire(name, "device")
                    assert torch.equal(t.cpu(), expected[name])
                    t.add_(1.0)
                    expected[name] = expected[name] + 1.0
                    pm.release(name, "device", dirty=True)
            except BaseException as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        pm.flush()
        for name, ref in expected.items():
            assert torch.equal(pm.read(name), ref)
        assert not over


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


def test_no_room_names_the_pinned_copies_and_the_fix(tmp_path):
    """A wait for room that only this thread's own pins block can never end: it raises within
    seconds (stuck_after_s, not the timeout), naming the pinned copies and the budget that would
    hold both."""
    with make(tmp_path, device="16KiB", wait_timeout_s=30) as pm:
        a = pm.register("layers.2", torch.randn(2500), "host", kind=Kind.PARAM)  # 10000 bytes
        pm.acquire(a)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"reserve_scratch\('gather layers.3', 'device'\): tensor 'gather "
                                               r"layers.3': no room for .* on the device tier and none can come: "
                                               r".* pinned copies \(name, pins\): \[\('layers.2.param', 1\)\]; "
                                               r"raise device_budget to at least \d+ bytes"):
            pm.reserve_scratch(8000, what="gather layers.3")
        assert 2 <= time.monotonic() - t0 < 5
        pm.release(a)
        buf = pm.reserve_scratch(8000, what="gather layers.3")  # evicts a's unpinned copy
        assert buf.numel() >= 8000 and pm.record(a).residency[Tier.DEVICE] is Residency.ABSENT
        pm.free_scratch(buf)


def test_a_wait_on_another_threads_pin_waits_up_to_the_timeout(tmp_path):
    with make(tmp_path, device="16KiB", wait_timeout_s=0.3) as pm:
        a = pm.register("layers.2", torch.randn(2500), "host", kind=Kind.PARAM)
        holder = threading.Thread(target=pm.acquire, args=(a,))
        holder.start()
        holder.join()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"no room for .* on the device tier after waiting 0.3 s"):
            pm.reserve_scratch(8000, what="gather layers.3")
        assert time.monotonic() - t0 >= 0.25
        pm.release(a)


def test_a_wait_ends_when_another_thread_unregisters_its_tensor(tmp_path):
    with make(tmp_path, device="12KiB", wait_timeout_s=10) as pm:
        a = pm.register("a", torch.randn(2500), "host")
        b = pm.register("b", torch.randn(2500), "host")
        pm.acquire(a)  # the device is full: acquiring b waits for room
        errors = []

        def acquire_b():
            try:
                pm.acquire(b)
            except KeyError as e:
                errors.append(e)

        waiter = threading.Thread(target=acquire_b)
        waiter.start()
        time.sleep(0.1)
        pm.unregister(b)
        waiter.join(5)
        assert not waiter.is_alive() and len(errors) == 1
        assert "acquire('b', 'device'): 'b' was unregistered by another thread meanwhile" in str(errors[0])
        pm.release(a)


def test_a_failed_home_write_is_refused_by_reads_until_a_new_store(tmp_path, monkeypatch):
    with make(tmp_path) as pm:
        a = pm.register("a", torch.randn(1000), "nvme")
        pm.flush()
        real = nvme.write_extent

        def broken(*args, **kwargs):
            raise OSError(5, "Input/output error")

        monkeypatch.setattr(nvme, "write_extent", broken)
        pm.store(a, torch.ones(1000))  # asynchronous: its failure comes later
        with pytest.raises(RuntimeError, match="last write to the nvme tier failed.*Input/output error"):
            pm.read(a)
        with pytest.raises(RuntimeError, match="values there are lost"):
            pm.acquire(a, "host")
        assert pm.record(a).pins(Tier.HOST) == 0 and pm.pool.in_use_count == 0
        with pytest.raises(OSError, match="Input/output error"):
            pm.flush()  # reported there too, once
        monkeypatch.setattr(nvme, "write_extent", real)
        pm.store(a, torch.full((1000,), 2.0))
        assert torch.equal(pm.read(a), torch.full((1000,), 2.0))


def test_two_threads_each_waiting_for_room_the_other_holds_fail_within_seconds(tmp_path):
    """Thread A pins a, thread B pins b, then each waits for room only the other's release could
    make (step_in_backward's update thread against backward did this): nothing can move, so a wait
    fails after stuck_after_s, not after the 30 s timeout; the other then gets its room."""
    with make(tmp_path, device="24KiB", wait_timeout_s=30) as pm:
        a, b, c, d = (pm.register(n, torch.randn(2500), "host") for n in "abcd")  # 10000 bytes each
        pinned = threading.Barrier(2)
        outcome: dict[str, str] = {}

        def run(mine, wanted, name):
            pm.acquire(mine)
            pinned.wait()
            try:
                pm.acquire(wanted)
                pm.release(wanted)
                outcome[name] = "got it"
            except RuntimeError as e:
                outcome[name] = str(e)
            finally:
                pm.release(mine)

        t0 = time.monotonic()
        threads = [threading.Thread(target=run, args=args) for args in ((a, c, "A"), (b, d, "B"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert not any(t.is_alive() for t in threads) and time.monotonic() - t0 < 15
        failed = [v for v in outcome.values() if v != "got it"]
        assert len(failed) == 1 and "none can come" in failed[0] and "threads waiting for room there too" in failed[0]

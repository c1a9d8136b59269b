"""The state machine of the records (tierzero/placement/residency.py, records.py): dirty releases
and stores invalidate or update every copy, lazy copies stay dirty until room or flush, moves in
flight are typed records, and a failed home write is refused until a new store."""

import threading

import pytest
import torch

import tierzero.placement.storage.nvme as nvme
from placement_builders import make, same
from tierzero.placement.storage.nvme import ChecksumError
from tierzero.placement.handles import Kind, TensorHandle
from tierzero.placement.residency import Residency
from tierzero.config.tiernames import Tier


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

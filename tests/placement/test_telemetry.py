"""Telemetry (tierzero/placement/telemetry.py): moves, stalls and the Chrome trace of a manager's
work."""

import json

import torch

from placement_builders import make


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

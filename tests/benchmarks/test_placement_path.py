"""benchmarks/placement_path.py: one fetch of an NVMe-homed tensor to the device enters
placement's core modules in the order manager -> residency -> moves -> nvme: the manager once
(the public call), the table once per lookup and once for the fetch and its commit, the move's
worker starting in moves (the executor) and reading through nvme once."""

from __future__ import annotations

from builders import REPO


def test_a_fetch_runs_manager_residency_moves_nvme(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import placement_path

    entries, visits = placement_path.trace_acquire({"handles"})
    core = [e.rsplit(">", 1)[1] for e in entries]
    order = [m for m in dict.fromkeys(core) if m in ("manager", "residency", "moves", "nvme")]
    assert order == ["manager", "residency", "moves", "nvme"], entries
    assert visits["manager"] == 1 and visits["nvme"] == 1, visits
    assert visits["residency"] <= 4, entries  # 9 before the split (96f4799)
    worker = [e for e in entries if e.startswith("tierzero-io")]
    assert worker[0].endswith(":->executor") and any(e.endswith(":plans>nvme") for e in worker), worker

"""benchmarks/placement_path.py: one fetch of an NVMe-homed tensor to the device enters
placement's core modules in the order manager -> residency -> executor -> nvme: the manager once
(the public call), the table once for the call and once for the commit, the move submitted to
the executor, whose worker starts there and reads through nvme once."""

from __future__ import annotations

from builders import REPO


def test_a_fetch_runs_manager_residency_executor_nvme(monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import placement_path

    entries, visits = placement_path.trace_acquire({"handles"})
    core = [e.rsplit(">", 1)[1] for e in entries]
    order = [m for m in dict.fromkeys(core) if m in ("manager", "residency", "executor", "nvme")]
    assert order == ["manager", "residency", "executor", "nvme"], entries
    assert visits["manager"] == 1 and visits["nvme"] == 1, visits
    assert visits["residency"] <= 2, entries  # 9 before the split (96f4799), 4 at 42336d0
    worker = [e for e in entries if e.startswith("tierzero-io")]
    assert worker[0].endswith(":->executor") and any(e.endswith(":plans>nvme") for e in worker), worker

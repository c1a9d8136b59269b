"""benchmarks/nvme_floor.py's steps: with the overlapped step a step carries the updates of the
one before it, and the last step's land after the steps, in a settle timed apart (a settle inside
the first and the last step made the first carry none and the last two)."""

from __future__ import annotations

import json

import pytest

from builders import REPO


@pytest.mark.parametrize("streams", ["sync", "async"])
def test_the_last_steps_updates_land_in_a_settle_apart(tmp_path, capsys, monkeypatch, streams) -> None:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import nvme_floor

    spec = {"size": "L2x64", "mode": "clip", "steps": 4, "batch": 1, "seq": 8, "device_budget": "32MiB",
            "host_budget": "96MiB", "nvme_dir": str(tmp_path), "io_threads": 2, "overlap_step": True,
            "streams": streams, "poison": True}
    nvme_floor.child(spec)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    n, steps, settle = lines[0]["params"], lines[1:-1], lines[-1]
    assert [s["step"] for s in steps] == [0, 1, 2, 3] and settle["settle_s"] > 0
    # each update writes the parameters (fp32) and both moments home; which row a write lands in
    # depends on the update thread's timing, but none is lost: four updates' worth at least
    written = sum(r["tz_by_kind"][k]["write"] for r in steps + [settle] for k in ("params", "moments")) / n
    assert written >= 4 * 12 * 0.99

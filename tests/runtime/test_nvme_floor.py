"""benchmarks/nvme_floor.py's steps: with the overlapped step a step carries the updates of the
one before it, and the last step's land after the steps, timed apart: every update is counted
once, none twice (a settle inside the first and last steps made the last one carry two)."""

from __future__ import annotations

import json

import pytest

from builders import REPO


@pytest.mark.parametrize("streams", ["sync", "async"])
def test_each_step_carries_one_steps_updates(tmp_path, capsys, monkeypatch, streams) -> None:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import nvme_floor

    spec = {"size": "L2x64", "mode": "clip", "steps": 4, "batch": 1, "seq": 8, "device_budget": "32MiB",
            "host_budget": "56MiB", "nvme_dir": str(tmp_path), "io_threads": 2, "overlap_step": True,
            "streams": streams, "poison": True}
    nvme_floor.child(spec)
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    n, steps, settle = lines[0]["params"], lines[1:-1], lines[-1]
    assert [s["step"] for s in steps] == [0, 1, 2, 3] and settle["settle_s"] > 0
    # each update writes the parameters (fp32) and both moments home: every counted step the same
    # bytes, the last one's too (its own updates land in the settle, not in it)
    written = [sum(r["tz_by_kind"][k]["write"] for k in ("params", "moments")) / n for r in steps[1:] + [settle]]
    assert written == pytest.approx([12] * 4, rel=0.01)

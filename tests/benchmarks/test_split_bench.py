"""benchmarks/split.py at a tiny size: each fixed fraction's states land on NVMe in that share
(within one block), the NVMe bytes a step moves grow with it, and "auto" at a host budget for
about half the states puts some on NVMe and some on the host, moving no more NVMe bytes than
the best fixed share at that budget."""

from __future__ import annotations

import pytest

from builders import REPO


def test_split_benchmark_smoke(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import split

    result = split.main(["--nvme-dir", str(tmp_path), "--model", "tiny", "--layers", "6", "--width", "64",
                         "--seq", "16", "--steps", "2", "--fractions", "0,0.5,1", "--shares", "0.5", "--pairs", "1",
                         "--json"])
    fixed = {r["fraction"]: r for r in result["fixed"]}
    block = max(r["states_bytes"] for r in fixed.values()) / 6  # about one of the six blocks
    for f, r in fixed.items():
        assert abs(r["states_on_nvme"] - f * r["states_bytes"]) <= block, (f, r["states_on_nvme"], r["states_bytes"])
    assert fixed[0]["nvme_bytes_per_step"] == 0 < fixed[0.5]["nvme_bytes_per_step"] < fixed[1]["nvme_bytes_per_step"]
    (at,) = result["auto"]
    auto, best = at["pairs"][0]["auto"], at["pairs"][0]["best_fixed"]
    assert 0 < auto["states_on_nvme"] < auto["states_bytes"], auto
    assert at["auto_plan_nvme_bytes"] <= at["best_plan_nvme_bytes"]
    assert auto["nvme_bytes_per_step"] <= best["nvme_bytes_per_step"]
    assert auto["losses"] == fixed[0]["losses"]  # the same training, wherever the states live

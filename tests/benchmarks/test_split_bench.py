"""benchmarks/split.py at a tiny size: each fixed fraction's states land on NVMe in that share
(within one block), the NVMe bytes a step moves grow with it, and "auto" under a host budget
for about half the states puts some on NVMe and some on the host."""

from __future__ import annotations

import pytest

from builders import REPO


def test_split_benchmark_smoke(tmp_path, monkeypatch) -> None:
    monkeypatch.syspath_prepend(str(REPO / "benchmarks"))
    import split

    result = split.main(["--nvme-dir", str(tmp_path), "--model", "tiny", "--layers", "6", "--width", "64",
                         "--seq", "16", "--steps", "2", "--fractions", "0,0.5,1", "--pairs", "1", "--json"])
    fixed = {r["fraction"]: r for r in result["fixed"]}
    block = max(r["states_bytes"] for r in fixed.values()) / 6  # about one of the six blocks
    for f, r in fixed.items():
        assert abs(r["states_on_nvme"] - f * r["states_bytes"]) <= block, (f, r["states_on_nvme"], r["states_bytes"])
    assert fixed[0]["nvme_bytes_per_step"] == 0 < fixed[0.5]["nvme_bytes_per_step"] < fixed[1]["nvme_bytes_per_step"]
    auto = result["pairs"][0]["auto"]
    assert 0 < auto["states_on_nvme"] < auto["states_bytes"], auto
    assert auto["losses"] == fixed[0]["losses"]  # the same training, wherever the states live

"""`tierzero tune` weighs optimizer-state splits beside prefetch settings: "auto"'s choice and the
fixed host/NVMe splits that fit, each predicted by the tier model from the recording with its
updates' NVMe reads changed (tierzero/planning/split_tuning.py), ranked by the predicted step."""

from __future__ import annotations

import json
from typing import Any

from tierzero.cli import tune


def args(tmp_path: Any, *extra: str) -> list[str]:
    return ["--model", "tiny", "--n-layer", "4", "--device-budget", "2MiB", "--host-budget", "64MiB",
            "--nvme-dir", str(tmp_path / "nvme"), "--params", "host", "--grads", "host", "--optimizer-states", "nvme",
            "--batch", "2", "--seq", "32", "--no-progress", "--simulate", "--policies", "none,lookahead:1",
            "--nvme-depths", "0", "--io-threads", "2", *extra]


def test_tune_ranks_splits_by_the_predicted_step(tmp_path: Any, capsys: Any) -> None:
    assert tune.main(args(tmp_path, "--json")) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["recording"]["updates"] > 0
    splits = {r["name"]: r for r in report["splits"]}
    assert {"auto", "nvme=0", "nvme=0.5", "nvme=1"} <= set(splits), list(splits)
    steps = [r["predicted_step_s"] for r in report["splits"]]
    assert steps == sorted(steps)
    reads = [splits[f"nvme={f}"]["update_nvme_read_bytes"] for f in ("0", "0.25", "0.5", "0.75", "1")]
    assert reads[0] == 0 and reads == sorted(reads) and reads[-1] > 0
    # more of the states read from NVMe by the updates racing the forward never predicts a shorter step
    assert splits["nvme=0"]["predicted_step_s"] <= splits["nvme=1"]["predicted_step_s"]
    assert splits["nvme=0"]["predicted_stall_s"] < splits["nvme=1"]["predicted_stall_s"]


def test_the_splits_are_printed_after_the_prefetch_candidates(tmp_path: Any, capsys: Any) -> None:
    assert tune.main(args(tmp_path)) == 0
    out = capsys.readouterr().out
    assert out.index("chosen: ") < out.index("optimizer-state splits under the chosen prefetch setting")
    assert "auto (" in out and "nvme=0.5 (host=0.50 nvme=0.50)" in out

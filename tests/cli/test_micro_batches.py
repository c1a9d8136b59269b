"""`tierzero train --micro-batches K`: a step of K micro-batches of --batch rows, run layer by
layer, trains as one plain step over the same K x --batch rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tierzero.cli import train

SMALL = ["--model", "tiny", "--steps", "3", "--seq", "32", "--device-budget", "4MiB", "--host-budget", "8MiB",
         "--no-progress", "--lr", "1e-3", "--warmup", "0"]


def _rows(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_two_micro_batches_train_as_one_batch_of_their_rows(tmp_path: Path) -> None:
    runs = {}
    for name, flags in {"plain": ["--batch", "4"], "layer-major": ["--batch", "2", "--micro-batches", "2"]}.items():
        run_dir = tmp_path / name
        assert train.main([*SMALL, *flags, "--run-dir", str(run_dir), "--nvme-dir", str(tmp_path / f"nvme-{name}")]) == 0
        runs[name] = _rows(run_dir)
    # The same rows each step; the mean over two halves is the mean over the whole in exact
    # arithmetic, so the runs differ by fp32 rounding only.
    for plain, lm in zip(runs["plain"], runs["layer-major"], strict=True):
        assert lm["loss"] == pytest.approx(plain["loss"], rel=1e-5)
        assert lm["tokens_per_s"] > 0
    summary = json.loads((tmp_path / "layer-major" / "summary.json").read_text())
    assert summary["micro_batches"] == 2


def test_bad_micro_batch_count(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert train.main([*SMALL, "--micro-batches", "0", "--run-dir", str(tmp_path)]) == 2
    assert "--micro-batches: expected a whole number >= 1" in capsys.readouterr().err

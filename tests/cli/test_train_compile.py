"""`tierzero train --compile`: the tiny GPT's blocks compiled (tz.compile), the same training."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch._dynamo.utils import counters

from tierzero.cli import train

SMALL = ["--model", "tiny", "--steps", "2", "--batch", "2", "--seq", "16", "--device-budget", "4MiB",
         "--host-budget", "64MiB", "--params", "host", "--optimizer-states", "host", "--no-progress"]


def losses(tmp_path: Path, name: str, *extra: str) -> list[float]:
    run_dir = tmp_path / name
    assert train.main([*SMALL, "--run-dir", str(run_dir), *extra]) == 0
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_compile_flag_compiles_the_blocks_and_trains_the_same(tmp_path: Path) -> None:
    eager = losses(tmp_path, "eager")
    torch._dynamo.reset()
    counters.clear()
    compiled = losses(tmp_path, "compiled", "--compile")
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # the tiny GPT's one block shape
    # Inductor's kernels against eager's: fp32 rounding, far below what one step moves the loss by.
    assert max(abs(a - b) for a, b in zip(eager, compiled)) <= 1e-4 * abs(eager[0]), (eager, compiled)
    assert abs(eager[1] - eager[0]) > 1e-3 * abs(eager[0])

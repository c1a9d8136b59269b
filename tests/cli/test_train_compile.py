"""`tierzero train --compile`: the tiny GPT's blocks compiled (tz.compile), the same training.

The flag's plumbing only: tz.compile runs with dynamo's aot_eager backend here (the same graphs,
no C++ compile; inductor's numbers are tests/runtime/test_compile.py's)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from torch._dynamo.utils import counters

import tierzero as tz
from tierzero.cli import train

SMALL = ["--model", "tiny", "--steps", "2", "--batch", "2", "--seq", "16", "--device-budget", "4MiB",
         "--host-budget", "64MiB", "--params", "host", "--optimizer-states", "host", "--no-progress"]


def losses(tmp_path: Path, name: str, *extra: str) -> list[float]:
    run_dir = tmp_path / name
    assert train.main([*SMALL, "--run-dir", str(run_dir), *extra]) == 0
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_compile_flag_compiles_the_blocks_and_trains_the_same(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    compile_ = tz.compile
    calls: list[Any] = []
    monkeypatch.setattr(tz, "compile", lambda model: calls.append(model) or compile_(model, backend="aot_eager"))
    eager = losses(tmp_path, "eager")
    assert not calls
    torch._dynamo.reset()
    counters.clear()
    compiled = losses(tmp_path, "compiled", "--compile")
    assert len(calls) == 1
    assert counters["stats"]["unique_graphs"] == 1, dict(counters["stats"])  # the tiny GPT's one block shape
    assert compiled == eager  # aot_eager runs eager's kernels

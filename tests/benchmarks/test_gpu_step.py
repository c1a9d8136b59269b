"""benchmarks/gpu_step.py without a GPU: configurations a, b and e train a tiny Llama with the CPU
as device on the asynchronous stream stand-in, so the script's logic runs in CI; the GPU-only
ones say why they did not run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from builders import REPO

pytest.importorskip("transformers")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run; a GPU runs the real configurations")
def test_runs_a_b_and_e_on_the_cpu_stand_in(tmp_path: Path) -> None:
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_step.py"), "--device", "cpu", "--streams", "async",
           "--size", "tiny", "--seq", "64", "--steps", "2", "--nvme-dir", str(tmp_path), "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    runs = {r["config"]: r for r in report["runs"]}
    for which in "abe":
        assert runs[which]["step_s"] > 0 and runs[which]["tokens_per_s"] > 0, runs[which]
    assert runs["a"]["streams"] == runs["b"]["streams"] == "async" and runs["a"]["stall_s"] is not None
    assert runs["c"]["skipped"] == runs["d"]["skipped"] == "needs CUDA"
    assert "need one" in report["note"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU run; a GPU runs the real configurations")
def test_auto_and_micro_batches_on_the_cpu_stand_in(tmp_path: Path) -> None:
    """g ("auto", here with int8 states) trains and records where each kind lives; with
    --micro-batches, a runs tz.accumulate and a-plain the plain loop, with the same losses step by
    step; a configuration that is not one is refused."""
    cmd = [sys.executable, str(REPO / "benchmarks" / "gpu_step.py"), "--device", "cpu", "--streams", "async",
           "--size", "tiny", "--seq", "32", "--steps", "1", "--micro-batches", "2", "--nvme-dir", str(tmp_path),
           "--configs", "g-int8,a,a-plain", "--json"]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout)
    runs = {r["config"]: r for r in report["runs"]}
    assert report["micro_batches"] == 2 and set(runs) == {"g-int8", "a", "a-plain"}, report
    for r in runs.values():
        assert r["step_s"] > 0 and r["micro_batches"] == 2 and len(r["losses"]) == 2, r
    assert runs["a"]["losses"] == runs["a-plain"]["losses"]
    assert runs["a"]["tokens_per_s"] == pytest.approx(2 * 32 / runs["a"]["step_s"])
    states = {c: sum(runs[c]["tier_bytes"]["optimizer_states"].values()) for c in ("a", "g-int8")}
    assert runs["g-int8"]["optimizer_state_dtype"] == "int8" and runs["a"]["optimizer_state_dtype"] == "float32"
    assert 0.45 < states["g-int8"] / states["a"] < 0.55, states  # fp32 master weights: 4 + 2 x 1.02 bytes of 12
    for wrong in ("e-plain", "e-int8", "g-int8-bf16"):
        bad = subprocess.run(cmd[:-3] + ["--configs", wrong, "--json"], capture_output=True, text=True, env=env,
                             timeout=300)
        assert bad.returncode == 2 and f"'{wrong}'" in bad.stderr, bad.stderr

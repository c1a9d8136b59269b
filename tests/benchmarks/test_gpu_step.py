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

"""`tierzero train`: a short run of the tiny GPT with most of its state on NVMe writes a complete
run folder; bad input fails at start with a message that says what was needed and given."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import io_engine.files
from tierzero.cli import train
from builders import REPO

TIERS = {"device", "host", "nvme"}
SMALL = ["--model", "tiny", "--steps", "3", "--batch", "2", "--seq", "32",
         "--device-budget", "4MiB", "--host-budget", "8MiB", "--no-progress"]


def test_tiny_run_writes_a_complete_run_folder(tmp_path: Path) -> None:
    run_dir, nvme = tmp_path / "run", tmp_path / "nvme"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO),
                                                                      os.environ.get("PYTHONPATH")]))}
    args = [a for a in SMALL if a != "--no-progress"]
    proc = subprocess.run([sys.executable, "-m", "tierzero.cli", "train", *args, "--nvme-dir", str(nvme),
                           "--run-dir", str(run_dir)], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    # the progress bar: one line per step on a non-terminal stderr, with loss, tokens/s, tiers, IO rate
    bars = [line for line in proc.stderr.splitlines() if line.startswith("[")]
    assert len(bars) == 3 and all(k in bars[-1] for k in ("loss", "tok/s", "dev", "host", "nvme", "GB/s"))

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    for r in rows:
        assert math.isfinite(r["loss"]) and r["step_s"] > 0 and r["tokens_per_s"] > 0 and r["stall_s"] >= 0
        assert set(r["bytes"]) == TIERS and r["bytes"]["nvme"] > 0
    assert rows[0]["loss"] < 6.0  # ~ln(256) at initialisation: the meta-built model is initialised

    summary = json.loads((run_dir / "summary.json").read_text())
    budgets, peaks = summary["budgets"], summary["peak_bytes"]
    assert set(budgets) == set(peaks) == TIERS
    assert all(peaks[t] <= budgets[t] for t in TIERS)
    # NVMe really holds state: more than the device and host budgets together
    assert summary["state_bytes"] > budgets["device"] + budgets["host"]
    assert peaks["nvme"] >= summary["state_bytes"] - budgets["device"] - budgets["host"]

    trace = json.loads((run_dir / "trace.json").read_text())
    assert any(e.get("ph") == "X" for e in trace["traceEvents"])
    assert (run_dir / "tiers.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # the swap files are removed at the end
    assert not [p for p in nvme.rglob("*") if p.is_file()]


def run_cli(tmp_path: Path, *extra: str) -> int:
    return train.main([*SMALL, "--run-dir", str(tmp_path / "run"), *extra])


def test_missing_and_empty_corpus_fail_at_start(tmp_path: Path, capsys: Any) -> None:
    assert run_cli(tmp_path, "--data", str(tmp_path / "missing.txt")) == 2
    assert "missing.txt" in capsys.readouterr().err
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    assert run_cli(tmp_path, "--data", str(empty)) == 2
    assert "holds 0 bytes" in capsys.readouterr().err


def test_budget_too_small_for_the_state_it_must_hold(tmp_path: Path, capsys: Any) -> None:
    assert run_cli(tmp_path, "--host-budget", "1MiB") == 2  # everything on host: ~16 MiB
    err = capsys.readouterr().err
    assert "--host-budget 1.00 MiB is too small" in err and "on host" in err and "nvme" in err
    assert run_cli(tmp_path, "--host-budget", "1MiB", "--device-budget", "64KiB") == 2
    err = capsys.readouterr().err  # every tier that falls short at once, each with its least budget
    assert "--device-budget 64.00 KiB is too small" in err and "--host-budget 1.00 MiB is too small" in err
    assert err.count("Raise --device-budget ") == 1 and " --host-budget " in err.split("Raise ")[1]


def test_nvme_dir_on_a_disk_without_room(tmp_path: Path, capsys: Any, monkeypatch: Any) -> None:
    monkeypatch.setattr(io_engine.files, "free_bytes", lambda path: 4096)
    assert run_cli(tmp_path, "--nvme-dir", str(tmp_path / "nvme")) == 2
    err = capsys.readouterr().err
    assert "4.00 KiB free" in err and "needs" in err and "bytes" in err
    assert not (tmp_path / "nvme").exists()  # found before anything was written


def test_bad_step_count(tmp_path: Path, capsys: Any) -> None:
    assert train.main(["--steps", "0", "--run-dir", str(tmp_path)]) == 2
    assert "--steps: expected an int >= 1, got 0" in capsys.readouterr().err


@pytest.mark.parametrize("flag", ["--grads", "--optimizer-states"])
def test_state_tiers_default_to_the_params_tier(flag: str) -> None:
    """The optimizer states default to --params' tier; the gradients to where each block's
    update runs, as the API's grads=None."""
    args = train.parser().parse_args(["--nvme-dir", "/x"])
    cfg = train._config(args)
    assert cfg.params == cfg.optimizer_states == "nvme" and cfg.grads is None
    args = train.parser().parse_args(["--nvme-dir", "/x", flag, "host"])
    assert getattr(train._config(args), flag[2:].replace("-", "_")) == "host"


def test_activations_on_nvme_with_checkpointing(tmp_path: Path) -> None:
    """--activations nvme --activation-checkpointing: the same losses as the default run, the
    activations counted on NVMe each step, and their moves in the trace."""
    def rows(name: str, *extra: str) -> list[dict]:
        run_dir = tmp_path / name
        assert train.main([*SMALL, "--run-dir", str(run_dir), "--nvme-dir", str(tmp_path / f"nvme-{name}"), *extra]) == 0
        return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]

    plain = rows("plain")
    placed = rows("placed", "--activations", "nvme", "--activation-checkpointing")
    assert [r["loss"] for r in placed] == [r["loss"] for r in plain]
    for r in placed:
        assert r["activation_bytes"]["nvme"] > 0 and r["activation_stall_s"] >= 0
        assert sum(r["activation_bytes"].values()) < sum(plain[0]["activation_bytes"].values())
    assert plain[0]["activation_bytes"]["nvme"] == 0
    trace = json.loads((tmp_path / "placed" / "trace.json").read_text())["traceEvents"]
    tracks = {e["args"]["name"] for e in trace if e.get("name") == "thread_name"}
    assert "activations" in tracks
    assert any(e.get("ph") == "X" and e["name"].endswith(".activation") for e in trace)


def test_split_flags_and_the_placement_in_the_summary(tmp_path: Path) -> None:
    """--optimizer-states with fractions: the states on host and NVMe in summary.json's
    "placement" (tz.tier_bytes), the grads where their updates run, the same losses as all on host."""
    def run(name: str, *extra: str) -> tuple[list[float], dict]:
        run_dir = tmp_path / name
        assert train.main([*SMALL, "--run-dir", str(run_dir), "--nvme-dir", str(tmp_path / f"nvme-{name}"),
                           "--host-budget", "24MiB", "--params", "host", "--grads", "host", *extra]) == 0
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [r["loss"] for r in rows], json.loads((run_dir / "summary.json").read_text())["placement"]

    plain, placed_plain = run("plain", "--optimizer-states", "host")
    losses, placed = run("split", "--optimizer-states", "host=0.5,nvme=0.5")
    assert losses == plain
    assert placed["optimizer_states"]["host"] > 0 and placed["optimizer_states"]["nvme"] > 0
    assert placed_plain["optimizer_states"]["nvme"] == 0 and placed["grads"] == placed_plain["grads"]
    with pytest.raises(SystemExit):
        train.parser().parse_args(["--optimizer-states", "host=0.5,nvme=0.4"])

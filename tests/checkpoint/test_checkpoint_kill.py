"""`tierzero train --checkpoint-every 2 --resume` survives SIGKILL at any moment, exactly.

The run is killed again and again, at random moments and at moments chosen to fall inside a
checkpoint save (the save's `.tmp-ckpt-*` folder is watched for and the process killed as soon
as it appears); each kill is followed by `--resume`. Every loss any attempt wrote must equal the
uninterrupted run's loss of that step, bit for bit, and the final run must cover every step.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from builders import REPO
STEPS = 8


def _cmd(run_dir: Path, data: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "tierzero.cli", "train", "--model", "tiny", "--steps", str(STEPS),
            "--batch", "2", "--seq", "32", "--data", str(data), "--nvme-dir", str(run_dir.parent / "nvme"),
            "--nvme-budget", "64MiB", "--run-dir", str(run_dir), "--checkpoint-every", "2",
            "--keep-last", "2", "--no-progress", *extra]


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    return env


def _losses(run_dir: Path) -> dict[int, float]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return {}
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    out: dict[int, float] = {}
    for r in rows:
        assert r["step"] not in out, f"step {r['step']} appears twice in {path}"
        out[r["step"]] = r["loss"]
    return out


def _tmp_dirs(ckpt: Path) -> set[tuple[str, int]]:
    """(name, inode) of unfinished saves' folders: a new save makes a new inode."""
    try:
        return {(e.name, e.inode()) for e in os.scandir(ckpt) if e.name.startswith(".tmp-ckpt-")}
    except FileNotFoundError:
        return set()


def _clean_swap(nvme: Path) -> None:
    """Swap folders of killed runs (their preallocated files would pile up on the disk)."""
    for p in nvme.glob("rank*/run-*"):
        shutil.rmtree(p, ignore_errors=True)


@pytest.mark.slow
def test_sigkill_anywhere_then_resume_is_bit_identical(tmp_path):
    data = tmp_path / "data.txt"
    data.write_bytes(b"".join(p.read_bytes() for p in sorted((REPO / "tierzero").rglob("*.py"))))
    ref_dir = tmp_path / "ref"
    subprocess.run(_cmd(ref_dir, data), env=_env(), check=True, capture_output=True, timeout=120)
    reference = _losses(ref_dir)
    assert sorted(reference) == list(range(STEPS))

    rng = random.Random(7)
    run_dir = tmp_path / "run"
    ckpt = run_dir / "checkpoints"
    kills, kills_in_save, finished = 0, 0, False
    attempt = 0
    while not finished:
        attempt += 1
        assert attempt < 40, f"no progress after {attempt} attempts ({kills} kills)"
        in_save = kills < 12 and attempt % 2 == 0
        kill_at = None if kills >= 12 or in_save else time.monotonic() + rng.uniform(1.5, 5.0)
        before = _tmp_dirs(ckpt)
        proc = subprocess.Popen(_cmd(run_dir, data, "--resume"), env=_env(), stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE)
        killed = False
        deadline = time.monotonic() + 90
        while proc.poll() is None and time.monotonic() < deadline:
            if (in_save and _tmp_dirs(ckpt) - before) or (kill_at is not None and time.monotonic() >= kill_at):
                proc.send_signal(signal.SIGKILL)
                killed = True
                break
            time.sleep(0.0005 if in_save else 0.01)
        proc.wait(timeout=30)
        stderr = proc.stderr.read().decode()
        if killed and proc.returncode == -signal.SIGKILL:
            kills += 1
            kills_in_save += bool(_tmp_dirs(ckpt) - before)  # this run left an unfinished save behind
            _clean_swap(tmp_path / "nvme")
        else:
            assert proc.returncode == 0, f"attempt {attempt} failed (rc {proc.returncode}):\n{stderr[-3000:]}"
            finished = kills >= 12 or not killed
            if finished and kills < 10:  # it ended before its kill: start over with a fresh run
                finished = False
                shutil.rmtree(run_dir)
        losses = _losses(run_dir)
        for step, loss in losses.items():
            assert loss == reference[step], (f"attempt {attempt}: step {step} loss {loss!r} != uninterrupted "
                                             f"{reference[step]!r}")
    print(f"{attempt} attempts, {kills} kills, {kills_in_save} inside a save")
    assert kills >= 10 and kills_in_save >= 3, (kills, kills_in_save)
    assert _losses(run_dir) == reference
    assert not _tmp_dirs(ckpt)
    assert len([p for p in ckpt.iterdir() if p.name.startswith("ckpt-")]) == 2  # keep_last


def test_resume_refuses_other_settings_and_starts_afresh_without_a_checkpoint(tmp_path, capsys):
    from tierzero.cli import train

    data = tmp_path / "data.txt"
    data.write_bytes((REPO / "tierzero" / "cli" / "train.py").read_bytes())
    args = ["--model", "tiny", "--batch", "2", "--seq", "16", "--data", str(data), "--run-dir", str(tmp_path / "r"),
            "--no-progress", "--checkpoint-every", "1", "--resume"]
    train.run(train.parser().parse_args([*args, "--steps", "2"]))
    assert "no checkpoint" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"other settings .*'steps': \(2, 3\)"):
        train.run(train.parser().parse_args([*args, "--steps", "3"]))
    summary = train.run(train.parser().parse_args([*args, "--steps", "2"]))  # already done: nothing to run
    assert summary["steps"] == 2 and len(_losses(tmp_path / "r")) == 2


def test_sigterm_saves_at_the_step_boundary_and_resume_is_exact(tmp_path):
    """What a scheduler's preemption sends: the run checkpoints at the end of the step under way
    (off the --checkpoint-every cadence), removes its swap files and exits 143; --resume then
    gives every step the uninterrupted run's loss, bit for bit."""
    data = tmp_path / "data.txt"
    data.write_bytes((REPO / "tierzero" / "cli" / "train.py").read_bytes() * 4)
    ref_dir = tmp_path / "ref"
    subprocess.run(_cmd(ref_dir, data), env=_env(), check=True, capture_output=True, timeout=120)
    reference = _losses(ref_dir)
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(_cmd(run_dir, data, "--checkpoint-every", "5"), env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while len(_losses(run_dir)) < 2 and time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.01)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 143, err
    stopped = int(err.split("stopped by SIGTERM at step ")[1].split(",")[0])
    assert 2 <= stopped < STEPS and "saved (continue with --resume)" in err, err
    assert not [p for p in (tmp_path / "nvme").rglob("*") if p.is_file()]
    assert sorted(_losses(run_dir)) == list(range(stopped))
    saved = [p.name for p in (run_dir / "checkpoints").iterdir()]
    assert saved == ["ckpt-00000001"], saved  # the stop's own checkpoint (the cadence of 5 was not reached)
    proc = subprocess.run(_cmd(run_dir, data, "--resume"), env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert _losses(run_dir) == reference

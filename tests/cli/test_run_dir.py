"""`tierzero train` and its run folder under what users do to it: nothing lost, nothing hung.

A second run on a run folder is refused at once; a --export target that cannot be written is
refused before the first step; the end-of-run files are written each on its own (a full disk
for one names it and does not stop the others); a failing run leaves summary.json saying why;
--resume drops a torn last line of metrics.jsonl; SIGTERM stops a run that does not checkpoint
at once, without leaving swap files.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path


from builders import REPO
from tierzero.cli import train
from tierzero.cli.caches import CACHE_VARIABLES
from tierzero.cli.run.folder import RunDir

TINY = ["--model", "tiny", "--batch", "2", "--seq", "32", "--device-budget", "4MiB", "--host-budget", "8MiB",
        "--no-progress"]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}


def start(tmp_path: Path, *extra: str, env: dict[str, str] = ENV) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tierzero.cli", "train", *TINY, "--nvme-dir", str(tmp_path / "nvme"),
                             "--run-dir", str(tmp_path / "run"), *extra], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def wait_for_rows(run: Path, rows: int, proc: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        metrics = run / "metrics.jsonl"
        if metrics.exists() and len(metrics.read_text().splitlines()) >= rows:
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"no {rows} rows in {run / 'metrics.jsonl'} after {timeout} s")


def swap_files(nvme: Path) -> list[Path]:
    return [p for p in nvme.rglob("*") if p.is_file()] if nvme.exists() else []


def test_a_second_run_is_refused_at_once_and_sigterm_stops_the_first(tmp_path: Path, capsys) -> None:
    """The first run has a home and a temporary folder of its own: the command's caches leave
    nothing in either, stopped or not ([Note: private caches])."""
    home, tmp = tmp_path / "home", tmp_path / "tmp"
    home.mkdir(), tmp.mkdir()
    env = {k: v for k, v in ENV.items() if k not in CACHE_VARIABLES}
    first = start(tmp_path, "--steps", "100000", env={**env, "HOME": str(home), "TMPDIR": str(tmp)})
    try:
        wait_for_rows(tmp_path / "run", 2, first)
        t0 = time.monotonic()
        assert train.main([*TINY, "--steps", "2", "--run-dir", str(tmp_path / "run")]) == 2
        assert time.monotonic() - t0 < 30
        err = capsys.readouterr().err
        assert f"--run-dir '{tmp_path / 'run'}' is in use by process {first.pid}" in err
        assert first.poll() is None  # untouched: its rows go on
        rows = len((tmp_path / "run" / "metrics.jsonl").read_text().splitlines())
        wait_for_rows(tmp_path / "run", rows + 1, first)
    finally:
        first.send_signal(signal.SIGTERM)
        _, err = first.communicate(timeout=120)
    assert first.returncode == 143, err
    assert "stopped by SIGTERM" in err and "Traceback" not in err
    assert swap_files(tmp_path / "nvme") == []
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["stopped_by"] == "SIGTERM" and summary["steps_completed"] >= 3
    assert list(home.iterdir()) == [] and list(tmp.iterdir()) == []  # no /tmp/torchinductor_<user>, no ~/.cache


def test_a_bad_export_target_is_refused_before_the_first_step(tmp_path: Path, capsys) -> None:
    """Checked before anything is built or read (the --model folder here holds nothing yet)."""
    target = tmp_path / "mine"
    target.mkdir()
    (target / "thesis.tex").write_text("years of work")
    (tmp_path / "model").mkdir()
    folder_args = [*TINY[2:], "--model", str(tmp_path / "model"), "--steps", "3", "--run-dir", str(tmp_path / "run")]
    t0 = time.monotonic()
    assert train.main([*folder_args, "--export", str(target)]) == 2
    assert "exists and is not a model folder" in capsys.readouterr().err and time.monotonic() - t0 < 30
    assert not (tmp_path / "run").exists() and (target / "thesis.tex").read_text() == "years of work"
    assert train.main([*TINY, "--steps", "3", "--run-dir", str(tmp_path / "run"), "--export", str(tmp_path / "x")]) == 2
    assert "--export writes a transformers model folder" in capsys.readouterr().err


def test_a_full_disk_for_one_end_of_run_file_names_it_and_the_others_are_written(tmp_path: Path, monkeypatch,
                                                                                    capsys) -> None:
    real = RunDir.write

    def full(self, name, content):
        if name == "trace.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(self, name, content)

    monkeypatch.setattr(RunDir, "write", full)
    assert train.main([*TINY, "--steps", "3", "--run-dir", str(tmp_path / "run"), "--host-budget", "64MiB"]) == 1
    err = capsys.readouterr().err
    assert f"error: {tmp_path / 'run' / 'trace.json'}: not written (OSError: [Errno 28] No space left" in err
    run = tmp_path / "run"
    assert not (run / "trace.json").exists() and not list(run.glob(".trace.json.tmp-*"))
    summary = json.loads((run / "summary.json").read_text())
    assert summary["files_not_written"] and summary["steps"] == 3
    assert (run / "tiers.png").read_bytes()[:4] == b"\x89PNG"


FSIZE = """
import resource, sys
from tierzero.cli import train
from tierzero.cli.caches import CACHE_VARIABLES
resource.setrlimit(resource.RLIMIT_FSIZE, (8 << 10, 8 << 10))  # files of at most 8 KiB from here on
sys.exit(train.main(sys.argv[1:]))
"""


def test_rlimit_fsize_fails_the_large_files_alone(tmp_path: Path) -> None:
    """A real write failure (EFBIG under RLIMIT_FSIZE): trace.json and tiers.png exceed the limit
    and are named; metrics.jsonl and summary.json are written whole; no partial file stays."""
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-c", FSIZE, *TINY, "--steps", "3", "--run-dir", str(run), "--host-budget",
                           "64MiB"], env=ENV,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr
    assert f"{run / 'trace.json'}: not written (OSError: [Errno 27] File too large" in proc.stderr
    assert [json.loads(r)["step"] for r in (run / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    assert json.loads((run / "summary.json").read_text())["steps"] == 3
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".lock")) == sorted(
        ["metrics.jsonl", "summary.json"] + (["tiers.png"] if (run / "tiers.png").exists() else []))


def test_a_failing_run_leaves_summary_json_with_the_error(tmp_path: Path, monkeypatch, capsys) -> None:
    real = train._step

    def step(r, i):
        if i == 2:
            raise RuntimeError("the data loader broke")
        return real(r, i)

    monkeypatch.setattr(train, "_step", step)
    assert train.main([*TINY, "--steps", "4", "--run-dir", str(tmp_path / "run"), "--nvme-dir",
                       str(tmp_path / "nvme")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == (f"tierzero train: error: RuntimeError: the data loader broke; traceback in "
                       f"{tmp_path / 'run' / 'error.log'}")
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["error"] == "RuntimeError: the data loader broke" and summary["steps_completed"] == 2
    assert "Traceback" in (tmp_path / "run" / "error.log").read_text()
    assert swap_files(tmp_path / "nvme") == []


def test_resume_drops_a_torn_last_line_of_metrics(tmp_path: Path, capsys) -> None:
    args = [*TINY, "--steps", "4", "--run-dir", str(tmp_path / "run"), "--checkpoint-every", "2", "--host-budget",
            "64MiB"]
    assert train.main(args) == 0
    metrics = tmp_path / "run" / "metrics.jsonl"
    whole = metrics.read_text()
    metrics.write_text(whole + '{"step": 4, "loss": 5.5')  # a kill while writing the next row
    capsys.readouterr()
    assert train.main([*args, "--resume"]) == 0
    assert "dropped a torn last line" in capsys.readouterr().err
    assert metrics.read_text() == whole

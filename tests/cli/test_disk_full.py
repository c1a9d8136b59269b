"""A disk that filled: resuming counts the checkpoints already there, and a disk full in the
middle of a run exits 3 naming the file and the folder to free."""

from __future__ import annotations

import errno
from pathlib import Path

import pytest

import tierzero as tz
from tierzero.cli import train
from tierzero.cli.run import folder as run_dir
from tierzero.cli.run.folder import RunFolders, disk_error, new_checkpoints

TINY = ["--model", "tiny", "--batch", "2", "--seq", "16", "--host-budget", "16MiB", "--no-progress"]


def test_resume_counts_the_checkpoints_already_there(tmp_path: Path, monkeypatch) -> None:
    run = tmp_path / "run"
    for n in (1, 2):
        (run / "checkpoints" / f"ckpt-{n:08d}").mkdir(parents=True)
        (run / "checkpoints" / f"ckpt-{n:08d}" / "manifest.json").write_text("x")
    args = train.parser().parse_args(["--run-dir", str(run), "--checkpoint-every", "1", "--keep-last", "2",
                                      "--steps", "1", "--resume"])
    assert new_checkpoints(args) == (1, 2)  # the one being saved; the two there stay or are pruned
    state = 16 << 20
    files = run_dir.METRICS_ROW_BYTES + run_dir.TRACE_EVENTS_PER_STEP * run_dir.TRACE_EVENT_BYTES
    folders = RunFolders.open(args, 0)
    try:
        monkeypatch.setattr(run_dir, "free_disk_bytes", lambda path: files + state)  # room for one more
        folders.check_room(args, state)
        monkeypatch.setattr(run_dir, "free_disk_bytes", lambda path: files + state - 1)
        with pytest.raises(OSError, match=r"1 more checkpoint\(s\) beside the 2 there"):
            folders.check_room(args, state)
    finally:
        folders.close()


def test_a_disk_full_mid_run_exits_3_naming_the_file_and_the_folder(tmp_path: Path, monkeypatch, capsys) -> None:
    ckpt = tmp_path / "run" / "checkpoints"

    def full(folder, *args, **kw):
        raise OSError(errno.ENOSPC, f"cannot preallocate 4096 bytes for '{folder}/.tmp-ckpt-1/rank00000.bin': "
                                    "No space left on device")

    monkeypatch.setattr(tz, "save_checkpoint", full)
    assert train.main([*TINY, "--steps", "1", "--checkpoint-every", "1", "--run-dir", str(tmp_path / "run")]) == 3
    err = capsys.readouterr().err
    assert "rank00000.bin" in err and f"Free space on the disk of --checkpoint-dir '{ckpt}'" in err
    e = disk_error(OSError(errno.ENOSPC, "No space left on device"), ckpt / "x", ckpt, "--checkpoint-dir")
    assert e.errno == errno.ENOSPC and str(ckpt / "x") in str(e)
    assert disk_error(e2 := OSError(errno.EACCES, "denied"), ckpt, ckpt, "--run-dir") is e2  # not a full disk

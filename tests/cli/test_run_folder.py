"""What a run folder already holds: an earlier run is never replaced by a run without --resume,
nothing tierzero did not write is replaced or followed, and a refused --resume changes nothing.

Most cases read the folder through RunFolders.open (what `tierzero train` does before its first
step); one real run shows the whole path. Another user's files are made by chown to uid 65534
(nobody), which needs root: skipped elsewhere.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tierzero.cli import train
from tierzero.cli.run.folder import RunFolders

NOBODY = 65534
TINY = ["--model", "tiny", "--batch", "2", "--seq", "32", "--device-budget", "4MiB", "--host-budget", "16MiB",
        "--no-progress"]


def args(run: Path, *extra: str):
    return train.parser().parse_args(["--run-dir", str(run), *extra])


def earlier_run(run: Path) -> None:
    """A folder as a killed run leaves it: 3 metrics rows, two checkpoints."""
    (run / "checkpoints").mkdir(parents=True)
    (run / ".lock").write_text("1\n")
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": i, "loss": 1.0}) + "\n" for i in range(3)))
    for n in (1, 2):
        (run / "checkpoints" / f"ckpt-{n:08d}").mkdir()
        (run / "checkpoints" / f"ckpt-{n:08d}" / "manifest.json").write_text("x")


def snapshot(folder: Path) -> dict[str, bytes | str]:
    """Every entry under `folder` (links as their targets, never followed), but the lock."""
    out: dict[str, bytes | str] = {}
    for p in sorted(folder.rglob("*")):
        rel = str(p.relative_to(folder))
        if p.name == ".lock":
            continue
        out[rel] = f"-> {os.readlink(p)}" if p.is_symlink() else "dir" if p.is_dir() else p.read_bytes()
    return out


def open_folders(a) -> None:
    RunFolders.open(a, 0).close()


def test_an_earlier_run_is_refused_without_resume_and_removed_only_by_overwrite(tmp_path: Path) -> None:
    run = tmp_path / "run"
    earlier_run(run)
    (run / "nvme").mkdir()  # the folders this command names are its own
    before = snapshot(run)
    with pytest.raises(ValueError, match=r"holds an earlier run: metrics.jsonl \(3 rows\), 2 checkpoint") as e:
        open_folders(args(run, "--checkpoint-every", "1", "--nvme-dir", str(run / "nvme")))
    assert "--resume" in str(e.value) and "--overwrite" in str(e.value) and "new --run-dir" in str(e.value)
    assert snapshot(run) == before
    open_folders(args(run, "--resume", "--nvme-dir", str(run / "nvme")))
    assert snapshot(run) == before
    open_folders(args(run, "--overwrite", "--nvme-dir", str(run / "nvme")))
    assert sorted(snapshot(run)) == ["checkpoints", "nvme"]
    open_folders(args(run, "--nvme-dir", str(run / "nvme")))  # empty of runs now: a new run may start


def test_a_checkpoint_folder_elsewhere_with_checkpoints_is_an_earlier_run_too(tmp_path: Path) -> None:
    earlier_run(tmp_path / "old")
    (tmp_path / "old" / "metrics.jsonl").unlink()
    with pytest.raises(ValueError, match="holds an earlier run: 2 checkpoint"):
        open_folders(args(tmp_path / "run", "--checkpoint-every", "1", "--checkpoint-dir",
                          str(tmp_path / "old" / "checkpoints")))
    assert not (tmp_path / "run").exists()  # refused before anything is made


@pytest.mark.parametrize("plant", ["unknown file", "linked checkpoints", "linked ckpt", "linked metrics",
                                   "ckpt without manifest"])
def test_what_tierzero_did_not_write_is_refused_whatever_the_flags(tmp_path: Path, plant: str) -> None:
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    run.mkdir()
    (elsewhere / "ckpt-00000007").mkdir(parents=True)
    (elsewhere / "ckpt-00000007" / "manifest.json").write_text("theirs")
    (elsewhere / "metrics.jsonl").write_text("theirs\n")
    if plant == "unknown file":
        (run / "thesis.tex").write_text("years of work")
    elif plant == "linked checkpoints":
        os.symlink(elsewhere, run / "checkpoints")
    elif plant == "linked ckpt":
        (run / "checkpoints").mkdir()
        os.symlink(elsewhere / "ckpt-00000007", run / "checkpoints" / "ckpt-00000007")
    elif plant == "linked metrics":
        os.symlink(elsewhere / "metrics.jsonl", run / "metrics.jsonl")
    else:
        (run / "checkpoints" / "ckpt-00000003").mkdir(parents=True)
    before, theirs = snapshot(run), snapshot(elsewhere)
    for flags in ([], ["--resume"], ["--overwrite"]):
        with pytest.raises(ValueError, match="holds what tierzero did not write"):
            open_folders(args(run, "--checkpoint-every", "2", *flags))
        assert snapshot(run) == before and snapshot(elsewhere) == theirs
    assert not (run / ".lock").exists()


def test_another_users_files_are_refused_even_as_root(tmp_path: Path) -> None:
    """Files under tierzero's own names that another user owns (a second uid) are not this run's."""
    if os.geteuid() != 0:
        pytest.skip("giving files to another user needs root")
    run = tmp_path / "run"
    earlier_run(run)
    os.chown(run / "metrics.jsonl", NOBODY, NOBODY)
    with pytest.raises(ValueError, match=r"metrics.jsonl \(owned by uid 65534"):
        open_folders(args(run, "--overwrite"))
    (run / "metrics.jsonl").unlink()
    os.chown(run / "checkpoints" / "ckpt-00000001", NOBODY, NOBODY)
    with pytest.raises(ValueError, match=r"ckpt-00000001 \(owned by uid 65534"):
        open_folders(args(run, "--overwrite"))
    assert (run / "checkpoints" / "ckpt-00000001" / "manifest.json").read_text() == "x"


def test_a_real_restart_keeps_the_old_run_and_a_refused_resume_changes_nothing(tmp_path: Path, capsys) -> None:
    run = tmp_path / "run"
    base = [*TINY, "--run-dir", str(run), "--checkpoint-every", "1", "--keep-last", "1"]
    assert train.main([*base, "--steps", "1"]) == 0
    done = snapshot(run)
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 1
    capsys.readouterr()
    assert train.main([*base, "--steps", "1"]) == 2  # the same command again, without --resume
    assert "holds an earlier run: metrics.jsonl (1 rows)" in capsys.readouterr().err
    assert snapshot(run) == done
    assert train.main([*base, "--steps", "2", "--resume"]) == 2  # --steps differs from the saved run's
    assert "saved by a run with other settings" in capsys.readouterr().err
    assert snapshot(run) == done  # summary.json (the finished run's) and error.log untouched

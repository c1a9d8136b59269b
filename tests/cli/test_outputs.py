"""`tierzero train`'s outputs under faults (issue 46): an --export that cannot be written where it
goes, or that would replace the run's own folders, is refused before the first step; a failed
export names itself in summary.json and the other end-of-run files are still written; no file
of the run folder is written through a link someone planted; the run folder is private.

Read-only and full disks are real tmpfs mounts (root only: skipped, saying why, elsewhere).
"""

from __future__ import annotations

import json
import os
import stat
import time
from pathlib import Path

import pytest

from builders import tmpfs
from tierzero.cli import train
from tierzero.cli.run.folder import RunDir

TINY = ["--batch", "2", "--seq", "32", "--device-budget", "4MiB", "--host-budget", "8MiB", "--no-progress"]


def refused(tmp_path: Path, capsys, export: Path | str, *extra: str) -> str:
    """train.main with --export `export` (the --model folder empty: nothing may be built yet);
    asserts it is refused as bad input at once, before the run folder exists; its stderr."""
    (tmp_path / "model").mkdir(exist_ok=True)
    run = tmp_path / "run"
    t0 = time.monotonic()
    assert train.main([*TINY, "--model", str(tmp_path / "model"), "--steps", "40", "--run-dir", str(run),
                       "--export", str(export), *extra]) == 2
    assert time.monotonic() - t0 < 30
    return capsys.readouterr().err


def test_an_export_that_cannot_be_written_there_is_refused_before_the_first_step(tmp_path: Path, capsys) -> None:
    (tmp_path / "file").write_text("x")
    assert "cannot write in '/proc'" in refused(tmp_path, capsys, "/proc/x")
    assert "is a file, not a folder" in refused(tmp_path, capsys, tmp_path / "file" / "out")
    assert not (tmp_path / "run").exists()


def test_an_export_on_a_read_only_mount_or_its_root_is_refused(tmp_path: Path, capsys) -> None:
    with tmpfs(tmp_path / "ro", "ro,size=1m") as ro:
        assert f"cannot write in '{ro}' (Read-only file system)" in refused(tmp_path, capsys, ro / "out")
        assert "is a mount point" in refused(tmp_path, capsys, ro)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("which", ["nvme-dir", "checkpoint-dir", "parent of nvme-dir", "run-dir", "parent of run-dir"])
def test_an_export_that_is_or_holds_the_runs_own_folders_is_refused(tmp_path: Path, capsys, which: str) -> None:
    folders = {"--nvme-dir": tmp_path / "scratch" / "nvme", "--checkpoint-dir": tmp_path / "ck",
               "--run-dir": tmp_path / "run"}
    export = {"nvme-dir": folders["--nvme-dir"], "checkpoint-dir": folders["--checkpoint-dir"],
              "parent of nvme-dir": tmp_path / "scratch", "run-dir": folders["--run-dir"],
              "parent of run-dir": tmp_path}[which]
    flags = ["--nvme-dir", str(folders["--nvme-dir"]), "--checkpoint-dir", str(folders["--checkpoint-dir"]),
             "--checkpoint-every", "10"]
    err = refused(tmp_path, capsys, export, *flags)
    assert f"--export {str(export)!r} {'is' if which in ('nvme-dir', 'checkpoint-dir', 'run-dir') else 'contains'}" in err
    assert "give --export a folder outside" in err


def test_a_failed_export_is_named_in_summary_json_and_the_other_files_are_written(tmp_path: Path, capsys) -> None:
    """The export's disk fills up at the end (a 96 KiB tmpfs: the probe fits, the model does
    not): trace.json, tiers.png and summary.json are still written, summary.json names the
    export, its path and the error, and the run exits 1."""
    pytest.importorskip("transformers")
    pytest.importorskip("tokenizers")
    from test_train_hf import TEXTS, make_folder

    folder, data = tmp_path / "llama", tmp_path / "data.txt"
    make_folder(folder)
    data.write_text("".join(TEXTS))
    with tmpfs(tmp_path / "small", "size=96k") as small:
        run = tmp_path / "run"
        rc = train.main(["--model", str(folder), "--data", str(data), "--steps", "2", "--batch", "2", "--seq", "16",
                         "--device-budget", "4MiB", "--host-budget", "16MiB", "--no-progress", "--run-dir", str(run),
                         "--export", str(small / "out")])
        assert rc == 1
        assert not (small / "out").exists() and not list(small.iterdir())  # no half export left
    err = capsys.readouterr().err
    assert f"{small / 'out'}: not written (OSError: [Errno 28] No space left on device" in err
    summary = json.loads((run / "summary.json").read_text())
    [failed] = summary["files_not_written"]
    assert failed["file"] == "export" and failed["path"] == str(small / "out")
    assert failed["error"].startswith("OSError: [Errno 28]")
    assert json.loads((run / "trace.json").read_text()) and (run / "tiers.png").read_bytes()[:4] == b"\x89PNG"
    assert len((run / "metrics.jsonl").read_text().splitlines()) == 2


# ------------------------------------------------------------------------------- links


def plant(victim: Path, where: Path, how: str) -> None:
    victim.write_text("the user's file\n")
    os.symlink(victim, where) if how == "symlink" else os.link(victim, where)


@pytest.mark.parametrize("how", ["symlink", "hard link"])
def test_a_planted_lock_link_is_refused_and_its_target_untouched(tmp_path: Path, how: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    plant(tmp_path / "victim", run / ".lock", how)
    with pytest.raises(OSError, match=r"\.lock' is a (symbolic link|hard link \(2 names\)); tierzero does not write"):
        RunDir(run)
    assert (tmp_path / "victim").read_text() == "the user's file\n"


@pytest.mark.parametrize("how", ["symlink", "hard link"])
def test_metrics_and_end_of_run_files_replace_a_planted_link_never_write_through_it(tmp_path: Path,
                                                                                   how: str) -> None:
    run = tmp_path / "run"
    run.mkdir()
    for name in ("metrics.jsonl", "summary.json", f".summary.json.tmp-{os.getpid()}"):
        plant(tmp_path / f"victim-{name}", run / name, how)
    folder = RunDir(run)
    try:
        with folder.open_metrics(resume=False) as f:
            f.write('{"step": 0}\n')
        assert folder.write_each({"summary.json": "{}"}) == []
        with folder.open_metrics(resume=True) as f:  # now its own file: appended to
            f.write('{"step": 1}\n')
    finally:
        folder.close()
    for name in ("metrics.jsonl", "summary.json", f".summary.json.tmp-{os.getpid()}"):
        assert (tmp_path / f"victim-{name}").read_text() == "the user's file\n", name
    assert (run / "metrics.jsonl").read_text() == '{"step": 0}\n{"step": 1}\n'
    assert not (run / "metrics.jsonl").is_symlink() and (run / "metrics.jsonl").stat().st_nlink == 1


def test_resuming_onto_a_planted_metrics_link_is_refused(tmp_path: Path) -> None:
    run = tmp_path / "run"
    run.mkdir()
    plant(tmp_path / "victim", run / "metrics.jsonl", "symlink")
    folder = RunDir(run)
    try:
        with pytest.raises(OSError, match="metrics.jsonl' is a symbolic link"):
            folder.open_metrics(resume=True)
    finally:
        folder.close()
    assert (tmp_path / "victim").read_text() == "the user's file\n"


# ------------------------------------------------------------------------- permissions


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_the_run_folder_is_private_unless_asked(tmp_path: Path) -> None:
    """A whole run: the folder 0700, every file in it 0600; --file-mode umask: as the umask makes them."""
    old = os.umask(0o022)
    try:
        assert train.main(["--model", "tiny", *TINY, "--host-budget", "64MiB", "--steps", "2", "--run-dir", str(tmp_path / "run"),
                           "--checkpoint-every", "2"]) == 0
        run = tmp_path / "run"
        assert mode(run) == 0o700 and mode(run / "checkpoints") == 0o700
        files = [p for p in run.rglob("*") if p.is_file()]
        assert {p.name for p in files} >= {"metrics.jsonl", "summary.json", "trace.json", "tiers.png", ".lock",
                                           "manifest.json", "rank00000.bin", "rank00000.pt"}
        assert {p.name: mode(p) for p in files} == {p.name: 0o600 for p in files}
        assert all(mode(p) == 0o700 for p in run.rglob("*") if p.is_dir())
        folder = RunDir(tmp_path / "shared", private=False)
        folder.write("summary.json", "{}")
        folder.close()
        assert mode(tmp_path / "shared") == 0o755 and mode(tmp_path / "shared" / "summary.json") == 0o644
    finally:
        os.umask(old)

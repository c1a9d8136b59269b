"""The run folder of swap files and the reclaimer of dead runs' folders ([Note: reclaiming dead
runs]): nothing it did not make, no symlink followed, no live or foreign run touched."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Iterator

import pytest

from tierzero.placement.storage.swap_dirs import LOCK, RunFolder, check_nvme_dir, reclaim_dead_runs

DEAD_PID = 2**22 + 12345  # above the kernel's pid_max default (4194304): never a live process


def dead_run(rank_dir: Path, name: str = "run-20260101-000000-1-deadbeef", pid: int | str = DEAD_PID,
             swap_files: int = 2) -> Path:
    """A run folder as a killed run leaves it: an unlocked lock holding a PID, swap files."""
    run = rank_dir / name
    run.mkdir(parents=True)
    (run / LOCK).write_text(f"{pid}\n")
    for i in range(swap_files):
        (run / f"swap{i:04d}.bin").write_bytes(b"x" * 4096)
    return run


def test_a_run_folder_is_private_locked_and_removed_whole(tmp_path: Path) -> None:
    folder = RunFolder(tmp_path / "nvme", 0)
    assert stat.S_IMODE(folder.path.stat().st_mode) == 0o700
    assert stat.S_IMODE((folder.path / LOCK).stat().st_mode) & 0o077 == 0
    assert (folder.path / LOCK).read_text().strip() == str(os.getpid())
    folder.file(0).write_bytes(b"y")
    folder.remove()
    assert not (tmp_path / "nvme" / "rank0").exists()
    folder.remove()  # idempotent


def test_removing_after_the_folder_is_gone_is_silent(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    folder = RunFolder(tmp_path / "nvme", 0)
    folder.file(0).write_bytes(b"y")
    for p in folder.path.iterdir():
        p.unlink()
    folder.path.rmdir()
    folder.remove()
    assert capfd.readouterr().err == ""


def test_a_dead_run_is_reclaimed(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    rank = tmp_path / "nvme" / "rank0"
    run = dead_run(rank)
    reclaim_dead_runs(rank)
    assert not run.exists()
    assert f"by process {DEAD_PID}, which is gone" in capfd.readouterr().err


def test_only_what_tierzero_made_is_removed(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    rank = tmp_path / "nvme" / "rank0"
    run = dead_run(rank)
    (run / "notes.txt").write_text("mine")
    reclaim_dead_runs(rank)
    assert sorted(p.name for p in run.iterdir()) == ["notes.txt"]
    assert "holds files tierzero did not make: ['notes.txt']" in capfd.readouterr().err


@pytest.mark.parametrize("pid", [os.getpid(), "?", ""], ids=["live-pid", "not-a-pid", "empty"])
def test_a_lock_of_a_live_process_or_without_a_pid_is_left(tmp_path: Path, pid: int | str) -> None:
    rank = tmp_path / "nvme" / "rank0"
    run = dead_run(rank, pid=pid)
    reclaim_dead_runs(rank)
    assert (run / "swap0000.bin").exists() and (run / LOCK).exists()


def test_a_locked_run_is_left(tmp_path: Path) -> None:
    live = RunFolder(tmp_path / "nvme", 0)
    live.file(0).write_bytes(b"y")
    reclaim_dead_runs(live.path.parent)
    assert live.file(0).exists()
    live.remove()


def test_a_symlinked_rank_folder_is_not_followed(tmp_path: Path) -> None:
    """nvme_dir/rank0 -> elsewhere, whose run-* folder looks dead: it is not touched, and a run
    still starts (its own folder goes where the link points, and is removed again)."""
    elsewhere = tmp_path / "user-data"
    victim = dead_run(elsewhere)
    (tmp_path / "nvme").mkdir()
    (tmp_path / "nvme" / "rank0").symlink_to(elsewhere)
    reclaim_dead_runs(tmp_path / "nvme" / "rank0")
    folder = RunFolder(tmp_path / "nvme", 0)
    assert victim.exists() and len(list(victim.iterdir())) == 3
    folder.remove()
    assert victim.exists() and (tmp_path / "nvme" / "rank0").is_symlink()


def test_a_symlinked_run_folder_is_not_followed(tmp_path: Path) -> None:
    elsewhere = dead_run(tmp_path / "user-data")
    rank = tmp_path / "nvme" / "rank0"
    rank.mkdir(parents=True)
    (rank / "run-20260101-000000-2-cafecafe").symlink_to(elsewhere)
    folder = RunFolder(tmp_path / "nvme", 0)  # starts
    assert len(list(elsewhere.iterdir())) == 3
    folder.remove()
    assert (rank / "run-20260101-000000-2-cafecafe").is_symlink()


def test_a_symlinked_lock_or_swap_file_is_not_followed(tmp_path: Path) -> None:
    rank = tmp_path / "nvme" / "rank0"
    target = tmp_path / "precious.bin"
    target.write_bytes(b"keep")
    run = dead_run(rank, swap_files=0)
    (run / "swap0000.bin").symlink_to(target)
    reclaim_dead_runs(rank)
    assert target.read_bytes() == b"keep"
    linked = dead_run(tmp_path / "nvme" / "rank1", swap_files=1)
    (linked / LOCK).unlink()
    (linked / LOCK).symlink_to(target)
    reclaim_dead_runs(tmp_path / "nvme" / "rank1")
    assert (linked / "swap0000.bin").exists() and target.read_bytes() == b"keep"


FOREIGN = """
import os, sys
from pathlib import Path
from tierzero.placement.storage.swap_dirs import RunFolder  # before dropping privileges: root's files
if os.getuid() == 0:
    os.setgid(65534); os.setuid(65534)  # nobody
folder = RunFolder(Path(sys.argv[1]), 0)
folder.file(0).write_bytes(b"y")
folder.remove()
print("started")
"""


@pytest.fixture
def scratch() -> Iterator[Path]:
    """A shared scratch folder (1777) that another user can reach (pytest's tmp_path is 0700)."""
    path = Path(tempfile.mkdtemp(prefix="tierzero-scratch-"))
    path.chmod(0o1777)
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_another_users_run_folder_is_skipped(scratch: Path) -> None:
    """A shared scratch disk (1777): another user's folder that looks dead cannot be opened by
    this run; it is skipped and the run starts."""
    rank = scratch / "nvme" / "rank0"
    foreign = dead_run(rank)
    for p in (scratch / "nvme", rank):
        p.chmod(0o1777)
    foreign.chmod(0o700 if os.getuid() == 0 else 0o000)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run([sys.executable, "-c", FOREIGN, str(scratch / "nvme")], env=env, capture_output=True,
                          text=True, timeout=60)
    foreign.chmod(0o700)
    assert proc.returncode == 0 and "started" in proc.stdout, proc.stderr
    assert len(list(foreign.iterdir())) == 3


@pytest.mark.parametrize("make,match", [
    (lambda p: p.write_text("x"), "is a file, not a folder"),
    (lambda p: (p.parent / "f").write_text("x"), "is a file, not a folder"),
], ids=["nvme-dir-is-a-file", "parent-is-a-file"])
def test_nvme_dir_problems_say_what_is_wrong(tmp_path: Path, make, match: str) -> None:
    nvme = tmp_path / "nvme"
    make(nvme)
    target = nvme if nvme.exists() else tmp_path / "f" / "nvme"
    with pytest.raises(NotADirectoryError, match=match):
        check_nvme_dir(target)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        check_nvme_dir(tmp_path / "missing" / "nvme")


def test_roots_reclaimer_leaves_another_users_dead_run(tmp_path: Path) -> None:
    """Root opens any folder: a dead run's folder another user owns is still theirs to reclaim."""
    if os.geteuid() != 0:
        pytest.skip("a folder of another user needs root to make (chown)")
    rank = tmp_path / "nvme" / "rank0"
    foreign = dead_run(rank)
    for p in (foreign, *foreign.iterdir()):
        os.chown(p, 65534, 65534)
    reclaim_dead_runs(rank)
    assert len(list(foreign.iterdir())) == 3


def test_the_rank_folders_a_first_user_makes_are_usable_by_a_second(scratch: Path) -> None:
    """nvme_dir and rank0 made by this user's run (still running) on a shared scratch disk: a
    second user's run makes its own run folder there (second uid: nobody, in a child)."""
    if os.geteuid() != 0:
        pytest.skip("a second user needs root (os.setuid in a child process)")
    first = RunFolder(scratch / "nvme", 0)
    try:
        assert stat.S_IMODE((scratch / "nvme" / "rank0").stat().st_mode) == 0o1777
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        proc = subprocess.run([sys.executable, "-c", FOREIGN, str(scratch / "nvme")], env=env, capture_output=True,
                              text=True, timeout=60)
        assert proc.returncode == 0 and "started" in proc.stdout, proc.stderr
        assert first.path.is_dir() and stat.S_IMODE(first.path.stat().st_mode) == 0o700
    finally:
        first.remove()

"""The caches under the `tierzero` command are private to it, and a compile cache another user
could write is refused ([Note: private caches]). That a real run leaves nothing in /tmp or the
home folder: tests/cli/test_run_dir.py (its first run has its own)."""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path

import pytest

from tierzero.cli import train
from tierzero.cli.caches import CACHE_VARIABLES, PREFIX, check_compile_cache, private_caches

NOBODY = 65534


def test_the_command_keeps_its_caches_in_a_private_folder_it_removes(monkeypatch) -> None:
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    monkeypatch.setenv("MPLCONFIGDIR", "/the/users/own")
    with private_caches() as folder:
        assert folder.stat().st_mode & 0o777 == 0o700 and folder.stat().st_uid == os.geteuid()
        assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(folder / "torchinductor")
        assert os.environ["TRITON_CACHE_DIR"] == str(folder / "triton")
        assert os.environ["MPLCONFIGDIR"] == "/the/users/own"  # placed by the user: kept
    assert not folder.exists() and "TORCHINDUCTOR_CACHE_DIR" not in os.environ
    assert os.environ["MPLCONFIGDIR"] == "/the/users/own"


def test_a_killed_commands_folder_is_removed_by_the_next_and_nothing_else(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.Popen(["true"])
    gone.wait()  # its PID is free now: a command killed with SIGKILL leaves such a folder
    killed, live, other = (tmp_path / f"{PREFIX}ab-{gone.pid}", tmp_path / f"{PREFIX}cd-{os.getpid()}",
                           tmp_path / f"{PREFIX}ef-{gone.pid}")
    kept = [live, tmp_path / f"{PREFIX}link-{gone.pid}"]
    for folder in (killed, live):
        (folder / "torchinductor").mkdir(parents=True)
    kept[1].symlink_to(live)
    if os.geteuid() == 0:  # another user's folder (only root can make one): never ours to remove
        (other / "torchinductor").mkdir(parents=True)
        os.chown(other, NOBODY, NOBODY)
        kept.append(other)
    with private_caches() as folder:
        assert folder.name.startswith(PREFIX) and folder.name.endswith(f"-{os.getpid()}")
    assert not killed.exists()
    assert all(os.path.lexists(k) for k in kept) and live.is_dir()


def test_a_compile_cache_others_can_write_is_refused(tmp_path: Path, monkeypatch) -> None:
    cache = tmp_path / "torchinductor_me"
    cache.mkdir(mode=0o700)
    check_compile_cache(cache)  # private: used
    cache.chmod(0o777)  # as planted before the user's first run
    with pytest.raises(ValueError, match=r"writable by others than you \(mode 0777\)"):
        check_compile_cache(cache)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(cache))
    assert train.main(["--compile", "--steps", "1", "--run-dir", str(tmp_path / "run")]) == 2
    assert not (tmp_path / "run").exists()
    cache.chmod(0o700)
    os.symlink(cache, tmp_path / "link")
    with pytest.raises(ValueError, match="a symbolic link"):
        check_compile_cache(tmp_path / "link")
    if os.geteuid() == 0:  # another user's folder, even private, is theirs
        os.chown(cache, NOBODY, NOBODY)
        with pytest.raises(ValueError, match="owned by uid 65534"):
            check_compile_cache(cache)

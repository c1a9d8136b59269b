"""A model folder's file that is not one (a FIFO, a link to a device, unreadable) is named as
what it is, at once: never read (a FIFO would block), never "the folder has no model"."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from builders import REPO
from tierzero.formats import WeightSource, readable_file, verify_folder

NOBODY = 65534


def test_a_fifo_or_a_device_in_a_model_folder_is_named_as_such(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"model.safetensors' is a FIFO \(named pipe\), not a regular file"):
        WeightSource(tmp_path)
    os.unlink(tmp_path / "model.safetensors")
    os.symlink("/dev/urandom", tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"is a device file \(a link to '/dev/urandom'\)"):
        WeightSource(tmp_path)
    os.mkfifo(tmp_path / "config.json")
    pytest.importorskip("transformers")
    from tierzero.formats import meta_model, require_causal_lm

    with pytest.raises(ValueError, match=r"config.json' is a FIFO"):
        require_causal_lm(tmp_path)
    with pytest.raises(ValueError, match=r"config.json' is a FIFO"):
        meta_model(tmp_path)


def test_a_missing_file_is_still_missing_and_a_linked_file_is_read(tmp_path: Path) -> None:
    assert readable_file(tmp_path / "absent") is False
    (tmp_path / "real").write_text("x")
    os.symlink(tmp_path / "real", tmp_path / "link")
    assert readable_file(tmp_path / "link") is True
    os.symlink(tmp_path / "gone", tmp_path / "dangling")
    with pytest.raises(ValueError, match="which does not exist"):
        readable_file(tmp_path / "dangling")
    assert verify_folder(tmp_path) is False


def test_an_unreadable_file_is_named_for_another_user() -> None:
    """As uid 65534 (a second user), a model file only root may read is named as unreadable (the
    folder in the system's temporary folder: pytest's own is root's alone)."""
    if os.geteuid() != 0:
        pytest.skip("running as another user needs root")
    with tempfile.TemporaryDirectory() as tmp:
        tmp_path = Path(tmp)
        tmp_path.chmod(0o755)
        _unreadable_as_nobody(tmp_path)


def _unreadable_as_nobody(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 16)
    (tmp_path / "model.safetensors").chmod(0o600)
    code = ("import os\n"
            "from tierzero.formats import WeightSource\n"  # imported as root: Python's files may be root's alone
            "os.setgid(65534); os.setuid(65534)\n"
            f"WeightSource({str(tmp_path)!r})\n")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "model.safetensors' cannot be read by this user (mode 0600, owner uid 0)" in proc.stderr

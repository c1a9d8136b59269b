"""A single-file export (`tierzero export CKPT --to FILE.safetensors`) replaces only an earlier
export of its own, is private, names no path of this machine, and carries a checksum that
tz.load_safetensors and a --model folder's check verify (plain safetensors readers still load it).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import pytest
import torch

import tierzero as tz
from builders import gpt, tier_config
from tierzero.checkpoint import export_checkpoint
from tierzero.formats import verify_folder

NOBODY = 65534


@pytest.fixture
def ckpt(tmp_path: Path, wrapped) -> Path:
    model = wrapped(gpt(layers=2), tier_config(tier="host"))
    return tz.save_checkpoint(tmp_path / "ck", model)


def flip(path: Path, pos: int) -> None:
    raw = bytearray(path.read_bytes())
    raw[pos] ^= 0x01
    path.write_bytes(bytes(raw))


def test_an_existing_file_is_replaced_only_when_it_is_an_earlier_export(tmp_path: Path, ckpt: Path) -> None:
    notes = tmp_path / "notes.safetensors"
    notes.write_text("my notes")
    with pytest.raises(ValueError, match="is a safetensors file tierzero did not write|is not a safetensors file"):
        export_checkpoint(ckpt, notes)
    assert notes.read_text() == "my notes"
    theirs = tmp_path / "elsewhere.txt"
    theirs.write_text("theirs")
    os.symlink(theirs, tmp_path / "link.safetensors")
    with pytest.raises(ValueError, match="is a symbolic link"):
        export_checkpoint(ckpt, tmp_path / "link.safetensors")
    out = export_checkpoint(ckpt, tmp_path / "m.safetensors")
    assert export_checkpoint(ckpt, out) == out  # its own earlier export: replaced
    assert theirs.read_text() == "theirs" and sorted(os.listdir(tmp_path)) == [
        "ck", "elsewhere.txt", "link.safetensors", "m.safetensors", "notes.safetensors"]


def test_another_users_file_is_not_replaced_even_by_root(tmp_path: Path, ckpt: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("giving a file to another user needs root")
    out = export_checkpoint(ckpt, tmp_path / "m.safetensors")
    os.chown(out, NOBODY, NOBODY)  # an export, but another user's
    before = out.read_bytes()
    with pytest.raises(ValueError, match="owned by uid 65534"):
        export_checkpoint(ckpt, out)
    assert out.read_bytes() == before


def test_the_export_is_private_whatever_the_umask_and_names_no_path(tmp_path: Path, ckpt: Path) -> None:
    old = os.umask(0)
    try:
        out = export_checkpoint(ckpt, tmp_path / "m.safetensors")
    finally:
        os.umask(old)
    assert out.stat().st_mode & 0o777 == 0o600
    raw = out.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    meta = json.loads(raw[8:8 + n])["__metadata__"]
    assert meta["tierzero_checkpoint"] == ckpt.name and str(tmp_path).encode() not in raw[:8 + n]


def test_a_flipped_byte_fails_the_load_and_the_folder_check(tmp_path: Path, ckpt: Path) -> None:
    out = export_checkpoint(ckpt, tmp_path / "m.safetensors")
    want = tz.load_safetensors(out)
    safetensors_torch = pytest.importorskip("safetensors.torch")
    theirs = safetensors_torch.load_file(str(out))  # the metadata is plain strings to other readers
    assert all(torch.equal(theirs[k], want[k]) for k in want)
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(out.read_bytes())
    assert verify_folder(folder) is False  # no record; the file's own checksum holds
    flip(out, out.stat().st_size - 3)  # a byte of the last tensor
    with pytest.raises(ValueError, match=r"m.safetensors' is corrupt"):
        tz.load_safetensors(out)
    flip(folder / "model.safetensors", 8 + 40)  # a byte of the header (a name, a shape, an offset)
    with pytest.raises(ValueError, match=r"model.safetensors' is (corrupt|not a safetensors file)"):
        verify_folder(folder)

"""The checksum record of a model folder tierzero writes: `tierzero.checksums.json`, the size and
xxh3-128 of every file the save wrote (config files, shards, index), beside them.

transformers ignores the file, so the folder loads as before; `tz.from_pretrained` (and
`tierzero train --model FOLDER`) verify every listed file before building anything, and a
flipped byte anywhere, in a weight, a header, the index or a config, is an error naming the
file. Files added to the folder later (a tokenizer, a README) are not listed and not checked.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import xxhash

from tierzero.formats.files import readable_file
from tierzero.formats.safetensors_file import verify_safetensors

RECORD = "tierzero.checksums.json"
_ALGORITHM = "xxh3_128"
_CHUNK = 8 << 20


def file_digest(path: Path) -> tuple[int, str]:
    """The size and xxh3-128 (hex) of a file, read in chunks."""
    h = xxhash.xxh3_128()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def record_text(folder: Path) -> str:
    """The record of every regular file in `folder` (not the record itself, nor hidden files)."""
    files = {}
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name == RECORD or entry.name.startswith(".") or not entry.is_file(follow_symlinks=False):
            continue
        size, digest = file_digest(Path(entry.path))
        files[entry.name] = {"bytes": size, _ALGORITHM: digest}
    return json.dumps({"format": "tierzero.checksums/1", "algorithm": _ALGORITHM, "files": files}, indent=1) + "\n"


def verify_folder(folder: str | os.PathLike[str]) -> bool:
    """Check every file the folder's record lists (size and checksum), and every other
    .safetensors file that carries its own checksum (a single-file export copied in: [Note: a
    checksum inside a safetensors file]); ValueError naming the first that differs or is missing.
    False when the folder has no record."""
    folder = Path(folder)
    if not folder.is_dir():
        return False  # the caller names a folder that is not one
    record_path = folder / RECORD
    recorded = readable_file(record_path)
    listed = _verify_record(folder, record_path) if recorded else {}
    for entry in sorted(os.scandir(folder), key=lambda e: e.name):
        if entry.name.endswith(".safetensors") and entry.name not in listed and readable_file(entry.path):
            verify_safetensors(entry.path)
    return recorded


def _verify_record(folder: Path, record_path: Path) -> dict:
    """The files the record lists, each checked."""
    try:
        record = json.loads(record_path.read_text(encoding="utf-8"))
        files = record["files"]
        if record.get("algorithm") != _ALGORITHM or not isinstance(files, dict):
            raise ValueError(f"algorithm {record.get('algorithm')!r}")
    except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
        raise ValueError(f"{str(record_path)!r} is not a tierzero checksum record ({e}); it was damaged: restore the "
                         "folder from a copy, or delete the record to load it unchecked") from None
    for name, expected in files.items():
        path = folder / name
        if not readable_file(path):
            raise ValueError(f"{str(path)!r} is missing: {RECORD} lists it ({expected.get('bytes')} bytes); restore "
                             "the folder from a copy")
        size, digest = file_digest(path)
        if size != expected.get("bytes") or digest != expected.get(_ALGORITHM):
            raise ValueError(f"{str(path)!r} is corrupt: its {size} bytes do not match {RECORD} "
                             f"({expected.get('bytes')} bytes, {_ALGORITHM} {expected.get(_ALGORITHM)}, read "
                             f"{digest}); restore the folder from a copy (or, to load it anyway, delete {RECORD})")
    return files

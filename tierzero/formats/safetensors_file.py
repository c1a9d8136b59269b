"""The safetensors file format, written by tierzero itself (tierzero/formats/weights.py reads it with the
`safetensors` library).

A file is: 8 bytes little-endian u64 N, then N bytes of JSON header
{"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ..., "__metadata__": {..}}
(offsets relative to the byte after the header, tensors packed in header order), then the raw
little-endian bytes. Any reader of the format (the `safetensors` package, transformers) loads
what `write_safetensors` writes. Writing streams one tensor at a time into a private temporary
file that is fsynced and renamed into place (never more than one tensor in memory, never a half
file under the name). A checksum in the metadata: [Note: a checksum inside a safetensors file].
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

import numpy as np
import torch
import xxhash

from io_engine import file_mode, not_own

DTYPES: dict[torch.dtype, str] = {
    torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
    torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
    torch.bool: "BOOL",
}


class TensorSpec(NamedTuple):
    """One tensor of a file to write: its bytes come from `produce()` when its turn comes."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    produce: Callable[[], torch.Tensor]


def dtype_name(dtype: torch.dtype, *, what: str) -> str:
    name = DTYPES.get(dtype)
    if name is None:
        raise ValueError(f"{what}: dtype {dtype} has no safetensors name; supported: "
                         f"{sorted(str(d) for d in DTYPES)}")
    return name


# [Note: a checksum inside a safetensors file]
# A single .safetensors file has no folder to hold a checksum record beside it, so it carries
# its own: the metadata key CHECKSUM_KEY holds "xxh3_128:<32 hex>" of the header's tensor entries
# (canonical JSON: sorted keys, no spaces, metadata left out) followed by every byte after the
# header. The writer puts 32 zeros there, hashes the entries and the data as it streams them, and
# writes the digest over the zeros before the file is fsynced and renamed into place. Plain
# readers see one more metadata string; `verify_safetensors` (tz.load_safetensors, and every
# safetensors file of a --model folder that its checksum record does not list) recomputes it, so
# a flipped byte in a weight or a shape is an error naming the file. The key also marks the file
# as tierzero's: an export replaces an existing file only when it carries the key.
CHECKSUM_KEY = "tierzero_checksum"
_ALGORITHM = "xxh3_128:"
_ZEROS = "0" * 32


def _canonical(entries: dict[str, object]) -> bytes:
    return json.dumps(entries, sort_keys=True, separators=(",", ":")).encode()


def write_safetensors(path: str | os.PathLike[str], specs: Iterable[TensorSpec],
                      metadata: dict[str, str] | None = None, *, checksum: bool = False,
                      private: bool = True) -> Path:
    """Write the tensors of `specs` in order, producing one at a time (never all in memory),
    under a temporary name (0600, or 0666 less the umask when not `private`) renamed into place;
    `checksum`: with its checksum in the metadata ([Note: a checksum inside a safetensors file])."""
    path = Path(path)
    specs = list(specs)
    header: dict[str, object] = {}
    offset = 0
    for spec in specs:
        if spec.name in header or spec.name == "__metadata__":
            raise ValueError(f"write_safetensors({str(path)!r}): duplicate or reserved tensor name {spec.name!r}")
        nbytes = int(np.prod(spec.shape, dtype=np.int64)) * spec.dtype.itemsize
        header[spec.name] = {"dtype": dtype_name(spec.dtype, what=spec.name), "shape": list(spec.shape),
                             "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    hasher = xxhash.xxh3_128(_canonical(header)) if checksum else None
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    if checksum:
        meta[CHECKSUM_KEY] = _ALGORITHM + _ZEROS
    if meta:
        header["__metadata__"] = meta
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as the reference writer does
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)  # a killed export's, or a planted link: removed, never followed
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, file_mode(private))
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for spec in specs:
                t = spec.produce().detach().to("cpu").contiguous()
                if tuple(t.shape) != tuple(spec.shape) or t.dtype != spec.dtype:
                    raise ValueError(f"write_safetensors: tensor {spec.name!r} was declared {spec.dtype} "
                                     f"{tuple(spec.shape)} but produced {t.dtype} {tuple(t.shape)}")
                if t.numel():
                    data = t.reshape(-1).view(torch.uint8).numpy()
                    f.write(data)
                    if hasher is not None:
                        hasher.update(data)
                del t  # the caller may free this tensor's source before producing the next one
            if hasher is not None:
                f.flush()
                at = 8 + blob.index((_ALGORITHM + _ZEROS).encode()) + len(_ALGORITHM)
                os.pwrite(f.fileno(), hasher.hexdigest().encode(), at)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def read_metadata(path: str | os.PathLike[str]) -> dict[str, str]:
    """The `__metadata__` of a safetensors file (empty when it has none); ValueError naming the
    file when it is not one."""
    with open(path, "rb") as f:
        return _read_raw_header(f, path)[1].get("__metadata__") or {}


def verify_safetensors(path: str | os.PathLike[str]) -> bool:
    """Check the checksum a safetensors file carries ([Note: a checksum inside a safetensors
    file]); ValueError naming the file when it differs. False when it carries none."""
    with open(path, "rb") as f:
        start, header = _read_raw_header(f, path)
        recorded = (header.pop("__metadata__", None) or {}).get(CHECKSUM_KEY)
        if recorded is None:
            return False
        hasher = xxhash.xxh3_128(_canonical(header))
        f.seek(start)
        while chunk := f.read(8 << 20):
            hasher.update(chunk)
    got = _ALGORITHM + hasher.hexdigest()
    if got != recorded:
        raise ValueError(f"{str(path)!r} is corrupt: its tensors and data hash to {got}, its metadata records "
                         f"{recorded} ({CHECKSUM_KEY}); a byte was changed after tierzero wrote it: restore the file "
                         "from a copy or export it again")
    return True


def check_file_target(path: str | os.PathLike[str], *, what: str = "export") -> Path:
    """`path` if a .safetensors file may be written there: nothing there yet, or an earlier
    export of this user's (a regular file carrying tierzero's metadata); ValueError otherwise:
    an export replaces only its own earlier file."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    why = not_own(st, folder=False)
    if not why:
        try:
            meta = read_metadata(path)
        except (OSError, ValueError) as e:
            meta, why = {}, f"not a safetensors file ({e})"
        if not why and CHECKSUM_KEY not in meta and "tierzero_checkpoint" not in meta:
            why = "a safetensors file tierzero did not write"
    if why:
        raise ValueError(f"{what}: {str(path)!r} exists and is {why}; an export replaces only an earlier export of "
                         "its own: give a new file name, or move that file away")
    return path


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike[str],
                     metadata: dict[str, str] | None = None) -> Path:
    """Write a state dict (e.g. tz.full_state_dict(model)) as a safetensors file (0600, with its
    checksum: tz.load_safetensors verifies it)."""
    specs = [TensorSpec(k, tuple(v.shape), v.dtype, lambda v=v: v) for k, v in tensors.items()]
    return write_safetensors(path, specs, metadata, checksum=True)


def _read_raw_header(f, path: str | os.PathLike[str]) -> tuple[int, dict]:
    """(file offset of the data, the whole header, metadata included) from the open file `f`."""
    head = f.read(8)
    size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
    try:
        if size < 2 or size > os.fstat(f.fileno()).st_size - 8:
            raise ValueError(f"a header of {size} bytes")
        header = json.loads(f.read(size))
        if not isinstance(header, dict):
            raise ValueError("a header that is not a JSON object")
    except ValueError as e:
        raise ValueError(f"{str(path)!r} is not a safetensors file ({e}); give a file written by "
                         "save_file / save_pretrained") from None
    return 8 + size, header


def read_header(path: str | os.PathLike[str]) -> tuple[int, dict[str, dict]]:
    """(file offset of the data, the header's tensor entries) of a safetensors file: a tensor's
    bytes are [start + begin, start + end) of the file for its "data_offsets" [begin, end].
    ValueError naming the file when the header is not one."""
    with open(path, "rb") as f:
        start, header = _read_raw_header(f, path)
    header.pop("__metadata__", None)
    return start, header


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or a new file in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

"""The safetensors file format, written by tierzero itself (tierzero/formats/weights.py reads it with the
`safetensors` library).

A file is: 8 bytes little-endian u64 N, then N bytes of JSON header
{"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ..., "__metadata__": {..}}
(offsets relative to the byte after the header, tensors packed in header order), then the raw
little-endian bytes. Any reader of the format (the `safetensors` package, transformers) loads
what `write_safetensors` writes. Writing streams one tensor at a time into a temporary file that
is fsynced and renamed into place, so a crash never leaves a half-written file under the name,
and never holds more than one tensor in memory (the library's save_file takes them all at once).
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path
from typing import Callable, Iterable, NamedTuple

import numpy as np
import torch

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


def write_safetensors(path: str | os.PathLike[str], specs: Iterable[TensorSpec],
                      metadata: dict[str, str] | None = None) -> Path:
    """Write the tensors of `specs` in order, producing one at a time (never all in memory)."""
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
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as the reference writer does
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
            for spec in specs:
                t = spec.produce().detach().to("cpu").contiguous()
                if tuple(t.shape) != tuple(spec.shape) or t.dtype != spec.dtype:
                    raise ValueError(f"write_safetensors: tensor {spec.name!r} was declared {spec.dtype} "
                                     f"{tuple(spec.shape)} but produced {t.dtype} {tuple(t.shape)}")
                if t.numel():
                    f.write(t.reshape(-1).view(torch.uint8).numpy())
                del t  # the caller may free this tensor's source before producing the next one
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


def save_safetensors(tensors: dict[str, torch.Tensor], path: str | os.PathLike[str],
                     metadata: dict[str, str] | None = None) -> Path:
    """Write a state dict (e.g. tz.full_state_dict(model)) as a safetensors file."""
    specs = [TensorSpec(k, tuple(v.shape), v.dtype, lambda v=v: v) for k, v in tensors.items()]
    return write_safetensors(path, specs, metadata)


def read_header(path: str | os.PathLike[str]) -> tuple[int, dict[str, dict]]:
    """(file offset of the data, the header's tensor entries) of a safetensors file: a tensor's
    bytes are [start + begin, start + end) of the file for its "data_offsets" [begin, end].
    ValueError naming the file when the header is not one."""
    with open(path, "rb") as f:
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
    header.pop("__metadata__", None)
    return 8 + size, header


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Make a rename or a new file in `path` durable."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

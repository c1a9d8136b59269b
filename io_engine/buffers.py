"""Caller buffers as flat byte views, and page-aligned numpy buffers for O_DIRECT."""

from __future__ import annotations

import numpy as np

PAGE = 4096
"""Alignment (bytes) of O_DIRECT offsets, lengths and memory used by io_engine."""


def aligned_empty(nbytes: int, alignment: int = PAGE) -> np.ndarray:
    """An uninitialised 1-D numpy uint8 array of `nbytes` whose data starts on an `alignment`
    boundary (a power of two), so O_DIRECT can transfer straight into it."""
    if not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"aligned_empty: expected nbytes as an int >= 0, got {nbytes!r}")
    if alignment < 1 or alignment & (alignment - 1):
        raise ValueError(f"aligned_empty: expected alignment as a power of two, got {alignment!r}")
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = -raw.ctypes.data % alignment
    # The slice keeps `raw` alive through its .base.
    return raw[start: start + nbytes]


def byte_view(buf, *, writable: bool) -> np.ndarray:
    """A flat uint8 numpy view sharing `buf`'s memory (no copy).

    Raises TypeError for objects without the buffer protocol, ValueError for non-contiguous
    buffers and for read-only buffers when `writable`.
    """
    if isinstance(buf, np.ndarray) and buf.dtype == np.uint8 and buf.ndim == 1 and buf.flags.c_contiguous:
        arr = buf
    else:
        try:
            arr = np.frombuffer(buf, dtype=np.uint8)
        except TypeError:
            raise TypeError(
                f"io_engine: expected a buffer-protocol object (numpy array, memoryview, bytearray, "
                f"mmap), got {type(buf).__name__}; for a CPU torch tensor pass `t.numpy()` or "
                f"`t.view(torch.uint8).numpy()`") from None
        except ValueError as e:
            raise ValueError(f"io_engine: the buffer must be C-contiguous ({e}); pass a contiguous "
                             f"copy or a contiguous slice") from None
    if writable and not arr.flags.writeable:
        raise ValueError(f"io_engine: pread needs a writable buffer, got a read-only "
                         f"{type(buf).__name__} of {arr.nbytes} bytes")
    return arr

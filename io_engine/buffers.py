"""Page-aligned numpy buffers for O_DIRECT."""

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

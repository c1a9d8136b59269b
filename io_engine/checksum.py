"""xxh3_64 checksums of buffers: one digest for a whole buffer, also computed piece by piece."""

from __future__ import annotations

import xxhash

from .buffers import byte_view


def checksum(buf) -> int:
    """xxh3_64 of the buffer's bytes (any C-contiguous buffer-protocol object), as an int.

    Equal to `IOFuture.checksum` of a `pread`/`pwrite` of the same bytes with checksum=True.
    """
    return xxhash.xxh3_64_intdigest(byte_view(buf, writable=False))


def new_hasher() -> "xxhash.xxh3_64":
    """A streaming xxh3_64 state: update() over consecutive pieces gives `checksum` of the whole."""
    return xxhash.xxh3_64()

"""asyncio-side file metadata helpers (aiofiles runs the blocking calls off the event loop).

Tensor bytes never go through aiofiles (it copies into Python bytes); they go through
IOEngine.pread/pwrite, whose futures are awaitable directly.
"""

from __future__ import annotations

import os

import aiofiles.os

from .files import PreallocatedFile


async def file_size(path: str | os.PathLike[str]) -> int:
    """Size of the file in bytes."""
    return (await aiofiles.os.stat(path)).st_size


async def make_dirs(path: str | os.PathLike[str]) -> None:
    """mkdir -p."""
    await aiofiles.os.makedirs(path, exist_ok=True)


async def remove(path: str | os.PathLike[str], *, missing_ok: bool = True) -> None:
    """Remove a file (no error if it is already gone and `missing_ok`)."""
    try:
        await aiofiles.os.remove(path)
    except FileNotFoundError:
        if not missing_ok:
            raise


async def preallocate(path: str | os.PathLike[str], nbytes: int, **kwargs) -> PreallocatedFile:
    """PreallocatedFile(path, nbytes, **kwargs) created in a thread: posix_fallocate of a large
    file can take a while and must not stall the loop."""
    return await aiofiles.os.wrap(PreallocatedFile)(path, nbytes, **kwargs)

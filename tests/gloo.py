"""A gloo world of N ranks for tests: spawned processes, a file rendezvous, a timeout so that a
rank that dies makes the others fail instead of hang."""

from __future__ import annotations

import contextlib
import datetime
from pathlib import Path
from typing import Any, Callable, Iterator

import torch.distributed as dist
import torch.multiprocessing as mp

TIMEOUT_S = 60


@contextlib.contextmanager
def gloo_group(rank: int, world_size: int, init_file: str | Path) -> Iterator[None]:
    """This process as `rank` of a gloo group of `world_size` (none at world size 1)."""
    if world_size == 1:
        yield
        return
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=TIMEOUT_S))
    try:
        yield
    finally:
        dist.destroy_process_group()


def _rank_main(rank: int, fn: Callable[..., None], world_size: int, init_file: str, args: tuple[Any, ...]) -> None:
    with gloo_group(rank, world_size, init_file):
        fn(rank, world_size, *args)


def run_ranks(fn: Callable[..., None], world_size: int, init_file: str | Path, *args: Any) -> None:
    """Run `fn(rank, world_size, *args)` on `world_size` spawned processes in one gloo group
    (`fn` a module-level function; its errors fail the caller). World size 1 runs in this
    process, without a group."""
    if world_size == 1:
        fn(0, 1, *args)
        return
    mp.start_processes(_rank_main, args=(fn, world_size, str(init_file), args), nprocs=world_size,
                       start_method="spawn")

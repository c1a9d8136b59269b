"""The collectives over flat tensors: plain module-level functions (tests patch them), the one
place tierzero calls torch.distributed.

Every tensor given to a collective must be device memory (NCCL refuses host tensors; the
stream stand-in checks it on the CPU: `CopyStreams.check_collective`), and the buffers they
make are made there. Every all-gather, reduce-scatter and all-reduce adds to a `CommBytes` the
bytes of the buffer it covers: the gathered output, the reduced input (the unit of the ZeRO paper's traffic model,
where gathering or reduce-scattering Ψ elements costs Ψ; on a ring each rank sends (N - 1) / N
of that, and 2 (N - 1) / N for an all-reduce). At world size 1 they copy nothing and send
nothing, so the single-process path is the same code as the distributed one. A failed
collective is re-raised as a `RankRuntimeError` naming this rank (`rank_errors`).
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch
import torch.distributed as dist

from tierzero.layout import CommBytes, FlatLayout
from tierzero.placement import CopyStreams


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def world(process_group: dist.ProcessGroup | None) -> tuple[int, int]:
    """(rank, world size) of `process_group`, or of the default group when torch.distributed is
    initialised; (0, 1) otherwise."""
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError("process_group given but torch.distributed is not initialised; call "
                             "torch.distributed.init_process_group() first or pass process_group=None")
        return 0, 1
    return dist.get_rank(process_group), dist.get_world_size(process_group)


def _all_gather(out: torch.Tensor, inp: torch.Tensor, group: Any, async_op: bool) -> Any:
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, inp, group=group, async_op=async_op)


def _reduce_scatter(out: torch.Tensor, inp: torch.Tensor, group: Any) -> None:
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    fn(out, inp, op=dist.ReduceOp.SUM, group=group)


def _on_device(streams: CopyStreams, what: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        streams.check_collective(t, what)


def start_all_gather(shard: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None,
                     comm: CommBytes, streams: CopyStreams) -> Any:
    """Start gathering every rank's `shard` into `full`; returns the collective's work handle
    (wait() on it before reading `full`). Only called with world size > 1."""
    _on_device(streams, "an all-gather", shard, full)
    comm.all_gather += _nbytes(full)
    return _all_gather(full, shard, group, async_op=True)


class RankRuntimeError(RuntimeError):
    """A failure on one rank of a distributed run; the message starts with "rank N: ". (The name
    ends in RuntimeError so that logs still read "...RuntimeError: rank N: ...".)"""

    def __init__(self, rank: int, message: str) -> None:
        super().__init__(f"rank {rank}: {message}")
        self.rank = rank
        self.message = message

    def __reduce__(self) -> tuple:
        return type(self), (self.rank, self.message)


@contextlib.contextmanager
def rank_errors(rank: int, world_size: int, what: str) -> Iterator[None]:
    """Re-raise a failed collective as a RankRuntimeError of this rank, saying why it may have
    failed (another rank raised or died, or the collective timed out)."""
    try:
        yield
    except RuntimeError as e:
        if world_size == 1 or isinstance(e, RankRuntimeError):
            raise
        raise RankRuntimeError(
            rank, f"{what} failed: {type(e).__name__}: {e}. Another rank probably raised or "
            "was killed, or a collective waited longer than collective_timeout_s (the timeout "
            "given to torch.distributed.init_process_group)") from e


def all_gather_flat(shard: torch.Tensor, layout: FlatLayout, group: dist.ProcessGroup | None,
                    comm: CommBytes, streams: CopyStreams, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The full flat buffer from every rank's shard, new or in `out` (world 1: the shard
    itself, no copy)."""
    if layout.world_size == 1:
        return shard
    full = streams.empty(layout.padded_numel, shard.dtype) if out is None else out
    _on_device(streams, "an all-gather", shard, full)
    comm.all_gather += _nbytes(full)
    _all_gather(full, shard, group, async_op=False)
    return full


def reduce_scatter_flat(full: torch.Tensor, layout: FlatLayout, group: dist.ProcessGroup | None,
                        comm: CommBytes, streams: CopyStreams) -> torch.Tensor:
    """This rank's shard of the mean of every rank's full flat buffer (world 1: `full` itself)."""
    if layout.world_size == 1:
        return full
    shard = streams.empty(layout.shard_numel, full.dtype)
    _on_device(streams, "a reduce-scatter", full, shard)
    comm.reduce_scatter += _nbytes(full)
    _reduce_scatter(shard, full, group)
    return shard.div_(layout.world_size)


def all_reduce_flat(full: torch.Tensor, layout: FlatLayout, group: dist.ProcessGroup | None,
                    comm: CommBytes, streams: CopyStreams) -> torch.Tensor:
    """The mean of every rank's full flat buffer, in place (world 1: `full` itself)."""
    if layout.world_size == 1:
        return full
    return all_reduce_(full, group, layout.world_size, streams, comm=comm).div_(layout.world_size)


def all_reduce_(t: torch.Tensor, group: dist.ProcessGroup | None, world_size: int, streams: CopyStreams, *,
                op: str = "sum", comm: CommBytes | None = None) -> torch.Tensor:
    """`t` reduced over the ranks in place (sum or max); world 1: unchanged."""
    if world_size > 1:
        _on_device(streams, "an all-reduce", t)
        if comm is not None:
            comm.all_reduce += _nbytes(t)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return t


def broadcast_from_first_(t: torch.Tensor, group: dist.ProcessGroup | None, world_size: int,
                          streams: CopyStreams) -> torch.Tensor:
    """`t` overwritten in place with the group's first rank's values; world 1: unchanged."""
    if world_size > 1:
        _on_device(streams, "a broadcast", t)
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast(t, src=src, group=group)
    return t

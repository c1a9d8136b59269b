"""The collectives over flat tensors: plain module-level functions (tests patch them), the one
place tierzero calls torch.distributed.

Every tensor given to a collective must be device memory (NCCL refuses host tensors; the
stream stand-in checks it on the CPU: `DeviceCopies.check_collective`), and the buffers they
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
from tierzero.placement import DeviceCopies


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


def _on_device(streams: DeviceCopies, what: str, *tensors: torch.Tensor) -> None:
    for t in tensors:
        streams.check_collective(t, what)


def start_all_gather(shard: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None,
                     comm: CommBytes, streams: DeviceCopies) -> Any:
    """Start gathering every rank's `shard` into `full`; returns the collective's work handle
    (wait() on it before reading `full`). Only called with world size > 1."""
    _on_device(streams, "an all-gather", shard, full)
    comm.all_gather += _nbytes(full)
    return _all_gather(full, shard, group, async_op=True)


# [Note: gathers ahead agreed across ranks]
# Which all-gathers a rank starts ahead is the prefetch policy's choice, and its inputs are the
# rank's own: "adaptive" plans from the times this rank measured, a block whose overlapped update
# is still running on this rank is skipped, and the device room counts packs still on their way.
# Two ranks could then start different all-gathers at the same fetch: the collectives came in
# another order on each, and training hung (seen with 2 ranks, stage 3, the asynchronous stream
# stand-in and params split across device and host; latent without a split: any rank-dependent
# choice does it, tests/runtime/test_gather_agreement.py). So every fetch that follows the trace
# agrees the choice before any all-gather starts: each rank's choice (blocks to gather ahead,
# gathers started earlier to keep) as 0/1 flags in one fixed order, all-reduced with MIN over a
# gloo group of the same ranks kept for this (CPU tensors; a group apart from the data's, so the
# agreement never waits behind the all-gathers in flight on it). A block is gathered ahead, and
# a gather kept, only where every rank chose it; the ones agreed start in trace order. The cost:
# one small CPU all-reduce per block fetch at stage 3 across ranks, where the fetch already
# waits on a collective of the same ranks.
_agreement_groups: dict[Any, Any] = {}


def agreement_group(group: dist.ProcessGroup | None) -> Any:
    """The gloo group over the ranks of `group` that agrees choices (see [Note: gathers ahead
    agreed across ranks]); made once per group, by every rank of it at the same point (wrap)."""
    key = group if group is not None else dist.group.WORLD
    if key not in _agreement_groups:
        ranks = dist.get_process_group_ranks(key)
        _agreement_groups[key] = dist.new_group(ranks, backend="gloo", timeout=_timeout_of(key),
                                                use_local_synchronization=True)
    return _agreement_groups[key]


def _timeout_of(group: Any) -> Any:
    """The collective timeout `group` was made with (so a lost rank ends the agreement's wait as
    soon as the data's); None (torch's default) where the backend does not say."""
    for device in ("cuda", "cpu"):
        with contextlib.suppress(Exception):
            return group._get_backend(torch.device(device)).options._timeout
    return None


def agree_all(flags: list[bool], group: Any) -> list[bool]:
    """Each flag true only where it is true on every rank of `group` (an agreement group); the
    same list on every rank. Every rank must call it with as many flags, at the same point."""
    t = torch.tensor([int(f) for f in flags] or [0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return [bool(v) for v in t.tolist()[:len(flags)]]


def broadcast_object(obj: Any, group: Any, world_size: int) -> Any:
    """Rank 0's `obj` on every rank of `group` (pickled; for small records, never tensors' data)."""
    if world_size == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def all_gather_objects(obj: Any, group: Any, world_size: int) -> list[Any]:
    """Every rank's `obj`, in rank order, on every rank of `group` (pickled; small records)."""
    if world_size == 1:
        return [obj]
    out: list[Any] = [None] * world_size
    dist.all_gather_object(out, obj, group=group)
    return out


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
                    comm: CommBytes, streams: DeviceCopies, *, out: torch.Tensor | None = None) -> torch.Tensor:
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
                        comm: CommBytes, streams: DeviceCopies) -> torch.Tensor:
    """This rank's shard of the mean of every rank's full flat buffer (world 1: `full` itself)."""
    if layout.world_size == 1:
        return full
    shard = streams.empty(layout.shard_numel, full.dtype)
    _on_device(streams, "a reduce-scatter", full, shard)
    comm.reduce_scatter += _nbytes(full)
    _reduce_scatter(shard, full, group)
    return shard.div_(layout.world_size)


def all_reduce_flat(full: torch.Tensor, layout: FlatLayout, group: dist.ProcessGroup | None,
                    comm: CommBytes, streams: DeviceCopies) -> torch.Tensor:
    """The mean of every rank's full flat buffer, in place (world 1: `full` itself)."""
    if layout.world_size == 1:
        return full
    return all_reduce_(full, group, layout.world_size, streams, comm=comm).div_(layout.world_size)


def all_reduce_(t: torch.Tensor, group: dist.ProcessGroup | None, world_size: int, streams: DeviceCopies, *,
                op: str = "sum", comm: CommBytes | None = None) -> torch.Tensor:
    """`t` reduced over the ranks in place (sum or max); world 1: unchanged."""
    if world_size > 1:
        _on_device(streams, "an all-reduce", t)
        if comm is not None:
            comm.all_reduce += _nbytes(t)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return t


def broadcast_from_first_(t: torch.Tensor, group: dist.ProcessGroup | None, world_size: int,
                          streams: DeviceCopies) -> torch.Tensor:
    """`t` overwritten in place with the group's first rank's values; world 1: unchanged."""
    if world_size > 1:
        _on_device(streams, "a broadcast", t)
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast(t, src=src, group=group)
    return t

"""Flat parameters and their shards: the layout ZeRO splits across data-parallel ranks.

A block's parameters are concatenated, in a fixed order, into one flat 1-D buffer padded to a
multiple of the world size; rank r owns the contiguous shard [r * n / world, (r + 1) * n / world)
of it, and the gradient, master weights and optimizer moments share that layout (which of them
a rank keeps whole instead is the ZeRO stage's choice: `ZeroStage`). With world size 1 the shard
is the whole buffer and the collectives below copy nothing and send nothing, so the
single-process path is the same code as the distributed one.

Every all-gather, reduce-scatter and all-reduce below adds to a `CommBytes` the bytes of the
buffer it covers: the gathered output, the reduced input (the unit of the ZeRO paper's traffic
model, where gathering or reduce-scattering Ψ elements costs Ψ; on a ring each rank sends
(N - 1) / N of that, and 2 (N - 1) / N for an all-reduce).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple, Sequence

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ZeroStage:
    """Which of a flat tensor's states each rank keeps whole rather than as its shard."""

    stage: int
    """1, 2 or 3 (Config.zero_stage)."""
    world_size: int

    @property
    def params_whole(self) -> bool:
        """Every rank keeps the full compute-dtype parameters (stages 1 and 2): blocks are
        fetched without an all-gather, and updated shards are all-gathered after the step."""
        return self.stage < 3 and self.world_size > 1

    @property
    def grads_whole(self) -> bool:
        """Every rank keeps the full gradient, all-reduced (stage 1), instead of its shard."""
        return self.stage == 1 and self.world_size > 1

    @property
    def gathers(self) -> bool:
        """Fetching a block all-gathers it from every rank's shard (stage 3 across ranks)."""
        return self.stage == 3 and self.world_size > 1


@dataclass
class CommBytes:
    """Bytes of the buffers this rank's collectives covered (module docstring), by kind."""

    all_gather: int = 0
    reduce_scatter: int = 0
    all_reduce: int = 0

    def take(self) -> "CommBytes":
        """The counts so far; the counters start again from zero."""
        out = CommBytes(self.all_gather, self.reduce_scatter, self.all_reduce)
        self.all_gather = self.reduce_scatter = self.all_reduce = 0
        return out

    @property
    def total(self) -> int:
        return self.all_gather + self.reduce_scatter + self.all_reduce

    def as_dict(self) -> dict[str, int]:
        """For metrics.jsonl and JSON output."""
        return {"all_gather": self.all_gather, "reduce_scatter": self.reduce_scatter, "all_reduce": self.all_reduce}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class ParamSlot(NamedTuple):
    """Where one parameter lies in its flat buffer."""

    fqn: str
    shape: torch.Size
    offset: int
    numel: int


ALIGN_BYTES = 64
"""Each parameter starts at a multiple of this many bytes of its flat buffer, as torch's own
allocations do: CPU kernels take the same vectorised paths on a view as on a lone tensor, so a
wrapped model computes the very same bits as the unwrapped one."""


@dataclass(frozen=True)
class FlatLayout:
    """Parameters packed in order, each starting on an ALIGN_BYTES boundary, then zero padding
    up to a multiple of `world_size`."""

    slots: tuple[ParamSlot, ...]
    numel: int
    """Elements up to the end of the last parameter."""
    padded_numel: int
    """Elements of the flat buffer (a multiple of world_size)."""
    world_size: int

    @classmethod
    def build(cls, fqns: Sequence[str], shapes: Sequence[torch.Size], world_size: int = 1, *,
              itemsize: int = 4) -> "FlatLayout":
        """`itemsize`: bytes per element of the smallest dtype the layout is used with."""
        if world_size < 1:
            raise ValueError(f"world_size: expected >= 1, got {world_size}")
        align = max(1, ALIGN_BYTES // itemsize)
        slots, offset = [], 0
        for fqn, shape in zip(fqns, shapes, strict=True):
            offset = -(-offset // align) * align
            n = torch.Size(shape).numel()
            slots.append(ParamSlot(fqn, torch.Size(shape), offset, n))
            offset += n
        padded = -(-max(offset, 1) // (world_size * align)) * world_size * align
        return cls(tuple(slots), offset, padded, world_size)

    @property
    def shard_numel(self) -> int:
        return self.padded_numel // self.world_size

    def shard_range(self, rank: int) -> tuple[int, int]:
        """[start, end) of the flat buffer owned by `rank`."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range for world size {self.world_size}")
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One view of `flat` per parameter, with the parameter's shape."""
        assert flat.numel() == self.padded_numel, (flat.numel(), self.padded_numel)
        return [flat[s.offset:s.offset + s.numel].view(s.shape) for s in self.slots]

    def gaps(self) -> list[tuple[int, int]]:
        """[start, end) ranges of the flat buffer that no parameter covers (alignment, padding)."""
        out, end = [], 0
        for slot in self.slots:
            if slot.offset > end:
                out.append((end, slot.offset))
            end = slot.offset + slot.numel
        if self.padded_numel > end:
            out.append((end, self.padded_numel))
        return out

    def flatten(self, tensors: Sequence[torch.Tensor | None], *, dtype: torch.dtype,
                device: torch.device | str | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
        """A flat buffer holding `tensors` (None: zeros), cast to `dtype`, padding zeroed: a new
        one, or `out` (overwritten whole)."""
        if out is None:
            device = device if device is not None else next((t.device for t in tensors if t is not None), "cpu")
            out = torch.empty(self.padded_numel, dtype=dtype, device=device)
        for slot, t in zip(self.slots, tensors, strict=True):  # every element written once
            view = out[slot.offset:slot.offset + slot.numel]
            if t is None:
                view.zero_()
            else:
                view.copy_(t.reshape(-1))
        for lo, hi in self.gaps():
            out[lo:hi].zero_()
        return out

    def __repr__(self) -> str:
        return (f"FlatLayout({len(self.slots)} params, numel={self.numel}, padded={self.padded_numel}, "
                f"world={self.world_size})")


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


def start_all_gather(shard: torch.Tensor, full: torch.Tensor, group: dist.ProcessGroup | None,
                     comm: CommBytes) -> Any:
    """Start gathering every rank's `shard` into `full`; returns the collective's work handle
    (wait() on it before reading `full`). Only called with world size > 1."""
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
                    comm: CommBytes, *, out: torch.Tensor | None = None) -> torch.Tensor:
    """The full flat buffer from every rank's shard, new or in `out` (world 1: the shard
    itself, no copy)."""
    if layout.world_size == 1:
        return shard
    full = shard.new_empty(layout.padded_numel) if out is None else out
    comm.all_gather += _nbytes(full)
    _all_gather(full, shard, group, async_op=False)
    return full


def reduce_scatter_flat(full: torch.Tensor, layout: FlatLayout, group: dist.ProcessGroup | None,
                        comm: CommBytes) -> torch.Tensor:
    """This rank's shard of the mean of every rank's full flat buffer (world 1: `full` itself)."""
    if layout.world_size == 1:
        return full
    shard = full.new_empty(layout.shard_numel)
    comm.reduce_scatter += _nbytes(full)
    _reduce_scatter(shard, full, group)
    return shard.div_(layout.world_size)


def all_reduce_flat(full: torch.Tensor, layout: FlatLayout, group: dist.ProcessGroup | None,
                    comm: CommBytes) -> torch.Tensor:
    """The mean of every rank's full flat buffer, in place (world 1: `full` itself)."""
    if layout.world_size == 1:
        return full
    return all_reduce_(full, group, layout.world_size, comm=comm).div_(layout.world_size)


def all_reduce_(t: torch.Tensor, group: dist.ProcessGroup | None, world_size: int, *, op: str = "sum",
                comm: CommBytes | None = None) -> torch.Tensor:
    """`t` reduced over the ranks in place (sum or max); world 1: unchanged."""
    if world_size > 1:
        if comm is not None:
            comm.all_reduce += _nbytes(t)
        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM, group=group)
    return t


def broadcast_from_first_(t: torch.Tensor, group: dist.ProcessGroup | None, world_size: int) -> torch.Tensor:
    """`t` overwritten in place with the group's first rank's values; world 1: unchanged."""
    if world_size > 1:
        src = dist.get_global_rank(group, 0) if group is not None else 0
        dist.broadcast(t, src=src, group=group)
    return t

"""Flat parameters and their shards: the layout ZeRO splits across data-parallel ranks.

A block's parameters are concatenated, in a fixed order, into one flat 1-D buffer padded to a
multiple of the world size (of world size x QUANT_BLOCK elements with more than one rank: every
shard starts on an int8 state's block, [Note: shards on int8 blocks]); rank r owns the
contiguous shard [r * n / world, (r + 1) * n / world) of it, and the gradient, master weights
and optimizer moments share that layout (which of them a rank keeps whole instead is the ZeRO
stage's choice: tierzero/layout/zero.py). With world size 1 the shard is the whole buffer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, Sequence

import torch

from tierzero.config import QUANT_BLOCK


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


# [Note: shards on int8 blocks]
# An int8 optimizer state keeps one scale per QUANT_BLOCK elements (tierzero/layout/state_codec.py),
# counted from its shard's start. With more than one rank the flat buffer is padded to a multiple
# of world_size x QUANT_BLOCK, so every rank's shard starts on a multiple of QUANT_BLOCK of the
# flat (global) index: the blocks are the same whatever the world size, and so are the bits of
# an update that sees the same gradient (the fused kernel's cuts at a shard's edge fall on
# whole vectors too, [Note: fused chunks] in tierzero/optim/base.py), and an int8 checkpoint
# reshards block by block (tierzero/checkpoint/reshard.py). The padding costs at most
# QUANT_BLOCK elements a rank per flat tensor, whatever the states' format.
@dataclass(frozen=True)
class FlatLayout:
    """Parameters packed in order, each starting on an ALIGN_BYTES boundary, then zero padding
    up to a multiple of `world_size` (x QUANT_BLOCK with more than one rank: [Note: shards on
    int8 blocks])."""

    slots: tuple[ParamSlot, ...]
    numel: int
    """Elements up to the end of the last parameter."""
    padded_numel: int
    """Elements of the flat buffer (a multiple of world_size; of world_size x QUANT_BLOCK with more
    than one rank)."""
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
        unit = world_size * (align if world_size == 1 else math.lcm(align, QUANT_BLOCK))
        padded = -(-max(offset, 1) // unit) * unit
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

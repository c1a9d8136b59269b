"""This rank's shards of what a checkpoint stores of a model (`rank_shards`, in one call): each
block's values and its optimizer states, each a RankShard, read into a caller's buffer and written
back to its home tier. tierzero.checkpoint reads and writes a model's state through these, never
through the placement manager."""

from __future__ import annotations

from typing import Mapping, NamedTuple, Protocol, Sequence

import numpy as np
import torch

from tierzero.layout import StateCodec
from tierzero.placement import TensorHandle
from tierzero.runtime.flat.flat_param import FlatParam


class RankShard:
    """This rank's shard of one stored tensor of `flat`: its values (`values=True`: the fp32
    master weights when there are any, else the parameters) or an optimizer state's handle."""

    def __init__(self, flat: FlatParam, handle: TensorHandle, *, values: bool, codec: StateCodec | None = None) -> None:
        self.flat, self.handle, self.values = flat, handle, values
        self.codec = codec
        """An optimizer state's format (None: values, kept as their dtype)."""
        self.dtype: torch.dtype = handle.dtype
        self.numel = flat.layout.shard_numel if values else handle.shape.numel()
        """Elements of the stored shard (an int8 state: its bytes, codes then scales)."""
        self.nbytes = self.numel * self.dtype.itemsize
        self.format = codec.dtype if codec is not None else str(self.dtype).removeprefix("torch.")
        """What a checkpoint's manifest names it by: the dtype, or an optimizer state's format
        ("float32", "bfloat16", "int8")."""

    def read_into(self, buf: np.ndarray) -> None:
        """This rank's shard of the tensor, as bytes, into `buf` (at least `nbytes` long)."""
        pm = self.flat.ctx.pm
        if self.handle.shape.numel() == self.numel:
            pm.read(self.handle, out=buf)
        else:  # the whole flat tensor is kept (stages 1 and 2): this rank's part of it
            torch.from_numpy(buf[:self.nbytes]).view(self.dtype).copy_(pm.read(self.handle)[self.flat.shard])

    def write(self, shard: torch.Tensor) -> None:
        """New contents of this rank's shard, in any floating dtype: values go to the master
        weights and the parameters (FlatParam.store_values), a state to its home tier."""
        if self.values:
            self.flat.store_values(shard)
        else:
            self.flat.ctx.pm.store(self.handle, shard.to(self.dtype))


class StoredStates(Protocol):
    """An optimizer's states of one block (the runtime's BlockState), as a checkpoint stores them."""

    def stored(self) -> dict[str, tuple[TensorHandle, StateCodec]]:
        """Each state besides the master weights, by kind: its handle and its format."""
        ...


class Stored(NamedTuple):
    """What a checkpoint stores of one flat tensor: this rank's shard of its values and of the
    optimizer's states by kind (none when no optimizer updates it), under the flat tensor's
    name (its parameters' handle's)."""

    name: str
    flat: FlatParam
    values: RankShard
    states: dict[str, RankShard]


def rank_shards(flats: Sequence[FlatParam], states: Mapping[FlatParam, StoredStates]) -> list[Stored]:
    """What a checkpoint stores of `flats`, in their order, this rank's shards: each one's
    values (the fp32 master weights when there are any, else the parameters) and the optimizer
    states of those in `states`."""
    out = []
    for flat in flats:
        block = states.get(flat)
        kinds = block.stored() if block is not None else {}
        out.append(Stored(flat.param.name, flat, RankShard(flat, flat.values, values=True),
                          {k: RankShard(flat, h, values=False, codec=c) for k, (h, c) in kinds.items()}))
    return out

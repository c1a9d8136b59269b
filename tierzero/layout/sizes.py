"""Device bytes of a block while it is fetched, from its parameters alone: what `tz.wrap` checks
the device budget against and `tierzero estimate` counts."""

from __future__ import annotations

import torch
from torch import nn

from tierzero.layout.flat_layout import FlatLayout
from tierzero.layout.zero import ZeroStage


def block_fetch_bytes(params: list[tuple[str, nn.Parameter]], dtype: torch.dtype, world_size: int,
                      zero_stage: int = 3) -> int:
    """Device bytes of a block (its (fqn, parameter) list) while it is fetched (see
    flat_param.fetched_bytes)."""
    gathered = ZeroStage(zero_stage, world_size).gathers
    return sum(fetched_bytes(layout, dtype, gathered=gathered)
               for _, layout in flat_groups(params, world_size, dtype))


def flat_groups(params: list[tuple[str, nn.Parameter]], world_size: int,
                dtype: torch.dtype) -> list[tuple[list[tuple[str, nn.Parameter]], FlatLayout]]:
    """A block's (fqn, parameter) list as its flat tensors' parameters and layouts: the
    trainable ones, then the frozen ones (each when there are any)."""
    out = []
    for trainable in (True, False):
        ps = [(f, p) for f, p in params if p.requires_grad == trainable]
        if ps:
            out.append((ps, FlatLayout.build([f for f, _ in ps], [p.shape for _, p in ps], world_size,
                                             itemsize=dtype.itemsize)))
    return out


def fetched_bytes(layout: FlatLayout, dtype: torch.dtype, *, gathered: bool) -> int:
    """Device bytes of a fetched flat tensor: the full tensor, plus when it is `gathered` across
    ranks (stage 3) the shard it is gathered from (pinned until the gather is done)."""
    return fetched_numel(layout, gathered=gathered) * dtype.itemsize


def fetched_numel(layout: FlatLayout, *, gathered: bool) -> int:
    """Elements of a fetched flat tensor on the device (`fetched_bytes`)."""
    return layout.padded_numel + (layout.shard_numel if gathered else 0)

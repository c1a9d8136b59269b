"""The flat tensors of the training state per block, kind and tier, and their bytes: what
`tz.wrap` registers and the plan counts (per-block numels of the flat layouts; arithmetic only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple, Sequence

from torch import nn

from tierzero.config import KINDS, TIER_NAMES, ElementBytes, round_up
from tierzero.layout.flat_layout import FlatLayout
from tierzero.layout.grouping import ROOT
from tierzero.layout.split import BlockTiers
from tierzero.layout.zero import ZeroStage

Flats = Sequence[tuple[Sequence[tuple[str, nn.Parameter]], FlatLayout]]
"""A block's flat groups (`flat_groups`): (named parameters, layout), trainable first."""
Blocks = Sequence[tuple[str, Flats]]
"""(block name, its flat groups) per block."""


def placement_order(names: Sequence[str]) -> list[int]:
    """Indices of the blocks `names` in the order [Note: split placement] fills the tiers: the
    root, then the blocks as listed."""
    return [i for i, n in enumerate(names) if n == ROOT] + [i for i, n in enumerate(names) if n != ROOT]


def trainable(flats: Flats) -> list[FlatLayout]:
    """The layouts of a block's flat tensors of trainable parameters."""
    return [layout for ps, layout in flats if ps[0][1].requires_grad]


class KindSizes(NamedTuple):
    """Bytes per block of each kind (the placement order of [Note: split placement]): what a
    split's fractions are fractions of."""

    params: list[int]
    grads: list[int]
    optimizer_states: list[int]


def kind_sizes(blocks: Blocks, zero: ZeroStage, element: ElementBytes) -> KindSizes:
    """Bytes per block of each kind on this rank, in the order of `blocks`, each flat tensor
    rounded up to a page (the optimizer states with their own master weights)."""
    params, grads, states = [], [], []
    for _, flats in blocks:
        layouts = trainable(flats)
        params.append(sum(round_up(element.nbytes("params", kept(lay, zero.params_whole))) for lay in layouts))
        grads.append(sum(round_up(element.nbytes("grads", kept(lay, zero.grads_whole))) for lay in layouts))
        states.append(sum(round_up(element.nbytes("master", lay.shard_numel))
                          + len(element.moments) * round_up(element.nbytes("moment", lay.shard_numel))
                          for lay in layouts))
    return KindSizes(params, grads, states)


def kept(layout: FlatLayout, whole: bool) -> int:
    """Elements a rank keeps of a flat tensor: all of it (`whole`), or its shard."""
    return layout.padded_numel if whole else layout.shard_numel


@dataclass(frozen=True)
class FlatTensor:
    """One flat tensor `tz.wrap` registers: its block, kind, home tier and bytes."""

    block: str
    kind: str
    """"params", "frozen", "grads", "master", "moments" (each moment apart)."""
    home: str
    nbytes: int


def state_tensors(blocks: Blocks, tiers: BlockTiers, frozen_tier: str, zero: ZeroStage,
                  element: ElementBytes) -> list[FlatTensor]:
    """The flat tensors `tz.wrap` registers for `blocks` placed by `tiers` (AdamW's states), on
    one rank: fp32 parameters homed with their states double as the master weights."""
    out = []
    for name, flats in blocks:
        home = {kind: getattr(tiers, kind).get(name, "host") for kind in KINDS}
        shared = element.params_are_master(same_tier=home["params"] == home["optimizer_states"],
                                           params_whole=zero.params_whole)
        for ps, layout in flats:
            params = element.nbytes("params", kept(layout, zero.params_whole))
            if not ps[0][1].requires_grad:
                out.append(FlatTensor(name, "frozen", frozen_tier, params))
                continue
            shard = layout.shard_numel
            out.append(FlatTensor(name, "params", home["params"], params))
            out.append(FlatTensor(name, "grads", home["grads"], element.nbytes("grads", kept(layout, zero.grads_whole))))
            if not shared:
                out.append(FlatTensor(name, "master", home["optimizer_states"], element.nbytes("master", shard)))
            out += [FlatTensor(name, "moments", home["optimizer_states"], element.nbytes("moment", shard))] * len(
                element.moments)
    return out


def tier_need(tensors: Sequence[FlatTensor], kinds: Sequence[str] | None = None) -> dict[str, int]:
    """Bytes each tier's budget gives `tensors` (of `kinds`, default all), each rounded up to a page."""
    need = dict.fromkeys(TIER_NAMES, 0)
    for t in tensors:
        if kinds is None or t.kind in kinds:
            need[t.home] += round_up(t.nbytes)
    return need

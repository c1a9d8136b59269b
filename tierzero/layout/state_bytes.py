"""The bytes of the training state per block, kind and tier: the one count that `tz.wrap` checks
a placement against and that the planning sizes budgets and "auto" by (per-block numels of the
flat layouts; arithmetic only)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

from torch import nn

from tierzero.config import KINDS, TIER_NAMES, Config, state_nbytes
from tierzero.layout.flat_layout import FlatLayout
from tierzero.layout.grouping import ROOT
from tierzero.layout.split import BlockTiers, KindSizes
from tierzero.layout.zero import ZeroStage

Flats = Sequence[tuple[Sequence[tuple[str, nn.Parameter]], FlatLayout]]
"""A block's flat groups (`flat_groups`): (named parameters, layout), trainable first."""
Blocks = Sequence[tuple[str, Flats]]
"""(block name, its flat groups) per block."""

PAGE = 4096
"""Bytes the tiers' allocators round every buffer up to (tierzero/placement/tiers.py's ALIGNMENT)."""


def round_up(nbytes: int) -> int:
    """The bytes a buffer of `nbytes` takes from a tier's budget."""
    return -(-nbytes // PAGE) * PAGE


def placement_order(names: Sequence[str]) -> list[int]:
    """Indices of the blocks `names` in the order [Note: split placement] fills the tiers: the
    root, then the blocks as listed."""
    return [i for i, n in enumerate(names) if n == ROOT] + [i for i, n in enumerate(names) if n != ROOT]


def _trainable(flats: Flats) -> list[FlatLayout]:
    return [layout for ps, layout in flats if ps[0][1].requires_grad]


def kind_sizes(blocks: Blocks, zero: ZeroStage, compute_itemsize: int, grad_itemsize: int, *,
               state_dtype: str = "float32", master_itemsize: int = 4) -> KindSizes:
    """Bytes per block of each kind on this rank, in the order of `blocks` (AdamW's optimizer
    states: fp32 master weights and two moments; fp32 parameters sharing a tier with their
    master weights are counted by `state_tensors`, not here). Each flat tensor is rounded up to
    a page as `tier_need` counts it, so that what "auto" fits by these sizes passes wrap's check."""
    params, grads, states = [], [], []
    for _, flats in blocks:
        layouts = _trainable(flats)
        params.append(sum(round_up((lay.padded_numel if zero.params_whole else lay.shard_numel) * compute_itemsize)
                          for lay in layouts))
        grads.append(sum(round_up((lay.padded_numel if zero.grads_whole else lay.shard_numel) * grad_itemsize)
                         for lay in layouts))
        states.append(sum(round_up(master_itemsize * lay.shard_numel)
                          + 2 * round_up(state_nbytes(lay.shard_numel, state_dtype))  # issue 53: real bytes
                          for lay in layouts))
    return KindSizes(params, grads, states)


@dataclass(frozen=True)
class FlatTensor:
    """One flat tensor `tz.wrap` registers: its block, kind, home tier and bytes."""

    block: str
    kind: str
    """"params", "frozen", "grads", "master", "moments" (each moment apart)."""
    home: str
    nbytes: int


def state_tensors(blocks: Blocks, tiers: BlockTiers, frozen_tier: str, zero: ZeroStage, compute_itemsize: int,
                  grad_itemsize: int, *, state_dtype: str = "float32", master_itemsize: int = 4) -> list[FlatTensor]:
    """The flat tensors `tz.wrap` registers for `blocks` placed by `tiers` (AdamW's states), on
    one rank: fp32 parameters homed with their states double as the master weights."""
    out = []
    for name, flats in blocks:
        home = {kind: getattr(tiers, kind).get(name, "host") for kind in KINDS}
        shared = compute_itemsize == master_itemsize and home["params"] == home["optimizer_states"] and not zero.params_whole
        for ps, layout in flats:
            whole, shard = layout.padded_numel, layout.shard_numel
            kept = (whole if zero.params_whole else shard) * compute_itemsize
            if not ps[0][1].requires_grad:
                out.append(FlatTensor(name, "frozen", frozen_tier, kept))
                continue
            out.append(FlatTensor(name, "params", home["params"], kept))
            out.append(FlatTensor(name, "grads", home["grads"], grad_itemsize * (whole if zero.grads_whole else shard)))
            if not shared:
                out.append(FlatTensor(name, "master", home["optimizer_states"], master_itemsize * shard))
            out += [FlatTensor(name, "moments", home["optimizer_states"], state_nbytes(shard, state_dtype))] * 2
    return out


def tier_need(tensors: Sequence[FlatTensor], kinds: Sequence[str] | None = None) -> dict[str, int]:
    """Bytes each tier's budget gives `tensors` (of `kinds`, default all), each rounded up to a page."""
    need = dict.fromkeys(TIER_NAMES, 0)
    for t in tensors:
        if kinds is None or t.kind in kinds:
            need[t.home] += round_up(t.nbytes)
    return need


def frozen_bytes(blocks: Blocks, zero: ZeroStage, compute_itemsize: int) -> int:
    """Bytes the frozen parameters' flat tensors take from Config.frozen_tier's budget."""
    return sum(round_up((layout.padded_numel if zero.params_whole else layout.shard_numel) * compute_itemsize)
               for _, flats in blocks for ps, layout in flats if not ps[0][1].requires_grad)


def fetch_window(config: Config, fetched: Mapping[str, int], zero: ZeroStage) -> int:
    """Device bytes of the fetched blocks (`fetched`: each block's bytes while fetched): the root
    block, the largest block and the prefetch reserve, as `tz.wrap` checks the device budget; 0
    when every parameter lives on the device whole."""
    if config.params == "device" and not zero.gathers:
        return 0
    rest = [n for name, n in fetched.items() if name != ROOT]
    reserve = config.prefetch.reserve if config.prefetch.policy == "bytes" else 0
    return fetched.get(ROOT, 0) + max(rest, default=0) + (reserve or 0)

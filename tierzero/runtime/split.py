"""Split placement at wrap: each block's tier per kind of state (Config's tiers, splits and
"auto" resolved by tierzero.layout's rule, [Note: split placement]), the refusal of a split that
cannot fit, and `tz.tier_bytes(model)`: the bytes each kind holds on each tier."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from tierzero.config import KINDS, MASTER_BYTES_PER_PARAM, OPTIMIZER_BYTES_PER_PARAM, TIER_NAMES, Config, format_size
from tierzero.layout import (ROOT, BlockTiers, FlatLayout, KindSizes, ZeroStage, block_tiers, resolve_auto, state_room,
                             tier_totals)
from tierzero.placement import Kind
from tierzero.runtime.state import state_of

Layouts = Sequence[tuple[str, object, Sequence[tuple[Sequence[tuple[str, nn.Parameter]], FlatLayout]]]]
"""wrap's blocks: (name, modules, [(named parameters, flat layout)]), the root last."""

MOMENT_BYTES_PER_PARAM = OPTIMIZER_BYTES_PER_PARAM - MASTER_BYTES_PER_PARAM
"""AdamW's two fp32 moments: what wrap counts for the optimizer it does not know yet."""

_KIND_OF = {Kind.PARAM: "params", Kind.FROZEN: "frozen", Kind.GRAD: "grads", Kind.MASTER: "optimizer_states",
            Kind.EXP_AVG: "optimizer_states", Kind.EXP_AVG_SQ: "optimizer_states", Kind.MOMENTUM: "optimizer_states"}


def placement_order(layouts: Layouts) -> list[int]:
    """Indices of `layouts` in the order [Note: split placement] fills the tiers: the root, then
    the blocks as listed."""
    return [len(layouts) - 1, *range(len(layouts) - 1)]


def kind_sizes(layouts: Layouts, order: list[int], zero: ZeroStage, compute: torch.dtype,
               grad: torch.dtype) -> tuple[KindSizes, list[int]]:
    """Bytes per block of each kind on this rank (AdamW's optimizer states: master weights and
    two moments), and the trainable elements per block, in `order`."""
    numels = [sum(layout.shard_numel for ps, layout in layouts[i][2] if ps[0][1].requires_grad) for i in order]
    whole = [sum(layout.padded_numel for ps, layout in layouts[i][2] if ps[0][1].requires_grad) for i in order]
    params = [(w if zero.params_whole else n) * compute.itemsize for n, w in zip(numels, whole)]
    grads = [(w if zero.grads_whole else n) * grad.itemsize for n, w in zip(numels, whole)]
    states = [n * OPTIMIZER_BYTES_PER_PARAM for n in numels]
    return KindSizes(params, grads, states), numels


def plan_tiers(config: Config, layouts: Layouts, zero: ZeroStage, compute: torch.dtype, grad: torch.dtype,
               device_window: int) -> BlockTiers:
    """Each block's tier per kind: `config`'s tiers, splits and "auto" (resolved into the room
    left on each tier once `device_window` bytes of the device, the fetched blocks, and the host
    staging of the update's read-ahead are set aside). A split that cannot fit the budgets is
    refused here, with the bytes it needs per tier."""
    names = [layouts[i][0] for i in placement_order(layouts)]
    if not config.is_split:
        return BlockTiers.uniform(names, config)
    order = placement_order(layouts)
    sizes, numels = kind_sizes(layouts, order, zero, compute, grad)
    frozen = sum(layout.shard_numel for _, _, flats in layouts for ps, layout in flats
                 if not ps[0][1].requires_grad) * compute.itemsize
    room, largest = state_room(config, sizes, device_window, frozen)
    resolved = resolve_auto(config, sizes, room)
    tiers = block_tiers(resolved, sizes)
    _check_fits(config, resolved, tiers, sizes, numels, frozen, device_window, largest, zero, compute)
    return BlockTiers.build(names, tiers)


def _check_fits(config: Config, resolved: Config, tiers: dict[str, list[str]], sizes: KindSizes,
                numels: list[int], frozen: int, device_window: int, largest: int, zero: ZeroStage,
                compute: torch.dtype) -> None:
    """ValueError naming the bytes per tier when the placement cannot fit the budgets."""
    shared = compute == torch.float32 and not zero.params_whole
    states = [n * (MOMENT_BYTES_PER_PARAM + (0 if shared and p == s else MASTER_BYTES_PER_PARAM))
              for n, p, s in zip(numels, tiers["params"], tiers["optimizer_states"])]
    totals = tier_totals(tiers, sizes._replace(optimizer_states=states))
    need = {t: sum(totals[k][t] for k in KINDS) for t in TIER_NAMES}
    need[config.frozen_tier] += frozen
    need["device"] += device_window
    if any(totals[k]["nvme"] for k in KINDS):
        need["host"] += largest  # an NVMe block's update is staged in host memory
    over = [t for t in TIER_NAMES if need[t] > config.budget(t)]
    if not over:
        return
    placed = ", ".join(f"{k}={getattr(resolved, k)!r}" for k in KINDS)
    detail = "; ".join(f"{t}: {format_size(need[t])} ({need[t]} bytes) needed, budget {format_size(config.budget(t))}"
                       + ("" if t != "device" else f" (of which {format_size(device_window)} the fetched blocks)")
                       for t in TIER_NAMES)
    raise ValueError(
        f"the placement {placed} cannot fit: {detail}. Over budget: {', '.join(over)}. Raise "
        f"{' and '.join(t + '_budget' for t in over)}, or give a smaller fraction of those tiers (or 'auto', "
        "which fills each tier to its budget); optimizer states are counted as AdamW keeps them "
        "(fp32 master weights and two moments)")


def tier_bytes(model: nn.Module) -> dict[str, dict[str, int]]:
    """{kind: {tier: bytes}} of what a wrapped model keeps on this rank: "params", "grads",
    "optimizer_states" (master weights and the tiered optimizer's moments, once it is built),
    and "frozen" when there are frozen parameters. fp32 parameters that double as the master
    weights count once, as params."""
    pm = state_of(model).pm
    out = {kind: dict.fromkeys(TIER_NAMES, 0) for kind in KINDS}
    for h in pm.handles:
        kind = _KIND_OF.get(h.kind)
        if kind is not None:
            out.setdefault(kind, dict.fromkeys(TIER_NAMES, 0))[h.home.value] += h.nbytes
    return out

"""Split placement at wrap: each block's tier per kind of state (Config's tiers, splits and
"auto" resolved by tierzero.layout's rule, [Note: split placement]), the refusal of a split that
cannot fit, and `tz.tier_bytes(model)`: the bytes each kind holds on each tier."""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from tierzero.config import DTYPE_BYTES, KINDS, TIER_NAMES, Config, format_size
from tierzero.layout import (BlockTiers, FlatLayout, FlatTensor, ZeroStage, block_tiers, frozen_bytes, kind_sizes,
                             placement_order, resolve_auto, state_room, state_tensors, tier_need)
from tierzero.placement import Kind
from tierzero.runtime.state import state_of

Layouts = Sequence[tuple[str, object, Sequence[tuple[Sequence[tuple[str, nn.Parameter]], FlatLayout]]]]
"""wrap's blocks: (name, modules, [(named parameters, flat layout)]), the root last."""

_KIND_OF = {Kind.PARAM: "params", Kind.FROZEN: "frozen", Kind.GRAD: "grads", Kind.MASTER: "optimizer_states",
            Kind.EXP_AVG: "optimizer_states", Kind.EXP_AVG_SQ: "optimizer_states", Kind.MOMENTUM: "optimizer_states"}


def plan_tiers(config: Config, layouts: Layouts, zero: ZeroStage, compute: torch.dtype, grad: torch.dtype,
               device_window: int) -> BlockTiers:
    """Each block's tier per kind: `config`'s tiers, splits and "auto" (resolved into the room
    left on each tier once `device_window` bytes of the device (the fetched blocks) and
    `config.device_reserve` (the step's working set), the host staging of the update's
    read-ahead and the frozen parameters are set aside). A split that cannot fit the budgets is
    refused here, with the bytes it needs per tier."""
    names = [name for name, _, _ in layouts]
    if not config.is_split:
        return BlockTiers.uniform(names, config)
    blocks = [(layouts[i][0], layouts[i][2]) for i in placement_order(names)]
    formats = dict(state_dtype=config.optimizer_state_dtype, master_itemsize=DTYPE_BYTES[config.master_dtype])
    sizes = kind_sizes(blocks, zero, compute.itemsize, grad.itemsize, **formats)
    frozen = frozen_bytes(blocks, zero, compute.itemsize)
    room, largest = state_room(config, sizes, device_window, frozen)
    resolved = resolve_auto(config, sizes, room)
    tiers = BlockTiers.build([n for n, _ in blocks], block_tiers(resolved, sizes))
    _check_fits(config, resolved, state_tensors(blocks, tiers, config.frozen_tier, zero, compute.itemsize,
                                                grad.itemsize, **formats), device_window, largest)
    return tiers


def _check_fits(config: Config, resolved: Config, tensors: Sequence[FlatTensor], device_window: int,
                largest: int) -> None:
    """ValueError naming the bytes per tier when the placed flat tensors (`state_tensors`), the
    fetched blocks, the reserved working set and an NVMe block's host staging exceed the budgets."""
    need = tier_need(tensors)
    need["device"] += device_window + config.device_reserve
    if any(t.home == "nvme" and t.kind != "frozen" for t in tensors):
        need["host"] += largest  # an NVMe block's update is staged in host memory
    over = [t for t in TIER_NAMES if need[t] > config.budget(t)]
    if not over:
        return
    placed = ", ".join(f"{k}={getattr(resolved, k)!r}" for k in KINDS)
    aside = f" (of which {format_size(device_window)} the fetched blocks"
    aside += f", {format_size(config.device_reserve)} the reserved working set)" if config.device_reserve else ")"
    detail = "; ".join(f"{t}: {format_size(need[t])} ({need[t]} bytes) needed, budget {format_size(config.budget(t))}"
                       + ("" if t != "device" else aside) for t in TIER_NAMES)
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

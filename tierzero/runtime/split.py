"""Placement at wrap: the plan of each block's tier per kind of state (Config's tiers, splits and
"auto" resolved by tierzero.layout.PlacementPlan), refused when it cannot fit the budgets, and
`tz.tier_bytes(model)`: the bytes each kind holds on each tier."""

from __future__ import annotations

from typing import Sequence

from torch import nn

from tierzero.config import KINDS, TIER_NAMES, Config
from tierzero.layout import FlatLayout, PlacementPlan, PlanInputs
from tierzero.placement import Kind
from tierzero.runtime.state import state_of

Layouts = Sequence[tuple[str, object, Sequence[tuple[Sequence[tuple[str, nn.Parameter]], FlatLayout]]]]
"""wrap's blocks: (name, modules, [(named parameters, flat layout)]), the root last."""

_KIND_OF = {Kind.PARAM: "params", Kind.FROZEN: "frozen", Kind.GRAD: "grads", Kind.MASTER: "optimizer_states",
            Kind.EXP_AVG: "optimizer_states", Kind.EXP_AVG_SQ: "optimizer_states", Kind.MOMENTUM: "optimizer_states"}


def checked_plan(config: Config, layouts: Layouts, world_size: int, *, cuda: bool) -> PlacementPlan:
    """The placement plan of wrap's blocks under `config` (splits and "auto" resolved), refused
    with the bytes of every tier that falls short before anything is registered
    ([Note: one placement plan])."""
    plan = PlacementPlan.build(config, PlanInputs.of(config, [(name, flats) for name, _, flats in layouts],
                                                     world_size, cuda=cuda))
    plan.check()
    return plan


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

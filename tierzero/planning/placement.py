"""The placement plan of a model under a Config, as `tz.wrap` will compute it
(tierzero.layout.PlacementPlan, [Note: one placement plan] in tierzero/layout/plan.py): each
block's tiers, "auto" resolved at the budgets, the least budgets, the NVMe bytes of a step."""

from __future__ import annotations

import torch
from torch import nn

from tierzero.config import Config
from tierzero.layout import BlockTiers, PlacementPlan, PlanInputs, blocks_of, flat_groups


def on_cuda(cfg: Config) -> bool:
    """Whether `cfg`'s device tier is a GPU (Config.device, else whether CUDA is there)."""
    return cfg.device.startswith("cuda") if cfg.device else torch.cuda.is_available()


def placement_plan(model: nn.Module, cfg: Config, world_size: int = 1) -> PlacementPlan:
    """The plan `tz.wrap(model, cfg)` computes on each of `world_size` ranks (`model` may be on
    the meta device)."""
    cuda = on_cuda(cfg)
    compute = getattr(torch, cfg.compute_dtype_name(cuda=cuda))
    blocks = [(name, flat_groups(params, world_size, compute)) for name, _, params in blocks_of(model, cfg)]
    return PlacementPlan.build(cfg, PlanInputs.of(cfg, blocks, world_size, cuda=cuda))


def resolve_placement(model: nn.Module, cfg: Config, world_size: int = 1) -> Config:
    """`cfg` with its "auto" kinds resolved into splits for `model` as `tz.wrap` resolves them
    (as it is when none is "auto"); the device room left for the step's working set is
    `cfg.device_reserve` (see `working_set`)."""
    if not any(getattr(cfg, k) == "auto" for k in ("params", "grads", "optimizer_states")):
        return cfg
    return placement_plan(model, cfg, world_size).resolved


def planned_tiers(model: nn.Module, cfg: Config, world_size: int = 1) -> BlockTiers:
    """Each block's tier per kind, as tz.wrap places `model` under `cfg`."""
    return placement_plan(model, cfg, world_size).tiers

"""Bytes per tier for a model and a Config, and the largest built-in model a machine can train.

The figures are tierzero's own state: compute-dtype parameters on `params`, gradients
(Config.grad_dtype) on `grads`, fp32 master weights and two AdamW moments on
`optimizer_states`, plus the working sets the runtime keeps: on the device the root block (held
through the forward and the backward), the block being computed and the blocks prefetched
ahead of it; on the host the NVMe read-ahead staging and the
optimizer's streaming buffers. Activations depend on the batch and sequence: activations.py
measures them and adds what each placement needs (`tierzero estimate --batch B --seq S`). Across N
data-parallel ranks the state each rank holds, and the bytes its collectives move per step,
follow the ZeRO stage (zero_model.py: the ZeRO paper's model).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from tierzero.config import TIER_NAMES, Config
from tierzero.layout import ROOT, CommBytes, blocks_of
from tierzero.models import CONFIGS, build
from tierzero.planning.placement import placement_plan
from tierzero.planning.zero_model import StateSizes, ZeroModel, param_counts


@dataclass(frozen=True)
class Estimate:
    params: int
    largest_block_params: int
    per_tier: dict[str, int]
    """Bytes needed on each tier: the state homed there plus the runtime's working sets."""
    home: dict[str, int]
    """Bytes of state homed on each tier (params, grads, optimizer states), by the ZeRO model."""
    least: dict[str, int]
    """The least budget of each tier (tierzero.layout.PlacementPlan): `per_tier` is never below."""
    state_bytes: int
    """Params + grads + optimizer states, wherever they live (the whole model's, in one process)."""
    world_size: int = 1
    per_rank: StateSizes | None = None
    """What each rank holds of each kind of state (the ZeRO paper's model; `home` by tier)."""
    layout_per_rank: StateSizes | None = None
    """The same as `tz.wrap` registers it: flat tensors aligned and padded (zero_model)."""
    comm: CommBytes | None = None
    """Bytes each rank's collectives cover per step of one backward (zero_model)."""

    def fits(self, budgets: dict[str, int]) -> bool:
        return all(self.per_tier[t] <= budgets[t] for t in TIER_NAMES)


def largest_block_params(model: nn.Module, cfg: Config) -> int:
    """Parameters of the largest block `tz.wrap(model, cfg)` builds besides the root (the
    whole model when it finds no blocks)."""
    blocks = blocks_of(model, cfg)
    sizes = [sum(p.numel() for _, p in params) for name, _, params in blocks if name != ROOT]
    return max(sizes, default=sum(p.numel() for _, p in blocks[-1][2]))


def estimate(model: nn.Module, cfg: Config, world_size: int = 1) -> Estimate:
    """Bytes per tier that each of `world_size` ranks needs to train `model` under `cfg` (model
    may be on the meta device). Kinds placed "auto" are resolved first (placement.py)."""
    plan = placement_plan(model, cfg, world_size)
    cfg = plan.resolved
    counts = param_counts(model, cfg)
    n, trainable = counts.params, counts.trainable
    block = largest_block_params(model, cfg)
    zm = ZeroModel.of(cfg, world_size)
    per_param = cfg.state_bytes_per_param(cuda=torch.cuda.is_available(), params_whole=zm.zero.params_whole)
    per_rank = zm.per_rank(n, trainable)
    need = per_rank.by_tier(cfg)
    if cfg.frozen_tier != cfg.params:  # frozen parameters (a LoRA base) live on their own tier
        frozen = zm.per_rank(n - trainable, 0).params
        for tier, f in cfg.shares("params").items():
            need[tier] -= round(frozen * f)
        need[cfg.frozen_tier] += frozen
    home = dict(need)
    # beside the least budgets, the working sets prefetching wants: blocks ahead on the device,
    # NVMe read-ahead and the update's read k+1 / write k-1 on the host (never below the least)
    need = plan.need
    policy = cfg.prefetch.policy if isinstance(cfg.prefetch.policy, str) else "object"
    ahead = {"lookahead": cfg.prefetch.depth, "adaptive": 2}.get(policy, 1)  # adaptive: at least two
    if plan.window:
        need["device"] += ahead * plan.fetched_largest
    blocks = [t for t in plan.tensors if t.block != ROOT]  # the root is read once and held
    read = max((t.nbytes for t in blocks if t.home == "nvme" and t.kind in ("params", "frozen")), default=0)
    updates = max((n for b, n in plan.update_sets.items() if b != ROOT), default=0)
    need["host"] += cfg.prefetch.nvme_depth * read + 2 * updates
    need = {t: max(need[t], plan.least[t]) for t in TIER_NAMES}
    state = round(n * per_param.params + trainable * (per_param.grads + per_param.optimizer_states))
    return Estimate(params=n, largest_block_params=block, per_tier=need, home=home, least=dict(plan.least),
                    state_bytes=state,
                    world_size=world_size, per_rank=per_rank, layout_per_rank=zm.layout_per_rank(model, cfg),
                    comm=zm.comm_per_step(counts))


def placements() -> list[dict[str, str]]:
    """Placements from fastest to most frugal, as tried by `largest_trainable`."""
    return [
        dict(params="host", grads="host", optimizer_states="host"),
        dict(params="host", grads="host", optimizer_states="nvme"),
        dict(params="nvme", grads="host", optimizer_states="nvme"),
        dict(params="nvme", grads="nvme", optimizer_states="nvme"),
    ]


def largest_trainable(budgets: dict[str, int], nvme_dir: str | None) -> tuple[str | None, dict]:
    """The largest built-in model with a placement that fits `budgets`, and that placement."""
    best: tuple[str | None, dict] = (None, {})
    for name in CONFIGS:
        with torch.device("meta"):
            model = build(name, device="meta")
        for placement in placements():
            if "nvme" in placement.values() and nvme_dir is None:
                continue
            cfg = Config(nvme_dir=nvme_dir, **placement)
            if estimate(model, cfg).fits(budgets):
                best = (name, placement)
                break
    return best

"""The placement plan of a model under a Config, as `tz.wrap` will compute it
(tierzero.layout.PlacementPlan, [Note: one placement plan] in tierzero/layout/plan.py): each
block's tiers, "auto" resolved at the budgets, the least budget of each tier, and the NVMe bytes
a step is expected to move at given budgets (what the host caches is not read)."""

from __future__ import annotations

import torch
from torch import nn

from tierzero.config import Config
from tierzero.layout import ROOT, BlockTiers, FlatTensor, PlacementPlan, PlanInputs, blocks_of, flat_groups
from tierzero.planning.traffic import Traffic


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


def flat_tensors(model: nn.Module, cfg: Config, world_size: int = 1) -> list[FlatTensor]:
    """The flat tensors of `tz.wrap(model, cfg)` on one of `world_size` ranks (model may be on
    the meta device), as the placement plan counts them."""
    return list(placement_plan(model, cfg, world_size).tensors)


def least_budgets(model: nn.Module, cfg: Config, world_size: int = 1) -> dict[str, int]:
    """The least budget of each tier `model` trains in under `cfg`: the placement plan's homes
    and the step's room on each tier ([Note: one placement plan] in tierzero/layout/plan.py);
    activations are not counted (activations.py adds theirs)."""
    return dict(placement_plan(model, cfg, world_size).least)


# [Note: expected NVMe bytes]
# `step_traffic` is the traffic with nothing cached. A step moves less where memory keeps copies:
# blocks sweep forward then backward, so what stays cached from one pass is used first by the
# next. At the least budgets (the most a step reads) a frozen base's root block stays on the
# device and the block backward starts with is the one forward ended with: each pass reads the
# base less those (trainable parameters are rewritten by each step, so their reads stay as
# step_traffic counts them). Room beyond the least budgets caches more, how much depends on the
# prefetch policy and on compute against the disk (Adaptive reads far ahead into host memory
# where compute is slow; with fast compute it fetches two blocks ahead and the spare room caches
# little): the fewest reads count every spare byte of the host and the device as cache, the
# parameters first (read twice), then the optimizer states and gradients (read once, host room
# only). Writes are not cached away: every updated tensor goes home once a step. Measured (tests/
# planning/test_estimate_measured.py, docs/estimate.md): within 10 % of the most at the least
# budgets, between the two elsewhere.
def expected_traffic(least: Traffic, tensors: list[FlatTensor], spare: dict[str, int]) -> tuple[Traffic, Traffic]:
    """The NVMe bytes a step is expected to move, (fewest, most): `least` (step_traffic:
    nothing cached) where what the least budgets keep cached is taken off (the most), and less
    what `spare` bytes of each tier beyond its least budget can cache (the fewest); see
    [Note: expected NVMe bytes]."""
    most = Traffic({k: dict(v) for k, v in least.by_kind.items()})
    frozen = [t for t in tensors if t.kind == "frozen" and t.home == "nvme"]
    if frozen and most.by_kind["frozen"]["read"]:
        # the root stays on the device (nothing rewrites it) and the turning block serves both passes
        blocks = [t.nbytes for t in frozen if t.block != ROOT]
        most.by_kind["frozen"]["read"] = 2 * max(0, sum(blocks) - max(blocks, default=0))
    fewest = Traffic({k: dict(v) for k, v in most.by_kind.items()})
    host = max(0, spare.get("host", 0))
    room = host + max(0, spare.get("device", 0))  # parameters are cached on either
    for kinds, passes in ((("params", "frozen"), 2), (("master", "moments", "grads"), 1)):
        for kind in kinds:
            read = fewest.by_kind[kind]["read"]
            cached = min(room, read // passes)
            fewest.by_kind[kind]["read"] = read - passes * cached
            room -= cached
        room = min(room, host)  # what is left of the host's room (the device caches no states)
    return fewest, most

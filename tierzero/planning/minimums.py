"""The least budget of each tier that a model trains in under a Config, all at once, and the
NVMe bytes a step is expected to move at given budgets (what the host caches is not read).
"""

from __future__ import annotations

import torch
from torch import nn

from tierzero.config import DTYPE_BYTES, Config
from tierzero.layout import (ROOT, FlatTensor, ZeroStage, blocks_of, fetched_bytes, flat_groups, round_up,
                             state_tensors, tier_need)
from tierzero.planning.placement import placed_blocks, planned_tiers
from tierzero.placement import windowed_room
from tierzero.planning.traffic import Traffic


def flat_tensors(model: nn.Module, cfg: Config, world_size: int = 1) -> list[FlatTensor]:
    """The flat tensors of `tz.wrap(model, cfg)` on one of `world_size` ranks (model may be on
    the meta device), counted as wrap counts them (tierzero.layout.state_tensors)."""
    zero = ZeroStage(cfg.zero_stage, world_size)
    compute = getattr(torch, cfg.compute_dtype_name(cuda=torch.cuda.is_available())).itemsize
    return state_tensors(placed_blocks(model, cfg, world_size), planned_tiers(model, cfg, world_size),
                         cfg.frozen_tier, zero, compute, getattr(torch, cfg.grad_dtype).itemsize,
                         state_dtype=cfg.optimizer_state_dtype, master_itemsize=DTYPE_BYTES[cfg.master_dtype])


# [Note: least budgets]
# `estimate()`'s per-tier figures add the working sets prefetching wants (blocks ahead on the
# device, nvme_depth blocks of read-ahead and three blocks of optimizer streaming on the host):
# what makes a step fast, not what it needs. A run trains in less, and refusing a placement over
# them refused ones that train (issue 43: "needs 9.02 of 8.00 MiB" for a run whose host peaked at
# 7.93). The least budgets follow the runtime's own checks instead, tensor by tensor:
#
#     every tier   the flat tensors homed there as `tz.wrap` registers them (tierzero.layout's
#                  FlatLayout, padded), each rounded up to the 4 KiB the tier's allocator takes
#     device       plus the root block and the largest block fetched at once (wrapping.py's
#                  check: "the root block plus the largest block"), unless every parameter
#                  lives there whole; plus the bytes policy's reserve
#     host         plus the larger of two working sets that never overlap: one block's update
#                  (its gradient, master weights and moments staged from NVMe, and the new
#                  parameters' staging buffer where they are not the master weights: the
#                  optimizer's check) and the staging of the largest NVMe-homed parameter
#                  tensor read toward the device
#
# Measured against bisection on tiny transformers folders (tests/planning/test_estimate_measured.py):
# a run trains at these budgets and is refused at 0.9x of any one of them.
def least_budgets(model: nn.Module, cfg: Config, world_size: int = 1) -> dict[str, int]:
    """The least budget of each tier `model` trains in under `cfg` (see [Note: least budgets]);
    activations are not counted (activations.py adds theirs)."""
    zero = ZeroStage(cfg.zero_stage, world_size)
    tensors = flat_tensors(model, cfg, world_size)
    need = tier_need(tensors)
    if cfg.params != "device" or zero.gathers:
        dtype = getattr(torch, cfg.compute_dtype_name(cuda=torch.cuda.is_available()))
        fetched = {name: sum(round_up(fetched_bytes(layout, dtype, gathered=zero.gathers))
                             for _, layout in flat_groups(ps, world_size, dtype))
                   for name, _, ps in blocks_of(model, cfg)}
        root = fetched.pop(ROOT, 0)
        reserve = cfg.prefetch.reserve if cfg.prefetch.policy == "bytes" else 0
        need["device"] += root + max(fetched.values(), default=0) + (reserve or 0)
    need["host"] += max(_update_set(tensors, cfg), _read_staging(tensors))
    return need


def _update_set(tensors: list[FlatTensor], cfg: Config) -> int:
    """Host bytes the largest block's update stages at once (the optimizer's check): its
    NVMe-homed gradient, master weights and moments, and its NVMe-homed parameters (the master
    weights themselves, or the new parameters' staging buffer). Where the host tier is one
    pinned region (CUDA, the asynchronous stand-in) the check asks the room in which they always
    find windows ([Note: working set windows]), else their pages."""
    if cfg.optimizer_states == "device":
        return 0
    per_block: dict[str, list[int]] = {}
    for t in tensors:
        if t.kind != "frozen" and t.home == "nvme":
            per_block.setdefault(t.block, []).append(t.nbytes)
    room = windowed_room if _pinned_host(cfg) else (lambda sizes: sum(round_up(n) for n in sizes))
    return max((room(sizes) for sizes in per_block.values()), default=0)


def _pinned_host(cfg: Config) -> bool:
    """The host tier is one pinned region: on CUDA, and in the asynchronous stand-in."""
    cuda = cfg.device.startswith("cuda") if cfg.device else torch.cuda.is_available()
    return cuda or cfg.stream_settings().mode == "async"


def _read_staging(tensors: list[FlatTensor]) -> int:
    """Host bytes a read of the largest NVMe-homed parameter tensor toward the device stages."""
    return max((round_up(t.nbytes) for t in tensors if t.kind in ("params", "frozen") and t.home == "nvme"),
               default=0)


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

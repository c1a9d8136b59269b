"""The split "auto" chooses for a model and a Config, as `tz.wrap` will choose it: each kind
placed "auto" filled into the device, then the host, then NVMe, after the room the step needs
(tierzero.layout.resolve_auto, [Note: split placement] in tierzero/layout/split.py)."""

from __future__ import annotations

import torch
from torch import nn

from tierzero.config import KINDS, OPTIMIZER_BYTES_PER_PARAM, Config
from tierzero.layout import ROOT, BlockTiers, KindSizes, ZeroStage, block_tiers, blocks_of, resolve_auto, state_room


def kind_sizes(model: nn.Module, cfg: Config, world_size: int = 1) -> tuple[KindSizes, int]:
    """Bytes per block of each kind on one rank, root first (the placement order), and the
    device bytes of the root plus two blocks (the one computing and the one fetched ahead)."""
    zero = ZeroStage(cfg.zero_stage, world_size)
    compute = getattr(torch, cfg.compute_dtype_name(cuda=torch.cuda.is_available())).itemsize
    grad = getattr(torch, cfg.grad_dtype).itemsize
    blocks = blocks_of(model, cfg)
    blocks = [b for b in blocks if b[0] == ROOT] + [b for b in blocks if b[0] != ROOT]
    whole = [sum(p.numel() for _, p in params if p.requires_grad) for _, _, params in blocks]
    share = [-(-n // world_size) for n in whole]
    sizes = KindSizes([(w if zero.params_whole else s) * compute for w, s in zip(whole, share)],
                      [(w if zero.grads_whole else s) * grad for w, s in zip(whole, share)],
                      [s * OPTIMIZER_BYTES_PER_PARAM for s in share])
    fetched = [sum(p.numel() for _, p in params) * compute for _, _, params in blocks]
    window = fetched[0] + 2 * max(fetched[1:], default=0)
    return sizes, window


def resolve_placement(model: nn.Module, cfg: Config, world_size: int = 1, *, device_extra: int = 0) -> Config:
    """`cfg` with its "auto" kinds resolved into splits for `model` (as it is when none is
    "auto"); `device_extra`: device bytes the step needs besides the fetched blocks (the largest
    block's compute temporaries and the activations at the run's batch and sequence)."""
    if not any(getattr(cfg, k) == "auto" for k in KINDS):
        return cfg
    sizes, window = kind_sizes(model, cfg, world_size)
    room, _ = state_room(cfg, sizes, window + device_extra)  # as tz.wrap, frozen bytes not counted here
    return resolve_auto(cfg, sizes, room)


def planned_tiers(model: nn.Module, cfg: Config, world_size: int = 1) -> BlockTiers:
    """Each block's tier per kind, as tz.wrap places `model` under `cfg` (splits and "auto"
    resolved by [Note: split placement]'s rule)."""
    cfg = resolve_placement(model, cfg, world_size)
    if not cfg.is_split:
        return BlockTiers.uniform([name for name, _, _ in blocks_of(model, cfg)], cfg)
    sizes, _ = kind_sizes(model, cfg, world_size)
    blocks = blocks_of(model, cfg)
    names = [n for n, _, _ in blocks if n == ROOT] + [n for n, _, _ in blocks if n != ROOT]
    return BlockTiers.build(names, block_tiers(cfg, sizes))

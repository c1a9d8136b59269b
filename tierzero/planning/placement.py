"""The split "auto" chooses for a model and a Config, as `tz.wrap` will choose it: each kind
placed "auto" filled into the device, then the host, then NVMe, after the room the step needs
(tierzero.layout.resolve_auto, [Note: split placement] in tierzero/layout/split.py), counted by
the same functions wrap uses (tierzero/layout/state_bytes.py)."""

from __future__ import annotations

import torch
from torch import nn

from tierzero.config import DTYPE_BYTES, KINDS, Config
from tierzero.layout import (BlockTiers, Blocks, KindSizes, ZeroStage, block_fetch_bytes, block_tiers, blocks_of,
                             fetch_window, flat_groups, frozen_bytes, kind_sizes, placement_order, resolve_auto,
                             state_room)


def _dtypes(cfg: Config) -> tuple[torch.dtype, torch.dtype]:
    return getattr(torch, cfg.compute_dtype_name(cuda=torch.cuda.is_available())), getattr(torch, cfg.grad_dtype)


def placed_blocks(model: nn.Module, cfg: Config, world_size: int = 1) -> Blocks:
    """(name, flat groups) of each block of `model` as `tz.wrap` builds them, in the placement
    order (root first)."""
    compute, _ = _dtypes(cfg)
    blocks = [(name, flat_groups(params, world_size, compute)) for name, _, params in blocks_of(model, cfg)]
    return [blocks[i] for i in placement_order([n for n, _ in blocks])]


def sizes_and_room(model: nn.Module, cfg: Config, world_size: int = 1) -> tuple[KindSizes, dict[str, int]]:
    """Bytes per block of each kind (placement order) and the room each tier offers the state,
    as `tz.wrap` counts them: less the fetched blocks and `cfg.device_reserve` on the device,
    the update's read-ahead on the host, the frozen parameters on their tier."""
    zero = ZeroStage(cfg.zero_stage, world_size)
    compute, grad = _dtypes(cfg)
    blocks = placed_blocks(model, cfg, world_size)
    sizes = kind_sizes(blocks, zero, compute.itemsize, grad.itemsize, state_dtype=cfg.optimizer_state_dtype,
                       master_itemsize=DTYPE_BYTES[cfg.master_dtype])
    fetched = {name: block_fetch_bytes(params, compute, world_size, cfg.zero_stage)
               for name, _, params in blocks_of(model, cfg)}
    room, _ = state_room(cfg, sizes, fetch_window(cfg, fetched, zero), frozen_bytes(blocks, zero, compute.itemsize))
    return sizes, room


def resolve_placement(model: nn.Module, cfg: Config, world_size: int = 1) -> Config:
    """`cfg` with its "auto" kinds resolved into splits for `model` (as it is when none is
    "auto"), as `tz.wrap` resolves them; the device room left for the step's working set is
    `cfg.device_reserve` (see `working_set`)."""
    if not any(getattr(cfg, k) == "auto" for k in KINDS):
        return cfg
    sizes, room = sizes_and_room(model, cfg, world_size)
    return resolve_auto(cfg, sizes, room)


def planned_tiers(model: nn.Module, cfg: Config, world_size: int = 1) -> BlockTiers:
    """Each block's tier per kind, as tz.wrap places `model` under `cfg` (splits and "auto"
    resolved by [Note: split placement]'s rule)."""
    cfg = resolve_placement(model, cfg, world_size)
    blocks = placed_blocks(model, cfg, world_size)
    if not cfg.is_split:
        return BlockTiers.uniform([name for name, _ in blocks], cfg)
    sizes, _ = sizes_and_room(model, cfg, world_size)
    return BlockTiers.build([n for n, _ in blocks], block_tiers(cfg, sizes))

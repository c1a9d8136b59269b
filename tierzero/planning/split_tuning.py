"""Optimizer-state splits for `tierzero tune` to weigh beside prefetch settings: the split "auto"
chooses and its neighbours that fit the budgets, and a recording changed to each split's updates
([Note: splits predicted from a recording])."""

from __future__ import annotations

import dataclasses
from typing import Mapping

from torch import nn

from tierzero.config import Config
from tierzero.planning.placement import flat_tensors
from tierzero.planning.placement import placement_plan
from tierzero.planning.recording import Leg, Recording

Split = str | Mapping[str, float]

STEPS = (0.0, 0.25, 0.5, 0.75, 1.0)
"""The share of the slower tier in the fixed splits weighed beside "auto"'s."""

# [Note: splits predicted from a recording]
# A split changes which blocks' optimizer states the overlapped step reads from NVMe: a block
# moved off NVMe updates from memory, a block moved onto it reads its master weights and moments
# (and its gradient where that is on NVMe) before its update. The recording (one split) is
# replayed with each update's reads made those of the candidate split, and the difference of its
# update waits taken against the replay of the recording as it ran ([Note: update waits as a
# difference]). Left out: the NVMe writes of the states (the replay has none of the updates'
# writes), and the speed of an update on a GPU (a block's update is the recorded CPU seconds
# wherever it runs). So the prediction ranks host/NVMe splits by their reads racing the forward;
# splits that move states to a GPU are weighed by the budgets, not by speed.


def split_candidates(model: nn.Module, cfg: Config, world_size: int = 1) -> list[tuple[str, Split, Split | None]]:
    """(name, optimizer_states split, grads) of "auto"'s choice at `cfg`'s budgets and the fixed
    splits between its two slowest tiers used (host and NVMe with nvme_dir, else device and host)
    at `STEPS` (grads None), those that fit the budgets (the placement plan), auto's first."""
    auto = placement_plan(model, cfg.replace(optimizer_states="auto", grads=None), world_size)
    fast, slow = ("host", "nvme") if cfg.nvme_dir is not None else ("device", "host")
    out = [("auto", auto.resolved.optimizer_states, auto.resolved.grads)]
    for f in STEPS:
        split: Split = slow if f == 1.0 else fast if f == 0.0 else {fast: 1.0 - f, slow: f}
        fixed = cfg.replace(optimizer_states=split, grads=None)
        if split != out[0][1] and not placement_plan(model, fixed, world_size).short():
            out.append((f"{slow}={f:g}", split, None))
    return out


def update_reads(model: nn.Module, cfg: Config, world_size: int = 1) -> dict[str, int]:
    """Per block, the NVMe bytes its update reads under `cfg` (its NVMe-homed master weights,
    moments and gradient; fp32 parameters where they are the master weights)."""
    tensors = flat_tensors(model, cfg, world_size)
    masters = {t.block for t in tensors if t.kind == "master"}
    out: dict[str, int] = {}
    for t in tensors:
        read = t.kind in ("master", "moments", "grads") or (t.kind == "params" and t.block not in masters)
        if t.home == "nvme" and read:
            out[t.block] = out.get(t.block, 0) + t.nbytes
    return out


def with_split(rec: Recording, reads: Mapping[str, int]) -> Recording:
    """`rec` with each update's NVMe reads those of another split (`reads`: `update_reads` of
    it): one read of the block's bytes, or none."""
    updates = [u._replace(reads=(Leg("nvme", "host", reads[u.block], 0.0),) if reads.get(u.block) else ())
               for u in rec.updates]
    return dataclasses.replace(rec, updates=updates)


__all__ = ["split_candidates", "update_reads", "with_split", "STEPS"]

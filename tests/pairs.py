"""For tests that train a tierzero-wrapped model beside its plain PyTorch twin, or on several ranks."""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

import tierzero as tz


def step_and_zero(optimizers: tuple[Any, ...], schedulers: tuple[Any, ...] = ()) -> None:
    """One optimizer step of each optimizer (then each scheduler), then zero_grad(), in the
    same order for the wrapped model and its twin."""
    for opt in optimizers:
        opt.step()
    for sched in schedulers:
        sched.step()
    for opt in optimizers:
        opt.zero_grad()


def clipped_step(model: Any, opt: Any, loss: Any, clip: float, world_size: int) -> tuple[float, float]:
    """One step of a tiered model on this rank's loss: backward, tz.clip_grad_norm_, step,
    zero_grad. (The loss averaged over the ranks, the global gradient norm before clipping.)"""
    loss.backward()
    norm = tz.clip_grad_norm_(model, clip).item()
    opt.step()
    opt.zero_grad()
    total = loss.detach().clone()
    if world_size > 1:
        dist.all_reduce(total)
    return total.item() / world_size, norm

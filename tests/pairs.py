"""For tests that train a tierzero-wrapped model beside its plain PyTorch twin."""

from __future__ import annotations

from typing import Any


def step_and_zero(optimizers: tuple[Any, ...], schedulers: tuple[Any, ...] = ()) -> None:
    """One optimizer step of each optimizer (then each scheduler), then zero_grad(), in the
    same order for the wrapped model and its twin."""
    for opt in optimizers:
        opt.step()
    for sched in schedulers:
        sched.step()
    for opt in optimizers:
        opt.zero_grad()

"""Shared pytest setup. Tests mirror the packages (tests/placement/ for tierzero.placement, ...);
what they share is here as fixtures, built on the plain functions of builders.py (models,
configs, state equality), gloo.py (a world of N ranks), pairs.py (a wrapped model beside its
plain twin) and exactness.py (the data-parallel accuracy bound).

`@pytest.mark.gpu` tests are skipped, with the reason shown, without CUDA.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import pytest
import torch
from torch import nn

import tierzero as tz
from builders import tier_config
from tierzero import runtime
from tierzero.config import Tier


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items or torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; run `make test-gpu` on a machine with one")
    for item in gpu_items:
        item.add_marker(skip)


@pytest.fixture
def wrapped() -> Iterator[Callable[..., nn.Module]]:
    """`wrapped(model, config=None)`: tz.wrap(model, config or a roomy host config); at teardown
    the device tier's peak is checked against its budget and every wrapped model is closed."""
    models: list[nn.Module] = []

    def make(model: nn.Module, config: tz.Config | None = None, **kw: Any) -> nn.Module:
        tz.wrap(model, config or tier_config(tier="host"), **kw)
        models.append(model)
        return model

    yield make
    for m in models:
        pm = runtime.placement_manager(m)
        assert pm.peak_bytes(Tier.DEVICE) <= pm.budget(Tier.DEVICE), (pm.peak_bytes(Tier.DEVICE), pm.budget(Tier.DEVICE))
        runtime.close(m)

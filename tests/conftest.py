"""Shared pytest setup: `@pytest.mark.gpu` tests are skipped, with the reason shown, without CUDA."""

import pytest


def pytest_collection_modifyitems(config, items):
    gpu_items = [item for item in items if "gpu" in item.keywords]
    if not gpu_items:
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; run `make test-gpu` on a machine with one")
    for item in gpu_items:
        item.add_marker(skip)

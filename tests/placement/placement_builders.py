"""Builders shared by placement's tests: a small manager over a temporary NVMe folder, and a
bit-for-bit comparison."""

import torch

from tierzero.config.config import Config
from tierzero.placement.manager import PlacementManager


def make(tmp_path, *, device="64KiB", host="64KiB", nvme_budget="1MiB", **kw):
    cfg = Config(device_budget=device, host_budget=host, nvme_dir=str(tmp_path / "nvme"),
                 nvme_budget=nvme_budget, checksums=True)
    return PlacementManager(cfg, wait_timeout_s=kw.pop("wait_timeout_s", 0.3), **kw)


def same(a, b):
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(
        a.detach().cpu().reshape(-1).view(torch.uint8), b.detach().cpu().reshape(-1).view(torch.uint8))

"""Room's eviction (tierzero/placement/eviction.py) on a host tier whose memory is one region:
the victims are the policy's, only those that open a window ([Note: arena windows])."""

from __future__ import annotations

import torch

from tierzero.config import Config, StandInConfig
from tierzero.config.tiernames import Tier
from tierzero.placement import PlacementManager, Residency
from tierzero.placement.tiers import ALIGNMENT, PinnedArena


def test_a_fragmented_arena_evicts_only_the_window_it_needs(tmp_path) -> None:
    cfg = Config(device_budget="64KiB", host_budget=6 * ALIGNMENT, nvme_dir=str(tmp_path / "nvme"),
                 nvme_budget="1MiB", streams="async", stand_in=StandInConfig(delay_seed=5))
    page = ALIGNMENT // 4
    with PlacementManager(cfg, wait_timeout_s=5) as pm:
        assert isinstance(pm.pool, PinnedArena)
        t = [pm.register(f"t{i}", torch.full((page,), float(i)), "nvme") for i in range(6)]
        pm.flush()
        for order in (range(6), (0, 2, 4, 1, 3, 5)):  # host copies on pages 0-5, then used in this order
            for i in order:
                pm.acquire(t[i], "host")
                pm.release(t[i], "host")
        assert pm.pool.try_alloc(1) is None  # the arena is full
        big = pm.register("big", torch.arange(2.0 * page), "nvme")
        pm.flush()
        assert torch.equal(pm.acquire(big, "host"), torch.arange(2.0 * page))
        pm.release(big, "host")
        # t0 and t1 open two pages (their latest, t1, third least recent); LRU alone would have
        # evicted t0, t2, t4 and t1 before two adjacent pages were free
        held = {h.name: pm.record(h).residency[Tier.HOST] is Residency.RESIDENT for h in t}
        assert held == {"t0": False, "t1": False, "t2": True, "t3": True, "t4": True, "t5": True}
        for i in (2, 3, 4, 5):
            assert torch.equal(pm.acquire(t[i], "host"), torch.full((page,), float(i)))
            pm.release(t[i], "host")

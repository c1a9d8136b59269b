"""Room's eviction (tierzero/placement/eviction.py) on a host tier whose memory is one region:
the victims are the policy's, only those that open a window ([Note: arena windows]); by default the
least recently used, and a policy is pluggable."""

from __future__ import annotations

import pytest
import torch

from placement_builders import make, same
from tierzero.config import Config, StandInConfig
from tierzero.config.tiernames import Tier
from tierzero.placement.handles import TensorHandle
from tierzero.placement import PlacementManager, Residency
from tierzero.placement.storage.tiers import ALIGNMENT, PinnedArena


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


def test_a_prefetched_copy_not_used_yet_is_evicted_last_whatever_the_policy_ranks_first(tmp_path) -> None:
    """The runtime's policy ranks by next use in its block trace, and puts the tensors of no
    block (activation packs, optimizer states read ahead) first; a read just made must still go
    last, or the packs read ahead for backward are pushed out and read again. A host copy that
    a move to the device read has served its read."""
    n = 1024
    cfg = Config(device_budget=4 * n * 4, host_budget=3 * n * 4, nvme_dir=str(tmp_path / "nvme"), nvme_budget="1MiB")
    with PlacementManager(cfg, wait_timeout_s=5) as pm:
        t = {name: pm.register(name, torch.full((n,), float(i)), "nvme") for i, name in enumerate("abcde")}
        pm.flush()

        class NamesFirst:  # like the prefetcher: some tensors first whatever their use
            def order(self, candidates):
                return sorted(candidates, key=lambda h: h.name)

        pm.room.policy = NamesFirst()
        assert pm.prefetch(t["a"], "host")  # read ahead, not used yet
        pm.acquire(t["b"], "host")  # used
        pm.release(t["b"], "host")
        assert pm.prefetch(t["c"], "host")  # read ahead, then read by the move to the device
        pm.flush()
        pm.acquire(t["c"], "device")
        pm.release(t["c"], "device")
        host = lambda: {k: pm.record(h).residency[Tier.HOST] is Residency.RESIDENT for k, h in t.items()}
        assert host() == {"a": True, "b": True, "c": True, "d": False, "e": False}
        pm.acquire(t["d"], "host")  # room for one: the policy ranks a first, but a is unused
        pm.release(t["d"], "host")
        assert host() == {"a": True, "b": False, "c": True, "d": True, "e": False}
        pm.acquire(t["e"], "host")  # c served its move: used, evicted before a
        pm.release(t["e"], "host")
        assert host() == {"a": True, "b": False, "c": False, "d": True, "e": True}
        assert torch.equal(pm.acquire(t["a"], "host"), torch.zeros(n))
        pm.release(t["a"], "host")


def test_a_fragmented_arena_writes_back_only_the_dirty_copies_of_one_window(tmp_path) -> None:
    """A shortfall on a host tier of one region writes home the dirty copies of one window,
    not the least recently used ones until enough bytes are coming: those need not lie
    together, and each write-back that opens no window is a gradient written and read again."""
    cfg = Config(device_budget="64KiB", host_budget=6 * ALIGNMENT, nvme_dir=str(tmp_path / "nvme"),
                 nvme_budget="1MiB", streams="async", stand_in=StandInConfig(delay_seed=3))
    page = ALIGNMENT // 4
    with PlacementManager(cfg, wait_timeout_s=5) as pm:
        assert isinstance(pm.pool, PinnedArena)
        t = [pm.register(f"t{i}", torch.zeros(page), "nvme") for i in range(6)]
        big = pm.register("big", torch.arange(2.0 * page), "nvme")
        pm.flush()
        for i in range(6):  # pages 0-5, in address order
            pm.acquire(t[i], "host")
            pm.release(t[i], "host")
        for i in (0, 2, 4, 1, 3, 5):  # written lazily in this order: all dirty, t0 least recent
            pm.acquire(t[i], "host", overwrite=True).fill_(float(i + 1))
            pm.release(t[i], "host", dirty=True, lazy=True)
        pm.telemetry.reset_step()
        assert torch.equal(pm.acquire(big, "host"), torch.arange(2.0 * page))
        pm.release(big, "host")
        written = pm.telemetry.reset_step().nvme_write_bytes
        # t0 and t1 (pages 0-1) are written home and evicted; LRU alone would have written t0
        # and t2, found no window when they landed, then t4 and t1: four pages, not two
        assert written == 2 * ALIGNMENT
        held = {h.name: pm.record(h).residency[Tier.HOST] is Residency.RESIDENT for h in t}
        assert held == {"t0": False, "t1": False, "t2": True, "t3": True, "t4": True, "t5": True}
        for i in range(6):
            assert torch.equal(pm.acquire(t[i], "host"), torch.full((page,), float(i + 1)))
            pm.release(t[i], "host")


def test_eviction_is_lru_by_default_and_policy_pluggable(tmp_path):
    with make(tmp_path, device="32KiB", host="256KiB") as pm:
        t = [pm.register(f"t{i}", torch.full((2048,), float(i)), "host") for i in range(4)]  # 8 KiB each: 4 fit the device
        for i in range(4):
            pm.acquire(t[i])
            pm.release(t[i])
        pm.acquire(t[0])  # t0 is now the most recently used
        pm.release(t[0])
        pm.acquire(t[1])
        pm.release(t[1])
        t.append(pm.register("t4", torch.full((2048,), 4.0), "host"))
        assert same(pm.acquire(t[4]), torch.full((2048,), 4.0))  # evicts the LRU copy: t2
        pm.release(t[4])
        res = {h.name: pm.record(h).residency[Tier.DEVICE] for h in t}
        assert res["t2"] is Residency.ABSENT and all(r is Residency.RESIDENT for n, r in res.items() if n != "t2")

        seen = []

        class Biggest:
            def order(self, candidates):
                seen.append(list(candidates))
                return sorted(candidates, key=lambda h: h.name, reverse=True)

        pm.room.policy = Biggest()
        pm.acquire(t[2])
        pm.release(t[2])
        assert seen and all(isinstance(h, TensorHandle) for h in seen[0])
        assert pm.record(t[4]).residency[Tier.DEVICE] is Residency.ABSENT
        with pytest.raises(ValueError, match="order"):
            pm.room.policy = object()

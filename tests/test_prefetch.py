"""Prefetch policies, trace recording and replay, deviation handling, next-use eviction."""

from __future__ import annotations

import warnings

import pytest

import tierzero as tz
from tierzero.prefetch import (BytesAhead, FetchPhase, Lookahead, NoPrefetch, Prefetcher, TraceEvent, Unit,
                               policy_from_config)
from tierzero.tiers import Tier

UNITS = [Unit(f"b{i}", (f"b{i}.param",), 100 + i, nvme=i % 2 == 1) for i in range(5)]


class FakePM:
    def __init__(self) -> None:
        self.calls: list[tuple[str, Tier]] = []

    def prefetch(self, name: str, tier: Tier) -> bool:
        self.calls.append((name, tier))
        return True


def make(policy=Lookahead(2), room: int = 10_000, nvme_depth: int = 0) -> tuple[Prefetcher, FakePM]:
    pm = FakePM()
    return Prefetcher(pm, UNITS, policy, nvme_depth=nvme_depth, device_room=lambda: room), pm


def run(p: Prefetcher, order: list[str], key: object = "train") -> None:
    p.begin(key)
    for name in order:
        p.on_fetch(TraceEvent(FetchPhase.FORWARD, name), held=[])
    p.end()


def test_policies_select_nearest_units_that_fit() -> None:
    up = UNITS[1:]
    assert NoPrefetch().select(up, 10_000) == []
    assert Lookahead(2).select(up, 10_000) == UNITS[1:3]
    assert Lookahead(3).select(up, 202) == UNITS[1:2]  # the second does not fit the room
    assert BytesAhead(305).select(up, 10_000) == UNITS[1:3]
    assert BytesAhead(10_000).select(up, 310) == UNITS[1:4]


def test_policy_from_config() -> None:
    assert policy_from_config(tz.Config(prefetch=tz.PrefetchConfig(policy="none"))) == NoPrefetch()
    assert policy_from_config(tz.Config(prefetch=tz.PrefetchConfig(depth=3))) == Lookahead(3)
    cfg = tz.Config(device_budget=1000, prefetch=tz.PrefetchConfig(policy="bytes"))
    assert policy_from_config(cfg) == BytesAhead(500)


def test_first_iteration_records_later_ones_prefetch_ahead_cyclically() -> None:
    p, pm = make(Lookahead(2))
    order = ["b0", "b1", "b2", "b3", "b4"]
    run(p, order)
    assert pm.calls == []
    assert [e.unit for e in p.trace("train")] == order
    p.begin("train")
    p.on_fetch(TraceEvent(FetchPhase.FORWARD, "b0"), held=[])
    assert pm.calls == [("b1.param", Tier.DEVICE), ("b2.param", Tier.DEVICE)]
    pm.calls.clear()
    for name in order[1:]:
        p.on_fetch(TraceEvent(FetchPhase.FORWARD, name), held=["b0"])
    # At the end the trace wraps around to the next iteration's start (b0 is held: skipped).
    assert pm.calls[-2:] == [("b1.param", Tier.DEVICE), ("b2.param", Tier.DEVICE)]
    p.end()
    assert p.deviations == 0


def test_nvme_units_are_read_into_host_further_ahead() -> None:
    p, pm = make(Lookahead(1), nvme_depth=3)
    run(p, ["b0", "b1", "b2", "b3", "b4"])
    p.begin("train")
    p.on_fetch(TraceEvent(FetchPhase.FORWARD, "b0"), held=[])
    assert pm.calls == [("b1.param", Tier.DEVICE), ("b1.param", Tier.HOST), ("b3.param", Tier.HOST)]


def test_deviation_warns_once_falls_back_and_rerecords() -> None:
    p, pm = make(Lookahead(1))
    run(p, ["b0", "b1", "b2"])
    with pytest.warns(UserWarning, match="differs from the recorded trace"):
        run(p, ["b0", "b2", "b1"])
    assert p.deviations == 1
    assert [e.unit for e in p.trace("train")] == ["b0", "b2", "b1"]
    pm.calls.clear()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        run(p, ["b0", "b2", "b1"])  # follows the new trace
        run(p, ["b0", "b1"])  # shorter: deviates again, silently
    assert p.deviations == 2
    assert ("b2.param", Tier.DEVICE) in pm.calls


def test_traces_are_kept_per_key() -> None:
    p, _ = make()
    run(p, ["b0", "b1", "b2"], key="train")
    run(p, ["b0", "b1"], key="eval")
    run(p, ["b0", "b1", "b2"], key="train")
    assert p.deviations == 0


def test_eviction_order_is_farthest_next_use_first() -> None:
    p, _ = make(NoPrefetch())
    order = ["b0", "b1", "b2", "b3", "b3", "b2", "b1", "b0"]
    run(p, order)
    p.begin("train")
    for name in order[:4]:
        p.on_fetch(TraceEvent(FetchPhase.FORWARD, name), held=[])
    # Next uses from position 4: b3 at 4, b2 at 5, b1 at 6, b0 at 7; unknown tensors first.
    assert p.order(["b0.param", "b2.param", "x.grad", "b3.param", "b1.param"]) == \
        ["x.grad", "b0.param", "b1.param", "b2.param", "b3.param"]
    for name in order[4:]:
        p.on_fetch(TraceEvent(FetchPhase.FORWARD, name), held=[])
    p.end()
    assert p.order(["b1.param", "b0.param"]) == ["b1.param", "b0.param"]  # no iteration: LRU order kept

"""Prefetch policies, trace recording and replay, deviation handling, eviction order, learned
times, and a user's own policy training a model within its budgets."""

from __future__ import annotations

import copy
import warnings
from typing import Any, NamedTuple, Sequence

import pytest
import torch

import tierzero as tz
from tierzero.prefetch import prefetcher as prefetch
from tierzero import runtime
from tierzero.models import GPT, GPTConfig
from tierzero.prefetch.policies import (Adaptive, BlockTimes, BytesAhead, Fetch, FetchPhase, Lookahead,
    NoPrefetch, PrefetchPolicy, PrefetchView, TraceEvent, Unit, policy_from_config)
from tierzero.placement import CopyStreams
from tierzero.placement.residency import Residency
from tierzero.placement.telemetry import Telemetry
from tierzero.config.tiernames import Tier

D, H = Tier.DEVICE, Tier.HOST


class FakeHandle(NamedTuple):
    name: str
    nbytes: int
    home: Tier


def unit(i: int, nvme: bool) -> Unit:
    h = FakeHandle(f"b{i}.param", 100 + i, Tier.NVME if nvme else Tier.HOST)
    return Unit(f"b{i}", (h,), h.nbytes, nvme)


UNITS = [unit(i, nvme=i % 2 == 1) for i in range(5)]


class FakeRecord:
    def __init__(self) -> None:
        self.residency = dict.fromkeys(Tier, Residency.ABSENT)


class FakePM:
    """What the Prefetcher uses of a PlacementManager; prefetches are recorded, and make the
    copy FETCHING."""

    def __init__(self, host_free: int = 10_000) -> None:
        self.calls: list[tuple[str, Tier]] = []
        self.speculative: list[tuple[str, Tier]] = []
        self.telemetry = Telemetry()
        self.config = tz.Config()
        self.streams = CopyStreams(torch.device("cpu"))
        self.host_free = host_free
        self.records: dict[str, FakeRecord] = {}

    def prefetch(self, handles: FakeHandle | Sequence[FakeHandle], tier: Tier, *, speculative: bool = False) -> bool:
        for h in (handles,) if isinstance(handles, FakeHandle) else handles:
            self.calls.append((h.name, tier))
            if speculative:
                self.speculative.append((h.name, tier))
            if tier is not h.home:
                self.record(h).residency[tier] = Residency.FETCHING
        return True

    def record(self, h: FakeHandle | Sequence[FakeHandle]) -> FakeRecord | tuple[FakeRecord, ...]:
        if not isinstance(h, FakeHandle):
            return tuple(self.records.setdefault(x.name, FakeRecord()) for x in h)
        return self.records.setdefault(h.name, FakeRecord())

    def free_bytes(self, tier: Tier, counting: Sequence[FakeHandle] = ()) -> int:
        cached = sum(h.nbytes for h in counting if self.record(h).residency[tier] is Residency.RESIDENT)
        return self.host_free + cached


def make(policy: Any = Lookahead(2, nvme_depth=0), room: int = 10_000, host_free: int = 10_000):
    pm = FakePM(host_free)
    return prefetch.Prefetcher(pm, UNITS, policy, device_free=lambda: room), pm


def run(p: prefetch.Prefetcher, order: list[str], key: object = "train") -> None:
    p.begin(key)
    for name in order:
        p.on_fetch(TraceEvent(FetchPhase.FORWARD, name), held=[])
        p.fetched()
    p.end()


class Greedy(PrefetchPolicy):
    """A user's policy: asks for every unit on both tiers at every fetch; evicts the nearest
    next use first when `reverse` (the worst order), leaving `drop` out of its answer."""

    def __init__(self, reverse: bool = False, drop: str | None = None) -> None:
        self.reverse, self.drop = reverse, drop
        self.views = 0

    def plan(self, view: PrefetchView) -> list[Fetch]:
        self.views += 1
        ups = list(view.upcoming())
        return [Fetch(u.unit.name, D) for u in ups] + [Fetch(u.unit.name, H) for u in ups]

    def victims(self, view: PrefetchView, candidates: list[str]) -> list[str]:
        order = super().victims(view, candidates)
        return [n for n in (order[::-1] if self.reverse else order) if n != self.drop]


def view(pos: int = 0, *, room: int = 10_000, host_room: int = 10_000, times: BlockTimes | None = None,
         where: dict[str, frozenset[Tier]] | None = None, wraps: bool = True) -> PrefetchView:
    trace = tuple(TraceEvent(FetchPhase.FORWARD, u.name) for u in UNITS)
    return PrefetchView(trace, pos, {u.name: u for u in UNITS}, frozenset({UNITS[pos].name}), wraps,
                        times or BlockTimes(), {D: room, H: host_room}.__getitem__,
                        lambda name: (where or {}).get(name, frozenset()),
                        {u.name: [i] for i, u in enumerate(UNITS)})


# ----------------------------------------------------------------------------- built-in policies


def test_builtins_plan_nearest_units_that_fit() -> None:
    assert NoPrefetch().plan(view()) == []
    assert NoPrefetch(nvme_depth=2).plan(view()) == [Fetch("b1", H)]  # b1, b2 ahead: b1 on NVMe
    assert Lookahead(2, nvme_depth=0).plan(view()) == [Fetch("b1", D), Fetch("b2", D)]
    assert Lookahead(3, nvme_depth=0).plan(view(room=202)) == [Fetch("b1", D)]  # b2 would not fit
    assert BytesAhead(305, nvme_depth=0).plan(view()) == [Fetch("b1", D), Fetch("b2", D)]
    assert BytesAhead(10_000, nvme_depth=0).plan(view(room=310)) == [Fetch(f"b{i}", D) for i in (1, 2, 3)]
    # Read-ahead wraps into the next iteration; device copies only where the view allows it.
    assert Lookahead(2, nvme_depth=3).plan(view(3)) == [Fetch("b4", D), Fetch("b0", D), Fetch("b1", H)]
    assert Lookahead(2, nvme_depth=0).plan(view(3, wraps=False)) == [Fetch("b4", D)]


def test_policy_from_config() -> None:
    assert policy_from_config(tz.Config(prefetch=tz.PrefetchConfig(policy="none"))) == NoPrefetch(4)
    assert policy_from_config(tz.Config()) == Adaptive(nvme_depth=4)  # the default
    assert policy_from_config(tz.Config(prefetch=tz.PrefetchConfig(policy="lookahead", depth=3, nvme_depth=1))) \
        == Lookahead(3, 1)
    cfg = tz.Config(device_budget=1000, prefetch=tz.PrefetchConfig(policy="bytes"))
    assert policy_from_config(cfg) == BytesAhead(500, 4)
    assert policy_from_config(tz.Config(prefetch={"policy": "adaptive", "nvme_depth": 2})) == Adaptive(nvme_depth=2)
    mine = Lookahead(7)
    assert policy_from_config(tz.Config(prefetch=mine)) is mine
    cfg = tz.Config(prefetch={"policy": "test_prefetch:Greedy", "options": {"reverse": True}})
    assert isinstance(policy_from_config(cfg), Greedy) and policy_from_config(cfg).reverse


@pytest.mark.parametrize("prefetch_cfg,match", [
    ({"policy": "always"}, "expected one of 'none', 'lookahead', 'bytes', 'adaptive', a dotted path"),
    ({"policy": "no_such_module.Policy"}, "module 'no_such_module' does not import"),
    ({"policy": "test_prefetch.NoSuchClass"}, "has no attribute 'NoSuchClass'"),
    ({"policy": "test_prefetch.FakePM"}, "FakePM is not a class implementing tz.PrefetchPolicy"),
    ({"policy": "test_prefetch.Greedy", "options": {"depth": 3}}, "do not fit Greedy"),
    ({"policy": "lookahead", "options": {"depth": 3}}, "only for a policy class named by dotted path"),
    ({"policy": Greedy}, "got the class Greedy; pass an object"),
])
def test_bad_policies_are_refused_naming_what_is_accepted(prefetch_cfg: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tz.Config(prefetch=prefetch_cfg)


def test_adaptive_asks_just_early_enough() -> None:
    timed = Adaptive(nvme_depth=0)  # no read-ahead floor: what the times ask for only
    # Slow compute (1 s per block) against fast copies: the next two blocks (the next decision
    # may come late)...
    slow = BlockTimes([1.0] * 5, {(u.name, t): 0.01 for u in UNITS for t in (D, H)})
    assert timed.plan(view(1, times=slow)) == [Fetch("b2", D), Fetch("b3", D)]
    # ... and the unit after them, on NVMe, read into host, so its device copy starts from there.
    assert timed.plan(view(3, times=slow)) == [Fetch("b4", D), Fetch("b0", D), Fetch("b1", H)]
    # The default also keeps reads of the next nvme_depth units in flight.
    assert timed.plan(view(2, times=slow)) == [Fetch("b3", D), Fetch("b4", D)]
    assert Adaptive().plan(view(2, times=slow)) == [Fetch("b3", D), Fetch("b4", D), Fetch("b1", H)]
    # Copies as slow as compute: further ahead, NVMe units read into host before their turn.
    fast = BlockTimes([0.01] * 5, {(u.name, t): 0.01 for u in UNITS for t in (D, H)})
    assert timed.plan(view(0, times=fast)) == [Fetch(f"b{i}", D) for i in (1, 2, 3, 4)]
    assert timed.plan(view(0, times=fast, room=202)) == [Fetch("b1", D), Fetch("b3", H)]
    # Before anything is learned it acts as Lookahead(1).
    assert Adaptive(nvme_depth=2).plan(view(0)) == Lookahead(1, 2).plan(view(0))


# ------------------------------------------------------------------------------- prefetcher


def test_first_iteration_records_later_ones_prefetch_ahead_cyclically() -> None:
    p, pm = make(Lookahead(2, nvme_depth=0))
    order = ["b0", "b1", "b2", "b3", "b4"]
    run(p, order)
    assert pm.calls == []
    assert [e.unit for e in p.trace("train")] == order
    p.begin("train")
    p.on_fetch(TraceEvent(FetchPhase.FORWARD, "b0"), held=[])
    assert pm.calls == [("b1.param", D), ("b2.param", D)]
    # the next block for sure, the one after it only into free room ([Note: read further ahead
    # only into free room])
    assert pm.speculative == [("b2.param", D)]
    pm.calls.clear()
    for name in order[1:]:
        p.on_fetch(TraceEvent(FetchPhase.FORWARD, name), held=["b0"])
    # At the end the trace wraps around to the next iteration's start (b0 is held: skipped).
    assert pm.calls[-2:] == [("b1.param", D), ("b2.param", D)]
    p.end()
    assert p.deviations == 0


def test_nvme_units_are_read_into_host_further_ahead_once() -> None:
    p, pm = make(Lookahead(1, nvme_depth=3))
    run(p, ["b0", "b1", "b2", "b3", "b4"])
    p.begin("train")
    p.on_fetch(TraceEvent(FetchPhase.FORWARD, "b0"), held=[])
    # b1's device copy reads it from NVMe itself: no second read into host.
    assert pm.calls == [("b1.param", D), ("b3.param", H)]


def test_the_prefetcher_clips_a_policy_to_the_rooms() -> None:
    p, pm = make(Greedy(), room=202, host_free=210)
    run(p, ["b0", "b1", "b2", "b3", "b4"])
    p.begin("train")
    p.on_fetch(TraceEvent(FetchPhase.FORWARD, "b0"), held=[])
    # Asked for every unit on both tiers: b1 fits the device room (b2 would not); of the NVMe
    # units, b3 fits the host room (b1 comes to the device from NVMe itself).
    assert pm.calls == [("b1.param", D), ("b3.param", H)]


def test_a_policy_answer_that_is_no_fetch_is_refused() -> None:
    class Odd(PrefetchPolicy):
        def plan(self, view: PrefetchView) -> list[Any]:
            return [("b9", D)]

    p, _ = make(Odd())
    run(p, ["b0", "b1"])
    p.begin("train")
    with pytest.raises(ValueError, match=r"plan\(\) gave \('b9', <Tier.DEVICE.*expected Fetch\(unit, tier\)"):
        p.on_fetch(TraceEvent(FetchPhase.FORWARD, "b0"), held=[])


def test_deviation_warns_once_falls_back_and_rerecords() -> None:
    p, pm = make(Lookahead(1, nvme_depth=0))
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
    assert ("b2.param", D) in pm.calls


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
    h = {u.name: u.tensors[0] for u in UNITS}
    other = FakeHandle("x.grad", 4, Tier.HOST)
    # Next uses from position 4: b3 at 4, b2 at 5, b1 at 6, b0 at 7; tensors of no unit first.
    assert p.order([h["b0"], h["b2"], other, h["b3"], h["b1"]]) == [other, h["b0"], h["b1"], h["b2"], h["b3"]]
    for name in order[4:]:
        p.on_fetch(TraceEvent(FetchPhase.FORWARD, name), held=[])
    p.end()
    assert p.order([h["b1"], h["b0"]]) == [h["b1"], h["b0"]]  # no iteration: LRU order kept


def test_eviction_follows_the_policy_and_keeps_left_out_units_last() -> None:
    p, _ = make(Greedy(reverse=True, drop="b4"))
    run(p, ["b0", "b1", "b2", "b3", "b4"])
    p.begin("train")
    p.on_fetch(TraceEvent(FetchPhase.FORWARD, "b0"), held=[])
    h = {u.name: u.tensors[0] for u in UNITS}
    # Greedy(reverse) evicts the nearest next use first, and leaves b4 out of its answer.
    assert p.order([h["b4"], h["b3"], h["b1"], h["b2"]]) == [h["b1"], h["b2"], h["b3"], h["b4"]]


def test_times_are_learned_from_fetch_spans_and_moves(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = iter([float(t) for t in range(100)])
    monkeypatch.setattr(prefetch, "_clock", lambda: next(clock))
    p, pm = make(NoPrefetch())
    order = ["b0", "b1", "b2"]
    for read_s in (0.5, 0.3):
        p.begin("train")
        for name in order:
            p.on_fetch(TraceEvent(FetchPhase.FORWARD, name), held=[])
            pm.telemetry.record_stall("device", 0.25, {"read": 0.25})  # the fetch waited
            p.fetched()
            t = p._it.marks[-1].start
        pm.telemetry.record_move("b1.param", "nvme", "host", 101, t, t + read_s)
        pm.telemetry.record_move("b1.param", "host", "device", 101, t, t + 0.1)
        p.end()
    # The clock ticks once per call: begin, each on_fetch, end. A fetch's span (to the next
    # on_fetch) is 1 tick, 0.25 of it stalled. The last one's compute is known at the next
    # iteration's first fetch: 3 ticks (end, begin, on_fetch) less 0.25, mixed half and half
    # with the first measure (0.75, to the end of its iteration).
    times = p.times("train")
    assert [times.compute_s(i) for i in range(3)] == [0.75, 0.75, (0.75 + 2.75) / 2]
    assert times.fetch_s("b1", H) == pytest.approx(0.4) and times.fetch_s("b1", D) == pytest.approx(0.1)
    assert times.fetch_s("b3", H) == pytest.approx(0.4 / 101 * 103)  # never seen: by bytes
    spans = [e for e in pm.telemetry.chrome_trace()["traceEvents"] if e.get("cat") == prefetch.TRACK]
    assert [s["name"] for s in spans] == [f"forward {n}" for n in order] * 2
    assert spans[0]["args"]["stall_s"] == 0.25 and spans[0]["args"]["pos"] == 0


# ---------------------------------------------------------------------- a user's own policy


def test_a_user_policy_trains_like_plain_pytorch_within_budgets(tmp_path: Any) -> None:
    torch.manual_seed(0)
    ref = GPT(GPTConfig(vocab_size=97, seq_len=16, n_layer=5, n_head=2, n_embd=36))
    block = sum(p.numel() for p in ref.blocks[0].parameters()) * 4
    root = sum(p.numel() for n, p in ref.named_parameters() if not n.startswith("blocks.")) * 4
    toml = tmp_path / "tz.toml"
    toml.write_text(f'device_budget = {root + 2 * block + 8192}\nhost_budget = "64MiB"\n'
                    f'nvme_dir = "{tmp_path}"\nparams = "nvme"\ncompute_dtype = "float32"\n'
                    '[prefetch]\npolicy = "test_prefetch.Greedy"\noptions = {reverse = true}\n')
    model = tz.wrap(copy.deepcopy(ref), tz.Config.from_file(toml))
    state = runtime.state_of(model)
    policy = state.ctx.prefetcher.policy
    assert isinstance(policy, Greedy) and policy.reverse
    pm = runtime.placement_manager(model)
    # tz.AdamW computes what torch's fused AdamW does, bit for bit
    opt, ropt = tz.AdamW(model, lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    g = torch.Generator().manual_seed(1)
    try:
        for step in range(4):
            x = torch.randint(0, 97, (3, 16), generator=g)
            loss, rloss = model(x, x).loss, ref(x, x).loss
            torch.testing.assert_close(loss, rloss, rtol=0, atol=0, msg=f"loss at step {step}")
            loss.backward()
            rloss.backward()
            for o in (opt, ropt):
                o.step()
                o.zero_grad()
        for (name, p), rp in zip(model.state_dict().items(), ref.state_dict().values()):
            torch.testing.assert_close(p, rp, rtol=0, atol=0, msg=name)
        assert policy.views > 0  # it was asked, at every fetch after the first step
        for tier in (Tier.DEVICE, Tier.HOST):
            assert 0 < pm.peak_bytes(tier) <= pm.budget(tier), tier
    finally:
        runtime.close(model)

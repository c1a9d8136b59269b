"""Random sequences of placement operations against a reference dict, with tight budgets."""

import threading
import uuid

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tierzero.config.config import Config
from tierzero.placement.handles import Kind, TensorHandle
from tierzero.placement.manager import PlacementManager
from tierzero.placement.residency import Residency
from tierzero.placement.storage.tiers import ALIGNMENT, round_up
from tierzero.config.tiernames import Tier

DTYPES = (torch.float32, torch.bfloat16, torch.int64)
HOMES = (Tier.DEVICE, Tier.HOST, Tier.NVME)
MAX_HELD = 2  # pins held across operations (each op may take one more)


def random_tensor(numel, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype is torch.int64:
        return torch.randint(-(2**40), 2**40, (numel,), generator=g)
    return torch.randn(numel, generator=g).to(dtype)


def bits(t):
    return t.detach().cpu().reshape(-1).view(torch.uint8)


def assert_same(t, ref, what):
    assert t.dtype == ref.dtype and t.shape == ref.shape, what
    assert torch.equal(bits(t), bits(ref)), what


def modify(t, how):
    if how == 0:
        t.add_(3)
    elif how == 1:
        t.neg_()
    else:
        t.view(-1)[:: 3].fill_(-7)


op_names = st.sampled_from(["cycle", "cycle", "cycle", "hold", "unhold", "prefetch", "prefetch",
                            "drop", "store", "read", "flush"])


@settings(max_examples=20, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                 HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_placement_sequences_match_reference(tmp_path, data):
    n = data.draw(st.integers(100, 300), label="tensors")
    specs = data.draw(st.lists(st.tuples(st.integers(1, 2501), st.sampled_from(DTYPES), st.sampled_from(HOMES)),
                               min_size=n, max_size=n), label="specs")
    seed = data.draw(st.integers(0, 2**31 - 1), label="seed")
    kinds = (Kind.PARAM, Kind.EXP_AVG, Kind.MASTER)
    ref = {(f"layers.{i}", kinds[i % 3]): random_tensor(numel, dtype, seed + i)
           for i, (numel, dtype, _) in enumerate(specs)}
    homes = {name: home for name, (_, _, home) in zip(ref, specs)}
    bucket = {name: round_up(t.numel() * t.element_size()) for name, t in ref.items()}
    biggest = max(bucket.values())
    homed = {tier: sum(bucket[k] for k in ref if homes[k] is tier) for tier in HOMES}
    cfg = Config(device_budget=homed[Tier.DEVICE] + 3 * biggest, host_budget=homed[Tier.HOST] + 6 * biggest,
                 nvme_budget=homed[Tier.NVME] + ALIGNMENT, nvme_dir=str(tmp_path / f"nvme-{uuid.uuid4().hex}"),
                 io={"threads": 2, "block_size": "64KiB"}, checksums=True)
    threads_before = set(threading.enumerate())
    pm = PlacementManager(cfg, wait_timeout_s=20)
    over = []
    for b in pm.budgets.values():
        b.add_hook(lambda tier, used, limit=b.limit: over.append((tier, used)) if used > limit else None)

    held: list[tuple[TensorHandle, Tier, torch.Tensor]] = []
    names = list(ref)
    handles: dict[tuple[str, Kind], TensorHandle] = {}
    pick_name = st.sampled_from(names)
    pick_tier = st.sampled_from([Tier.DEVICE, Tier.HOST])

    def pins_of(name):
        return sum(1 for h in held if h[0] is handles[name])

    def release(name, tier, t, can_modify):
        dirty = False
        if can_modify and data.draw(st.booleans(), label="modify"):
            modify(t, data.draw(st.integers(0, 2), label="how"))
            ref[name] = t.detach().cpu().clone()
            dirty = True
        dirty = dirty or data.draw(st.booleans(), label="dirty anyway")
        pm.release(handles[name], tier, dirty=dirty)

    try:
        for name in names:
            owner, kind = name
            handles[name] = pm.register(owner, ref[name], homes[name], kind=kind)
        assert pm.handles == tuple(handles.values())
        for step in range(data.draw(st.integers(50, 250), label="ops")):
            op = data.draw(op_names, label="op")
            name, tier = data.draw(pick_name, label="name"), data.draw(pick_tier, label="tier")
            h = handles[name]
            where = f"step {step}: {op} {h.name} {tier} ({pm.record(h)!r})"
            if op == "cycle":
                t = pm.acquire(h, tier)
                assert_same(t, ref[name], where)
                release(name, tier, t, can_modify=pins_of(name) == 0)
            elif op == "hold" and len(held) < MAX_HELD:
                t = pm.acquire(h, tier)
                assert_same(t, ref[name], where)
                held.append((h, tier, t))
            elif op == "unhold" and held:
                h, tier, t = held.pop(data.draw(st.integers(0, len(held) - 1), label="which"))
                name = (h.owner, h.kind)
                release(name, tier, t, can_modify=pins_of(name) == 0)
            elif op == "prefetch":
                pm.prefetch(h, tier)
            elif op == "drop" and tier is not homes[name] and not any(x[0] is h and x[1] is tier for x in held):
                pm.drop(h, tier)
                assert pm.record(h).residency[tier] is Residency.ABSENT
            elif op == "store":
                new = random_tensor(ref[name].numel(), ref[name].dtype, seed - step)
                pm.store(h, new)
                ref[name] = new
                for x in held:
                    if x[0] is h:
                        assert_same(x[2], new, where + " (held copy after store)")
            elif op == "read":
                assert_same(pm.read(h), ref[name], where)
            elif op == "flush":
                pm.flush()
            assert all(pm.bytes_used(t) <= pm.budget(t) for t in Tier), where
        while held:
            h, tier, _ = held.pop()
            pm.release(h, tier)
        pm.flush()
        for name, h in handles.items():
            assert_same(pm.read(h), ref[name], f"final read {h.name}")
            for tier in (Tier.DEVICE, Tier.HOST):
                assert_same(pm.acquire(h, tier), ref[name], f"final acquire {h.name} {tier}")
                pm.release(h, tier)
        assert not over, over[:5]
        assert all(pm.peak_bytes(t) <= pm.budget(t) for t in Tier)
    finally:
        pm.close()
    assert pm.pool.in_use_count == 0 and pm.pool.cached_bytes == 0
    assert pm.swap.allocator.used_bytes == 0
    assert all(pm.bytes_used(t) == 0 for t in Tier)
    assert set(threading.enumerate()) <= threads_before

"""Waits for room and for moves (tierzero/placement/waiting.py): budgets are never exceeded, a
wait ends on another thread's release or unregister, and a wait nothing can end fails soon,
naming the pinned copies and the fix."""

import threading
import time

import pytest
import torch

from placement_builders import make, same
from tierzero.placement.handles import Kind, TensorHandle
from tierzero.placement.residency import Residency
from tierzero.config.tiernames import Tier


def test_budgets_never_exceeded_and_everything_pinned_raises(tmp_path):
    with make(tmp_path, device="24KiB", wait_timeout_s=0.2) as pm:
        over = []
        for b in pm.budgets.values():
            b.add_hook(lambda tier, used, b=b: over.append((tier, used)) if used > b.limit else None)
        t = [pm.register(f"t{i}", torch.randn(2500), "host") for i in range(3)]
        pm.acquire(t[0])
        pm.acquire(t[1])
        assert pm.prefetch(t[2]) is False  # no room without evicting a pinned copy
        with pytest.raises(RuntimeError, match=r"'t2': no room .* device tier .* pinned copies .*'t0', 1"):
            pm.acquire(t[2])
        pm.release(t[0])
        assert pm.prefetch(t[2]) is True and pm.prefetch(t[2]) is True
        pm.flush()
        assert pm.record(t[0]).residency[Tier.DEVICE] is Residency.ABSENT
        assert not over and pm.peak_bytes("device") <= pm.budget("device")


def test_acquire_waits_for_a_release_by_another_thread(tmp_path):
    with make(tmp_path, device="12KiB", wait_timeout_s=10) as pm:
        a = pm.register("a", torch.randn(2500), "host")
        b = pm.register("b", torch.randn(2500), "host")
        pm.acquire(a)
        threading.Timer(0.1, pm.release, args=(a,)).start()
        t0 = time.monotonic()
        assert same(pm.acquire(b), pm.read(b))
        assert time.monotonic() - t0 >= 0.05
        pm.release(b)


def test_threads_sharing_tight_budgets(tmp_path):
    errors = []
    with make(tmp_path, device="40KiB", host="160KiB", wait_timeout_s=30) as pm:
        over = []
        for b in pm.budgets.values():
            b.add_hook(lambda tier, used, limit=b.limit: over.append(tier) if used > limit else None)
        expected = {}
        handles = []
        for i in range(24):
            data = torch.randn(1000 + 37 * i)
            handles.append(pm.register(f"t{i}", data, ("nvme", "host")[i % 2]))
            expected[handles[i]] = data

        def worker(k):
            try:
                g = torch.Generator().manual_seed(k)
                mine = [handles[i] for i in range(k, 24, 3)]  # each thread writes only its own tensors
                for _ in range(60):
                    name = mine[int(torch.randint(len(mine), (1,), generator=g))]
                    other = handles[int(torch.randint(24, (1,), generator=g))]
                    pm.prefetch(other, "device")
                    t = pm.acquire(name, "device")
                    assert torch.equal(t.cpu(), expected[name])
                    t.add_(1.0)
                    expected[name] = expected[name] + 1.0
                    pm.release(name, "device", dirty=True)
            except BaseException as e:  # surfaced below
                errors.append(e)

        threads = [threading.Thread(target=worker, args=(k,)) for k in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        pm.flush()
        for name, ref in expected.items():
            assert torch.equal(pm.read(name), ref)
        assert not over


def test_no_room_names_the_pinned_copies_and_the_fix(tmp_path):
    """A wait for room that only this thread's own pins block can never end: it raises within
    seconds (stuck_after_s, not the timeout), naming the pinned copies and the budget that would
    hold both."""
    with make(tmp_path, device="16KiB", wait_timeout_s=30) as pm:
        a = pm.register("layers.2", torch.randn(2500), "host", kind=Kind.PARAM)  # 10000 bytes
        pm.acquire(a)
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"scratch\.reserve\('gather layers.3', 'device'\): tensor 'gather "
                                               r"layers.3': no room for .* on the device tier and none can come: "
                                               r".* pinned copies \(name, pins\): \[\('layers.2.param', 1\)\]; "
                                               r"raise device_budget to at least \d+ bytes"):
            pm.scratch.reserve(8000, what="gather layers.3")
        assert 2 <= time.monotonic() - t0 < 5
        pm.release(a)
        buf = pm.scratch.reserve(8000, what="gather layers.3")  # evicts a's unpinned copy
        assert buf.numel() >= 8000 and pm.record(a).residency[Tier.DEVICE] is Residency.ABSENT
        pm.scratch.free(buf)


def test_a_wait_on_another_threads_pin_waits_up_to_the_timeout(tmp_path):
    with make(tmp_path, device="16KiB", wait_timeout_s=0.3) as pm:
        a = pm.register("layers.2", torch.randn(2500), "host", kind=Kind.PARAM)
        holder = threading.Thread(target=pm.acquire, args=(a,))
        holder.start()
        holder.join()
        t0 = time.monotonic()
        with pytest.raises(RuntimeError, match=r"no room for .* on the device tier after waiting 0.3 s"):
            pm.scratch.reserve(8000, what="gather layers.3")
        assert time.monotonic() - t0 >= 0.25
        pm.release(a)


def test_a_wait_ends_when_another_thread_unregisters_its_tensor(tmp_path):
    with make(tmp_path, device="12KiB", wait_timeout_s=10) as pm:
        a = pm.register("a", torch.randn(2500), "host")
        b = pm.register("b", torch.randn(2500), "host")
        pm.acquire(a)  # the device is full: acquiring b waits for room
        errors = []

        def acquire_b():
            try:
                pm.acquire(b)
            except KeyError as e:
                errors.append(e)

        waiter = threading.Thread(target=acquire_b)
        waiter.start()
        time.sleep(0.1)
        pm.unregister(b)
        waiter.join(5)
        assert not waiter.is_alive() and len(errors) == 1
        assert "acquire('b', 'device'): 'b' was unregistered by another thread meanwhile" in str(errors[0])
        pm.release(a)


def test_two_threads_each_waiting_for_room_the_other_holds_fail_within_seconds(tmp_path):
    """Thread A pins a, thread B pins b, then each waits for room only the other's release could
    make (step_in_backward's update thread against backward did this): nothing can move, so a wait
    fails after stuck_after_s, not after the 30 s timeout; the other then gets its room."""
    with make(tmp_path, device="24KiB", wait_timeout_s=30) as pm:
        a, b, c, d = (pm.register(n, torch.randn(2500), "host") for n in "abcd")  # 10000 bytes each
        pinned = threading.Barrier(2)
        outcome: dict[str, str] = {}

        def run(mine, wanted, name):
            pm.acquire(mine)
            pinned.wait()
            try:
                pm.acquire(wanted)
                pm.release(wanted)
                outcome[name] = "got it"
            except RuntimeError as e:
                outcome[name] = str(e)
            finally:
                pm.release(mine)

        t0 = time.monotonic()
        threads = [threading.Thread(target=run, args=args) for args in ((a, c, "A"), (b, d, "B"))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(20)
        assert not any(t.is_alive() for t in threads) and time.monotonic() - t0 < 15
        failed = [v for v in outcome.values() if v != "got it"]
        assert len(failed) == 1 and "none can come" in failed[0] and "threads waiting for room there too" in failed[0]

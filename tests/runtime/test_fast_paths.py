"""The GPU's code path on the CPU: under the asynchronous stream stand-in (poisoned, with delays)
the fast paths are on at world size 1 and 2 and give the very bits of the inline step; the
stand-in catches a wait removed on purpose (the mutation check); gradients leave for the host
by an asynchronous copy; an update kernel that would mix devices is refused at wrap."""

from __future__ import annotations

import copy
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import tierzero as tz
from tierzero import optim, runtime
from tierzero.placement import PlacementManager, plans
from tierzero.placement.residency import ResidencyTable
from builders import assert_state_equal, tier_config
from dp_model import GLOBAL_BATCH, device_budget, global_batches, make_model
from gloo import run_ranks
import builders

STAND_IN = tz.StandInConfig(poison=True, delay_seed=11, max_delay_s=0.003)
STEPS = 3


def config(nvme: Path, model: Any, world_size: int, streams: str, **kw: Any) -> tz.Config:
    return tier_config(nvme, device_budget=device_budget(model, world_size), streams=streams, stand_in=STAND_IN,
                       grads="host", **kw)


def train(model: Any, cfg: tz.Config, rank: int, world_size: int, *, clip: bool) -> dict[str, Any]:
    """STEPS steps of this rank's rows; the losses, the final state dict (every rank gathers) and
    which fast paths ran: the threads block updates ran on, early capture's count."""
    threads: list[str] = []
    step_flat = optim.TieredOptimizer._step_flat

    def recorded(opt: Any, *args: Any, **kw: Any) -> Any:
        threads.append(threading.current_thread().name.split("_")[0])
        return step_flat(opt, *args, **kw)

    optim.TieredOptimizer._step_flat = recorded
    try:
        tz.wrap(model, cfg)
        opt = tz.AdamW(model, lr=3e-3, weight_decay=0.1)
        rows = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
        losses = []
        for x, y in global_batches()[:STEPS]:
            loss = model(x[rows], y[rows]).loss
            loss.backward()
            if clip:
                tz.clip_grad_norm_(model, 0.5)
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        state = model.state_dict()
        return {"losses": losses, "state": state, "threads": sorted(set(threads)),
                "captures": runtime.state_of(model).ctx.account.captures}
    finally:
        optim.TieredOptimizer._step_flat = step_flat
        runtime.close(model)


def fast_and_inline(rank: int, world_size: int, out_dir: str) -> None:
    """Each rank: the stand-in with the fast paths against sync with the step inline, overlapped
    (clipped) and step_in_backward (unclipped); the results to out_dir/rank{r}.pt."""
    out = {}
    for name, kw, clip in [("overlap", {}, True), ("in_backward", {"step_in_backward": True}, False)]:
        for streams in ("async", "sync"):
            model = make_model()
            extra = kw if streams == "async" else {"overlap_step": False}
            cfg = config(Path(out_dir) / f"nvme-{name}-{streams}", model, world_size, streams, **extra)
            out[name, streams] = train(model, cfg, rank, world_size, clip=clip)
    torch.save(out, Path(out_dir) / f"rank{rank}.pt")


@pytest.mark.parametrize("world_size", [1, 2])
def test_fast_paths_active_under_the_stand_in_and_exact(tmp_path: Path, world_size: int) -> None:
    run_ranks(fast_and_inline, world_size, tmp_path / "init", str(tmp_path))
    for rank in range(world_size):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        for name, thread in [("overlap", "tierzero-step"), ("in_backward", "tierzero-update")]:
            fast, inline = got[name, "async"], got[name, "sync"]
            assert fast["threads"] == [thread], (rank, name, fast["threads"])  # updates on their own thread
            assert inline["threads"] == ["MainThread"], (rank, name, inline["threads"])
            assert fast["captures"] > 0, (rank, name)  # early capture took the shares on the device
            assert fast["losses"] == inline["losses"], (rank, name)
            assert_state_equal(fast["state"], inline["state"], f"rank {rank} {name}")


def parity(nvme: Path, streams: str) -> bool:
    """A GPT with its parameters and states on NVMe, trained beside its plain twin: whether every
    loss and the final state have the same bits (any error raised counts as a mismatch)."""
    torch.manual_seed(0)
    ref = builders.gpt(seq=16, layers=3, seed=None)
    model = copy.deepcopy(ref)
    cfg = tier_config(nvme, device_budget="256KiB", streams=streams, stand_in=STAND_IN)
    try:
        tz.wrap(model, cfg)
        opt, ropt = tz.AdamW(model, lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
        for step in range(STEPS):
            x = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(step))
            loss, rloss = model(x, x).loss, ref(x, x).loss
            if not torch.equal(loss, rloss):
                return False
            loss.backward()
            rloss.backward()
            for o in (opt, ropt):
                o.step()
                o.zero_grad()
        return all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), ref.state_dict().values()))
    except Exception:
        return False
    finally:
        runtime.close(model)


def test_mutation_check_a_wait_removed_fails_under_the_stand_in_and_passes_under_sync(
        tmp_path: Path, monkeypatch: Any) -> None:
    """Item 3 of issue 28: compute's wait for a fetched copy (and for a gradient's copy to the
    host) removed by patching it out. Parity holds under the stand-in with the wait and under
    sync without it; under the stand-in without it, it fails: a green run means the waits are there."""
    assert parity(tmp_path / "whole", "async")
    monkeypatch.setattr(ResidencyTable, "_compute_after", lambda self, waits: None)
    assert parity(tmp_path / "sync", "sync")
    assert not parity(tmp_path / "stand-in", "async")


def test_mutation_check_of_the_writeback_wait(tmp_path: Path, monkeypatch: Any) -> None:
    """A device copy written back to NVMe: its device-to-host copy waited for before the NVMe
    write of the staging buffer; without that wait the stand-in gives other bytes (or refuses
    to give the staging buffer back under a queued copy), sync does not notice."""
    def round_trip(streams: str) -> bool:
        slow = tz.StandInConfig(delay_seed=7, max_delay_s=0.05)  # the device-to-host copy waits ~50 ms
        cfg = tz.Config(device_budget="1MiB", host_budget="1MiB", nvme_dir=str(tmp_path / streams),
                        nvme_budget="4MiB", streams=streams, stand_in=slow)
        data = torch.randn(4000)
        try:
            with PlacementManager(cfg, wait_timeout_s=2) as pm:
                h = pm.register("w", data, "nvme")
                pm.acquire(h, "device").mul_(2)
                pm.release(h, "device", dirty=True)
                pm.flush()
                pm.drop(h, "device")
                return torch.equal(pm.read(h), data * 2)
        except Exception:
            return False

    assert round_trip("async")
    monkeypatch.setattr(plans, "wait_for_staging", lambda event: None)
    assert round_trip("sync")
    assert not round_trip("async")


def test_gradients_leave_for_the_host_by_an_asynchronous_copy(tmp_path: Path, monkeypatch: Any) -> None:
    written = []
    model = builders.gpt(seq=16, layers=2)
    tz.wrap(model, tier_config(tmp_path, tier="host", streams="async", stand_in=STAND_IN))
    pm = runtime.placement_manager(model)
    release = pm.release
    monkeypatch.setattr(pm, "release", lambda h, tier, **kw: (
        written.append(kw.get("written") is not None and not kw["written"].query()), release(h, tier, **kw))[1])
    try:
        x = torch.randint(0, 257, (2, 16))
        model(x, x).loss.backward()  # backward goes on while each gradient's copy is in flight
        assert True in written
        tz.AdamW(model, lr=1e-3).step()  # the optimizer's reads wait for the copies: no NaN
        assert all(v.isfinite().all() for v in model.state_dict().values())
    finally:
        runtime.close(model)


def test_a_gradient_placed_apart_is_copied_to_its_update(tmp_path: Path) -> None:
    """grads='host' with the optimizer states on the device: the update runs on the device on a
    copy of the gradient (never mixing devices), the same bits with asynchronous streams as with
    synchronous ones."""
    states = []
    for streams in ("async", "sync"):
        model = tz.wrap(builders.gpt(), tier_config(tier="device", grads="host", streams=streams))
        opt = tz.AdamW(model, lr=1e-3)
        for _ in range(2):
            model(torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(3))).logits.sum().backward()
            opt.step()
            opt.zero_grad()
        states.append(tz.full_state_dict(model))
        runtime.close(model)
    builders.assert_state_equal(states[0], states[1], "async against sync")

"""The overlapped step (tierzero/step_queue.py): opt.step() returns with its block updates still
queued; the next forward computes each block once its update is done. Compared with the same
model trained by plain torch (and with the inline step) every step, bit for bit."""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import pytest
import torch

import tierzero as tz
from tierzero import optim
from tierzero import runtime
from tierzero.models import GPT
from tierzero.runtime.step.step_queue import StepFailed
from tierzero.config import Tier
from tierzero.placement import Residency
from builders import tier_config
import builders

SEQ = 16


def gpt() -> GPT:
    return builders.gpt(vocab=131, seq=SEQ, layers=3, heads=2, width=36, seed=None)


def config(tmp_path: Any, **kw: Any) -> tz.Config:
    return tier_config(tmp_path, device_budget="256KiB", **kw)


def batch(step: int) -> torch.Tensor:
    return torch.randint(0, 131, (2, SEQ), generator=torch.Generator().manual_seed(step))


def pair(tmp_path: Any, **cfg: Any) -> tuple[Any, Any, Any, Any]:
    """A wrapped GPT and its plain twin, with tz.AdamW and torch's fused AdamW."""
    torch.manual_seed(0)
    ref = gpt()
    model = copy.deepcopy(ref)
    tz.wrap(model, config(tmp_path, **cfg))
    return model, ref, tz.AdamW(model, lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)


def forward_backward(model: Any, ref: Any, step: int) -> None:
    """Both models' loss on the step's batch, the same bits, then both backwards."""
    x = batch(step)
    loss, rloss = model(x, x).loss, ref(x, x).loss
    assert torch.equal(loss, rloss), step
    loss.backward()
    rloss.backward()


class Gate:
    """Holds the update of one block (by name) until opened; records which updates ran."""

    def __init__(self, monkeypatch: Any, block: str) -> None:
        self.block, self.open, self.ran = block, threading.Event(), []
        step_flat = optim.TieredOptimizer._step_flat

        def held(opt: Any, flat: Any, *args: Any, **kw: Any) -> None:
            if flat.name == self.block:
                assert self.open.wait(30), "the test never opened the gate"
            self.ran.append(flat.name)
            step_flat(opt, flat, *args, **kw)

        monkeypatch.setattr(optim.TieredOptimizer, "_step_flat", held)


def test_step_returns_before_its_updates_and_forward_waits_for_them(tmp_path: Any, monkeypatch: Any) -> None:
    model, ref, opt, ropt = pair(tmp_path)
    ctx = runtime.state_of(model).ctx
    flats = {f.name: f for f in runtime.state_of(model).flat_params(trainable=True)}
    gate = Gate(monkeypatch, "blocks.1")
    try:
        for step in range(3):
            forward_backward(model, ref, step)
            assert torch.equal(tz.clip_grad_norm_(model, 0.5), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
            gate.open.clear()
            gate.ran.clear()  # clipping waited for the last step's updates
            t0 = time.perf_counter()
            opt.step()
            opt.zero_grad()  # asks the queued updates to clear their gradients after them
            assert time.perf_counter() - t0 < 20  # returned with blocks.1's update held
            assert ctx.updating((flats["blocks.1"].param,)) and not flats["blocks.1"].grad.empty
            order = list(ctx.forward_order)  # the step's order: root, blocks.0, blocks.1, ...
            assert order[:3] == ["root", "blocks.0", "blocks.1"]
            assert set(gate.ran) <= {"root", "blocks.0"}  # the queue keeps the step's order
            ropt.step()
            ropt.zero_grad()
            threading.Timer(0.3, gate.open.set).start()  # the forward below waits at blocks.1
        x = batch(3)
        assert torch.equal(model(x, x).loss, ref(x, x).loss)
        assert all(f.grad.empty for f in flats.values())
        sd = model.state_dict()
        for k, v in ref.state_dict().items():
            assert torch.equal(sd[k], v), k
        assert runtime.step_stats(model).stall_s["host"] > 0.2  # the waits count as stalls
    finally:
        gate.open.set()
        runtime.close(model)


@pytest.mark.parametrize("overlap", [True, False], ids=["overlapped", "inline"])
def test_overlapped_and_inline_steps_match_torch_with_a_schedule(tmp_path: Any, overlap: bool) -> None:
    model, ref, opt, ropt = pair(tmp_path, overlap_step=overlap)
    warmup = lambda s: (s + 1) / 4  # noqa: E731  lr changes right after every step() returns
    sched, rsched = (torch.optim.lr_scheduler.LambdaLR(o, warmup) for o in (opt, ropt))
    assert (runtime.state_of(model).ctx.updates is not None) == overlap
    try:
        for step in range(4):
            forward_backward(model, ref, step)
            for o, s in ((opt, sched), (ropt, rsched)):
                o.step()
                s.step()
                o.zero_grad()
        sd = model.state_dict()  # right after the last step: it waits for the updates
        for k, v in ref.state_dict().items():
            assert torch.equal(sd[k], v), k
    finally:
        runtime.close(model)


@pytest.mark.filterwarnings("ignore:tierzero. the block order differs")  # the forward that raised
def test_a_failed_update_is_raised_by_the_next_forward_and_a_checkpoint_restores(tmp_path: Any,
                                                                                  monkeypatch: Any) -> None:
    torch.manual_seed(0)
    ref = gpt()
    model, twin = copy.deepcopy(ref), copy.deepcopy(ref)
    tz.wrap(model, config(tmp_path / "a"))
    tz.wrap(twin, config(tmp_path / "b"))
    opt, topt = tz.AdamW(model, lr=1e-2), tz.AdamW(twin, lr=1e-2)

    def train(m: Any, o: Any, step: int) -> torch.Tensor:
        x = batch(step)
        loss = m(x, x).loss
        loss.backward()
        o.step()
        o.zero_grad()
        return loss

    try:
        for step in range(2):
            assert torch.equal(train(model, opt, step), train(twin, topt, step))
        tz.save_checkpoint(tmp_path / "ckpt", model, opt)
        step_flat = optim.TieredOptimizer._step_flat

        def broken(self: Any, flat: Any, *args: Any, **kw: Any) -> None:
            if flat.name == "blocks.1":
                raise OSError(28, "No space left on device")
            step_flat(self, flat, *args, **kw)

        monkeypatch.setattr(optim.TieredOptimizer, "_step_flat", broken)
        x = batch(2)
        model(x, x).loss.backward()
        opt.step()  # returns; the update of layers.1 fails on the queue's thread
        opt.zero_grad()
        with pytest.raises(StepFailed, match=r"updating block 'blocks\.1'.*No space left on device.*partial step"):
            model(x, x)
        with pytest.raises(StepFailed):  # every later use says so too, until a checkpoint is loaded
            tz.clip_grad_norm_(model, 1.0)
        monkeypatch.setattr(optim.TieredOptimizer, "_step_flat", step_flat)
        tz.load_checkpoint(tmp_path / "ckpt", model, opt)
        for step in range(2, 4):
            assert torch.equal(train(model, opt, step), train(twin, topt, step)), step
    finally:
        runtime.close(model)
        runtime.close(twin)
    left = [p for d in ("a", "b") for p in (tmp_path / d).rglob("*") if p.is_file()]
    assert not left, left  # no swap file left behind


def test_a_block_whose_update_ends_while_the_one_before_it_computes_is_fetched_ahead_then(
        tmp_path: Any, monkeypatch: Any) -> None:
    """The prefetcher does not bring a block still being updated; it plans again as each update
    ends (StepContext.update_done), so a block whose update ends while the block before it
    computes is on its way before its own fetch, not copied on demand then."""
    model, ref, opt, ropt = pair(tmp_path, prefetch=tz.PrefetchConfig(policy="lookahead", depth=1))
    pm = runtime.placement_manager(model)
    flats = {f.name: f for f in runtime.state_of(model).flat_params(trainable=True)}
    blocks1 = flats["blocks.1"].param
    gate = Gate(monkeypatch, "blocks.1")
    seen: list[bool] = []

    def during_blocks0(module: Any, args: Any) -> None:  # after tierzero's own pre-hook fetched it
        ctx = runtime.state_of(model).ctx
        if not gate.open.is_set() and ctx.updating((blocks1,)):
            gate.open.set()
            deadline = time.monotonic() + 10
            while ctx.updating((blocks1,)) and time.monotonic() < deadline:
                time.sleep(0.001)
            # the update rewrote the parameters, so no device copy was left valid: a copy
            # there now was started after the update ended
            while pm.record(blocks1).residency[Tier.DEVICE] is Residency.ABSENT and time.monotonic() < deadline:
                time.sleep(0.001)
            seen.append(pm.record(blocks1).residency[Tier.DEVICE] is not Residency.ABSENT)

    hook = model.blocks[0].register_forward_pre_hook(during_blocks0)
    try:
        gate.open.set()
        forward_backward(model, ref, 0)  # the prefetcher records the block order
        gate.open.clear()
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
        forward_backward(model, ref, 1)  # blocks.1's update is held until blocks.0 computes
        assert seen == [True]
        for o in (opt, ropt):
            o.step()
            o.zero_grad()
        sd = model.state_dict()
        for k, v in ref.state_dict().items():
            assert torch.equal(sd[k], v), k
    finally:
        hook.remove()
        gate.open.set()
        runtime.close(model)

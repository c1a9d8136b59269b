"""The parts of a wrapped model's StepContext, seen from a real step: the device account every
holder of device room judges by, the phase and owner, and the schedule the blocks' hooks ask."""

from __future__ import annotations

import threading

import pytest
import torch

import builders
import tierzero as tz
from tierzero import runtime
from tierzero.config import Tier
from tierzero.runtime.step.schedule import PLAIN, LayerMajor
from tierzero.runtime.step.step_context import Phase


def test_the_device_account_is_the_room_of_fetches_and_the_prefetcher(wrapped) -> None:
    model = wrapped(builders.gpt(layers=2))
    ctx = runtime.state_of(model).ctx
    account, budget = ctx.account, ctx.pm.budget(Tier.DEVICE)
    assert account.free_bytes() == budget - account.homes and account.free_for_prefetch() == account.free_bytes()
    seen = []

    def during(module, args):  # the block's own pre-hook ran first: it is held now
        seen.append((dict(account.held), account.free_bytes(), ctx.step.phase, ctx.step.owner))

    handle = model.blocks[1].register_forward_pre_hook(during)
    x = torch.randint(0, 257, (2, 24))
    model(x).logits.float().square().mean().backward()
    handle.remove()
    (held, left, phase, owner), = seen
    assert "blocks.1" in held and left == budget - account.homes - sum(b.nbytes for b in held.values())
    assert phase is Phase.FORWARD and owner is threading.current_thread()
    assert not account.held and account.free_bytes() == budget - account.homes  # every block released, capture given back
    assert ctx.step.phase is Phase.IDLE and ctx.step.owner is None
    assert ctx.step.backward_died() is False
    # the prefetcher plans in the account's free bytes, not in a sum of its own
    assert ctx.prefetcher is not None and ctx.prefetcher.device_free == account.free_for_prefetch


def test_early_capture_takes_room_only_beside_the_largest_block(wrapped) -> None:
    model = wrapped(builders.gpt(layers=2))
    account = runtime.state_of(model).ctx.account
    before, captures = account.free_bytes(), account.captures
    largest, account.largest_block = account.largest_block, before  # no byte would leave it room
    assert not account.take_capture(1) and account.free_bytes() == before and account.captures == captures
    account.largest_block = largest
    assert account.take_capture(64) and account.free_bytes() == before - 64 and account.beside() == 64
    account.capture_done(64)
    assert account.free_bytes() == before and account.beside() == 0 and account.captures == captures + 1


def test_the_schedule_is_layer_major_only_within_accumulate(wrapped) -> None:
    model = wrapped(builders.gpt(layers=2))
    ctx = runtime.state_of(model).ctx
    assert ctx.schedule is PLAIN and not PLAIN.defers_release([], []) and not PLAIN.owns_forward
    during = []

    def loss_fn(out, mb):
        during.append((ctx.schedule, ctx.schedule.owns_forward, ctx.schedule.sums_wide))
        return out.logits.float().square().mean()

    mbs = [torch.randint(0, 257, (2, 24)) for _ in range(2)]
    tz.accumulate(model, mbs, loss_fn)
    assert len(during) == 2 and all(isinstance(s, LayerMajor) and owns and wide for s, owns, wide in during)
    assert ctx.schedule is PLAIN
    with pytest.raises(ValueError, match="empty"):
        tz.accumulate(model, [], loss_fn)
    assert ctx.schedule is PLAIN

"""A wrapped model entered from a second thread while a step is under way: one clear error, and
the model goes on as if the call had not been made."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

import builders
from builders import tier_config
from pairs import step_and_zero
import tierzero as tz

SEQ = 16


def test_a_second_thread_is_refused_and_the_step_goes_on(wrapped) -> None:
    ref = builders.gpt(seq=SEQ, layers=3)
    model = wrapped(copy.deepcopy(ref), tier_config(tier="host", device_budget="2MiB"))
    opt, ref_opt = tz.AdamW(model, lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    x = torch.randint(0, 257, (2, SEQ), generator=torch.Generator().manual_seed(0))
    inside, resume = threading.Event(), threading.Event()

    def pause(module, args):  # the first thread stops in the middle of its forward
        if threading.current_thread().name == "first":
            inside.set()
            resume.wait(30)

    handle = model.blocks[1].register_forward_pre_hook(pause)
    losses: list[float] = []

    def first() -> None:
        loss = model(x, x).loss
        loss.backward()
        losses.append(loss.item())

    t = threading.Thread(target=first, name="first")
    t.start()
    assert inside.wait(30)
    with pytest.raises(RuntimeError, match="a step that thread 'first' started.*refused and the model left as it was"):
        model(x, x)
    resume.set()
    t.join(30)
    handle.remove()
    assert losses, "the first thread's step did not finish"
    ref_loss = ref(x, x).loss
    ref_loss.backward()
    assert losses[0] == ref_loss.item()
    step_and_zero((opt, ref_opt))
    for step in range(2):  # and it trains on, from this thread, as the plain model does
        a, b = model(x, x).loss, ref(x, x).loss
        a.backward()
        b.backward()
        step_and_zero((opt, ref_opt))
        assert a.item() == b.item(), step

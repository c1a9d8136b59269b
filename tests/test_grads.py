"""FlatGrad's early capture of the root block's gradients (tierzero/grads.py): the tied
embedding / LM head's contributions go into the stored gradient as autograd sends them, with
the bits of plain PyTorch's summed `.grad`, and a backward that raises leaves nothing held."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import tierzero as tz
from tierzero import runtime
from tierzero.blocks import Block
from tierzero.grads import FlatGrad
from tierzero.grouping import ROOT
from tierzero.models import GPT, GPTConfig
from tierzero.tiers import Tier

VOCAB, SEQ, D = 257, 24, 44


def gpt(tie: bool = True) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=3, n_head=4, n_embd=D, tie_weights=tie))


def wrapped(tmp_path: Any, ref: GPT, **kw: Any) -> GPT:
    model = copy.deepcopy(ref)
    cfg = dict(device_budget="64MiB", host_budget="64MiB", nvme_dir=str(tmp_path), nvme_budget="256MiB",
               params="nvme", grads="nvme", optimizer_states="nvme", compute_dtype="float32")
    cfg.update(kw)
    return tz.wrap(model, tz.Config(**cfg))


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, VOCAB, (3, SEQ), generator=torch.Generator().manual_seed(seed))


def loss_of(model: GPT, x: torch.Tensor) -> torch.Tensor:
    logits = model(x).logits
    return F.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), x[:, 1:].reshape(-1))


def stored_grads(model: GPT) -> dict[str, torch.Tensor]:
    """Every parameter's gradient as the wrapped model stores it (world size 1: whole)."""
    state = runtime.state_of(model)
    out = {}
    for flat in state.flat_params(trainable=True):
        assert flat.grad is not None
        with flat.grad.acquire() as g:
            for slot in flat.layout.slots:
                out[slot.fqn] = g[slot.offset:slot.offset + slot.numel].view(slot.shape).clone()
    return out


def root_grad(model: GPT) -> FlatGrad:
    (root,) = [b for b in runtime.state_of(model).blocks if b.name == ROOT]
    grad = root.flats[0].grad
    assert grad is not None
    return grad


@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
def test_root_gradients_are_taken_as_autograd_sends_them(tmp_path: Any, monkeypatch: Any, tie: bool) -> None:
    ref = gpt(tie)
    model = wrapped(tmp_path, ref)
    events: list[str] = []
    capture, post_backward = FlatGrad.capture, Block.post_backward

    def spy_capture(self: FlatGrad, index: int, g: torch.Tensor) -> bool:
        taken = capture(self, index, g)
        events.append(f"capture {self.layout.slots[index].fqn} {taken}")
        return taken

    def spy_post_backward(self: Block, call: Any = None) -> None:
        events.append(f"post_backward {self.name}")
        post_backward(self, call)

    monkeypatch.setattr(FlatGrad, "capture", spy_capture)
    monkeypatch.setattr(Block, "post_backward", spy_post_backward)
    opt = tz.AdamW(model)
    try:
        for step in range(2):  # the second backward adds to nothing: zero_grad between
            x = tokens(step)
            events.clear()
            loss_of(model, x).backward()
            ref.zero_grad(set_to_none=True)
            loss_of(ref, x).backward()
            got = stored_grads(model)
            for name, p in ref.named_parameters():
                assert torch.equal(got[name], p.grad), f"gradient of {name} at step {step}"
            head = "wte.weight" if tie else "lm_head.weight"
            first_block = next(i for i, e in enumerate(events) if e.startswith("post_backward blocks."))
            # the LM head's share is stored before any layer's backward ends: autograd does not
            # hold it through backward
            assert events.index(f"capture {head} True") < first_block, events
            if tie:  # the embedding's share comes last, into the same stored gradient
                assert events.count(f"capture {head} True") == 2, events
                assert events.index(f"capture {head} True", first_block) > first_block
            assert all(p.grad is None for p in model.parameters())
            opt.zero_grad()
    finally:
        runtime.close(model)


def test_accumulation_and_bf16_gradients_fall_back_with_the_same_values(tmp_path: Any) -> None:
    """A second backward before zero_grad adds to the stored sum (not captured: autograd's order
    would differ); bf16 stored gradients are not captured either. Both as plain torch sums."""
    ref = gpt()
    model = wrapped(tmp_path / "fp32", ref)
    half = wrapped(tmp_path / "bf16", ref, grad_dtype="bfloat16")
    try:
        for seed in (0, 1):
            for m in (model, half):
                loss_of(m, tokens(seed)).backward()
            loss_of(ref, tokens(seed)).backward()
            assert root_grad(model)._held is None and root_grad(half)._held is None
        got, got_half = stored_grads(model), stored_grads(half)
        for name, p in ref.named_parameters():
            assert torch.equal(got[name], p.grad), name
            # torch sums the two backwards' fp32 gradients; bf16 storage rounds each
            torch.testing.assert_close(got_half[name].float(), p.grad, rtol=2e-2, atol=1e-3, msg=name)
    finally:
        runtime.close(model)
        runtime.close(half)


def test_a_backward_that_raises_leaves_nothing_held(tmp_path: Any) -> None:
    ref = gpt()
    model = wrapped(tmp_path, ref)
    opt, ropt = tz.AdamW(model, lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    try:
        def boom(grad: torch.Tensor) -> None:
            raise RuntimeError("boom")

        def hook_output(module: Any, args: Any, out: torch.Tensor) -> None:
            out.register_hook(boom)

        # a layer's output whose gradient raises: backward stops in the middle of the layers
        handle = model.blocks[1].register_forward_hook(hook_output)
        loss = loss_of(model, tokens(0))
        handle.remove()
        with pytest.raises(RuntimeError, match="boom"):
            loss.backward()
        assert root_grad(model)._held is not None  # the LM head's share was taken before the raise
        opt.zero_grad()
        pm = runtime.placement_manager(model)
        assert pm.record(root_grad(model).handle).pins(Tier.HOST) == 0
        for seed in (1, 2):  # training goes on, as plain torch does from the same start
            loss, rloss = loss_of(model, tokens(seed)), loss_of(ref, tokens(seed))
            assert torch.equal(loss, rloss)
            loss.backward()
            rloss.backward()
            opt.step(), ropt.step()
            opt.zero_grad(), ropt.zero_grad()
        for (name, p), q in zip(ref.named_parameters(), model.state_dict().values()):
            assert torch.equal(p, q), name
    finally:
        runtime.close(model)


def test_autograd_grad_gets_the_tied_weights_gradient_untouched(tmp_path: Any) -> None:
    """torch.autograd.grad returns gradients instead of accumulating them: nothing is captured."""
    ref = gpt()
    model = wrapped(tmp_path, ref)
    try:
        x = tokens(0)
        (g,) = torch.autograd.grad(loss_of(model, x), [model.wte.weight])
        (rg,) = torch.autograd.grad(loss_of(ref, x), [ref.wte.weight])
        assert torch.equal(g, rg)
        assert root_grad(model).empty and root_grad(model)._held is None
    finally:
        runtime.close(model)

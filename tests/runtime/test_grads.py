"""FlatGrad's early capture (tierzero/runtime/flat/capture.py): every share of a gradient, the tied embedding /
LM head's two among them, goes into the stored gradient as autograd sends it, with the bits of
plain PyTorch's summed `.grad`; a backward that raises leaves nothing held."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import tierzero as tz
from tierzero import runtime
import builders
from builders import tier_config
from tierzero.runtime.blocks import Block
from tierzero.runtime.flat.capture import CaptureSum
from tierzero.runtime.flat.grads import FlatGrad
from tierzero.layout.grouping import ROOT
from tierzero.models import GPT, GPTConfig
from tierzero.config.tiernames import Tier

VOCAB, SEQ, D = 257, 24, 44


def gpt(tie: bool = True) -> GPT:
    model = builders.gpt(vocab=VOCAB, seq=SEQ, layers=3, width=D, tie_weights=tie)
    model.spare = torch.nn.Parameter(torch.randn(5))  # trainable, used by no forward: no share
    return model


class SometimesSpare(GPT):
    """A GPT whose `spare` parameter only the forwards with `use_spare` set use."""

    use_spare = False

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> Any:
        out = super().forward(idx, targets)
        return out._replace(logits=out.logits + self.spare.sum()) if self.use_spare else out


def plain_grad(p: torch.nn.Parameter) -> torch.Tensor:
    return torch.zeros_like(p) if p.grad is None else p.grad


def wrapped(tmp_path: Any, ref: GPT, **kw: Any) -> GPT:
    return tz.wrap(copy.deepcopy(ref), tier_config(tmp_path, **kw))


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
def test_gradients_are_taken_as_autograd_sends_them(tmp_path: Any, monkeypatch: Any, tie: bool) -> None:
    ref = gpt(tie)
    model = wrapped(tmp_path, ref)
    events: list[str] = []
    add, post_backward = CaptureSum.add, Block.post_backward

    def spy_capture(self: CaptureSum, index: int, g: torch.Tensor) -> bool:
        taken = add(self, index, g)
        events.append(f"capture {self._grad.layout.slots[index].fqn} {taken}")
        return taken

    def spy_post_backward(self: Block, call: Any = None) -> None:
        events.append(f"post_backward {self.name}")
        post_backward(self, call)

    monkeypatch.setattr(CaptureSum, "add", spy_capture)
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
                assert torch.equal(got[name], plain_grad(p)), f"gradient of {name} at step {step}"
            head = "wte.weight" if tie else "lm_head.weight"
            first_block = next(i for i, e in enumerate(events) if e.startswith("post_backward blocks."))
            # the LM head's share is stored before any layer's backward ends: autograd does not
            # hold it through backward
            assert events.index(f"capture {head} True") < first_block, events
            if tie:  # the embedding's share comes last, into the same stored gradient
                assert events.count(f"capture {head} True") == 2, events
                assert events.index(f"capture {head} True", first_block) > first_block
            with torch._C.DisableTorchFunctionSubclass():  # autograd's .grad, not p.grad's GradView
                assert all(p.grad is None for p in model.parameters())
            # every block's gradients too: autograd never made a `.grad` to flatten
            taken = {e.split()[1] for e in events if e.startswith("capture") and e.endswith("True")}
            assert taken == {n for n, _ in ref.named_parameters()} - {"spare"}
            for i in range(3):
                last = max(k for k, e in enumerate(events) if e.startswith(f"capture blocks.{i}."))
                assert last < events.index(f"post_backward blocks.{i}"), events
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
            assert root_grad(model).capture.held is None and root_grad(half).capture.held is None
        got, got_half = stored_grads(model), stored_grads(half)
        for name, p in ref.named_parameters():
            assert torch.equal(got[name], plain_grad(p)), name
            # torch sums the two backwards' fp32 gradients; bf16 storage rounds each
            torch.testing.assert_close(got_half[name].float(), plain_grad(p), rtol=2e-2, atol=1e-3, msg=name)
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
        assert root_grad(model).capture.held is not None  # the LM head's share was taken before the raise
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
        assert root_grad(model).empty and root_grad(model).capture.held is None
    finally:
        runtime.close(model)


def test_flatten_writes_every_element_once_and_zeroes_the_gaps() -> None:
    """FlatLayout.flatten into a dirty buffer (the pool reuses buffers): parameters copied, the
    alignment gaps, the padding and a parameter without gradient zeroed; gaps() is exactly what
    no parameter covers."""
    from tierzero.layout.flat_layout import FlatLayout

    shapes = [torch.Size([3, 5]), torch.Size([7]), torch.Size([2, 2, 3]), torch.Size([1])]
    layout = FlatLayout.build([f"p{i}" for i in range(4)], shapes, world_size=3)
    covered = torch.zeros(layout.padded_numel, dtype=torch.bool)
    for s in layout.slots:
        covered[s.offset:s.offset + s.numel] = True
    gaps = torch.zeros_like(covered)
    for lo, hi in layout.gaps():
        gaps[lo:hi] = True
    assert torch.equal(gaps, ~covered) and gaps.any()
    tensors = [torch.randn(s) for s in shapes]
    tensors[2] = None
    out = torch.full((layout.padded_numel,), float("nan"))
    flat = layout.flatten(tensors, dtype=torch.float32, out=out)
    assert flat is out and not flat.isnan().any()
    for s, t in zip(layout.slots, tensors):
        want = torch.zeros(s.numel) if t is None else t.reshape(-1)
        assert torch.equal(flat[s.offset:s.offset + s.numel], want)
    assert torch.equal(flat[gaps], torch.zeros(int(gaps.sum())))
    assert torch.equal(layout.flatten(tensors, dtype=torch.float32), flat)


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_a_parameter_no_gradient_reaches_is_left_alone_as_torch_does(tmp_path: Any, optimizer: str) -> None:
    """`spare` is trainable and unused: torch's optimizers skip it (p.grad is None: no weight
    decay, no moments) and clipping leaves it out; the wrapped model must too, bit for bit."""
    ref = gpt()
    model = wrapped(tmp_path, ref)
    if optimizer == "adamw":
        opt, ropt = tz.AdamW(model, lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    else:
        opt = tz.SGD(model, lr=0.1, momentum=0.9, weight_decay=0.1)
        ropt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1, fused=True)
    spare = ref.spare.detach().clone()
    try:
        for seed in range(3):
            loss, rloss = loss_of(model, tokens(seed)), loss_of(ref, tokens(seed))
            assert torch.equal(loss, rloss), seed
            loss.backward()
            rloss.backward()
            assert torch.equal(tz.clip_grad_norm_(model, 0.5), torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
            opt.step(), ropt.step()
            opt.zero_grad(), ropt.zero_grad()
        sd = model.state_dict()
        for name, p in ref.named_parameters():
            assert torch.equal(sd[name], p), name
        assert torch.equal(sd["spare"], spare)
    finally:
        runtime.close(model)


def test_a_parameter_used_in_some_steps_counts_its_own_adamw_steps(tmp_path: Any) -> None:
    """torch.optim.AdamW counts steps per parameter (bias correction) and skips one without a
    gradient: `spare`, used in steps 2 and 4 of 5, gets two updates, counted 1 and 2, not 2
    and 4. The per-parameter counts go through a checkpoint and back, exactly."""
    torch.manual_seed(0)
    ref = SometimesSpare(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=3, n_head=4, n_embd=D))
    ref.spare = torch.nn.Parameter(torch.randn(5))
    model = wrapped(tmp_path / "nvme", ref)
    opt, ropt = tz.AdamW(model, lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    try:
        for step in range(5):
            model.use_spare = ref.use_spare = step in (1, 3)
            loss, rloss = loss_of(model, tokens(step)), loss_of(ref, tokens(step))
            assert torch.equal(loss, rloss), step
            loss.backward()
            rloss.backward()
            opt.step(), ropt.step()
            opt.zero_grad(), ropt.zero_grad()
            if step == 2:  # a checkpoint with unequal counts, loaded back before going on
                tz.save_checkpoint(tmp_path / "ckpt", model, opt)
                tz.load_checkpoint(tmp_path / "ckpt", model, opt)
        assert ropt.state[ref.spare]["step"].item() == 2
        sd = model.state_dict()
        for name, p in ref.named_parameters():
            assert torch.equal(sd[name], p), name
    finally:
        runtime.close(model)


@pytest.mark.parametrize("grad_dtype", ["float32", "bfloat16"])
def test_a_refused_capture_sends_each_gradient_to_the_host_with_no_device_temporary(
        tmp_path: Any, monkeypatch: Any, grad_dtype: str) -> None:
    """Early capture's device buffer refused (no room in the device budget, here never any):
    each parameter's `.grad` goes straight to its slice of the stored gradient on the host, by
    an asynchronous copy, with plain torch's values and norms; no device memory is made outside
    the device budget (a flat temporary of the block, or a converted one, would be)."""
    ref = gpt()
    model = wrapped(tmp_path, ref, grads="host", grad_dtype=grad_dtype, streams="async",
                    stand_in=tz.StandInConfig(poison=True, delay_seed=3, max_delay_s=0.003))
    ctx = runtime.state_of(model).ctx
    monkeypatch.setattr(ctx.account, "take_capture", lambda nbytes: False)
    streams = runtime.placement_manager(model).streams
    made: list[str] = []

    def counted(name: str) -> Any:
        make = getattr(streams, name)
        return lambda *a, **kw: (made.append(name), make(*a, **kw))[1]

    for name in ("empty", "to_device"):
        monkeypatch.setattr(streams, name, counted(name))
    dtype = getattr(torch, grad_dtype)
    try:
        for seed in (0, 1):
            tz.clip_grad_norm_(model, 1e9)  # clipping on: norms are taken as gradients are written
            loss_of(model, tokens(seed)).backward()
            ref.zero_grad(set_to_none=True)
            loss_of(ref, tokens(seed)).backward()
            assert made == [] and ctx.account.captures == 0
            stored = {n: torch.zeros_like(p) if p.grad is None else p.grad.to(dtype)
                      for n, p in ref.named_parameters()}
            norms = [torch.linalg.vector_norm(p.grad.to(dtype).float()) for p in ref.parameters() if p.grad is not None]
            assert torch.equal(tz.clip_grad_norm_(model, 1e9), torch.linalg.vector_norm(torch.stack(norms)))
            got = stored_grads(model)
            for name, g in stored.items():
                assert torch.equal(got[name], g), name
            for flat in runtime.state_of(model).flat_params(trainable=True):
                assert flat.grad is not None
                flat.grad.clear()
    finally:
        runtime.close(model)

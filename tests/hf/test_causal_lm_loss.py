"""causal_lm_loss / chunked_cross_entropy (tierzero/hf/loss.py): the loss and gradients of the
plain head + cross_entropy within what fp32 rounding allows (bounded against a float64 run of
the same computation, so the bound means the same on every CPU's kernels), on transformers
GPT-2 (a tied head) and Llama (tied and untied, and under peft); on a tierzero-wrapped model bit
for bit the same training as the plain model with the same loss, whatever its activations'
placement; measured on fake tensors without the logits; and refused where it would be wrong."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import tierzero as tz
from tierzero import runtime
from tierzero.config import Tier
from tierzero.hf import causal_lm_loss, chunked_cross_entropy
from tierzero.planning import measure_activations
import builders
import hf_models

ROUNDING = 4
"""How many times plain fp32's distance from float64 the chunked loss may be (both are fp32
sums of the same terms, in other orders)."""


def assert_as_close_as_plain(got: torch.Tensor, plain: torch.Tensor, exact: torch.Tensor, what: str) -> None:
    """`got` is no further from `exact` (float64) than ROUNDING x plain fp32's largest distance,
    or fp32's resolution at the tensor's scale where plain happens to hit it exactly."""
    exact = exact.double()
    floor = torch.finfo(plain.dtype).eps * exact.abs().max().item()
    allowed = ROUNDING * max((plain.double() - exact).abs().max().item(), floor)
    off = (got.double() - exact).abs().max().item()
    assert off <= allowed, f"{what}: {off:.3e} from float64, plain {plain.dtype} is {allowed / ROUNDING:.3e}"


def plain_loss(h: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(h, w, b).float().flatten(0, -2), y.flatten())


@pytest.mark.parametrize("chunk", [1, 7, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [True, False])
def test_chunked_cross_entropy_is_cross_entropy_over_the_head(chunk: int, dtype: torch.dtype, bias: bool) -> None:
    g = torch.Generator().manual_seed(2)
    h = torch.randn(3, 41, 24, generator=g)
    w = torch.randn(157, 24, generator=g) / 5
    b = torch.randn(157, generator=g) if bias else None
    y = torch.randint(0, 157, (3, 41), generator=g)
    y[0, 4], y[2, :9] = -100, -100  # ignored targets, as transformers marks them
    runs = {}
    for name, fn, dt in (("exact", plain_loss, torch.float64), ("plain", plain_loss, dtype),
                         ("chunked", lambda *a: chunked_cross_entropy(*a, chunk=chunk), dtype)):
        leaves = [t.to(dt).requires_grad_() for t in (h, w, b) if t is not None]
        loss = fn(leaves[0], leaves[1], leaves[2] if bias else None, y)
        runs[name] = [loss.detach(), *torch.autograd.grad(loss, leaves)]
    for i, what in enumerate(["loss", "hidden grad", "weight grad", "bias grad"][:len(runs["exact"])]):
        got, plain, exact = runs["chunked"][i], runs["plain"][i], runs["exact"][i]
        assert got.dtype == plain.dtype and got.shape == plain.shape, what
        assert_as_close_as_plain(got, plain, exact, what)


def model_grads(model: Any, loss: torch.Tensor) -> list[torch.Tensor]:
    params = [p for p in model.parameters() if p.requires_grad]
    return [loss.detach(), *torch.autograd.grad(loss, params)]


@pytest.mark.parametrize("kind", ["gpt2", "llama-tied", "llama-untied"])
def test_the_models_own_loss_without_its_logits(kind: str) -> None:
    cls, config = hf_models.MODELS[kind]()
    model = hf_models.build(cls, config).train()
    x = hf_models.token_batches(config.vocab_size, n=1, seq=23, rows=3)[0]
    labels = x.clone()
    labels[1, 5:9] = -100
    exact = copy.deepcopy(model).double()
    want = model_grads(exact, exact(input_ids=x, labels=labels, use_cache=False).loss)
    plain = model_grads(model, model(input_ids=x, labels=labels, use_cache=False).loss)
    got = model_grads(model, causal_lm_loss(model, x, labels, use_cache=False, chunk=10))
    for g, p, e in zip(got, plain, want):
        assert_as_close_as_plain(g, p, e, kind)
    # num_items_in_batch: the sum divided by it (what transformers' Trainer passes when it accumulates)
    n = torch.tensor(101)
    want = model_grads(exact, exact(input_ids=x, labels=labels, use_cache=False, num_items_in_batch=n).loss)
    plain = model_grads(model, model(input_ids=x, labels=labels, use_cache=False, num_items_in_batch=n).loss)
    got = model_grads(model, causal_lm_loss(model, x, labels, use_cache=False, chunk=10, num_items_in_batch=n))
    for g, p, e in zip(got, plain, want):
        assert_as_close_as_plain(g, p, e, f"{kind} num_items_in_batch")
    # shift_labels: the target of each position as given (what tierzero's harness passes)
    y = torch.roll(x, -1, dims=1)
    logits = model(input_ids=x, use_cache=False).logits
    plain = model_grads(model, F.cross_entropy(logits.float().flatten(0, 1), y.flatten()))
    logits = exact(input_ids=x, use_cache=False).logits
    want = model_grads(exact, F.cross_entropy(logits.flatten(0, 1), y.flatten()))
    got = model_grads(model, causal_lm_loss(model, x, shift_labels=y, use_cache=False))
    for g, p, e in zip(got, plain, want):
        assert_as_close_as_plain(g, p, e, f"{kind} shift_labels")


def test_a_peft_model_over_the_causal_lm() -> None:
    peft = pytest.importorskip("peft")
    hf_models.hf()
    model = peft.get_peft_model(builders.llama(tied=False), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    for p in model.parameters():  # lora_B starts at zero: make the adapters count
        if p.requires_grad:
            torch.nn.init.normal_(p, std=0.1)
    x = hf_models.token_batches(211, n=1)[0]
    exact = copy.deepcopy(model).double()
    want = model_grads(exact, exact(input_ids=x, labels=x, use_cache=False).loss)
    plain = model_grads(model, model(input_ids=x, labels=x, use_cache=False).loss)
    got = model_grads(model, causal_lm_loss(model, x, x, use_cache=False, chunk=5))
    assert len(got) == 1 + 2 * 2 * 3  # the loss, lora_A and lora_B of 2 projections in 3 layers
    for g, p, e in zip(got, plain, want):
        assert_as_close_as_plain(g, p, e, "peft")


@pytest.mark.parametrize("kind,activations,ckpt", [("gpt2", "device", False), ("gpt2", "nvme", False),
                                                   ("gpt2", "nvme", True), ("llama-untied", "nvme", False)])
def test_a_tiered_model_trains_bit_for_bit_as_the_plain_one(tmp_path: Path, kind: str, activations: str,
                                                            ckpt: bool) -> None:
    """The head's weight (GPT-2's tied to the embedding) is read inside the root block's hold, in
    forward and in backward, and its gradient lands through early capture like the rest."""
    cls, config = hf_models.MODELS[kind]()
    ref = hf_models.build(cls, config).train()
    model = tz.wrap(copy.deepcopy(ref), builders.tier_config(tmp_path, tier="host", params="nvme",
                                                             optimizer_states="nvme", device_budget="1MiB",
                                                             activations=activations, activation_checkpointing=ckpt))
    try:
        opt = tz.AdamW(model, lr=3e-3, weight_decay=0.1)
        ropt = torch.optim.AdamW(ref.parameters(), lr=3e-3, weight_decay=0.1, fused=True)
        for x in hf_models.token_batches(config.vocab_size, n=3, seq=20):
            losses = []
            for m, o in ((model, opt), (ref, ropt)):
                loss = causal_lm_loss(m, x, x, use_cache=False, chunk=9)
                loss.backward()
                if m is model:
                    tz.clip_grad_norm_(m, 0.5)
                else:
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
                o.step()
                o.zero_grad()
                losses.append(loss.item())
            assert losses[0] == losses[1], losses
        builders.assert_state_equal(model.state_dict(), ref.state_dict(), f"{kind} {activations} ckpt={ckpt}")
        pm = runtime.placement_manager(model)
        for t in Tier:
            assert pm.peak_bytes(t) <= pm.budget(t), t
    finally:
        runtime.close(model)


def test_measured_on_fake_tensors_without_the_logits() -> None:
    cls, config = hf_models.MODELS["gpt2"]()
    model = hf_models.build(cls, config, meta=True)
    seq, cfg = 48, tz.Config(compute_dtype="float32")
    plain = measure_activations(model, cfg, lambda m, x, y: m(input_ids=x, labels=x, use_cache=True).loss,
                                batch=2, seq=seq)
    got = measure_activations(model, cfg, lambda m, x, y: causal_lm_loss(m, x, x, use_cache=True, chunk=8),
                              batch=2, seq=seq)
    logits = 2 * seq * config.vocab_size * 4
    assert got.blocks == plain.blocks and got.after == plain.after == 0
    # cross_entropy keeps the log-probabilities; the chunked loss a few bytes a token instead
    assert 0 <= got.outside - (plain.outside - logits) <= 2 * seq * 16, (got.outside, plain.outside, logits)


def test_refused_where_it_would_not_be_the_models_loss() -> None:
    cls, config = hf_models.MODELS["gpt2"]()
    model = hf_models.build(cls, config)
    x = hf_models.token_batches(config.vocab_size, n=1)[0]
    handle = model.lm_head.register_forward_hook(lambda m, a, out: out * 0.5)  # a scaled head, as some models have
    with pytest.raises(ValueError, match="logits are not its output layer over its decoder's last hidden states"):
        causal_lm_loss(model, x, x)
    handle.remove()
    assert causal_lm_loss(model, x, x).isfinite()
    with pytest.raises(ValueError, match="give labels .* or shift_labels"):
        causal_lm_loss(model, x, x, shift_labels=x)
    with pytest.raises(ValueError, match="no linear output layer"):
        causal_lm_loss(model.transformer, x, x)
    with pytest.raises(ValueError, match="one target per position"):
        chunked_cross_entropy(torch.zeros(2, 3, 4), torch.zeros(5, 4), None, torch.zeros(2, 4, dtype=torch.long))

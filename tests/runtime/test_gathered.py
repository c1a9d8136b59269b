"""Weights you can read and change: a wrapped parameter read outside a forward raises (never
zeros), conversions after wrap are refused, and tz.gathered_params gives the full values (equal
to the state dict) and writes changes back so that the next forward and the next step are those
of the same change on a plain model."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

import tierzero as tz
from tierzero import runtime
from builders import assert_state_equal, gpt, tier_config


def tokens(seed: int) -> torch.Tensor:
    return torch.randint(0, 257, (2, 24), generator=torch.Generator().manual_seed(seed))


def nvme_config(tmp_path: Path, **kw: object) -> tz.Config:
    return tier_config(tmp_path / "nvme", tier="host", params="nvme", optimizer_states="nvme", **kw)


def test_a_placeholder_read_raises_and_conversions_are_refused(wrapped: Callable[..., nn.Module]) -> None:
    model = wrapped(gpt(layers=2))
    w = model.blocks[0].attn.qkv.weight
    for read in (lambda: w.sum(), lambda: repr(w), lambda: w.detach().clone(), lambda: torch.equal(w, w),
                 lambda: w.data.numpy(), lambda: w + 1, lambda: copy.deepcopy(model)):
        with pytest.raises(RuntimeError, match="parameter 'blocks.0.attn.qkv.weight' is not fetched|taken from a "
                                               "tierzero-wrapped parameter.*gathered_params"):
            read()
    assert w.shape == (180, 60) and w.dtype == torch.float32 and w.requires_grad and w.grad is None
    assert sum(p.numel() for p in model.parameters()) > 0
    for convert in (lambda: model.to(torch.bfloat16), lambda: model.half(), lambda: model.double()):
        with pytest.raises(ValueError, match="compute in Config.compute_dtype"):
            convert()
    model.to(torch.float32)  # nothing to change: allowed
    model.float().to("cpu")
    x = tokens(0)
    model(x, x).loss.backward()  # the forward runs on plain parameters, as fetched


def test_gathered_reads_equal_the_state_dict_and_writes_change_the_next_step(tmp_path: Path) -> None:
    ref = gpt(layers=3)
    model = tz.wrap(copy.deepcopy(ref), nvme_config(tmp_path))
    try:
        opt, ropt = tz.AdamW(model, lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
        x = tokens(1)
        for m, o in ((model, opt), (ref, ropt)):
            m(x, x).loss.backward()
            o.step()
            o.zero_grad()
        sd = model.state_dict()
        with tz.gathered_params(model):
            read = {n: p.detach().clone() for n, p in model.named_parameters()}
        assert_state_equal(read, {n: sd[n] for n in read}, "gathered vs state_dict")
        with tz.gathered_params(model, model.blocks[1], writable=True), torch.no_grad():
            model.blocks[1].mlp.fc.weight[3].mul_(-2.0)  # a write on a view, as users do
            model.blocks[1].ln_1.bias.add_(0.25)
            with pytest.raises(RuntimeError, match="not fetched"):
                model.blocks[0].mlp.fc.weight.sum()  # only the blocks asked for are gathered
            with pytest.raises(RuntimeError, match="a forward inside tz.gathered_params"):
                model(x, x)
        with torch.no_grad():
            ref.blocks[1].mlp.fc.weight[3].mul_(-2.0)
            ref.blocks[1].ln_1.bias.add_(0.25)
        for step in range(2):  # the forward sees the write, and so does the optimizer's master copy
            x = tokens(2 + step)
            loss, rloss = model(x, x).loss, ref(x, x).loss
            assert torch.equal(loss, rloss), (step, loss.item(), rloss.item())
            loss.backward()
            rloss.backward()
            opt.step()
            ropt.step()
            opt.zero_grad()
            ropt.zero_grad()
        assert_state_equal(model.state_dict(), ref.state_dict(), "after the write and two steps")
        with tz.gathered_params(model, [model.blocks[2]]), torch.no_grad():  # writable=False: dropped
            model.blocks[2].attn.proj.weight.zero_()
        assert_state_equal(model.state_dict(), ref.state_dict(), "after a discarded change")
        x = tokens(9)
        assert torch.equal(model(x, x).loss, ref(x, x).loss)
    finally:
        runtime.close(model)


def test_a_write_keeps_the_full_precision_of_what_it_did_not_change(tmp_path: Path) -> None:
    """bfloat16 compute, fp32 master weights: only the elements a write changes take its
    (bfloat16) values; the others keep their fp32 values."""
    ref = gpt(layers=2)
    model = tz.wrap(copy.deepcopy(ref), nvme_config(tmp_path, compute_dtype="bfloat16"))
    try:
        with tz.gathered_params(model, model.blocks[0], writable=True), torch.no_grad():
            assert model.blocks[0].attn.qkv.weight.dtype == torch.bfloat16
            model.blocks[0].attn.qkv.weight[0, :5] = 0.5
        with torch.no_grad():
            ref.blocks[0].attn.qkv.weight[0, :5] = 0.5
        assert_state_equal(model.state_dict(), ref.state_dict(), "fp32 values after a bfloat16 write")
    finally:
        runtime.close(model)


def test_gathering_more_than_the_device_budget_is_refused(tmp_path: Path) -> None:
    model = gpt(layers=4)
    sizes = sum(p.numel() for p in model.blocks[0].parameters()) * 4
    tz.wrap(model, nvme_config(tmp_path, device_budget=sizes * 3 + (1 << 16)))
    try:
        with pytest.raises(ValueError, match=r"need .* on the device tier at once.*pass fewer modules"):
            with tz.gathered_params(model):
                pass
        with tz.gathered_params(model, model.blocks[:2]):
            assert model.blocks[1].attn.qkv.weight.abs().sum() > 0
    finally:
        runtime.close(model)

"""Optimizer states in bfloat16 and int8, and bf16 master weights (Config.optimizer_state_dtype,
Config.master_dtype): the update against plain PyTorch, the 8-bit codec against its formula,
the same bits on every placement, real bytes on every tier, checkpoints in their format."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import pytest
import torch

import tierzero as tz
from builders import assert_state_equal, gpt, tier_config
from tierzero import runtime
from tierzero.optim import base as optim_base
from tierzero.optim import window_kernel
from tierzero.checkpoint import CheckpointError
from tierzero.config import QUANT_BLOCK, state_nbytes
from tierzero.layout import StateCodec, round_stochastic_

STEPS = 4


def batches(n: int = STEPS, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 257, (3, 24), generator=g) for _ in range(n)]


def opt_state(model: Any, opt: Any) -> dict[str, torch.Tensor]:
    """Every block's master weights and states, as stored (their formats' bits)."""
    runtime.settle(model)
    return {f"{name}/{k}": v for name, entry in opt.state_dict()["state"].items()
            for k, v in entry.items() if k != "step"}


def train(config: tz.Config, steps: int = STEPS, *, accumulate: bool = False, sgd: bool = False) -> tuple[Any, Any]:
    model = gpt(layers=3)
    tz.wrap(model, config)
    opt = tz.SGD(model, lr=0.05, momentum=0.9, weight_decay=0.01) if sgd else tz.AdamW(model, lr=3e-3, weight_decay=0.1)
    for x in batches(steps):
        if accumulate:
            tz.accumulate(model, [(x[:2], x[:2]), (x[2:], x[2:])], lambda out, mb: out.loss)
        else:
            model(x, x).loss.backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def reference_bf16_states(steps: int = STEPS) -> dict[str, torch.Tensor]:
    """Plain PyTorch: each parameter's AdamW moments kept in bf16, widened to fp32, updated by
    AdamW in the order torch's fused CPU kernel computes it, without its fused multiply-adds
    ([Note: fused state windows]), and rounded back to nearest after each step."""
    def single(x: float) -> float:
        return torch.tensor(x, dtype=torch.float32).item()

    model = gpt(layers=3)
    moments = {n: (torch.zeros_like(p, dtype=torch.bfloat16), torch.zeros_like(p, dtype=torch.bfloat16))
               for n, p in model.named_parameters()}
    lr, wd, beta1, beta2, eps = 3e-3, 0.1, 0.9, 0.999, 1e-8
    for step, x in enumerate(batches(steps), 1):
        model(x, x).loss.backward()
        with torch.no_grad():
            for n, p in model.named_parameters():
                m, v, g = moments[n][0].float(), moments[n][1].float(), p.grad
                p.mul_(single(1 - lr * wd))
                m += (g - m) * single(1 - beta1)
                v.mul_(single(beta2)).add_(g * single(1 - beta2) * g)
                root = v.double().sqrt().float()  # correctly rounded (torch's fp32 sqrt is not always)
                p -= m * single(lr / (1 - beta1 ** step)) / (root / single(math.sqrt(1 - beta2 ** step)) + single(eps))
                moments[n][0].copy_(m)
                moments[n][1].copy_(v)
                p.grad = None
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_bf16_states_are_torch_with_bf16_moments(wrapped) -> None:
    model, opt = train(tier_config(tier="host", optimizer_state_dtype="bfloat16"))
    state = opt_state(model, opt)
    assert all(v.dtype == torch.bfloat16 for k, v in state.items() if not k.endswith("/master"))
    runtime.settle(model)
    ref = reference_bf16_states()
    sd = model.state_dict()
    for name, value in ref.items():
        assert torch.equal(sd[name], value), name
    runtime.close(model)


@pytest.mark.parametrize("unsigned", [False, True])
def test_int8_codec_against_its_formula(unsigned: bool) -> None:
    numel = 3 * QUANT_BLOCK + 37  # a short last block
    torch.manual_seed(0)
    x = torch.randn(numel) * torch.logspace(-7, 0, numel)
    x = x.abs() if unsigned else x
    codec = StateCodec("int8", unsigned=unsigned)
    stored = codec.zeros(numel)
    assert stored.dtype == torch.uint8 and stored.numel() == state_nbytes(numel, "int8") == 4 * (QUANT_BLOCK + 4)
    scratch = torch.zeros(4 * QUANT_BLOCK)
    scratch[:numel] = x
    codec.encode(scratch, stored, numel, 0, numel)
    # the formula, block by block, in float64
    blocks = torch.cat([x, torch.zeros(4 * QUANT_BLOCK - numel)]).double().view(4, QUANT_BLOCK)
    s = blocks.abs().amax(dim=1, keepdim=True)
    scales = stored[4 * QUANT_BLOCK:].view(torch.float32)
    assert torch.equal(scales, s.float().view(-1))
    if unsigned:
        q = torch.round(255 * (blocks / s) ** 0.25)
        expect = s * (q / 255) ** 4
        codes = stored[:4 * QUANT_BLOCK].double()
    else:
        q = torch.round(127 * torch.sign(blocks) * (blocks.abs() / s).sqrt())
        expect = s * torch.sign(q) * (q / 127) ** 2
        codes = stored[:4 * QUANT_BLOCK].view(torch.int8).double()
    assert (codes - q.view(-1)).abs().max() <= 1  # fp32 against fp64 at a rounding edge
    assert (codes != q.view(-1)).float().mean() < 0.01
    decoded = codec.decode(stored, numel, 0, numel, torch.empty(4 * QUANT_BLOCK))
    torch.testing.assert_close(decoded.double(), expect.view(-1)[:numel], rtol=2e-2, atol=1e-30)
    # decoding again and encoding what was decoded keeps every code: a value no update touched stays
    again = codec.zeros(numel)
    scratch[:numel] = decoded
    codec.encode(scratch, again, numel, 0, numel)
    assert torch.equal(again[:4 * QUANT_BLOCK], stored[:4 * QUANT_BLOCK])
    # a window of whole blocks decodes the same values as the whole
    part = codec.decode(stored, numel, QUANT_BLOCK, numel, torch.empty(3 * QUANT_BLOCK))
    assert torch.equal(part, decoded[QUANT_BLOCK:])


def test_stochastic_rounding_is_unbiased_and_a_function_of_index_and_seed() -> None:
    x = torch.full((20000,), 1.0 + 2 ** -9)  # a quarter of the way from 1.0 to the next bf16 value, 1 + 2^-7
    out = torch.empty(20000, dtype=torch.bfloat16)
    round_stochastic_(x.clone(), out, 0, 7)
    up = (out.float() > 1.0).float().mean().item()
    assert abs(up - 0.25) < 0.02, up
    other = torch.empty(20000, dtype=torch.bfloat16)
    round_stochastic_(x.clone(), other, 0, 7)
    assert torch.equal(out, other)
    piece = torch.empty(5000, dtype=torch.bfloat16)
    round_stochastic_(x[:5000].clone(), piece, 15000, 7)  # the same elements by index, cut elsewhere
    assert torch.equal(piece, out[15000:])
    round_stochastic_(x.clone(), other, 0, 8)
    assert not torch.equal(out, other)
    exact = torch.randn(1000).bfloat16().float()
    round_stochastic_(exact.clone(), piece[:1000], 3, 9)
    assert torch.equal(piece[:1000].float(), exact)  # a bf16 value is kept


def test_int8_trains_as_fp32_does(wrapped) -> None:
    losses = {}
    for fmt in ("float32", "int8", "bfloat16"):
        model = gpt(layers=3)
        tz.wrap(model, tier_config(tier="host", optimizer_state_dtype=fmt))
        opt = tz.AdamW(model, lr=3e-3)
        for x in batches(12):
            loss = model(x, x).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
        losses[fmt] = loss.item()
        runtime.close(model)
    assert losses["float32"] < 5.0
    assert abs(losses["int8"] - losses["float32"]) < 0.01 * losses["float32"], losses
    assert abs(losses["bfloat16"] - losses["float32"]) < 0.01 * losses["float32"], losses


PLACEMENTS = {
    "nvme": lambda d: tier_config(d, tier="nvme"),
    "split": lambda d: tier_config(d, tier="host", optimizer_states={"host": 0.5, "nvme": 0.5}),
    "device": lambda d: tier_config(d, tier="host", optimizer_states="device", grads=None),
    "async": lambda d: tier_config(d, tier="nvme", streams="async"),
    "in_backward": lambda d: tier_config(d, tier="host", step_in_backward=True),
}


@pytest.fixture(scope="module")
def host_runs() -> dict[tuple[str, str], dict[str, torch.Tensor]]:
    out = {}
    for fmt, master in (("int8", "float32"), ("bfloat16", "bfloat16")):
        model, opt = train(tier_config(tier="host", **_formats(fmt, master)))
        out[fmt, master] = opt_state(model, opt)
        runtime.close(model)
    return out


def _formats(fmt: str, master: str) -> dict[str, str]:
    kw = dict(optimizer_state_dtype=fmt, master_dtype=master)
    return kw if master == "float32" else dict(kw, compute_dtype="bfloat16")


@pytest.mark.parametrize("where", sorted(PLACEMENTS))
@pytest.mark.parametrize("fmt,master", [("int8", "float32"), ("bfloat16", "bfloat16")])
def test_same_bits_on_every_placement(tmp_path: Path, where: str, fmt: str, master: str, host_runs) -> None:
    config = PLACEMENTS[where](tmp_path / "swap").replace(**_formats(fmt, master))
    model, opt = train(config)
    state = opt_state(model, opt)
    runtime.close(model)
    expected = host_runs[fmt, master]
    assert sorted(state) == sorted(expected)
    for key, value in expected.items():
        assert state[key].dtype == value.dtype and torch.equal(state[key], value), (where, key)


def test_accumulate_and_sgd_momentum_formats(wrapped) -> None:
    a, opt_a = train(tier_config(tier="host", optimizer_state_dtype="int8"), accumulate=True)
    sa = opt_state(a, opt_a)
    b, opt_b = train(tier_config(tier="host", optimizer_state_dtype="int8", step_in_backward=True), accumulate=True)
    assert all(torch.equal(v, opt_state(b, opt_b)[k]) for k, v in sa.items())
    runtime.close(a)
    runtime.close(b)
    for fmt in ("bfloat16", "int8"):
        m, opt = train(tier_config(tier="host", optimizer_state_dtype=fmt), sgd=True)
        kinds = {k.split("/")[-1]: v.dtype for k, v in opt_state(m, opt).items()}
        assert kinds == {"master": torch.float32, "momentum": torch.bfloat16 if fmt == "bfloat16" else torch.uint8}
        runtime.close(m)


def train_groups(config: tz.Config, *, sgd: bool) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Three steps with two param groups of different hyper-parameters and two parameters in
    none (left out: gaps in their windows); (the state as stored, the model's weights before)."""
    model = gpt(layers=3)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    tz.wrap(model, config)
    named = list(model.named_parameters())
    vectors = [p for _, p in named if p.dim() == 1]
    groups = [{"params": [p for _, p in named if p.dim() > 1], "weight_decay": 0.1},
              {"params": vectors[:-2], "weight_decay": 0.0, "lr": 1e-3}]
    opt = tz.SGD(groups, lr=0.05, momentum=0.9) if sgd else tz.AdamW(groups, lr=3e-3)
    for x in batches(3):
        model(x, x).loss.backward()
        opt.step()
        opt.zero_grad()
    state = opt_state(model, opt)
    runtime.close(model)
    return state, before


@pytest.mark.parametrize("fmt,master,sgd", [("int8", "float32", False), ("bfloat16", "bfloat16", False),
                                            ("int8", "bfloat16", True), ("float32", "bfloat16", True)])
def test_fused_kernel_gives_the_eager_bits(monkeypatch, fmt: str, master: str, sgd: bool) -> None:
    """[Note: fused state windows]: the kernel and the eager path give the same bits, whatever
    the windows (a block in one, or in many cut mid-parameter and run on several threads), with
    rows of hyper-parameters and gaps. (The eager path once sliced fp32 master weights at the
    window's offset: wrong weights updated from a block's second window on.)"""
    if window_kernel.library("sgd" if sgd else "adamw", master, fmt) is None:
        pytest.skip(f"no C++ compiler ({window_kernel.compiler()!r}) to build the fused window kernel")
    kw: dict[str, Any] = dict(tier="host", optimizer_state_dtype=fmt)
    if master == "bfloat16":
        kw.update(master_dtype="bfloat16", compute_dtype="bfloat16")
    # two threads for every run (the model's kernels too: their sums depend on it), so the small
    # windows spread over two whatever OMP_NUM_THREADS says
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        windows_and_paths(monkeypatch, kw, sgd)
    finally:
        torch.set_num_threads(threads)


def windows_and_paths(monkeypatch: Any, kw: dict[str, Any], sgd: bool) -> None:
    whole, before = train_groups(tier_config(**kw), sgd=sgd)
    monkeypatch.setattr(optim_base, "STATE_WINDOW", 16 * QUANT_BLOCK)
    fused, _ = train_groups(tier_config(**kw), sgd=sgd)
    assert_state_equal(fused, whole, "small windows against whole blocks")
    with window_kernel.built_with(None):
        eager, _ = train_groups(tier_config(**kw), sgd=sgd)
    assert_state_equal(eager, whole, "eager path against the fused kernel")
    left_out = [n for n, p in gpt(layers=3).named_parameters() if p.dim() == 1][-2:]
    model = gpt(layers=3)
    tz.wrap(model, tier_config(**kw))
    state = runtime.state_of(model)
    for name in left_out:  # a parameter in no group keeps its weights
        flat, i = state.locate(dict(model.named_parameters())[name])
        slot = flat.layout.slots[i]
        got = whole[f"{flat.name}/master"][slot.offset:slot.offset + slot.numel].float()
        assert torch.equal(got, before[name].view(-1).to(got.dtype).float()), name
    runtime.close(model)


def test_without_a_compiler_one_warning_and_the_same_bits() -> None:
    if window_kernel.library("adamw", "float32", "int8") is None:
        pytest.skip(f"no C++ compiler ({window_kernel.compiler()!r}) to build the fused window kernel")
    fused, _ = train_groups(tier_config(tier="host", optimizer_state_dtype="int8"), sgd=False)
    with window_kernel.built_with("/nonexistent/c++"), pytest.warns(RuntimeWarning) as caught:
        eager, _ = train_groups(tier_config(tier="host", optimizer_state_dtype="int8"), sgd=False)
        assert window_kernel.library("adamw", "float32", "int8") is None
    assert [str(w.message) for w in caught if "could not be built" in str(w.message)][1:] == []
    assert any("'/nonexistent/c++'" in str(w.message) and "same bits" in str(w.message) for w in caught)
    assert_state_equal(fused, eager, "no compiler")


@pytest.mark.parametrize("fmt", ["bfloat16", "int8"])
def test_tier_bytes_are_the_real_bytes(tmp_path: Path, fmt: str) -> None:
    config = tier_config(tmp_path / "swap", tier="host", optimizer_states={"host": 0.5, "nvme": 0.5},
                         optimizer_state_dtype=fmt)
    model, opt = train(config, steps=1)
    state = runtime.state_of(model)
    shards = [f.layout.shard_numel for f in opt.flat_params]
    placed = tz.tier_bytes(model)["optimizer_states"]
    # fp32 parameters homed with their states are the master weights (counted as params)
    moments = sum(2 * state_nbytes(n, fmt) for n in shards)
    masters = sum(4 * f.layout.shard_numel for f in opt.flat_params if f.ensure_master() is not f.param)
    assert sum(placed.values()) == moments + masters
    from tierzero.planning.placement import flat_tensors
    planned = [t for t in flat_tensors(model_like(), config) if t.kind == "moments"]
    assert sum(t.nbytes for t in planned) == moments
    del state
    runtime.close(model)


def model_like() -> Any:
    with torch.device("meta"):
        return gpt(layers=3, seed=None)


def test_checkpoint_keeps_the_format_and_resumes_bit_for_bit(tmp_path: Path) -> None:
    config = tier_config(tmp_path / "swap", tier="nvme", optimizer_state_dtype="int8")
    whole, opt_whole = train(config, steps=STEPS)
    expected = opt_state(whole, opt_whole)
    runtime.close(whole)
    half, opt_half = train(config, steps=STEPS // 2)
    tz.save_checkpoint(tmp_path / "ckpt", half, opt_half)
    runtime.close(half)
    manifest = (next((tmp_path / "ckpt").glob("ckpt-*")) / "manifest.json").read_text()
    assert '"exp_avg": "int8"' in manifest and '"exp_avg_sq": "int8"' in manifest
    model = gpt(layers=3)
    tz.wrap(model, config)
    opt = tz.AdamW(model, lr=3e-3, weight_decay=0.1)
    tz.load_checkpoint(tmp_path / "ckpt", model, opt)
    for x in batches(STEPS)[STEPS // 2:]:
        model(x, x).loss.backward()
        opt.step()
        opt.zero_grad()
    state = opt_state(model, opt)
    runtime.close(model)
    for key, value in expected.items():
        assert torch.equal(state[key], value), key
    # another format: refused naming both, converted when asked
    other = gpt(layers=3)
    tz.wrap(other, config.replace(optimizer_state_dtype="bfloat16"))
    opt = tz.AdamW(other, lr=3e-3)
    with pytest.raises(CheckpointError, match="in int8, this optimizer keeps it in bfloat16.*convert_states=True"):
        tz.load_checkpoint(tmp_path / "ckpt", other, opt)
    tz.load_checkpoint(tmp_path / "ckpt", other, opt, convert_states=True)
    converted = opt_state(other, opt)
    runtime.close(other)
    source = gpt(layers=3)
    tz.wrap(source, config)
    sopt = tz.AdamW(source, lr=3e-3)
    tz.load_checkpoint(tmp_path / "ckpt", source, sopt)
    saved = opt_state(source, sopt)
    runtime.close(source)
    for key, value in saved.items():
        if key.endswith("/master"):
            assert torch.equal(converted[key], value)
            continue
        numel = converted[key].numel()
        codec = StateCodec("int8", unsigned=key.endswith("exp_avg_sq"))
        wide = codec.decode(value, numel, 0, numel, torch.empty(-(-numel // QUANT_BLOCK) * QUANT_BLOCK))
        assert torch.equal(converted[key], wide.bfloat16()), key


def test_state_dict_refuses_another_format(wrapped) -> None:
    a, opt_a = train(tier_config(tier="host", optimizer_state_dtype="int8"), steps=1)
    sd = opt_a.state_dict()
    b = wrapped(gpt(layers=3), tier_config(tier="host", optimizer_state_dtype="bfloat16"))
    opt_b = tz.AdamW(b, lr=3e-3, weight_decay=0.1)
    with pytest.raises(ValueError, match="expected torch.bfloat16 .* got torch.uint8"):
        opt_b.load_state_dict(sd)
    runtime.close(a)

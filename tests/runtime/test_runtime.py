"""tz.wrap: block grouping, hooks, parameters, state dicts, inference, bad input."""

from __future__ import annotations

import copy
import warnings
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import tierzero as tz
from tierzero import runtime
from tierzero.models import GPT, GPTConfig, build
from tierzero.config.tiernames import Tier
import builders
from builders import tier_config
from pairs import step_and_zero

D, VOCAB, SEQ = 60, 257, 32


def gpt(**kw: Any) -> GPT:
    return builders.gpt(seq=SEQ, **kw)


def batch(seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (2, SEQ), generator=g), torch.randint(0, VOCAB, (2, SEQ), generator=g)


def cfg(**kw: Any) -> tz.Config:
    return tier_config(tier="host", **{"device_budget": "2MiB", **kw})


def test_default_blocks_are_the_repeated_layers_plus_root(wrapped) -> None:
    model = gpt()
    params = dict(model.named_parameters())
    wrapped(model, cfg())
    state = runtime.state_of(model)
    assert [b.name for b in state.blocks] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "root"]
    root = state.blocks[-1]
    assert [s.fqn for s in root.flats[0].layout.slots] == ["wte.weight", "wpe.weight", "ln_f.weight", "ln_f.bias"]
    # Same Parameter objects, same shapes, tied weight still tied; no data outside compute.
    assert dict(model.named_parameters()) == params
    assert model.lm_head.weight is model.wte.weight
    assert model.wte.weight.shape == (VOCAB, D) and model.wte.weight.stride() == (0, 0)
    x, y = batch()
    model(x, y).loss.backward()
    with torch._C.DisableTorchFunctionSubclass():  # autograd's .grad: p.grad reads the flat gradient
        assert all(p.grad is None for p in model.parameters())
    assert not state.ctx.account.held


def test_block_classes_and_min_block_bytes(wrapped) -> None:
    model = wrapped(gpt(), cfg(block_classes=("MLP", "CausalSelfAttention")))
    names = [b.name for b in runtime.state_of(model).blocks]
    assert names[:2] == ["blocks.0.attn", "blocks.0.mlp"] and len(names) == 9
    layer_bytes = (12 * D * D + 13 * D) * 4
    model2 = wrapped(gpt(), cfg(min_block_bytes=int(1.5 * layer_bytes)))
    assert [b.name for b in runtime.state_of(model2).blocks] == ["blocks.0+1", "blocks.2+1", "root"]
    x, y = batch()
    ref = gpt()
    torch.testing.assert_close(model2(x, y).loss, ref(x, y).loss, rtol=0, atol=0)


def test_unknown_block_class_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"block_classes: no module of class \['Blok'\].*Block"):
        tz.wrap(gpt(), cfg(block_classes=("Blok",)))


def test_wrapping_twice_is_an_error(wrapped) -> None:
    model = wrapped(gpt(), cfg())
    with pytest.raises(ValueError, match="is or contains part of a tierzero-wrapped model"):
        tz.wrap(model, cfg())
    with pytest.raises(ValueError, match="is or contains part of"):
        tz.wrap(model.blocks[0], cfg())
    with pytest.raises(ValueError, match="is or contains part of"):
        tz.wrap(nn.Sequential(model), cfg())


def test_device_budget_smaller_than_a_block_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match=r"device_budget .* smaller than the root block .* 'blocks.0'.*raise"):
        tz.wrap(gpt(), cfg(device_budget="100KiB"))
    with pytest.raises(ValueError, match="prefetch reserve"):
        tz.wrap(gpt(), cfg(device_budget="1MiB", prefetch=tz.PrefetchConfig(policy="bytes", reserve="1MiB")))


def test_host_budget_too_full_to_stage_nvme_tensors_fails_at_wrap_and_optimizer(tmp_path: Any) -> None:
    """Gradients homed on the host leave too little room to stage an NVMe block's parameters:
    wrap says so, instead of the first forward waiting for room nothing can make; the same
    when the optimizer's host-homed states would take that room (wrap's plan counts them); nothing
    is left behind either time."""
    model = gpt()
    block = sum(p.numel() for p in model.blocks[0].parameters()) * 4
    grads = sum(p.numel() for p in model.parameters()) * 4
    tight = dict(device_budget="4MiB", nvme_dir=str(tmp_path / "a"), params="nvme", compute_dtype="float32")
    with pytest.raises(ValueError, match=r"staged through host memory.*raise host_budget"):
        tz.wrap(gpt(), tz.Config(host_budget=grads + block // 2, grads="host", **tight))
    assert not any(p.is_file() for p in (tmp_path / "a").rglob("*"))
    tight["nvme_dir"] = str(tmp_path / "b")
    # the optimizer's host-homed states take that room: wrap's plan counts them and says so at once
    with pytest.raises(ValueError, match=r"staged through host memory.*raise host_budget"):
        tz.wrap(gpt(), tz.Config(host_budget=3 * grads + block // 2, grads="nvme", optimizer_states="host", **tight))
    assert not any(p.is_file() for p in (tmp_path / "b").rglob("*"))


def test_meta_model_without_reset_parameters_is_a_clear_error() -> None:
    class Scale(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(3, device="meta"))

    model = nn.Sequential(nn.Linear(3, 3, device="meta"), Scale())
    with pytest.raises(ValueError, match=r"meta device .* without reset_parameters\(\).*'1 \(Scale\)'"):
        tz.wrap(model, cfg())


def test_meta_model_is_materialised_block_by_block(wrapped) -> None:
    model = build("tiny", device="meta", n_layer=2, seq_len=SEQ)
    params = list(model.parameters())
    wrapped(model, cfg())
    assert list(model.parameters()) == params and model.lm_head.weight is model.wte.weight
    sd = model.state_dict()
    assert all(not v.is_meta and torch.isfinite(v).all() for v in sd.values())
    assert sd["blocks.0.ln_1.weight"].eq(1).all()  # LayerNorm.reset_parameters
    x, _ = batch()
    assert torch.isfinite(model(x % 256).logits).all()


def test_state_dict_roundtrip(wrapped) -> None:
    ref = gpt()
    model = wrapped(copy.deepcopy(ref), cfg())
    sd = model.state_dict()
    assert sd.keys() == ref.state_dict().keys()
    for k, v in ref.state_dict().items():
        assert sd[k].device.type == "cpu" and torch.equal(sd[k], v), k
    other = GPT(GPTConfig(vocab_size=VOCAB, seq_len=SEQ, n_layer=4, n_head=4, n_embd=D))
    model.load_state_dict(other.state_dict())
    full = tz.full_state_dict(model)
    for k, v in other.state_dict().items():
        assert torch.equal(full[k], v), k
    x, y = batch()
    torch.testing.assert_close(model(x, y).loss, other(x, y).loss, rtol=0, atol=0)
    assert model.wte.weight.stride() == (0, 0)  # back to placeholders after the load
    with pytest.raises(ValueError, match="assign=True"):
        model.load_state_dict(other.state_dict(), assign=True)


def test_inference_eval_and_no_grad_match_plain_torch(wrapped) -> None:
    ref = gpt()
    model = wrapped(copy.deepcopy(ref), cfg())
    x, y = batch()
    model.eval()
    ref.eval()
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(model(x).logits, ref(x).logits, rtol=0, atol=0)
    state = runtime.state_of(model)
    assert state.ctx.prefetcher.trace((False, False)) is not None
    assert not state.ctx.account.held
    model.train()
    ref.train()
    model(x, y).loss.backward()
    assert state.ctx.prefetcher.trace((True, True))[-1].unit == "blocks.0"


def test_buffers_stay_plain_on_the_device(wrapped) -> None:
    class WithBuffer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(7, 7) for _ in range(3))
            self.register_buffer("scale", torch.full((7,), 0.5))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x) * self.scale
            return x

    torch.manual_seed(0)
    ref = WithBuffer()
    model = wrapped(copy.deepcopy(ref), cfg())
    pm = runtime.placement_manager(model)
    assert model.scale.device == pm.device and type(model.scale) is torch.Tensor
    x = torch.randn(3, 7)
    torch.testing.assert_close(model(x), ref(x), rtol=0, atol=0)
    assert torch.equal(model.state_dict()["scale"], ref.scale)


def test_dynamic_control_flow_warns_once_and_rerecords(wrapped) -> None:
    class Skippy(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(nn.Linear(9, 9) for _ in range(4))

        def forward(self, x: torch.Tensor, skip: bool) -> torch.Tensor:
            for i, layer in enumerate(self.layers):
                if not (skip and i == 2):
                    x = torch.tanh(layer(x))
            return x.square().mean()

    torch.manual_seed(0)
    ref = Skippy()
    model = wrapped(copy.deepcopy(ref), cfg(prefetch=tz.PrefetchConfig(policy="lookahead", depth=1)))
    opt, ropt = tz.AdamW(model, lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    x = torch.randn(5, 9)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step, skip in enumerate([False, False, True, True, False, True]):
            loss, rloss = model(x, skip), ref(x, skip)
            torch.testing.assert_close(loss, rloss, rtol=0, atol=0)
            loss.backward()
            rloss.backward()
            step_and_zero((opt, ropt))
    msgs = [str(w.message) for w in caught if "differs from the recorded trace" in str(w.message)]
    assert len(msgs) == 1
    prefetcher = runtime.state_of(model).ctx.prefetcher
    assert prefetcher.deviations == 3  # steps 2, 4 and 5 deviate; step 3 follows step 2's trace


def test_zero_grad_clears_flat_gradients(wrapped) -> None:
    model = wrapped(gpt(), cfg())
    opt = tz.AdamW(model, lr=1e-2)
    x, y = batch()
    model(x, y).loss.backward()
    opt.zero_grad()
    before = model.state_dict()
    opt.step()  # no gradients since zero_grad: nothing to do, as torch skips params without grad
    after = model.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_step_stats_report_prefetch_hits(wrapped) -> None:
    model = wrapped(gpt(), cfg(device_budget=2_000_000))
    for _ in range(3):
        x, y = batch()
        model(x, y).loss.backward()
        stats = runtime.step_stats(model)
    assert stats.prefetch_hits > 0 and stats.prefetch_misses == 0
    assert set(stats.stall_s) == {"device", "host", "nvme"}
    pm = runtime.placement_manager(model)
    assert pm.peak_bytes(Tier.DEVICE) <= pm.budget(Tier.DEVICE)


def test_bfloat16_compute_keeps_fp32_master_weights(wrapped) -> None:
    ref = gpt()
    model = wrapped(copy.deepcopy(ref), cfg(compute_dtype="bfloat16"))
    assert model.wte.weight.dtype == torch.bfloat16
    opt, ropt = tz.AdamW(model, lr=1e-3), torch.optim.AdamW(ref.parameters(), lr=1e-3, fused=True)
    for step in range(3):
        x, y = batch(step)
        loss, rloss = model(x, y).loss, ref(x, y).loss
        torch.testing.assert_close(loss.float(), rloss, rtol=2e-2, atol=0)
        loss.backward()
        rloss.backward()
        step_and_zero((opt, ropt))
    sd = model.state_dict()
    assert sd["wte.weight"].dtype == torch.float32  # from the master weights
    # The bf16 run moves the fp32 master weights the way the fp32 run moves its parameters.
    start = gpt().state_dict()
    delta = torch.cat([(sd[k] - start[k]).flatten() for k in start])
    ref_delta = torch.cat([(v - start[k]).flatten() for k, v in ref.state_dict().items()])
    assert F.cosine_similarity(delta, ref_delta, dim=0) > 0.95


def test_block_kwargs_tuple_outputs_and_parallel_calls(wrapped) -> None:
    class Cell(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = nn.Linear(11, 11)

        def forward(self, x: torch.Tensor, *, gate: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
            h = torch.tanh(self.lin(x)) * gate
            return h, {"aux": h.square().mean()}

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.cells = nn.ModuleList(Cell() for _ in range(3))

        def forward(self, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
            gate = torch.sigmoid(a.mean(0))
            ha, aux_a = self.cells[0](a, gate=gate)
            hb, aux_b = self.cells[0](b, gate=gate)  # the same block twice, on parallel branches
            h, aux = self.cells[1](ha + hb, gate=gate)
            h, _ = self.cells[2](h, gate=gate)
            return h.sum() + aux_a["aux"] + aux_b["aux"] + aux["aux"]

    torch.manual_seed(0)
    ref = Net()
    model = wrapped(copy.deepcopy(ref), cfg(device_budget="64KiB"))
    opt, ropt = tz.SGD(model, lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1, fused=True)
    for step in range(3):
        a, b = torch.randn(5, 11), torch.randn(5, 11)
        loss, rloss = model(a, b), ref(a, b)
        torch.testing.assert_close(loss, rloss, rtol=1e-6, atol=0)
        loss.backward()
        rloss.backward()
        step_and_zero((opt, ropt))
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-6, atol=0)
    assert not runtime.state_of(model).ctx.account.held


def test_saved_views_of_parameters_are_rebuilt_and_outer_hooks_still_apply(wrapped) -> None:
    """F.linear saves weight.t() (a view of the device copy) for backward; the runtime saves it as
    a reference into the block and rebuilds it from the copy fetched for backward, so released
    copies are really freed; tensors it does not own still reach the user's saved-tensor hooks."""
    ref = gpt()
    model = wrapped(copy.deepcopy(ref), cfg(device_budget=1_000_000))
    packed = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        packed.append(t.shape)
        return t.clone()

    x, y = batch()
    for _ in range(2):
        packed.clear()
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            loss = model(x, y).loss
        assert packed  # activations went through the outer hooks
        assert (VOCAB, D) not in packed and (D, VOCAB) not in packed  # the tied weight did not
        loss.backward()
    rloss = ref(x, y).loss
    rloss.backward()
    rloss = ref(x, y).loss
    rloss.backward()
    opt = tz.SGD(model, lr=1.0)
    opt.step()
    with torch.no_grad():
        for p in ref.parameters():
            p -= p.grad
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(model.state_dict()[k], v, rtol=1e-6, atol=1e-7, msg=k)


def test_a_failed_fetch_leaves_nothing_held_or_reserved(wrapped, monkeypatch) -> None:
    model = gpt()
    for p in model.blocks[1].mlp.parameters():
        p.requires_grad_(False)  # blocks.1 has a trainable and a frozen flat tensor
    ref = copy.deepcopy(model)
    wrapped(model, cfg())
    pm = runtime.placement_manager(model)
    x, y = batch()
    model(x, y).loss.backward()  # the first step records the trace
    from tierzero.runtime.flat import fetch_group

    real = fetch_group.start_gather
    calls = []

    def failing(ctx, flat):
        calls.append(flat.param.name)
        if flat.param.name == "blocks.1.frozen":
            raise OSError("injected: the read of the frozen half failed")
        return real(ctx, flat)

    monkeypatch.setattr(fetch_group, "start_gather", failing)
    with pytest.raises(OSError, match="injected"):
        model(x, y).loss
    assert "blocks.1.param" in calls  # the trainable half had started before the failure
    monkeypatch.setattr(fetch_group, "start_gather", real)
    # blocks.1 is not held and pins nothing (the root's hold of the interrupted forward ends
    # at the next forward's start, as for any forward that raised)
    assert "blocks.1" not in runtime.state_of(model).ctx.account.held
    for h in pm.handles:
        if h.owner == "blocks.1":
            assert pm.record(h).pins(Tier.DEVICE) == 0 and pm.record(h).pins(Tier.HOST) == 0, h
    # the model still trains, and matches its plain twin
    opt, ropt = tz.SGD(model, lr=0.1), torch.optim.SGD([p for p in ref.parameters() if p.requires_grad], lr=0.1, fused=True)
    opt.zero_grad()
    for seed in (2, 3):
        x, y = batch(seed)
        model(x, y).loss.backward()
        ref(x, y).loss.backward()
        step_and_zero((opt, ropt))
    for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=n)


def test_a_failed_optimizer_leaves_no_state_behind(tmp_path) -> None:
    model = gpt()
    # room on the states' tier for the fp32 parameters (master weights) but not the moments
    n_bytes = sum(p.numel() for p in model.parameters()) * 4
    tz.wrap(model, cfg(nvme_dir=str(tmp_path), params="nvme", optimizer_states="nvme"))
    pm = runtime.placement_manager(model)
    # wrap's plan counts the moments: a budget taken away since (as by another tenant) refuses them
    pm.budgets[tz.Tier.NVME].limit = n_bytes + n_bytes // 2
    try:
        nvme_before = pm.bytes_used("nvme")
        for _ in range(2):  # a retry meets the same clear error, not a name clash
            with pytest.raises(ValueError, match="nvme"):
                tz.AdamW(model, lr=1e-3)
            assert [h for h in pm.handles if h.kind.value.startswith("exp_avg")] == []
            assert pm.bytes_used("nvme") == nvme_before
    finally:
        runtime.close(model)

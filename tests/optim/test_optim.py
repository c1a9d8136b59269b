"""tz.AdamW / tz.SGD / tz.clip_grad_norm_ against torch, state dicts, schedulers, bad input."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import tierzero as tz
from tierzero import runtime
from tierzero.placement.handles import Kind
from pairs import step_and_zero


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(13, 13) for _ in range(3))
        self.head = nn.Linear(13, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return self.head(x).square().mean()


def pair(**cfg: Any) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = Net()
    model = copy.deepcopy(ref)
    tz.wrap(model, tz.Config(device_budget="1MiB", host_budget="64MiB", compute_dtype="float32", **cfg))
    return model, ref


def backward(model: nn.Module, ref: nn.Module, seed: int) -> None:
    x = torch.randn(4, 13, generator=torch.Generator().manual_seed(seed))
    model(x).backward()
    ref(x).backward()


def close(model: nn.Module) -> None:
    pm = runtime.placement_manager(model)
    assert pm.peak_bytes("device") <= pm.budget("device")
    runtime.close(model)


def assert_same(model: nn.Module, ref: nn.Module) -> None:
    sd = model.state_dict()
    for k, v in ref.state_dict().items():
        torch.testing.assert_close(sd[k], v, rtol=1e-6, atol=0, msg=k)


def test_sgd_without_momentum_and_zero_grad_to_zeros() -> None:
    model, ref = pair()
    opt, ropt = tz.SGD(model, lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1, fused=True)
    for step in range(3):
        backward(model, ref, step)
        opt.step()
        ropt.step()
        opt.zero_grad(set_to_none=False)
        ropt.zero_grad(set_to_none=False)
    assert_same(model, ref)
    close(model)


def test_clip_returns_total_norm_and_scales_lazily() -> None:
    model, ref = pair()
    backward(model, ref, 0)
    norm = tz.clip_grad_norm_(model, 1e-3)
    rnorm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e-3)
    assert norm.dtype == torch.float32 and torch.equal(norm, rnorm)
    # A second clip sees the scaled gradients, as torch's would.
    torch.testing.assert_close(tz.clip_grad_norm_(model, 1.0),
                               torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0), rtol=1e-6, atol=0)
    # Accumulating more gradient after clipping applies the pending scale first.
    backward(model, ref, 1)
    torch.testing.assert_close(tz.clip_grad_norm_(model, 1.0),
                               torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0), rtol=1e-6, atol=0)
    close(model)


def test_state_dict_roundtrip_continues_identically(tmp_path: Any) -> None:
    model, ref = pair(optimizer_states="nvme", nvme_dir=str(tmp_path))
    opt, ropt = tz.AdamW(model, lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    backward(model, ref, 0)
    step_and_zero((opt, ropt))
    saved = opt.state_dict()
    assert saved["state"]["layers.0"]["step"] == 1 and saved["param_groups"][0]["lr"] == 1e-2
    model_sd = model.state_dict()
    # Train on, then restore the model and optimizer and take the same step again.
    model(torch.randn(4, 13)).backward()
    opt.step()
    opt.zero_grad()
    model.load_state_dict(model_sd)
    opt.load_state_dict(saved)
    backward(model, ref, 1)
    opt.step()
    ropt.step()
    assert_same(model, ref)
    close(model)


def test_scheduler_changes_the_lr_used() -> None:
    model, ref = pair()
    opt, ropt = tz.AdamW(model, lr=1e-2), torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.1)
    rsched = torch.optim.lr_scheduler.StepLR(ropt, step_size=1, gamma=0.1)
    for step in range(3):
        backward(model, ref, step)
        step_and_zero((opt, ropt), (sched, rsched))
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-5)
    assert_same(model, ref)
    close(model)


def test_bad_arguments_are_clear_errors() -> None:
    model, _ = pair()
    with pytest.raises(ValueError, match="betas in"):
        tz.AdamW(model, betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="SGD: expected lr"):
        tz.SGD(model, lr=-1.0)
    with pytest.raises(ValueError, match="not wrapped by tierzero"):
        tz.AdamW(Net())
    for p in model.parameters():
        p.requires_grad_(False)
    close(model)
    torch.manual_seed(0)
    frozen = Net().requires_grad_(False)
    tz.wrap(frozen, tz.Config(device_budget="1MiB", compute_dtype="float32"))
    with pytest.raises(ValueError, match="no trainable parameters"):
        tz.AdamW(frozen)
    close(frozen)


def test_step_in_backward_updates_during_backward_and_refuses_clipping(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    ref = copy.deepcopy(model)
    tz.wrap(model, tz.Config(device_budget="1MiB", host_budget="4MiB", compute_dtype="float32",
                             step_in_backward=True))
    opt = tz.AdamW(model, lr=0.1)
    x = torch.randn(4, 8)
    try:
        model(x).sum().backward()
        # the blocks were updated by backward itself, before opt.step()
        assert not torch.equal(model.state_dict()["0.weight"], ref[0].weight.detach())
        with pytest.raises(ValueError, match="step_in_backward=False to clip"):
            tz.clip_grad_norm_(model, 1.0)
        with pytest.raises(RuntimeError, match="before opt.step()"):
            model(x).sum().backward()  # a second backward before opt.step()
    finally:
        runtime.close(model)


@pytest.mark.parametrize("params,states,shared", [("host", "host", True), ("nvme", "host", False)])
def test_fp32_params_are_the_master_weights_on_the_same_tier(tmp_path: Any, params: str, states: str,
                                                              shared: bool) -> None:
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    tz.wrap(model, tz.Config(device_budget="1MiB", host_budget="4MiB", nvme_dir=str(tmp_path),
                             params=params, optimizer_states=states, compute_dtype="float32"))
    try:
        tz.AdamW(model, lr=0.1)
        masters = [h for h in runtime.placement_manager(model).handles if h.kind is Kind.MASTER]
        assert (masters == []) is shared
    finally:
        runtime.close(model)


def test_a_new_optimizer_takes_over_with_fresh_state(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    ref = copy.deepcopy(model)
    tz.wrap(model, tz.Config(device_budget="1MiB", host_budget="4MiB", nvme_dir=str(tmp_path),
                             params="host", optimizer_states="nvme", compute_dtype="float32"))
    pm = runtime.placement_manager(model)
    try:
        old = tz.AdamW(model, lr=0.1)
        model(torch.randn(4, 8)).sum().backward()
        step_and_zero((old,))
        nvme_before = pm.bytes_used("nvme")
        opt = tz.AdamW(model, lr=1e-2)  # takes over: the old moments are given back, not shared
        assert pm.bytes_used("nvme") == nvme_before
        assert len([h for h in pm.handles if h.kind is Kind.EXP_AVG]) == len(opt.flat_params)
        for stale in (old.step, old.state_dict, lambda: tz.save_checkpoint(tmp_path / "ckpt", model, old)):
            with pytest.raises(RuntimeError, match="newer tiered optimizer"):
                stale()
        assert not (tmp_path / "ckpt").exists()  # refused before anything was written
        # the new optimizer starts from zero moments: the same updates as a fresh torch AdamW
        ref.load_state_dict({k: v for k, v in model.state_dict().items()})
        ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2, fused=True)
        for _ in range(3):
            x = torch.randn(4, 8)
            model(x).sum().backward()
            ref(x).sum().backward()
            step_and_zero((opt, ropt))
        for (n, a), b in zip(model.state_dict().items(), ref.state_dict().values()):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6, msg=n)
    finally:
        runtime.close(model)


def test_a_torch_optimizer_over_a_wrapped_model_is_refused() -> None:
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    params = list(model.parameters())
    tz.wrap(model, tz.Config(device_budget="1MiB", host_budget="4MiB", compute_dtype="float32"))
    try:
        opt = torch.optim.AdamW(params, lr=0.1)
        model(torch.randn(4, 8)).sum().backward()
        for _ in range(2):  # every step, not only the first
            with pytest.raises(ValueError, match="would not train.*tz.AdamW"):
                opt.step()
        plain = nn.Linear(3, 3)  # optimizers of other models are untouched
        plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
        plain(torch.randn(2, 3)).sum().backward()
        plain_opt.step()
    finally:
        runtime.close(model)


def test_a_torch_optimizer_stepped_before_wrap_or_given_more_params_is_refused_after() -> None:
    model = nn.Sequential(*[nn.Linear(8, 8) for _ in range(3)])
    params = list(model.parameters())
    early = torch.optim.SGD(params[:2], lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    early.step()  # clean: the model is not wrapped yet
    later = torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)
    later.step()  # clean: another model's parameters
    tz.wrap(model, tz.Config(device_budget="1MiB", host_budget="4MiB", compute_dtype="float32"))
    try:
        with pytest.raises(ValueError, match="would not train"):
            early.step()  # the same Parameter objects, now wrapped
        later.step()
        later.add_param_group({"params": params[2:]})
        with pytest.raises(ValueError, match="would not train"):
            later.step()
    finally:
        runtime.close(model)


def test_a_host_budget_too_small_for_a_blocks_update_is_refused_at_construction(tmp_path: Any) -> None:
    """The update of a block holds its gradient, master weights and both moments on the host at
    once (all NVMe-homed, staged through host memory): a host budget that cannot hold that is
    refused by wrap's placement plan at once (the optimizer's constructor checks it again),
    naming the bytes it needs, instead of waiting at the first step; that many bytes then train."""
    import builders

    def attempt(host: str | int) -> nn.Module:
        model = builders.gpt(seq=16, layers=2, width=128)
        return tz.wrap(model, builders.tier_config(tmp_path / f"nvme-{host}", device_budget="4MiB", host_budget=host))

    with pytest.raises(ValueError, match=r"host: .* a block's update or an NVMe-homed tensor, staged through host "
                                         r"memory .* raise host_budget to at least (\d+) bytes") as e:
        attempt("1MiB")
    need = int(e.value.args[0].split("at least ")[1].split(" bytes")[0])
    model = attempt(need)
    try:
        opt = tz.AdamW(model, lr=1e-3)
        x = torch.randint(0, 257, (2, 16))
        model(x, x).loss.backward()
        opt.step()
        opt.zero_grad()
        runtime.settle(model)
    finally:
        runtime.close(model)

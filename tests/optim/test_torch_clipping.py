"""torch's and Accelerate's clipping on a wrapped model's parameters (p.grad stands for the flat
gradients: [Note: gradients seen through p.grad]): the norm and the steps of tz.clip_grad_norm_
and of plain PyTorch, or a clear refusal."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch import nn

import tierzero as tz
from builders import tier_config


class Net(nn.Module):
    """Uneven widths; the head's bias gets no gradient (unused), as torch's p.grad None."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(11, 13), nn.Linear(13, 7), nn.Linear(7, 13)])
        self.head = nn.Linear(13, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return (x @ self.head.weight.t()).square().mean()


def trio(wrapped: Any, config: tz.Config) -> tuple[nn.Module, nn.Module, nn.Module]:
    """(wrapped, clipped through torch), (wrapped, clipped with tz.clip_grad_norm_), plain."""
    torch.manual_seed(0)
    plain = Net()
    return wrapped(copy.deepcopy(plain), config), wrapped(copy.deepcopy(plain), config), plain


def run(wrapped: Any, config: tz.Config, clip: Callable[[nn.Module], Any], steps: int = 3,
        reference: Callable[[nn.Module], Any] | None = None) -> None:
    """`clip` on the first wrapped model and on the plain one, `reference` (tz.clip_grad_norm_ by
    default) on the second wrapped one: the same results and the same parameters, every step."""
    model, twin, plain = trio(wrapped, config)
    reference = reference or (lambda m: tz.clip_grad_norm_(m, 0.05))
    opts = tz.AdamW(model, lr=1e-2), tz.AdamW(twin, lr=1e-2), torch.optim.AdamW(plain.parameters(), lr=1e-2,
                                                                                fused=True)
    for step in range(steps):
        x = torch.randn(6, 11, generator=torch.Generator().manual_seed(step))
        for m in (model, twin, plain):
            m(x).backward()
        got, want, ref = clip(model), reference(twin), clip(plain)
        if got is not None:
            assert torch.equal(got, ref) and torch.equal(got, want), (step, got, want, ref)
        for opt in opts:
            opt.step()
            opt.zero_grad()
        for name, value in plain.state_dict().items():
            assert torch.equal(model.state_dict()[name], value), (step, name)
            assert torch.equal(twin.state_dict()[name], value), (step, name)


@pytest.mark.parametrize("foreach", [None, True, False])
def test_torch_clip_grad_norm_is_tz_clip_grad_norm(wrapped: Any, foreach: bool | None) -> None:
    run(wrapped, tier_config(tier="host"),
        lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05, foreach=foreach))


def test_torch_clip_grad_norm_with_gradients_on_nvme_and_inf_norm(wrapped: Any, tmp_path: Any) -> None:
    run(wrapped, tier_config(tmp_path, grads="nvme"),
        lambda m: torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01, norm_type=float("inf")),
        reference=lambda m: tz.clip_grad_norm_(m, 0.01, norm_type=float("inf")))


def test_clipping_some_parameters_scales_only_theirs(wrapped: Any) -> None:
    # a whole flat tensor (layers.0), part of one (layers.1's weight, not its bias) with part of the
    # root's: each group its own factor, as plain PyTorch
    def clip(m: nn.Module) -> None:
        torch.nn.utils.clip_grad_norm_(m.layers[0].parameters(), 0.01)
        torch.nn.utils.clip_grad_norm_([m.layers[1].weight, m.head.weight], 0.02)

    model, _, plain = trio(wrapped, tier_config(tier="host"))
    opt, popt = tz.AdamW(model, lr=1e-2), torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True)
    for step in range(2):
        x = torch.randn(6, 11, generator=torch.Generator().manual_seed(step))
        model(x).backward()
        plain(x).backward()
        clip(model)
        clip(plain)
        for opt_ in (opt, popt):
            opt_.step()
            opt_.zero_grad()
        for name, value in plain.state_dict().items():
            assert torch.equal(model.state_dict()[name], value), (step, name)


@pytest.mark.parametrize("foreach", [None, True])
def test_torch_clip_grad_value(wrapped: Any, foreach: bool | None) -> None:
    def clip(m: nn.Module) -> None:
        torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)  # a pending factor, folded in first
        torch.nn.utils.clip_grad_value_(m.parameters(), 2e-3, foreach=foreach)

    run(wrapped, tier_config(tier="host"), clip, reference=clip)


def test_accelerate_clip_grad_norm(wrapped: Any) -> None:
    accelerate = pytest.importorskip("accelerate")
    accelerator = accelerate.Accelerator(cpu=True)
    run(wrapped, tier_config(tier="host"), lambda m: accelerator.clip_grad_norm_(m.parameters(), 0.05))


def test_other_uses_of_p_grad_are_refused_naming_the_parameter(wrapped: Any) -> None:
    model = wrapped(Net())
    assert all(p.grad is None for p in model.parameters())  # no backward yet, as torch
    model(torch.randn(2, 11)).backward()
    assert model.head.bias.grad is None  # no gradient reached it
    grad = model.layers[1].weight.grad
    assert grad is not None and grad.shape == (7, 13) and grad.dtype == torch.float32
    with pytest.raises(RuntimeError, match=r"'layers\.1\.weight'.*tz\.clip_grad_norm_"):
        grad.add_(1.0)
    with pytest.raises(RuntimeError, match="refused"):
        grad.sum()


def test_step_in_backward_refuses_torch_clipping(wrapped: Any, tmp_path: Any) -> None:
    model = wrapped(Net(), tier_config(tier="host", step_in_backward=True))
    opt = tz.AdamW(model, lr=1e-2)
    model(torch.randn(2, 11)).backward()
    with pytest.raises(ValueError, match="step_in_backward=False to clip"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.zero_grad()


def test_model_zero_grad_and_p_grad_none_forget_as_torch(wrapped: Any) -> None:
    # model.zero_grad() (not the optimizer's) between steps, and one parameter's p.grad set to None
    # after a backward (the optimizer skips it): as plain PyTorch, under the overlapped step
    model, _, plain = trio(wrapped, tier_config(tier="host"))
    opt, popt = tz.AdamW(model, lr=1e-2), torch.optim.AdamW(plain.parameters(), lr=1e-2, fused=True)
    for step in range(4):
        for m in (model, plain):
            m.zero_grad()
            m(torch.randn(6, 11, generator=torch.Generator().manual_seed(step))).backward()
            if step == 2:
                m.layers[1].weight.grad = None
        assert model.layers[1].weight.grad is None if step == 2 else model.layers[1].weight.grad is not None
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0)), step
        opt.step()
        popt.step()
        for name, value in plain.state_dict().items():
            assert torch.equal(model.state_dict()[name], value), (step, name)

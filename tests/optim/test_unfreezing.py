"""Parameters frozen at wrap and unfrozen later (progressive unfreezing, linear probe then
fine-tune), and frozen after wrap: trained as plain PyTorch trains them, step by step, with a
new optimizer, with a param group added, or with the old optimizer (which updates only what it
was given, though every unfrozen parameter gets its gradient)."""

from __future__ import annotations

import copy
from typing import Any, Callable

import pytest
import torch
from torch import nn

import tierzero as tz
from builders import tier_config

UNFREEZE_AT = 2


class Net(nn.Module):
    """A backbone (`embed` in the root block, `layers` the blocks) and a head (root)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(11, 13)
        self.layers = nn.ModuleList([nn.Linear(13, 13), nn.Linear(13, 7), nn.Linear(7, 13)])
        self.head = nn.Linear(13, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x)
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x).square().mean()

    def backbone(self) -> list[nn.Parameter]:
        return [*self.embed.parameters(), *self.layers.parameters()]


def adamw(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-2, fused=True)


def train(wrapped: Any, config: tz.Config, at_unfreeze: Callable[[Net, Any, bool], Any], steps: int = 5,
          clip: bool = False) -> None:
    """The backbone frozen before wrap, unfrozen at UNFREEZE_AT, where `at_unfreeze(model,
    optimizer, tiered)` returns the optimizer to go on with; losses, norms and every parameter the
    same bits as plain PyTorch's after every step."""
    torch.manual_seed(0)
    plain = Net()
    for p in plain.backbone():
        p.requires_grad_(False)
    model = wrapped(copy.deepcopy(plain), config)
    opt, popt = tz.AdamW([model.head.weight, model.head.bias], lr=1e-2), adamw(plain.head.parameters())
    for step in range(steps):
        if step == UNFREEZE_AT:
            for m in (model, plain):
                for p in m.backbone():
                    p.requires_grad_(True)
            opt, popt = at_unfreeze(model, opt, True), at_unfreeze(plain, popt, False)
        x = torch.randn(6, 11, generator=torch.Generator().manual_seed(step))
        loss, ploss = model(x), plain(x)
        loss.backward()
        ploss.backward()
        assert torch.equal(loss, ploss), step
        if clip:  # the gradients of what the optimizer leaves alone count too, as plain PyTorch counts them
            norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            assert torch.equal(norm, torch.nn.utils.clip_grad_norm_(plain.parameters(), 0.05)), step
        for o in (opt, popt):
            o.step()
            o.zero_grad()
        got = model.state_dict()
        for name, value in plain.state_dict().items():
            assert torch.equal(got[name], value), (step, name, (got[name] - value).abs().max())
    for p in plain.backbone():  # the backbone did train (or was meant not to)
        assert p.requires_grad


@pytest.mark.parametrize("where", ["host", "nvme"])
def test_unfrozen_then_a_new_optimizer(wrapped: Any, tmp_path: Any, where: str) -> None:
    config = tier_config(tmp_path if where == "nvme" else None, tier=where)
    train(wrapped, config, lambda m, opt, tiered: tz.AdamW(m, lr=1e-2) if tiered else adamw(m.parameters()))


def test_unfrozen_then_a_param_group_added(wrapped: Any) -> None:
    def add(m: Net, opt: Any, tiered: bool) -> Any:
        opt.add_param_group({"params": m.backbone(), "lr": 3e-3})
        return opt
    train(wrapped, tier_config(tier="host"), add, clip=True)


def test_unfrozen_with_the_old_optimizer_gets_gradients_but_no_update(wrapped: Any) -> None:
    train(wrapped, tier_config(tier="host"), lambda m, opt, tiered: opt, clip=True)


def test_unfrozen_in_a_layer_major_step(wrapped: Any) -> None:
    torch.manual_seed(0)
    plain = Net()
    plain.layers.requires_grad_(False)
    model = wrapped(copy.deepcopy(plain), tier_config(tier="host"))
    model(torch.randn(2, 11)).backward()  # a step while frozen
    model.layers.requires_grad_(True)
    plain.layers.requires_grad_(True)
    opt, popt = tz.AdamW(model, lr=1e-2), adamw(plain.parameters())
    opt.zero_grad()
    mbs = [torch.randn(3, 11, generator=torch.Generator().manual_seed(i)) for i in range(2)]
    tz.accumulate(model, mbs, lambda out, mb: out / 2)
    for mb in mbs:
        (plain(mb) / 2).backward()
    for o in (opt, popt):
        o.step()
    for name, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[name], value), name


@pytest.mark.parametrize("new_optimizer", [False, True], ids=["old optimizer", "new optimizer"])
def test_frozen_after_wrap_and_unfrozen_again(wrapped: Any, new_optimizer: bool) -> None:
    torch.manual_seed(0)
    plain = Net()
    model = wrapped(copy.deepcopy(plain), tier_config(tier="host"))
    opt, popt = tz.AdamW(model, lr=1e-2), adamw(plain.parameters())
    for step in range(5):
        if step in (1, 3):  # frozen after wrap, then unfrozen: the old optimizer skips it meanwhile;
            for m in (model, plain):  # a new one takes in a frozen flat tensor, then a trainable one
                m.layers[1].requires_grad_(step == 3)
            if new_optimizer:
                opt, popt = tz.AdamW(model, lr=1e-2), adamw([p for p in plain.parameters() if p.requires_grad])
        x = torch.randn(6, 11, generator=torch.Generator().manual_seed(step))
        model(x).backward()
        plain(x).backward()
        for o in (opt, popt):
            o.step()
            o.zero_grad()
        for name, value in plain.state_dict().items():
            assert torch.equal(model.state_dict()[name], value), (step, name)

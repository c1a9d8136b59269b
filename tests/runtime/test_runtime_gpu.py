"""tz.wrap on CUDA: device copies on the copy stream, bf16 compute with fp32 master weights."""

from __future__ import annotations

import copy

import pytest
import torch

import tierzero as tz
from tierzero import runtime
from tierzero.models import GPT
from tierzero.config.tiernames import Tier
from pairs import step_and_zero
import builders

pytestmark = pytest.mark.gpu

D, VOCAB, SEQ = 60, 257, 32


def gpt(device: str = "cpu") -> GPT:
    return builders.gpt(seq=SEQ).to(device)


def batches(n: int, device: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A learnable task: predict the current token (targets = inputs)."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, VOCAB, (4, SEQ), generator=g).to(device) for _ in range(n)]
    return [(x, x) for x in xs]


def budget(compute_bytes: int) -> int:
    block = (12 * D * D + 13 * D) * compute_bytes
    root = (VOCAB * D + SEQ * D + 2 * D) * compute_bytes
    return root + 2 * block + 64 * 1024


@pytest.mark.parametrize("params", ["host", "device"])
def test_fp32_on_cuda_matches_plain_torch(params: str) -> None:
    ref = gpt("cuda")
    model = copy.deepcopy(ref).cpu()
    tz.wrap(model, tz.Config(device_budget=budget(4) if params == "host" else "64MiB", host_budget="256MiB",
                             params=params, compute_dtype="float32"))
    assert model.wte.weight.device.type == "cuda"
    opt, ropt = tz.AdamW(model, lr=3e-3), torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True)
    try:
        for x, y in batches(10, "cuda"):
            loss, rloss = model(x, y).loss, ref(x, y).loss
            torch.testing.assert_close(loss, rloss, rtol=1e-4, atol=0)
            loss.backward()
            rloss.backward()
            torch.testing.assert_close(tz.clip_grad_norm_(model, 1.0),
                                       torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0).cpu(),
                                       rtol=1e-4, atol=0)
            step_and_zero((opt, ropt))
        sd = model.state_dict()
        for k, v in ref.state_dict().items():
            torch.testing.assert_close(sd[k], v.cpu(), rtol=1e-3, atol=1e-4, msg=k)
        pm = runtime.placement_manager(model)
        assert pm.peak_bytes(Tier.DEVICE) <= pm.budget(Tier.DEVICE)
    finally:
        runtime.close(model)


def test_bf16_auto_dtype_trains_like_fp32() -> None:
    ref = gpt("cuda")
    model = copy.deepcopy(ref).cpu()
    tz.wrap(model, tz.Config(device_budget=budget(2), host_budget="256MiB"))
    assert model.wte.weight.dtype == torch.bfloat16
    opt, ropt = tz.AdamW(model, lr=3e-3), torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True)
    losses, rlosses = [], []
    try:
        for x, y in batches(20, "cuda"):
            loss, rloss = model(x, y).loss, ref(x, y).loss
            losses.append(loss.item())
            rlosses.append(rloss.item())
            loss.backward()
            rloss.backward()
            step_and_zero((opt, ropt))
            runtime.step_stats(model)
        assert losses[-1] < 0.8 * losses[0]
        assert abs(losses[-1] - rlosses[-1]) < 0.1 * rlosses[-1]
        assert model.state_dict()["wte.weight"].dtype == torch.float32
        pm = runtime.placement_manager(model)
        assert pm.peak_bytes(Tier.DEVICE) <= pm.budget(Tier.DEVICE)
    finally:
        runtime.close(model)

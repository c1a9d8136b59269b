"""tz.wrap on CUDA: device copies on the copy stream, bf16 compute with fp32 master weights."""

from __future__ import annotations

import copy
from typing import Any

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
                                       torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0),  # on the device, as torch's
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


def beside_plain_torch(config: tz.Config, steps: int, *, autocast: bool = False, rtol: float = 1e-4) -> tuple[Any, int]:
    """A wrapped copy of the GPU's GPT trained beside it by plain torch (fused AdamW), the losses
    compared every step; the tiered optimizer and early capture's count, once closed."""
    ref = gpt("cuda")
    model = copy.deepcopy(ref).cpu()
    tz.wrap(model, config)
    opt, ropt = tz.AdamW(model, lr=3e-3), torch.optim.AdamW(ref.parameters(), lr=3e-3, fused=True)
    try:
        for x, y in batches(steps, "cuda"):
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss, rloss = model(x, y).loss, ref(x, y).loss
            torch.testing.assert_close(loss.float(), rloss.float(), rtol=rtol, atol=0)
            loss.backward()
            rloss.backward()
            step_and_zero((opt, ropt))
        return opt, runtime.state_of(model).ctx.account.captures
    finally:
        runtime.close(model)


def test_device_tier_states_step_on_the_gpu() -> None:
    """Gradients, master weights and moments on the device tier: the fused update runs on the GPU
    (its step counts made there), matching plain torch."""
    beside_plain_torch(tz.Config(device_budget="64MiB", host_budget="64MiB", params="device", grads="device",
                                 optimizer_states="device", compute_dtype="float32"), 5)


def test_an_update_that_would_mix_devices_is_refused_at_wrap_on_cuda() -> None:
    with pytest.raises(ValueError, match="grads='host' with optimizer_states='device'"):
        tz.wrap(gpt(), tz.Config(device_budget="64MiB", host_budget="64MiB", params="device", grads="host",
                                 optimizer_states="device"))


@pytest.mark.parametrize("step_in_backward", [False, True])
def test_fast_paths_on_cuda_match_plain_torch(step_in_backward: bool) -> None:
    """The overlapped step (or step_in_backward's updater) and early capture on CUDA: updates on
    their own thread, shares summed on the device, the gradient's copy to the host on the d2h
    stream; the losses follow plain torch."""
    opt, captures = beside_plain_torch(tz.Config(device_budget=budget(4), host_budget="256MiB", compute_dtype="float32",
                                                 step_in_backward=step_in_backward), 8)
    assert (opt._updater is not None) if step_in_backward else (opt._queue is not None)
    assert captures > 0


def test_bf16_autocast_over_fp32_parameters_follows_plain_torch() -> None:
    beside_plain_torch(tz.Config(device_budget=budget(4), host_budget="256MiB", compute_dtype="float32"), 5,
                       autocast=True, rtol=2e-2)


class _Slow(torch.nn.Module):
    """A block whose GPU work takes ~20 ms while the host queues it in microseconds."""

    def __init__(self, cycles: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(16, 16)
        self.cycles = cycles

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.cuda._sleep(self.cycles)
        return self.lin(x)


def test_adaptive_policy_times_blocks_with_cuda_events() -> None:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(1_000_000)
    end.record()
    end.synchronize()
    cycles = int(20.0 / (start.elapsed_time(end) / 1_000_000))  # ~20 ms
    model = torch.nn.Sequential(*[_Slow(cycles) for _ in range(4)])
    tz.wrap(model, tz.Config(device_budget="16MiB", host_budget="16MiB", compute_dtype="float32"))
    try:
        x = torch.randn(4, 16, device="cuda")
        opt = tz.AdamW(model)
        for _ in range(3):
            model(x).sum().backward()
            opt.zero_grad()
        state = runtime.state_of(model)
        times = state.ctx.prefetcher.times((True, True))
        forward = [times.compute_s(i) for i in range(3)]
        assert all(0.015 < t < 0.2 for t in forward), forward  # GPU time, not the host's launch time
    finally:
        runtime.close(model)

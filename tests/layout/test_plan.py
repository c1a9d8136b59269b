"""One placement plan (tierzero/layout/plan.py, [Note: one placement plan]) read by wrap and the
estimate alike, over a grid of placements: uniform, splits, "auto"; a frozen base on each tier;
the stream stand-in's pinned host region; ZeRO 1-3 at 2 ranks. At the estimate's least budgets
wrap accepts and a step trains; one page under any of them is refused at once naming the tier;
wrap places every block where the estimate planned it; "auto" moves no more NVMe bytes than any
fixed split the plan accepts at the same budgets."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import tierzero as tz
from tierzero import runtime
from tierzero.config import PAGE
from tierzero.planning import least_budgets, planned_tiers
from tierzero.planning.placement import placement_plan
import builders
from gloo import run_ranks

TIERS = ("device", "host", "nvme")
CASES = {
    "all on host": dict(params="host", grads="host", optimizer_states="host"),
    "all on the device": dict(params="device", optimizer_states="device"),
    "params and states on nvme": dict(params="nvme", grads="host", optimizer_states="nvme"),
    "states host/nvme": dict(optimizer_states={"host": 0.5, "nvme": 0.5}),
    "three-way splits": dict(params={"device": 0.3, "host": 0.3, "nvme": 0.4},
                             optimizer_states={"device": 0.3, "host": 0.3, "nvme": 0.4}),
    "params nvme, states split, grads nvme": dict(params="nvme", grads="nvme",
                                                   optimizer_states={"host": 0.5, "nvme": 0.5}),
    "auto": dict(optimizer_states="auto"),
    "auto params and states": dict(params="auto", optimizer_states="auto"),
    "step in backward on nvme": dict(params="nvme", optimizer_states="nvme", step_in_backward=True),
    "async stand-in, states nvme": dict(params="host", optimizer_states="nvme", streams="async"),
    "async stand-in, auto": dict(optimizer_states="auto", streams="async"),
    "frozen base on the device": dict(frozen="device"),
    "frozen base on the host": dict(frozen="host", optimizer_states={"host": 0.5, "nvme": 0.5}),
    "frozen base on nvme": dict(frozen="nvme", optimizer_states="auto"),
}


def model(case: str) -> torch.nn.Module:
    out = builders.gpt(layers=3, seq=16, width=44)
    if "frozen" in case:  # a LoRA-like base: the attention frozen
        for name, p in out.named_parameters():
            if "attn" in name:
                p.requires_grad_(False)
    return out


def config(nvme: Path, budgets: dict[str, int] | None = None, **kw: Any) -> tz.Config:
    sizes = budgets or {"device": 64 << 20, "host": 64 << 20, "nvme": 64 << 20}
    return tz.Config(nvme_dir=str(nvme), compute_dtype="float32", grads=kw.pop("grads", None),
                     device_budget=sizes["device"], host_budget=sizes["host"], nvme_budget=sizes["nvme"], **kw)


def step(m: torch.nn.Module) -> float:
    opt = tz.AdamW(m, lr=1e-3)
    x = torch.randint(0, 257, (2, 16), generator=torch.Generator().manual_seed(0))
    loss = m(x, targets=x).loss
    loss.backward()
    opt.step()
    opt.zero_grad()
    runtime.settle(m)
    return loss.item()


def check_least(case: str, kw: dict[str, Any], nvme: Path, world_size: int = 1) -> None:
    """At the least budgets wrap accepts, places the blocks as planned and a step trains; one
    page under each tier's least is refused at wrap, naming that tier."""
    least = least_budgets(model(case), config(nvme, **kw), world_size)
    cfg = config(nvme, least, **kw)
    m = tz.wrap(model(case), cfg)
    try:
        assert runtime.state_of(m).ctx.tiers == planned_tiers(model(case), cfg, world_size), case
        assert torch.isfinite(torch.tensor(step(m)))
    finally:
        runtime.close(m)
    for tier in TIERS:
        if least[tier] >= PAGE:
            with pytest.raises(ValueError, match=f"{tier}_budget"):
                tz.wrap(model(case), config(nvme, {**least, tier: least[tier] - PAGE}, **kw))


@pytest.mark.parametrize("case", list(CASES))
def test_least_budgets_train_and_a_page_less_is_refused(case: str, tmp_path: Path) -> None:
    check_least(case, dict(CASES[case]), tmp_path)


def _ranks(rank: int, world_size: int, nvme: str) -> None:
    for stage in (1, 2, 3):
        check_least("states host/nvme", dict(CASES["states host/nvme"], zero_stage=stage), Path(nvme), world_size)


def test_least_budgets_at_two_ranks_every_zero_stage(tmp_path: Path) -> None:
    run_ranks(_ranks, 2, tmp_path / "init", str(tmp_path / "nvme"))


@pytest.mark.parametrize("share", [0.25, 0.5, 0.75])
def test_auto_moves_no_more_nvme_bytes_than_any_fixed_split(share: float, tmp_path: Path) -> None:
    """Host budgets holding `share` of the states beyond what the states all on NVMe need, a
    device with room for an eighth of them: "auto" is accepted and moves no more NVMe bytes a step than any fixed split of the
    states (a tenth apart, host/NVMe and device/host/NVMe) the plan accepts at the same budgets."""
    probe = model("auto")
    on_nvme = placement_plan(probe, config(tmp_path, optimizer_states="nvme"))
    states = sum(t.nbytes for t in on_nvme.tensors if t.kind in ("master", "moments"))
    budgets = {"device": on_nvme.need["device"] + states // 8, "nvme": 64 << 20,
               "host": on_nvme.need["host"] + int(share * states)}
    auto = placement_plan(probe, config(tmp_path, budgets, optimizer_states="auto"))
    assert not auto.short()
    fixed = []
    for d in range(0, 11, 2):
        for h in range(0, 11 - d):
            split = {"device": d / 10, "host": h / 10, "nvme": 1 - (d + h) / 10}
            plan = placement_plan(probe, config(tmp_path, budgets, optimizer_states=split))
            if not plan.short():
                fixed.append((plan.nvme_step_bytes, split))
    assert fixed and auto.nvme_step_bytes <= min(fixed, key=lambda f: f[0])[0], (auto.resolved, min(fixed))
    m = tz.wrap(model("auto"), config(tmp_path, budgets, optimizer_states="auto"))
    try:
        assert runtime.state_of(m).ctx.tiers == auto.tiers
    finally:
        runtime.close(m)


def test_auto_places_gradients_on_nvme_when_the_host_is_short(tmp_path: Path) -> None:
    """grads=None, the states on NVMe and a host too small for every gradient: "auto" puts the
    gradients of the blocks whose states are on NVMe there too, and trains."""
    probe = model("auto")
    frugal = placement_plan(probe, config(tmp_path, optimizer_states="nvme"))
    grads = sum(t.nbytes for t in frugal.tensors if t.kind == "grads")
    least = least_budgets(probe, config(tmp_path, optimizer_states="auto"))
    assert least["host"] < frugal.need["host"] < least["host"] + grads  # the gradients' room is not needed
    cfg = config(tmp_path, least, optimizer_states="auto")
    plan = placement_plan(probe, cfg)
    assert "nvme" in set(plan.tiers.grads.values()), plan.tiers
    m = tz.wrap(model("auto"), cfg)
    try:
        assert tz.tier_bytes(m)["grads"]["nvme"] > 0
        step(m)
    finally:
        runtime.close(m)

"""The planning's placement (tierzero/planning/placement.py) and `tz.wrap` count the state with
one piece (tierzero/layout/state_bytes.py): the split "auto" chooses, and the bytes of every
kind on every tier, agree with the wrapped model's, frozen parameters included."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

import tierzero as tz
from tierzero.planning import flat_tensors, planned_tiers, resolve_placement
from tierzero.config import round_up
from tierzero.planning.placement import placement_plan
from tierzero.runtime import state_of
import builders

_KIND = {"master": "optimizer_states", "moments": "optimizer_states"}


def lora_like(layers: int = 5) -> torch.nn.Module:
    """A GPT whose attention weights are frozen (requires_grad=False), as under LoRA."""
    model = builders.gpt(layers=layers, seq=24, width=60)
    for name, p in model.named_parameters():
        if ".attn" in name or "attn." in name:
            p.requires_grad_(False)
    assert any(not p.requires_grad for p in model.parameters())
    return model


def planned_bytes(model: torch.nn.Module, cfg: tz.Config) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = {}
    for t in flat_tensors(model, cfg):
        kind = _KIND.get(t.kind, t.kind)
        per = out.setdefault(kind, dict.fromkeys(("device", "host", "nvme"), 0))
        per[t.home] += t.nbytes
    return out


def test_auto_with_frozen_parameters_plans_what_wrap_places(wrapped: Any, tmp_path: Path) -> None:
    """A host budget whose room for the states depends on the frozen bytes: the planning's
    "auto" takes them off the host as wrap does, so the tiers and bytes agree block by block."""
    probe = lora_like()
    cfg = tz.Config(device_budget="8MiB", host_budget="8MiB", nvme_dir=str(tmp_path), compute_dtype="float32",
                    grads=None, optimizer_states="auto")
    on_host = placement_plan(probe, cfg.replace(optimizer_states="host"))
    frozen = sum(round_up(t.nbytes) for t in on_host.tensors if t.kind == "frozen")
    assert frozen > 0
    states = sum(round_up(t.nbytes) for t in on_host.tensors if t.kind in ("master", "moments"))
    host = on_host.need["host"] - states // 2  # half the states do not fit beside the frozen base
    cfg = cfg.replace(device_budget=on_host.need["device"] + 4096, host_budget=host)  # no state on the device
    resolved = resolve_placement(probe, cfg)
    assert isinstance(resolved.optimizer_states, dict) and resolved.optimizer_states["nvme"] > 0, resolved
    assert resolved.optimizer_states["host"] > 0, resolved
    tiers = planned_tiers(probe, cfg)
    model = wrapped(lora_like(), cfg)
    tz.AdamW(model, lr=1e-3)
    ctx = state_of(model).ctx
    assert {b: ctx.tiers.optimizer_states[b] for b in tiers.optimizer_states} == dict(tiers.optimizer_states)
    placed = tz.tier_bytes(model)
    assert placed["frozen"]["host"] > 0
    assert planned_bytes(lora_like(), cfg) == placed


def test_a_split_plans_the_bytes_wrap_places(wrapped: Any, tmp_path: Path) -> None:
    cfg = tz.Config(device_budget="16MiB", host_budget="64MiB", nvme_dir=str(tmp_path), compute_dtype="float32",
                    params={"device": 0.3, "host": 0.7}, optimizer_states={"device": 0.2, "host": 0.5, "nvme": 0.3})
    model = wrapped(builders.gpt(layers=6, seq=24, width=52), cfg)
    tz.AdamW(model, lr=1e-3)
    assert planned_bytes(builders.gpt(layers=6, seq=24, width=52), cfg) == tz.tier_bytes(model)

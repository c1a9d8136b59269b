"""The device's working set of a step (tierzero/planning/working_set.py, [Note: measuring the
working set]) grows with batch x seq, and "auto" sets it aside: at a device budget that holds the
states only without the reserve, fewer of them go to the device with it, in the planning and at
wrap alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import tierzero as tz
from tierzero.planning import resolve_placement, working_set
from tierzero.config import round_up
from tierzero.planning.placement import placement_plan
import builders


def lm_loss(model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return model(x, y).loss


def gpt() -> torch.nn.Module:
    return builders.gpt(layers=4, seq=96, width=60)


def test_the_working_set_grows_with_batch_and_seq() -> None:
    cfg = tz.Config(compute_dtype="float32")
    sets = {(b, s): working_set(gpt(), cfg, lm_loss, batch=b, seq=s) for b, s in ((1, 24), (2, 24), (2, 48))}
    reserves = [ws.reserve for ws in sets.values()]
    assert reserves == sorted(reserves) and len(set(reserves)) == len(reserves), sets
    pair = sets[(2, 24)].activations / sets[(1, 24)].activations
    assert pair == pytest.approx(2, rel=0.01)  # the kept activations: linear in the batch (packs aligned)
    assert all(ws.peak > 0 for ws in sets.values())
    host = working_set(gpt(), cfg.replace(activations="host"), lm_loss, batch=2, seq=48)
    assert host.activations < sets[(2, 48)].activations  # off the device: the two fetched back only


def test_the_peak_holds_the_largest_temporaries_and_not_the_parameters() -> None:
    """A step's peak without the kept activations is at least the logits of the loss head
    (batch x seq x vocab fp32) and far less than the parameters plus their gradients."""
    ws = working_set(gpt(), tz.Config(compute_dtype="float32"), lm_loss, batch=2, seq=96)
    params = sum(p.numel() * 4 for p in gpt().parameters())
    assert 2 * 96 * 257 * 4 <= ws.peak < 2 * params + 2 * 96 * 257 * 4 * 4, (ws, params)


def test_auto_sets_the_reserve_aside(wrapped: Any, tmp_path: Path) -> None:
    cfg = tz.Config(device_budget="64MiB", host_budget="64MiB", compute_dtype="float32", grads=None,
                    optimizer_states="auto")
    plan = placement_plan(gpt(), cfg.replace(optimizer_states="device"))
    window = plan.window
    states = sum(round_up(t.nbytes) for t in plan.tensors if t.kind in ("master", "moments", "grads"))
    ws = working_set(gpt(), cfg, lm_loss, batch=1, seq=24)
    assert ws.reserve < states  # the reserve displaces some of the states
    cfg = cfg.replace(device_budget=window + states + 4096)
    assert resolve_placement(gpt(), cfg).optimizer_states == "device"  # they fit without the reserve
    reserved = cfg.replace(device_reserve=ws.reserve)
    split = resolve_placement(gpt(), reserved).optimizer_states
    assert isinstance(split, dict) and 0 < split["device"] < 1 and split["host"] > 0, split
    placed = {}
    for name, c in (("plain", cfg), ("reserved", reserved)):
        model = wrapped(gpt(), c)
        tz.AdamW(model, lr=1e-3)
        placed[name] = tz.tier_bytes(model)["optimizer_states"]["device"]
    assert placed["reserved"] < placed["plain"], placed


def test_a_reserve_as_large_as_the_device_is_refused() -> None:
    with pytest.raises(ValueError, match="device_reserve: expected less than device_budget"):
        tz.Config(device_budget="1MiB", device_reserve="1MiB")

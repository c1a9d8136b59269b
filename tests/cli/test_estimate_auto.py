"""`tierzero estimate` prints "auto"'s plan beside the given placement's least budgets: where the
parameters and optimizer states would live at the budgets (tierzero.layout.PlacementPlan), what
`tz.wrap` then places on each tier, and the least budgets "auto" trains from; int8 states make
all of these smaller."""

from __future__ import annotations

import json
from typing import Any

import tierzero as tz
from tierzero import runtime
from tierzero.cli import estimate
from tierzero.models import build

BUDGETS = dict(device_budget="10MiB", host_budget="1GiB")
FLAGS = ["--model", "tiny", "--device-budget", BUDGETS["device_budget"], "--host-budget", BUDGETS["host_budget"],
         "--compute-dtype", "float32"]


def run(capsys: Any, fmt: str) -> dict:
    assert estimate.main([*FLAGS, "--optimizer-state-dtype", fmt, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_auto_plan_is_what_wrap_places_and_int8_puts_more_on_the_device(capsys: Any) -> None:
    out = {fmt: run(capsys, fmt) for fmt in ("float32", "int8")}
    for fmt, result in out.items():
        auto = result["auto"]
        assert auto["fits"] and not auto["over_budget"]
        model = build("tiny")
        tz.wrap(model, tz.Config(params="auto", optimizer_states="auto", compute_dtype="float32",
                                 optimizer_state_dtype=fmt, **BUDGETS))
        tz.AdamW(model, lr=1e-3)
        try:
            placed = tz.tier_bytes(model)
        finally:
            runtime.close(model)
        assert placed == auto["tier_bytes"], fmt
        assert result["placement"]["params"] == "host"  # the given placement (the default) is not auto's
    f32, i8 = (out[f]["auto"] for f in ("float32", "int8"))
    states = [a["tier_bytes"]["optimizer_states"] for a in (f32, i8)]
    assert sum(states[1].values()) < sum(states[0].values())
    assert states[1]["device"] == sum(states[1].values())  # int8: all of them on the device
    assert 0 < states[0]["device"] < sum(states[0].values())  # fp32: some
    assert out["int8"]["least_budgets"]["host"] < out["float32"]["least_budgets"]["host"]
    assert i8["least_budgets"]["host"] < f32["least_budgets"]["host"]


def test_auto_plan_printed(capsys: Any) -> None:
    assert estimate.main([*FLAGS, "--optimizer-state-dtype", "int8", "--host-budget", "1MiB"]) == 0
    out = capsys.readouterr().out
    assert '"auto" (params and optimizer states auto) at these budgets: params ' in out
    assert "(does not fit: host over budget)" in out and '"auto" trains from budgets device ' in out
    assert "    optimizer states " in out

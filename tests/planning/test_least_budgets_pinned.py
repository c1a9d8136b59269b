"""The estimate's least host budget where the host tier is one pinned region (CUDA, the
asynchronous stand-in): the optimizer's construction check asks there for the room in which a
block's update always finds its windows, and the estimate asks the same."""

from __future__ import annotations

from typing import Any

import torch

import tierzero as tz
from tierzero.models import build
from tierzero.planning import least_budgets


def _config(tmp_path: Any, host: int | str, streams: str) -> tz.Config:
    return tz.Config(nvme_dir=str(tmp_path / "nvme"), nvme_budget="64MiB", device_budget="64MiB", host_budget=host,
                     compute_dtype="float32", params="nvme", grads="host", optimizer_states="nvme", streams=streams)


def test_the_least_host_budget_in_one_pinned_region_is_accepted_and_trains(tmp_path: Any) -> None:
    meta = build("tiny", device="meta")
    synchronous = least_budgets(meta, _config(tmp_path, "64MiB", "sync"))["host"]
    pinned = least_budgets(meta, _config(tmp_path, "64MiB", "async"))["host"]
    assert pinned > synchronous  # the windows cost room a pool of separate buffers does not need
    torch.manual_seed(0)
    model = tz.wrap(build("tiny"), _config(tmp_path, pinned, "async"))
    try:
        opt = tz.AdamW(model, lr=1e-3)  # the construction check accepts the estimate's number
        x = torch.randint(0, 256, (2, 32))
        for _ in range(2):
            model(x, targets=x).loss.backward()
            opt.step()
            opt.zero_grad()
    finally:
        tz.runtime.close(model)

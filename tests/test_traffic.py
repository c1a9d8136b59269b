"""NVMe traffic: counted per step by kind, and kept to what a step needs (issue: the step at the
disk's limit). Byte counts come from the swap files' own reads and writes."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch

import tierzero as tz
from tierzero import runtime
from tierzero.config import Config
from tierzero.handles import Kind
from tierzero.models import GPT, GPTConfig
from tierzero.placement import PlacementManager, Residency
from tierzero.tiers import Tier


def pm_for(tmp_path: Any) -> PlacementManager:
    cfg = Config(device_budget="64KiB", host_budget="64KiB", nvme_dir=str(tmp_path / "nvme"), nvme_budget="1MiB")
    return PlacementManager(cfg, wait_timeout_s=0.3)


def test_overwrite_acquire_reads_nothing_and_a_clean_release_drops_the_copy(tmp_path: Any) -> None:
    data = torch.arange(1024, dtype=torch.float32)
    with pm_for(tmp_path) as pm:
        h = pm.register("g", data, "nvme", kind=Kind.GRAD)
        pm.flush()
        pm.telemetry.reset_step()
        buf = pm.acquire(h, "host", overwrite=True)
        assert pm.telemetry.reset_step().nvme_read_bytes == 0
        buf.fill_(7.0)  # the caller fails before it is done: released clean
        pm.release(h, "host")
        assert pm.record(h).residency[Tier.HOST] is Residency.ABSENT  # the half-written copy is gone
        assert torch.equal(pm.read(h), data)
        buf = pm.acquire(h, "host", overwrite=True)
        buf.copy_(-data)
        pm.release(h, "host", dirty=True)
        pm.flush()
        stats = pm.telemetry.reset_step()
        assert stats.nvme_by_kind["grads"] == {"read": data.nbytes, "write": data.nbytes}  # pm.read's, and the write
        assert stats.nvme_read_bytes == data.nbytes and stats.nvme_write_bytes == data.nbytes
        assert torch.equal(pm.read(h), -data)
        assert 0 < stats.nvme_busy_s


def gpt() -> GPT:
    return GPT(GPTConfig(vocab_size=257, seq_len=32, n_layer=8, n_head=4, n_embd=64))


@pytest.mark.parametrize("step_in_backward,host", [(False, "2600KiB"), (False, "16MiB"), (True, "2600KiB")],
                         ids=["clip-spill", "clip-roomy", "step_in_backward"])
def test_step_traffic_by_kind(tmp_path: Any, step_in_backward: bool, host: str) -> None:
    """Everything on NVMe; a host budget of 2600 KiB (a little under the 3.05 MiB `tierzero
    estimate` asks) cannot keep every gradient until the step, 16 MiB keeps everything. Per step the moments are read at most and written exactly once, the
    parameters written once; a gradient is written to NVMe only when the host budget cannot
    keep it until the step (never with room, never with step_in_backward) and read back at
    most once (clipping reads none: its norms come from backward)."""
    torch.manual_seed(0)
    model = gpt()
    n_params = sum(p.numel() for p in model.parameters())
    cfg = tz.Config(device_budget="2MiB", host_budget=host, nvme_dir=str(tmp_path), params="nvme",
                    grads="nvme", optimizer_states="nvme", compute_dtype="float32",
                    step_in_backward=step_in_backward)
    tz.wrap(model, cfg)
    try:
        opt = tz.AdamW(model, lr=1e-3)
        g = torch.Generator().manual_seed(0)
        for step in range(3):
            x = torch.randint(0, 257, (2, 32), generator=g)
            model(x, x).loss.backward()
            if not step_in_backward:
                tz.clip_grad_norm_(model, 1.0)
            opt.step()
            opt.zero_grad()
            runtime.placement_manager(model).flush()
            stats = runtime.step_stats(model)
        pm = runtime.placement_manager(model)
        io = {kind: sum(pm.io_bytes(h) for h in pm.handles if h.kind is kind) for kind in Kind}
        assert io[Kind.PARAM] >= 4 * n_params  # fp32, padded to whole pages
        by_kind = stats.nvme_by_kind
        assert stats.nvme_read_bytes == sum(v["read"] for v in by_kind.values())
        assert stats.nvme_write_bytes == sum(v["write"] for v in by_kind.values())
        moments = io[Kind.EXP_AVG] + io[Kind.EXP_AVG_SQ]
        assert by_kind["moments"]["write"] == moments and by_kind["moments"]["read"] <= moments
        assert by_kind["params"]["write"] == io[Kind.PARAM]  # the updated parameters (= master weights), once
        assert by_kind["params"]["read"] <= 3 * io[Kind.PARAM]  # forward, backward, the step at most
        grads = by_kind["grads"]
        if step_in_backward or host == "16MiB":
            assert grads == {"read": 0, "write": 0}
        else:
            assert 0 < grads["write"] <= io[Kind.GRAD] and grads["read"] <= grads["write"]
    finally:
        runtime.close(model)

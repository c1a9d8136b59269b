"""Checkpoints across data-parallel ranks (gloo): a checkpoint written by 2 ranks resumes exactly
on 2 ranks, and loads on 3 ranks and on 1 (resharding) to continue the same training.

Each run trains the ZeRO-3 test model (tests/test_zero3.py: uneven sizes, tied weights, frozen
parameters, params and optimizer states on NVMe) on slices of the same global batches.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import tierzero as tz
from tierzero import runtime
from pairs import clipped_step
from dp_model import GLOBAL_BATCH, device_budget, global_batches, make_model
from gloo import run_ranks

SAVE_AT = 4


def run_rank(rank: int, world_size: int, out_dir: str, ckpt: str, load: bool) -> None:
    """Train from scratch and save at SAVE_AT (load=False), or load `ckpt` and continue from
    SAVE_AT (load=True); writes out_dir/rank{rank}.pt with the global losses after SAVE_AT."""
    model = make_model()
    cfg = tz.Config(device_budget=device_budget(model, world_size), host_budget="64MiB",
                    nvme_dir=os.path.join(out_dir, "nvme"), nvme_budget="64MiB", params="nvme",
                    optimizer_states="nvme", compute_dtype="float32")
    tz.wrap(model, cfg)
    opt = tz.AdamW(model, lr=3e-3, weight_decay=0.1)
    rows = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
    batches = global_batches()
    if load:
        extra = tz.load_checkpoint(ckpt, model, opt)
        assert extra == {"step": SAVE_AT}, extra
    losses = []
    for step, (x, y) in enumerate(batches):
        if load and step < SAVE_AT:
            continue
        losses.append(clipped_step(model, opt, model(x[rows], y[rows]).loss, 0.5, world_size)[0])
        if not load and step + 1 == SAVE_AT:
            tz.save_checkpoint(ckpt, model, opt, extra={"step": SAVE_AT})
            losses = []
    full = tz.full_state_dict(model)
    torch.save({"losses": losses, "state": full}, os.path.join(out_dir, f"rank{rank}.pt"))
    runtime.close(model)


def run(tmp_path: Path, name: str, world_size: int, ckpt: Path, load: bool) -> dict:
    out = tmp_path / name
    out.mkdir()
    run_ranks(run_rank, world_size, tmp_path / f"init-{name}", str(out), str(ckpt), load)
    return torch.load(out / "rank0.pt")


@pytest.fixture(scope="module")
def saved_by_two(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict]:
    tmp = tmp_path_factory.mktemp("ckpt-ranks")
    ckpt = tmp / "ckpt"
    first = run(tmp, "save", 2, ckpt, load=False)
    files = sorted(p.name for p in next(ckpt.glob("ckpt-*")).iterdir())
    assert files == ["manifest.json", "rank00000.bin", "rank00000.pt", "rank00001.bin", "rank00001.pt"], files
    return ckpt, first


def test_two_ranks_resume_exactly(tmp_path: Path, saved_by_two: tuple[Path, dict]) -> None:
    ckpt, first = saved_by_two
    resumed = run(tmp_path, "resume2", 2, ckpt, load=True)
    assert len(first["losses"]) == len(global_batches()) - SAVE_AT
    assert resumed["losses"] == first["losses"]
    for key, value in first["state"].items():
        assert torch.equal(resumed["state"][key], value), key


@pytest.mark.parametrize("world_size", [3, 1])
def test_reshard_on_load(tmp_path: Path, saved_by_two: tuple[Path, dict], world_size: int) -> None:
    """The same training continues on another number of ranks (summation order differs, hence
    a tolerance instead of equality)."""
    ckpt, first = saved_by_two
    resumed = run(tmp_path, f"resume{world_size}", world_size, ckpt, load=True)
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(first["losses"]), rtol=1e-5, atol=0)
    for key, value in first["state"].items():
        rel = ((resumed["state"][key] - value).norm() / value.norm().clamp_min(1e-12)).item()  # frozen zero biases: 0
        assert rel < 1e-5, f"{key}: relative error {rel:.2e} after resharding 2 -> {world_size} ranks"

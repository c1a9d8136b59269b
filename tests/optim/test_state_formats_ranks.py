"""Optimizer states in int8 across data-parallel ranks (gloo): the same bits at 2 ranks whether
the states live on NVMe or on the host, a 2-rank checkpoint resumes exactly, and the loss follows
the one-process run on the same global batch (split over the ranks). 1 and 2 ranks bit for bit,
and int8 checkpoints at another world size: tests/optim/test_state_formats_world.py."""

from __future__ import annotations

import os
from pathlib import Path

import torch

import tierzero as tz
from tierzero import runtime
from pairs import clipped_step
from dp_model import GLOBAL_BATCH, device_budget, global_batches, make_model
from gloo import run_ranks

SAVE_AT = 2


def run_rank(rank: int, world_size: int, out_dir: str, places: list[str], ckpt: str, load: bool) -> None:
    for where in places:  # one spawn of the ranks runs them in turn
        train_rank(rank, world_size, out_dir, where, ckpt, load)


def train_rank(rank: int, world_size: int, out_dir: str, where: str, ckpt: str, load: bool) -> None:
    model = make_model()
    tier = dict(params="nvme", optimizer_states="nvme") if where == "nvme" else \
        dict(params="host", optimizer_states={"host": 0.5, "device": 0.5}, grads=None)
    cfg = tz.Config(device_budget=device_budget(model, world_size) + (8 << 20), host_budget="64MiB",
                    nvme_dir=os.path.join(out_dir, "nvme"), nvme_budget="64MiB", compute_dtype="float32",
                    optimizer_state_dtype="int8", **tier)
    tz.wrap(model, cfg)
    opt = tz.AdamW(model, lr=3e-3, weight_decay=0.1)
    rows = slice(rank * GLOBAL_BATCH // world_size, (rank + 1) * GLOBAL_BATCH // world_size)
    if load:
        tz.load_checkpoint(ckpt, model, opt)
    losses = []
    for step, (x, y) in enumerate(global_batches()[:4]):
        if load and step < SAVE_AT:
            continue
        losses.append(clipped_step(model, opt, model(x[rows], y[rows]).loss, 0.5, world_size)[0])
        if not load and step + 1 == SAVE_AT and ckpt and where == "nvme":
            tz.save_checkpoint(ckpt, model, opt)
    runtime.settle(model)
    states = {f"{k}/{kind}": v for k, e in opt.state_dict()["state"].items() for kind, v in e.items() if kind != "step"}
    torch.save({"losses": losses, "states": states}, os.path.join(out_dir, f"{where}-rank{rank}.pt"))
    runtime.close(model)


def run(tmp_path: Path, name: str, world_size: int, places: list[str], ckpt: str,
        load: bool = False) -> dict[str, list[dict]]:
    out = tmp_path / name
    out.mkdir()
    run_ranks(run_rank, world_size, tmp_path / f"init-{name}", str(out), places, ckpt, load)
    return {w: [torch.load(out / f"{w}-rank{r}.pt") for r in range(world_size)] for w in places}


def test_int8_across_ranks(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ckpt")
    runs = run(tmp_path, "two", 2, ["nvme", "split"], ckpt)
    nvme = runs["nvme"]
    for name, other in (("split", runs["split"]), ("resumed", run(tmp_path, "resumed", 2, ["nvme"], ckpt, load=True)["nvme"])):
        for r in range(2):
            assert sorted(other[r]["states"]) == sorted(nvme[r]["states"])
            for key, value in nvme[r]["states"].items():
                assert torch.equal(other[r]["states"][key], value), (name, r, key)
        assert other[0]["losses"] == nvme[0]["losses"][-len(other[0]["losses"]):], name
    one = run(tmp_path, "one", 1, ["nvme"], "")["nvme"]
    torch.testing.assert_close(torch.tensor(nvme[0]["losses"]), torch.tensor(one[0]["losses"]), rtol=1e-3, atol=0)

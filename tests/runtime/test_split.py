"""Split placement: each kind of state split across device, host and NVMe block by block
(tierzero/runtime/split.py, [Note: split placement]) trains bit for bit as the same model all
on "host", at 1 and 2 ranks (gloo); the bytes per tier follow the fractions within one block;
checkpoints resume across a change of split; a split that cannot fit is refused at wrap; "auto"
fills the device, then the host.

The whole file runs under the asynchronous stand-in too (the Makefile's ASYNC_TESTS)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import tierzero as tz
from tierzero import runtime
from tierzero.layout import split_blocks
import builders
from gloo import run_ranks
from pairs import clipped_step

STEPS = 4
SEQ = 24
BATCH = 3

SPLITS = {
    "states on three tiers": dict(optimizer_states={"device": 0.25, "host": 0.5, "nvme": 0.25}),
    "every kind split, grads apart": dict(params={"device": 0.3, "host": 0.4, "nvme": 0.3},
                                          grads={"host": 0.5, "nvme": 0.5},
                                          optimizer_states={"device": 0.4, "host": 0.3, "nvme": 0.3}),
    "grads on the device, states off it": dict(grads={"device": 0.5, "host": 0.5},
                                               optimizer_states={"host": 0.5, "nvme": 0.5}),
}
ALL_HOST = dict(params="host", grads="host", optimizer_states="host")


def config(nvme_dir: Path, **kw: Any) -> tz.Config:
    base = dict(device_budget="64MiB", host_budget="64MiB", nvme_dir=str(nvme_dir), nvme_budget="256MiB",
                compute_dtype="float32", params="host", grads=None, optimizer_states="host")
    base.update(kw)
    return tz.Config(**base)


def batches(n: int, vocab: int = 257) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, vocab, (BATCH, SEQ + 1), generator=g) for _ in range(n)]


def lm_loss(model: Any, batch: torch.Tensor) -> torch.Tensor:
    return model(batch[:, :-1], batch[:, 1:]).loss


def train(model: Any, opt: Any, data: list[torch.Tensor], rank: int, world_size: int) -> list[float]:
    """Each rank its slice of every batch; the losses averaged over the ranks."""
    losses = []
    for batch in data:
        part = batch.chunk(world_size)[rank] if world_size > 1 else batch
        losses.append(clipped_step(model, opt, lm_loss(model, part), 1.0, world_size)[0])
    return losses


def _run(rank: int, world_size: int, runs: dict[str, dict[str, Any]], nvme: str, out: str) -> None:
    """Every configuration of `runs` trained in turn in one world (one spawn: the ranks' start is
    most of the time)."""
    results = {}
    for name, kw in runs.items():
        (Path(nvme) / name).mkdir(exist_ok=True)
        model = tz.wrap(builders.gpt(layers=5, seq=SEQ), config(Path(nvme) / name, **kw))
        opt = tz.AdamW(model, lr=3e-3, weight_decay=0.1)
        losses = train(model, opt, batches(STEPS), rank, world_size)
        results[name] = {"losses": losses, "state": tz.full_state_dict(model),
                         "masters": builders.master_weights(model), "placed": tz.tier_bytes(model)}
        runtime.close(model)
    if rank == 0:
        torch.save(results, out)


@pytest.mark.parametrize("world_size", [1, 2])
def test_splits_train_bit_for_bit_as_all_host(world_size: int, tmp_path: Path) -> None:
    """Losses, parameters and master weights the same bits as all on "host" (fp32 on a CPU, where
    the device tier's fused kernel is the CPU's), at 1 and 2 ranks; each kind on the tiers asked."""
    runs = {"host": ALL_HOST, **SPLITS}
    run_ranks(_run, world_size, tmp_path / "init", runs, str(tmp_path), str(tmp_path / "out.pt"))
    results = torch.load(tmp_path / "out.pt")
    host = results["host"]
    for split, kw in SPLITS.items():
        got = results[split]
        assert got["losses"] == host["losses"], (split, got["losses"], host["losses"])
        builders.assert_state_equal(got["state"], host["state"], f"{split}, parameters")
        builders.assert_state_equal(got["masters"], host["masters"], f"{split}, master weights")
        for kind, fractions in kw.items():
            on = {t for t, n in got["placed"][kind].items() if n}
            assert on == {t for t, f in fractions.items() if f}, (split, kind, got["placed"][kind])


def test_bytes_per_tier_within_one_block_of_the_fractions(wrapped: Any, tmp_path: Path) -> None:
    fractions = {"params": {"device": 0.2, "host": 0.45, "nvme": 0.35},
                 "grads": {"device": 0.5, "host": 0.5, "nvme": 0.0},
                 "optimizer_states": {"device": 0.1, "host": 0.3, "nvme": 0.6}}
    model = wrapped(builders.gpt(layers=9, seq=SEQ, width=36), config(tmp_path, **fractions))
    tz.AdamW(model, lr=1e-3)  # registers the moments
    placed = tz.tier_bytes(model)
    state = runtime.state_of(model)
    for kind, split in fractions.items():
        total = sum(placed[kind].values())
        per_block = {"params": lambda f: f.param.nbytes, "grads": lambda f: f.grad.handle.nbytes,
                     "optimizer_states": lambda f: 3 * f.param.nbytes}[kind]
        largest = max(per_block(f) for f in state.flat_params(trainable=True))
        for tier, f in split.items():
            assert abs(placed[kind][tier] - f * total) <= largest, (kind, tier, placed[kind], f, largest)
    assert placed["params"]["device"] and placed["optimizer_states"]["nvme"]


def test_split_blocks_rule() -> None:
    """The midpoint rule: the fastest tier first, each tier within one block of its share, an
    empty share gets nothing, uneven blocks included."""
    sizes = [7, 30, 30, 30, 30, 11, 30]
    tiers = split_blocks(sizes, {"device": 0.25, "host": 0.0, "nvme": 0.75})
    assert tiers == ["device", "device", "nvme", "nvme", "nvme", "nvme", "nvme"]  # 37 of 42 bytes: one block short
    assert split_blocks(sizes, {"host": 1.0}) == ["host"] * len(sizes)
    for fractions in ({"device": 0.1, "host": 0.6, "nvme": 0.3}, {"device": 0.5, "host": 0.5}):
        tiers = split_blocks(sizes, fractions)
        for tier, f in fractions.items():
            assert abs(sum(s for s, t in zip(sizes, tiers) if t == tier) - f * sum(sizes)) <= max(sizes)


def _save(rank: int, world_size: int, kw: dict[str, Any], nvme: str, ckpt: str, out: str) -> None:
    data = batches(2 * STEPS)
    model = tz.wrap(builders.gpt(layers=5, seq=SEQ), config(Path(nvme), **kw))
    opt = tz.AdamW(model, lr=3e-3, weight_decay=0.1)
    train(model, opt, data[:STEPS], rank, world_size)
    tz.save_checkpoint(ckpt, model, opt)
    losses = train(model, opt, data[STEPS:], rank, world_size)
    runtime.close(model)
    if rank == 0:
        torch.save(losses, out)


def _resume(rank: int, world_size: int, kw: dict[str, Any], nvme: str, ckpt: str, out: str) -> None:
    data = batches(2 * STEPS)
    model = tz.wrap(builders.gpt(layers=5, seq=SEQ, seed=1), config(Path(nvme), **kw))
    opt = tz.AdamW(model, lr=3e-3, weight_decay=0.1)
    tz.load_checkpoint(ckpt, model, opt)
    losses = train(model, opt, data[STEPS:], rank, world_size)
    runtime.close(model)
    if rank == 0:
        torch.save(losses, out)


def test_resume_across_a_change_of_split(tmp_path: Path) -> None:
    """Saved under one split; resumed under another and under all-host: the same next losses."""
    ckpt = tmp_path / "ckpt"
    first = dict(params={"device": 0.5, "nvme": 0.5}, optimizer_states={"device": 0.3, "host": 0.3, "nvme": 0.4})
    later = dict(params={"host": 0.6, "nvme": 0.4}, optimizer_states={"nvme": 0.5, "device": 0.5})
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
    run_ranks(_save, 1, tmp_path / "init", first, str(tmp_path / "a"), str(ckpt), str(tmp_path / "a.pt"))
    expected = torch.load(tmp_path / "a.pt")
    for name, kw in (("b", later), ("c", ALL_HOST)):
        run_ranks(_resume, 1, tmp_path / "init", kw, str(tmp_path / name), str(ckpt), str(tmp_path / f"{name}.pt"))
        assert torch.load(tmp_path / f"{name}.pt") == expected, name


def test_split_that_cannot_fit_is_refused_at_wrap_with_bytes(tmp_path: Path) -> None:
    cfg = config(tmp_path, device_budget="1MiB", optimizer_states={"device": 0.9, "host": 0.1})
    with pytest.raises(ValueError, match=r"cannot fit: device: .* bytes\) needed, budget .*Over budget: device"):
        tz.wrap(builders.gpt(layers=5, seq=SEQ, width=96), cfg)


def test_auto_uses_the_device_then_the_host(wrapped: Any, tmp_path: Path) -> None:
    """A device budget with room for about half the optimizer states beside the fetched blocks:
    "auto" puts the first blocks' states there and the rest on the host (none on NVMe)."""
    probe = wrapped(builders.gpt(layers=6, seq=SEQ), config(tmp_path / "probe"))
    tz.AdamW(probe, lr=1e-3)
    states = sum(tz.tier_bytes(probe)["optimizer_states"].values())
    window = 3 * max(f.param.nbytes for f in runtime.state_of(probe).flat_params())
    (tmp_path / "auto").mkdir()
    model = wrapped(builders.gpt(layers=6, seq=SEQ),
                    config(tmp_path / "auto", optimizer_states="auto", device_budget=window + states // 2 + 4096))
    tz.AdamW(model, lr=1e-3)
    placed = tz.tier_bytes(model)["optimizer_states"]
    assert placed["device"] > 0 and placed["host"] > 0 and placed["nvme"] == 0, placed
    block = max(f.param.nbytes for f in runtime.state_of(model).flat_params())
    assert placed["device"] <= states // 2 + 4096 + 3 * block


def test_auto_fits_what_wrap_checks_at_every_device_budget() -> None:
    """"auto" sizes each block's flat tensors as wrap's check counts them (each rounded up to a
    page): at device budgets where the device is filled to within a few pages, wrap accepted to
    the byte what auto chose (bf16 parameters: tensors of uneven pages)."""
    from tierzero.models import build
    refused, on_device = [], set()
    for budget in range(1_570_000, 1_600_000, 997):
        cfg = tz.Config(optimizer_states="auto", grads=None, device_budget=budget, host_budget="256MiB",
                        compute_dtype="bfloat16")
        try:
            model = tz.wrap(build("tiny"), cfg)
        except ValueError as e:
            refused.append((budget, str(e)[:200]))
            continue
        on_device.add(tz.tier_bytes(model)["optimizer_states"]["device"])
        runtime.close(model)
    assert refused == []
    assert len(on_device) > 1  # the sweep crosses budgets where one more block's states fit


def test_the_reserved_working_set_is_no_tiers(tmp_path: Path) -> None:
    """Config.device_reserve is set aside from the device tier itself: fetched, cached and
    updated tensors stay within device_budget - device_reserve, and a budget whose rest cannot
    hold the fetched blocks is refused at wrap naming the reserve."""
    from tierzero.models import build
    cfg = tz.Config(device_budget="8MiB", device_reserve="5MiB", host_budget="64MiB")
    model = tz.wrap(build("tiny"), cfg)
    pm = runtime.placement_manager(model)
    assert pm.budget("device") == 3 << 20
    opt = tz.AdamW(model, lr=1e-3)
    x = torch.randint(0, 256, (2, 32))
    model(x, targets=x).loss.backward()
    opt.step()
    assert pm.budgets[tz.Tier.DEVICE].peak <= 3 << 20
    runtime.close(model)
    with pytest.raises(ValueError, match="working set"):
        tz.wrap(build("tiny"), cfg.replace(device_reserve="7900KiB"))

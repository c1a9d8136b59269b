"""`tierzero estimate --batch B --seq S`: activation bytes measured on fake tensors equal what the
runtime places for the same step (but for alignment padding), extrapolate to other lengths, and
the command prints them with the largest batch and sequence each placement fits."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

import tierzero as tz
from tierzero import runtime
from tierzero.cli import main
from tierzero.cli.harness import batch_loss
from tierzero.planning import activation_model, measure_activations
import builders

BATCH, SEQ = 2, 32


def placed(tmp_path: Path, name: str, **kw: Any) -> dict[str, int]:
    """Activation bytes by tier of one step of the test GPT."""
    model = tz.wrap(builders.gpt(seq=2 * SEQ, layers=3), builders.tier_config(tmp_path / name, tier="nvme", **kw))
    try:
        x = torch.randint(0, 257, (BATCH, SEQ))
        batch_loss(model, x, x).backward()
        return runtime.step_stats(model).activation_bytes
    finally:
        runtime.close(model)


def test_measured_on_fake_tensors_as_the_runtime_places_them(tmp_path: Path) -> None:
    model = builders.gpt(seq=2 * SEQ, layers=3)
    acts = measure_activations(model, tz.Config(compute_dtype="float32"), batch_loss, batch=BATCH, seq=SEQ)
    assert [b for b, _ in acts.per_call] == ["blocks.0", "blocks.1", "blocks.2"] and acts.outside > 0
    slack = 64 * 40  # alignment padding: under 64 bytes for each of a pack's segments
    on_device = placed(tmp_path, "device")
    assert abs(on_device["device"] - (acts.blocks + acts.outside)) <= slack, (on_device, acts)
    ckpt = placed(tmp_path, "ckpt", activations="nvme", activation_checkpointing=True)
    assert abs(sum(ckpt.values()) - (acts.kept(True) + acts.outside)) <= slack, (ckpt, acts)
    assert acts.kept(True) < acts.blocks / 4


def test_micro_batches_keep_k_steps_of_activations(tmp_path: Path) -> None:
    """tz.accumulate over k micro-batches keeps each one's activations until the backward: the
    estimate counts k of them, and the runtime places that."""
    k = 3
    model = builders.gpt(seq=2 * SEQ, layers=3)
    acts = measure_activations(model, tz.Config(compute_dtype="float32"), batch_loss, batch=BATCH, seq=SEQ)
    one, need = acts.need("nvme", False), acts.need("nvme", False, micro_batches=k)
    assert need["nvme"] == k * one["nvme"] and need["host"] == one["host"]
    assert need["device"] == one["device"] + (k - 1) * (acts.outside + max(n for _, n in acts.inputs))
    model = tz.wrap(model, builders.tier_config(tmp_path / "nvme", tier="nvme", activations="nvme"))
    try:
        mbs = [(x, x) for x in torch.randint(0, 257, (k, BATCH, SEQ))]
        tz.accumulate(model, mbs, lambda out, mb: out.loss)
        got = runtime.step_stats(model).activation_bytes
    finally:
        runtime.close(model)
    slack = k * 64 * 40  # alignment padding: under 64 bytes for each of a pack's segments
    assert abs(got["nvme"] - k * acts.blocks) <= slack, (got, acts)


def test_fitted_to_two_lengths_it_predicts_a_third(tmp_path: Path) -> None:
    model = builders.gpt(seq=8 * SEQ, layers=2)
    cfg = tz.Config(compute_dtype="float32")
    fitted = activation_model(model, cfg, batch_loss, batch=BATCH, seq=SEQ)
    for batch, seq in ((BATCH, 3 * SEQ), (3 * BATCH, SEQ)):
        want = measure_activations(model, cfg, batch_loss, batch=batch, seq=seq)
        got = fitted.scaled(batch, seq)
        assert abs(got.blocks - want.blocks) <= 0.01 * want.blocks and abs(got.outside - want.outside) <= 0.01 * want.outside


def test_the_command_prints_activations_and_what_each_placement_fits(tmp_path: Path, capsys: Any) -> None:
    args = ["estimate", "--model", "tiny", "--batch", str(BATCH), "--seq", str(SEQ), "--device-budget", "64MiB",
            "--host-budget", "256MiB"]
    assert main([*args, "--nvme-dir", str(tmp_path), "--json"]) == 0
    acts = json.loads(capsys.readouterr().out)["activations"]
    assert len(acts["per_block"]) == 4 and all(b["bytes"] > 0 for b in acts["per_block"])
    fits = acts["fits"]
    for placement in ("device", "host", "nvme", "auto"):
        assert fits[f"{placement} checkpointed"]["max_batch"] >= fits[placement]["max_batch"] >= 1
    # the device budget holds the activations of "device" only: the others fit larger batches
    assert fits["nvme"]["max_batch"] > fits["device"]["max_batch"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "blocks.3" in text and "activations=nvme checkpointed" in text

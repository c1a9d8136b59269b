"""The estimate on an fp32 mixture-of-experts model: transformers' fused experts multiply through
aten._grouped_mm, whose fake kernel takes only bf16 ([Note: fake kernels narrower than the real
ones]); the activations are still measured, and equal what the runtime places for the same step."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import tierzero as tz
from tierzero import runtime
from tierzero.cli import main
from tierzero.cli.harness import batch_loss
from tierzero.planning import measure_activations
import builders

BATCH, SEQ, VOCAB = 2, 16, 131


def qwen3_moe() -> Any:
    """A tiny random Qwen3-MoE (uneven widths, 3 experts, 2 per token), fp32."""
    transformers = pytest.importorskip("transformers")
    config = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=24, intermediate_size=40, moe_intermediate_size=28,
                                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=6,
                                         num_experts=3, num_experts_per_tok=2, max_position_embeddings=64,
                                         decoder_sparse_step=1, tie_word_embeddings=False)
    torch.manual_seed(0)
    return transformers.Qwen3MoeForCausalLM(config)


def test_an_fp32_moe_is_measured_as_the_runtime_places_it(tmp_path: Path) -> None:
    model = qwen3_moe()
    assert any(p.dim() == 3 for p in model.parameters())  # fused experts: the grouped_mm path
    acts = measure_activations(model, tz.Config(compute_dtype="float32"), batch_loss, batch=BATCH, seq=SEQ)
    assert [b for b, _ in acts.per_call] == ["model.layers.0", "model.layers.1"] and acts.blocks > 0
    wrapped = tz.wrap(model, builders.tier_config(tmp_path / "nvme", tier="host"))
    try:
        x = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
        batch_loss(wrapped, x, x).backward()
        placed = runtime.step_stats(wrapped).activation_bytes
    finally:
        runtime.close(wrapped)
    # the fake run builds a causal mask per block that the real one skips (its data-dependent
    # check is unknown on fake tensors); and alignment padding, under 64 bytes a segment
    mask = BATCH * SEQ * SEQ * 4
    measured = acts.blocks + acts.outside
    assert 0 <= measured - placed["device"] <= 2 * mask + 64 * 80, (placed, acts)


def test_the_command_estimates_an_fp32_moe_folder(tmp_path: Path, capsys: Any) -> None:
    qwen3_moe().save_pretrained(tmp_path / "moe")
    assert main(["estimate", "--model", str(tmp_path / "moe"), "--batch", "4", "--seq", "32", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [b["block"] for b in out["activations"]["per_block"]] == ["model.layers.0", "model.layers.1"]
    assert out["device_working_set"]["peak"] > 0

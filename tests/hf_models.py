"""Tiny transformers models for the tests, uneven on purpose (Llama tied and untied with
vocabulary 211, GPT-2 with vocabulary 157), and a folder of several safetensors shards with an
index: what tests of weights, copy-on-write homes and from_pretrained load."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
from torch import nn

import tierzero as tz
from builders import llama_config, tier_config


def hf() -> Any:
    """transformers, or the test is skipped (an optional extra)."""
    return pytest.importorskip("transformers")


def llama(tied: bool = True, layers: int = 3) -> Any:
    hf()
    return llama_config(tied=tied, layers=layers)


def gpt2() -> Any:
    transformers = hf()
    return transformers.GPT2Config(vocab_size=157, n_embd=40, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                         embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)


MODELS: dict[str, Callable[[], tuple[str, Any]]] = {
    "llama-tied": lambda: ("LlamaForCausalLM", llama(True)),
    "llama-untied": lambda: ("LlamaForCausalLM", llama(False)),
    "gpt2": lambda: ("GPT2LMHeadModel", gpt2()),
}


def build(cls_name: str, config: Any, *, meta: bool = False, seed: int = 0) -> nn.Module:
    cls = getattr(hf(), cls_name)
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return cls(config)
    return cls(config)


def save(model: nn.Module, folder: Path) -> Path:
    model.save_pretrained(folder, max_shard_size="20KB")
    assert (folder / "model.safetensors.index.json").is_file() and len(list(folder.glob("*.safetensors"))) > 2
    return folder


def weights_config(tmp_path: Path, **kw: Any) -> tz.Config:
    """Parameters and optimizer states on NVMe under tmp_path/nvme, an 8 MiB device budget."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    return tier_config(tmp_path / "nvme", tier="host", device_budget="8MiB", params="nvme", optimizer_states="nvme",
                       **kw)


def swap_files(tmp_path: Path) -> list[str]:
    """The files under the swap folder of weights_config(tmp_path)."""
    return [os.path.join(d, f) for d, _, fs in os.walk(tmp_path / "nvme") for f in fs]


def token_batches(vocab: int, n: int = 10, seq: int = 12, rows: int = 2) -> list[torch.Tensor]:
    """`n` batches of `rows` x `seq` token ids below `vocab`, the same every call."""
    g = torch.Generator().manual_seed(3)
    return [torch.randint(0, vocab, (rows, seq), generator=g) for _ in range(n)]


def moe(kind: str) -> tuple[str, Any]:
    """A tiny mixture-of-experts causal LM (class name, config): "mixtral" (per-expert w1/w2/w3,
    `block_sparse_moe` in its checkpoints) or "qwen2_moe" (per-expert gate/up/down projections and
    a shared expert); uneven widths, 3 experts. transformers fuses the experts on load."""
    transformers = hf()
    common = dict(vocab_size=131, hidden_size=24, intermediate_size=40, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64, num_experts_per_tok=2, tie_word_embeddings=False)
    if kind == "mixtral":
        return "MixtralForCausalLM", transformers.MixtralConfig(num_local_experts=3, **common)
    return "Qwen2MoeForCausalLM", transformers.Qwen2MoeConfig(num_experts=3, moe_intermediate_size=28,
                                                              shared_expert_intermediate_size=36,
                                                              decoder_sparse_step=1, **common)


def t5(tie: bool = True) -> Any:
    """A tiny T5 (encoder-decoder, relative position biases, the embedding shared by encoder,
    decoder and, tied, the LM head); uneven vocabulary, no dropout."""
    return hf().T5Config(vocab_size=97, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_decoder_layers=2, num_heads=4,
                         dropout_rate=0.0, tie_word_embeddings=tie, decoder_start_token_id=0, pad_token_id=0)

"""What the tests build again and again, in one place: the repository's root, the built-in GPT
at a test's uneven shapes, a tiny transformers Llama, a tiered config.

Plain functions (not fixtures) so that ranks spawned by tests/gloo.py can call them too; the
fixtures of conftest.py are built on them.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path
from typing import Any, Iterator

import torch

import tierzero as tz
from tierzero import runtime
from tierzero.models import GPT, GPTConfig

REPO = Path(__file__).resolve().parents[1]
"""The checkout's root (PYTHONPATH for subprocesses that import tierzero from it)."""


def gpt(*, vocab: int = 257, seq: int = 24, layers: int = 4, heads: int = 4, width: int = 60,
        seed: int | None = 0, **kw: Any) -> GPT:
    """The built-in GPT, uneven on purpose by default (vocabulary 257, width 60), from
    `torch.manual_seed(seed)` (None: the generator as it is); `kw` go to GPTConfig."""
    if seed is not None:
        torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=vocab, seq_len=seq, n_layer=layers, n_head=heads, n_embd=width, **kw))


def llama_config(*, vocab: int = 211, hidden: int = 48, intermediate: int = 84, layers: int = 3, heads: int = 4,
                 kv_heads: int = 2, tied: bool = True, **kw: Any) -> Any:
    """A tiny transformers LlamaConfig with uneven sizes (vocabulary 211)."""
    import transformers  # optional dependency: the tests that need it import this first

    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
                                    num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                                    max_position_embeddings=64, tie_word_embeddings=tied, **kw)


def llama(*, seed: int = 0, **kw: Any) -> Any:
    """A tiny transformers LlamaForCausalLM (llama_config's shapes and `kw`), from `seed`."""
    import transformers

    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(llama_config(**kw))


def saved_llama(tmp_path_factory: Any, *, dtype: torch.dtype = torch.float32, seed: int = 0, **kw: Any) -> Path:
    """A pretrained-style folder of `llama(seed=seed, tied=False, **kw)` saved in `dtype` (most
    checkpoints are bfloat16 on disk), for module-scoped `folder` fixtures."""
    out = tmp_path_factory.mktemp("llama") / "model"
    llama(seed=seed, tied=False, **kw).to(dtype).save_pretrained(out)
    return out


def tier_config(nvme_dir: Path | str | None = None, *, tier: str = "nvme", **kw: Any) -> tz.Config:
    """A Config with every kind of state on `tier` (swap files under the folder `nvme_dir`, whose
    parent must exist), fp32 compute and budgets roomy enough for the test models; `kw` override
    any field."""
    base: dict[str, Any] = dict(device_budget="64MiB", host_budget="64MiB", compute_dtype="float32",
                                params=tier, grads=tier, optimizer_states=tier)
    if nvme_dir is not None:
        base.update(nvme_dir=str(nvme_dir), nvme_budget="256MiB")
    base.update(kw)
    return tz.Config(**base)


def assert_state_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str = "") -> None:
    """The same keys and, for every key, the same bits (dtype and shape included)."""
    assert sorted(actual) == sorted(expected), f"{what}: keys differ: {sorted(set(actual) ^ set(expected))}"
    for key, value in expected.items():
        got = actual[key]
        assert got.dtype == value.dtype and got.shape == value.shape, (what, key, got.dtype, value.dtype)
        assert torch.equal(got, value), f"{what}: {key} differs by {(got.double() - value.double()).abs().max():.3e}"


def master_weights(model: Any) -> dict[str, torch.Tensor]:
    """A wrapped model's fp32 master weights by block, read through its placement manager
    (after the last step's updates and writes)."""
    runtime.settle(model)
    state = runtime.state_of(model)
    return {f.name: state.pm.read(f.ensure_master()) for f in state.flat_params(trainable=True)}


@contextlib.contextmanager
def tmpfs(where: Path, options: str) -> Iterator[Path]:
    """A tmpfs mounted at `where` with `options` ("ro,size=1m", "size=96k"): a real read-only or
    small file system for fault injection; skips the test where mounting is not allowed."""
    import pytest

    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (fault injection on a real read-only / full file system)")
    where.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"mount -t tmpfs is not permitted here: {proc.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)

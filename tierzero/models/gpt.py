"""A small GPT (nanoGPT's shape): token + position embedding, N pre-norm transformer blocks
(LayerNorm, causal self-attention, MLP), a final LayerNorm and an LM head tied to the token
embedding by default.

Every module with parameters is a torch Linear, LayerNorm or Embedding; Linear and Embedding
are subclassed only so that `reset_parameters()` gives GPT-2's initialisation, so a model
built on the meta device and materialised by tierzero.wrap starts where an eager one does.
"""

from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a GPT."""

    vocab_size: int = 256
    """Tokens in the vocabulary (256 = bytes, what tierzero's default corpus uses)."""
    seq_len: int = 256
    """Longest sequence (rows of the position embedding)."""
    n_layer: int = 4
    """Transformer blocks."""
    n_head: int = 4
    """Attention heads; must divide n_embd."""
    n_embd: int = 128
    """Model width."""
    bias: bool = True
    """Biases in Linear and LayerNorm layers."""
    tie_weights: bool = True
    """The LM head reuses the token embedding's weight."""
    checkpoint: bool = False
    """Recompute each block's activations in backward (torch.utils.checkpoint, non-reentrant)."""

    def __post_init__(self) -> None:
        for name in ("vocab_size", "seq_len", "n_layer", "n_head", "n_embd"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"GPTConfig.{name}: expected an int >= 1, got {v!r}")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig: n_head={self.n_head} must divide n_embd={self.n_embd}")

    def replace(self, **changes: object) -> "GPTConfig":
        return dataclasses.replace(self, **changes)


CONFIGS: dict[str, GPTConfig] = {
    # Byte vocabulary for the small one (tests, CLI demo); the named sizes use GPT-2's padded
    # vocabulary so their parameter counts match their names (GPT-2 / GPT-3 paper shapes).
    "tiny": GPTConfig(vocab_size=256, seq_len=256, n_layer=4, n_head=4, n_embd=128),
    "125m": GPTConfig(vocab_size=50304, seq_len=1024, n_layer=12, n_head=12, n_embd=768),
    "350m": GPTConfig(vocab_size=50304, seq_len=1024, n_layer=24, n_head=16, n_embd=1024),
    "1b": GPTConfig(vocab_size=50304, seq_len=2048, n_layer=24, n_head=16, n_embd=2048),
    "3b": GPTConfig(vocab_size=50304, seq_len=2048, n_layer=32, n_head=32, n_embd=2560),
    "7b": GPTConfig(vocab_size=50304, seq_len=2048, n_layer=32, n_head=32, n_embd=4096),
}


def gpt_config(name: str, **overrides: object) -> GPTConfig:
    """The named configuration, with fields replaced by `overrides`."""
    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}; expected one of {', '.join(CONFIGS)}")
    return CONFIGS[name].replace(**overrides)


class GPTOutput(NamedTuple):
    logits: torch.Tensor
    loss: torch.Tensor | None


class Linear(nn.Linear):
    """nn.Linear whose reset_parameters() is GPT-2's: N(0, 0.02) weight, zero bias."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


class Embedding(nn.Embedding):
    """nn.Embedding whose reset_parameters() is GPT-2's: N(0, 0.02)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.n_head = cfg.n_head
        self.qkv = Linear(cfg.n_embd, 3 * cfg.n_embd, bias=cfg.bias)
        self.proj = Linear(cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.fc = Linear(cfg.n_embd, 4 * cfg.n_embd, bias=cfg.bias)
        self.proj = Linear(4 * cfg.n_embd, cfg.n_embd, bias=cfg.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(F.gelu(self.fc(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig) -> None:
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, *, device: torch.device | str | None = None) -> None:
        super().__init__()
        self.config = cfg
        with torch.device(device) if device is not None else nullcontext():
            self.wte = Embedding(cfg.vocab_size, cfg.n_embd)
            self.wpe = Embedding(cfg.seq_len, cfg.n_embd)
            self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
            self.ln_f = nn.LayerNorm(cfg.n_embd, bias=cfg.bias)
            self.lm_head = Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_weights:
            self.lm_head.weight = self.wte.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> GPTOutput:
        t = idx.shape[1]
        if t > self.config.seq_len:
            raise ValueError(f"sequence of {t} tokens is longer than seq_len={self.config.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False) if self.config.checkpoint else block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))
        return GPTOutput(logits, loss)

    def num_params(self) -> int:
        """Parameters counted once each (a tied weight once)."""
        return sum(p.numel() for p in self.parameters())


def build(name: str, *, device: torch.device | str | None = None, **overrides: object) -> GPT:
    """A GPT of a named size ("tiny", "125m", "350m", "1b", "3b", "7b"); device="meta" builds it
    without memory (tierzero.wrap materialises it block by block)."""
    return GPT(gpt_config(name, **overrides), device=device)


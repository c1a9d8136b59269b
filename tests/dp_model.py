"""The data-parallel test model shared by the ZeRO, multi-rank checkpoint and stage tests: a GPT
with uneven sizes (width 60, vocabulary 257), tied weights, a frozen parameter inside a block and
a frozen embedding; its device budget at a world size; the global batches every world size
splits."""

from __future__ import annotations

import torch
from torch import nn

import builders
import tierzero as tz
from tierzero.layout import ROOT, block_fetch_bytes, blocks_of
from tierzero.models import GPT

STEPS = 8
GLOBAL_BATCH = 6  # splits evenly over 1, 2 and 3 ranks
SEQ = 24
VOCAB = 257
D = 60


def make_model() -> GPT:
    model = builders.gpt(vocab=VOCAB, seq=SEQ, layers=3, width=D, tie_weights=True)
    model.wpe.weight.requires_grad_(False)
    model.blocks[1].ln_1.weight.requires_grad_(False)
    for block in model.blocks:
        # The key bias's gradient is zero in exact arithmetic (softmax ignores a constant added to
        # every score of a query): it is rounding noise, which AdamW's division by sqrt(v) + eps
        # turns into steps of up to ~lr that differ between any two summation orders.
        block.attn.qkv.bias.requires_grad_(False)
    return model


def device_budget(model: nn.Module, world_size: int) -> int:
    """Root block + 2.5 of the largest block, as fetched at this world size."""
    sizes = {name: block_fetch_bytes(ps, torch.float32, world_size)
             for name, _, ps in blocks_of(model, tz.Config())}
    root = sizes.pop(ROOT)
    return root + int(2.5 * max(sizes.values()))


def global_batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g),
             torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)) for _ in range(STEPS)]

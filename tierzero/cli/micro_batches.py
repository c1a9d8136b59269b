"""`tierzero train --micro-batches K`: each step runs K micro-batches of --batch rows through
tz.accumulate (layer by layer: each block fetched once for the K, not K times)."""

from __future__ import annotations

import argparse
from typing import Any

import psutil
import torch
import torch.nn.functional as F

import tierzero as tz
from tierzero.cli.harness import batch_loss
from tierzero.models import GPT


def add_micro_batch_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument("--micro-batches", type=int, default=1, metavar="K",
                   help="gradient accumulation: each step is K micro-batches of --batch rows, run layer by layer "
                        "(tz.accumulate; docs/accumulate.md)")


def check_micro_batches(args: argparse.Namespace) -> None:
    if args.micro_batches < 1:
        raise ValueError(f"--micro-batches: expected a whole number >= 1 (micro-batches per step), "
                         f"got {args.micro_batches}")


TOKEN_ID_BYTES = 16
"""A token's id and its target (int64 each) in the step's batch."""


def check_step_memory(args: argparse.Namespace, model: torch.nn.Module, available: int | None = None) -> None:
    """ValueError at once, naming the limit, when the step's rows cannot be held in this machine's
    available memory (`available`: psutil's, by default): the token ids of its K x --batch rows of
    --seq tokens, and the hidden state between blocks that each micro-batch keeps while tz.accumulate
    runs the K layer by layer (4 bytes per token per unit of the embedding width)."""
    width = max((m.embedding_dim for m in model.modules() if isinstance(m, torch.nn.Embedding)), default=0)
    per_row = args.seq * (TOKEN_ID_BYTES + 4 * width)
    rows = args.micro_batches * args.batch
    available = psutil.virtual_memory().available if available is None else available
    if rows * per_row > available:
        most = available // (args.batch * per_row)
        raise ValueError(f"--micro-batches {args.micro_batches} x --batch {args.batch} x --seq {args.seq}: the "
                         f"step's rows need about {rows * per_row / 2**30:.1f} GiB of memory (token ids, and the hidden "
                         f"states tz.accumulate keeps between blocks), this machine has {available / 2**30:.1f} GiB "
                         f"available; give --micro-batches {max(most, 1)} or fewer (or a smaller --batch / --seq)")


def forward_backward(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, k: int, *,
                     chunked: bool) -> torch.Tensor:
    """The step's forward and backward over the rows of `x` in `k` equal micro-batches, each
    loss as harness.batch_loss's divided by k; their sum, detached. k = 1 is the plain step."""
    if k == 1:
        loss = batch_loss(model, x, y, chunked=chunked)
        loss.backward()
        return loss.detach()
    if chunked:
        raise ValueError("--chunked-loss runs the model inside its loss, which tz.accumulate cannot schedule "
                         "block by block; drop --chunked-loss or use --micro-batches 1")
    targets: dict[int, torch.Tensor] = {}
    mbs: list[Any] = []
    for xi, yi in zip(x.chunk(k), y.chunk(k)):
        mbs.append((xi, yi) if isinstance(model, GPT) else {"input_ids": xi, "use_cache": False})
        targets[id(mbs[-1])] = yi

    def loss_fn(out: Any, mb: Any) -> torch.Tensor:
        if isinstance(model, GPT):
            return out.loss / k
        logits = out.logits.float()
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets[id(mb)].reshape(-1)) / k

    return torch.stack(tz.accumulate(model, mbs, loss_fn)).sum()

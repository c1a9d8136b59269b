"""`tierzero train --micro-batches K`: each step runs K micro-batches of --batch rows through
tz.accumulate (layer by layer: each block fetched once for the K, not K times)."""

from __future__ import annotations

import argparse
from typing import Any

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

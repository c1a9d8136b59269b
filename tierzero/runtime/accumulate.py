"""`tz.accumulate`: one step of gradient accumulation over k micro-batches, layer by layer, so
each block is fetched once for the k forwards and once for the k backwards (GreedySnake's
schedule). The schedule itself: schedule.py ([Note: layer-major schedule])."""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
from torch import nn

from tierzero.runtime.step.schedule import PLAIN, LayerMajor
from tierzero.runtime.state import state_of


def _call(model: nn.Module, mb: Any) -> Any:
    if isinstance(mb, dict):
        return model(**mb)
    if isinstance(mb, tuple):
        return model(*mb)
    return model(mb)


def accumulate(model: nn.Module, micro_batches: Iterable[Any], loss_fn: Callable[[Any, Any], torch.Tensor], *,
               forward: Callable[[Any], Any] | None = None) -> list[torch.Tensor]:
    """Forward and backward over `micro_batches` layer by layer; the gradients summed as the plain
    loop sums them. Each micro-batch is passed as model(**mb) (a dict), model(*mb) (a tuple) or
    model(mb), or to `forward(mb)` where given (which calls the model once); `loss_fn(outputs, mb)`
    gives its loss (scale it, e.g. / k, as wanted). Returns the losses, detached, in order. Then
    tz.clip_grad_norm_ and opt.step() as after the plain loop. A step that cannot run layer by
    layer raises `LayerMajorRefusal` (a ValueError) before any backward."""
    state = state_of(model).renewed()  # parameters unfrozen since wrap are taken in first
    mbs = list(micro_batches)
    if not mbs:
        raise ValueError("tz.accumulate: micro_batches is empty; give at least one micro-batch")
    if not torch.is_grad_enabled():
        raise ValueError("tz.accumulate runs a training step's backward: call it with grad enabled "
                         "(not under torch.no_grad() or torch.inference_mode())")
    if state.ctx.schedule is not PLAIN:
        raise ValueError(f"tz.accumulate: {type(model).__name__} is already in a tz.accumulate step; "
                         "call it from the training loop, not from inside a model or loss_fn")
    return LayerMajor(model, state, mbs, loss_fn, forward or (lambda mb: _call(model, mb))).run()

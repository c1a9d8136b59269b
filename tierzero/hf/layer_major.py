"""tierzero.hf.Trainer's gradient accumulation layer by layer: the micro-batches of one
optimizer step (gradient_accumulation_steps > 1) go through tz.accumulate together, each block
fetched once for all of them. Each micro-batch's loss is the plain Trainer's, computed by its
own `compute_loss` on the outputs tz.accumulate produced and scaled as its `training_step`
scales it, so the logged loss and grad_norm are the plain Trainer's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import nn

from tierzero.runtime import accumulate


@dataclass
class StepGroup:
    """The micro-batches of one optimizer step (Trainer.get_batch_samples) and, once run, their losses."""

    samples: list[Any]
    num_items: Any
    losses: list[torch.Tensor] | None = None

    def index(self, inputs: Any) -> int | None:
        return next((i for i, s in enumerate(self.samples) if s is inputs), None)


class _Replay:
    """Stands for the model inside Trainer.compute_loss: gives back the outputs tz.accumulate computed."""

    def __init__(self, outputs: Any) -> None:
        self.outputs: Any = outputs

    def __call__(self, **inputs: Any) -> Any:
        if self.outputs is None:
            raise RuntimeError("tierzero.hf.Trainer: compute_loss called the model twice for one micro-batch; "
                               "gradient accumulation layer by layer runs it once (set gradient_accumulation_steps=1)")
        outputs, self.outputs = self.outputs, None
        return outputs


def _model_inputs(trainer: transformers.Trainer, inputs: dict[str, Any], num_items: Any) -> dict[str, Any]:
    """What the plain Trainer.compute_loss passes to the model for `inputs`."""
    inputs = dict(inputs)
    if (trainer.label_smoother is not None or trainer.compute_loss_func is not None) and "labels" in inputs:
        inputs.pop("labels")
    if trainer.model_accepts_loss_kwargs and num_items is not None:
        inputs["num_items_in_batch"] = num_items
    return inputs


def _scaled(trainer: transformers.Trainer, loss: torch.Tensor, num_items: Any) -> torch.Tensor:
    """The loss as the plain Trainer.training_step scales it before backward."""
    if trainer.args.n_gpu > 1:
        loss = loss.mean()
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        scaled = (trainer.model_accepts_loss_kwargs and num_items is not None) or trainer.compute_loss_func is not None
    if not scaled:
        loss = loss / getattr(trainer, "current_gradient_accumulation_steps", trainer.args.gradient_accumulation_steps)
    return loss


def step_losses(trainer: transformers.Trainer, model: nn.Module, group: StepGroup) -> list[torch.Tensor]:
    """Forward and backward of every micro-batch of `group`, layer by layer; their losses as the
    plain training_step returns them."""
    model.train()
    if callable(getattr(trainer.optimizer, "train", None)):
        trainer.optimizer.train()
    prepared = [trainer._prepare_inputs(s) for s in group.samples]
    mbs = [_model_inputs(trainer, p, group.num_items) for p in prepared]
    given = {id(mb): p for mb, p in zip(mbs, prepared)}

    def loss_fn(outputs: Any, mb: dict[str, Any]) -> torch.Tensor:
        loss = trainer.compute_loss(_Replay(outputs), dict(given[id(mb)]), num_items_in_batch=group.num_items)
        return _scaled(trainer, loss, group.num_items)

    with trainer.compute_loss_context_manager():
        return accumulate(model, mbs, loss_fn)

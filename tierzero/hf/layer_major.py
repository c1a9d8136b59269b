"""tierzero.hf.Trainer's gradient accumulation layer by layer: the micro-batches of one
optimizer step (gradient_accumulation_steps > 1) go through tz.accumulate together, each block
fetched once for all of them. Each micro-batch runs the trainer's own `compute_loss` (whatever
it passes the model: TRL's fused head, its own kwargs), scaled as its `training_step` scales it,
so the logged loss and grad_norm are the plain Trainer's. A step tz.accumulate refuses before any
loss is computed (a forward under autocast or no_grad) leaves the random generators as they were,
so the plain loop can run it instead."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import transformers
from torch import nn

from tierzero.runtime import LayerMajorRefusal, accumulate


@dataclass
class StepGroup:
    """The micro-batches of one optimizer step (Trainer.get_batch_samples) and, once run, their losses."""

    samples: list[Any]
    num_items: Any
    losses: list[torch.Tensor] | None = None

    def index(self, inputs: Any) -> int | None:
        return next((i for i, s in enumerate(self.samples) if s is inputs), None)


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


def _rng_states() -> tuple[torch.Tensor, list[torch.Tensor] | None]:
    return torch.get_rng_state(), torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None


def step_losses(trainer: transformers.Trainer, model: nn.Module, group: StepGroup) -> list[torch.Tensor]:
    """Forward and backward of every micro-batch of `group`, layer by layer; their losses as the
    plain training_step returns them. Raises LayerMajorRefusal where tz.accumulate refuses the
    step; with no loss computed yet, the random generators are as they were at the call."""
    model.train()
    if callable(getattr(trainer.optimizer, "train", None)):
        trainer.optimizer.train()
    prepared = [trainer._prepare_inputs(s) for s in group.samples]
    cpu, cuda = _rng_states()

    def forward(inputs: dict[str, Any]) -> torch.Tensor:
        return trainer.compute_loss(model, inputs, num_items_in_batch=group.num_items)

    try:
        with trainer.compute_loss_context_manager():
            return accumulate(model, prepared, lambda loss, _: _scaled(trainer, loss, group.num_items), forward=forward)
    except LayerMajorRefusal as refusal:
        if not refusal.losses_computed:
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state_all(cuda)
        raise

"""`Trainer`: transformers' Trainer for a tierzero-wrapped model (re-exported as tierzero.hf.Trainer).

A wrapped model keeps its gradients in flat fp32 shards and leaves every `p.grad` None, its
optimizer state on tiers, its parameters as placeholders streamed in by the runtime. The plain
Trainer reaches for all three directly (it clips `p.grad`, clears with `model.zero_grad()`, builds
torch.optim.AdamW over the parameters, saves full state dicts); this subclass redirects each of
those jobs to tierzero and leaves the rest of the loop (data, accumulation, schedules, logging,
callbacks, trainer_state.json, RNG files) to transformers. See `Trainer` for the overridden methods.
"""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import transformers
from torch import nn
from transformers.trainer import SCHEDULER_NAME, TRAINING_ARGS_NAME
from transformers.trainer_callback import TrainerCallback
from transformers.trainer_pt_utils import reissue_pt_warnings
from transformers.training_args import OptimizerNames, ParallelMode

from tierzero import runtime
from tierzero.checkpoint import load_checkpoint, open_checkpoint, save_checkpoint
from tierzero.formats import is_peft
from tierzero.hf.layer_major import StepGroup, step_losses
from tierzero.hf.loss import causal_lm_loss
from tierzero.hf.pretrained import save_pretrained
from tierzero.optim import AdamW, TieredOptimizer, clip_grad_norm_
from tierzero.runtime import LayerMajorRefusal

__all__ = ["Trainer", "TIERZERO_DIR", "trainer_for"]

TIERZERO_DIR = "tierzero"
"""The folder inside `output_dir/checkpoint-N/` holding the model's and optimizer's tiered state
(a tz.save_checkpoint folder)."""

DRIVER = "tierzero.hf.Trainer"

_ADAMW = {OptimizerNames.ADAMW_TORCH.value, OptimizerNames.ADAMW_TORCH_FUSED.value}
"""TrainingArguments.optim values built as tz.AdamW (torch's AdamW math)."""


class Trainer(transformers.Trainer):
    """transformers.Trainer (same constructor) for a model wrapped with `tz.wrap`.

    Overridden, each the narrowest method that does the job:

    - `create_optimizer`: builds `tz.AdamW` from TrainingArguments over the plain Trainer's
      two param groups (`get_decay_parameter_names`: weight_decay for the others, 0 for biases
      and norm weights), instead of torch.optim.AdamW over the placeholder parameters (which
      never see a gradient). An optimizer given with `optimizers=` must be a tz optimizer built
      on this model (ValueError otherwise).
    - `_clip_grad_norm` / `_get_grad_norm`: `tz.clip_grad_norm_(model, max_grad_norm)` (or an
      infinite max_norm when max_grad_norm is 0, as the plain Trainer does), so the true global
      norm is what gets clipped and logged as `grad_norm`.
    - `_build_accelerator_args`: accelerate without device placement. Its optimizer wrapper
      would otherwise round-trip the optimizer's full state through state_dict() at prepare (all
      master weights and moments in RAM), and placement is tierzero's job.
    - `_move_model_to_device`: a no-op; tierzero places the model (parameters are streamed to its
      device, wrap moved the buffers), and `model.to(other_device)` would copy every zero-stride
      placeholder into a full-size tensor.
    - `_save_checkpoint` / `save_model` / `_save_optimizer_and_scheduler`: a Trainer checkpoint
      (`output_dir/checkpoint-N/`) holds what the plain Trainer's holds for other tools (a peft
      model's adapter_config.json and adapter_model.safetensors, which PeftModel.from_pretrained
      loads; else the model as a transformers folder, config.json and model.safetensors streamed
      out by tz.save_pretrained, which from_pretrained loads), and, for an exact resume, the
      model's and optimizer's state as a tz.save_checkpoint folder `tierzero/` (streamed from
      the tiers, no full state dict in RAM; the optimizer left out with save_only_model), beside
      the Trainer's own training_args.bin, scheduler.pt, rng_state.pth and trainer_state.json.
      export_weights=False leaves the weights out (a model too large to write twice a
      checkpoint: `tierzero export output_dir/checkpoint-N/tierzero --to DIR` writes the same
      folder later). `save_model` outside a checkpoint (the user's export) is the plain Trainer's.
    - `get_batch_samples` / `training_step`: with gradient_accumulation_steps > 1, the first
      micro-batch's training_step runs all of the step's micro-batches through tz.accumulate
      (tierzero/hf/layer_major.py: each runs this trainer's compute_loss; the losses the plain
      loop would give, per micro-batch), the others return their losses. chunked_loss steps take
      the plain loop, and so does every step after one whose forward cannot run layer by layer
      (under autocast, as bf16=True runs it, or no_grad: tz.accumulate refuses it before any
      loss), with one warning.
    - `_load_from_checkpoint` / `_load_optimizer_and_scheduler`: resuming loads that folder with
      tz.load_checkpoint once the optimizer exists (the second method; the first only checks the
      folder is a tierzero one), then the scheduler.

    Gradients are cleared where the plain Trainer calls `model.zero_grad()` (which leaves the flat
    gradients alone): at train begin and after each optimizer step, by a callback
    (`on_train_begin`, `on_step_end`) calling the tz optimizer's zero_grad().

    chunked_loss=True (off by default): the training loss of a causal LM is `causal_lm_loss`,
    the model's own loss without the whole sequence's logits (see [Note: chunked loss] in
    tierzero/hf/loss.py), divided by `num_items_in_batch` where the plain Trainer has the model
    divide by it; evaluation keeps the model's loss and logits (`compute_loss`).

    Refused at construction with a ValueError saying what to change: a model not wrapped,
    several processes (tierzero shards across ranks itself; accelerate would add DDP on top),
    fp16 (a GradScaler unscales `p.grad`; use Config(compute_dtype=...)), optimizer_cls_and_kwargs,
    load_best_model_at_end (it reads full weight files), an `optim` other than adamw_torch(_fused)
    when no optimizer is given, and chunked_loss with label smoothing or a compute_loss_func.
    """

    def __init__(self, model: nn.Module | None = None, *args: Any, chunked_loss: bool = False,
                 export_weights: bool = True, **kwargs: Any) -> None:
        super().__init__(model, *args, **kwargs)
        self.chunked_loss = chunked_loss
        self.export_weights = export_weights
        self._check_args()
        if self.model is not None:
            self._check_model(self.model)
        if self.optimizer is not None:
            self._claim(self.optimizer)
        self.add_callback(_ClearTieredGrads())
        self._saving_checkpoint = False
        """True while _save_checkpoint runs: save_model then writes the tiered state."""
        self._layer_major = True
        """False once a step's forward could not run layer by layer: the plain loop from then on."""

    # ------------------------------------------------------------------------------- checks

    def _check_args(self) -> None:
        args = self.args
        if args.world_size > 1 or args.parallel_mode is not ParallelMode.NOT_PARALLEL:
            raise ValueError(f"{DRIVER}: runs in one process on one device (got world_size={args.world_size}, "
                             f"n_gpu={args.n_gpu}, parallel_mode={args.parallel_mode.value}); tierzero shards "
                             "across ranks itself (tz.wrap under torchrun), which this Trainer does not drive yet: "
                             "use a plain PyTorch loop with tz.AdamW for several processes")
        if args.fp16:
            raise ValueError(f"{DRIVER}: fp16=True needs a GradScaler, which unscales `p.grad` (tierzero's "
                             "gradients live in flat fp32 shards); set fp16=False and choose the compute dtype "
                             "with tz.Config(compute_dtype=...)")
        if args.load_best_model_at_end:
            raise ValueError(f"{DRIVER}: load_best_model_at_end=True is not supported (it reads full weight "
                             "files); set it to False and load the best checkpoint's tierzero/ folder with "
                             "tz.load_checkpoint")
        if self.optimizer_cls_and_kwargs is not None:
            raise ValueError(f"{DRIVER}: optimizer_cls_and_kwargs builds a torch optimizer over placeholder "
                             "parameters; pass optimizers=(tz.AdamW(model, ...), None) instead")
        if self.chunked_loss and (self.label_smoother is not None or self.compute_loss_func is not None):
            raise ValueError(f"{DRIVER}: chunked_loss=True computes the model's own cross-entropy, not label "
                             "smoothing (label_smoothing_factor) or a compute_loss_func; drop one or the other")

    def _check_model(self, model: nn.Module) -> runtime.TieredState:
        try:
            return runtime.state_of(model)
        except ValueError:
            raise ValueError(f"{DRIVER}: expected a model wrapped with tz.wrap(model, config), got an unwrapped "
                             f"{type(model).__name__}; wrap it first, or train it with transformers.Trainer") from None

    def _claim(self, optimizer: torch.optim.Optimizer) -> TieredOptimizer:
        """The tz optimizer inside `optimizer` (accelerate wraps it), declared driven by this Trainer."""
        inner = _unwrap(optimizer)
        state = self._check_model(self.model)
        if not isinstance(inner, TieredOptimizer) or not set(inner.flat_params) <= set(state.flat_params()):
            raise ValueError(f"{DRIVER}: the optimizer must be a tz.AdamW / tz.SGD built on this model, got "
                             f"{type(inner).__name__}; a torch optimizer sees only the placeholder parameters, "
                             "which never get a gradient. Pass optimizers=(tz.AdamW(model, ...), None), or none "
                             "to build tz.AdamW from the TrainingArguments")
        inner.driven_by(DRIVER)
        return inner

    @property
    def tiered_optimizer(self) -> TieredOptimizer:
        assert self.optimizer is not None, "the optimizer is created at the start of train()"
        return self._claim(self.optimizer)

    # ---------------------------------------------------------------------------- optimizer

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        opt_model = self.model if model is None else model
        self._check_model(opt_model)
        if self.optimizer is None:
            args = self.args
            if str(getattr(args.optim, "value", args.optim)) not in _ADAMW:
                raise ValueError(f"{DRIVER}: TrainingArguments.optim={args.optim!r} has no tiered counterpart; "
                                 f"use one of {sorted(_ADAMW)} (built as tz.AdamW), or pass "
                                 "optimizers=(tz.AdamW(model, ...) or tz.SGD(model, ...), None)")
            # the plain Trainer's groups: biases and norm weights exempt from weight decay
            decayed = set(self.get_decay_parameter_names(opt_model))
            named = [(n, p) for n, p in opt_model.named_parameters() if p.requires_grad]
            groups = [{"params": [p for n, p in named if n in decayed], "weight_decay": args.weight_decay},
                      {"params": [p for n, p in named if n not in decayed], "weight_decay": 0.0}]
            self.optimizer = AdamW(groups, lr=args.learning_rate, betas=(args.adam_beta1, args.adam_beta2),
                                   eps=args.adam_epsilon, weight_decay=args.weight_decay)
        self._claim(self.optimizer)
        return self.optimizer

    def _clip_grad_norm(self, model: nn.Module) -> torch.Tensor:
        return clip_grad_norm_(self.model, self.args.max_grad_norm)

    def _get_grad_norm(self, model: nn.Module, grad_norm: Any = None) -> Any:
        if grad_norm is None:  # max_grad_norm == 0: the norm alone (an infinite max_norm scales by 1)
            grad_norm = clip_grad_norm_(self.model, float("inf"))
        return grad_norm

    # ----------------------------------------------------------------------------------- loss

    def compute_loss(self, model: nn.Module, inputs: dict[str, Any], return_outputs: bool = False,
                     num_items_in_batch: torch.Tensor | int | None = None) -> Any:
        if not self.chunked_loss or return_outputs or not model.training:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        inputs = dict(inputs)
        ids, labels, shifted = inputs.pop("input_ids"), inputs.pop("labels", None), inputs.pop("shift_labels", None)
        if labels is None and shifted is None:
            raise ValueError(f"{DRIVER}: chunked_loss=True needs labels in each batch (the model's loss is over them)")
        # the plain Trainer hands num_items_in_batch to the model's loss only where its forward takes it
        items = num_items_in_batch if self.model_accepts_loss_kwargs else None
        return causal_lm_loss(model, ids, None if shifted is not None else labels, shift_labels=shifted,
                              num_items_in_batch=items, **inputs)

    # ------------------------------------------------------------ accumulation, layer by layer

    def get_batch_samples(self, epoch_iterator: Any, num_batches: int, device: Any) -> tuple[list, Any]:
        samples, num_items = super().get_batch_samples(epoch_iterator, num_batches, device)
        # chunked_loss runs the model inside the loss: those steps take the plain loop
        layer_major = len(samples) > 1 and not self.chunked_loss and self._layer_major
        self._step_group = StepGroup(samples, num_items) if layer_major else None
        return samples, num_items

    def training_step(self, model: nn.Module, inputs: dict[str, Any], num_items_in_batch: Any = None) -> torch.Tensor:
        group: StepGroup | None = getattr(self, "_step_group", None)
        i = group.index(inputs) if group is not None else None
        if group is None or i is None:
            return super().training_step(model, inputs, num_items_in_batch)
        if group.losses is None:
            try:
                group.losses = step_losses(self, model, group)
            except LayerMajorRefusal as refusal:
                if refusal.losses_computed:  # a loss's side effects happened: not the plain step any more
                    raise
                self._plain_loop(refusal)
                return super().training_step(model, inputs, num_items_in_batch)
        return group.losses[i]

    def _plain_loop(self, refusal: LayerMajorRefusal) -> None:
        """Accumulate with the plain loop from this step on (nothing of this step ran yet)."""
        self._layer_major, self._step_group = False, None
        warnings.warn(f"{type(self).__name__}: accumulating with the plain loop, each block fetched once per "
                      f"micro-batch (layer by layer, {refusal.reason})", RuntimeWarning, stacklevel=2)

    # ------------------------------------------------------------------------------ placement

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        return {**super()._build_accelerator_args(**kwargs), "device_placement": False}

    def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
        pass  # tierzero streams the parameters to its device; wrap moved the buffers

    # ---------------------------------------------------------------------------- checkpoints

    def _save_checkpoint(self, model: nn.Module, trial: Any) -> None:
        self._saving_checkpoint = True
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._saving_checkpoint = False

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if not self._saving_checkpoint:
            return super().save_model(output_dir, _internal_call)
        assert output_dir is not None
        saved = self.args.should_save and self.export_weights and self._save_loadable(output_dir)
        optimizer = None if self.args.save_only_model else self.tiered_optimizer
        save_checkpoint(Path(output_dir) / TIERZERO_DIR, self.model, optimizer)
        if self.args.should_save:
            config = getattr(self.model, "config", None)
            if not saved and not is_peft(self.model) and hasattr(config, "save_pretrained"):
                config.save_pretrained(output_dir)
            if self.processing_class is not None:
                self.processing_class.save_pretrained(output_dir)
            torch.save(self.args, os.path.join(output_dir, TRAINING_ARGS_NAME))

    def _save_loadable(self, output_dir: str) -> bool:
        """What the plain Trainer's checkpoint holds for other tools, written before the tiered
        state: a peft model's adapter files (peft's save_pretrained), else a transformers model
        as its folder (tz.save_pretrained, streamed; it replaces the folder whole, so it goes
        first). False for a model that is neither (its weights are in tierzero/ only)."""
        if is_peft(self.model):
            self.model.save_pretrained(output_dir)
            return True
        if not callable(getattr(getattr(self.model, "config", None), "save_pretrained", None)):
            return False
        save_pretrained(self.model, output_dir)
        return True

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        # the optimizer's state went into tierzero/ with the model's (save_model)
        if self.args.should_save:
            with warnings.catch_warnings(record=True) as caught:
                torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            reissue_pt_warnings(caught)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
        # the tiered state is loaded with the optimizer's, once it exists: _load_optimizer_and_scheduler
        _tiered_dir(resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None:
            return
        folder = _tiered_dir(checkpoint)
        _, manifest = open_checkpoint(folder)
        with_optimizer = manifest.optimizer is not None  # not with save_only_model
        load_checkpoint(folder, self.model, self.tiered_optimizer if with_optimizer else None)
        scheduler = os.path.join(checkpoint, SCHEDULER_NAME)
        if with_optimizer and os.path.isfile(scheduler):
            with warnings.catch_warnings(record=True) as caught:
                self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))
            reissue_pt_warnings(caught)


@functools.cache
def trainer_for(cls: type) -> type[Trainer]:
    """`cls`, a transformers.Trainer subclass (trl.SFTTrainer, trl.DPOTrainer, one's own), with
    tierzero.hf.Trainer's overrides in front: `class TieredX(tierzero.hf.Trainer, cls)`, the same
    constructor as `cls` plus Trainer's keywords; one class per `cls`."""
    if not (isinstance(cls, type) and issubclass(cls, transformers.Trainer)):
        raise ValueError(f"tierzero.hf.trainer_for: expected a transformers.Trainer subclass (trl.SFTTrainer, ...), "
                         f"got {cls!r}")
    if issubclass(cls, Trainer):
        return cls
    return type(f"Tiered{cls.__name__}", (Trainer, cls), {"__module__": __name__, "__qualname__": f"Tiered{cls.__name__}",
                                                          "__doc__": f"{cls.__qualname__} for a tz.wrap-ped model."})


class _ClearTieredGrads(TrainerCallback):
    """Clears the flat gradients where the plain Trainer calls model.zero_grad() (which does not
    reach them): before training and after each optimizer step (on_step_end is the first event
    after that call)."""

    def on_train_begin(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        _unwrap(optimizer).zero_grad()

    def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        _unwrap(optimizer).zero_grad()


def _unwrap(optimizer: Any) -> Any:
    """The optimizer inside accelerate's AcceleratedOptimizer (and the like)."""
    while not isinstance(optimizer, TieredOptimizer) and isinstance(getattr(optimizer, "optimizer", None),
                                                                      torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    return optimizer


def _tiered_dir(checkpoint: str) -> Path:
    folder = Path(checkpoint) / TIERZERO_DIR
    if not folder.is_dir():
        raise ValueError(f"{DRIVER}: {checkpoint!r} holds no {TIERZERO_DIR}/ folder, so it was not written by "
                         f"{DRIVER}; resume from one of its checkpoints (output_dir/checkpoint-N), or load plain "
                         "weights into the wrapped model with tz.load_weights and start a new run")
    return folder

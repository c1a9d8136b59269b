"""Refusing a torch optimizer that would silently not train a wrapped model.

tierzero keeps a wrapped model's gradients in flat shards, not in `p.grad`, and its parameters
hold placeholders outside a block's forward and backward: a torch optimizer (or transformers'
plain Trainer, which builds one) stepping them would update nothing and say nothing. wrap()
records each wrapped model's parameters here and installs, once, a global optimizer step
pre-hook (torch's documented `register_optimizer_step_pre_hook`) that refuses such a step. An
optimizer found clean is not looked at again until a model is wrapped or its parameter count
changes (`add_param_group`), so the hook costs a lookup per step. tierzero's own optimizers (a
layer above) are recognised by the class attribute `TIERED_OPTIMIZER` they set, not by type.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle

_TIERED: "weakref.WeakKeyDictionary[nn.Module, frozenset[int]]" = weakref.WeakKeyDictionary()
"""Side table: wrapped model -> the ids of its parameters (tensors compare elementwise, so ids;
a hit is confirmed by identity)."""
_CLEAN: "weakref.WeakKeyDictionary[torch.optim.Optimizer, tuple[int, int]]" = weakref.WeakKeyDictionary()
"""Optimizer -> (wraps so far, its parameter count) when it was last found clean."""
TIERED_OPTIMIZER = "_tierzero_steps_flat_gradients"
"""The class attribute (True) by which an optimizer says it steps a wrapped model's flat
gradients itself (tierzero.optim.TieredOptimizer sets it)."""
_wraps = 0
_hook: RemovableHandle | None = None


def refuse_other_optimizers(model: nn.Module) -> None:
    """Refuse, from now on, a step of any optimizer other than tierzero's over `model`'s
    parameters (called by wrap)."""
    global _wraps, _hook
    _TIERED[model] = frozenset(id(p) for p in model.parameters())
    _wraps += 1
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_check)


def _check(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    seen = (_wraps, sum(len(g["params"]) for g in optimizer.param_groups))
    if _CLEAN.get(optimizer) == seen:
        return
    if not getattr(type(optimizer), TIERED_OPTIMIZER, False):
        for group in optimizer.param_groups:
            for p in group["params"]:
                model = _owner(p)
                if model is not None:
                    raise ValueError(
                        f"{type(optimizer).__name__} steps parameters of the tierzero-wrapped "
                        f"{type(model).__name__}, whose gradients live in tierzero's flat shards, not "
                        "in p.grad: it would not train. Use tz.AdamW(model, ...) or tz.SGD(model, ...) "
                        "(with transformers' Trainer: tierzero.hf.Trainer, which builds one)")
    _CLEAN[optimizer] = seen


def _owner(p: torch.Tensor) -> nn.Module | None:
    for model, ids in list(_TIERED.items()):
        if id(p) in ids and any(q is p for q in model.parameters()):
            return model
    return None

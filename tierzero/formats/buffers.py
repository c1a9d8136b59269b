"""A model's buffers when its weights come from a checkpoint: the persistent ones the checkpoint
gives are loaded, the rest (non-persistent buffers such as rotary inverse frequencies, and
persistent ones a checkpoint leaves out) are computed by the model's own initialisation
(transformers' `_init_weights`, else the module's `reset_parameters()`), as transformers'
from_pretrained does."""

from __future__ import annotations

import sys
from typing import Callable

import torch
from torch import nn

from tierzero.formats.weights import WeightPlan, few


def _meta_buffers(model: nn.Module, plan: WeightPlan) -> list[tuple[str, nn.Module, list[str]]]:
    """(fqn, module, names) of buffers the checkpoint does not give that are still on meta."""
    out = []
    for fqn, module in model.named_modules():
        prefix = f"{fqn}." if fqn else ""
        names = [k for k, b in module._buffers.items() if b is not None and b.is_meta
                 and (k in module._non_persistent_buffers_set or prefix + k in plan.init_buffers)]
        if names:
            out.append((fqn, module, names))
    return out


def _initializer(model: nn.Module, fqn: str, module: nn.Module) -> Callable[[], None] | None:
    """How the module's buffers are computed: the top transformers model's `_init_weights(module)`,
    else the module's own `reset_parameters()`."""
    transformers = sys.modules.get("transformers")
    if transformers is not None:
        top = next((m for m in _ancestors(model, fqn) if isinstance(m, transformers.PreTrainedModel)), None)
        if top is not None:
            return lambda: top._init_weights(module)
    reset = getattr(module, "reset_parameters", None)
    return reset if callable(reset) else None


def _ancestors(model: nn.Module, fqn: str) -> list[nn.Module]:
    """The modules on the path from the root to `fqn`, outermost first."""
    out, m = [model], model
    for part in fqn.split(".") if fqn else []:
        m = m.get_submodule(part)
        out.append(m)
    return out


def check_buffers(model: nn.Module, plan: WeightPlan) -> None:
    """ValueError, before anything changes, for meta buffers nothing can compute."""
    bad = [f"{fqn + '.' if fqn else ''}{k} ({type(m).__name__})"
           for fqn, m, names in _meta_buffers(model, plan) if _initializer(model, fqn, m) is None for k in names]
    if bad:
        raise ValueError(
            f"weights {str(plan.source.path)!r}: {type(model).__name__} has buffers on the meta device that are "
            f"not in the checkpoint (non-persistent buffers computed in __init__): {few(bad)}; give their "
            "modules a reset_parameters() that computes them (parameters stay untouched: they are loaded "
            "afterwards), or build those modules on a real device (e.g. move them with to_empty() and "
            "compute the buffers) before tz.wrap")


def init_buffers(model: nn.Module, plan: WeightPlan) -> None:
    """Make the meta buffers the checkpoint does not give real and compute them (call while the
    parameters are still as built, so an initialiser that also touches them changes nothing
    that is kept: they are loaded from the checkpoint)."""
    for fqn, module, names in _meta_buffers(model, plan):
        init = _initializer(model, fqn, module)
        assert init is not None, fqn  # check_buffers ran first
        for k in names:
            b = module._buffers[k]
            fill = float("nan") if b.dtype.is_floating_point else 0
            module._buffers[k] = torch.full(b.shape, fill, dtype=b.dtype, device="cpu")
        with torch.no_grad(), torch.device("cpu"):
            init()
        stale = [k for k in names if module._buffers[k].dtype.is_floating_point
                 and module._buffers[k].isnan().all() and module._buffers[k].numel()]
        if stale:
            raise ValueError(f"{fqn or type(model).__name__}: initialising {type(module).__name__} did not compute "
                             f"its buffers {stale}; compute them in its reset_parameters() (or the model's "
                             "_init_weights), or build the model on a real device")


def load_buffers(model: nn.Module, plan: WeightPlan, device: torch.device) -> None:
    """Persistent buffers from the checkpoint, in each buffer's dtype, on `device` (the buffer
    objects are replaced when on meta, else written in place)."""
    for fqn, module in model.named_modules():
        prefix = f"{fqn}." if fqn else ""
        for k, b in module._buffers.items():
            name = prefix + k
            if b is None or name not in plan.keys or k in module._non_persistent_buffers_set:
                continue
            value = plan.read_buffer(name, b)
            if b.is_meta:
                module._buffers[k] = value.to(device, copy=True)
            else:
                with torch.no_grad():
                    b.copy_(value)
    plan.source.release()


def persistent_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's buffers that its state_dict holds (running statistics and the like): they
    live outside the tiers, whole on every rank."""
    return {f"{prefix}{'.' if prefix else ''}{name}": buf for prefix, module in model.named_modules()
            for name, buf in module._buffers.items()
            if buf is not None and name not in module._non_persistent_buffers_set}

"""A model's buffers, and the parameters a checkpoint does not give, when its weights come from
a checkpoint: the persistent buffers the checkpoint gives are loaded; the rest (non-persistent
buffers such as rotary inverse frequencies, persistent ones a checkpoint leaves out) and the
missing parameters are computed by the model's own initialisation, as transformers'
from_pretrained does: the nearest transformers model's `_init_weights`, module by module in the
order its `initialize_weights` walks them (children first, so the random draws come in its
order: a new head gets the very values transformers gives it from the same seed); peft's
adapters by their layer's `reset_lora_parameters`; other modules by their `reset_parameters()`."""

from __future__ import annotations

import sys
from typing import Callable, Hashable, NamedTuple

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


class _Init(NamedTuple):
    """An initialiser, and what it initialises (peft's covers an adapter's A and B at once)."""

    covers: Hashable
    run: Callable[[], None]


def _initializer(model: nn.Module, fqn: str, module: nn.Module) -> _Init | None:
    """How the module's tensors are computed: peft's initialisation of the adapter it belongs to,
    the nearest transformers model's `_init_weights(module)`, else the module's own
    `reset_parameters()`."""
    path = _ancestors(model, fqn)
    for i in range(len(path) - 1, -1, -1):  # the tuner layer the module is an adapter of
        layer = path[i]
        if callable(getattr(layer, "reset_lora_parameters", None)) and i + 2 < len(path):
            names = fqn.split(".")[i:]
            if names[0] in getattr(layer, "adapter_layer_names", ()):
                adapter = names[1]
                config = getattr(model, "peft_config", {}).get(adapter)
                init = getattr(config, "init_lora_weights", True)
                return _Init((id(layer), adapter), lambda: layer.reset_lora_parameters(adapter, init))
    transformers = sys.modules.get("transformers")
    if transformers is not None:
        nearest = next((m for m in reversed(path) if isinstance(m, transformers.PreTrainedModel)), None)
        if nearest is not None:
            return _Init(id(module), lambda: nearest._init_weights(module))
    reset = getattr(module, "reset_parameters", None)
    return _Init(id(module), reset) if callable(reset) else None


def _ancestors(model: nn.Module, fqn: str) -> list[nn.Module]:
    """The modules on the path from the root to `fqn`, outermost first."""
    out, m = [model], model
    for part in fqn.split(".") if fqn else []:
        m = m.get_submodule(part)
        out.append(m)
    return out


def check_buffers(model: nn.Module, plan: WeightPlan) -> None:
    """ValueError, before anything changes, for meta buffers and missing meta parameters that
    nothing can compute."""
    for found, what, fix in (
            (_missing_params(model, plan), "parameters on the meta device that are not in the checkpoint, and "
             "nothing initialises them (no transformers model above them, no reset_parameters())",
             "give the checkpoint that holds them, or build those modules on a real device (their values are "
             "then kept)"),
            (_meta_buffers(model, plan), "buffers on the meta device that are not in the checkpoint (non-persistent "
             "buffers computed in __init__)", "give their modules a reset_parameters() that computes them "
             "(parameters stay untouched: they are loaded afterwards), or build those modules on a real device "
             "(e.g. move them with to_empty() and compute the buffers) before tz.wrap")):
        bad = [f"{fqn + '.' if fqn else ''}{k} ({type(m).__name__})"
               for fqn, m, names in found if _initializer(model, fqn, m) is None for k in names]
        if bad:
            raise ValueError(f"weights {str(plan.source.path)!r}: {type(model).__name__} has {what}: {few(bad)}; "
                             f"{fix}")


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
            init.run()
        stale = [k for k in names if module._buffers[k].dtype.is_floating_point
                 and module._buffers[k].isnan().all() and module._buffers[k].numel()]
        if stale:
            raise ValueError(f"{fqn or type(model).__name__}: initialising {type(module).__name__} did not compute "
                             f"its buffers {stale}; compute them in its reset_parameters() (or the model's "
                             "_init_weights), or build the model on a real device")


def _missing_params(model: nn.Module, plan: WeightPlan) -> list[tuple[str, nn.Module, list[str]]]:
    """(fqn, module, names) of the meta parameters the checkpoint does not give, module by module
    in transformers' initialisation order (children before their parent)."""
    missing = {id(p) for n, p in model.named_parameters(remove_duplicate=False) if n in plan.init_params}
    return [(fqn, module, names) for fqn, module in _children_first(model)
            if (names := [k for k, p in module._parameters.items() if p is not None and p.is_meta and id(p) in missing])]


def _children_first(module: nn.Module, fqn: str = "") -> list[tuple[str, nn.Module]]:
    out = []
    for name, child in module.named_children():
        out += _children_first(child, f"{fqn}.{name}" if fqn else name)
    return out + [(fqn, module)]


def init_params(model: nn.Module, plan: WeightPlan) -> None:
    """Give the parameters the checkpoint lacks their values (module docstring): the meta ones
    made real on the CPU and initialised, in order; the real ones kept as they are. Both go to
    `plan.own`, where the shards read them. Call before the parameters are registered."""
    todo = _missing_params(model, plan)
    for _, module, names in todo:  # all made real first: an initialiser may set several modules' tensors
        for k in names:
            p = module._parameters[k]
            torch.utils.swap_tensors(p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype), requires_grad=p.requires_grad))
    done = set()
    for fqn, module, names in todo:
        init = _initializer(model, fqn, module)
        assert init is not None, fqn  # check_buffers ran first
        if init.covers in done:
            continue  # peft initialises an adapter's A and B together
        done.add(init.covers)
        kept = {k: p.detach().clone() for k, p in module._parameters.items()
                if p is not None and k not in names and not p.is_meta}
        with torch.no_grad(), torch.device("cpu"):
            init.run()
            for k, value in kept.items():  # what the model had, or was loaded, stays
                module._parameters[k].copy_(value)
    named = dict(model.named_parameters(remove_duplicate=False))
    plan.own.update({n: named[n].detach() for n in plan.init_params})


def load_buffers(model: nn.Module, plan: WeightPlan, device: torch.device) -> None:
    """Persistent buffers from the checkpoint, in each buffer's dtype, on `device` (the buffer
    objects are replaced when on meta, else written in place)."""
    for fqn, module in model.named_modules():
        prefix = f"{fqn}." if fqn else ""
        for k, b in module._buffers.items():
            name = prefix + k
            if b is None or not plan.gives(name) or k in module._non_persistent_buffers_set:
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

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
from typing import Any, Callable, Hashable, NamedTuple, Sequence

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


def _initializer(model: nn.Module, fqn: str, module: nn.Module, params: Sequence[str] = ()) -> _Init | None:
    """How the module's tensors (`params` of them, when known) are computed: peft's
    initialisation of the adapter they belong to, the nearest transformers model's
    `_init_weights(module)`, else the module's own `reset_parameters()`."""
    path = _ancestors(model, fqn)
    for i in range(len(path) - 1, -1, -1):  # the tuner layer the module is an adapter of
        layer = path[i]
        # an adapter module (lora_A.<adapter>), or an adapter's tensor in a ParameterDict (lora_embedding_A)
        within = fqn.split(".")[i:] + (list(params[:1]) if isinstance(module, nn.ParameterDict) else [])
        if callable(getattr(layer, "reset_lora_parameters", None)) and len(within) >= 2:
            if within[0] in getattr(layer, "adapter_layer_names", ()):
                adapter = within[1]
                config = getattr(model, "peft_config", {}).get(adapter)
                init = getattr(config, "init_lora_weights", True)
                return _Init((id(layer), adapter), lambda: _init_adapter(layer, adapter, init))
    transformers = sys.modules.get("transformers")
    if transformers is not None:
        nearest = next((m for m in reversed(path) if isinstance(m, transformers.PreTrainedModel)), None)
        if nearest is not None:
            return _Init(id(module), lambda: nearest._init_weights(module))
    reset = getattr(module, "reset_parameters", None)
    return _Init(id(module), reset) if callable(reset) else None


def _init_adapter(layer: nn.Module, adapter: str, init: Any) -> None:
    """Draw `adapter`'s tensors in `layer` as peft's update_layer draws them on a real device. See
    [Note: adapters drawn as peft draws them]."""
    for attr in getattr(layer, "adapter_layer_names", ()):
        part = getattr(layer, attr, None)
        if not isinstance(part, (nn.ModuleDict, nn.ParameterDict)) or adapter not in part:
            continue
        built = part[adapter]
        if isinstance(built, nn.Parameter):
            if not init:  # peft's torch.randn, whose values it dropped: drawn aside, the stream left as peft's
                with torch.random.fork_rng(devices=[]):
                    built.normal_()
        elif callable(getattr(built, "reset_parameters", None)):
            built.reset_parameters()
    if init:
        layer.reset_lora_parameters(adapter, init)


# [Note: adapters drawn as peft draws them]
# peft's update_layer draws an adapter twice: building it (an nn.Linear's reset_parameters(), an
# embedding adapter's torch.randn) and then its reset_lora_parameters(). Over a base on the meta
# device, get_peft_model(..., low_cpu_mem_usage=True) builds the Linear adapters on meta (no
# draws) but still draws the embedding adapters' randn on the CPU; without it, it draws all of
# them on the CPU and then moves them to the base's meta device, dropping the values. tz.wrap
# draws what get_peft_model(low_cpu_mem_usage=True) did not, layer by layer in peft's order, so
# that from the seed plain peft starts from the random stream gives the same values (tested
# against plain peft in tests/hf/test_lora.py). Without low_cpu_mem_usage, the values peft drew
# are gone and wrap draws later in the stream: other values. init_lora_weights=False keeps what
# building drew; an embedding adapter's, dropped by peft, is drawn aside (other values, the
# stream after it as plain peft's).


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
               for fqn, m, names in found if _initializer(model, fqn, m, names) is None for k in names]
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
        init = _initializer(model, fqn, module, names)
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

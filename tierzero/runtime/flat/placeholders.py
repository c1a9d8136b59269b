"""Parameters that refuse to be read while they hold no data.

Outside its block's forward and backward a wrapped parameter is a placeholder: a one-element
zero-stride tensor of the right shape and dtype (flat_param.py), which refuses to be read
([Note: unfetched parameters])."""

from __future__ import annotations

import weakref
from typing import Any, Callable, Iterable, Protocol, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

_NAMES: dict[int, str] = {}
"""id(parameter) -> its name in the wrapped model (for messages), while the parameter lives."""
_HINTS: dict[int, str] = {}
"""id(parameter) -> what to change if the model reads it outside its block (a block_classes hint)."""
_CLASSES: dict[type, type] = {}
"""A parameter class -> its Unfetched subclass."""
_SOURCE_OF: dict[int, tuple["weakref.ref[ParamSource]", int]] = {}
"""id(parameter) -> (what it consults, its index there), while the parameter lives."""


class ParamSource(Protocol):
    """What an unfetched parameter consults (its FlatParam's FlatSource): where `p.grad` reads its
    gradient, and what hears that the parameter was set to require a gradient or not."""

    def grad_view(self, index: int) -> torch.Tensor | None: ...

    def requires_grad_set(self, index: int, requires_grad: bool) -> None: ...

    def grad_set_none(self, index: int) -> None: ...


def _descriptors(names: tuple[str, ...], part: str) -> set[Any]:
    return {getattr(getattr(torch.Tensor, n), part) for n in names if hasattr(torch.Tensor, n)}


METADATA: set[Any] = (
    _descriptors(("shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "grad_fn", "layout", "ndim",
                  "names", "is_cuda", "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_mkldnn", "is_nested",
                  "itemsize", "nbytes", "output_nr", "_version", "_backward_hooks",
                  "_post_accumulate_grad_hooks", "retains_grad", "_base"), "__get__")
    | _descriptors(("requires_grad", "grad", "data", "_backward_hooks", "_post_accumulate_grad_hooks"), "__set__")
    | {getattr(torch.Tensor, n) for n in (
        "size", "dim", "numel", "nelement", "element_size", "stride", "storage_offset", "is_contiguous",
        "is_floating_point", "is_complex", "is_signed", "data_ptr", "requires_grad_", "register_hook",
        "register_post_accumulate_grad_hook", "retain_grad", "__len__", "get_device", "is_pinned", "is_shared",
        "is_inference", "__hash__", "__dir__", "__setstate__", "_is_view", "dim_order") if hasattr(torch.Tensor, n)}
    | {torch.is_floating_point, torch.is_complex, torch.numel, torch._has_compatible_shallow_copy_type,
       torch.autograd.grad, torch.autograd.backward})
"""What a placeholder answers: its metadata, never its values (autograd's calls that name
parameters as the inputs to differentiate for)."""
_GRAD = torch.Tensor.grad.__get__
"""`p.grad`: a gradient kept apart may stand behind it ([Note: gradients seen through p.grad])."""
_GRAD_SET = torch.Tensor.grad.__set__
_HEARD = {_GRAD, _GRAD_SET, torch.Tensor.requires_grad.__set__, torch.Tensor.requires_grad_}
"""What the parameter's flat tensor answers (`p.grad`) or hears of (`p.grad = None`:
model.zero_grad(); `requires_grad` set: a parameter frozen at wrap unfrozen)."""
_VIEWS = {torch.Tensor.detach, torch.Tensor.data.__get__}
"""What gives an UnfetchedTensor (a state dict's values until its hook replaces them)."""
_CONVERSIONS = {torch.Tensor.to, torch.Tensor.half, torch.Tensor.float, torch.Tensor.double,
                torch.Tensor.bfloat16, torch.Tensor.cuda, torch.Tensor.cpu, torch.Tensor.type}
"""What nn.Module.to / .half() / .cuda() / .type() call on each parameter."""
_TARGET_DTYPE = {torch.Tensor.half: torch.float16, torch.Tensor.float: torch.float32,
                 torch.Tensor.double: torch.float64, torch.Tensor.bfloat16: torch.bfloat16}


# [Note: unfetched parameters]
# A placeholder read as it is would give zeros, silently. So while FREE a parameter's class is a
# subclass of its own (`Unfetched<Class>`, made once per class, as torch's parametrizations make
# a module's) whose `__torch_function__` lets through what needs no data (shape, dtype, device,
# requires_grad, grad, hooks, ...) and refuses everything else with an error naming the parameter
# and the ways to read it (`tz.gathered_params`, `model.state_dict()`). `p.data` and `p.detach()`
# give an `UnfetchedTensor` that refuses the same way (a state dict's values are replaced by the
# real ones before the caller sees them). A conversion (`model.to(dtype)`, `.half()`,
# `.to(device)`) is refused naming Config.compute_dtype, unless it changes nothing. When the
# block is fetched the parameter gets its own class back: a forward runs on plain parameters, at
# no cost. The class is the only state on the parameter; its name and its flat tensor are kept in
# side tables. The flat tensor answers `p.grad` (a GradView where it holds a gradient: [Note:
# gradients seen through p.grad] in grad_views.py) and hears `requires_grad` set, so that a
# parameter frozen at wrap and unfrozen is taken in before the next forward (wrapping.refresh).
class _Unfetched:
    """The behaviour of an unfetched parameter (see [Note: unfetched parameters])."""

    _plain: type
    """The class the parameter has while fetched."""

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in METADATA or (func is torch.Tensor.type and len(args) == 1 and not kwargs):
            with torch._C.DisableTorchFunctionSubclass():
                out = func(*args, **kwargs)
                if func not in _HEARD:
                    return out
                requires_grad = args[0].requires_grad
            source, index = _source_of(args[0])
            if source is None:
                return out
            if func == _GRAD:
                return source.grad_view(index) if out is None else out
            if func == _GRAD_SET:
                if args[1] is None:
                    source.grad_set_none(index)
            else:
                source.requires_grad_set(index, requires_grad)
            return out
        this = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, _Unfetched))
        if func in _VIEWS:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs).as_subclass(UnfetchedTensor)
        if func in _CONVERSIONS and _changes_nothing(func, this, args[1:], kwargs):
            return this
        raise _refusal(func, this, args[1:], kwargs)


class UnfetchedTensor(_Unfetched, torch.Tensor):
    """`p.data` or `p.detach()` of an unfetched parameter: refuses to be read like it."""

    _plain = torch.Tensor


def guard(params: Sequence[nn.Parameter], names: Sequence[str], source: ParamSource | None = None) -> None:
    """The parameters now hold placeholders: reads are refused from here on; `names`: theirs in
    the wrapped model; `source`: what they consult (each at its index in `params`), which
    answers `p.grad` and hears of `requires_grad` set."""
    for index, (p, name) in enumerate(zip(params, names, strict=True)):
        if id(p) not in _NAMES:
            weakref.finalize(p, _forget, id(p))
        _NAMES[id(p)] = name
        if source is not None:
            _SOURCE_OF[id(p)] = (weakref.ref(source), index)
        if not isinstance(p, _Unfetched):
            p.__class__ = _unfetched_class(type(p))


def hint(p: nn.Parameter, text: str) -> None:
    """Said when `p` is refused: how to choose blocks if the model reads it outside its block."""
    if id(p) not in _HINTS:
        weakref.finalize(p, _HINTS.pop, id(p), None)
    _HINTS[id(p)] = text


def _source_of(p: torch.Tensor) -> tuple[ParamSource | None, int]:
    ref, index = _SOURCE_OF.get(id(p), (None, 0))
    return (ref() if ref is not None else None), index


def unguard(params: Iterable[nn.Parameter]) -> None:
    """The parameters hold real data (fetched, or values being loaded): their own classes again."""
    for p in params:
        if isinstance(p, _Unfetched):
            p.__class__ = type(p)._plain


def _forget(key: int) -> None:
    _NAMES.pop(key, None)
    _SOURCE_OF.pop(key, None)


def _unfetched_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"Unfetched{cls.__name__}", (_Unfetched, cls), {"_plain": cls, "__module__": __name__})
    return _CLASSES[cls]


def _target(func: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, Any]:
    """(device, dtype) a conversion asks for (None: unchanged)."""
    if func in _TARGET_DTYPE:
        return None, _TARGET_DTYPE[func]
    if func is torch.Tensor.cpu:
        return torch.device("cpu"), None
    if func is torch.Tensor.cuda:
        return torch.device("cuda"), None
    if func is torch.Tensor.type:
        return None, args[0] if args else kwargs.get("dtype")
    with torch._C.DisableTorchFunctionSubclass():
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
    return device, dtype


def _changes_nothing(func: Callable[..., Any], t: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the conversion `func(t, *args, **kwargs)` would return `t` itself."""
    device, dtype = _target(func, args, kwargs)
    with torch._C.DisableTorchFunctionSubclass():
        same_device = device is None or (device.type == t.device.type and device.index in (None, t.device.index))
        return same_device and (dtype is None or dtype == t.dtype)


def _refusal(func: Callable[..., Any], t: torch.Tensor, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Exception:
    what = getattr(func, "__name__", str(func))
    name = _NAMES.get(id(t))
    about = (f"parameter {name!r}" if name is not None else
             f"a tensor of shape {tuple(t.shape)} taken from a tierzero-wrapped parameter (p.data / p.detach())")
    if func in _CONVERSIONS:
        device, dtype = _target(func, args, kwargs)
        to = " and ".join(str(x) for x in (dtype, device) if x is not None)
        return ValueError(
            f"converting {about} to {to} ({what}(), as model.to() / .half() / .cuda() do) after tz.wrap: a wrapped "
            "model's parameters live on tierzero's tiers and compute in Config.compute_dtype, which a conversion "
            "would not change. Choose the dtype with tz.Config(compute_dtype=...) (the values' dtype with "
            "from_pretrained(..., dtype=...)) when wrapping, and let tierzero place the model on its device")
    return RuntimeError(
        f"{about} is not fetched: outside its block's forward and backward a tierzero-wrapped parameter holds "
        f"no values (it lives on its tier), so {what}() on it was refused instead of reading zeros. Read or "
        "change it inside `with tz.gathered_params(model, modules, writable=...):`, read values with "
        "model.state_dict(), write them with model.load_state_dict(); a peft merge: "
        "tz.save_pretrained(model, DIR, merge_adapters=True)" + (f"; {_HINTS[id(t)]}" if id(t) in _HINTS else ""))

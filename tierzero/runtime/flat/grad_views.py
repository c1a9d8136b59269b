"""`GradView`: what `p.grad` of an unfetched wrapped parameter gives while its flat gradient
holds a gradient for it: a stand-in that torch's clipping works through
([Note: gradients seen through p.grad])."""

from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_leaves

from tierzero.runtime.flat.grads import FlatGrad
from tierzero.runtime.flat.placeholders import METADATA

_SOURCES: dict[int, tuple[FlatGrad, int, str, bool]] = {}
"""id(view) -> (its flat gradient, the parameter's index there, the parameter's name, refused),
while the view lives."""


# [Note: gradients seen through p.grad]
# A wrapped parameter's gradient lives in its block's FlatGrad, this rank's shard, on its tier;
# `p.grad` itself stays None. torch.nn.utils.clip_grad_norm_ (and Accelerate's, which calls it)
# reads `p.grad` and, finding None everywhere, would return 0.0 and clip nothing. So `p.grad` of
# an unfetched parameter (its `__torch_function__` sees the read: placeholders.py) gives, where
# torch's would not be None, a `GradView`: a zero-stride tensor of the parameter's shape, dtype
# and device that answers what torch's clipping asks of a gradient, the way tz.clip_grad_norm_
# answers it, and refuses everything else naming the parameter:
#
#     vector_norm, norm, _foreach_norm   the parameter's norm, from the norms backward computed
#                                        as it wrote the gradient (FlatGrad.norms, fp32): the
#                                        total torch builds from them, in the model's parameter
#                                        order, is tz.clip_grad_norm_'s, bit for bit
#     mul_, _foreach_mul_                FlatGrad.slots.scale: once every parameter of the flat
#                                        gradient has the same factor, its pending factor, as
#                                        tz.clip_grad_norm_ sets it (a subset: multiplied in)
#     clamp_, _foreach_clamp_min_/max_   FlatGrad.slots.clamp, in the stored bytes (clip_grad_value_)
#
# and `p.grad = None` (model.zero_grad()) forgets the parameter's gradient (FlatGrad.slots.forget),
# which model.zero_grad() would otherwise leave to be summed into by the next backward.
#
# With several ranks each holds a shard of every gradient: a parameter's norm would take a
# collective per parameter, so the norms are refused there, naming tz.clip_grad_norm_ (global);
# clamping is elementwise and works. Under Config.step_in_backward the blocks were updated with
# unclipped gradients: every view refuses, as tz.clip_grad_norm_ does. A view's operations wait
# for the overlapped step's updates; `p.grad` itself waits only where a zero_grad is queued behind
# its block's update (its answer comes after). Reading `p.grad` costs a forward nothing: a
# fetched parameter has its own class back, and wrap's own readers of autograd's `.grad` look
# past the view.
class GradView(torch.Tensor):
    """`p.grad` of an unfetched wrapped parameter (see [Note: gradients seen through p.grad])."""

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if func in METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in (torch.Tensor.data.__get__, torch.Tensor.detach):
            return args[0]
        handler = _HANDLERS.get(func)
        if handler is None:
            view = next(a for a in tree_leaves((args, kwargs)) if isinstance(a, GradView))
            raise _refusal(view, getattr(func, "__name__", str(func)))
        return handler(*args, **kwargs)


def view_of(grad: FlatGrad, index: int, name: str, placeholder: torch.Tensor, *,
            refused: bool = False) -> torch.Tensor | None:
    """What `p.grad` gives for parameter `index` of `grad` (named `name`), FREE on `placeholder`:
    None where torch's would be None (no gradient reached it since zero_grad). `refused`: the
    blocks are updated in backward (Config.step_in_backward), so there is never a gradient left
    to clip: a view that refuses to be clipped, saying so."""
    if not refused and index not in grad.reached():
        return None
    view = placeholder.as_subclass(GradView)
    _SOURCES[id(view)] = (grad, index, name, refused)
    weakref.finalize(view, _SOURCES.pop, id(view), None)
    return view


def _source(view: torch.Tensor) -> tuple[FlatGrad, int, str]:
    grad, index, name, refused = _SOURCES[id(view)]
    if refused:
        raise ValueError(f"clipping parameter {name!r}'s gradient (p.grad): the model was wrapped with "
                         "Config(step_in_backward=True), so its blocks were updated during backward with "
                         "unclipped gradients; wrap it with step_in_backward=False to clip gradients")
    grad.ctx.drain_updates()
    return grad, index, name


def _norm_of(view: torch.Tensor, norm_type: float) -> torch.Tensor:
    grad, index, name = _source(view)
    ctx = grad.ctx
    if ctx.world_size > 1:
        raise ValueError(
            f"rank {ctx.rank} of {ctx.world_size}: the norm of p.grad of parameter {name!r} (as "
            "torch.nn.utils.clip_grad_norm_ and accelerate's clip_grad_norm_ read it) was refused: with several "
            "ranks each holds only a shard of a tierzero-wrapped model's gradients, so one parameter's norm is not "
            "at hand. Clip with tz.clip_grad_norm_(model, max_norm), which returns the global norm")
    ctx.clips_with(float(norm_type))  # from now on backward computes the norms as it writes
    return grad.norms(float(norm_type))[index].to(view.device)


def _vector_norm(x: torch.Tensor, ord: float = 2.0, dim: Any = None, keepdim: bool = False, *,
                 dtype: Any = None, out: Any = None) -> torch.Tensor:
    if dim is not None or keepdim or dtype is not None or out is not None:
        raise _refusal(x, "vector_norm with dim, keepdim, dtype or out")
    return _norm_of(x, float(ord))


def _tensor_norm(x: torch.Tensor, p: Any = "fro", dim: Any = None, keepdim: bool = False,
                 dtype: Any = None) -> torch.Tensor:
    if dim is not None or keepdim or dtype is not None or (isinstance(p, str) and p != "fro"):
        raise _refusal(x, "norm with dim, keepdim, dtype or a matrix norm")
    return _norm_of(x, 2.0 if p == "fro" else float(p))


def _foreach_norm(tensors: list[torch.Tensor], ord: float = 2.0, dtype: Any = None) -> tuple[torch.Tensor, ...]:
    if dtype is not None:
        raise _refusal(next(t for t in tensors if isinstance(t, GradView)), "_foreach_norm with dtype")
    plain = [t for t in tensors if not isinstance(t, GradView)]
    with torch._C.DisableTorchFunctionSubclass():
        norms = iter(torch._foreach_norm(plain, ord) if plain else ())
    return tuple(_norm_of(t, float(ord)) if isinstance(t, GradView) else next(norms) for t in tensors)


_LAST_FACTOR: list[Any] = [None, None]
"""(the factor torch's clipping gave last, its fp32 CPU copy): one copy per clip, not per parameter."""


def _mul_(x: torch.Tensor, factor: Any) -> torch.Tensor:
    grad, index, name = _source(x)
    if isinstance(factor, torch.Tensor):
        if factor.numel() != 1:
            raise _refusal(x, "mul_ by a tensor of several elements")
        if _LAST_FACTOR[0] is not factor:
            with torch._C.DisableTorchFunctionSubclass():
                _LAST_FACTOR[:] = [factor, factor.detach().to("cpu", torch.float32).reshape(())]
        factor = _LAST_FACTOR[1]
    grad.slots.scale(index, factor if isinstance(factor, torch.Tensor) else float(factor))
    return x


def _clamp_(x: torch.Tensor, min: Any = None, max: Any = None) -> torch.Tensor:
    if isinstance(min, torch.Tensor) or isinstance(max, torch.Tensor):
        raise _refusal(x, "clamp_ to tensor bounds")
    grad, index, _ = _source(x)
    grad.slots.clamp(index, min, max)
    return x


def _foreach(op: Callable[..., None], each: Callable[[torch.Tensor, Any], Any]) -> Callable[..., None]:
    """A foreach op in place over tensors some of which are views: torch's op on the plain ones,
    `each(view, scalar)` on every view."""
    def run(tensors: list[torch.Tensor], scalar: Any) -> None:
        plain = [t for t in tensors if not isinstance(t, GradView)]
        if plain:
            with torch._C.DisableTorchFunctionSubclass():
                op(plain, scalar)
        for t in tensors:
            if isinstance(t, GradView):
                each(t, scalar)
    return run


_HANDLERS: dict[Any, Callable[..., Any]] = {
    torch.linalg.vector_norm: _vector_norm, torch.Tensor.norm: _tensor_norm, torch.norm: _tensor_norm,
    torch._foreach_norm: _foreach_norm, torch.Tensor.mul_: _mul_,
    torch._foreach_mul_: _foreach(torch._foreach_mul_, _mul_), torch.Tensor.clamp_: _clamp_,
    torch._foreach_clamp_min_: _foreach(torch._foreach_clamp_min_, lambda t, s: _clamp_(t, min=s)),
    torch._foreach_clamp_max_: _foreach(torch._foreach_clamp_max_, lambda t, s: _clamp_(t, max=s)),
}
"""What torch's clipping calls on gradients, and how a GradView answers it."""


def _refusal(view: torch.Tensor, what: str) -> Exception:
    found = _SOURCES.get(id(view))
    about = f"parameter {found[2]!r}" if found is not None else "a parameter"
    return RuntimeError(
        f"{what}() on p.grad of {about} of a tierzero-wrapped model was refused: its gradient lives in "
        "tierzero's flat shards on their tier, and p.grad stands for it only in torch's and accelerate's "
        "clip_grad_norm_ / clip_grad_value_ (its norm, a factor, a clamp). Clip with tz.clip_grad_norm_(model, "
        "max_norm); gradients are cleared by the tiered optimizer's zero_grad()")


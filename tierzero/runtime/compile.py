"""`tz.compile(model, **compile_kwargs)`: torch.compile over a wrapped model, block by block.

Each block's own computation (its module's `forward`) is compiled; the root's computation
(embeddings, final norm, head, loss) stays eager, and so do tierzero's hooks, which run around
the compiled forwards. The model is changed in place and returned (no OptimizedModule around it:
state dicts, checkpoints and the tiered optimizers see the same module). See [Note: compiled
blocks] for why and for what `torch.compile(model)` and `model.compile()` do instead.
"""

from __future__ import annotations

import types
import weakref
from typing import Any, Callable

import torch
from torch import nn

from tierzero.layout import ROOT
from tierzero.runtime.state import state_of

# [Note: compiled blocks]
# A wrapped parameter holds its values only between its block's pre-forward hook and its
# post-forward hook (a placeholder otherwise: [Note: unfetched parameters]). So the hooks, and
# the saved-tensor hooks of the root's forward, are `opaque` (activation_pack.py): dynamo never
# traces into them, it breaks the graph and calls them as Python. What dynamo then compiles is each
# block's forward, with the block fetched: its parameters enter the graph as inputs, guarded on
# shape, dtype and strides (the same on every fetch, whatever the device copy's address), so one
# compile serves every fetch and every block of the same shape (torchtitan compiles each
# transformer block under FSDP2 this way). The tensors the compiled forward saves for backward
# go through the root's saved-tensor hooks like eager ones: parameter views are rebuilt from the
# copy fetched for backward, activations are placed on their tier.
#
# tz.compile compiles each block's forward explicitly. `torch.compile(model)` and
# `model.compile()` reach the same graphs by themselves: dynamo meets the root's opaque hook,
# falls back to eager for that frame, the root's forward breaks at each block call (or skips,
# inside a loop), and each block's forward is compiled in its own frame. So does
# `block.compile(fullgraph=True)` on each block (torch runs a compiled module's hooks outside its
# graph). `fullgraph=True` over a region that spans blocks (the whole model, a Sequential of
# blocks) cannot hold the hooks between them: dynamo's error then carries
# activation_pack.OPAQUE_REASON, which names tz.compile(model, fullgraph=True).

_NO_CUDA_GRAPHS = ("reduce-overhead", "max-autotune")

_OWN_FORWARD: "weakref.WeakKeyDictionary[nn.Module, Callable[..., Any] | None]" = weakref.WeakKeyDictionary()
"""A block module compiled by tz.compile -> the forward its instance had before (None: its class's,
bound again when needed, so that the table holds no reference to the module)."""


def compile(model: nn.Module, **compile_kwargs: Any) -> nn.Module:  # noqa: A001 (torch's name)
    """Compile each block's forward of a wrapped model with `torch.compile(**compile_kwargs)`,
    tierzero's hooks outside the graphs (see the module docstring); returns `model`.

    Compiling again replaces the earlier compile (with the new arguments). Raises ValueError
    for a model that is not wrapped, and for CUDA graphs (mode "reduce-overhead" or
    "max-autotune", options {"triton.cudagraphs": True}): a block's parameters are a new device
    copy on every fetch, which a recorded graph would not follow.
    """
    state = state_of(model)
    _check_kwargs(compile_kwargs)
    for block in state.blocks:
        if block.name == ROOT:  # its forward calls the other blocks: see [Note: compiled blocks]
            continue
        for module in block.modules:
            module.forward = torch.compile(_original_forward(module), **compile_kwargs)
    return model


def _original_forward(module: nn.Module) -> Callable[..., Any]:
    if module not in _OWN_FORWARD:
        _OWN_FORWARD[module] = module.__dict__.get("forward")
    own = _OWN_FORWARD[module]
    return own if own is not None else types.MethodType(type(module).forward, module)


def _check_kwargs(kwargs: dict[str, Any]) -> None:
    mode = kwargs.get("mode")
    options = kwargs.get("options") or {}
    if mode in _NO_CUDA_GRAPHS or options.get("triton.cudagraphs"):
        given = f"mode={mode!r}" if mode in _NO_CUDA_GRAPHS else "options={'triton.cudagraphs': True}"
        raise ValueError(
            f"tz.compile: {given} turns on CUDA graphs, which replay the device addresses they recorded, while a "
            "tierzero block's parameters are a new device copy on every fetch. Expected a mode without CUDA "
            "graphs: mode='max-autotune-no-cudagraphs' (the same kernels) or the default")

"""Activation checkpointing by tierzero (Config.activation_checkpointing): each block call keeps
only its input and runs its forward again in backward, as torch.utils.checkpoint's
non-reentrant mode does, without the user wrapping modules."""

from __future__ import annotations

import contextlib
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from tierzero.runtime.activation_pack import ActivationPack, SavedActivation
from tierzero.runtime.activations import Activations


class _Saved(NamedTuple):
    """What the forward saved at one number: the recompute must save the same."""

    shape: torch.Size
    dtype: torch.dtype


class _Input(NamedTuple):
    """A tensor input of the call: placed in the frame's pack (`slot`) or kept (`tensor`)."""

    slot: SavedActivation | None
    tensor: torch.Tensor | None
    requires_grad: bool


# [Note: recompute frames]
# A block call's pre-forward opens a `Frame`. The call's tensor inputs (as the block's own hook
# passes them on: what autograd propagates to) go into an ActivationPack of their own, sealed at
# once so that the writer places them (Config.activations) while the block computes; the random
# generators' states and the autocast state are kept. During the call's forward every tensor
# autograd saves gets a `SavedActivation` numbered in save order, and nothing is kept. The first
# unpack in backward runs the call again, `module(*args, **kwargs)` with the inputs restored from
# the pack: the block is held for its backward then, so its hooks treat the call as a recompute
# (blocks.py). Saved-tensor hooks keep what the recompute saves, number by number, and each
# unpack takes its tensor. A recompute that saves other shapes or dtypes than the forward did (a
# mutable object passed in, such as a transformers cache; control flow that changed) raises, as
# torch's determinism check does, instead of giving wrong gradients. The frame, what it
# recomputed and its input pack are freed when autograd drops its last record, or at the block
# call's post-backward.
class Frame:
    """One block call under activation checkpointing (see [Note: recompute frames])."""

    def __init__(self, store: Activations, block: str, module: nn.Module, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> None:
        self.store = store
        self.block = block
        self.module = module
        self.pack: ActivationPack = store.new_pack(block)
        leaves, self._spec = tree_flatten((args, kwargs))
        self._leaves: list[Any] = []
        for x in leaves:
            if isinstance(x, torch.Tensor):
                slot = self.pack.save(x, False)
                self._leaves.append(_Input(slot, x if slot is None else None, x.requires_grad))
            else:
                self._leaves.append(x)
        store.seal(self.pack)
        device = store.device
        self._cuda = [device] if device.type == "cuda" else []
        self._rng = torch.get_rng_state()
        self._cuda_rng = [torch.cuda.get_rng_state(d) for d in self._cuda]
        self._autocast = [(d, torch.is_autocast_enabled(d), torch.get_autocast_dtype(d))
                          for d in dict.fromkeys(("cpu", device.type))]
        self._autocast_cache = torch.is_autocast_cache_enabled()
        self._saved: list[_Saved] = []
        self._recomputed: dict[int, torch.Tensor] | None = None
        self._live = 0
        self.freed = False

    @property
    def saves(self) -> int:
        """Tensors the call's forward saved so far."""
        return len(self._saved)

    def save(self, t: torch.Tensor, param_view: bool) -> SavedActivation:
        """Every tensor the call's forward saves, parameters' views too: the recompute brings it back."""
        self._saved.append(_Saved(t.shape, t.dtype))
        self._live += 1
        return SavedActivation(self, len(self._saved) - 1)

    def unpack(self, index: int) -> torch.Tensor:
        if self.freed:
            raise RuntimeError(
                f"tierzero: backward needs an activation of {self.block!r} after the block's backward freed its "
                "recompute; a second backward through the same graph (retain_graph=True) is not supported with "
                "Config.activation_checkpointing")
        if self._recomputed is None:
            self._recomputed = self._recompute()
        return self._recomputed.pop(index)

    def _recompute(self) -> dict[int, torch.Tensor]:
        leaves = [self._restore(x) if isinstance(x, _Input) else x for x in self._leaves]
        args, kwargs = tree_unflatten(leaves, self._spec)
        kept: dict[int, torch.Tensor] = {}

        def keep(t: torch.Tensor) -> None:
            kept[len(kept)] = t

        def never(packed: Any) -> torch.Tensor:
            raise AssertionError("the recompute's own graph is never run backward")

        with torch.profiler.record_function(f"tierzero::recompute {self.block}"), \
                torch.random.fork_rng(devices=self._cuda, device_type=self.store.device.type), \
                contextlib.ExitStack() as stack:
            torch.set_rng_state(self._rng)
            for device, state in zip(self._cuda, self._cuda_rng):
                torch.cuda.set_rng_state(state, device)
            for device_type, enabled, dtype in self._autocast:
                stack.enter_context(torch.autocast(device_type, dtype=dtype, enabled=enabled,
                                                   cache_enabled=self._autocast_cache))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(torch.autograd.graph.saved_tensors_hooks(keep, never))
            self.module(*args, **kwargs)
        self._check(kept)
        return kept

    def _restore(self, x: _Input) -> torch.Tensor:
        t = x.slot.unpack() if x.slot is not None else x.tensor
        assert t is not None
        return t.detach().requires_grad_(x.requires_grad)

    def _check(self, kept: dict[int, torch.Tensor]) -> None:
        again = [_Saved(t.shape, t.dtype) for t in kept.values()]
        if again == self._saved:
            return
        first = next((i for i, (a, b) in enumerate(zip(self._saved, again)) if a != b), min(len(again), len(self._saved)))
        was = self._saved[first] if first < len(self._saved) else "nothing"
        now = again[first] if first < len(again) else "nothing"
        raise RuntimeError(
            f"tierzero: activation checkpointing recomputed {self.block!r} and it saved {len(again)} tensors where "
            f"its forward saved {len(self._saved)}; tensor {first} was {was}, is {now}. The block's forward must "
            "repeat itself from its inputs: a mutable object passed to it (a transformers cache: call the model with "
            "use_cache=False when training), control flow on state that changed, or randomness outside torch's "
            "generators makes it differ; fix that, or use Config(activation_checkpointing=False)")

    def slot_died(self) -> None:
        self._live -= 1
        if self._live == 0:
            self.free()

    def free(self) -> None:
        """Drop what the frame holds (idempotent; safe from a finalizer); its pack goes too."""
        if self.freed:
            return
        self.freed = True
        self._recomputed = None
        self._leaves = []
        self.pack.free()

    def __repr__(self) -> str:
        return f"Frame({self.block!r}, {len(self._saved)} saved, {self.pack!r}, freed={self.freed})"

"""Activation bytes of a model at a batch and sequence length, and the largest batch x sequence
each activation placement fits in the budgets (`tierzero estimate --batch B --seq S`).
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tierzero.config import TIER_NAMES, Config
from tierzero.layout import ROOT, PackLayout, blocks_of, saved_span

# [Note: measuring activations]
# The bytes are measured, not modelled: one forward and loss of the model on fake tensors
# (torch's FakeTensorMode: shapes, dtypes, devices and storages, no memory, no arithmetic) with the
# saved-tensor hooks the runtime uses, each block call's saves packed by the same layout
# (tierzero.layout.PackLayout). Fake tensors on the device, not on the meta device, because which
# kernel runs, and so what it saves, depends on the device: on a CPU, scaled_dot_product_attention
# picks its flash kernel (a few bytes per token) where a meta tensor would take the math path and
# save the whole attention matrix. What the caller's loss saves after the model's forward returns
# is counted apart (`after`): on the device, out of the runtime's sight, whose hooks cover the
# model's forward. Measured at `seq` and `2 seq`, each figure is fitted as
# a*seq + b*seq^2 (b is zero where attention memory is linear); bytes are linear in the batch.

Loss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
"""What one training step computes: the loss of (model, inputs, targets)."""

PLACEMENTS = ("device", "host", "nvme", "auto")


@dataclass(frozen=True)
class ActivationBytes:
    """What one forward at `batch` x `seq` saves for backward, in bytes (see [Note: measuring activations])."""

    batch: int
    seq: int
    per_call: list[tuple[str, int]]
    """(block, bytes) of every block call, in forward order: one pack each."""
    inputs: list[tuple[str, int]]
    """(block, bytes of its inputs) per call: what activation checkpointing keeps."""
    outside: int
    """Saved in the model's forward outside every block (the head's): stays on the device."""
    after: int = 0
    """Saved by the caller after the model's forward returned (its loss, when the model does not
    compute it): on the device, out of the runtime's sight."""

    @property
    def blocks(self) -> int:
        return sum(n for _, n in self.per_call)

    @property
    def largest(self) -> int:
        return max((n for _, n in self.per_call), default=0)

    def kept(self, checkpointing: bool) -> int:
        """Bytes kept from forward to backward by the block calls."""
        return sum(n for _, n in (self.inputs if checkpointing else self.per_call))

    def need(self, placement: str, checkpointing: bool, *, prefetch: int = 2, micro_batches: int = 1) -> dict[str, int]:
        """Bytes each tier needs for the activations under a placement: the loss head's stay on
        the device; "device" keeps every call's there, "host" and "nvme" keep them on their tier
        and need `prefetch` of them on the device in backward (the block's own and the next,
        fetched ahead), "nvme" also a host copy of each pack being written; with checkpointing
        one block's whole activations are recomputed on the device at a time. `micro_batches`
        k > 1 (tz.accumulate): k of everything kept, and k - 1 block inputs on the device, those
        of the micro-batches parked between two blocks ([Note: layer-major schedule])."""
        k = micro_batches
        packs = self.inputs if checkpointing else self.per_call
        one = max((n for _, n in packs), default=0)
        need = dict.fromkeys(TIER_NAMES, 0)
        need["device"] = k * (self.outside + self.after) + (self.largest if checkpointing else 0)
        need["device"] += (k - 1) * max((n for _, n in self.inputs), default=0)
        if placement == "device":
            need["device"] += k * self.kept(checkpointing)
        else:
            need["device"] += prefetch * one
            need[placement] += k * self.kept(checkpointing)
            if placement == "nvme":
                need["host"] += prefetch * one
        return need


@dataclass(frozen=True)
class ActivationModel:
    """Activation bytes as a function of batch and sequence: measured at (batch, seq) and
    (batch, 2 seq), each figure fitted as a*seq + b*seq^2 per row of the batch."""

    at: ActivationBytes
    twice: ActivationBytes

    def scaled(self, batch: int, seq: int) -> ActivationBytes:
        s = self.at.seq

        def fit(n1: int, n2: int) -> int:
            quad = (n2 - 2 * n1) / (2 * s * s)  # n(S) = a S + b S^2 per batch of at.batch rows
            lin = n1 / s - quad * s
            return max(0, round((lin * seq + quad * seq * seq) * batch / self.at.batch))

        return ActivationBytes(
            batch, seq, [(b, fit(n1, n2)) for (b, n1), (_, n2) in zip(self.at.per_call, self.twice.per_call)],
            [(b, fit(n1, n2)) for (b, n1), (_, n2) in zip(self.at.inputs, self.twice.inputs)],
            fit(self.at.outside, self.twice.outside), fit(self.at.after, self.twice.after))

    def largest(self, fits: Callable[[ActivationBytes], bool], *, vary: str) -> int:
        """The largest batch (vary="batch", at this seq) or seq (vary="seq", at this batch) whose
        activations `fits` accepts; 0 when not even one fits."""
        def ok(n: int) -> bool:
            return fits(self.scaled(n, self.at.seq) if vary == "batch" else self.scaled(self.at.batch, n))

        lo, hi = 0, 1
        while ok(hi):
            lo, hi = hi, hi * 2
            if hi > 1 << 24:
                return lo
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if ok(mid) else (lo, mid)
        return lo


def measure_activations(model: nn.Module, config: Config, loss: Loss, *, batch: int, seq: int,
                        device: torch.device | str = "cpu") -> ActivationBytes:
    """The activation bytes of one step of `model` (any device, meta included: it is copied to
    fake tensors) at `batch` x `seq` tokens, computing in `config`'s compute dtype on `device`."""
    device = torch.device(device)
    with fake_model(model, config, device) as (fake, params):
        scopes = _Scopes(fake, config, params, device)
        ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
        with torch.autograd.graph.saved_tensors_hooks(scopes.save, lambda x: x):
            loss(fake, ids, ids)
        scopes.remove()
    return ActivationBytes(batch, seq, scopes.per_call, scopes.inputs, scopes.outside.finish(), scopes.after.finish())


def activation_model(model: nn.Module, config: Config, loss: Loss, *, batch: int, seq: int,
                     device: torch.device | str = "cpu") -> ActivationModel:
    """`measure_activations` at `seq` and `2 seq` (see ActivationModel)."""
    at = measure_activations(model, config, loss, batch=batch, seq=seq, device=device)
    twice = measure_activations(model, config, loss, batch=batch, seq=2 * seq, device=device)
    return ActivationModel(at, twice)


@contextlib.contextmanager
def fake_model(model: nn.Module, config: Config, device: torch.device) -> Iterator[tuple[nn.Module, set[int]]]:
    """Under a FakeTensorMode: a copy of `model` whose parameters (in `config`'s compute dtype)
    and buffers are fake tensors on `device`, and the ids of its parameters' storages."""
    dtype = getattr(torch, config.compute_dtype_name(cuda=device.type == "cuda"))
    shell = _shell_copy(model)
    with FakeTensorMode(allow_non_fake_inputs=True), _ShapeOnlyFakes():
        fake = _fake_copy(shell, device, dtype)
        yield fake, {id(p.untyped_storage()) for p in fake.parameters()}


# [Note: fake kernels narrower than the real ones]
# aten._grouped_mm's fake kernel (transformers' fused MoE experts: Qwen3-MoE, OLMoE, Mixtral)
# checks the CUDA kernel's rules whatever the device: bf16 inputs only, rows 16-byte aligned. The
# CPU kernel, and CUDA's fallback in transformers, also multiply fp32 and any widths, so an fp32
# MoE stopped the measurement there. `_ShapeOnlyFakes` gives such an op's output from its shape
# rule alone, in the dtype the real kernel gives (`out_dtype`, by default the inputs'): the bytes
# made, and the inputs autograd saves, are the real op's. It sits under every other mode of the
# measurement (they see the op once, with its real dtypes); the real kernel checks at the run.


def _grouped_mm_out(mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None = None,
                    bias: torch.Tensor | None = None, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """aten._grouped_mm's output: the shape rule of torch's own fake kernel, without its checks."""
    if mat_a.dim() == 2 and mat_b.dim() == 2:
        assert offs is not None, "aten._grouped_mm of two 2-d matrices takes offs"
        shape = (offs.size(0), mat_a.size(0), mat_b.size(1))
    elif mat_a.dim() == 2:
        shape = (mat_a.size(0), mat_b.size(-1))
    elif mat_b.dim() == 2:
        shape = (mat_a.size(1), mat_b.size(1))
    else:
        shape = (mat_a.size(0), mat_a.size(1), mat_b.size(-1))
    return torch.empty(shape, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


_SHAPE_ONLY_FAKES: dict[Any, Callable[..., torch.Tensor]] = {torch.ops.aten._grouped_mm.default: _grouped_mm_out}


class _ShapeOnlyFakes(TorchDispatchMode):
    """The ops whose fake kernel refuses inputs the real kernel takes, given by their shape rule
    (see [Note: fake kernels narrower than the real ones])."""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        rule = _SHAPE_ONLY_FAKES.get(func)
        return func(*args, **(kwargs or {})) if rule is None else rule(*args, **(kwargs or {}))


def _shell_copy(model: nn.Module) -> nn.Module:
    """A copy of `model`'s modules sharing its parameters and buffers (`_fake_copy` replaces
    them), made outside any FakeTensorMode: under one, deepcopy turns every other tensor a
    module keeps as a plain attribute (transformers' rotary embeddings keep `original_inv_freq`)
    into a fake tensor, which cannot be deep-copied."""
    memo: dict[int, Any] = {id(t): t for t in (*model.parameters(), *model.buffers())}
    return copy.deepcopy(model, memo)


def _fake_copy(fake: nn.Module, device: torch.device, dtype: torch.dtype) -> nn.Module:
    """`fake` (a `_shell_copy`) with its parameters (in the compute dtype, ties kept) and
    buffers replaced by fake tensors on `device`; called under a FakeTensorMode."""
    made: dict[int, Any] = {}
    for module in fake.modules():
        for name, p in module._parameters.items():
            if p is not None:
                if id(p) not in made:
                    made[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype,
                                                           device=device), requires_grad=p.requires_grad)
                module._parameters[name] = made[id(p)]
        for name, b in module._buffers.items():
            if b is not None:
                module._buffers[name] = torch.zeros(b.shape, dtype=b.dtype, device=device)
    return fake.train()


class _Scopes:
    """Block calls as scopes of saved tensors, as the runtime counts them (blocks.py)."""

    def __init__(self, model: nn.Module, config: Config, params: set[int], device: torch.device) -> None:
        self.params = params
        self.device = device
        self.per_call: list[tuple[str, int]] = []
        self.inputs: list[tuple[str, int]] = []
        self.outside = PackLayout()
        self.after = PackLayout()
        self._in_forward = False
        self._open: list[tuple[str, PackLayout]] = []
        self._keep: list[Any] = []  # storages counted: their ids stay theirs
        self._handles = [model.register_forward_pre_hook(lambda m, args: self._root(True)),
                         model.register_forward_hook(lambda m, args, out: self._root(False), always_call=True)]
        for name, modules, _ in blocks_of(model, config):
            if name == ROOT:
                continue
            for module in modules:
                self._handles.append(module.register_forward_pre_hook(
                    lambda m, args, kwargs, name=name: self._enter(name, args, kwargs), with_kwargs=True))
                self._handles.append(module.register_forward_hook(lambda m, args, out: self._exit()))

    def _root(self, inside: bool) -> None:
        self._in_forward = inside

    def _add(self, layout: PackLayout, t: torch.Tensor) -> None:
        if t.layout is torch.strided and t.device == self.device and t.numel() > 0:
            storage = t.untyped_storage()
            self._keep.append(storage)
            layout.add(id(storage), 0, saved_span(t))

    def _enter(self, name: str, args: Any, kwargs: Any) -> None:
        inputs = PackLayout()
        for x in tree_leaves((args, kwargs)):
            if isinstance(x, torch.Tensor):
                self._add(inputs, x)
        self.inputs.append((name, inputs.finish()))
        self._open.append((name, PackLayout()))

    def _exit(self) -> None:
        name, layout = self._open.pop()
        self.per_call.append((name, layout.finish()))

    def save(self, t: torch.Tensor) -> torch.Tensor:
        if id(t.untyped_storage()) not in self.params:
            self._add(self._open[-1][1] if self._open else self.outside if self._in_forward else self.after, t)
        return t

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

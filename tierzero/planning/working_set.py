"""The device's working set of a step at a batch and sequence: what the step itself holds on the
device beside the state's tiers (the largest block's compute temporaries, the loss head's logits,
the activations the placement keeps there), the bytes `Config.device_reserve` sets aside."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tierzero.config import Config
from tierzero.layout import ROOT, blocks_of
from tierzero.planning.activations import Loss, fake_model, measure_activations

# [Note: measuring the working set]
# A step's device memory outside every budget is measured, like the activations ([Note:
# measuring activations]), by one forward, loss and backward on fake tensors on the device, with
# the live bytes of every storage an operator makes tracked to their peak (freed when their last
# reference goes, as the caching allocator frees them). What the tiers already hold is left out:
# the parameters are made before the count starts, each gradient is dropped once accumulated (the
# runtime moves it to the grads tier), and what a block call saves for backward is taken off the
# device at the save and made anew at the unpack, as activations="host" does. The peak left is
# the largest block's forward or backward temporaries (attention scores on a math kernel, the
# MLP's widened hidden states and their gradients), the loss head's logits and saves, and one
# block's activations fetched back: the room a step needs whatever the state's placement. The
# activations the placement keeps on the device are added from the activation bytes
# (ActivationBytes.need). At the run's batch and sequence exactly, no fit: fake tensors cost
# no memory, so the model's own shapes are measured.


@dataclass(frozen=True)
class WorkingSet:
    """Device bytes of one step at `batch` x `seq` outside every tier's budget."""

    batch: int
    seq: int
    peak: int
    """Peak live bytes with every block's saves off the device (see the note)."""
    activations: int
    """Block activations the Config's `activations` placement keeps on the device."""

    @property
    def reserve(self) -> int:
        """The bytes to give Config.device_reserve."""
        return self.peak + self.activations


def working_set(model: nn.Module, config: Config, loss: Loss, *, batch: int, seq: int,
                device: torch.device | str = "cpu", micro_batches: int = 1) -> WorkingSet:
    """The device's working set of a step of `model` (any device, meta included) at `batch` x
    `seq` (one rank's rows of a micro-batch; `micro_batches` k of them kept by tz.accumulate)
    computing in `config`'s dtype on `device` ([Note: measuring the working set]);
    `loss(model, inputs, targets)` is the step's loss. Give its `reserve` to
    `Config.device_reserve` before "auto" places the state:

        ws = working_set(model, cfg, loss, batch=8, seq=2048)
        cfg = cfg.replace(device_reserve=ws.reserve)   # or Config.auto(model, device_reserve=...)
    """
    if batch < 1 or seq < 1:
        raise ValueError(f"working_set: expected batch >= 1 and seq >= 1, got batch {batch}, seq {seq}")
    acts = measure_activations(model, config, loss, batch=batch, seq=seq, device=device)
    placement = config.activations if config.activations in ("device", "nvme") else "host"  # "auto": the least
    need = acts.need(placement, config.activation_checkpointing, micro_batches=micro_batches)["device"]
    return WorkingSet(batch, seq, measure_peak(model, config, loss, batch=batch, seq=seq, device=device),
                      max(0, need - acts.outside - acts.after))


def measure_peak(model: nn.Module, config: Config, loss: Loss, *, batch: int, seq: int,
                 device: torch.device | str = "cpu") -> int:
    """The peak live bytes of one step with block saves off the device ([Note: measuring the
    working set])."""
    device = torch.device(device)
    with fake_model(model, config, device) as (fake, params):
        hooks = [p.register_post_accumulate_grad_hook(_drop_grad) for p in fake.parameters() if p.requires_grad]
        offload = _Offload(fake, config, params)
        with _LiveBytes() as live:
            ids = torch.zeros(batch, seq, dtype=torch.long, device=device)
            with torch.autograd.graph.saved_tensors_hooks(offload.pack, offload.unpack):
                loss(fake, ids, ids).backward()
        offload.remove()
        for h in hooks:
            h.remove()
    return live.peak


def _drop_grad(p: torch.Tensor) -> None:
    p.grad = None


class _LiveBytes(TorchDispatchMode):
    """The peak of the bytes of the storages operators made that are still referenced."""

    def __init__(self) -> None:
        super().__init__()
        self.live: dict[int, tuple[StorageWeakRef, int]] = {}
        self.peak = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        given = {StorageWeakRef(t.untyped_storage()).cdata for t in tree_leaves((args, kwargs))
                 if isinstance(t, torch.Tensor) and t.layout is torch.strided}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.layout is torch.strided:  # a view or in-place result: not new
                if StorageWeakRef(t.untyped_storage()).cdata in given:
                    continue
                ref = StorageWeakRef(t.untyped_storage())
                held = self.live.get(ref.cdata)
                if held is None or held[0].expired():
                    self.live[ref.cdata] = (ref, t.untyped_storage().nbytes())
        self.live = {k: v for k, v in self.live.items() if not v[0].expired()}
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))
        return out


class _Offload:
    """Saved-tensor hooks that take what a block call saves off the device (its shape kept) and
    make it anew at the unpack; parameters and saves outside blocks stay."""

    def __init__(self, model: nn.Module, config: Config, params: set[int]) -> None:
        self.params = params
        self.depth = 0
        self._handles = []
        for name, modules, _ in blocks_of(model, config):
            if name != ROOT:
                for module in modules:
                    self._handles.append(module.register_forward_pre_hook(lambda m, a: self._enter(1)))
                    self._handles.append(module.register_forward_hook(lambda m, a, o: self._enter(-1)))

    def _enter(self, step: int) -> None:
        self.depth += step

    def pack(self, t: torch.Tensor) -> Any:
        if self.depth == 0 or id(t.untyped_storage()) in self.params or t.layout is not torch.strided:
            return t
        return (t.shape, t.dtype, t.device)

    def unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        shape, dtype, device = packed
        return torch.empty(shape, dtype=dtype, device=device)

    def remove(self) -> None:
        for h in self._handles:
            h.remove()

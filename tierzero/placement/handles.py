"""Typed handles of placed tensors: what a tensor is, without parsing its name.

The placement manager hands out one `TensorHandle` per registered tensor and takes it back at
`unregister`; every other call names the tensor by its handle. A handle says whose tensor it is
(`owner`: a block's FQN such as "layers.3" or "root", or any name for tensors registered outside
a model), what it is (`kind`), its shape, dtype and home tier. Its `name` exists for messages,
traces and checkpoints only; no module builds or parses one to learn what a tensor is.

Handles compare by identity: two registrations are two tensors even with equal fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

import torch

from tierzero.config import PAGE, Tier


class Kind(Enum):
    """What a placed tensor holds."""

    PARAM = "param"
    """A block's trainable parameters, flat, in the compute dtype (this rank's shard)."""
    FROZEN = "frozen"
    """A block's parameters with requires_grad=False, flat, in the compute dtype."""
    GRAD = "grad"
    """The gradient of a PARAM tensor (in the gradient dtype)."""
    MASTER = "master"
    """fp32 master weights of a PARAM tensor whose compute dtype is narrower than fp32."""
    EXP_AVG = "exp_avg"
    """AdamW's first moment."""
    EXP_AVG_SQ = "exp_avg_sq"
    """AdamW's second moment."""
    MOMENTUM = "momentum"
    """SGD's momentum buffer."""
    ACTIVATION = "activation"
    """The tensors autograd saved in one forward call of a block, packed as bytes (Config.activations)."""
    TENSOR = "tensor"
    """Anything else (tensors registered directly with a PlacementManager)."""

    @property
    def traffic(self) -> str:
        """The group NVMe traffic is counted under: params (trainable), frozen, grads, master,
        moments, activations or other. With fp32 parameters that double as the master weights, the
        optimizer's reads and writes of them count as params."""
        return _TRAFFIC[self]


_TRAFFIC = {Kind.PARAM: "params", Kind.FROZEN: "frozen", Kind.GRAD: "grads", Kind.MASTER: "master",
            Kind.EXP_AVG: "moments", Kind.EXP_AVG_SQ: "moments", Kind.MOMENTUM: "moments",
            Kind.ACTIVATION: "activations", Kind.TENSOR: "other"}
TRAFFIC_GROUPS = ("params", "frozen", "grads", "master", "moments", "activations", "other")


@dataclass(frozen=True, eq=False)
class TensorHandle:
    """One registered tensor (see the module docstring). Immutable; hashed by identity."""

    owner: str
    kind: Kind
    shape: torch.Size
    dtype: torch.dtype
    home: Tier
    nbytes: int = field(init=False)
    name: str = field(init=False)
    """For messages, traces and checkpoints: "layers.3.param"; the owner alone for TENSOR."""
    traffic: str = field(init=False)
    """Its kind's traffic group (Kind.traffic), read on every NVMe read and write."""
    io_bytes: int = field(init=False)
    """Bytes a buffer given to PlacementManager.read(h, out=...) must hold (NVMe regions are
    whole pages)."""

    def __post_init__(self) -> None:
        # computed once: the placement manager reads both on every acquire and release
        object.__setattr__(self, "nbytes", self.shape.numel() * self.dtype.itemsize)
        name = self.owner if self.kind is Kind.TENSOR else f"{self.owner}.{self.kind.value}"
        object.__setattr__(self, "name", name)
        object.__setattr__(self, "traffic", self.kind.traffic)
        object.__setattr__(self, "io_bytes", -(-self.nbytes // PAGE) * PAGE if self.home is Tier.NVME else self.nbytes)

    @property
    def staging(self) -> Tier:
        """The tier the CPU works on this tensor in: an NVMe home goes through host memory."""
        return Tier.HOST if self.home is Tier.NVME else self.home

    def __repr__(self) -> str:
        return (f"TensorHandle({self.name!r}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"home={self.home.value})")

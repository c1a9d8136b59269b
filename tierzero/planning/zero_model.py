"""Bytes a data-parallel rank holds and moves per step at each ZeRO stage: the ZeRO paper's model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import nn

from tierzero.config import KINDS, TIER_NAMES, Config
from tierzero.layout import ROOT, CommBytes, FlatLayout, ZeroStage, blocks_of


# [Note: the ZeRO paper's model]
# For Ψ parameters (Ψt of them trainable), N ranks, c bytes per compute-dtype parameter, g bytes
# per gradient element (Config.grad_dtype) and K bytes of optimizer state per trainable parameter
# (AdamW: fp32 master weights and two moments, K = 12; K = 8 where fp32 parameters double as the
# master weights: the same tier, and a rank holds only its shard of them; fewer in the formats of
# Config.optimizer_state_dtype and master_dtype, ElementBytes.per_param), a rank holds
#
#     stage   params   grads    optimizer states      the paper (bf16, Ψt = Ψ, K = 12)
#     1       cΨ       gΨt      KΨt/N                 2Ψ + 2Ψ + KΨ/N
#     2       cΨ       gΨt/N    KΨt/N                 2Ψ + (2 + K)Ψ/N
#     3       cΨ/N     gΨt/N    KΨt/N                 (2 + 2 + K)Ψ/N
#
# and each step (one backward) its collectives cover these bytes (tierzero.layout.CommBytes' unit: the
# gathered output, the reduced input):
#
#     stage 1   all-reduce gΨt (the gradients)         all-gather cΨt (the updated parameters)
#     stage 2   reduce-scatter gΨt                     all-gather cΨt
#     stage 3   reduce-scatter gΨt                     all-gather c(2Ψ - Ψk): every block before its
#               forward and again before its backward, except the block the forward releases last
#               (the root block when the model's own modules hold parameters), which stays
#               gathered for its backward (Ψk its parameters)
#
# i.e. about 2Ψ elements for stages 1 and 2 and 3Ψ for stage 3, none at N = 1; gradient
# accumulation repeats the reduction once per backward. A clipped step also all-reduces one fp32
# norm (4 bytes), left out here. On a ring an all-gather or a reduce-scatter sends (N - 1) / N of
# its bytes per rank and an all-reduce 2 (N - 1) / N, so stage 1 sends 1.5x what stage 2 does.
#
# Two figures per rank: `per_rank` is the model above with Ψ/N read as ⌈Ψ/N⌉ elements (exactly
# Ψ/N when N divides Ψ, as it does for every built-in model up to N = 64); `layout_per_rank` is
# what `tz.wrap` registers: each block's flat tensors aligned per parameter and padded to a
# multiple of N (tierzero.layout.FlatLayout), a fraction of a percent more.
@dataclass(frozen=True)
class StateSizes:
    """Bytes of each kind of training state (one rank's, or the whole model's)."""

    params: int
    grads: int
    optimizer_states: int

    @property
    def total(self) -> int:
        return self.params + self.grads + self.optimizer_states

    def as_dict(self) -> dict[str, int]:
        return {"params": self.params, "grads": self.grads, "optimizer_states": self.optimizer_states,
                "total": self.total}

    def by_tier(self, cfg: Config) -> dict[str, int]:
        """Bytes on each tier, as `cfg` places the kinds."""
        out = dict.fromkeys(TIER_NAMES, 0)
        for kind, nbytes in zip(KINDS, (self.params, self.grads, self.optimizer_states)):
            for tier, f in cfg.shares(kind).items():  # a split: its fractions of the bytes
                out[tier] += round(nbytes * f)
        return out


@dataclass(frozen=True)
class ZeroModel:
    """The per-rank memory and traffic of one ZeRO stage ([Note: the ZeRO paper's model])."""

    zero: ZeroStage
    compute_bytes: int
    """c: bytes per compute-dtype parameter."""
    grad_bytes: int
    """g: bytes per gradient element."""
    optimizer_bytes: float
    """K: bytes of optimizer state per trainable parameter."""

    @classmethod
    def of(cls, cfg: Config, world_size: int = 1, *, cuda: bool | None = None) -> "ZeroModel":
        """The model for training under `cfg` with tz.AdamW on `world_size` ranks."""
        cuda = torch.cuda.is_available() if cuda is None else cuda
        zero = ZeroStage(cfg.zero_stage, world_size)
        per = cfg.state_bytes_per_param(cuda=cuda, params_whole=zero.params_whole)
        return cls(zero, per.params, per.grads, per.optimizer_states)

    def per_rank(self, params: int, trainable: int) -> StateSizes:
        """Bytes one rank holds of `params` parameters, `trainable` of them trainable."""
        n = self.zero.world_size
        share = lambda count: -(-count // n)  # noqa: E731 - ⌈count / N⌉ elements
        return StateSizes(
            params=self.compute_bytes * (params if self.zero.params_whole else share(params)),
            grads=self.grad_bytes * (trainable if self.zero.grads_whole else share(trainable)),
            optimizer_states=round(self.optimizer_bytes * share(trainable)))

    def comm_per_step(self, counts: "ParamCounts", *, backwards: int = 1) -> CommBytes:
        """Bytes one rank's collectives cover in a step of `backwards` backward passes."""
        if self.zero.world_size == 1:
            return CommBytes()
        c = self.compute_bytes
        grads = backwards * self.grad_bytes * counts.trainable
        if self.zero.stage == 1:
            return CommBytes(all_gather=c * counts.trainable, all_reduce=grads)
        if self.zero.stage == 2:
            return CommBytes(all_gather=c * counts.trainable, reduce_scatter=grads)
        return CommBytes(all_gather=backwards * c * (2 * counts.params - counts.kept), reduce_scatter=grads)

    def layout_per_rank(self, model: nn.Module, cfg: Config) -> StateSizes:
        """Bytes one rank registers for `model`: the flat tensors of `tz.wrap(model, cfg)`,
        aligned and padded (tierzero.layout.FlatLayout), split as this stage splits them."""
        params = grads = optim = 0
        for _, _, block in blocks_of(model, cfg):
            for trainable in (True, False):
                ps = [(f, p) for f, p in block if p.requires_grad == trainable]
                if not ps:
                    continue
                layout = FlatLayout.build([f for f, _ in ps], [p.shape for _, p in ps], self.zero.world_size,
                                          itemsize=self.compute_bytes)
                whole, shard = layout.padded_numel, layout.shard_numel
                params += self.compute_bytes * (whole if self.zero.params_whole else shard)
                if trainable:
                    grads += self.grad_bytes * (whole if self.zero.grads_whole else shard)
                    optim += round(self.optimizer_bytes * shard)
        return StateSizes(params, grads, optim)


class ParamCounts(NamedTuple):
    """Parameters of a model as `tz.wrap(model, cfg)` groups them into blocks."""

    params: int
    """Ψ."""
    trainable: int
    """Ψt."""
    kept: int
    """Ψk: those of the block the forward releases last, which stays gathered for its
    backward: the root block when it holds any, else the last block ([Note: the ZeRO paper's model])."""
    root: int
    """The root block's."""


def param_counts(model: nn.Module, cfg: Config) -> ParamCounts:
    blocks = blocks_of(model, cfg)
    sizes = {name: sum(p.numel() for _, p in ps) for name, _, ps in blocks}
    kept = sizes[ROOT] or (sizes[blocks[-2][0]] if len(blocks) > 1 else 0)
    return ParamCounts(params=sum(sizes.values()),
                       trainable=sum(p.numel() for _, _, ps in blocks for _, p in ps if p.requires_grad),
                       kept=kept, root=sizes[ROOT])

"""AdamW and SGD: the update math of a tiered optimizer, torch's fused CPU kernels on each
chunk of a block's fp32 state (the same bits as torch.optim.AdamW / SGD with fused=True over the
same param groups)."""

from __future__ import annotations

import math
from typing import Any

import torch

from tierzero.optim.base import ParamsT, TieredOptimizer


class AdamW(TieredOptimizer):
    """torch.optim.AdamW (decoupled weight decay, bias correction) on tiered fp32 state, by torch's
    fused CPU kernel: one pass over memory where the elementwise ops take about eight, and the
    same bits as torch.optim.AdamW(fused=True). `params`: a wrapped model, or its parameters or
    param groups as torch takes them (each group may set lr, betas, eps, weight_decay)."""

    state_kinds = ("exp_avg", "exp_avg_sq")
    kernel = "adamw"

    def __init__(self, params: ParamsT, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.01) -> None:
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    def _check_group(self, group: dict[str, Any]) -> None:
        lr, betas, eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        if lr < 0 or eps < 0 or wd < 0 or len(betas) != 2 or not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"AdamW: expected lr, eps, weight_decay >= 0 and betas in [0, 1), got "
                             f"lr={lr}, betas={betas}, eps={eps}, weight_decay={wd}")

    def _row(self, group: dict[str, Any], step: int) -> tuple[float, ...]:
        # computed in double as torch's fused CPU kernel does, then single precision
        lr, (beta1, beta2), wd = float(group["lr"]), group["betas"], group["weight_decay"]
        return _single(1 - lr * wd, 1 - beta1, beta2, 1 - beta2, lr / (1 - beta1 ** step),
                       math.sqrt(1 - beta2 ** step), group["eps"])

    def _update(self, group: dict[str, Any], steps: list[int], grads: list[torch.Tensor],
                params: list[torch.Tensor], *states: list[torch.Tensor]) -> None:
        exp_avgs, exp_avg_sqs = states
        beta1, beta2 = group["betas"]
        counts = [torch.tensor(float(s), device=p.device) for s, p in zip(steps, params)]  # CUDA's kernel: on the device
        torch._fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, [], counts, lr=group["lr"], beta1=beta1,
                            beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                            amsgrad=False, maximize=False)


class SGD(TieredOptimizer):
    """torch.optim.SGD (momentum, weight decay; no dampening or Nesterov) by torch's fused CPU
    kernel: the same bits as torch.optim.SGD(fused=True). `params` as AdamW's (each group may
    set lr, momentum, weight_decay)."""

    kernel = "sgd"

    def __init__(self, params: ParamsT, lr: float, momentum: float = 0.0, weight_decay: float = 0.0) -> None:
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @property
    def state_kinds(self) -> tuple[str, ...]:  # type: ignore[override]
        """Momentum buffers once a group has momentum (registered then, zeros)."""
        return ("momentum",) if any(g["momentum"] for g in self.param_groups) else ()

    def _check_group(self, group: dict[str, Any]) -> None:
        lr, momentum, wd = group["lr"], group["momentum"], group["weight_decay"]
        if lr < 0 or momentum < 0 or wd < 0:
            raise ValueError(f"SGD: expected lr, momentum, weight_decay >= 0, got lr={lr}, "
                             f"momentum={momentum}, weight_decay={wd}")

    def _row(self, group: dict[str, Any], step: int) -> tuple[float, ...]:
        return _single(float(group["lr"]), group["weight_decay"], group["momentum"], float(group["momentum"] != 0))

    def _update(self, group: dict[str, Any], steps: list[int], grads: list[torch.Tensor],
                params: list[torch.Tensor], *states: list[torch.Tensor]) -> None:
        # On a parameter's first update its momentum buffer becomes the gradient (plus weight
        # decay); from zeros the later-step formula gives the same bits, so one call may mix.
        buffers = states[0] if states and group["momentum"] else []
        torch._fused_sgd_(params, grads, buffers, weight_decay=group["weight_decay"],
                          momentum=group["momentum"], lr=group["lr"], dampening=0.0, nesterov=False,
                          maximize=False, is_first_step=all(s == 1 for s in steps))


def _single(*values: float) -> tuple[float, ...]:
    """`values` rounded to single precision (the fused window kernel's hyper-parameters)."""
    return tuple(torch.tensor(values, dtype=torch.float32).tolist())

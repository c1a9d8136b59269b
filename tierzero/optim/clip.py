"""`tz.clip_grad_norm_`: torch.nn.utils.clip_grad_norm_ over a wrapped model's flat gradients,
from the norms backward computed as it wrote them (FlatGrad), global across ranks."""

from __future__ import annotations

import torch
from torch import nn

from tierzero import runtime
from tierzero.optim.base import flat_grad
from tierzero.runtime import FlatParam, global_norm


@torch.no_grad()
def clip_grad_norm_(model: nn.Module, max_norm: float, norm_type: float = 2.0,
                    error_if_nonfinite: bool = False) -> torch.Tensor:
    """torch.nn.utils.clip_grad_norm_ over a wrapped model's flat gradients: returns the total
    norm (fp32) on the model's compute device, where torch returns it for a model on that device,
    and scales the gradients by min(1, max_norm / (norm + 1e-6)) (applied lazily, when the
    optimizer or the next backward reads them). With several ranks the norm is the global one
    over every rank's gradient shard (a collective: every rank calls it).

    From the first call on, backward computes each block's norms as it writes the gradient, so
    later calls read no gradient (a different norm_type than the last call's reads once)."""
    state = runtime.state_of(model)
    state.ctx.drain_updates()
    if state.config.step_in_backward:
        raise ValueError("clip_grad_norm_: the model was wrapped with Config(step_in_backward=True), "
                         "so its blocks were updated during backward with unclipped gradients; "
                         "wrap it with step_in_backward=False to clip gradients")
    flats = [f for f in state.flat_params(trainable=True) if not flat_grad(f).empty]
    ctx = state.ctx
    ctx.clips_with(float(norm_type))
    if not flats:
        return torch.tensor(0.0, device=ctx.device)
    norms: dict[tuple[FlatParam, int], torch.Tensor] = {}
    for i, flat in enumerate(flats):
        if i + 1 < len(flats) and not flat_grad(flats[i + 1]).has_norms(float(norm_type)):
            flat_grad(flats[i + 1]).prefetch()
        unreached = flat_grad(flat).unreached()  # as torch, which leaves out p.grad None
        for j, n in enumerate(flat_grad(flat).norms(float(norm_type))):
            if j not in unreached:
                norms[flat, j] = n
    if ctx.world_size == 1:
        # The norm of the per-parameter norms in the model's parameter order, as torch computes
        # it: the same bits as torch.nn.utils.clip_grad_norm_(model.parameters()).
        total = torch.linalg.vector_norm(torch.stack([norms[k] for k in state.param_order if k in norms]), norm_type)
    else:
        total = global_norm(list(norms.values()), float(norm_type), ctx)
    if error_if_nonfinite and (total.isnan() or total.isinf()):
        raise RuntimeError(f"the total norm of order {norm_type} of the gradients is non-finite "
                           f"({total.item()}); pass error_if_nonfinite=False to clip anyway")
    # The factor is kept on the CPU: a 0-dim CPU tensor scales gradients on either tier, a
    # device one would refuse the host tier's gradients on CUDA.
    coef = torch.clamp(float(max_norm) / (total + 1e-6), max=1.0).cpu()
    for flat in flats:
        flat_grad(flat).scale_by(coef)
    return total.to(ctx.device)

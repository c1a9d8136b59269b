"""The next-token loss of a causal LM without the logits of the whole sequence
([Note: chunked loss]).

`causal_lm_loss` runs it on a transformers causal LM, inside the model's forward: a forward hook
on its decoder keeps the last hidden states, the model computes the logits of the last position
only (`logits_to_keep=1`), and a hook on the model computes the loss before the model's forward
returns and puts it in the output. On a tierzero-wrapped model the head's weight (a tied
embedding too) is therefore read while its block is held, the loss is an output of the root
module, so backward fetches the block again before the loss's backward reads the weight, and
the weight's gradient goes where every gradient of the block goes (early capture).
"""

from __future__ import annotations

import inspect
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch._subclasses.fake_tensor import is_fake

from tierzero.formats import base_model

CHUNK_BYTES = 32 << 20
"""The fp32 logits of one chunk, by default (`chunk=None`): about 170 tokens at GPT-2's vocabulary."""

_CHECKED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
"""Models whose last-position logits matched the plain head over the decoder's output."""


# [Note: chunked loss]
# A causal LM's head makes seq x vocabulary logits, and the loss over them keeps about three such
# tensors alive through backward (the fp32 logits, cross-entropy's log-probabilities, then their
# gradients): at GPT-2's 50257 tokens, 393 MiB each at seq 2048, more than the twelve blocks'
# activations placed elsewhere. `chunked_cross_entropy` takes the hidden states and the head's
# weight instead: forward computes the logits of `chunk` tokens at a time and keeps only each
# token's log-sum-exp; backward computes each chunk's logits again and turns them into the
# chunk's gradients, so one chunk's logits live at a time. The price is the head's matmul once
# more in backward. Numerically it is cross_entropy over `F.linear(hidden, weight, bias).float()`
# summed in another order (the same within fp32 rounding, not bit for bit).
def chunked_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          targets: torch.Tensor, *, ignore_index: int = -100, chunk: int | None = None,
                          num_items: torch.Tensor | int | None = None) -> torch.Tensor:
    """`F.cross_entropy(F.linear(hidden, weight, bias).float().flatten(0, -2), targets.flatten(),
    ignore_index=ignore_index)` (the mean over the targets that are not `ignore_index`), with the
    logits made `chunk` tokens at a time in forward and again in backward (see [Note: chunked
    loss]). `hidden`: (..., d); `targets`: its leading shape; `chunk` None: CHUNK_BYTES of logits.
    `num_items`: the sum over the targets divided by this instead (transformers' loss given
    `num_items_in_batch`: the targets of every batch a gradient accumulates)."""
    if targets.shape != hidden.shape[:-1]:
        raise ValueError(f"chunked_cross_entropy: targets of shape {tuple(targets.shape)} for hidden states of "
                         f"shape {tuple(hidden.shape)}; give one target per position")
    if chunk is None:
        chunk = max(1, CHUNK_BYTES // (4 * weight.shape[0]))
    if chunk < 1:
        raise ValueError(f"chunked_cross_entropy: chunk={chunk}; give a positive number of tokens")
    return _ChunkedCrossEntropy.apply(hidden.flatten(0, -2), weight, bias, targets.flatten(), ignore_index, chunk,
                                      num_items)


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.linear(hidden, weight, bias).float()


class _ChunkedCrossEntropy(torch.autograd.Function):
    """Saves the hidden states, the head (a tiered model's: references into its block) and each
    token's log-sum-exp; the logits are never saved."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                targets: torch.Tensor, ignore_index: int, chunk: int,
                num_items: torch.Tensor | int | None) -> torch.Tensor:
        valid = targets != ignore_index
        safe = torch.where(valid, targets, 0)
        lse = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, hidden.shape[0], chunk):
            logits = _logits(hidden[s:s + chunk], weight, bias)
            lse[s:s + chunk] = torch.logsumexp(logits, dim=1)
            picked = logits.gather(1, safe[s:s + chunk, None]).squeeze(1)
            total += torch.where(valid[s:s + chunk], lse[s:s + chunk] - picked, 0).sum()
        count = valid.sum() if num_items is None else torch.as_tensor(num_items, device=hidden.device)
        ctx.chunk = chunk
        ctx.save_for_backward(hidden, weight, bias, safe, valid, lse, count)
        return total / count

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, safe, valid, lse, count = ctx.saved_tensors
        want_h, want_w, want_b = ctx.needs_input_grad[:3]
        # weight and bias gradients add up over the chunks in fp32 whatever the compute dtype
        acc = torch.promote_types(weight.dtype, torch.float32)
        grad_h = torch.empty_like(hidden) if want_h else None
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device) if want_w else None
        grad_b = torch.zeros(bias.shape, dtype=acc, device=bias.device) if want_b else None
        scale = grad / count
        for s in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[s:s + ctx.chunk]
            # d loss / d logits = (softmax - one_hot(target)) * grad / count, on valid rows only
            d = _logits(h, weight, bias).sub_(lse[s:s + ctx.chunk, None]).exp_()
            rows = torch.arange(h.shape[0], device=d.device)
            d[rows, safe[s:s + ctx.chunk]] -= 1
            d.mul_(torch.where(valid[s:s + ctx.chunk], scale, 0)[:, None])
            d = d.to(weight.dtype)
            if grad_h is not None:
                torch.mm(d, weight, out=grad_h[s:s + ctx.chunk])
            if grad_w is not None:
                grad_w.addmm_(d.t().to(acc), h.to(acc))
            if grad_b is not None:
                grad_b += d.sum(0, dtype=acc)
        return (grad_h, grad_w.to(weight.dtype) if grad_w is not None else None,
                grad_b.to(bias.dtype) if grad_b is not None else None, None, None, None, None)


def causal_lm_loss(model: nn.Module, input_ids: torch.Tensor, labels: torch.Tensor | None = None, *,
                   shift_labels: torch.Tensor | None = None, ignore_index: int = -100, chunk: int | None = None,
                   num_items_in_batch: torch.Tensor | int | None = None, **kwargs: Any) -> torch.Tensor:
    """The loss `model(input_ids=input_ids, labels=labels, **kwargs).loss` computes for a
    transformers causal LM (a peft model over one too; tierzero-wrapped or not): labels shifted
    inside, `ignore_index` ignored, the mean over the rest (or, as the model's loss given
    `num_items_in_batch`, their sum divided by it); or `shift_labels`, the target of each position
    as given. Without the whole sequence's logits: see [Note: chunked loss].

    ValueError for a model whose head is not a linear layer over its decoder's output (e.g. it
    scales or caps the logits), or whose forward takes no `logits_to_keep`."""
    if (labels is None) == (shift_labels is None):
        raise ValueError("causal_lm_loss: give labels (shifted inside, as the model's own loss) or shift_labels "
                         "(one target per position), not both or neither")
    lm = base_model(model)
    head = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if not isinstance(head, nn.Linear):
        raise ValueError(f"causal_lm_loss: {type(lm).__name__} has no linear output layer (get_output_embeddings() "
                         f"is {type(head).__name__}); it computes the loss of a transformers causal LM")
    if "logits_to_keep" not in inspect.signature(lm.forward).parameters:
        raise ValueError(f"causal_lm_loss: {type(lm).__name__}.forward takes no logits_to_keep, so it would "
                         "compute the logits of every position anyway; use model(input_ids, labels=labels).loss")
    decoder = lm.get_decoder()
    if shift_labels is None:
        assert labels is not None
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    hidden: list[torch.Tensor] = []

    def keep_hidden(module: nn.Module, args: Any, output: Any) -> None:
        hidden.append(output[0])

    def add_loss(module: nn.Module, args: Any, output: Any) -> None:
        h = hidden[-1]
        _check_head(lm, head, h, output.logits)
        output["loss"] = chunked_cross_entropy(h, head.weight, head.bias, shift_labels, ignore_index=ignore_index,
                                               chunk=chunk, num_items=num_items_in_batch)

    handles = [decoder.register_forward_hook(keep_hidden),
               lm.register_forward_hook(add_loss, prepend=True)]  # before tierzero's, which release the head
    try:
        return model(input_ids=input_ids, logits_to_keep=1, **kwargs).loss
    finally:
        for handle in handles:
            handle.remove()


def _check_head(lm: nn.Module, head: nn.Linear, hidden: torch.Tensor, logits: torch.Tensor) -> None:
    """The model's own logits of the last position against the plain head over the decoder's
    output, once per model (real tensors only: fake ones carry no values)."""
    if lm in _CHECKED or is_fake(logits):
        return
    with torch.no_grad():
        mine = F.linear(hidden[:, -1:], head.weight, head.bias).float()
        theirs = logits.float()
        tol = max(1e-5, 4 * torch.finfo(logits.dtype).eps) * max(theirs.abs().max().item(), 1.0)
        if mine.shape != theirs.shape or (mine - theirs).abs().max().item() > tol:
            raise ValueError(
                f"causal_lm_loss: {type(lm).__name__}'s logits are not its output layer over its decoder's last "
                "hidden states (it scales, caps or otherwise changes them), so a loss from the hidden states would "
                "not be its loss; use model(input_ids, labels=labels).loss")
    _CHECKED.add(lm)

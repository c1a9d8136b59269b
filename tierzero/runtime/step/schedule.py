"""The schedules a wrapped model's blocks follow within a step, behind one `Schedule` that
Block's hooks consult: the plain one (each forward call fetches its block; a block's backward
hold ends at that call's post-backward) and tz.accumulate's layer-major one, whose rules all
live here: see [Note: layer-major schedule]."""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Protocol, Sequence

import greenlet
import torch
from torch import nn

from tierzero.layout import ROOT
from tierzero.prefetch import FetchPhase


class ParkedBlock(Protocol):
    """What a schedule uses of a block (tierzero.runtime.blocks.Block, above)."""

    name: str

    def hold(self, phase: FetchPhase) -> None: ...

    def unhold(self) -> None: ...


class HeldCall(Protocol):
    """A forward call of a block that autograd may run backward through (blocks._Call)."""

    recompute: bool
    post_backward_done: bool


class StepContextRef(Protocol):
    schedule: "Schedule"


class Root(Protocol):
    """What the layer-major step uses of the root state (tierzero.runtime.state.TieredState)."""

    model: nn.Module
    ctx: StepContextRef

    @property
    def in_block_call(self) -> bool: ...

    def begin_forward(self, module: nn.Module) -> None: ...

    def end_forward(self, output: Any) -> None: ...

    def abort_forward(self) -> None: ...


class Schedule:
    """The plain schedule: every forward call fetches its block in its own pre-forward hook, the
    root's hooks begin and end the iteration, and a block's backward hold ends at each call's
    post-backward."""

    owns_forward = False
    """The schedule, not the root's hooks, begins and ends the forward (its micro-batches run it)."""
    sums_wide = False
    """Early capture sums a block's shares in the stored gradient's dtype where that is wider
    than the compute dtype ([Note: layer-major sums in the gradient's dtype])."""

    def arrive(self, block: ParkedBlock, *, recompute: bool) -> None:
        """A block's pre-forward hook, before the block is held."""

    def defers_release(self, calls: Sequence[HeldCall], done: Sequence[HeldCall]) -> bool:
        """Whether a block's post-backward for the calls `done` (of its `calls`) leaves its
        reduction and release to a later call."""
        return False

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


PLAIN = Schedule()
"""The schedule of every step but tz.accumulate's."""


# [Note: layer-major schedule]
# Eager Python cannot run block b for k forwards, then block b+1, in one call stack. So each
# micro-batch's forward (model, then loss_fn) runs in its own greenlet on the caller's thread.
# - Forward: a block's pre-forward hook parks the running micro-batch (`arrive`). Once all k
#   wait at the same block, the step releases the block before, holds this one (one fetch; the
#   prefetcher is told as in a plain forward) and lets the k through it in the order k..1.
# - Backward: one `torch.autograd.backward(losses)`. Autograd runs ready nodes by descending
#   sequence number; the numbers count up in creation order on the thread, which greenlets
#   share. So it runs block L for micro-batch 1..k, then block L-1 for 1..k, ...: a parameter
#   used once per micro-batch gets its shares in the plain loop's order (the same bits).
#   Shares of a parameter used twice (a tied embedding and head) come in another order.
# - A block's backward holds are released, and its gradient reduced, at its last call's
#   post-backward (`defers_release`, which Block.post_backward asks): one fetch per block, one
#   reduction (at ZeRO 2 and 3 the plain loop reduces k times, so the sums differ by rounding).
# - What is held where: what autograd saves in each call goes to its pack or frame (with
#   activation_checkpointing, only the call's input), placed per Config.activations within the
#   budgets: k per block. Each parked micro-batch also carries the next block's input, which
#   stays on the device where compute made it.
# - Refused with a ValueError, before any backward (nothing falls back): micro-batches that
#   reach different blocks (data-dependent routing) or finish while others wait, and a block
#   reached inside another block's call or inside a region that changes autograd's thread
#   state (no_grad, autocast, torch.utils.checkpoint: the model's own checkpointing), which
#   the other micro-batches would inherit. The plain loop runs those: the refusal is a
#   `LayerMajorRefusal`, and tierzero.hf's trainers take the plain loop on it (one warning).

# [Note: layer-major sums in the gradient's dtype]
# The plain loop adds each micro-batch's gradient to the stored one, in the stored gradient's
# dtype (fp32 by default): with bf16 compute, one rounding to fp32 per micro-batch. Layer by
# layer, the k micro-batches' shares of a block meet before the block's gradient is stored. If
# they met in autograd (its input buffer sums every share of a parameter within the one
# backward), or in an early-capture buffer of the compute dtype, they would be summed in bf16,
# far from the plain loop's gradient. So, where the stored gradient is wider than the compute
# dtype, early capture (grads.py) takes every share in a layer-major step of several
# micro-batches (`Schedule.sums_wide`):
# - into a device buffer of the stored gradient's dtype: each bf16 share is added to it in
#   fp32, in the plain loop's order, and the block is still stored (and reduced across ranks)
#   once, at its last call;
# - with no device room for that buffer, on one rank, into the stored gradient itself (each
#   share copied to its tier first): the same sums, more copies;
# - with no room and several ranks (the shares must be reduced), or a gradient already holding
#   an earlier backward's sum, autograd sums them, and a RuntimeWarning says so.
# A parameter used once per micro-batch then gets the plain loop's bits; one used twice in a
# micro-batch (a tied embedding) has its shares added in fp32 rather than first summed in bf16.

PLAIN_LOOP = "for mb in micro_batches: loss_fn(model(mb), mb).backward()"


class LayerMajorRefusal(ValueError):
    """tz.accumulate cannot run this step layer by layer ([Note: layer-major schedule]); raised
    before any backward, so the plain loop can run the same micro-batches instead. `reason`:
    why, in a phrase; `losses_computed`: how many loss_fn calls had returned (their side effects
    happened)."""

    def __init__(self, message: str, reason: str, losses_computed: int) -> None:
        super().__init__(message)
        self.reason = reason
        self.losses_computed = losses_computed


class _Parked(NamedTuple):
    """A micro-batch waiting at `block`'s pre-forward hook."""

    block: ParkedBlock


class _Finished(NamedTuple):
    """A micro-batch's forward and loss done."""

    loss: torch.Tensor
    outputs: list[torch.Tensor]


def _thread_state() -> tuple[Any, ...]:
    """Autograd's thread state a parked micro-batch would hand to the others."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(), torch.is_autocast_enabled("cpu"),
            torch.is_autocast_enabled("cuda"), top(False) if top is not None else None)


class LayerMajor(Schedule):
    """One call of `tz.accumulate` (see [Note: layer-major schedule]): the wrapped model's
    schedule from its forward to the end of its backward."""

    def __init__(self, model: nn.Module, state: Root, micro_batches: Sequence[Any],
                 loss_fn: Callable[[Any, Any], torch.Tensor], forward: Callable[[Any], Any]) -> None:
        self.model = model
        self.state = state
        self.micro_batches = micro_batches
        self.sums_wide = len(micro_batches) > 1
        self.loss_fn = loss_fn
        self.forward = forward
        self._losses = 0
        self._workers: dict[greenlet.greenlet, int] = {}
        self._driver = greenlet.getcurrent()
        self._entry_state: tuple[Any, ...] = ()

    def arrive(self, block: ParkedBlock, *, recompute: bool) -> None:
        """A block's pre-forward hook: park the micro-batch running it until the step resumes it
        (not the root's, nor a recompute in backward)."""
        current = greenlet.getcurrent()
        if recompute or block.name == ROOT:
            return
        if current not in self._workers:
            return
        in_scope = self.state.in_block_call
        if in_scope or _thread_state() != self._entry_state:
            where = ("inside another block's call" if in_scope else
                     "inside a region that changes autograd's state (no_grad, autocast, or torch.utils.checkpoint: "
                     "turn the model's own gradient checkpointing off, Config(activation_checkpointing=True) "
                     "keeps only each block's input)")
            raise self.refusal(f"micro-batch {self._workers[current]} reached block {block.name!r} {where}")
        self._driver.switch(_Parked(block))

    def refusal(self, reason: str) -> LayerMajorRefusal:
        return LayerMajorRefusal(f"tz.accumulate cannot run {type(self.model).__name__} block by block: {reason}. "
                          f"Nothing was changed; train it with the plain loop ({PLAIN_LOOP}), which gives the same "
                          "gradients and fetches each block once per micro-batch", reason, self._losses)

    def defers_release(self, calls: Sequence[HeldCall], done: Sequence[HeldCall]) -> bool:
        """A block reduces and releases at its last call's post-backward: not while a forward
        call of it (not a recompute) other than `done` still waits for its backward."""
        return any(not c.post_backward_done for c in calls if c not in done and not c.recompute)

    def run(self) -> list[torch.Tensor]:
        state = self.state
        state.begin_forward(state.model)
        self._entry_state = _thread_state()
        state.ctx.schedule = self
        self.owns_forward = True
        try:
            try:
                finished = self._forward()
            finally:
                self.owns_forward = False
            outputs = [t for f in finished for t in f.outputs]
            state.end_forward(outputs)
            losses = [f.loss for f in finished]
            torch.autograd.backward(losses)
        except BaseException:
            state.abort_forward()
            raise
        finally:
            state.ctx.schedule = PLAIN
        return [loss.detach() for loss in losses]

    def _forward(self) -> list[_Finished]:
        """Every micro-batch through each block in turn; the micro-batches' results in order."""
        k = len(self.micro_batches)
        for i, mb in enumerate(self.micro_batches):
            self._workers[greenlet.greenlet(lambda mb=mb: self._one(mb), parent=self._driver)] = i
        workers = list(self._workers)
        stops: dict[int, _Parked | _Finished] = {}
        held: ParkedBlock | None = None
        try:
            while True:
                for i in reversed(range(k)):
                    stops[i] = workers[i].switch()
                parked = {stop.block for stop in stops.values() if isinstance(stop, _Parked)}
                if held is not None:
                    held.unhold()
                    held = None
                if not parked:
                    return [stop for _, stop in sorted(stops.items())]  # type: ignore[misc]
                if len(parked) > 1 or any(isinstance(s, _Finished) for s in stops.values()):
                    raise self.refusal(self._diverged(stops))
                held = parked.pop()
                held.hold(FetchPhase.FORWARD)
        finally:
            if held is not None:
                held.unhold()
            for w in workers:
                if not w.dead:
                    w.throw(greenlet.GreenletExit)

    @staticmethod
    def _diverged(stops: dict[int, _Parked | _Finished]) -> str:
        where = {i: (f"block {s.block.name!r}" if isinstance(s, _Parked) else "the end of its forward")
                 for i, s in sorted(stops.items())}
        return "its micro-batches took different routes through the blocks (" + ", ".join(
            f"micro-batch {i} at {w}" for i, w in where.items()) + ")"

    def _one(self, mb: Any) -> _Finished:
        out = self.forward(mb)
        loss = self.loss_fn(out, mb)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.requires_grad:
            raise ValueError(f"tz.accumulate: loss_fn(outputs, micro_batch) must give a one-element tensor that "
                             f"requires grad; it gave {type(loss).__name__}"
                             + (f" of shape {tuple(loss.shape)}" if isinstance(loss, torch.Tensor) else ""))
        self._losses += 1
        return _Finished(loss, [t for t in output_tensors(out) if t.requires_grad])


def output_tensors(obj: Any) -> list[torch.Tensor]:
    """Tensors inside an output: tuples, lists, dicts, namedtuples and dataclasses."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    if dataclass_fields := getattr(obj, "__dataclass_fields__", None):
        return [t for name in dataclass_fields for t in output_tensors(getattr(obj, name))]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in output_tensors(v)]
    if isinstance(obj, (tuple, list)):
        return [t for v in obj for t in output_tensors(v)]
    return []

"""Blocks of a wrapped model: the unit that is fetched to the device, computed on, released.

Levels, the way FSDP2 splits them:

- `FlatParam` (flat_param.py) owns one flat tensor of a block (its trainable parameters, or its
  frozen ones): the handles in the placement manager, the ParamState of the nn.Parameters that
  view it, its values; its gradient is a `FlatGrad` (grads.py).
- `FetchGroup` (fetch_group.py) brings a block's flat tensors to the device together (copies,
  all-gathers across ranks) and reduces their gradients after backward.
- `Block` (here) counts holds (forward calls, backward calls, recomputation) and runs the hooks:
  fetch before forward, release after it, fetch again before backward (a hook on the outputs'
  gradients), reduce gradients and release after backward (`RegisterPostBackward` on the inputs).
  Each forward call with grad opens a scope for what autograd saves in it: an ActivationPack
  (activation_pack.py) or, with activation checkpointing, a recompute Frame (recompute.py).
- `StepContext` (step_context.py) is what blocks share, `Schedule` included; state.py owns it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from tierzero.config import Tier
from tierzero.layout import ROOT, outside_read_hints
from tierzero.prefetch import FetchPhase, TraceEvent, Unit
from tierzero.runtime.activation_pack import ActivationPack, opaque
from tierzero.runtime.activations import Activations
from tierzero.runtime.flat.fetch_group import FetchGroup
from tierzero.runtime.flat.flat_param import FlatParam
from tierzero.runtime.flat.placeholders import hint
from tierzero.runtime.recompute import Frame
from tierzero.runtime.step.schedule import output_tensors
from tierzero.runtime.step.step_context import Phase, StepContext


class RegisterPostBackward(torch.autograd.Function):
    """Identity on a block call's inputs whose backward runs once their gradients are computed,
    i.e. after the block's backward: the block's post-backward."""

    @staticmethod
    def forward(ctx: Any, call: "_Call", *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.call = call
        return inputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[Any, ...]:
        ctx.call.block.post_backward(ctx.call)
        return (None, *grads)


@dataclass(eq=False)
class _Call:
    """One forward call of a block that autograd may run backward through."""

    block: "Block"
    pre_backward_done: bool = False
    """The block was fetched for this call's backward (from the start for a recompute)."""
    post_backward_done: bool = False
    recompute: bool = False
    """A forward run again in backward (activation checkpointing)."""
    saved: ActivationPack | Frame | None = None
    """What autograd saved in this call (a forward with grad), until its backward is over."""

    @property
    def holds_backward(self) -> bool:
        """This call holds the block for backward until its post-backward."""
        return self.pre_backward_done and not self.post_backward_done


class Block:
    """The FlatParams of some modules, fetched and released together (see module docstring)."""

    def __init__(self, name: str, modules: list[nn.Module], flats: list[FlatParam], ctx: StepContext,
                 activations: Activations) -> None:
        self.name = name
        self.modules = modules
        self.flats = flats
        self.ctx = ctx
        self.activations = activations
        self.group = FetchGroup(name, flats, ctx)
        self.unit = Unit(name, tuple(f.param for f in flats), sum(f.nbytes for f in flats),
                         any(f.home is Tier.NVME for f in flats))
        self.nbytes = self.unit.nbytes
        """Device bytes while fetched (the unit's: a block's flat tensors never change)."""
        self._holds = 0
        self._calls: list[_Call] = []
        """Forward calls whose backward may still come (swept by the final callback)."""
        self._running: list[_Call] = []
        """Calls between their pre- and post-forward hooks."""
        self._handles: list[Any] = []
        self._grads_final_sent = False
        """ctx.grads_final was called for this block's flats since its last forward."""
        self._deferred = 0
        """Backward holds whose release waits for the last call of a layer-major step."""
        if name != ROOT:
            for p, text in outside_read_hints(name, modules):
                hint(p, text)
        self.successor = self
        """The block that took its place when the root state was built again (wrapping.refresh)."""

    def register_hooks(self) -> None:
        for module in self.modules:  # outside compiled graphs: [Note: compiled blocks]
            self._handles.append(module.register_forward_pre_hook(opaque(self._pre_forward), with_kwargs=True))
            self._handles.append(module.register_forward_hook(opaque(self._post_forward)))

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ------------------------------------------------------------------------------ holds

    def hold(self, phase: FetchPhase) -> None:
        """Fetch on the first hold; nested holds (recompute, repeated calls) share the copy."""
        self._holds += 1
        if self._holds > 1 or not self.flats:
            return
        ctx = self.ctx
        ctx.hold(self)
        with torch.profiler.record_function(f"tierzero::fetch {self.name}"):
            if ctx.prefetcher is not None:
                ctx.prefetcher.on_fetch(TraceEvent(phase, self.name), ctx.account.held.keys())
            try:
                ctx.wait_updates(self.flats)  # the overlapped step's update of this block
                self.group.fetch()
            except BaseException:  # not held: the next iteration starts clean
                self._holds -= 1
                ctx.release(self)
                raise
            if ctx.prefetcher is not None:
                ctx.prefetcher.fetched()

    def unhold(self) -> None:
        assert self._holds > 0, f"{self.name}: release without a hold"
        self._holds -= 1
        if self._holds == 0 and self.flats:
            ctx = self.ctx
            # A gathered block fetched again next (the last block: forward, then its backward)
            # keeps its gathered copy instead of gathering it again.
            keep = ctx.zero.gathers and ctx.prefetcher is not None and ctx.prefetcher.next_unit() == self.name
            with torch.profiler.record_function(f"tierzero::release {self.name}"):
                self.group.free(keep_gathered=keep)
            ctx.release(self)

    def begin_iteration(self) -> None:
        """A new forward from the root: release holds an interrupted step left (a backward
        that raised), forget the calls."""
        while self._holds:
            self.unhold()
        for flat in self.flats:
            if flat.grad is not None:
                flat.grad.capture.drop()  # of a backward that raised before its accumulate
        self._running.clear()
        # A call still holding for backward belongs to a backward that raised (its holds were
        # just released); a call whose backward never started is added back by its pre-backward.
        self._calls.clear()
        self._grads_final_sent = False
        self._deferred = 0

    # ------------------------------------------------------------------------------ hooks
    # A forward call (grad enabled) becomes a _Call: RegisterPostBackward on its inputs, a
    # pre-backward hook on its outputs. A forward run again inside backward (activation
    # checkpointing) is a call that holds the block from the start: non-reentrant checkpointing
    # may stop it early (no post-forward hook) and reentrant checkpointing backpropagates through
    # it, so its hold ends at the block's next post-backward, not at its post-forward.

    def _pre_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
        if kwargs is None:
            # Called without kwargs: torch runs the hooks a module had when its call began, and
            # this one's handle was removed since (the root state built again in the root's
            # pre-forward, wrapping.refresh): the block that replaced it runs in its place.
            out = self.successor._pre_forward(module, args, {})
            return None if out is None else out[0]
        recompute = self.ctx.step.phase is Phase.BACKWARD
        self.ctx.schedule.arrive(self, recompute=recompute)
        self.hold(FetchPhase.RECOMPUTE if recompute else FetchPhase.FORWARD)
        if not torch.is_grad_enabled():
            return None
        call = _Call(self, pre_backward_done=recompute, recompute=recompute)
        self._calls.append(call)
        if not recompute:
            self._running.append(call)
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if idx:
            outs = RegisterPostBackward.apply(call, *(flat[i] for i in idx))
            for i, t in zip(idx, outs):
                flat[i] = t
        if not recompute and self.name != ROOT:
            call.saved = self._open_scope(module, *tree_unflatten(flat, spec))
        return tree_unflatten(flat, spec) if idx else None

    def _open_scope(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> ActivationPack | Frame:
        """The scope of what autograd saves in this call, from now to its post-forward."""
        acts = self.activations
        if getattr(module, "gradient_checkpointing", False) is True and module.training:
            acts.note_own_checkpointing(self.name)
        scope = Frame(acts, self.name, module, args, kwargs) if acts.checkpointing else acts.new_pack(self.name)
        acts.saved.push(scope)
        return scope

    def _post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if self.ctx.step.phase is Phase.BACKWARD:
            if not torch.is_grad_enabled():
                self.unhold()  # a recompute without autograd: nothing comes back for it
            return None
        call = self._running.pop() if torch.is_grad_enabled() else None
        try:
            if call is not None and call.saved is not None:
                self.activations.saved.pop(call.saved)
                if isinstance(call.saved, ActivationPack):
                    self.activations.seal(call.saved)  # while the block is held: its room counts
                elif not call.saved.saves:
                    call.saved.free()  # autograd saved nothing: no backward will recompute the call
        finally:
            self.unhold()
        if call is None:
            return None
        hook = self._make_pre_backward(call)
        for t in output_tensors(output):
            if t.requires_grad:
                t.register_hook(hook)
        return None

    def _make_pre_backward(self, call: _Call) -> Callable[[torch.Tensor], None]:
        def pre_backward(grad: torch.Tensor) -> None:
            if call.pre_backward_done:
                return
            call.pre_backward_done = True
            if call not in self._calls:
                self._calls.append(call)
            self.ctx.begin_backward()
            self.hold(FetchPhase.BACKWARD)
        return pre_backward

    def post_backward(self, call: _Call | None = None) -> None:
        """Accumulate gradients; release the backward hold of `call` and of every recompute of
        this block (call None: of every call, at the end of backward). Idempotent."""
        done = [c for c in self._calls if c.holds_backward and (call is None or c is call or c.recompute)]
        if call is not None and call.holds_backward and call not in done:
            done.append(call)
        deferring = call is not None and self.ctx.schedule.defers_release(self._calls, done)
        if not deferring:
            self.group.reduce_grads()
        for c in done:
            c.post_backward_done = True
            if c.saved is not None:
                c.saved.free()  # every node of the call has run (or never will)
        self._deferred += len(done)
        while not deferring and self._deferred:
            self._deferred -= 1
            self.unhold()
        self.activations.collect()
        if (self.ctx.grads_final is not None and not self._grads_final_sent
                and all(c.post_backward_done for c in self._calls)):
            # No forward call of this block still waits for its backward: its gradients are final.
            self._grads_final_sent = True
            for flat in self.flats:
                if flat.grad is not None and not flat.grad.empty:
                    self.ctx.grads_final(flat)
        if call is None:
            self._calls.clear()

    def __repr__(self) -> str:
        return f"Block({self.name!r}, {len(self.flats)} flat tensors, {self.nbytes} bytes, holds={self._holds})"

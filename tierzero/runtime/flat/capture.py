"""Early gradient capture: each share of a parameter's gradient summed, as autograd sends it,
into its flat gradient's sum (`CaptureSum`), found by a walk of the graph (`GradCapture`)
([Note: early gradient capture])."""

from __future__ import annotations

import warnings
from typing import Any, Callable, NamedTuple, Protocol, Sequence

import torch
from torch import nn

from tierzero.config import Tier
from tierzero.layout import FlatLayout
from tierzero.placement import TensorHandle
from tierzero.runtime.step.step_context import StepContext


class Gradient(Protocol):
    """What early capture uses of a flat gradient (grads.py's FlatGrad, which owns its CaptureSum)."""

    layout: FlatLayout
    ctx: StepContext
    handle: TensorHandle
    empty: bool
    """No gradient stored since the last zero_grad()."""
    capture: CaptureSum


# [Note: early gradient capture]
# Early capture (`GradCapture`, summing into each flat gradient's `CaptureSum`): each share of a parameter's gradient is summed into the stored
# gradient as autograd sends it (a post hook on the node that sends it), in the order autograd
# would sum it, so the bits are the same, and None goes on in its place: autograd neither buffers
# it nor sets `.grad`. Without it the root block (embedding, LM head, final norm), fetched before
# the first block and done after the last, has its gradients held by autograd from the LM head's
# backward to the end of backward (a tied embedding / LM head's share waits in autograd's input
# buffer for the embedding's: vocab x width x 4 bytes, 0.5 GB at 50k x 2560), and every block's
# `.grad` exist whole beside its stored gradient before the flattening: all outside the budgets.
# Where the shares are summed:
#
#     the stored gradient   synchronous CPU copies, one rank, gradients stored in the parameters'
#                           dtype, the first backward since zero_grad() (a second one adds to the
#                           stored sum, which autograd's order would not): acquired (overwrite) at
#                           the first share and held until the block's accumulate
#     a device buffer       wherever copies are asynchronous (CUDA, the stream stand-in) or there
#                           are several ranks: the whole flat gradient of this backward, in the
#                           parameters' dtype, reserved (device budget) at the first share when
#                           there is room now; at accumulate it is what the reduce-scatter (or
#                           all-reduce) reads and what the device-to-host copy takes to the
#                           stored gradient, exactly as the flattened `.grad` would be
#
# A share that arrives otherwise (a recompute in backward, no room for the buffer) is added at
# accumulate; on one rank with nothing captured, each parameter's `.grad` goes straight into its
# slice of the stored gradient, with no flat temporary on the device (`_write_straight`). The
# device-to-host copy of a gradient runs on the copy stream: backward goes on at once, and the
# stored gradient's readers wait for the copy's event (PlacementManager.release's `written`); its
# norms are taken on the device before it leaves.
class CaptureSum:
    """Where one flat gradient's shares are summed in a backward ([Note: early gradient capture]):
    the stored gradient itself, acquired (overwrite) at the first share and pinned until
    accumulate, or a device buffer reserved then."""

    def __init__(self, grad: Gradient, reached: Callable[[int], None]) -> None:
        self._grad = grad
        self._reached = reached
        """Told each parameter (by index) a share reached."""
        self.held: torch.Tensor | None = None
        """Where this backward's shares are summed: the stored gradient, or a view of `scratch`."""
        self.scratch: torch.Tensor | None = None
        """On the device: the buffer `held` views, given back at accumulate."""
        self.captured: set[int] = set()
        """Parameters (by index) with contributions summed into `held`."""
        self._refused = False
        """No room was found for the device buffer in this backward: none until accumulate."""

    @property
    def on_device(self) -> bool:
        """The shares are summed in a device buffer, not the stored gradient
        ([Note: early gradient capture]; in a layer-major step also where that buffer sums in a
        wider dtype than the compute dtype, see [Note: layer-major sums in the gradient's dtype])."""
        ctx = self._grad.ctx
        return ctx.pm.copies.asynchronous or ctx.world_size > 1 or self.sum_dtype() != ctx.compute_dtype

    def applies(self, dtype: torch.dtype) -> bool:
        """Early capture applies now to a contribution of `dtype`."""
        grad = self._grad
        if self.on_device:
            return not self._refused and dtype == grad.ctx.compute_dtype
        if self.held is not None:
            return dtype == self.held.dtype
        return dtype == grad.handle.dtype and grad.empty

    def sum_dtype(self) -> torch.dtype:
        """The dtype of the device buffer: the compute dtype, in which autograd would sum; in a
        layer-major step of several micro-batches, the stored gradient's where it is wider
        ([Note: layer-major sums in the gradient's dtype])."""
        ctx, stored = self._grad.ctx, self._grad.handle.dtype
        if ctx.schedule.sums_wide and stored.itemsize > ctx.compute_dtype.itemsize:
            return stored
        return ctx.compute_dtype

    def add(self, index: int, g: torch.Tensor) -> bool:
        """Sum one contribution to parameter `index`'s gradient into this backward's sum, as
        autograd's input buffer would (the first one copied, later ones added, in arrival
        order); False when early capture does not apply (the caller passes `g` on)."""
        if not self.applies(g.dtype) or (self.held is None and not self._start()):
            return False
        assert self.held is not None
        slot = self._grad.layout.slots[index]
        view = self.held[slot.offset:slot.offset + slot.numel]
        self._reached(index)
        share = g.reshape(-1)
        if index in self.captured:
            view.add_(share.to(view.device))  # a no-op where the share is there already
        else:
            view.copy_(share)
            self.captured.add(index)
        return True

    def _start(self) -> bool:
        """The first share of a backward: take where the shares are summed."""
        grad = self._grad
        ctx, h = grad.ctx, grad.handle
        with torch.profiler.record_function(f"tierzero::capture_grad {h.owner}"):
            if not self.on_device:
                return self._hold_stored()
            dtype = self.sum_dtype()
            nbytes = grad.layout.padded_numel * dtype.itemsize
            scratch = None
            if ctx.account.take_capture(nbytes):
                scratch = ctx.pm.scratch.reserve(nbytes, Tier.DEVICE, what=f"{h.name} (captured)", wait=False)
                if scratch is None:
                    ctx.account.capture_done(nbytes)
            if scratch is None:
                return self._refuse(dtype)
            self.scratch, self.held = scratch, scratch[:nbytes].view(dtype)
            return True

    def _hold_stored(self) -> bool:
        """Sum this backward's shares in the stored gradient itself, pinned from now until
        accumulate (overwritten: not zeroed, accumulate zeroes what no share reached)."""
        h = self._grad.handle
        self.held = self._grad.ctx.pm.acquire(h, h.staging, overwrite=True)
        return True

    def _refuse(self, dtype: torch.dtype) -> bool:
        """No device room for the buffer: the shares go on to autograd (False). In a layer-major
        step that sums in a wider dtype, autograd would sum the micro-batches in the compute
        dtype ([Note: layer-major sums in the gradient's dtype]): on one rank, into a gradient
        nothing was stored in yet, the shares are summed in the stored gradient itself (each
        copied to its tier), the same bits; otherwise a warning says what differs."""
        grad = self._grad
        ctx = grad.ctx
        if dtype == ctx.compute_dtype:
            self._refused = True
            return False
        if ctx.world_size == 1 and grad.empty:
            return self._hold_stored()
        self._refused = True
        warnings.warn(f"tz.accumulate: no device room for {grad.layout.padded_numel * dtype.itemsize} bytes to sum "
                      f"{grad.handle.owner}'s gradient over the micro-batches in {dtype}; autograd sums them in "
                      f"{ctx.compute_dtype} instead, not as the plain loop does (raise device_budget, or run "
                      "the plain loop)", RuntimeWarning, stacklevel=2)
        return False

    def fold(self, buf: torch.Tensor, grads: list[torch.Tensor | None]) -> None:
        """The sum in `buf` completed: what autograd still held added, the slots no share reached
        and the padding zeroed."""
        layout = self._grad.layout
        for i, (slot, g) in enumerate(zip(layout.slots, grads)):
            view = buf[slot.offset:slot.offset + slot.numel]
            if i in self.captured:
                if g is not None:
                    view.add_(g.reshape(-1).to(view.device))
            elif g is not None:
                view.copy_(g.reshape(-1))
            else:
                view.zero_()
        for lo, hi in layout.gaps():
            buf[lo:hi].zero_()

    def fold_held(self, grads: list[torch.Tensor | None]) -> torch.Tensor:
        """The shares were summed in the stored gradient: `fold` them there and hand it back
        (the caller releases it); nothing is held after."""
        buf, self.held = self.held, None
        assert buf is not None and self.scratch is None
        try:
            self.fold(buf, grads)
            return buf
        finally:
            self.captured.clear()
            self._refused = False

    def drop(self) -> None:
        """Forget the shares summed (a backward that raised before accumulate, or accumulate
        done with the device buffer): the buffer given back, the stored gradient left as it was."""
        ctx, h = self._grad.ctx, self._grad.handle
        if self.scratch is not None:
            assert self.held is not None  # set together: the view of the room capture took
            ctx.pm.scratch.free(self.scratch, Tier.DEVICE)
            ctx.account.capture_done(self.held.nbytes)
        elif self.held is not None:
            ctx.pm.release(h, h.staging)
        self.held = self.scratch = None
        self.captured.clear()
        self._refused = False


class GradCapture:
    """Early capture for a wrapped model's trainable parameters ([Note: early gradient capture]):
    after each forward with autograd, a walk of the graph from the outputs finds every edge into one of
    those parameters' AccumulateGrad nodes and puts a post hook on the node that sends it; the
    hook gives the share to the parameter's FlatGrad (`capture`) and passes None on in its
    place."""

    def __init__(self, params: Sequence[tuple[nn.Parameter, Gradient, int]]) -> None:
        self._where = {id(p): (p, grad, i) for p, grad, i in params}
        """id(parameter) -> (the parameter, its flat gradient, its index there)."""

    def install(self, outputs: Sequence[torch.Tensor]) -> None:
        """Hook the nodes that send gradients to the parameters, in the graph behind `outputs`."""
        if not self._where or not any(g.capture.applies(p.dtype) for p, g, _ in self._where.values()):
            return
        seen: set[Any] = set()
        todo = [t.grad_fn for t in outputs if t.grad_fn is not None]
        while todo:
            node = todo.pop()
            if node in seen:
                continue
            seen.add(node)
            edges = []
            for j, (child, _) in enumerate(node.next_functions):
                if child is None:
                    continue
                variable = getattr(child, "variable", None)
                if variable is not None and id(variable) in self._where:
                    _, grad, i = self._where[id(variable)]
                    edges.append(_Edge(j, child, grad, i))
                elif child not in seen:
                    todo.append(child)
            if edges:
                node.register_hook(_capture_hook(edges))


def _accumulates(accumulate: Any) -> bool:
    """This backward runs the AccumulateGrad node `accumulate`: a .backward() that reaches it
    (the engine's answer, which torch's multi-grad hooks also ask); never torch.autograd.grad,
    which returns gradients instead (the engine refuses the question there)."""
    try:
        return torch._C._will_engine_execute_node(accumulate)
    except RuntimeError:  # "... currently running autograd.grad()"
        return False


class _Edge(NamedTuple):
    """Where a node sends a parameter's gradient: its output `position`, to `accumulate` (the
    parameter's AccumulateGrad node); the parameter is `index` in `grad`."""

    position: int
    accumulate: Any
    grad: Gradient
    index: int


def _capture_hook(edges: list[_Edge]) -> Any:
    """A node post hook: the gradients the node sends along `edges` go to the FlatGrads; None
    goes on in their place; only when this backward accumulates into the parameter (not for
    torch.autograd.grad, nor a backward(inputs=...) without it)."""
    def hook(grad_inputs: tuple[torch.Tensor | None, ...], grad_outputs: Any) -> tuple[Any, ...] | None:
        out = list(grad_inputs)
        taken = False
        for e in edges:
            g = out[e.position]
            if g is not None and _accumulates(e.accumulate) and e.grad.capture.add(e.index, g):
                out[e.position] = None
                taken = True
        return tuple(out) if taken else None
    return hook

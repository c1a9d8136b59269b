"""Blocks of a wrapped model: the unit that is fetched to the device, computed on, released.

Levels, the way FSDP2 splits them:

- `FlatParam` owns this rank's shard of one flat tensor in the placement manager (a block's
  trainable parameters, or its frozen ones; the whole flat tensor at world size 1) and the
  nn.Parameters that view the full tensor while it is fetched. Its `ParamState` says what those
  parameters hold; only `install()` / `uninstall()` change it. It also owns the tensor's fp32
  gradient (and master weights, for the optimizer) in the placement manager.
- `Block` groups the FlatParams of some modules, counts holds (forward calls, backward calls,
  recomputation) and runs the hooks: fetch before forward, release after it, fetch again before
  backward (a hook on the outputs' gradients), accumulate gradients and release after backward
  (`RegisterPostBackward` on the inputs).
- `StepContext` is what blocks share: the placement manager, the prefetcher, the phase of the
  step, which blocks are held and the all-gathers in flight. The root state (runtime.py) owns it.

ZeRO-3 (world size N > 1): the placement manager tiers only this rank's 1/N shard of each flat
tensor. A fetch copies the shard to the device and all-gathers every rank's shard into a
scratch buffer reserved on the device tier (started ahead by the prefetcher, from the trace,
with async_op=True: a `PendingGather` record in `StepContext.gathers`); the release frees that
buffer. After backward the flat gradient is reduce-scattered, averaged over ranks, into the fp32
gradient shard. Every rank issues the same collectives in the same order because they follow the
same trace through the same model with the same budgets. At world size 1 the shard is the whole
tensor, the fetched copy is the shard's device copy, and no collective runs.

Parameters are never replaced: each stays the same nn.Parameter object, and its `.data` is set
to a view into the device copy while held, and to a one-element zero-stride placeholder of the
same shape, dtype and device otherwise. Autograd saves parameters (leaves) by reference, so a
backward sees whatever `.data` holds then: the copy the pre-backward hook fetched.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from tierzero.prefetch import Prefetcher, TraceEvent, Unit
from tierzero.sharding import (FlatLayout, all_gather_flat, broadcast_from_first_, rank_errors,
                               reduce_scatter_flat, start_all_gather)
from tierzero.tiers import Tier


class ParamState(Enum):
    """What a FlatParam's nn.Parameters hold.

    FREE     one-element zero-stride placeholders with the right shape: no device memory.
    HELD     views into the flat tensor's pinned device copy: its bytes on the device tier.
    SCRATCH  full CPU tensors that load_state_dict copies into: the block's bytes in CPU memory
             outside every budget, only while a load runs.
    """

    FREE = "free"
    HELD = "held"
    SCRATCH = "scratch"


class Phase(Enum):
    """Where a wrapped model is in its step: blocks forwarded during BACKWARD are recomputed."""

    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


def staging_tier(home: Tier) -> Tier:
    """Where a tensor homed on `home` is worked on by the CPU: NVMe bytes go through host."""
    return Tier.HOST if home is Tier.NVME else home


class PendingGather(NamedTuple):
    """One flat tensor fetched or on its way to the device. `full` is every rank's shard
    gathered once `work` is done (None: nothing in flight); `scratch` is the device buffer
    `full` lives in (None at world size 1, where `full` is the pinned device copy of the shard)."""

    full: torch.Tensor
    work: Any
    scratch: torch.Tensor | None
    """Where `full` lives; it holds the shard's device copy pinned until `work` is done."""


@dataclass
class StepContext:
    """State shared by every block of one wrapped model."""

    pm: Any
    compute_dtype: torch.dtype
    grad_tier: Tier
    master_tier: Tier
    rank: int = 0
    world_size: int = 1
    group: Any = None
    """The process group of the data-parallel ranks (None: the default group)."""
    prefetcher: Prefetcher | None = None
    phase: Phase = Phase.IDLE
    held: dict[str, "Block"] = field(default_factory=dict)
    callback_queued: bool = False
    device_home_bytes: int = 0
    """Bytes of tensors homed on the device tier (not available for fetched copies)."""
    end_backward: Callable[[], None] | None = None
    """The root state's final callback of a backward pass."""
    grads_final: Callable[["FlatParam"], None] | None = None
    """Called once per backward with each trainable flat whose gradient is final (set by a
    tiered optimizer under Config.step_in_backward)."""
    held_storage: dict[int, "FlatParam"] = field(default_factory=dict)
    """data_ptr of the device copy -> FlatParam, for every HELD flat tensor."""
    gathers: dict["FlatParam", PendingGather] = field(default_factory=dict)
    """All-gathers started ahead of their block's fetch (world size > 1), in issue order; they
    are always among the blocks the prefetcher chose last, so they fit the device room."""
    gathered: dict[str, int] = field(default_factory=lambda: {"ahead": 0, "on_demand": 0})
    """Fetches at world size > 1 whose all-gather the prefetcher started ahead / that started it."""

    @property
    def device(self) -> torch.device:
        return self.pm.device

    def register(self, name: str, data: torch.Tensor, home: Tier, *, dtype: torch.dtype | None = None) -> None:
        """Register a tensor in the placement manager (the one place the runtime does)."""
        rec = self.pm.register(name, data, home, dtype=dtype)
        if home is Tier.DEVICE:
            self.device_home_bytes += rec.nbytes

    def begin_backward(self) -> None:
        """First pre-backward hook of a backward pass: queue the final callback once."""
        self.phase = Phase.BACKWARD
        if not self.callback_queued and self.end_backward is not None:
            self.callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def device_room(self) -> int:
        held = sum(b.nbytes for b in self.held.values())
        return self.pm.budget(Tier.DEVICE) - self.device_home_bytes - held

    def gather_ahead(self, blocks: list["Block"]) -> None:
        """The prefetcher's choice at world size > 1: start the all-gathers of `blocks`, drop
        those started earlier for blocks neither chosen now nor held (so what is in flight
        always fits the room the choice was made in). Every rank makes the same choice."""
        keep = {b.name for b in blocks} | set(self.held)
        for flat in [f for f in self.gathers if f.name not in keep]:
            flat.discard_gather()
        for block in blocks:
            block.gather_ahead()

    def discard_gathers(self) -> None:
        """Drop every all-gather started ahead (a new iteration starts from a clean slate)."""
        for flat in list(self.gathers):
            flat.discard_gather()


class FlatParam:
    """One flat tensor of a block and the nn.Parameters that view it (see module docstring)."""

    def __init__(self, name: str, params: list[nn.Parameter], layout: FlatLayout,
                 orig_dtypes: list[torch.dtype], ctx: StepContext, home: Tier) -> None:
        self.name = name
        self.params = params
        self.layout = layout
        self.orig_dtypes = orig_dtypes
        self.ctx = ctx
        self.home = home
        self.trainable = params[0].requires_grad
        assert all(p.requires_grad == self.trainable for p in params), name
        self.param_name = f"{name}.param" if self.trainable else f"{name}.frozen"
        self.grad_name = f"{name}.grad"
        self.master_name = f"{name}.master"
        self.has_master = False
        self.grad_empty = True
        """set_to_none semantics: no gradient since the last zero_grad()."""
        self.grad_scale: torch.Tensor | None = None
        """A factor (clip_grad_norm_) not yet applied to the stored gradient."""
        self._placeholders = [torch.zeros((), dtype=ctx.compute_dtype, device=ctx.device).expand(s.shape)
                              for s in layout.slots]
        self._device: torch.Tensor | None = None
        """The device copy the parameters view while HELD."""
        self._fetched: PendingGather | None = None
        """The finished fetch whose memory `_device` is, while HELD."""
        self._state = ParamState.FREE

    @property
    def nbytes(self) -> int:
        """Device bytes while fetched: the full flat tensor, plus the shard it is gathered from
        at world size > 1 (pinned until the gather is done)."""
        return fetched_bytes(self.layout, self.ctx.compute_dtype)

    @property
    def shard(self) -> slice:
        """This rank's part of the flat tensor."""
        return slice(*self.layout.shard_range(self.ctx.rank))

    # ----------------------------------------------------------------------------- setup

    def register(self, values: list[torch.Tensor]) -> None:
        """Put this rank's shard of the parameters' values (the first rank's values, so every
        rank starts alike) into the placement manager; the parameters become placeholders.
        Trainable ones get an fp32 gradient shard (and, when the compute dtype is narrower than
        fp32, fp32 master weights made from these full-precision values)."""
        ctx = self.ctx
        flat = self.layout.flatten(values, dtype=torch.float32, device="cpu")
        with rank_errors(ctx.rank, ctx.world_size, f"broadcast of {self.param_name} at wrap"):
            broadcast_from_first_(flat, ctx.group, ctx.world_size)
        shard = flat[self.shard]
        ctx.register(self.param_name, shard, self.home, dtype=ctx.compute_dtype)
        if self.trainable:
            ctx.register(self.grad_name, torch.zeros(self.layout.shard_numel), ctx.grad_tier)
            if ctx.compute_dtype != torch.float32:
                ctx.register(self.master_name, shard, ctx.master_tier)
                self.has_master = True
        self.uninstall()

    def ensure_master(self) -> None:
        """fp32 master weights for the optimizer. With an fp32 compute dtype the parameters
        themselves are the master weights when they live on the optimizer states' tier (one
        copy instead of two, and no separate write of new parameters); otherwise a copy is
        made on that tier."""
        if self.has_master or self.master_name == self.param_name:
            return
        if self.ctx.compute_dtype == torch.float32 and self.home is self.ctx.master_tier:
            self.master_name = self.param_name
            return
        self.ctx.register(self.master_name, self.ctx.pm.read(self.param_name).float(), self.ctx.master_tier)
        self.has_master = True

    # ------------------------------------------------------------------------- transitions

    def install(self, flat: torch.Tensor) -> None:
        """FREE -> HELD: the parameters view the device copy `flat`."""
        assert self._state is ParamState.FREE, (self.name, self._state)
        for p, view in zip(self.params, self.layout.views(flat)):
            p.data = view
        self._device = flat
        self.ctx.held_storage[flat.untyped_storage().data_ptr()] = self
        self._state = ParamState.HELD

    def saved_view(self, saved: "SavedView") -> torch.Tensor:
        """A tensor saved for backward as a view of this flat tensor's device copy, rebuilt on the
        copy held now."""
        if self._state is not ParamState.HELD:
            raise RuntimeError(
                f"tierzero: backward needs parameters of {self.name!r} but the block is not fetched; "
                "a second backward through the same graph (retain_graph=True) is not supported")
        assert self._device is not None
        return self._device.as_strided(saved.size, saved.stride, saved.offset)

    def install_scratch(self, values: list[torch.Tensor]) -> None:
        """FREE -> SCRATCH: the parameters hold `values` (full CPU tensors) for a state-dict load."""
        if self._state is not ParamState.FREE:
            raise RuntimeError(f"{self.name}: load_state_dict while the block is in use "
                               f"({self._state.value}); load between training steps")
        for p, v in zip(self.params, values):
            p.data = v
        self._state = ParamState.SCRATCH

    def uninstall(self) -> None:
        """HELD / SCRATCH -> FREE: the parameters become placeholders again."""
        for p, ph in zip(self.params, self._placeholders):
            p.data = ph
        if self._device is not None:
            del self.ctx.held_storage[self._device.untyped_storage().data_ptr()]
            self._device = None
        self._state = ParamState.FREE

    def gather_ahead(self) -> None:
        """Start the all-gather of the full tensor (world size > 1) unless fetched or started."""
        assert self.ctx.world_size > 1, self.name
        if self._state is ParamState.FREE and self not in self.ctx.gathers:
            self.ctx.gathers[self] = self._start_gather()

    def fetch(self) -> None:
        """FREE -> HELD on the full tensor, gathered ahead by gather_ahead() or now."""
        pending = self.ctx.gathers.pop(self, None)
        if self.ctx.world_size > 1:
            self.ctx.gathered["ahead" if pending is not None else "on_demand"] += 1
        pending = pending or self._start_gather()
        self._finish_gather(pending)
        self._fetched = pending
        self.install(pending.full)

    def free(self, *, keep_gathered: bool = False) -> None:
        """HELD -> FREE; keep_gathered: the gathered copy (world size > 1) waits in
        StepContext.gathers for the next fetch instead of being freed."""
        self.uninstall()
        pending, self._fetched = self._fetched, None
        assert pending is not None, self.name
        if keep_gathered:
            assert pending.scratch is not None, self.name
            self.ctx.gathers[self] = pending._replace(work=None)  # done; its shard is released
        else:
            self._drop(pending)

    def _start_gather(self) -> PendingGather:
        ctx = self.ctx
        shard = ctx.pm.acquire(self.param_name, Tier.DEVICE)
        if ctx.world_size == 1:
            return PendingGather(shard, None, None)
        nbytes = self.layout.padded_numel * ctx.compute_dtype.itemsize
        try:
            scratch = ctx.pm.reserve_scratch(nbytes, Tier.DEVICE, what=f"{self.param_name} (gathered)")
        except BaseException:
            ctx.pm.release(self.param_name, Tier.DEVICE)
            raise
        full = scratch[:nbytes].view(ctx.compute_dtype)
        with torch.profiler.record_function(f"tierzero::all_gather {self.name}"), \
                rank_errors(ctx.rank, ctx.world_size, f"all-gather of {self.param_name}"):
            work = start_all_gather(shard, full, ctx.group)
        return PendingGather(full, work, scratch)

    def _finish_gather(self, pending: PendingGather) -> None:
        """Wait for the all-gather; the shard's device copy is then no longer needed (it stays
        cached, evictable)."""
        if pending.work is None:
            return
        with torch.profiler.record_function(f"tierzero::wait_all_gather {self.name}"), \
                rank_errors(self.ctx.rank, self.ctx.world_size, f"all-gather of {self.param_name}"):
            pending.work.wait()
        self.ctx.pm.release(self.param_name, Tier.DEVICE)

    def _drop(self, pending: PendingGather) -> None:
        """Give back the device memory of a finished fetch."""
        if pending.scratch is None:
            self.ctx.pm.release(self.param_name, Tier.DEVICE)
        else:
            self.ctx.pm.free_scratch(pending.scratch, Tier.DEVICE)

    def discard_gather(self) -> None:
        """Forget an all-gather started ahead (its values are stale once the shard is written)."""
        pending = self.ctx.gathers.pop(self, None)
        if pending is not None:
            self._finish_gather(pending)
            self._drop(pending)

    # ---------------------------------------------------------------------------- gradients

    def accumulate_grad(self) -> None:
        """Move the parameters' .grad into the flat fp32 gradient; idempotent (no .grad: no-op)."""
        if not self.trainable:
            return
        grads = [p.grad for p in self.params]
        if all(g is None for g in grads):
            return
        for p in self.params:
            p.grad = None  # frees the device copy as soon as it is accumulated
        with torch.profiler.record_function(f"tierzero::accumulate_grad {self.name}"):
            with self.grad(writable=True, apply_scale=False) as buf:
                if self.grad_empty and self.layout.world_size == 1 and buf.device == self.ctx.device:
                    # No collective and no copy between devices: flatten straight into the
                    # gradient, without a block-sized temporary.
                    self.layout.flatten(grads, dtype=torch.float32, out=buf)
                else:
                    full = self.layout.flatten(grads, dtype=torch.float32, device=self.ctx.device)
                    with rank_errors(self.ctx.rank, self.ctx.world_size, f"reduce-scatter of {self.grad_name}"):
                        shard = reduce_scatter_flat(full, self.layout, self.ctx.group)
                    if self.grad_empty:
                        buf.copy_(shard)
                    else:
                        if self.grad_scale is not None:
                            buf.mul_(self.grad_scale)
                        buf.add_(shard.to(buf.device))
            self.grad_scale = None
            self.grad_empty = False

    @contextlib.contextmanager
    def grad(self, *, writable: bool = False, apply_scale: bool = True) -> Iterator[torch.Tensor]:
        """The fp32 gradient shard on the CPU-side tier; with apply_scale, a pending clip factor
        is applied to a copy (the stored gradient keeps it pending)."""
        tier = staging_tier(self.ctx.pm.records[self.grad_name].home)
        buf = self.ctx.pm.acquire(self.grad_name, tier)
        try:
            if apply_scale and self.grad_scale is not None:
                yield buf * self.grad_scale
            else:
                yield buf
        finally:
            self.ctx.pm.release(self.grad_name, tier, dirty=writable)

    def scale_grad(self, factor: torch.Tensor) -> None:
        if not self.grad_empty:
            self.grad_scale = factor if self.grad_scale is None else self.grad_scale * factor

    def clear_grad(self, *, set_to_none: bool = True) -> None:
        """Forget the gradient (set_to_none) or make it zeros."""
        for p in self.params:
            p.grad = None
        self.grad_scale = None
        self.grad_empty = set_to_none
        if not set_to_none and self.trainable:
            with self.grad(writable=True, apply_scale=False) as buf:
                buf.zero_()

    # ---------------------------------------------------------------------------- full values

    def read_full(self) -> list[torch.Tensor]:
        """Current values as CPU tensors in the parameters' original dtypes (from the fp32
        master weights when there are any), gathered from every rank (a collective: every rank
        calls it)."""
        ctx = self.ctx
        flat = ctx.pm.read(self.master_name if self.has_master else self.param_name)
        if ctx.world_size > 1:
            with rank_errors(ctx.rank, ctx.world_size, f"all-gather of {self.param_name} for a state dict"):
                flat = all_gather_flat(flat.to(ctx.device), self.layout, ctx.group).cpu()
        return [v.to(dt, copy=True) for v, dt in zip(self.layout.views(flat), self.orig_dtypes)]

    def write_full(self, values: list[torch.Tensor]) -> None:
        """Overwrite the values (parameters and master weights) with this rank's part of
        `values` (full tensors)."""
        flat = self.layout.flatten(values, dtype=torch.float32, device="cpu")[self.shard]
        if self.has_master:
            self.ctx.pm.store(self.master_name, flat)
        self.store_param(flat)

    def store_param(self, master: torch.Tensor) -> None:
        """New values of this rank's parameter shard, from fp32 `master`."""
        self.ctx.pm.store(self.param_name, master.to(self.ctx.compute_dtype))
        self.discard_gather()

    def master_updated(self, master: torch.Tensor) -> None:
        """The master weights now hold `master` (an optimizer step or load): store the new
        parameters, unless the parameters are the master weights (the master's write reaches
        them), and drop a gathered copy of the old ones either way."""
        if self.master_name == self.param_name:
            self.discard_gather()
        else:
            self.store_param(master)

    def __repr__(self) -> str:
        return f"FlatParam({self.param_name!r}, {self.layout}, {self._state.value})"


class SavedView(NamedTuple):
    """A tensor saved for backward that views a held flat tensor's device copy."""

    flat: FlatParam
    size: torch.Size
    stride: tuple[int, ...]
    offset: int


class _Outer(NamedTuple):
    """A tensor packed by the saved-tensor hooks that were active outside the model's forward."""

    unpack: Callable[[Any], torch.Tensor]
    packed: Any


class SavedParamViews:
    """Saved-tensor hooks active during the root module's forward.

    Autograd saves parameters that are leaves by reference (backward reads their current .data),
    but ops also save views of them (F.linear saves weight.t() for its backward). Those would
    keep the forward's device copy alive until backward, or read a reused buffer. Instead a
    saved tensor whose storage is a held block's device copy is packed as (flat, size, stride,
    offset) and rebuilt from the copy the pre-backward hook fetched. Other tensors go to the
    hooks that were active outside the forward (e.g. torch.autograd.graph.save_on_cpu), or are
    saved as they are; activation checkpointing installs its own hooks inside, which win.
    """

    def __init__(self, ctx: StepContext) -> None:
        self.ctx = ctx
        self._context: torch.autograd.graph.saved_tensors_hooks | None = None
        self._outer: tuple[Callable[[torch.Tensor], Any], Callable[[Any], torch.Tensor]] | None = None

    def enter(self) -> None:
        self.exit()
        top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
        self._outer = top(False) if top is not None else None
        self._context = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._context.__enter__()

    def exit(self) -> None:
        if self._context is not None:
            self._context.__exit__(None, None, None)
            self._context = None

    def _pack(self, t: torch.Tensor) -> Any:
        flat = None
        if t.device == self.ctx.device and self.ctx.held_storage:
            try:
                flat = self.ctx.held_storage.get(t.untyped_storage().data_ptr())
            except (RuntimeError, NotImplementedError):  # tensors without storage (subclasses)
                flat = None
        if flat is not None and t.dtype == self.ctx.compute_dtype:
            return SavedView(flat, t.size(), t.stride(), t.storage_offset())
        if self._outer is not None:
            pack, unpack = self._outer
            return _Outer(unpack, pack(t))
        return t

    @staticmethod
    def _unpack(packed: Any) -> torch.Tensor:
        if isinstance(packed, SavedView):
            return packed.flat.saved_view(packed)
        if isinstance(packed, _Outer):
            return packed.unpack(packed.packed)
        return packed


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

    @property
    def holds_backward(self) -> bool:
        """This call holds the block for backward until its post-backward."""
        return self.pre_backward_done and not self.post_backward_done


class Block:
    """The FlatParams of some modules, fetched and released together (see module docstring)."""

    def __init__(self, name: str, modules: list[nn.Module], flats: list[FlatParam], ctx: StepContext) -> None:
        self.name = name
        self.modules = modules
        self.flats = flats
        self.ctx = ctx
        self.unit = Unit(name, tuple(f.param_name for f in flats), sum(f.nbytes for f in flats),
                         any(f.home is Tier.NVME for f in flats))
        self._holds = 0
        self._calls: list[_Call] = []
        """Forward calls whose backward may still come (swept by the final callback)."""
        self._running: list[_Call] = []
        """Calls between their pre- and post-forward hooks."""
        self._handles: list[Any] = []
        self._grads_final_sent = False
        """ctx.grads_final was called for this block's flats since its last forward."""

    @property
    def nbytes(self) -> int:
        return self.unit.nbytes

    def gather_ahead(self) -> None:
        """Start the all-gathers of this block's flat tensors (the prefetcher's choice)."""
        with torch.profiler.record_function(f"tierzero::gather_ahead {self.name}"):
            for flat in self.flats:
                flat.gather_ahead()

    def register_hooks(self) -> None:
        for module in self.modules:
            self._handles.append(module.register_forward_pre_hook(self._pre_forward, with_kwargs=True))
            self._handles.append(module.register_forward_hook(self._post_forward))

    # ------------------------------------------------------------------------------ holds

    def hold(self, phase: str) -> None:
        """Fetch on the first hold; nested holds (recompute, repeated calls) share the copy."""
        self._holds += 1
        if self._holds > 1 or not self.flats:
            return
        ctx = self.ctx
        ctx.held[self.name] = self
        with torch.profiler.record_function(f"tierzero::fetch {self.name}"):
            if ctx.prefetcher is not None:
                ctx.prefetcher.on_fetch(TraceEvent(phase, self.name), ctx.held.keys())
            for flat in self.flats:
                flat.fetch()

    def unhold(self) -> None:
        assert self._holds > 0, f"{self.name}: release without a hold"
        self._holds -= 1
        if self._holds == 0 and self.flats:
            ctx = self.ctx
            # A gathered block fetched again next (the last block: forward, then its backward)
            # keeps its gathered copy instead of gathering it again.
            keep = ctx.world_size > 1 and ctx.prefetcher is not None and ctx.prefetcher.next_unit() == self.name
            with torch.profiler.record_function(f"tierzero::release {self.name}"):
                for flat in self.flats:
                    flat.free(keep_gathered=keep)
            del ctx.held[self.name]

    def begin_iteration(self) -> None:
        """A new forward from the root: release holds an interrupted step left, forget calls
        whose backward never came."""
        while self._holds:
            self.unhold()
        self._running.clear()
        self._calls = [c for c in self._calls if c.holds_backward]
        self._grads_final_sent = False

    # ------------------------------------------------------------------------------ hooks
    # A forward call (grad enabled) becomes a _Call: RegisterPostBackward on its inputs, a
    # pre-backward hook on its outputs. A forward run again inside backward (activation
    # checkpointing) is a call that holds the block from the start: non-reentrant checkpointing
    # may stop it early (no post-forward hook) and reentrant checkpointing backpropagates through
    # it, so its hold ends at the block's next post-backward, not at its post-forward.

    def _pre_forward(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        recompute = self.ctx.phase is Phase.BACKWARD
        self.hold("recompute" if recompute else "forward")
        if not torch.is_grad_enabled():
            return None
        call = _Call(self, pre_backward_done=recompute, recompute=recompute)
        self._calls.append(call)
        if not recompute:
            self._running.append(call)
        flat, spec = tree_flatten((args, kwargs))
        idx = [i for i, x in enumerate(flat) if isinstance(x, torch.Tensor) and x.requires_grad]
        if not idx:
            return None
        outs = RegisterPostBackward.apply(call, *(flat[i] for i in idx))
        for i, t in zip(idx, outs):
            flat[i] = t
        return tree_unflatten(flat, spec)

    def _post_forward(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> Any:
        if self.ctx.phase is Phase.BACKWARD:
            if not torch.is_grad_enabled():
                self.unhold()  # a recompute without autograd: nothing comes back for it
            return None
        self.unhold()
        if not torch.is_grad_enabled():
            return None
        call = self._running.pop()
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
            self.hold("backward")
        return pre_backward

    def post_backward(self, call: _Call | None = None) -> None:
        """Accumulate gradients; release the backward hold of `call` and of every recompute of
        this block (call None: of every call, at the end of backward). Idempotent."""
        done = [c for c in self._calls if c.holds_backward and (call is None or c is call or c.recompute)]
        if call is not None and call.holds_backward and call not in done:
            done.append(call)
        for flat in self.flats:
            flat.accumulate_grad()
        for c in done:
            c.post_backward_done = True
            self.unhold()
        if (self.ctx.grads_final is not None and not self._grads_final_sent
                and all(c.post_backward_done for c in self._calls)):
            # No forward call of this block still waits for its backward: its gradients are final.
            self._grads_final_sent = True
            for flat in self.flats:
                if flat.trainable and not flat.grad_empty:
                    self.ctx.grads_final(flat)
        if call is None:
            self._calls.clear()

    def __repr__(self) -> str:
        return f"Block({self.name!r}, {len(self.flats)} flat tensors, {self.nbytes} bytes, holds={self._holds})"


def fetched_bytes(layout: FlatLayout, dtype: torch.dtype) -> int:
    """Device bytes of a fetched flat tensor: the full tensor, plus at world size > 1 the shard
    it is gathered from."""
    extra = layout.shard_numel if layout.world_size > 1 else 0
    return (layout.padded_numel + extra) * dtype.itemsize


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

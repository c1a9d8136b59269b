"""`TieredState`: the root state of a wrapped model (its blocks, the shared StepContext, the
root hooks that start and end an iteration, the state-dict hooks), held in a side table keyed
by the model, and the queries on a wrapped model: `state_of`, `placement_manager`,
`step_stats`, `step_comm_bytes`, `full_state_dict`, `settle`, `close`."""

from __future__ import annotations

import contextlib
import sys
import threading
import weakref
from typing import Any, Callable, Iterator

import torch
from torch import nn

from tierzero.config import Config, Tier, format_size
from tierzero.layout import CommBytes, unique_params
from tierzero.placement import PlacementManager, StepStats
from tierzero.runtime.activations import Activations
from tierzero.runtime.activation_pack import opaque
from tierzero.runtime.blocks import Block
from tierzero.runtime.flat.fetch_group import discard_gathers
from tierzero.runtime.flat.flat_param import FlatParam
from tierzero.runtime.flat.capture import GradCapture
from tierzero.runtime.step.schedule import output_tensors
from tierzero.runtime.step.step_context import Phase, StepContext

_STATES: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[TieredState]]" = weakref.WeakKeyDictionary()
"""Side table: wrapped root module -> its state, both held weakly (the model holds its state
through its hooks; a strong value, which reaches the model, would keep both alive forever)."""


_OWNED: "weakref.WeakSet[nn.Module]" = weakref.WeakSet()
"""Side table: every module of a wrapped model (to refuse wrapping twice). A set: a value naming
the root would keep every wrapped model alive forever (a weak key held by its own value)."""


class TieredState:
    """The root state of a wrapped model: placement manager, blocks, prefetcher, root hooks."""

    def __init__(self, model: nn.Module, config: Config, ctx: StepContext, blocks: list[Block],
                 activations: Activations, renew: Callable[[], TieredState] | None = None) -> None:
        self.model = model
        self.config = config
        self.ctx = ctx
        self.blocks = blocks
        self.activations = activations
        """Non-root blocks in model order, then the root block."""
        self._flat_of: dict[int, tuple[FlatParam, int]] = {
            id(p): (flat, i) for b in blocks for flat in b.flats for i, p in enumerate(flat.params)}
        """id(parameter) -> (its FlatParam, its index there)."""
        self.param_order = [self._flat_of[id(p)] for p in model.parameters()]
        """(FlatParam, index) of each parameter in model.parameters() order."""
        self._handles: list[Any] = []
        self._saved_views = activations.saved
        self._renew = renew
        """wrapping.refresh of this model: the state that takes in parameters unfrozen since wrap."""
        self._grad_capture = GradCapture([(p, flat.grad, i) for b in blocks for flat in b.flats
                                          if flat.grad is not None for i, p in enumerate(flat.params)])

    @property
    def pm(self) -> PlacementManager:
        return self.ctx.pm

    def locate(self, p: torch.Tensor) -> tuple[FlatParam, int] | None:
        """(its FlatParam, its index there) of a parameter of this model; None for any other tensor."""
        found = self._flat_of.get(id(p))
        return found if found is not None and found[0].params[found[1]] is p else None

    def flat_params(self, *, trainable: bool | None = None) -> list[FlatParam]:
        return [f for b in self.blocks for f in b.flats if trainable is None or f.trainable == trainable]

    def register_hooks(self) -> None:
        for block in self.blocks:
            block.register_hooks()
            self._register_state_dict_hooks(block)
        self._handles.append(self.model.register_forward_pre_hook(opaque(self._root_pre_forward), prepend=True))
        self._handles.append(self.model.register_forward_hook(opaque(self._root_post_forward), always_call=True))

    def remove_hooks(self) -> None:
        """Every hook this state and its blocks registered, removed (a new root state takes over)."""
        for block in self.blocks:
            block.remove_hooks()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    # ------------------------------------------------------------------------ step lifecycle

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        if self in _GATHERED:
            raise RuntimeError(f"{type(module).__name__}: a forward inside tz.gathered_params(); run it after the "
                               "with block (the gathered parameters are fetched outside any step)")
        self.ctx.step.check_thread(type(module).__name__)
        if self.ctx.schedule.owns_forward:
            return  # a micro-batch of tz.accumulate's step, which began it once
        fresh = self.renewed()
        if fresh is not self:  # its hooks replaced these: the rest of this forward is its
            return fresh._root_pre_forward(module, args)
        self.begin_forward(module)

    def renewed(self) -> TieredState:
        """This state, or the one that replaces it once parameters frozen at wrap were unfrozen
        (wrapping.refresh, between steps)."""
        if not self.ctx.unfrozen or self._renew is None or self.ctx.step.phase is not Phase.IDLE or self.ctx.account.held:
            return self
        return self._renew()

    def begin_forward(self, module: nn.Module) -> None:
        """An iteration's forward starts (the root's pre-forward, or tz.accumulate's step)."""
        if self.ctx.step.backward_died():
            self.ctx.end_iteration(died=True)  # its final callback never ran; blocks reset below
        if self.ctx.step.phase is Phase.BACKWARD:
            return
        for block in self.blocks:
            block.begin_iteration()
        discard_gathers(self.ctx)
        grad = torch.is_grad_enabled()
        self.ctx.begin_iteration(grad=grad)
        assert self.ctx.prefetcher is not None
        self.ctx.prefetcher.begin((grad, module.training))
        if grad:
            self.activations.begin_iteration()
            self._saved_views.enter()

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """Runs even when the forward raised (always_call: then with no output, while torch
        handles the exception); a forward that raised is no trace to learn from, and one that
        `check_thread` refused changed nothing to undo."""
        if (self.ctx.step.phase is Phase.BACKWARD or self.ctx.step.owner is not threading.current_thread()
                or self.ctx.schedule.owns_forward):
            return
        self.end_forward(output)

    def end_forward(self, output: Any) -> None:
        """An iteration's forward is over (the root's post-forward, or tz.accumulate's step with
        the outputs of all its micro-batches); `output` None: it raised."""
        if self._saved_views.entered:
            self.activations.end_forward()
        self._saved_views.exit()
        outputs = [t for t in output_tensors(output) if t.requires_grad]
        if not torch.is_grad_enabled() or not outputs:
            self.ctx.end_iteration(died=output is None and sys.exc_info()[0] is not None)
        else:
            self._grad_capture.install(outputs)

    def abort_forward(self) -> None:
        """A step that raised: its forward ended as one that raised, unless it was over."""
        if self.ctx.step.phase is Phase.FORWARD:
            self.end_forward(None)

    @property
    def in_block_call(self) -> bool:
        """A block call's forward is running (its saved tensors go to its scope)."""
        return self.activations.saved.in_scope

    def end_backward(self) -> None:
        """Final callback of a backward pass (queued by the first pre-backward hook)."""
        with torch.profiler.record_function("tierzero::end_backward"):
            for block in self.blocks:
                block.post_backward(None)
            self.activations.end_backward()
            self.ctx.end_iteration()

    # --------------------------------------------------------------------------- state dicts

    def _register_state_dict_hooks(self, block: Block) -> None:
        for module in block.modules:
            params = [p for p in unique_params(module.parameters())
                      if self._flat_of.get(id(p), (None,))[0] in block.flats]
            if not params:
                continue
            ids = {id(p) for p in params}
            # in parameter order: every rank gathers the same flat tensors in the same order
            flats = list(dict.fromkeys(self._flat_of[id(p)][0] for p in params))
            self._handles += [
                module.register_state_dict_post_hook(
                    lambda m, sd, prefix, meta, ids=ids: self._save_hook(m, sd, prefix, ids)),
                module.register_load_state_dict_pre_hook(
                    lambda m, sd, prefix, meta, *rest, flats=flats: self._load_pre_hook(m, sd, prefix, meta, flats)),
                module.register_load_state_dict_post_hook(
                    lambda m, incompatible, flats=flats: self._load_post_hook(flats)),
            ]

    def _save_hook(self, module: nn.Module, state_dict: dict[str, Any], prefix: str, ids: set[int]) -> None:
        cache: dict[FlatParam, list[torch.Tensor]] = {}
        for name, p in module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False):
            if id(p) in ids and name in state_dict:
                flat, i = self._flat_of[id(p)]
                if flat not in cache:
                    cache[flat] = flat.read_full()
                state_dict[name] = cache[flat][i]

    def _load_pre_hook(self, module: nn.Module, state_dict: dict[str, Any], prefix: str,
                       local_metadata: dict[str, Any], flats: list[FlatParam]) -> None:
        """The flat tensors the state dict gives values for hold full CPU tensors to load into
        (the others are not read, nor written back: a partial load, such as peft's adapters,
        leaves a frozen base's home untouched)."""
        if local_metadata.get("assign_to_params_buffers", False):
            raise ValueError("load_state_dict(assign=True) would replace the parameters of a "
                             "tierzero-wrapped model; load with assign=False (the default)")
        given = {id(p) for n, p in module.named_parameters(prefix=prefix.rstrip("."), remove_duplicate=False)
                 if n in state_dict}
        for flat in flats:
            if any(id(p) in given for p in flat.params):
                flat.views.install_scratch(flat.read_full())

    def _load_post_hook(self, flats: list[FlatParam]) -> None:
        for flat in flats:
            if not flat.is_free:
                flat.write_full([p.data for p in flat.params])
                flat.views.uninstall()

    def __repr__(self) -> str:
        return (f"TieredState({type(self.model).__name__}, {len(self.blocks)} blocks, "
                f"phase={self.ctx.step.phase.value}, {self.pm!r})")


def adopt(model: nn.Module, state: TieredState) -> None:
    """Record `state` as the wrapped `model`'s (the end of tz.wrap)."""
    _STATES[model] = weakref.ref(state)
    _OWNED.update(model.modules())


def is_wrapped(model: nn.Module) -> bool:
    """Whether `model` is, or contains, a module of a tierzero-wrapped model."""
    return any(m in _OWNED for m in model.modules())


def _state(model: nn.Module) -> TieredState | None:
    ref = _STATES.get(model)
    return ref() if ref is not None else None


def _states() -> list[TieredState]:
    return [s for s in (ref() for ref in list(_STATES.values())) if s is not None]


def state_of(model: nn.Module) -> TieredState:
    """The tierzero state of a wrapped model, or of the one wrapped model inside `model` (a
    peft model around a wrapped transformers model); ValueError if there is none."""
    state = _state(model)
    if state is None:
        inner = [s for s in map(_state, model.modules()) if s is not None]
        if len(inner) == 1:
            return inner[0]
        raise ValueError(f"{type(model).__name__} is not wrapped by tierzero"
                         + (f" (it holds {len(inner)} wrapped models; pass one)" if inner else "")
                         + "; call tz.wrap(model, config) first")
    return state


def state_of_param(p: torch.Tensor, *, who: str) -> TieredState:
    """The state of the wrapped model `p` is a parameter of; ValueError naming `who` otherwise."""
    states = _states()
    for state in states:
        if state.locate(p) is not None:
            return state
    for state in states:  # added since wrap (peft's adapters): wrapping.refresh takes it in
        if any(q is p for q in state.model.parameters()):
            return state
    raise ValueError(f"{who}: a tensor of shape {tuple(p.shape)} is not a parameter of a tierzero-wrapped model; "
                     "tiered optimizers step a wrapped model's parameters (tz.wrap(model, config) first, then "
                     "give the model or parameters from its named_parameters())")


def placement_manager(model: nn.Module) -> PlacementManager:
    """The PlacementManager holding a wrapped model's state (budgets, peaks, telemetry)."""
    return state_of(model).pm


def step_stats(model: nn.Module) -> StepStats:
    """This step's stall seconds and bytes moved per tier and prefetch hits/misses, since the
    previous call (call it once per training step)."""
    return state_of(model).pm.recorder.reset_step()


def step_comm_bytes(model: nn.Module) -> CommBytes:
    """Bytes of the all-gathers, reduce-scatters and all-reduces this rank issued for the model
    since the previous call (call it once per training step; tierzero.layout.CommBytes)."""
    return state_of(model).ctx.comm.take()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's full state dict as CPU tensors (parameters in their original dtypes), for
    export. With several ranks every rank must call it (parameters are gathered from every
    rank's shard); rank 0 gets the dict, the other ranks an empty one."""
    state = state_of(model)
    sd = {k: v.detach().to("cpu") for k, v in model.state_dict().items()}
    return sd if state.ctx.rank == 0 else {}


_GATHERED: "weakref.WeakSet[TieredState]" = weakref.WeakSet()
"""Wrapped models inside tz.gathered_params() now."""


@contextlib.contextmanager
def gathered_params(model: nn.Module, modules: nn.Module | list[nn.Module] | None = None, *,
                    writable: bool = False) -> Iterator[None]:
    """Within the block, the wrapped model's parameters (those of `modules`, which may be any
    submodules; None: all) hold their full values, readable as plain tensors (FSDP's
    summon_full_params, DeepSpeed's GatheredParameters). Their blocks are fetched to the device
    tier like a forward fetches them, so they must fit its budget together (ValueError naming
    the bytes otherwise: gather fewer modules at a time). The values are in the compute dtype
    (fp32 compute: exactly the state dict's). writable=True: what the block changed in them is
    written back to their homes and master weights on exit (where fp32 master weights are kept
    apart from narrower parameters, only the elements whose value changed take it); False: changes
    are discarded (but on parameters homed on the device tier, which are the values themselves).
    Between steps only; with several ranks every rank enters it with the same modules."""
    state = state_of(model)
    ctx = state.ctx
    if ctx.step.phase is not Phase.IDLE or ctx.account.held or state in _GATHERED:
        raise RuntimeError("tz.gathered_params: the model is in a step or already gathered; use it between "
                           "training steps (after opt.step()), not inside a forward, a backward or another "
                           "gathered_params")
    ctx.drain_updates()
    blocks = _blocks_of(state, modules)
    need, room = sum(b.nbytes for b in blocks), ctx.account.free_bytes()
    if need > room:
        raise ValueError(f"tz.gathered_params: the {len(blocks)} block(s) asked for need {format_size(need)} "
                         f"({need} bytes) on the device tier at once, and its budget leaves {format_size(room)} "
                         f"({room} bytes) beside the device-homed tensors; pass fewer modules at a time "
                         "(e.g. one layer), or raise device_budget")
    _GATHERED.add(state)
    fetched: list[Block] = []
    try:
        for block in blocks:
            ctx.hold(block)
            try:
                block.group.fetch()
            except BaseException:
                ctx.release(block)
                raise
            fetched.append(block)
        yield
        while writable and fetched:  # block by block: one block's values in CPU memory at a time
            block = fetched.pop(0)
            values = [flat.views.held() for flat in block.flats]
            _release(block, discard=False)
            for flat, shard in zip(block.flats, values):
                flat.write_values(shard)
    finally:
        for block in fetched:
            _release(block, discard=True)
        _GATHERED.discard(state)


def _blocks_of(state: TieredState, modules: nn.Module | list[nn.Module] | None) -> list[Block]:
    blocks = [b for b in state.blocks if b.flats]
    if modules is None:
        return blocks
    wanted = set()
    for module in [modules] if isinstance(modules, nn.Module) else modules:
        located = [state.locate(p) for p in module.parameters()]
        wanted |= {found[0] for found in located if found is not None}
    return [b for b in blocks if any(f in wanted for f in b.flats)]


def _release(block: Block, *, discard: bool) -> None:
    """A gathered block back to FREE; `discard`: its device copies are dropped, so what was
    changed in them is not seen again."""
    ctx = block.ctx
    block.group.free()
    ctx.release(block)
    if discard:
        for flat in block.flats:
            if flat.param.home is not Tier.DEVICE:
                ctx.pm.drop(flat.param, Tier.DEVICE)


def settle(model: nn.Module) -> None:
    """Wait until the model's tiered state is at rest: the last opt.step()'s overlapped block
    updates done (Config.overlap_step), every dirty cached copy written home, every move landed.
    For measurements that attribute a step's traffic to the step, and before reading tensors
    through the placement manager directly; tierzero's own readers (state dicts, checkpoints,
    clipping, the next step) wait for the updates themselves."""
    state = state_of(model)
    state.ctx.drain_updates()
    state.pm.flush()


def close(model: nn.Module) -> None:
    """Free the model's tiered state (swap files, host memory, threads); the model cannot run
    afterwards. Idempotent."""
    state = state_of(model)
    if state.ctx.updates is not None:
        state.ctx.updates.close()  # the step's last updates land before the files go
    for flat in state.flat_params(trainable=True):
        if flat.grad is not None:
            flat.grad.capture.drop()  # of a backward that raised: its device buffer goes back
    try:
        state.activations.close()
    finally:
        state.pm.close()


def model_dtype(state: TieredState) -> torch.dtype:
    """The model's dtype as transformers reports it: its first floating parameter's (original)."""
    return next((d for f in state.flat_params() for d in f.orig_dtypes if d.is_floating_point), torch.float32)

"""`TieredState`: the root state of a wrapped model (its blocks, the shared StepContext, the
root hooks that start and end an iteration, the state-dict hooks), held in a side table keyed
by the model, and the queries on a wrapped model: `state_of`, `placement_manager`,
`step_stats`, `step_comm_bytes`, `full_state_dict`, `settle`, `close`."""

from __future__ import annotations

import sys
import threading
import weakref
from typing import Any

import torch
from torch import nn

from tierzero.config import Config
from tierzero.layout import CommBytes, unique_params
from tierzero.placement import PlacementManager, StepStats
from tierzero.runtime.blocks import Block, SavedParamViews, output_tensors
from tierzero.runtime.fetch_group import discard_gathers
from tierzero.runtime.flat_param import FlatParam
from tierzero.runtime.grads import GradCapture
from tierzero.runtime.step_context import Phase, StepContext

_STATES: "weakref.WeakKeyDictionary[nn.Module, TieredState]" = weakref.WeakKeyDictionary()
"""Side table: wrapped root module -> its state."""


_OWNED: "weakref.WeakKeyDictionary[nn.Module, nn.Module]" = weakref.WeakKeyDictionary()
"""Side table: every submodule of a wrapped model -> its root (to refuse wrapping twice)."""


class TieredState:
    """The root state of a wrapped model: placement manager, blocks, prefetcher, root hooks."""

    def __init__(self, model: nn.Module, config: Config, ctx: StepContext, blocks: list[Block]) -> None:
        self.model = model
        self.config = config
        self.ctx = ctx
        self.blocks = blocks
        """Non-root blocks in model order, then the root block."""
        self._flat_of: dict[int, tuple[FlatParam, int]] = {
            id(p): (flat, i) for b in blocks for flat in b.flats for i, p in enumerate(flat.params)}
        """id(parameter) -> (its FlatParam, its index there)."""
        self.param_order = [self._flat_of[id(p)] for p in model.parameters()]
        """(FlatParam, index) of each parameter in model.parameters() order."""
        self._handles: list[Any] = []
        self._saved_views = SavedParamViews(ctx)
        self._grad_capture = GradCapture([(p, flat.grad, i) for b in blocks for flat in b.flats
                                          if flat.grad is not None for i, p in enumerate(flat.params)])

    @property
    def pm(self) -> PlacementManager:
        return self.ctx.pm

    def flat_params(self, *, trainable: bool | None = None) -> list[FlatParam]:
        return [f for b in self.blocks for f in b.flats if trainable is None or f.trainable == trainable]

    def register_hooks(self) -> None:
        for block in self.blocks:
            block.register_hooks()
            self._register_state_dict_hooks(block)
        self._handles.append(self.model.register_forward_pre_hook(self._root_pre_forward, prepend=True))
        self._handles.append(self.model.register_forward_hook(self._root_post_forward, always_call=True))

    # ------------------------------------------------------------------------ step lifecycle

    def _root_pre_forward(self, module: nn.Module, args: Any) -> None:
        self.ctx.check_thread(type(module).__name__)
        if self.ctx.backward_died():
            self.ctx.end_iteration(died=True)  # its final callback never ran; blocks reset below
        if self.ctx.phase is Phase.BACKWARD:
            return
        for block in self.blocks:
            block.begin_iteration()
        discard_gathers(self.ctx)
        grad = torch.is_grad_enabled()
        self.ctx.begin_iteration(grad=grad)
        assert self.ctx.prefetcher is not None
        self.ctx.prefetcher.begin((grad, module.training))
        if grad:
            self._saved_views.enter()

    def _root_post_forward(self, module: nn.Module, args: Any, output: Any) -> None:
        """Runs even when the forward raised (always_call: then with no output, while torch
        handles the exception); a forward that raised is no trace to learn from, and one that
        `check_thread` refused changed nothing to undo."""
        if self.ctx.phase is Phase.BACKWARD or self.ctx.owner is not threading.current_thread():
            return
        self._saved_views.exit()
        outputs = [t for t in output_tensors(output) if t.requires_grad]
        if not torch.is_grad_enabled() or not outputs:
            self.ctx.end_iteration(died=output is None and sys.exc_info()[0] is not None)
        else:
            self._grad_capture.install(outputs)

    def end_backward(self) -> None:
        """Final callback of a backward pass (queued by the first pre-backward hook)."""
        with torch.profiler.record_function("tierzero::end_backward"):
            for block in self.blocks:
                block.post_backward(None)
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
                    lambda m, sd, prefix, meta, *rest, flats=flats: self._load_pre_hook(meta, flats)),
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

    def _load_pre_hook(self, local_metadata: dict[str, Any], flats: list[FlatParam]) -> None:
        if local_metadata.get("assign_to_params_buffers", False):
            raise ValueError("load_state_dict(assign=True) would replace the parameters of a "
                             "tierzero-wrapped model; load with assign=False (the default)")
        for flat in flats:
            flat.install_scratch(flat.read_full())

    def _load_post_hook(self, flats: list[FlatParam]) -> None:
        for flat in flats:
            flat.write_full([p.data for p in flat.params])
            flat.uninstall()

    def __repr__(self) -> str:
        return (f"TieredState({type(self.model).__name__}, {len(self.blocks)} blocks, "
                f"phase={self.ctx.phase.value}, {self.pm!r})")


def adopt(model: nn.Module, state: TieredState) -> None:
    """Record `state` as the wrapped `model`'s (the end of tz.wrap)."""
    _STATES[model] = state
    for m in model.modules():
        _OWNED[m] = model


def is_wrapped(model: nn.Module) -> bool:
    """Whether `model` is, or contains, a module of a tierzero-wrapped model."""
    return any(m in _OWNED for m in model.modules())


def state_of(model: nn.Module) -> TieredState:
    """The tierzero state of a wrapped model; ValueError if it is not wrapped."""
    state = _STATES.get(model)
    if state is None:
        raise ValueError(f"{type(model).__name__} is not wrapped by tierzero; call tz.wrap(model, config) first")
    return state


def placement_manager(model: nn.Module) -> PlacementManager:
    """The PlacementManager holding a wrapped model's state (budgets, peaks, telemetry)."""
    return state_of(model).pm


def step_stats(model: nn.Module) -> StepStats:
    """This step's stall seconds and bytes moved per tier and prefetch hits/misses, since the
    previous call (call it once per training step)."""
    return state_of(model).pm.telemetry.reset_step()


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
            flat.grad.drop_capture()  # of a backward that raised: its device buffer goes back
    state.pm.close()


def model_dtype(state: TieredState) -> torch.dtype:
    """The model's dtype as transformers reports it: its first floating parameter's (original)."""
    return next((d for f in state.flat_params() for d in f.orig_dtypes if d.is_floating_point), torch.float32)

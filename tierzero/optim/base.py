"""The block-by-block step of tz.AdamW / tz.SGD (torch.optim.Optimizer subclasses, so torch's
LR schedulers work) over a wrapped model's flat gradients.

The state of each block (fp32 master weights, owned by the runtime's FlatParam, and the
moments) lives on `config.optimizer_states`, reached through the runtime's BlockState. A step
walks the blocks in the last forward's order as a pipeline: block k+1's gradient and state are
read ahead while block k is updated on the CPU by torch's fused kernels (the bits of
torch.optim.AdamW/SGD(fused=True)) and block k-1's new state is written home. With
Config.step_in_backward each block is updated once backward has made its gradient final;
otherwise (Config.overlap_step) step() queues the updates to run under the next forward
([Note: overlapped step] in tierzero/runtime/step/step_queue.py). `.grad` is not used; zero_grad()
clears the flat gradients. Parameter groups follow torch's contract ([Note: parameter groups]).
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import weakref
from typing import Any, Callable, Iterable, Iterator, Sequence, Union

import torch
from torch import nn

from tierzero import runtime
from tierzero.layout import FlatLayout
from tierzero.optim import window_kernel
from tierzero.optim.saved import SavedState, then_collectives
from tierzero.runtime import BlockState, FlatGrad, FlatParam, Piece, StepQueue

READ_AHEAD = 2
"""Blocks whose gradient and state a step reads ahead of the one it updates: the drive always
has the next block's reads queued behind the current one's writes."""

UPDATE_CHUNK = 1 << 22
"""Elements updated at a time (16 MiB of fp32): bounds the scaled gradient's temporary."""

STATE_WINDOW = 1 << 18
"""Elements of the shard widened to fp32 at a time when states are kept in fewer bits (a
multiple of QUANT_BLOCK): the windows' fp32 room (1 MiB a state) stays in the CPU's caches
through the passes that decode, update and encode it ([Note: state windows])."""


# [Note: fused chunks]
# torch's fused CPU kernels run a vector loop and then a scalar loop for the last
# `numel % vector width` elements, whose roundings differ; cutting where a separate tensor per
# parameter would end puts every element in the same loop as torch.optim.AdamW(fused=True) over
# the model's parameters, so the bits are the same (at world size 1; a shard that cuts a
# parameter moves its tail).
#
# [Note: parameter groups]
# The optimizer takes a wrapped model (one group of its trainable parameters) or groups of its
# parameters (`model.named_parameters()` picked as users pick them; `add_param_group` later),
# each with its own hyper-parameters; a group may take some parameters of a block's flat tensor
# and another group the rest. Each element's update depends only on its own hyper-parameters and
# step count, and the fused kernel treats every tensor of its lists on its own: so the pieces of
# one chunk that share hyper-parameters go to one kernel call, whichever groups they come from
# and wherever they lie in the block (a group splits a flat tensor at parameter boundaries
# only), and the bits are those of torch's optimizer over the same groups.
def _update_batches(layout: FlatLayout, rank: int, skip: frozenset[int] = frozenset(),
                    classes: Sequence[int] | None = None, *,
                    windowed: bool = False) -> list[tuple[int, list[Piece]]]:
    """This rank's shard of `layout` as (lo, hi, parameter index) pieces, lo and hi in shard
    coordinates, in batches of at most UPDATE_CHUNK elements, leaving out the parameters in
    `skip` (by index: those without a gradient, which torch's optimizers skip). Each piece lies
    inside one parameter (padding is never updated), and a parameter longer than UPDATE_CHUNK is
    cut at multiples of UPDATE_CHUNK from its own start. `classes` (by parameter index) sorts
    the pieces of each chunk of UPDATE_CHUNK elements into one batch per class: (class, pieces),
    in the order each class first appears (None: one class, 0). `windowed` (states kept in
    fewer bits): every chunk lies in one window of STATE_WINDOW elements from the shard's start
    instead, and a parameter is cut at the windows' edges ([Note: state windows] in
    tierzero/runtime/update.py). See the Notes above."""
    start, stop = layout.shard_range(rank)
    chunks: list[list[Piece]] = [[]]
    room = UPDATE_CHUNK
    for i, slot in enumerate(layout.slots):
        if i in skip:
            continue
        lo, end = max(slot.offset, start), min(slot.offset + slot.numel, stop)
        while lo < end:
            if windowed:
                hi = min(end, start + ((lo - start) // STATE_WINDOW + 1) * STATE_WINDOW)
                if chunks[-1] and (chunks[-1][-1][1] - 1) // STATE_WINDOW != (lo - start) // STATE_WINDOW:
                    chunks.append([])
                    room = UPDATE_CHUNK
            else:
                hi = min(end, slot.offset + ((lo - slot.offset) // UPDATE_CHUNK + 1) * UPDATE_CHUNK)
            if hi - lo > room:
                chunks.append([])
                room = UPDATE_CHUNK
            chunks[-1].append((lo - start, hi - start, i))
            room -= hi - lo
            lo = hi
    batches = []
    for chunk in chunks:
        by_class: dict[int, list[Piece]] = {}
        for piece in chunk:
            by_class.setdefault(0 if classes is None else classes[piece[2]], []).append(piece)
        batches += by_class.items()
    return batches


def _windows(batches: list[tuple[int, list[Piece]]]) -> Iterator[tuple[list[tuple[int, list[Piece]]], int, int]]:
    """Windowed batches (`_update_batches(..., windowed=True)`) by window: (the batches, the
    window's first element, one past its last piece's end), in order."""
    by_window: dict[int, list[tuple[int, list[Piece]]]] = {}
    for c, pieces in batches:
        by_window.setdefault(pieces[0][0] // STATE_WINDOW, []).append((c, pieces))
    for w, group in by_window.items():
        yield group, w * STATE_WINDOW, max(p[-1][1] for _, p in group)


class TieredOptimizer(torch.optim.Optimizer):
    """The block-by-block step shared by AdamW and SGD; subclasses give the update math.

    The optimizer owns its moments (registered in each block's BlockState, zeros at the start,
    given back when a newer optimizer of the same model replaces this one); the master weights
    belong to the FlatParam (they hold the values), which the BlockState asks for."""

    _tierzero_steps_flat_gradients = True  # runtime.TIERED_OPTIMIZER: the guard lets it step
    state_kinds: tuple[str, ...] = ()
    """Flat fp32 state tensors per block besides the master weights, by placed kind name
    ("exp_avg", "momentum"; zeros at the start)."""

    def __init__(self, params: ParamsT, defaults: dict[str, Any]) -> None:
        self._model_state, groups = _owner_and_groups(params, type(self).__name__)
        if self._model_state.ctx.updates is not None:  # the last optimizer's step lands first
            self._model_state.ctx.updates.close()
        self._states: dict[FlatParam, BlockState] = {}
        """Per flat tensor a group covers: its master weights and moments."""
        self._steps: dict[FlatParam, list[int]] = {}
        """Per flat tensor, updates applied to each parameter (by index): torch counts AdamW's
        steps per parameter, and skips a parameter without a gradient."""
        self._flats: list[FlatParam] = []
        """The flat tensors some group covers, in the model's order."""
        self._group_of: dict[FlatParam, list[int | None]] = {}
        """Per flat tensor, the group of each parameter (by index; None: in no group)."""
        self._batches: dict[FlatParam, tuple[Any, list[tuple[int, list[Piece]]]]] = {}
        """Per flat tensor, its update batches for the last (skipped, group classes) asked for."""
        self._ready = False
        super().__init__(groups, defaults)  # add_param_group checks each group
        ref = _OPTIMIZER_OF.get(self._model_state.model)
        previous = ref() if ref is not None else None
        if previous is not None:
            previous._give_back_states()
        self._cover()
        self._ready = True
        _OPTIMIZER_OF[self._model_state.model] = weakref.ref(self)
        self._stepped: set[FlatParam] = set()
        """Flats updated during this step's backward (Config.step_in_backward)."""
        self._driver: str | None = None
        """The training loop that declared it clips and clears the flat gradients (driven_by)."""
        self._pending: list[cf.Future[None]] = []
        """Updates of Config.step_in_backward running on the updater thread."""
        self._updater: cf.ThreadPoolExecutor | None = None
        self._queue: StepQueue | None = None
        """The overlapped step's updates (None: step() updates inline)."""
        ctx = self._model_state.ctx
        config = self._model_state.config
        # Updates run on a thread of their own at any world size and on any device: their
        # collectives are handed back to the thread that drives the model's (StepQueue), and
        # their device work is ordered against compute by the copy streams' events.
        if config.overlap_step and not config.step_in_backward:
            self._queue = runtime.update_queue(self._model_state, READ_AHEAD)
            weakref.finalize(self, self._queue.close)
        if config.step_in_backward:
            ctx.on_grads_final(self._step_in_backward)
            ctx.on_iteration_end(self._drain)
            # A block's update runs on a thread of its own while backward computes the blocks
            # before it: the update mostly waits for its state's NVMe reads, which then overlap
            # backward's compute.
            self._updater = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="tierzero-update")
            weakref.finalize(self, self._updater.shutdown, wait=False)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """torch's add_param_group, for parameters of this optimizer's wrapped model: the
        state of the blocks the group reaches is registered now (zero moments)."""
        if self._ready:  # parameters unfrozen since: taken in, so that the group reaches them
            runtime.refresh(self._model_state.model)
            self._follow_refresh()
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        try:
            self._check_group(group)
            strangers = [tuple(p.shape) for p in group["params"] if self._model_state.locate(p) is None]
            if strangers:
                raise ValueError(
                    f"{type(self).__name__}: param group {len(self.param_groups) - 1} holds {len(strangers)} "
                    f"tensor(s) that are not parameters of the tierzero-wrapped {type(self._model_state.model).__name__} "
                    f"(shapes {strangers[:3]}); a tiered optimizer steps one wrapped model: give parameters from its "
                    "named_parameters(), and train other tensors with a torch optimizer")
            if self._ready:
                self._cover()
        except BaseException:
            self.param_groups.pop()
            raise

    def _check_group(self, group: dict[str, Any]) -> None:
        """ValueError for hyper-parameters the update cannot take (subclasses)."""

    def _cover(self) -> None:
        """Map every parameter of the groups to its flat tensor, and register the state of the
        flat tensors covered for the first time (a failure unregisters what it registered)."""
        state = self._model_state
        where: dict[FlatParam, list[int | None]] = {}
        for g, group in enumerate(self.param_groups):
            for p in group["params"]:
                located = state.locate(p)
                assert located is not None, "add_param_group checked it"
                flat, i = located
                if flat.grad is not None:  # a frozen flat tensor never has a gradient to step
                    where.setdefault(flat, [None] * len(flat.layout.slots))[i] = g
        flats = [f for f in state.flat_params(trainable=True) if f in where]
        registered: list[tuple[FlatParam, str]] = []
        try:
            for flat in flats:
                if flat not in self._steps:
                    self._states[flat] = BlockState(flat, state.config.optimizer_state_dtype)
                    self._steps[flat] = [0] * len(flat.layout.slots)
                for kind in self.state_kinds:
                    if kind not in self._states[flat].states:
                        self._states[flat].add(kind)
                        registered.append((flat, kind))
            runtime.check_update_fits(state, [self._states[f] for f in flats], type(self).__name__)
        except BaseException:  # nothing half-registered stays behind: a retry starts clean
            for flat, kind in registered:
                self._states[flat].remove(kind)
            for flat in flats:
                if flat not in self._flats:
                    self._states.pop(flat, None)
                    self._steps.pop(flat, None)
            raise
        self._flats, self._group_of = flats, where
        self._batches.clear()

    def _follow_refresh(self) -> None:
        """The model's flat tensors were built again since this optimizer last looked
        (runtime.refresh: parameters unfrozen or added): each parameter's moments and step count
        move to the flat tensor that holds it now (the master weights are the flat tensor's)."""
        state = runtime.state_of(self._model_state.model)
        if state is self._model_state:
            return
        live = set(state.flat_params(trainable=True))
        gone = [f for f in self._states if f not in live]
        self._model_state = state
        if not self._states:  # a newer optimizer took over: nothing to move
            self._flats = [f for f in self._flats if f in live]
            return
        if gone and state.ctx.world_size > 1:
            raise ValueError(
                f"{type(self).__name__}: the parameters of blocks {[f.name for f in gone]} were unfrozen or added "
                f"since this optimizer was built, and with {state.ctx.world_size} ranks their moments cannot move to "
                "the rebuilt blocks; build a new optimizer after unfreezing (tz.AdamW(model, ...))")
        moves: dict[FlatParam, list[tuple[int, int, int, dict[str, torch.Tensor], int]]] = {}
        for old in gone:
            states, steps = self._states.pop(old), self._steps.pop(old)
            values = {k: states.read(k) for k in states.states}
            for kind in states.states:
                states.remove(kind)
            for i, (p, slot) in enumerate(zip(old.params, old.layout.slots)):
                new, j = state.locate(p) or (None, 0)
                if new in live:
                    moves.setdefault(new, []).append((j, slot.offset, slot.numel, values, steps[i]))
        self._cover()
        for new, parts in moves.items():
            if new not in self._states:
                continue  # none of its parameters is in a group of this optimizer now
            block = self._states[new]
            for kind in block.states:
                moved = block.read(kind)
                for j, offset, numel, values, _ in parts:
                    at = new.layout.slots[j].offset
                    moved[at:at + numel] = values[kind][offset:offset + numel]
                block.store(kind, moved)
            for j, _, _, _, steps in parts:
                self._steps[new][j] = steps

    @property
    def flat_params(self) -> list[FlatParam]:
        """The blocks' flat tensors this optimizer updates (a step takes them in the last
        forward's order)."""
        self._follow_refresh()
        return list(self._flats)

    def saved_state(self) -> SavedState:
        """What a save takes of this optimizer and a load gives back (state dicts and
        tierzero.checkpoint), once the updates queued have landed."""
        self._follow_refresh()
        self._model_state.ctx.drain_updates()
        if self._flats:
            self._check_live()
        return SavedState(self, list(self._flats), {f: self._states[f] for f in self._flats}, self._steps)

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._check_live()
        self._follow_refresh()
        self._model_state.ctx.drain_updates()
        groups = [dict(g) for g in self.param_groups]  # as now: an LR scheduler changes them before queued updates run
        todo = [f for f in self._flats if not flat_grad(f).empty and f not in self._stepped]
        # in the last forward's order: the next forward's first block is updated first
        order = {name: i for i, name in enumerate(self._model_state.ctx.forward_order)}
        todo.sort(key=lambda f: order.get(f.name, len(order)))
        self._stepped.clear()
        for i, flat in enumerate(todo):
            update = functools.partial(self._step_flat, flat, groups, ahead=todo[i + 1:i + 1 + READ_AHEAD])
            if self._queue is None:
                then_collectives(update())
            else:
                self._queue.submit(flat.param, flat.name,
                                   runtime.beside_compute(self._model_state, update, flat.name, overlapped=True))
        return loss

    @torch.no_grad()
    def _step_in_backward(self, flat: FlatParam) -> None:
        """Config.step_in_backward: update `flat` now that backward has made its gradient final."""
        if flat in self._stepped:
            raise RuntimeError(
                f"{type(self).__name__}: a second backward reached block {flat.name!r} before "
                "opt.step(); with Config(step_in_backward=True) each backward updates the "
                "blocks it finishes, so call opt.step() after every backward (for gradient "
                "accumulation, set step_in_backward=False)")
        self._stepped.add(flat)
        if flat not in self._group_of:
            return  # a flat tensor no group covers: its gradient waits, as torch leaves p.grad
        i = self._flats.index(flat)
        # backward finishes blocks in reverse order: read the previous one's state meanwhile
        # (one only: backward's own reads compete for the host room, and a second block's
        # state read this early was measured to be pushed out before its update)
        ahead = self._flats[max(0, i - 1):i]
        groups = self.param_groups

        def update() -> Callable[[], None] | None:
            with torch.no_grad():
                collectives = self._step_flat(flat, groups, ahead=ahead, grads_ahead=False)
                flat_grad(flat).clear()  # used up: its host room goes back now, and it never reaches NVMe
                return collectives

        if self._updater is None:
            then_collectives(update())
        else:  # in order, one at a time, while backward goes on
            beside = runtime.beside_compute(self._model_state, update, flat.name, overlapped=False)
            self._pending.append(self._updater.submit(beside))

    def _drain(self) -> None:
        """Wait for the updates started during this backward, then run their collectives here,
        in order (the thread that drives the model's); raise the first error."""
        pending, self._pending = self._pending, []
        cf.wait(pending)
        for fut in pending:
            if fut.exception() is not None:
                raise fut.exception()
        for fut in pending:
            then_collectives(fut.result())

    def driven_by(self, loop: str) -> None:
        """Declare that `loop` (e.g. "tierzero.hf.Trainer") drives this optimizer and handles the
        flat gradients: clips with tz.clip_grad_norm_ and clears with this optimizer's zero_grad()."""
        self._driver = loop

    def train(self) -> None:
        """tz optimizers have no train/eval modes. This is the schedule-free optimizers' hook,
        which transformers' Trainer calls (through accelerate's optimizer wrapper) before every
        training step, before the forward; it refuses the plain Trainer there. The plain Trainer
        clips `p.grad` and clears gradients with `model.zero_grad()`, but a wrapped model keeps
        its gradients in flat shards that neither touches: it would log grad_norm 0, never clip,
        and sum the gradients of every step. tierzero.hf.Trainer calls `driven_by` first."""
        if self._driver is None:
            raise ValueError(
                f"{type(self).__name__}.train() was called: transformers' Trainer calls it before each "
                "training step. The plain transformers.Trainer cannot train a tierzero-wrapped model: it "
                "clips and clears `p.grad`, which tierzero leaves None (gradients live in flat shards), "
                "so it would log grad_norm 0, ignore max_grad_norm and sum the gradients of every step. "
                "Use tierzero.hf.Trainer (`from tierzero.hf import Trainer`; defined in "
                "tierzero/hf/trainer.py), a drop-in subclass of transformers.Trainer. In your own loop, drop "
                "the optimizer.train() call: tz optimizers have no train/eval modes")

    def _step_flat(self, flat: FlatParam, groups: list[dict[str, Any]], *, ahead: list[FlatParam],
                   grads_ahead: bool = True) -> Callable[[], None] | None:
        """Update `flat` with its groups' hyper-parameters; the blocks `ahead` start reading
        their state (and gradients, `grads_ahead`) once this block's state is pinned
        (BlockState.update). Returns the update's collectives (FlatParam.master_updated) for the
        caller to run on the thread that drives the model's."""
        states = self._live_states(flat)
        with states.update(ahead=[self._live_states(f) for f in ahead], grads_ahead=grads_ahead) as block:
            steps = self._steps[flat]
            for j, g in enumerate(self._group_of[flat]):
                if g is not None and j not in block.skip:
                    steps[j] += 1
            batches = self._batches_of(flat, block.skip, groups, windowed=block.windowed)
            run = self._update_windows if block.windowed else self._update_pieces
            run(groups, steps, block, batches)
        return block.collectives

    def _update_pieces(self, groups: list[dict[str, Any]], steps: list[int], block: runtime.BlockUpdate,
                       batches: list[tuple[int, list[Piece]]], *, windowed: bool = False) -> None:
        for c, pieces in batches:
            grads, tensors = block.pieces(pieces)
            if windowed:  # the fused window kernel's arithmetic, in torch ops
                window_kernel.eager_update_(self.kernel, grads, *tensors, rows=[self._row(groups[c], steps[j]) for _, _, j in pieces])
            else:
                self._update(groups[c], [steps[j] for _, _, j in pieces], grads, *tensors)

    def _update_windows(self, groups: list[dict[str, Any]], steps: list[int], block: runtime.BlockUpdate,
                        batches: list[tuple[int, list[Piece]]]) -> None:
        """States kept in fewer bits ([Note: state windows]): one pass of the fused kernel a window,
        else decoded, updated in torch ops, encoded: the same bits ([Note: fused state windows])."""
        step = max(steps)
        held = block.held()
        lib = window_kernel.for_held(self.kernel, held)
        if lib is None:
            for w, lo, hi in _windows(batches):
                with block.window(lo, hi, step):
                    self._update_pieces(groups, steps, block, w, windowed=True)
            return
        window_kernel.update_windows(lib, held, list(_windows(batches)), steps, lambda c, s: self._row(groups[c], s),
                                     *block.rounding(step))

    def _batches_of(self, flat: FlatParam, skip: frozenset[int], groups: list[dict[str, Any]], *,
                    windowed: bool = False) -> list[tuple[int, list[Piece]]]:
        """`flat`'s update batches (see the function `_update_batches`): the parameters in no group and those
        in `skip` left out, one batch per chunk and set of equal hyper-parameters, named by the
        first group that has them. Kept while the skipped parameters and the way the groups'
        hyper-parameters fall into sets stay the same (most steps)."""
        first: dict[Any, int] = {}
        same = tuple(first.setdefault(_hyper_key(g), i) for i, g in enumerate(groups))
        slots = self._group_of[flat]
        key = (skip, same, windowed)
        cached = self._batches.get(flat)
        if cached is None or cached[0] != key:
            unused = skip | {j for j, g in enumerate(slots) if g is None}
            classes = [-1 if g is None else same[g] for g in slots]
            cached = self._batches[flat] = (key, _update_batches(flat.layout, self._model_state.ctx.rank,
                                                                  frozenset(unused), classes, windowed=windowed))
        return cached[1]

    kernel: str = ""
    """The fused window kernel's optimizer (window_kernel.OPTIMIZERS) for states in fewer bits."""

    def _row(self, group: dict[str, Any], step: int) -> tuple[float, ...]:
        """The fused window kernel's hyper-parameters for `group` at a parameter's `step`."""
        raise NotImplementedError

    def _update(self, group: dict[str, Any], steps: list[int], grads: list[torch.Tensor],
                params: list[torch.Tensor], *states: list[torch.Tensor]) -> None:
        """Update `params` (fp32 master pieces) and `states` in place from `grads`, piece by
        piece; `steps`: each piece's parameter's update count, this update included."""
        raise NotImplementedError

    def zero_grad(self, set_to_none: bool = True) -> None:
        self._follow_refresh()
        for flat in self._flats:
            mine = [j for j, g in enumerate(self._group_of[flat]) if g is not None]
            if len(mine) == len(flat.layout.slots):
                clear = functools.partial(flat.clear_grad, set_to_none=set_to_none)
            else:  # torch's zero_grad leaves the gradients of parameters in none of its groups
                clear = functools.partial(flat_grad(flat).clear_slots, mine, set_to_none=set_to_none)
            if self._queue is None or not self._queue.clear_after(flat.param, clear):
                clear()

    def _live_states(self, flat: FlatParam) -> BlockState:
        self._check_live()
        return self._states[flat]

    def _check_live(self) -> None:
        if not self._states:
            raise RuntimeError(f"{type(self).__name__}: a newer tiered optimizer was created for this "
                               "model and took over its state; use that one")

    def _give_back_states(self) -> None:
        """A newer optimizer of the same model takes over: unregister this one's moments."""
        for states in self._states.values():
            for kind in states.states:
                states.remove(kind)
        self._states = {}

    # ------------------------------------------------------------------------- state dicts

    def state_dict(self) -> dict[str, Any]:
        """param_groups as torch packs them; "state" maps each block to its step count and its
        master weights and moments (SavedState.state_dict)."""
        return self.saved_state().state_dict(super().state_dict())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.saved_state().load_state_dict(state_dict)


_OPTIMIZER_OF: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[TieredOptimizer]]" = weakref.WeakKeyDictionary()
"""Side table: a wrapped model -> its tiered optimizer (the newest one), both weakly held (the
optimizer holds the model: a strong value would keep both alive forever)."""


ParamsT = Union[nn.Module, Iterable[torch.Tensor], Iterable[tuple[str, torch.Tensor]], Iterable[dict[str, Any]]]
"""What a tiered optimizer takes: a wrapped model (its trainable parameters, one group), or its
parameters as torch's optimizers take them (tensors, (name, tensor) pairs, or group dicts)."""


def _owner_and_groups(params: ParamsT, who: str) -> tuple[runtime.TieredState, list[Any]]:
    """The wrapped model `params` belong to, and the groups to give torch's Optimizer. What
    changed in the model since wrap is taken in first (runtime.refresh: peft's adapters added
    and its base frozen after tz.from_pretrained)."""
    if isinstance(params, nn.Module):
        state = runtime.refresh(params)
        trainable = [p for p in state.model.parameters() if p.requires_grad]
        if not trainable:
            raise ValueError(f"{who}: the model has no trainable parameters (requires_grad=True); nothing to optimize")
        return state, trainable
    if isinstance(params, torch.Tensor):
        raise TypeError(f"{who}: params must be a wrapped model or an iterable of its parameters (or of param "
                        f"group dicts), got a {type(params).__name__}")
    items = [dict(item, params=_listed(item["params"])) if isinstance(item, dict) else item for item in params]
    tensors = [t for item in items for t in (item["params"] if isinstance(item, dict) else [item])]
    tensors = [t[1] if isinstance(t, tuple) else t for t in tensors]
    if not tensors:
        raise ValueError(f"{who} got an empty parameter list; give the wrapped model, or parameters from its "
                         "named_parameters()")
    return runtime.refresh(runtime.state_of_param(tensors[0], who=who).model), items


def _listed(params: Any) -> Any:
    """A group's parameters as a list (a set is left for torch to refuse: it has no order)."""
    return [params] if isinstance(params, torch.Tensor) else params if isinstance(params, set) else list(params)


def _hyper_key(group: dict[str, Any]) -> tuple[Any, ...]:
    """A group's hyper-parameters as a hashable key (a tensor stands for itself)."""
    def hashable(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return ("tensor", id(v))
        return tuple(hashable(x) for x in v) if isinstance(v, (list, tuple)) else v
    return tuple((k, hashable(v)) for k, v in sorted(group.items()) if k not in ("params", "param_names"))


def flat_grad(flat: FlatParam) -> FlatGrad:
    assert flat.grad is not None, f"{flat.name} is not trainable"
    return flat.grad

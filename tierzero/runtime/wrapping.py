"""`tz.wrap(model, config)`: transparent tiered training of an unchanged nn.Module.

Autograd's `.grad` of the parameters stay None: gradients live in the flat gradients, which the
clip functions and the optimizers read and `optimizer.zero_grad()` clears (`p.grad` stands for
them in torch's clipping: grad_views.py). Outside a block's forward
and backward its parameters hold no data (a zero-stride placeholder of the right shape and
dtype that refuses to be read: placeholders.py): read values with `model.state_dict()`,
`tz.full_state_dict(model)` or inside `tz.gathered_params(model)`, write them with
`model.load_state_dict()` or inside `tz.gathered_params(model, writable=True)`. Parameters
added or frozen after wrap (peft over a wrapped base) are taken in by `refresh`.

The phases of a step: [Note: a wrapped step]; across ranks: [Note: ZeRO in a wrapped model].
Limits: blocks run outside the root module's forward are fetched but their saved views and
activations are not managed; a second backward through one graph (retain_graph=True) is not
supported.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import torch
from torch import nn

from tierzero.config import Config, Tier
from tierzero.formats import LoadedShard, check_buffers, init_buffers, init_params, load_buffers, open_weights
from tierzero.layout import ROOT, FlatLayout, assign_params, block_specs, flat_groups, group_modules
from tierzero.placement import PlacementManager
from tierzero.prefetch import Prefetcher, Unit, policy_from_config, prefetch_units
from tierzero.runtime.activations import Activations
from tierzero.runtime.blocks import Block
from tierzero.runtime.flat.collectives import agreement_group, broadcast_from_first_, rank_errors, world
from tierzero.runtime.flat.fetch_group import gather_ahead
from tierzero.runtime.flat.flat_param import FlatParam, borrows_checkpoint, shard_request
from tierzero.runtime.optimizer_guard import refuse_other_optimizers
from tierzero.runtime.split import checked_plan
from tierzero.runtime.state import TieredState, adopt, is_wrapped, state_of
from tierzero.runtime.step.step_context import Phase, StepContext

# ------------------------------------------------------------------------------- public API


# [Note: a wrapped step]
# Phases of one training step, once wrapped:
#
# 1. wrap (once): parameters are grouped into blocks (the repeated children, e.g. transformer
#    layers, plus a root block for everything else and for parameters shared between blocks);
#    each block's parameters are packed into flat tensors registered with the placement manager
#    on `config.params` in the compute dtype, with gradients on `config.grads`; the
#    parameters become placeholders; hooks are registered once. With `weights=` the flat tensors
#    are read from a checkpoint instead, one block at a time (tierzero/formats/weights.py), so the model
#    may be built on the meta device.
# 2. forward: the root's pre-hook starts an iteration of the prefetcher; each block's pre-hook
#    fetches it to the device (the prefetcher starts copies of the blocks ahead per the trace) and
#    points its parameters at the device copy; its post-hook releases it and hooks its outputs.
# 3. backward: the hook on a block's outputs fetches it again; after the block's backward
#    (`RegisterPostBackward` on its inputs) the parameters' .grad are added into the flat
#    gradient (Config.grad_dtype) and released; a final callback per backward sweeps up what is
#    left (the root block, blocks whose inputs needed no gradient) and ends the prefetcher's
#    iteration.
# 4. step: tz.AdamW / tz.SGD / tz.clip_grad_norm_ (tierzero.optim) read the flat gradients, update
#    fp32 master weights block by block, and store the new parameters on their home tier.
#
# During the root's forward, tensors autograd saves that view a block's device copy are saved as
# references into the block (activation_pack.SavedTensors), so the copy is really freed after the
# forward and rebuilt for backward; the other tensors a block call saves are placed per
# Config.activations, or recomputed (Config.activation_checkpointing): see activations.py and
# recompute.py.
#
# [Note: ZeRO in a wrapped model]
# Data parallelism (Config.zero_stage): with torch.distributed initialised, wrap uses the default
# process group (or `process_group=`). At stage 3 each rank tiers only its shard of every flat
# tensor, fetches all-gather the blocks (started ahead by the prefetcher), gradients are
# reduce-scattered and averaged, the optimizers step on shards; at stage 2 every rank keeps the
# whole parameters (fetched without communication; updated shards all-gathered after the step),
# at stage 1 the whole gradients too (all-reduced; tierzero.layout.ZeroStage). tz.clip_grad_norm_
# takes the global norm; buffers and parameters are broadcast from the group's first rank at wrap
# (see blocks.py and state.py). Every rank must run the same blocks in the same order (no
# rank-dependent control flow), and call state_dict(), load_state_dict() and tz.full_state_dict()
# together: they gather.
def wrap(model: nn.Module, config: Config, *, process_group: Any = None,
         weights: str | os.PathLike[str] | None = None, strict: bool = False) -> nn.Module:
    """Make `model` train with its state on tiers (see [Note: a wrapped step]); returns `model`.

    `weights`: a transformers model folder (sharded safetensors) or a .safetensors file to fill
    the tiers from, block by block, instead of the model's own values; the model may then be
    built on the meta device whatever its modules (see tierzero/formats/weights.py: host memory holds
    about one block at a time, every rank reads only its shard's rows, nothing is broadcast).
    Keys are matched by transformers' rules (tierzero/formats/load_rules.py; a peft model loads
    its base model's checkpoint): keys the model does not use are ignored, parameters the
    checkpoint lacks are initialised as transformers initialises new modules (real ones keep their
    values), both reported in one warning; `strict=True` refuses them instead.

    Raises ValueError for a model already wrapped, an unknown `config.block_classes` name, a
    device budget too small for the largest block plus the prefetch reserve, meta-device
    parameters in a module without `reset_parameters()` (without `weights`), or `weights` that do
    not match the model (mis-shaped keys; with strict, missing and unexpected ones; before the
    model is changed).
    """
    if not isinstance(model, nn.Module):
        raise ValueError(f"wrap: expected an nn.Module, got {type(model).__name__}")
    if is_wrapped(model):
        raise ValueError(f"wrap: {type(model).__name__} is or contains part of a tierzero-wrapped model; "
                         "wrap a model once (wrap the root module only)")
    rank, world_size = world(process_group)
    with contextlib.ExitStack() as files:
        plan = None
        if weights is None:
            _check_meta(model)
        else:  # every mismatch is found here, before the model changes
            plan = open_weights(model, weights, strict=strict)
            files.callback(plan.source.close)
            check_buffers(model, plan)
        groups = group_modules(model, config)
        owner = assign_params(model, groups)
        pm = PlacementManager(config, rank=rank, world_size=world_size)
        try:
            compute_dtype = getattr(torch, config.compute_dtype_name(cuda=pm.device.type == "cuda"))
            grad_dtype = getattr(torch, config.grad_dtype)
            specs = block_specs(model, groups, owner)
            layouts = [(name, modules, flat_groups(params, world_size, compute_dtype))
                       for name, modules, params in specs]
            placement = checked_plan(config, layouts, world_size, cuda=pm.device.type == "cuda")
            ctx = StepContext(pm=pm, compute_dtype=compute_dtype, tiers=placement.tiers,
                              rank=rank, world_size=world_size, group=process_group,
                              zero_stage=config.zero_stage, grad_dtype=grad_dtype)
            shards = None
            if plan is not None:
                init_buffers(model, plan)  # while the parameters are still as built
                init_params(model, plan)
                wanted = [shard_request(layout, [p.dtype for _, p in ps], compute_dtype,
                                        borrow=borrows_checkpoint(home_of(ctx, config, name, ps[0][1].requires_grad),
                                                                  ctx.zero))
                          for name, _, flats in layouts for ps, layout in flats]
                # closed before the files (the exit stack unwinds in reverse): no read left in flight
                shards = files.enter_context(contextlib.closing(plan.read_shards(wanted, rank, borrow=pm.borrow)))
            activations = Activations(ctx, config, root_bytes=placement.fetched_root,
                                      largest_block=placement.fetched_largest)
            blocks = [_build_block(name, modules, flats, ctx, config, activations, shards)
                      for name, modules, flats in layouts]
            if plan is not None:
                load_buffers(model, plan, pm.device)
            # the registers' NVMe writes landed: a disk error fails wrap, here (a load's blocks
            # kept dirty in host room are written when their room is needed, errors at a flush)
            pm.settle()
            pm.room.check_staging()  # every home is registered: a host tier too full fails here, not later
        except BaseException:
            pm.close()
            raise
    try:
        state = _start(model, config, ctx, blocks, activations)
    except BaseException:  # e.g. the buffers' broadcast failed: no swap file stays behind
        pm.close()
        raise
    adopt(model, state)
    refuse_other_optimizers(model)
    return model


def _start(model: nn.Module, config: Config, ctx: StepContext, blocks: list[Block],
           activations: Activations) -> TieredState:
    """The wrapped model's root state, once its blocks are built: buffers on the device (the
    same on every rank), the prefetcher, the hooks."""
    pm = ctx.pm
    for module in model.modules():
        for key, buf in module._buffers.items():
            if buf is not None and (buf.device != pm.device or not pm.copies.is_device(buf)):
                module._buffers[key] = pm.copies.to_device(buf)
    _broadcast_buffers(model, ctx)
    state = TieredState(model, config, ctx, blocks, activations, renew=lambda: refresh(model))
    groups = {b.name: b.group for b in blocks}
    if ctx.zero.gathers:
        ctx.agree_group = agreement_group(ctx.group)

    def gather_units(units: list[Unit]) -> None:
        gather_ahead(ctx, [groups[u.name] for u in units], list(groups.values()))

    def fetch_units(units: list[Unit]) -> None:
        """Blocks fetched ahead bring their placed activations with them (before a backward)."""
        if ctx.zero.gathers:
            gather_units(units)
        else:
            prefetch_units(pm, units, Tier.DEVICE)
        activations.prefetch(units)

    fetch_ahead = fetch_units if activations.placed else gather_units if ctx.zero.gathers else None
    prefetcher = Prefetcher(pm, [b.unit for b in blocks if b.flats], policy_from_config(config),
                            device_free=ctx.account.free_for_prefetch,
                            fetch_ahead=fetch_ahead,
                            device_wraps=not ctx.zero.gathers, busy=ctx.updating,
                            device_beside=ctx.account.beside)
    ctx.attach(prefetcher, state.end_backward, max((b.nbytes for b in blocks if b.flats), default=0))
    pm.room.policy = prefetcher
    state.register_hooks()
    ctx.comm.take()  # wrap's gathers (stages 1-2, weights=) are no step's traffic
    return state


def refresh(model: nn.Module) -> TieredState:
    """Take in what changed in a wrapped model since wrap, between steps: parameters added inside
    its modules (peft's adapters over a wrapped base: get_peft_model after tz.from_pretrained)
    are tiered as wrap tiers its own, in the block of their module, from their values; a flat
    tensor whose parameters were all frozen meanwhile (peft froze the base) becomes a frozen one
    (FlatParam.freeze: on Config.frozen's tier, without gradient or master weights; a
    copy-on-write home stays unwritten); parameters frozen at wrap and set to require a gradient
    since (progressive unfreezing) join their block's trainable flat tensor, registered anew from
    the values, with a gradient and master weights on their tiers. The flat tensors that did not
    change are kept; the blocks, hooks and prefetcher are built again (a new root state;
    returned). Nothing changed: the state as it is. The tiered optimizers and tierzero.hf.Trainer
    call it, and so does the next forward once a frozen parameter was unfrozen, so that the
    natural orders of LoRA over a tiered base, and of unfreezing, all train the same way."""
    state = state_of(model)
    state.ctx.unfrozen = False
    new = [(fqn, p) for fqn, p in state.model.named_parameters() if state.locate(p) is None]
    changed = [f for f in state.flat_params(trainable=True) if not any(p.requires_grad for p in f.params)]
    changed += [f for f in state.flat_params(trainable=False) if any(p.requires_grad for p in f.params)]
    if not new and not changed:
        return state
    ctx, config = state.ctx, state.config
    if ctx.step.phase is not Phase.IDLE or ctx.account.held:
        raise RuntimeError(f"{type(state.model).__name__}: parameters were added, frozen or unfrozen since tz.wrap, "
                           "which tierzero takes in between steps, not inside a forward or a backward")
    ctx.drain_updates()
    blocks = state.blocks
    owner = assign_params(state.model, [[(b.name, m) for m in b.modules] for b in blocks if b.name != ROOT])
    added: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for fqn, p in new:
        added.setdefault(blocks[owner.get(id(p), -1)].name, []).append((fqn, p))
    specs = [(b.name, b.modules, [(s.fqn, p) for f in b.flats for s, p in zip(f.layout.slots, f.params)]
              + added.get(b.name, [])) for b in blocks]
    checked_plan(config, [(name, modules, flat_groups(ps, ctx.world_size, ctx.compute_dtype))
                          for name, modules, ps in specs], ctx.world_size, cuda=ctx.pm.device.type == "cuda")
    rebuilt = [b if b.name not in added and not any(f in changed for f in b.flats)
               else Block(b.name, b.modules, _refreshed_flats(b, added.get(b.name, []), config), ctx, b.activations)
               for b in blocks]
    for old, block in zip(blocks, rebuilt):
        old.successor = block
    state.remove_hooks()
    fresh = _start(state.model, config, ctx, rebuilt, state.activations)
    adopt(state.model, fresh)
    refuse_other_optimizers(state.model)
    return fresh


def _refreshed_flats(block: Block, added: list[tuple[str, nn.Parameter]], config: Config) -> list[FlatParam]:
    """A block's flat tensors once `added` parameters join it, by what requires a gradient now:
    its trainable parameters in one flat tensor, then its frozen ones in another, as wrap builds
    them. A flat tensor that holds exactly one side's parameters is kept (frozen by `freeze`
    when its parameters were), but a frozen one whose parameters were unfrozen; any other side is
    registered anew from the values."""
    ctx = block.ctx
    params = [(s.fqn, p, d) for f in block.flats for s, p, d in zip(f.layout.slots, f.params, f.orig_dtypes)]
    params += [(fqn, p, p.dtype) for fqn, p in added]
    sides = [[x for x in params if x[1].requires_grad == trainable] for trainable in (True, False)]
    keep = [next((f for f in block.flats if {id(p) for p in f.params} == {id(p) for _, p, _ in side}
                  and (f.trainable or not trainable)), None)  # a frozen one unfrozen is registered anew
            for trainable, side in zip((True, False), sides)]
    values: dict[int, torch.Tensor] = {id(p): p.detach() for _, p in added}
    for flat in block.flats:
        if flat not in keep:  # its parameters go to a new flat tensor: their values first
            values.update({id(p): v for p, v in zip(flat.params, flat.read_full())})
            flat.close()
    if keep[1] is not None and keep[1].trainable:  # before a new flat tensor takes its name
        keep[1].freeze(home_of(ctx, config, block.name, False))
    out = []
    for trainable, side, flat in zip((True, False), sides, keep):
        if flat is None and side:
            layout = FlatLayout.build([f for f, _, _ in side], [p.shape for _, p, _ in side], ctx.world_size,
                                      itemsize=ctx.compute_dtype.itemsize)
            flat = FlatParam(block.name, [p for _, p, _ in side], layout, [d for _, _, d in side], ctx,
                             home_of(ctx, config, block.name, trainable))
            flat.register([values[id(p)] for _, p, _ in side])
            with torch._C.DisableTorchFunctionSubclass():  # autograd's .grad (grad_views.py)
                computed = any(p.grad is not None for p in flat.params)
            if flat.grad is not None and computed:
                flat.grad.accumulate(flat.params)  # a backward before the optimizer: its gradient is kept
        if flat is not None:
            out.append(flat)
    return out


def home_of(ctx: StepContext, config: Config, block: str, trainable: bool) -> Tier:
    """The home tier of a block's flat tensor of trainable or of frozen parameters."""
    return ctx.param_tier(block) if trainable else Tier(config.frozen_tier)


def _build_block(name: str, modules: list[nn.Module],
                 layouts: list[tuple[list[tuple[str, nn.Parameter]], FlatLayout]], ctx: StepContext, config: Config,
                 activations: Activations, shards: Iterator[LoadedShard] | None) -> Block:
    """The block's flat tensors (`layouts`: flat_groups), registered from the parameters'
    values, or from the next of `shards` (this rank's shards read from a checkpoint, in flat
    order: registered and dropped, so about one block is in memory)."""
    flats = []
    for ps, layout in layouts:
        if shards is None:
            _materialize([p for _, p in ps], modules, ctx.device)
        flat = FlatParam(name, [p for _, p in ps], layout, [p.dtype for _, p in ps], ctx,
                         home_of(ctx, config, name, ps[0][1].requires_grad))
        if shards is None:
            flat.register([p.detach() for _, p in ps])
        else:
            with torch.profiler.record_function(f"tierzero::load_weights {name}"):
                shard = next(shards)
            _unmeta([p for _, p in ps])
            flat.register_shard(shard)
            del shard  # before the next is asked for: two shards in memory, not three
        flats.append(flat)
    return Block(name, modules, flats, ctx, activations)


def _broadcast_buffers(model: nn.Module, ctx: StepContext) -> None:
    """Every rank starts with the first rank's buffers (running statistics, masks)."""
    for fqn, buf in model.named_buffers():
        with rank_errors(ctx.rank, ctx.world_size, f"broadcast of buffer {fqn!r} at wrap"):
            broadcast_from_first_(buf, ctx.group, ctx.world_size, ctx.pm.copies)


# ------------------------------------------------------------------------ meta-device models


def _check_meta(model: nn.Module) -> None:
    missing = [f"{fqn or type(model).__name__} ({type(m).__name__})" for fqn, m in model.named_modules()
               if _has_meta(m) and not callable(getattr(m, "reset_parameters", None))]
    if missing:
        raise ValueError(
            f"wrap: the model has parameters or buffers on the meta device in modules without "
            f"reset_parameters(): {missing[:6]}{' ...' if len(missing) > 6 else ''}; give those modules "
            "a reset_parameters() method that initialises their tensors, build the model on a real "
            "device, or fill it from a checkpoint with tz.wrap(model, config, weights=PATH)")


def _has_meta(module: nn.Module) -> bool:
    tensors = list(module._parameters.values()) + list(module._buffers.values())
    return any(t is not None and t.is_meta for t in tensors)


def _unmeta(params: list[nn.Parameter]) -> None:
    """Meta parameters become CPU ones holding no memory (same Parameter objects), so that their
    `.data` can point at tier copies and placeholders; their values come from a checkpoint."""
    for p in params:
        if p.is_meta:
            empty = torch.zeros((), dtype=p.dtype).expand(p.shape)
            torch.utils.swap_tensors(p, nn.Parameter(empty, requires_grad=p.requires_grad))


def _materialize(params: list[nn.Parameter], modules: list[nn.Module], device: torch.device) -> None:
    """Give meta parameters real memory (same Parameter objects) and initialise them with their
    module's reset_parameters(); modules are materialised whole, once, when first needed."""
    if not any(p.is_meta for p in params):
        return
    wanted = {id(p) for p in params if p.is_meta}
    for root in modules:
        for module in root.modules():
            if not _has_meta(module) or not any(id(p) in wanted for p in module._parameters.values() if p is not None):
                continue
            for key, p in module._parameters.items():
                if p is not None and p.is_meta:
                    torch.utils.swap_tensors(p, nn.Parameter(torch.empty(p.shape, dtype=p.dtype),
                                                             requires_grad=p.requires_grad))
            for key, b in module._buffers.items():
                if b is not None and b.is_meta:
                    module._buffers[key] = torch.empty(b.shape, dtype=b.dtype, device=device)
            with torch.no_grad():
                module.reset_parameters()

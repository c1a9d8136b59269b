"""`PlacementPlan`: where every block's state lives and what a step holds on each tier, computed
once from a Config and a model's blocks; `tz.wrap` checks it, the planning prints it.

Arithmetic only: the runtime builds it at wrap, `tierzero.planning` from a model on the meta
device, and both read the same figures (least budgets, "auto"'s choice, NVMe bytes a step).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Sequence

from tierzero.config import (KINDS, TIER_NAMES, Config, ElementBytes, format_size, round_up, shares, update_tier,
                             windowed_bytes)
from tierzero.layout.grouping import ROOT
from tierzero.layout.sizes import fetched_numel
from tierzero.layout.split import BlockTiers, split_blocks
from tierzero.layout.state_bytes import (Blocks, FlatTensor, KindSizes, kind_sizes, placement_order, state_tensors,
                                         tier_need)
from tierzero.layout.zero import ZeroStage

# [Note: one placement plan]
# Every figure a user plans with is this plan's: the least budgets `tierzero estimate` prints,
# the check `tz.wrap` refuses by, the split "auto" chooses, the splits `tierzero tune` weighs.
# Per tier the plan holds the flat tensors homed there (each rounded to the page the tier
# allocates in) and the room the step takes there beside them:
#
#     device  the fetched blocks: the root block and the largest block at once (the root is held
#             through forward and backward), plus the bytes policy's reserve; none when every
#             parameter lives on the device whole. Config.device_reserve (the step's working set).
#             The gradient a device update copies in when it lives elsewhere.
#     host    the larger of two working sets that never overlap for long: the largest block's
#             update (its NVMe-homed gradient, master weights and moments staged, a device
#             gradient copied in, the new parameters' staging buffer where NVMe-homed parameters
#             are not the master weights, and under step_in_backward the root's gradient that
#             backward holds), and the staging of the largest NVMe-homed tensor. Where the host
#             tier is one pinned region (CUDA, the stream stand-in) the update asks the room in
#             which its buffers always find windows ([Note: working set windows]).
#     nvme    the homes alone.
#
# The least budgets are the homes plus that room: wrap accepts them, and one page less on any
# tier is refused at once, naming every tier that falls short. "auto" chooses, kind by kind in
# the order params, grads, optimizer states (params move the most NVMe bytes per byte homed: read
# twice, written once), among every run of blocks on the device, then the host, then NVMe, the
# one that fits the budgets and moves the fewest NVMe bytes a step (then the most on the device,
# then on the host). With grads=None the gradients go where their updates run; only when no run
# fits so (the budgets call for it) does a block whose states land on NVMe take its gradient there
# too, as grads=None promises (the gradients where their updates run) wherever it can be kept.
# Its least budgets are those of every "auto" kind on
# the slowest tier it may use. The runs are cut by the split rule ([Note: split placement]), so
# the Config "auto" resolves to places the same blocks when it is wrapped again.

NVME_MOVES = {"params": 3, "frozen": 2, "grads": 2, "master": 2, "moments": 2}
"""NVMe bytes a step moves per byte homed there, by flat tensor kind ([Note: least NVMe traffic]
in tierzero/planning/traffic.py): parameters read for forward and backward and written once, a
frozen base read twice, the rest read once and written once."""


@dataclass(frozen=True)
class PlanInputs:
    """What a plan is computed from besides the Config: a model's blocks on one rank."""

    blocks: Blocks
    """(name, flat groups) per block, in the placement order (root first)."""
    zero: ZeroStage
    element: ElementBytes
    cuda: bool
    """The device is a GPU: its buffers are exact sizes (the CPU's are whole pages)."""
    pinned_host: bool
    """The host tier is one pinned region (CUDA, the stream stand-in): windows for working sets."""
    sizes: KindSizes = field(init=False)
    fetched: dict[str, int] = field(init=False)
    """Device bytes of each block while fetched (all its flat tensors)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "blocks", [self.blocks[i] for i in placement_order([n for n, _ in self.blocks])])
        object.__setattr__(self, "sizes", kind_sizes(self.blocks, self.zero, self.element))
        gathered = self.zero.gathers
        object.__setattr__(self, "fetched", {
            name: sum(self.device_bytes(self.element.nbytes("params", fetched_numel(lay, gathered=gathered)))
                      for _, lay in flats) for name, flats in self.blocks})

    @classmethod
    def of(cls, config: Config, blocks: Blocks, world_size: int, *, cuda: bool) -> "PlanInputs":
        pinned = cuda or config.stream_settings().mode == "async"
        return cls(blocks, ZeroStage(config.zero_stage, world_size), config.element_bytes(cuda=cuda), cuda, pinned)

    @property
    def names(self) -> list[str]:
        return [name for name, _ in self.blocks]

    def device_bytes(self, nbytes: int) -> int:
        """Bytes a device buffer of `nbytes` takes from the device budget."""
        return nbytes if self.cuda else round_up(nbytes)


@dataclass(frozen=True)
class PlacementPlan:
    """Each block's tier per kind, each tier's homed bytes and the room a step holds there
    ([Note: one placement plan]); `check()` refuses budgets that cannot hold them."""

    config: Config
    """As given ("auto" included)."""
    resolved: Config
    """`config` with every "auto" kind replaced by the split chosen."""
    tiers: BlockTiers
    tensors: tuple[FlatTensor, ...]
    homes: dict[str, int]
    """Bytes each tier's budget gives the flat tensors homed there."""
    room: dict[str, dict[str, int]]
    """Per tier, what the step holds there beside the homes, by what it is."""
    least: dict[str, int]
    """The least budget of each tier: the homes and the room ("auto": on its slowest tiers)."""
    largest: str
    """The name of the largest block besides the root, as fetched."""
    fetched_largest: int
    """Device bytes of that block while fetched."""
    fetched_root: int
    """Device bytes of the root block while fetched (held through forward and backward)."""
    window: int
    """Device bytes of the fetched blocks at once (0: every parameter lives there whole)."""
    update_sets: dict[str, int]
    """Host bytes each block's update holds (the largest is part of the host's room)."""

    @classmethod
    def build(cls, config: Config, inputs: PlanInputs) -> "PlacementPlan":
        """The plan of `config` for the blocks of `inputs`, "auto" chosen at its budgets."""
        resolved = _choose(config, inputs) if _autos(config) else config
        plan = _plan(config, resolved, inputs)
        if _autos(config):
            least = _plan(config, _frugal(config, inputs), inputs).need
            return dataclasses.replace(plan, least=least)
        return plan

    @property
    def need(self) -> dict[str, int]:
        """Bytes of each tier's budget this plan takes: its homes and its room."""
        return {t: self.homes[t] + sum(self.room[t].values()) for t in TIER_NAMES}

    def short(self) -> list[str]:
        """The tiers whose budget is under what the plan takes."""
        need = self.need
        return [t for t in TIER_NAMES if need[t] > self.config.budget(t)]

    @property
    def nvme_step_bytes(self) -> int:
        """NVMe bytes one step moves with nothing cached (NVME_MOVES of each NVMe-homed tensor;
        parameters that are the master weights are read by the step once more)."""
        masters = {t.block for t in self.tensors if t.kind == "master"}
        total = 0
        for t in self.tensors:
            if t.home != "nvme":
                continue
            moves = NVME_MOVES[t.kind]
            if t.kind == "grads" and self.config.step_in_backward:
                moves = 0
            if t.kind == "params" and t.block not in masters and self.tiers.optimizer_states.get(t.block) == "nvme":
                moves += 0 if self.config.step_in_backward else 1
            total += moves * t.nbytes
        return total

    def check(self) -> None:
        """ValueError naming every tier whose budget is under what this plan takes, with the
        bytes and what they hold; for "auto", the least budgets at which it trains."""
        short = self.short()
        if not short:
            return
        need = self.need
        placed = ", ".join(f"{k}={getattr(self.config, k)!r}" for k in KINDS)
        detail = "; ".join(self._shortfall(t, need[t]) for t in short)
        least = ", ".join(f"{t}_budget {self.least[t]}" for t in TIER_NAMES)
        raise ValueError(
            f"the placement {placed} cannot fit: {detail}. Over budget: {', '.join(short)}. The least budgets this "
            f"placement trains in are {least} (bytes; `tierzero estimate` prints them): raise "
            f"{' and '.join(t + '_budget' for t in short)}, or place state on a slower tier"
            + ("" if _autos(self.config) else " (or 'auto', which fills each tier to its budget)")
            + f"; optimizer states are counted as AdamW keeps them (master weights in {self.config.master_dtype}, two "
              f"moments in {self.config.optimizer_state_dtype})")

    def _shortfall(self, tier: str, need: int) -> str:
        budget = self.config.budget(tier)
        parts = [f"{what} ({format_size(n)})" for what, n in self.room[tier].items() if n]
        parts += [f"the tensors homed there ({format_size(self.homes[tier])})"] if self.homes[tier] or not parts else []
        return (f"{tier}: {format_size(need)} ({need} bytes) needed, budget {format_size(budget)}: {tier}_budget "
                f"{format_size(budget)} ({budget} bytes) is smaller than " + " and ".join(parts)
                + f"; raise {tier}_budget to at least {need} bytes")


def _autos(config: Config) -> list[str]:
    return [k for k in KINDS if getattr(config, k) == "auto"]


def _tiers(config: Config, inputs: PlanInputs) -> BlockTiers:
    """Each block's tier per kind under `config` (no "auto"): the split rule per kind; grads=None:
    where each block's update runs."""
    sizes = inputs.sizes
    out = {kind: split_blocks(getattr(sizes, kind), shares(getattr(config, kind)))
           for kind in ("params", "optimizer_states")}
    out["grads"] = ([update_tier(t) for t in out["optimizer_states"]] if config.grads is None
                    else split_blocks(sizes.grads, shares(config.grads)))
    return BlockTiers.build(inputs.names, out)


def _plan(config: Config, resolved: Config, inputs: PlanInputs) -> PlacementPlan:
    tiers = _tiers(resolved, inputs)
    tensors = tuple(state_tensors(inputs.blocks, tiers, config.frozen_tier, inputs.zero, inputs.element))
    room, largest, window, update_sets = _room(config, inputs, tiers, tensors)
    plan = PlacementPlan(config, resolved, tiers, tensors, tier_need(tensors), room, {}, largest,
                         inputs.fetched.get(largest, 0), inputs.fetched.get(ROOT, 0), window, update_sets)
    return dataclasses.replace(plan, least=plan.need)


def _room(config: Config, inputs: PlanInputs, tiers: BlockTiers,
          tensors: Sequence[FlatTensor]) -> tuple[dict[str, dict[str, int]], str, int, dict[str, int]]:
    """What a step holds on each tier beside the homes ([Note: one placement plan])."""
    fetched = dict(inputs.fetched)
    root = fetched.pop(ROOT, 0)
    largest = max(fetched, key=fetched.get, default="(none)")
    whole = not inputs.zero.gathers and all(t.home == "device" for t in tensors if t.kind in ("params", "frozen"))
    reserve = (config.prefetch.reserve or 0) if config.prefetch.policy == "bytes" else 0
    by_block: dict[str, dict[str, list[FlatTensor]]] = {}
    for t in tensors:
        by_block.setdefault(t.block, {}).setdefault(t.kind, []).append(t)
    root_grad = [t.nbytes for t in by_block.get(ROOT, {}).get("grads", []) if t.home == "nvme"]
    device_update, updates = 0, {}
    for name, kinds in by_block.items():
        if "grads" not in kinds:
            continue  # frozen only: no update
        (grad,), (param,) = kinds["grads"], kinds["params"]
        masters = kinds.get("master", [])  # none: the parameters are the master weights
        staged = []  # host buffers the block's update holds at once
        if update_tier(tiers.optimizer_states[name]) == "host":
            staged += [t.nbytes for t in masters + kinds.get("moments", []) if t.home == "nvme"]
            if param.home == "nvme":
                staged.append(param.nbytes)  # staged as the master weights, or the new parameters' buffer
            if grad.home != "host":
                staged.append(grad.nbytes)  # staged from NVMe, or copied from the device
            if config.step_in_backward and name != ROOT:
                staged += root_grad  # backward holds it meanwhile ([Note: room held through backward])
        else:
            if grad.home != "device":
                device_update = max(device_update, inputs.device_bytes(grad.nbytes))
            if masters and param.home == "nvme":
                staged.append(param.nbytes)
        updates[name] = windowed_bytes(staged) if inputs.pinned_host else sum(round_up(n) for n in staged)
    host_update = max(updates.values(), default=0)
    staging = max((round_up(t.nbytes) for t in tensors if t.home == "nvme"), default=0)
    window = 0 if whole else root + fetched.get(largest, 0) + reserve
    device = {f"the root block ({format_size(root)}) plus the largest block {largest!r} "
              f"({format_size(fetched.get(largest, 0))}) plus the prefetch reserve ({format_size(reserve)}), "
              "fetched at once": window,
              "the step's working set (Config.device_reserve)": config.device_reserve,
              "a device update's gradient copied in": device_update}
    what = "a block's update or an NVMe-homed tensor, staged through host memory"
    if inputs.pinned_host:  # [Note: working set windows]
        what += (" (in the host tier's one pinned region the last buffer an update takes needs a free run of its "
                 "size between the others)")
    host = {what: max(host_update, staging)}
    return {"device": device, "host": host, "nvme": {}}, largest, window, updates


# ------------------------------------------------------------------------------------ "auto"


def _frugal(config: Config, inputs: PlanInputs) -> Config:
    """`config` with every "auto" kind on the slowest tier it may use (the least budgets)."""
    last = "nvme" if config.nvme_dir is not None else "host"
    best = None
    for grads_too in (False, True) if config.grads is None and last == "nvme" else (False,):
        cfg = config.replace(**dict.fromkeys(_autos(config), last))
        if grads_too:
            cfg = cfg.replace(grads=_with_states(cfg, inputs))
        need = _plan(config, cfg, inputs).need
        if best is None or need["device"] + need["host"] < best[0]:
            best = (need["device"] + need["host"], cfg)
    assert best is not None
    return best[1]


def _with_states(cfg: Config, inputs: PlanInputs) -> str | dict[str, float]:
    """grads=None's tiers, but NVMe for a block whose optimizer states are there: as a split."""
    states = split_blocks(inputs.sizes.optimizer_states, shares(cfg.optimizer_states))
    return _fractions(inputs.sizes.grads, [t if t == "nvme" else update_tier(t) for t in states])


def _fractions(sizes: Sequence[int], tiers: Sequence[str]) -> str | dict[str, float]:
    """The split whose rule puts each block of `sizes` on `tiers` (runs in block order)."""
    total = sum(sizes)
    if not total:
        return tiers[0] if tiers else "host"
    split = dict.fromkeys(TIER_NAMES, 0.0)
    for n, t in zip(sizes, tiers):
        split[t] += n / total
    whole = [t for t, f in split.items() if f >= 1.0]
    if whole:
        return whole[0]
    last = max(split, key=split.get)
    split[last] = 1.0 - sum(f for t, f in split.items() if t != last)
    return split


def _runs(n: int, order: Sequence[str]) -> list[list[str]]:
    """Every assignment of `n` blocks to runs of `order`'s tiers, in block order."""
    if len(order) == 1:
        return [[order[0]] * n]
    out = []
    for d in range(n, -1, -1):
        for rest in _runs(n - d, order[1:]):
            out.append([order[0]] * d + rest)
    return out


def _choose(config: Config, inputs: PlanInputs) -> Config:
    """`config` with each "auto" kind resolved ([Note: one placement plan])."""
    order = ["device", "host"] + (["nvme"] if config.nvme_dir is not None else [])
    autos = _autos(config)
    frugal = _frugal(config, inputs)
    chosen = config.replace(**{k: getattr(frugal, k) for k in autos})  # the kinds not chosen yet: frugal
    if config.grads is None:
        chosen = chosen.replace(grads=None)
    # grads=None: gradients where their updates run; on NVMe with their states only when nothing
    # fits so (the budgets call for it)
    modes = [False, True] if config.grads is None and "nvme" in order else [False]
    for kind in autos:
        sizes = getattr(inputs.sizes, kind)
        best: tuple[tuple[int, int, int], Config] | None = None
        for grads_too in modes:
            for run in _runs(len(sizes), order):
                split = _fractions(sizes, run)
                option = chosen.replace(**{kind: split})
                if config.grads is None:
                    option = option.replace(grads=_with_states(option, inputs) if grads_too else None)
                plan = _plan(config, option, inputs)
                if plan.short():
                    continue
                placed = dict.fromkeys(TIER_NAMES, 0)
                for n, t in zip(sizes, split_blocks(sizes, shares(split))):
                    placed[t] += n
                key = (plan.nvme_step_bytes, -placed["device"], -placed["host"])
                if best is None or key < best[0]:
                    best = (key, option)
            if best is not None:
                break
        if best is not None:
            chosen = best[1]
    return chosen

"""Which modules form a block, and which block owns each parameter: the one rule that
`tz.wrap` builds blocks by and `tierzero.planning` sizes them by.

A block is a repeated child of the model (a transformer layer, one layer of an MLP stack), or a
module of a class named in `config.block_classes`; blocks smaller than `config.min_block_bytes`
are merged with their neighbour. Everything else, and every parameter shared between blocks
(tied weights), belongs to the root block.
"""

from __future__ import annotations

from typing import Iterable

from torch import nn

from tierzero.config import Config

ROOT = "root"
"""Name of the root block in the placement manager (its tensors are "root.param", ...)."""


def unique_params(params: Iterable[nn.Parameter]) -> list[nn.Parameter]:
    return list({id(p): p for p in params}.values())


def param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in unique_params(module.parameters()))


def group_modules(model: nn.Module, config: Config) -> list[list[tuple[str, nn.Module]]]:
    """Module groups, one per non-root block, in model order."""
    if config.block_classes:
        wanted = set(config.block_classes)
        present = {type(m).__name__ for m in model.modules()}
        unknown = sorted(wanted - present)
        if unknown:
            with_params = sorted({type(m).__name__ for m in model.modules() if m._parameters})
            raise ValueError(
                f"block_classes: no module of class {unknown} in {type(model).__name__}; classes in "
                f"this model: {sorted(present)} (with parameters of their own: {with_params}); "
                "give class names from that list, or block_classes=() to find the repeated layers")
        found: list[tuple[str, nn.Module]] = []

        def walk(prefix: str, module: nn.Module) -> None:
            for name, child in module.named_children():
                fqn = f"{prefix}{name}"
                if type(child).__name__ in wanted:
                    found.append((fqn, child))
                else:
                    walk(f"{fqn}.", child)

        walk("", model)
    else:
        found = repeated_children(model)
    groups = [[item] for item in found if param_count(item[1])]
    if config.min_block_bytes and groups:
        merged: list[list[tuple[str, nn.Module]]] = [groups[0]]
        for group in groups[1:]:
            if sum(param_count(m) for _, m in merged[-1]) * 4 < config.min_block_bytes:
                merged[-1] = merged[-1] + group
            else:
                merged.append(group)
        groups = merged
    return groups


def repeated_children(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Children of the ModuleList/Sequential with the most parameters whose children that have
    parameters are all of one class (transformer layers, an MLP stack); [] when there is none."""
    best: tuple[int, list[tuple[str, nn.Module]]] = (0, [])
    for fqn, module in model.named_modules():
        if module is model or not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        kids = [(f"{fqn}.{n}", c) for n, c in module.named_children() if param_count(c)]
        if len(kids) >= 2 and len({type(c) for _, c in kids}) == 1:
            size = param_count(module)
            if size > best[0]:
                best = (size, kids)
    return best[1]


def assign_params(model: nn.Module, groups: list[list[tuple[str, nn.Module]]]) -> dict[int, int]:
    """id(parameter) -> index of its block; -1 for the root (outside every block, or shared
    between blocks: tied weights belong to the root, used by both)."""
    owner: dict[int, int] = {}
    for i, group in enumerate(groups):
        for _, module in group:
            for p in unique_params(module.parameters()):
                owner[id(p)] = i if owner.get(id(p), i) == i else -1
    return owner


BlockSpec = tuple[str, list[nn.Module], list[tuple[str, nn.Parameter]]]


def block_specs(model: nn.Module, groups: list[list[tuple[str, nn.Module]]], owner: dict[int, int]) -> list[BlockSpec]:
    """(name, modules, [(fqn, parameter)]) per block: the groups in order, then the root."""
    params: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(len(groups) + 1)]
    for fqn, p in model.named_parameters():
        params[owner.get(id(p), -1)].append((fqn, p))
    specs: list[BlockSpec] = []
    for group, ps in zip(groups, params):
        name = group[0][0] if len(group) == 1 else f"{group[0][0]}+{len(group) - 1}"
        specs.append((name, [m for _, m in group], ps))
    specs.append((ROOT, [model], params[-1]))
    return specs


def blocks_of(model: nn.Module, config: Config) -> list[BlockSpec]:
    """The blocks `tz.wrap(model, config)` builds: the groups in model order, then the root."""
    groups = group_modules(model, config)
    return block_specs(model, groups, assign_params(model, groups))

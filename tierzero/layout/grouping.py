"""Which modules form a block, and which block owns each parameter: the one rule that
`tz.wrap` builds blocks by and `tierzero.planning` sizes them by.

A block is a module of a class named in `config.block_classes`, or by default what
`default_blocks` finds: the repeated layers (transformer layers, an MLP stack), then the modules
outside them that hold parameters only through their children (a CNN's stages, a UNet's down and
up blocks). Blocks smaller than `config.min_block_bytes` are merged with their neighbour.
Everything else, and every parameter shared between blocks (tied weights), belongs to the root.
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
        found = default_blocks(model)
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


# [Note: default blocks]
# The root is fetched for every step, so the default blocks leave in it only what no block can
# take. First the repeated layers (`repeated_children`: the largest ModuleList or Sequential of
# one class), as ever: a transformer's blocks are its layers and nothing else, its embeddings
# and head stay in the root. Then, walking the modules outside those layers:
# - a ModuleList / Sequential / ModuleDict, or a module holding a chosen layer: its children
#   are walked;
# - a module with parameters of its own (an Embedding, a Linear, a norm; or a module that mixes
#   its own parameters with its children's in its forward): stays in the root, whole;
# - a module holding parameters only through its children (a ResNet's BasicBlock, a UNet's
#   down block, a time embedding): a block, unless it holds more parameters than the largest
#   repeated layer, then the same rule runs inside it (a CNN's stage is split into its blocks,
#   a T5 encoder into its layers).
# So ResNet's stages, a UNet's blocks and a DiT's patch embedding leave the root. A model whose
# forward reads such a module's parameters outside its call (diffusers' DiT reads
# `transformer_blocks[0].norm1.emb`) is refused at that read, naming the block_classes that
# would leave that module in the root.


def default_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks chosen without `block_classes`, in model order (see [Note: default blocks])."""
    found: list[tuple[str, nn.Module]] = []
    order = {id(m): i for i, m in enumerate(model.modules())}

    def inside(prefix: str, module: nn.Module) -> None:
        layers = [(f"{prefix}{fqn}", m) for fqn, m in repeated_children(module)]
        chosen = {id(m) for _, m in layers}
        holding = {id(m) for _, layer in layers for m in _ancestors(module, layer)}
        cap = max((param_count(m) for _, m in layers), default=0)
        found.extend(layers)

        def walk(prefix: str, parent: nn.Module) -> None:
            for name, child in parent.named_children():
                fqn = f"{prefix}{name}"
                if id(child) in chosen or not param_count(child):
                    continue
                if id(child) in holding or isinstance(child, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
                    walk(f"{fqn}.", child)
                elif any(p is not None for p in child._parameters.values()):
                    continue  # the root's
                elif cap and param_count(child) > cap:
                    inside(f"{fqn}.", child)
                else:
                    found.append((fqn, child))

        walk(prefix, module)

    inside("", model)
    return sorted(found, key=lambda item: order[id(item[1])])


def outside_read_hints(block: str, modules: list[nn.Module]) -> list[tuple[nn.Parameter, str]]:
    """(parameter, hint) for the parameters of a block's modules held by one of their children:
    the block_classes that would leave that child in the root, for a model whose forward reads it
    outside the block's call (the classes of the module's other children with parameters)."""
    hints: list[tuple[nn.Parameter, str]] = []
    for module in modules:
        kids = [(name, child) for name, child in module.named_children() if param_count(child)]
        for name, child in kids:
            others = tuple(sorted({type(c).__name__ for n, c in kids if n != name} - {type(child).__name__}))
            if others:
                hint = (f"if the model's forward reads it outside block {block!r}'s call, blocks that leave its "
                        f"{type(child).__name__} {name!r} in the root would work: tz.Config(block_classes={others!r})")
                hints += [(p, hint) for p in child.parameters()]
    return hints


def _ancestors(root: nn.Module, module: nn.Module) -> list[nn.Module]:
    """The modules between `root` (excluded) and `module` (excluded) on the path from one to the other."""
    path: list[nn.Module] = []

    def find(m: nn.Module) -> bool:
        for child in m.children():
            if child is module or find(child):
                path.append(child)
                return True
        return False

    find(root)
    return [m for m in path if m is not module]


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

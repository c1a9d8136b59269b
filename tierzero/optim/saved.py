"""SavedState: a tiered optimizer's state as state dicts and checkpoints save and load it (each
block's master weights, moments and step counts, the param groups' hyper-parameters)."""

from __future__ import annotations

from typing import Any, Callable

import torch

from tierzero.runtime import MASTER, BlockState, FlatParam


class SavedState:
    """What a save takes of a tiered optimizer and a load gives back: the blocks it updates
    (`flats`, in the model's order), each one's BlockState (`blocks`: the master weights and
    moments) and step counts, and its param groups. A view of the optimizer's own records, taken
    by TieredOptimizer.saved_state() once the updates queued have landed; valid until its next
    step."""

    def __init__(self, optimizer: torch.optim.Optimizer, flats: list[FlatParam], blocks: dict[FlatParam, BlockState],
                 steps: dict[FlatParam, list[int]]) -> None:
        self.optimizer = optimizer
        self.flats = flats
        self.blocks = blocks
        self._steps = steps
        """The optimizer's own step counts, by block and parameter (written by set_steps)."""

    def steps(self, flat: FlatParam) -> int | list[int]:
        """Updates applied to `flat`'s parameters so far (AdamW's bias correction counts them):
        one count when they are all equal (every parameter got a gradient every step), else one
        per parameter."""
        counts = self._steps[flat]
        return counts[0] if len(set(counts)) == 1 else list(counts)

    def set_steps(self, flat: FlatParam, steps: int | list[int]) -> None:
        n = len(flat.layout.slots)
        counts = [int(steps)] * n if isinstance(steps, int) else [int(s) for s in steps]
        if len(counts) != n:
            raise ValueError(f"{flat.name}: {len(counts)} step counts for {n} parameters")
        self._steps[flat] = counts

    def load_groups(self, saved: list[dict[str, Any]], sizes: list[int] | None) -> None:
        """Take the hyper-parameters of `saved` param groups (state dicts, checkpoints), group
        by group; ValueError unless they are as many, of the same sizes (`sizes`, when known)."""
        groups = self.optimizer.param_groups
        mine = [len(g["params"]) for g in groups]
        if len(saved) != len(mine) or (sizes is not None and sizes != mine):
            raise ValueError(f"{type(self.optimizer).__name__}: the saved optimizer state has {len(saved)} param "
                             f"group(s) of {sizes if sizes is not None else '?'} parameters, this optimizer "
                             f"{len(mine)} of {mine}; build the optimizer with the groups it was saved with")
        for group, values in zip(groups, saved):
            group.update({k: v for k, v in values.items() if k not in ("params", "param_names")})

    def state_dict(self, packed: dict[str, Any]) -> dict[str, Any]:
        """torch's packed state dict (`packed`: its param_groups) with "state": each block's step
        count and its master weights and moments, this rank's shards as CPU tensors in their
        formats (Config.optimizer_state_dtype: an int8 state is its bytes, codes then scales)."""
        packed["state"] = {}
        for flat in self.flats:
            block = self.blocks[flat]
            packed["state"][flat.name] = {"step": self.steps(flat), **{k: block.read(k) for k in block.kinds}}
        return packed

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.load_groups(state_dict["param_groups"], [len(g["params"]) for g in state_dict["param_groups"]])
        by_name = {flat.name: flat for flat in self.flats}
        unknown = sorted(set(state_dict["state"]) - set(by_name))
        if unknown:
            raise ValueError(f"optimizer state for unknown blocks {unknown}; this model's blocks are "
                             f"{sorted(by_name)}")
        for name, entry in state_dict["state"].items():
            flat = by_name[name]
            self.set_steps(flat, entry["step"])
            block = self.blocks[flat]
            for k in block.kinds:
                _check_format(name, k, entry[k], *block.stored_as(k))
                block.store(k, entry[k])
            then_collectives(flat.master_updated(entry[MASTER]))


def _check_format(block: str, kind: str, given: torch.Tensor, dtype: torch.dtype, shape: torch.Size) -> None:
    """ValueError unless a state dict's `given` state is stored as this optimizer's (`dtype`, `shape`)."""
    if given.dtype != dtype or given.shape != shape:
        raise ValueError(f"optimizer state {kind!r} of block {block!r}: expected {dtype} of shape {tuple(shape)} "
                         f"(this optimizer's format, Config.optimizer_state_dtype), got {given.dtype} of shape "
                         f"{tuple(given.shape)}; load a state dict saved with the same optimizer_state_dtype, or "
                         "convert through tz.load_checkpoint(..., convert_states=True)")


def then_collectives(collectives: Callable[[], None] | None) -> None:
    """Run an update's collectives (none: nothing to run) on this thread, which drives the model's."""
    if collectives is not None:
        collectives()

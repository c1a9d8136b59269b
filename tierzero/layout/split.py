"""Split placement: which tier each block's tensor of one kind lives on, for a split of that
kind's bytes across tiers (the plan, tierzero/layout/plan.py, places every kind by it and
chooses the split "auto" takes).

Arithmetic only, over bytes per block.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

from tierzero.config import KINDS, TIER_NAMES

# [Note: split placement]
# A kind split across tiers puts each block's tensor of that kind whole on one tier: the blocks
# are cut into runs, in the order the next step needs them, the first run on the fastest tier
# asked for ("device", then "host", then "nvme"). A block goes to the tier whose share of the
# cumulative bytes holds the block's midpoint, so each tier's bytes are within one block of its
# fraction (a boundary moves at most half a block either way).
# The order is the forward's: the root block first (embeddings are the first thing the forward
# computes; the overlapped step's update of a block must end before the next forward reaches
# it), then the blocks as the model lists them. The first blocks' updates are the ones the next
# forward waits for; the last blocks' updates, and their NVMe reads, have the whole forward of
# the earlier blocks to hide under. So the fast tier takes the blocks that are waited for, NVMe
# the ones with the most slack. Every rank computes the same assignment (the shard sizes agree).


def split_blocks(sizes: Sequence[int], fractions: Mapping[str, float]) -> list[str]:
    """The tier of each block (`sizes`: its bytes of one kind, in the order above) for a split
    of the total into `fractions` per tier ([Note: split placement])."""
    total = sum(sizes)
    bounds, acc = [], 0.0
    for tier in TIER_NAMES:
        acc += fractions.get(tier, 0.0) * total
        bounds.append((acc, tier))
    used = [t for t in TIER_NAMES if fractions.get(t, 0.0) > 0]
    out, before = [], 0
    for size in sizes:
        mid = before + size / 2
        tier = next((t for bound, t in bounds if mid < bound and fractions.get(t, 0.0) > 0), used[-1])
        out.append(tier)
        before += size
    return out


class BlockTiers(NamedTuple):
    """The tier of each block's tensor of each kind, by block name (`block_tiers`)."""

    params: Mapping[str, str]
    grads: Mapping[str, str]
    optimizer_states: Mapping[str, str]

    @classmethod
    def build(cls, names: Sequence[str], tiers: Mapping[str, Sequence[str]]) -> "BlockTiers":
        return cls(*(dict(zip(names, tiers[kind])) for kind in KINDS))

"""Split placement: which tier each block's tensor of one kind lives on, for a split of that
kind's bytes across tiers, and the split "auto" chooses from the room on each tier.

Arithmetic only, over bytes per block: the runtime places by it at wrap, the planning sizes by it.
"""

from __future__ import annotations

from typing import Mapping, NamedTuple, Sequence

from tierzero.config import KINDS, TIER_NAMES, Config, shares

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
    def build(cls, names: Sequence[str], tiers: Mapping[str, list[str]]) -> "BlockTiers":
        return cls(*(dict(zip(names, tiers[kind])) for kind in KINDS))

    @classmethod
    def uniform(cls, names: Sequence[str], config: Config) -> "BlockTiers":
        """Every block of each kind on its one tier under `config` (no split); grads=None: with
        the optimizer states on the device, else on the host (where the updates run)."""
        grads = config.grads or ("device" if config.optimizer_states == "device" else "host")
        return cls(*({n: t for n in names} for t in (config.params, grads, config.optimizer_states)))


class KindSizes(NamedTuple):
    """Bytes per block of each kind (the placement order of [Note: split placement])."""

    params: list[int]
    grads: list[int]
    optimizer_states: list[int]


def block_tiers(config: Config, sizes: KindSizes) -> dict[str, list[str]]:
    """The tier of each block for each kind under `config` ("auto" resolved already: see
    `resolve_auto`); grads=None: where each block's update runs."""
    out = {kind: split_blocks(getattr(sizes, kind), shares(getattr(config, kind)))
           for kind in ("params", "optimizer_states")}
    if config.grads is None:
        out["grads"] = ["device" if t == "device" else "host" for t in out["optimizer_states"]]
    else:
        out["grads"] = split_blocks(sizes.grads, shares(config.grads))
    return out


def state_room(config: Config, sizes: KindSizes, device_window: int, frozen: int = 0) -> tuple[dict[str, int], int]:
    """What each tier offers the state once the step's own working set is set aside: the
    `device_window` of fetched blocks and `config.device_reserve` on the device, three blocks' update read-ahead staged on
    the host (not the root's, placed first on the fastest tier), and `frozen` bytes on the frozen
    tier. Returns the room per tier and the largest block's bytes of all kinds."""
    largest = max((sum(getattr(sizes, k)[b] for k in KINDS) for b in range(1, len(sizes.params))), default=0)
    room = {"device": config.device_budget - device_window - config.device_reserve, "host": config.host_budget - 3 * largest,
            "nvme": config.nvme_budget}
    room[config.frozen_tier] -= frozen
    return room, largest


def resolve_auto(config: Config, sizes: KindSizes, room: Mapping[str, int]) -> Config:
    """`config` with each "auto" kind replaced by the split that fills the fastest tier first:
    `room` is what each tier offers the state once the step's own working set is set aside.
    Kinds placed explicitly take their bytes first; then the "auto" kinds in the order
    params, grads, optimizer_states, each block whole, device then host then NVMe (NVMe only
    with nvme_dir). Without "auto" the config is returned as it is."""
    autos = [k for k in KINDS if getattr(config, k) == "auto"]
    if not autos:
        return config
    left = dict(room)
    if config.nvme_dir is None:
        left["nvme"] = 0
    for kind in KINDS:
        if kind not in autos and not (kind == "grads" and config.grads is None):
            for tier, f in shares(getattr(config, kind)).items():
                left[tier] -= int(f * sum(getattr(sizes, kind)))
    follow = config.grads is None  # a block's gradient on the device with its states there, else on the host
    if follow:
        left["host"] -= sum(sizes.grads)
    changes = {}
    for kind in autos:
        blocks = getattr(sizes, kind)
        placed = dict.fromkeys(TIER_NAMES, 0)  # room taken
        share = dict.fromkeys(TIER_NAMES, 0)  # this kind's bytes
        order = [t for t in TIER_NAMES if t != "nvme" or config.nvme_dir is not None]
        carried = kind == "optimizer_states" and follow
        i = 0  # runs in block order, as split_blocks places them back

        def cost(b: int, tier: str) -> int:
            return blocks[b] + (sizes.grads[b] if carried and tier == "device" else 0)

        for b, n in enumerate(blocks):
            while i < len(order) - 1 and placed[order[i]] + cost(b, order[i]) > max(left[order[i]], 0):
                i += 1
            placed[order[i]] += cost(b, order[i])
            share[order[i]] += n
            if carried and order[i] == "device":
                left["host"] += sizes.grads[b]  # its gradient is not on the host after all
        for tier in TIER_NAMES:
            left[tier] -= placed[tier]
        changes[kind] = _normalised({t: share[t] / sum(blocks) for t in TIER_NAMES}) if sum(blocks) else "host"
    return config.replace(**changes)


def _normalised(split: Mapping[str, float]) -> dict[str, float] | str:
    """Fractions that sum to 1 exactly (a split of one tier is its name)."""
    whole = [t for t, f in split.items() if f >= 1.0]
    if whole:
        return whole[0]
    out = {t: float(split.get(t, 0.0)) for t in TIER_NAMES}
    last = max(out, key=out.get)
    out[last] = 1.0 - sum(f for t, f in out.items() if t != last)
    return out

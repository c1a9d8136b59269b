"""Where a kind of state goes: one tier, a split across tiers, or "auto".

A placement of `params`, `grads` or `optimizer_states` is a tier name, a split {"device": f,
"host": f, "nvme": f} (fractions of that kind's bytes, summing to 1; a missing tier is 0), or
"auto" (the split is chosen at wrap from the budgets: tierzero/layout/split.py). No torch here.
"""

from __future__ import annotations

import math
from typing import Any, Literal, Mapping, Union

from tierzero.config.tiernames import TIER_NAMES, TierName

Split = Mapping[str, float]
"""Fractions of a kind's bytes per tier name, summing to 1."""

Placement = Union[TierName, Literal["auto"], Split]
"""A kind's placement as a Config field takes it."""

KINDS: tuple[str, ...] = ("params", "grads", "optimizer_states")
"""The kinds of state a Config places (frozen parameters take a tier name only)."""


def check_placement(what: str, value: Any) -> str | dict[str, float]:
    """`value` checked and normalised: a tier name or "auto" as given, a split as a dict over
    every tier in TIER_NAMES order (a split with one tier at 1 is that tier's name).
    ValueError naming `what` otherwise."""
    if isinstance(value, str):
        if value in TIER_NAMES or value == "auto":
            return value
        raise ValueError(f"{what}: expected one of {', '.join(map(repr, TIER_NAMES))}, 'auto' or a split such as "
                         f"{{'device': 0.25, 'host': 0.5, 'nvme': 0.25}}, got {value!r}")
    if not isinstance(value, Mapping):
        raise ValueError(f"{what}: expected a tier name, 'auto' or a mapping of tier names to fractions, got "
                         f"{type(value).__name__} {value!r}")
    unknown = sorted(str(k) for k in value if k not in TIER_NAMES)
    if unknown:
        raise ValueError(f"{what}: a split's keys are tier names {list(TIER_NAMES)}, got {unknown} in {dict(value)!r}")
    out = {}
    for tier in TIER_NAMES:
        f = value.get(tier, 0.0)
        if isinstance(f, bool) or not isinstance(f, (int, float)) or not math.isfinite(f) or f < 0:
            raise ValueError(f"{what}: the fraction for {tier!r} must be a number >= 0, got {f!r} in {dict(value)!r}")
        out[tier] = float(f)
    total = sum(out.values())
    if abs(total - 1.0) > 1e-6:
        raise ValueError(f"{what}: a split's fractions must sum to 1, got {dict(value)!r} (sum {total:g}); "
                         "for example {'device': 0.25, 'host': 0.5, 'nvme': 0.25}")
    whole = [t for t, f in out.items() if f == 1.0]
    return whole[0] if whole else out


def shares(value: str | Mapping[str, float]) -> dict[str, float]:
    """The fractions per tier of a checked placement that is not "auto" (a tier name: all of it)."""
    if value == "auto":
        raise ValueError("a placement of 'auto' has no fractions until it is resolved for a model "
                         "(tz.wrap does: tierzero.layout.PlacementPlan)")
    if isinstance(value, str):
        return {t: float(t == value) for t in TIER_NAMES}
    return {t: float(value.get(t, 0.0)) for t in TIER_NAMES}


def update_tier(states_tier: str) -> str:
    """Where a block's update runs, and so where its gradient lives when `grads` is None: on the
    device for optimizer states homed there, on the host (the CPU's update) for "host" and "nvme"."""
    return "device" if states_tier == "device" else "host"


def tiers_used(value: str | Mapping[str, float]) -> set[str]:
    """The tiers a checked placement may put bytes on ("auto": every tier)."""
    if value == "auto":
        return set(TIER_NAMES)
    return {t for t, f in shares(value).items() if f > 0}


def parse_placement(text: str, *, what: str) -> str | dict[str, float]:
    """A placement from the command line: a tier, "auto", or "device=0.25,host=0.5,nvme=0.25"."""
    if "=" not in text:
        return check_placement(what, text)
    split: dict[str, float] = {}
    for part in text.split(","):
        tier, sep, number = part.partition("=")
        try:
            split[tier.strip()] = float(number)
        except ValueError:
            raise ValueError(f"{what}: expected TIER=FRACTION pairs such as device=0.25,host=0.5,nvme=0.25, "
                             f"got {text!r}") from None
        if not sep:
            raise ValueError(f"{what}: expected TIER=FRACTION pairs, got {part!r} in {text!r}")
    return check_placement(what, split)

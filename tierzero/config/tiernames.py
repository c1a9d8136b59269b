"""The three tiers, named once: the `Tier` enum, its names, and the `TierName` typing alias.

No torch here, so config.py (and anything else light) can import it; tiers.py re-exports `Tier`.
"""

from __future__ import annotations

from enum import Enum
from typing import Literal, get_args

TierName = Literal["device", "host", "nvme"]
"""The tier names as a type, for dataclass fields; checked against `Tier` below."""


class Tier(str, Enum):
    """Where a tensor's bytes live: GPU memory, pinned CPU memory, or an NVMe swap file.

    A str enum: `Tier("nvme") is Tier.NVME`, `Tier.HOST == "host"`, and it hashes like its value
    so dicts keyed by tiers can be looked up with plain strings.
    """

    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"

    __hash__ = str.__hash__

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    @classmethod
    def parse(cls, value: "Tier | str", *, what: str = "tier") -> "Tier":
        """A Tier from a Tier or its name; ValueError naming the choices otherwise."""
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"{what}: expected one of {', '.join(map(repr, TIER_NAMES))}, "
                             f"got {value!r}") from None


TIER_NAMES: tuple[str, ...] = tuple(t.value for t in Tier)
"""("device", "host", "nvme"): the tiers from fastest to largest."""

assert get_args(TierName) == TIER_NAMES, "TierName must list the Tier values, in order"

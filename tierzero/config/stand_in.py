"""How the device tier's copy streams run without CUDA: the settings of the asynchronous
stand-in (tierzero/placement/storage/stand_in.py), from a Config or from the environment.

On CUDA copies run on real streams, whatever these say. On the CPU "sync" (the default) copies
at once; "async" runs every copy later on a worker per copy stream, so the ordering the GPU
depends on is exercised on every machine. The environment switches it on for a whole run
(`TIERZERO_STREAMS=async`, as `make test` does for its second pass over the parity tests) when
the Config leaves `streams="auto"`:

    TIERZERO_STREAMS      "sync" | "async"
    TIERZERO_POISON       "1" | "0"   poisoning (StandInConfig.poison)
    TIERZERO_DELAY_SEED   an int      seeded random delays before each copy (StandInConfig.delay_seed)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal, Mapping, NamedTuple

STREAM_MODES = ("auto", "sync", "async")
"""Config.streams: "auto" takes TIERZERO_STREAMS from the environment, else "sync"."""

ENV_STREAMS, ENV_POISON, ENV_DELAY_SEED = "TIERZERO_STREAMS", "TIERZERO_POISON", "TIERZERO_DELAY_SEED"


@dataclass(frozen=True, kw_only=True)
class StandInConfig:
    """Options of the asynchronous stand-in for the device's streams (Config.streams="async")."""

    poison: bool = True
    """Fill a copy's destination with 0xFF bytes (NaN in every float dtype) when the copy is
    queued, and a device buffer when it is freed: a read before the copy's event or after the
    free gives values that parity tests catch."""
    delay_seed: int | None = None
    """Seed of a random delay (up to max_delay_s) before each copy; None: no delays."""
    max_delay_s: float = 0.002
    """The longest delay before a copy."""
    checks: bool = True
    """What asynchrony alone does not show, each an error: a collective given a tensor that is
    not device memory, a device buffer handed to compute and freed before compute recorded its
    use, a non-blocking copy whose host side is not from the pinned pool."""

    def __post_init__(self) -> None:
        for name in ("poison", "checks"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"stand_in.{name}: expected True or False, got {getattr(self, name)!r}")
        if self.delay_seed is not None and (isinstance(self.delay_seed, bool) or not isinstance(self.delay_seed, int)):
            raise ValueError(f"stand_in.delay_seed: expected an int or None, got {self.delay_seed!r}")
        if isinstance(self.max_delay_s, bool) or not isinstance(self.max_delay_s, (int, float)) or self.max_delay_s < 0:
            raise ValueError(f"stand_in.max_delay_s: expected a number >= 0, got {self.max_delay_s!r}")


class StreamSettings(NamedTuple):
    """How a CPU device tier runs its copies: the mode, and the stand-in's options."""

    mode: Literal["sync", "async"]
    stand_in: StandInConfig


def stream_settings(streams: str, stand_in: StandInConfig, env: Mapping[str, str] = os.environ) -> StreamSettings:
    """The settings a Config's `streams` and `stand_in` give (module docstring): an explicit
    mode as given; "auto" from the environment, whose poison and delay seed override."""
    if streams != "auto":
        return StreamSettings("async" if streams == "async" else "sync", stand_in)
    mode = env.get(ENV_STREAMS, "sync").strip().lower() or "sync"
    if mode not in ("sync", "async"):
        raise ValueError(f"{ENV_STREAMS}={env[ENV_STREAMS]!r}: expected 'sync' or 'async'")
    poison, seed = stand_in.poison, stand_in.delay_seed
    if env.get(ENV_POISON, "").strip():
        if env[ENV_POISON].strip() not in ("0", "1"):
            raise ValueError(f"{ENV_POISON}={env[ENV_POISON]!r}: expected '0' or '1'")
        poison = env[ENV_POISON].strip() == "1"
    if env.get(ENV_DELAY_SEED, "").strip():
        try:
            seed = int(env[ENV_DELAY_SEED])
        except ValueError:
            raise ValueError(f"{ENV_DELAY_SEED}={env[ENV_DELAY_SEED]!r}: expected an int") from None
    return StreamSettings(mode, StandInConfig(poison=poison, delay_seed=seed, max_delay_s=stand_in.max_delay_s,
                                              checks=stand_in.checks))

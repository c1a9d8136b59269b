"""The bottom layer: configuration, tier names, what this machine offers, bytes per parameter.

No torch at import time (`import tierzero.config` stays light for tools and the CLI's parser):

    config.py        Config, IOConfig, PrefetchConfig: frozen, keyword-only, validated; the
                     bytes per parameter of each kind of state under a Config
    tiernames.py     the Tier enum and its names
    policy_names.py  prefetch policy names and dotted paths, checked without importing the prefetcher
    machine.py       the one rule for what this machine offers (Config.auto, `tierzero estimate`)
    stand_in.py      how the CPU's copy streams run: at once, or the asynchronous stand-in
    split.py         a kind's placement: a tier, a split across tiers, or "auto"; where an update runs
    pages.py         the tiers' page, and the room one region needs for a working set
    state_format.py  the optimizer states' formats (float32, bfloat16, int8) and their bytes
"""

from io_engine import format_size, parse_size
from tierzero.config.config import DTYPE_BYTES, Config, ElementBytes, IOConfig, PrefetchConfig, StateBytes
from tierzero.config.pages import PAGE, round_up, windowed_bytes
from tierzero.config.stand_in import StandInConfig, StreamSettings
from tierzero.config.machine import machine_budgets
from tierzero.config.policy_names import BUILTIN_POLICIES, check_policy, load_policy_class
from tierzero.config.split import (KINDS, Placement, Split, check_placement, parse_placement, shares, tiers_used,
                                   update_tier)
from tierzero.config.state_format import (MASTER_DTYPES, QUANT_BLOCK, SCALE_BYTES, STATE_DTYPES, quant_blocks,
                                          state_bytes_per_param, state_nbytes)
from tierzero.config.tiernames import TIER_NAMES, Tier, TierName

__all__ = ["Config", "IOConfig", "PrefetchConfig", "Tier", "TierName", "TIER_NAMES", "format_size", "parse_size",
           "machine_budgets", "BUILTIN_POLICIES", "check_policy", "load_policy_class", "StateBytes",
           "DTYPE_BYTES", "StandInConfig", "StreamSettings",
           "KINDS", "Placement", "Split", "check_placement", "parse_placement", "shares", "tiers_used",
           "update_tier", "ElementBytes", "PAGE", "round_up", "windowed_bytes",
           "STATE_DTYPES", "MASTER_DTYPES", "QUANT_BLOCK", "SCALE_BYTES", "quant_blocks", "state_nbytes", "state_bytes_per_param"]

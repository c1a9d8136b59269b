"""Prefetch: what to fetch ahead of compute, and the prefetcher that records the block order.

    policies.py    the policy protocol (PrefetchPolicy, PrefetchView, Fetch) and the built-ins
    prefetcher.py  Prefetcher: records traces and times, asks the policy, clips its plan to the
                   room (`fitting`), orders eviction victims
"""

from tierzero.prefetch.policies import (Adaptive, BlockTimes, BytesAhead, Fetch, FetchPhase, Lookahead,
                                        NoPrefetch, PrefetchPolicy, PrefetchView, TraceEvent, Unit, describe,
                                        next_use_order, policy_from_config)
from tierzero.prefetch.prefetcher import Prefetcher, fitting, prefetch_unit, prefetch_units

__all__ = ["PrefetchPolicy", "PrefetchView", "Fetch", "FetchPhase", "TraceEvent", "Unit", "BlockTimes",
           "NoPrefetch", "Lookahead", "BytesAhead", "Adaptive", "describe", "fitting", "next_use_order",
           "policy_from_config", "Prefetcher", "prefetch_unit", "prefetch_units"]

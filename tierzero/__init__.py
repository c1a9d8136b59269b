"""tierzero: train PyTorch models whose state is larger than GPU memory, on one machine.

Every partitioned tensor lives on one of three tiers (GPU memory, pinned CPU memory, NVMe
files), is tracked by the placement manager within each tier's budget, and is fetched ahead of
compute from a recorded trace. The architecture, its layers and the rules between them: docs/architecture.md.
"""

from __future__ import annotations

import importlib
from typing import Any

from tierzero.config import Config, IOConfig, PrefetchConfig, StandInConfig, format_size, parse_size

__version__ = "0.1.0"

# Public names and the module that defines each; imported on first use so that `import
# tierzero` stays cheap and a CLI subcommand loads only what it needs.
_LAZY = {
    "Tier": "tierzero.config",
    "PlacementManager": "tierzero.placement",
    "Kind": "tierzero.placement",
    "TensorHandle": "tierzero.placement",
    "wrap": "tierzero.runtime",
    "accumulate": "tierzero.runtime",
    "compile": "tierzero.runtime",
    "full_state_dict": "tierzero.runtime",
    "gathered_params": "tierzero.runtime",
    "tier_bytes": "tierzero.runtime",
    "AdamW": "tierzero.optim",
    "SGD": "tierzero.optim",
    "clip_grad_norm_": "tierzero.optim",
    "save_checkpoint": "tierzero.checkpoint",
    "load_checkpoint": "tierzero.checkpoint",
    "export_checkpoint": "tierzero.checkpoint",
    "load_weights": "tierzero.checkpoint",
    "save_safetensors": "tierzero.formats",
    "load_safetensors": "tierzero.formats",
    "WeightSource": "tierzero.formats",
    "from_pretrained": "tierzero.hf",
    "save_pretrained": "tierzero.hf",
    "causal_lm_loss": "tierzero.hf",
    "PrefetchPolicy": "tierzero.prefetch",
    "PrefetchView": "tierzero.prefetch",
    "Fetch": "tierzero.prefetch",
    "NoPrefetch": "tierzero.prefetch",
    "Lookahead": "tierzero.prefetch",
    "BytesAhead": "tierzero.prefetch",
    "Adaptive": "tierzero.prefetch",
}

__all__ = ["Config", "IOConfig", "PrefetchConfig", "StandInConfig", "parse_size", "format_size", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tierzero' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

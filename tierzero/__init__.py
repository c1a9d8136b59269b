"""tierzero: train PyTorch models whose state is larger than GPU memory, on one machine.

Every partitioned tensor lives on one of three tiers (GPU memory, pinned CPU memory, NVMe
files), is tracked by the placement manager within each tier's budget, and is fetched ahead of
compute from a recorded trace. See DESIGN.md for the architecture.
"""

from __future__ import annotations

import importlib
from typing import Any

from tierzero.config import Config, IOConfig, PrefetchConfig, format_size, parse_size

__version__ = "0.1.0"

# Public names and the module that defines each; imported on first use so that `import
# tierzero` stays cheap and a CLI subcommand loads only what it needs.
_LAZY = {
    "Tier": "tierzero.tiers",
    "PlacementManager": "tierzero.placement",
    "wrap": "tierzero.runtime",
    "full_state_dict": "tierzero.runtime",
    "AdamW": "tierzero.optim",
    "SGD": "tierzero.optim",
    "clip_grad_norm_": "tierzero.optim",
    "save_checkpoint": "tierzero.checkpoint",
    "load_checkpoint": "tierzero.checkpoint",
    "export_checkpoint": "tierzero.export",
    "load_weights": "tierzero.export",
    "save_safetensors": "tierzero.safetensors_file",
    "load_safetensors": "tierzero.weights",
    "WeightSource": "tierzero.weights",
    "from_pretrained": "tierzero.hf",
    "save_pretrained": "tierzero.hf",
    "PrefetchPolicy": "tierzero.policies",
    "PrefetchView": "tierzero.policies",
    "Fetch": "tierzero.policies",
    "NoPrefetch": "tierzero.policies",
    "Lookahead": "tierzero.policies",
    "BytesAhead": "tierzero.policies",
    "Adaptive": "tierzero.policies",
    "Kind": "tierzero.handles",
    "TensorHandle": "tierzero.handles",
}

__all__ = ["Config", "IOConfig", "PrefetchConfig", "parse_size", "format_size", *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'tierzero' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value

"""transformers models in and out of tierzero, and transformers' Trainer for a tiered model.

    pretrained.py  tz.from_pretrained / tz.save_pretrained: folders streamed in and out, block by block
    trainer.py     tierzero.hf.Trainer: transformers.Trainer for a wrapped model; trainer_for(cls)
                   the same over any Trainer subclass (TRL's SFTTrainer, DPOTrainer)
    loss.py        causal_lm_loss: a causal LM's loss without the whole sequence's logits

transformers is an optional extra (`pip install 'tierzero[hf]'`): this package imports without
it; `Trainer` is imported on first use (it subclasses transformers.Trainer).
"""

from __future__ import annotations

from typing import Any

from tierzero.formats import meta_model, require_transformers
from tierzero.hf.loss import causal_lm_loss, chunked_cross_entropy
from tierzero.hf.pretrained import from_pretrained, save_pretrained

__all__ = ["from_pretrained", "save_pretrained", "meta_model", "Trainer", "trainer_for", "causal_lm_loss",
           "chunked_cross_entropy"]


def __getattr__(name: str) -> Any:
    if name in ("Trainer", "trainer_for"):
        require_transformers()
        import tierzero.hf.trainer  # optional dependency: transformers

        return getattr(tierzero.hf.trainer, name)
    raise AttributeError(f"module 'tierzero.hf' has no attribute {name!r}")

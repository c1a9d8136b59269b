"""Tiered optimizers and gradient clipping over a wrapped model's flat gradients.

    base.py   TieredOptimizer: the block-by-block step (streamed state, overlapped or in backward)
    saved.py  SavedState: what state dicts and checkpoints save and load of an optimizer
    adamw.py  AdamW and SGD: torch's fused CPU kernels on tiered fp32 state
    clip.py   clip_grad_norm_: the global norm from the norms backward computed
    window_kernel.py  the update of a window of bf16 / int8 states in one pass (a C++ loop)
"""

from tierzero.optim.adamw import SGD, AdamW
from tierzero.optim.base import TieredOptimizer
from tierzero.optim.clip import clip_grad_norm_
from tierzero.optim.saved import SavedState

__all__ = ["AdamW", "SGD", "TieredOptimizer", "SavedState", "clip_grad_norm_"]

"""How an optimizer state's values sit in its stored tensor, per format (config/state_format.py):
fp32 and bf16 as themselves; "int8" as one uint8 tensor, the codes of whole QUANT_BLOCK blocks
then one fp32 scale per block. `decode` widens a window of whole blocks to fp32, `encode` writes
it back; both are elementwise torch ops over whole blocks, so the bits do not depend on where a
window lies, on which tier, or how the work is cut ([Note: 8-bit states]).
"""

from __future__ import annotations

import torch

from tierzero.config import QUANT_BLOCK, quant_blocks, state_nbytes

# [Note: 8-bit states]
# Each block of QUANT_BLOCK elements keeps its absolute maximum `s` (fp32) and one byte per
# element, companded so that small values keep some precision, as the 8-bit optimizers' dynamic
# maps do (Dettmers et al.), in two plain elementwise maps that vectorise on any device:
#   signed states (AdamW's first moment, SGD's momentum): q = round(sign(x) sqrt(|x| 127^2 / s)),
#     x = s sign(q) (q / 127)^2: the smallest non-zero value is s / 16129;
#   AdamW's second moment (never negative): q = round((x 255^4 / s)^(1/4)), x = s (q / 255)^4:
#     its square root, which the update divides by, in the first map's resolution, and values
#     down to s * 2.4e-10 kept non-zero.
# A window is decoded once and encoded once per update, so a value no update touched (padding,
# a parameter without a gradient) keeps its code. Rounding is half-to-even, no randomness.
# The fused window kernel (tierzero/optim/window_kernel.py) does the same arithmetic in one
# loop, so the order and constants here are its: single-precision products and quotients (no
# reciprocals), correctly rounded roots (sqrt_), and the second moment's fourth root taken as
# sqrt(sqrt(x) 255^2 / sqrt(s)), since the update has sqrt(x) at hand. Both give the same bits.
_S2 = 16129.0
"""127 ** 2, the signed map's constant."""
_U4 = 4228250624.0
"""255 ** 4 as a float32 holds it (4228250625 rounded), the unsigned map's constant."""
_U2 = 65025.0
"""255 ** 2: the unsigned map's encoding takes the root of x / the root of s."""
_FLOOR = 1e-30
"""Scaled values are raised to this before their roots: a normal float whose codes are 0."""


class StateCodec:
    """One state's format: what its stored tensor is, and how a window of it widens to fp32.
    `unsigned`: the values are never negative (AdamW's second moment)."""

    def __init__(self, dtype: str, *, unsigned: bool = False) -> None:
        if dtype not in ("float32", "bfloat16", "int8"):
            raise ValueError(f"optimizer state dtype: expected 'float32', 'bfloat16' or 'int8', got {dtype!r}")
        self.dtype, self.unsigned = dtype, unsigned

    @property
    def exact(self) -> bool:
        """Whether the stored tensor is the fp32 values themselves (no decoding)."""
        return self.dtype == "float32"

    def zeros(self, numel: int) -> torch.Tensor:
        """The stored tensor of `numel` zeros (state_nbytes(numel, dtype) bytes)."""
        if self.dtype == "int8":
            return torch.zeros(state_nbytes(numel, "int8"), dtype=torch.uint8)
        return torch.zeros(numel, dtype=torch.float32 if self.exact else torch.bfloat16)

    def parts(self, stored: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(codes as [blocks, QUANT_BLOCK], scales as [blocks, 1]) of an int8 stored tensor."""
        n = quant_blocks(numel)
        codes = stored[:n * QUANT_BLOCK].view(n, QUANT_BLOCK)
        scales = stored[n * QUANT_BLOCK:].view(torch.float32).view(n, 1)
        return (codes if self.unsigned else codes.view(torch.int8)), scales

    def decode(self, stored: torch.Tensor, numel: int, lo: int, hi: int, out: torch.Tensor) -> torch.Tensor:
        """Elements [lo, hi) of the state (lo a multiple of QUANT_BLOCK) widened to fp32 into `out`
        (an int8 state: whole blocks, `out` rounded up to them); returns `out`'s values."""
        if self.dtype != "int8":
            return out[:hi - lo].copy_(stored[lo:hi])
        codes, scales = self.parts(stored, numel)
        b0, b1 = lo // QUANT_BLOCK, quant_blocks(hi)
        q = out[:(b1 - b0) * QUANT_BLOCK].view(b1 - b0, QUANT_BLOCK).copy_(codes[b0:b1])
        if self.unsigned:
            q.mul_(q)
            q.mul_(q).mul_(scales[b0:b1] / _U4)
        else:
            q.mul_(q.abs()).mul_(scales[b0:b1] / _S2)
        return out[:hi - lo]

    def encode(self, values: torch.Tensor, stored: torch.Tensor, numel: int, lo: int, hi: int) -> None:
        """Store `values` (fp32, decoded by `decode` into the same window, then changed) as
        elements [lo, hi). `values` is used as scratch (its contents are lost)."""
        if self.dtype != "int8":
            stored[lo:hi].copy_(values[:hi - lo])
            return
        codes, scales = self.parts(stored, numel)
        b0, b1 = lo // QUANT_BLOCK, quant_blocks(hi)
        x = values.view(-1)[:(b1 - b0) * QUANT_BLOCK].view(b1 - b0, QUANT_BLOCK)
        # torch's CPU sqrt is many times slower on zeros and subnormals than on normal floats:
        # values below _FLOOR, whose codes are 0 either way, are raised to it first.
        s = torch.amax(x.abs(), dim=1, keepdim=True)
        if self.unsigned:  # the fourth root as the root of (the root of x / the root of s)
            inv = torch.where(s > 0, torch.full_like(s, _U2) / sqrt_(s.clone()), 0.0)
            y = sqrt_(sqrt_(x).mul_(inv).clamp_min_(_FLOOR))
            codes[b0:b1] = y.round_().to(torch.int32)  # float -> uint8 directly is several times slower
        else:
            inv = torch.where(s > 0, torch.full_like(s, _S2) / s, 0.0)
            y = sqrt_(x.abs().mul_(inv).clamp_min_(_FLOOR))
            codes[b0:b1] = y.round_().copysign_(x).to(torch.int32)
        scales[b0:b1] = s

    def __repr__(self) -> str:
        return f"StateCodec({self.dtype!r}{', unsigned' if self.unsigned else ''})"


def sqrt_(x: torch.Tensor) -> torch.Tensor:
    """`x` (fp32) replaced by its square roots rounded correctly, as the CPU's sqrt instruction
    gives them: torch's CPU sqrt of fp32 is off by an ulp on ~1 in 5 values. Through double:
    a double root within an ulp rounds to the correct float (a float's root never lies that
    near a midpoint between two floats)."""
    return x.copy_(x.double().sqrt_())


def window_numel(lo: int, hi: int) -> int:
    """fp32 elements `decode` needs to hold the window [lo, hi) (whole blocks)."""
    return (quant_blocks(hi) - lo // QUANT_BLOCK) * QUANT_BLOCK


def round_stochastic_(values: torch.Tensor, out: torch.Tensor, first: int, seed: int) -> None:
    """`values` (fp32) into `out` (bf16) rounded stochastically: up with the probability of its
    distance from the bf16 value below, so rounding errors average out over steps. The random
    bits are a hash of (`seed`, element index `first` + i), never a global generator's: the
    same on every tier, device and placement. `values` is used as scratch."""
    n = values.numel()
    idx = torch.arange(first, first + n, dtype=torch.int64, device=values.device)
    h = (idx ^ (seed & 0xFFFFFFFF)) & 0xFFFFFFFF  # a 32-bit integer hash, products below 2^63
    for _ in range(2):
        h = ((h >> 16) ^ h) * 0x45D9F3B & 0xFFFFFFFF
    h = (h >> 16) ^ h
    bits = values.view(torch.int32).to(torch.int64) + (h & 0xFFFF)
    out.copy_((bits >> 16).to(torch.int16).view(torch.bfloat16))

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
_SIGNED, _UNSIGNED = 127.0, 255.0
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

    def _parts(self, stored: torch.Tensor, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
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
        codes, scales = self._parts(stored, numel)
        b0, b1 = lo // QUANT_BLOCK, quant_blocks(hi)
        q = out[:(b1 - b0) * QUANT_BLOCK].view(b1 - b0, QUANT_BLOCK).copy_(codes[b0:b1])
        if self.unsigned:
            q.mul_(q).mul_(q).mul_(scales[b0:b1] / _UNSIGNED ** 4)
        else:
            q.mul_(q.abs()).mul_(scales[b0:b1] / _SIGNED ** 2)
        return out[:hi - lo]

    def encode(self, values: torch.Tensor, stored: torch.Tensor, numel: int, lo: int, hi: int) -> None:
        """Store `values` (fp32, decoded by `decode` into the same window, then changed) as
        elements [lo, hi). `values` is used as scratch (its contents are lost)."""
        if self.dtype != "int8":
            stored[lo:hi].copy_(values[:hi - lo])
            return
        codes, scales = self._parts(stored, numel)
        b0, b1 = lo // QUANT_BLOCK, quant_blocks(hi)
        x = values.view(-1)[:(b1 - b0) * QUANT_BLOCK].view(b1 - b0, QUANT_BLOCK)
        # The maps' constants are folded into the scale's inverse (one pass fewer each). torch's
        # CPU sqrt takes ~7x longer on zeros (~30x on subnormals) than on normal floats: values
        # below _FLOOR, whose codes are 0 either way, are raised to it first (the same codes).
        if self.unsigned:
            s = torch.amax(x, dim=1, keepdim=True)
            # the fourth root as rsqrt(rsqrt(.)): 0.54 ns an element against 0.90 for two sqrts
            x.mul_(torch.where(s > 0, _UNSIGNED ** 4 / s, 0.0)).clamp_min_(_FLOOR).rsqrt_().rsqrt_().round_()
            codes[b0:b1] = x.to(torch.int32)  # float -> uint8 is ~6x slower than through int32
        else:
            s = torch.maximum(torch.amax(x, dim=1, keepdim=True), -torch.amin(x, dim=1, keepdim=True))
            y = torch.abs(x).mul_(torch.where(s > 0, _SIGNED ** 2 / s, 0.0)).clamp_min_(_FLOOR)
            codes[b0:b1] = y.sqrt_().round_().copysign_(x)
        scales[b0:b1] = s

    def __repr__(self) -> str:
        return f"StateCodec({self.dtype!r}{', unsigned' if self.unsigned else ''})"


def window_room(lo: int, hi: int) -> int:
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

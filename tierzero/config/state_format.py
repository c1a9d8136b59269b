"""The formats optimizer states are kept in, and their bytes (no torch: the plan counts them
before any tensor exists; tierzero/layout/state_codec.py encodes and decodes them).

    "float32"   4 bytes an element (the default: torch's fused AdamW, bit for bit)
    "bfloat16"  2 bytes an element (rounded to nearest on write)
    "int8"      1 byte an element, in blocks of QUANT_BLOCK elements with one fp32 scale each
"""

from __future__ import annotations

from typing import Literal

StateDtype = Literal["float32", "bfloat16", "int8"]
STATE_DTYPES: tuple[str, ...] = ("float32", "bfloat16", "int8")
MASTER_DTYPES: tuple[str, ...] = ("float32", "bfloat16")

QUANT_BLOCK = 256
"""Elements sharing one scale in the "int8" format (the 8-bit optimizers' block size)."""
SCALE_BYTES = 4
"""Bytes of one block's scale (fp32)."""

_ELEMENT_BYTES = {"float32": 4, "bfloat16": 2, "int8": 1}


def quant_blocks(numel: int) -> int:
    """Blocks of QUANT_BLOCK elements covering `numel` elements (the last one may be short)."""
    return -(-numel // QUANT_BLOCK)


def state_nbytes(numel: int, dtype: str) -> int:
    """Bytes one state of `numel` elements takes in the format `dtype`, as it is allocated on
    every tier: "int8" rounds the codes up to whole blocks and adds one scale per block."""
    if dtype not in _ELEMENT_BYTES:
        raise ValueError(f"optimizer state dtype: expected one of {STATE_DTYPES}, got {dtype!r}")
    if dtype == "int8":
        return quant_blocks(numel) * (QUANT_BLOCK + SCALE_BYTES)
    return numel * _ELEMENT_BYTES[dtype]


def state_bytes_per_param(dtype: str) -> float:
    """Bytes per parameter of one state in the format `dtype`, scales included (the limit of
    state_nbytes(n, dtype) / n for large n)."""
    return state_nbytes(QUANT_BLOCK, dtype) / QUANT_BLOCK

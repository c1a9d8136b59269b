"""Byte sizes written the way people write them: 8MiB, 1GiB, 4096."""

from __future__ import annotations

import re

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}


def parse_size(value: int | str, *, what: str = "size") -> int:
    """4096, "4096", "8MiB", "1.5GiB", "2GB" -> bytes (int); ValueError naming `what` otherwise."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(value))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(f"{what}: expected a byte count like 4096, '8MiB' or '1GiB', got {value!r}")
        n = int(float(m.group(1)) * _UNITS[unit])
    if n < 0:
        raise ValueError(f"{what}: expected a size >= 0, got {value!r}")
    return n


def format_size(n: int) -> str:
    """Bytes -> the shortest exact binary form: 8388608 -> '8MiB', 4097 -> '4097'."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)

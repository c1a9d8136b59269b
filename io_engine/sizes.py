"""Byte sizes written the way people write them ("8GiB", "512MB", 4096), read and printed.

The one parser and the formatters of the project: tierzero's Config and CLI use them too
(`tz.parse_size`, `tz.format_size`).
"""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: int | str, *, what: str = "size") -> int:
    """Bytes from an int or a string like "8GiB", "512MB", "1.5GiB", "4096"; ValueError naming
    `what` otherwise."""
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a byte count such as 4096 or '8GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"{what}: expected a non-negative byte count, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"{what}: expected a byte count such as 4096, '512MiB' or '8GiB' "
                f"(units B, KB/KiB, MB/MiB, GB/GiB, TB/TiB), got {value!r}")
        return int(float(m.group(1)) * _UNITS[unit])
    raise ValueError(f"{what}: expected an int or a string such as '8GiB', got {type(value).__name__}")


def format_size(nbytes: int | float, *, digits: int = 2) -> str:
    """Human-readable binary size, for messages: 1536 -> '1.50 KiB', 100 -> '100 B'."""
    n = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if abs(n) < 1024 or unit == "PiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.{digits}f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def exact_size(n: int) -> str:
    """The shortest exact binary spelling, which parse_size reads back: 8388608 -> '8MiB',
    4097 -> '4097' (for settings printed to be pasted into a config)."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return str(n)

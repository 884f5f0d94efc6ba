"""Human-readable byte sizes: parse "4GiB" / "512MB" / "0.3" (a fraction) and format them back."""

from __future__ import annotations

import re

_UNITS = {
    "": 1,
    "b": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_memory(text: str | float | int) -> float | int:
    """Parse a memory amount.

    Returns a float in (0, 1] for a fraction ("0.3" = 30% of what is free) or an int number of bytes
    ("4GiB", "512MB", "1000000"). Raises ValueError with a readable message otherwise.
    """
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        match = _SIZE_RE.match(text)
        if match is None:
            raise ValueError(
                f"cannot read memory size {text!r}: use bytes like '4GiB' or a fraction like '0.3'"
            )
        value, unit = float(match.group(1)), match.group(2).lower()
    if unit not in _UNITS:
        raise ValueError(
            f"unknown memory unit {unit!r} in {text!r} (known: KiB, MiB, GiB, KB, MB, GB)"
        )
    if unit == "" and 0 < value <= 1:
        return value
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return int(value * _UNITS[unit])


def format_bytes(num_bytes: float) -> str:
    """1536 -> '1.50 KiB'."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")

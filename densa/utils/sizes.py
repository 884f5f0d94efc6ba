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
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z%]*)\s*$")


def parse_memory(text: str | float | int) -> float | int:
    """Parse a memory amount, strictly.

    - bytes need a unit: "4GiB", "512MB", "1000000B" -> an int;
    - a share of free memory is a fraction in (0, 1] written with a decimal point ("0.3") or a
      percentage in (0, 100] ("30%") -> a float.
    Anything else raises ValueError saying what to write: "1.5" is neither (150%? 1.5 bytes?),
    and a bare integer is refused rather than read as bytes by surprise.
    """
    if isinstance(text, bool) or not isinstance(text, (str, int, float)):
        raise ValueError(f"cannot read memory size {text!r}")
    match = _SIZE_RE.match(str(text))
    if match is None:
        raise ValueError(
            f"cannot read memory size {text!r}: write bytes with a unit like '4GiB', or a share "
            "of free memory like '0.3' or '30%'"
        )
    number, unit = match.group(1), match.group(2).lower()
    value = float(number)
    if value <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    if unit == "%":
        return _fraction(value / 100, text)
    if unit == "":
        if "." not in number:
            raise ValueError(
                f"memory size {text!r} has no unit: write bytes like '{number}B' or '{number}MiB', "
                "or a share of free memory like '0.3' or '30%'"
            )
        return _fraction(value, text)
    if unit not in _UNITS:
        raise ValueError(
            f"unknown memory unit {unit!r} in {text!r} (known: B, KiB, MiB, GiB, TiB, KB, MB, GB, "
            "TB, or % of free memory)"
        )
    num_bytes = int(value * _UNITS[unit])
    if num_bytes <= 0:
        raise ValueError(f"memory size must be positive, got {text!r}")
    return num_bytes


def _fraction(value: float, text: object) -> float:
    if not 0 < value <= 1:
        raise ValueError(
            f"a share of free memory must be in (0, 1] (or (0%, 100%]), got {text!r}; "
            "for bytes add a unit, like '1.5GiB'"
        )
    return value


def format_bytes(num_bytes: float) -> str:
    """1536 -> '1.50 KiB'."""
    value = float(num_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")

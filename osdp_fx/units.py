"""Parsing of byte quantities written by users ("8GiB", "512 MB", 1 << 30)."""

from __future__ import annotations

import re

from .errors import InputError

_UNITS_BYTES = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str, *, what: str = "memory limit") -> int:
    """Return ``value`` as a whole number of bytes.

    Accepts a non-negative int, or a string such as ``"8GiB"``, ``"512MB"``, ``"1.5 GiB"``.
    Raises InputError naming the accepted forms otherwise.
    """
    if isinstance(value, bool):
        raise InputError(f"{what} must be bytes (int) or a string like '8GiB', got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0 or value != value or value == float("inf"):
            raise InputError(f"{what} must be a finite, non-negative number of bytes (or a "
                             f"string such as '8GiB'), got {value!r}")
        return int(value)
    if isinstance(value, str):
        match = _PATTERN.match(value)
        if match and match.group(2).lower() in _UNITS_BYTES:
            return int(float(match.group(1)) * _UNITS_BYTES[match.group(2).lower()])
    raise InputError(
        f"{what} {value!r} is not a byte quantity: pass an int of bytes or a string with a "
        f"unit such as '8GiB', '512MiB' or '16GB' (units: {', '.join(u for u in _UNITS_BYTES if u)})"
    )


def format_bytes(n_bytes: float) -> str:
    """Human-readable bytes with binary units, e.g. 1536 -> '1.5 KiB'."""
    value = float(n_bytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")

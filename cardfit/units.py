"""Byte quantities as people write them ("24GiB", "6 GB", "512MiB", "1e9")."""

import math
import re

from .errors import CardfitError

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int, what: str = "size") -> int:
    """Parse a byte quantity; bare numbers are bytes, suffixes K/M/G/T alone are binary."""
    if isinstance(text, int):
        if text < 0:
            raise CardfitError(f"{what} {text} is negative", "give a positive size such as 24GiB")
        return text
    match = _PATTERN.match(str(text))
    unit = match.group(2).lower() if match else None
    if not match or unit not in _UNITS:
        raise CardfitError(
            f"cannot read {what} '{text}'",
            "write a number with a unit: 24GiB, 6GB, 512MiB, or plain bytes",
        )
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value):
        raise CardfitError(f"{what} '{text}' is not a finite number", "write a size such as 24GiB")
    return int(round(value))


def format_bytes(n: float) -> str:
    """Binary units, two decimals, as the seed's tables print them."""
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{sign}{n / scale:.2f} {unit}"
    return f"{sign}{int(n)} B"

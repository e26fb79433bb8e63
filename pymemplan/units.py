"""Byte sizes as people write them: "80GiB", "1.5 GB", "512MiB", 4096."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4,
}
_PATTERN = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_bytes(value: int | float | str) -> int:
    """Bytes from an int or a string with an optional unit (B, KB/MB/GB/TB, KiB/MiB/GiB/TiB)."""
    if isinstance(value, bool):
        raise ValueError(f"not a size: {value!r}")
    if isinstance(value, (int, float)):
        number, unit = value, ""
    else:
        m = _PATTERN.match(str(value))
        unit = m.group(2).lower() if m else None
        if m is None or unit not in _UNITS:
            raise ValueError(
                f"not a size: {value!r}; write a number of bytes or a number with a unit, "
                "e.g. 4096, '512MiB', '80GiB', '1.5GB'")
        number = float(m.group(1))
    if number != number:  # NaN
        raise ValueError(f"not a size: {value!r}")
    if number < 0:
        raise ValueError(f"a size cannot be negative: {value!r}")
    bytes_ = number * _UNITS[unit]
    # Nothing is that large: 2**63 bytes is 8 EiB (and what the allocator's counters hold).
    if bytes_ >= 2**63:
        raise ValueError(f"a size too large: {value!r} (the most is 2**63 - 1 bytes)")
    return int(bytes_)


def format_bytes(n: int | float) -> str:
    """A short human-readable size with binary units: 1536 -> '1.50 KiB'."""
    v = float(n)
    if abs(v) < 1024:
        return f"{int(v)} B"
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        v /= 1024
        if abs(v) < 1024 or unit == "TiB":
            return f"{v:.2f} {unit}"
    raise AssertionError("unreachable")

"""Byte sizes as people write them ("80GB", "64MiB", 1e9) and as the plan prints them."""
from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
    "k": 2**10, "m": 2**20, "g": 2**30, "t": 2**40,
}
_SIZE_RE = re.compile(r"^\s*(-?[0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")

GiB = 2**30
MiB = 2**20
MAX_BYTES = 2**60
"""Largest size accepted (1 EiB): more than any machine has, and small enough that sums of a
few of them stay exact in the search's int64 and float64 arithmetic."""


def parse_bytes(value: int | float | str, *, what: str = "size") -> int:
    """Return ``value`` in bytes. Accepts a number of bytes or a string such as "80GB",
    "80 GiB", "64MiB" ("GB" is 10**9, "GiB" and bare "G" are 2**30).

    Raises ValueError naming ``what`` and the accepted forms when the value is not a size.
    """
    if isinstance(value, bool):
        raise ValueError(f"{what}: expected a size such as 80GiB or a number of bytes, got {value!r}")
    bare = True
    if isinstance(value, int):
        result = value          # exact (and not limited to float's range)
    elif isinstance(value, float):
        result = value
    elif isinstance(value, str):
        m = _SIZE_RE.match(value)
        unit = m.group(2).lower() if m else None
        if not m or unit not in _UNITS:
            raise ValueError(
                f"{what}: cannot read {value!r} as a size; write a number of bytes or a number "
                f"with a unit such as 64MiB, 80GB or 128GiB")
        result = float(m.group(1)) * _UNITS[unit]
        bare = _UNITS[unit] == 1
    else:
        raise ValueError(f"{what}: expected a size such as 80GiB or a number of bytes, got {value!r}")
    if result != result or result in (float("inf"), float("-inf")):
        raise ValueError(f"{what}: {value!r} is not a finite size; write a number of bytes or a "
                         f"number with a unit such as 64MiB, 80GB or 128GiB")
    if result < 0:
        raise ValueError(f"{what}: must not be negative, got {value!r}")
    if bare and result != int(result):
        # 1.5 bytes is a slip (a size meant in another unit), not something to round away
        raise ValueError(f"{what}: {value!r} is not a whole number of bytes; write an integer "
                         f"number of bytes or a size with a unit such as 64MiB or 1.5GiB")
    if result > MAX_BYTES:
        shown = f"{float(result):.3g}" if result < 1e300 else "over 1e300"
        raise ValueError(f"{what}: {value!r} is {shown} bytes, more than any machine has "
                         f"(at most 1 EiB); write the real size")
    return int(result)


def fmt_bytes(n: float) -> str:
    """Human-readable binary size: 1536 -> '1.5 KiB', 85899345920 -> '80.0 GiB'."""
    sign = "-" if n < 0 else ""
    n = abs(float(n))
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{sign}{n / scale:.1f} {unit}"
    return f"{sign}{int(n)} B"


def fmt_seconds(t: float) -> str:
    if t >= 1.0:
        return f"{t:.2f} s"
    if t >= 1e-3:
        return f"{t * 1e3:.1f} ms"
    return f"{t * 1e6:.0f} us"


def fmt_count(n: float) -> str:
    """A count with an SI-style suffix: 875 k, 124.4 M, 6.74 B."""
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {suffix}"
    return f"{n:g}"

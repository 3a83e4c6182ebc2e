"""Byte sizes as people write them: ``parse_bytes("24GiB")`` and ``format_bytes(n)``.

A budget such as ``memory_limit="24GiB"`` reads as a device's bytes. Decimal units are powers of
1000, binary ones powers of 1024, as the IEC defines them (a "24 GB" card in a spec sheet is
often 24 GiB; write the one you mean)::

    parse_bytes("24GiB")    == 24 * 2**30
    parse_bytes("1.5 GiB")  == 3 * 2**29
    parse_bytes("500 MB")   == 500 * 10**6
    parse_bytes(4096)       == 4096
    format_bytes(3 * 2**29) == "1.50 GiB"
"""

from __future__ import annotations

import math
import numbers
import re

__all__ = ["ACCEPTED_FORMS", "UNITS", "format_bytes", "parse_bytes"]

UNITS: dict[str, int] = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}

ACCEPTED_FORMS = (
    "a positive number of bytes (an int, or a finite float), or a string of a positive number and a unit: "
    "B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB (powers of 1024), any case, with an optional "
    "space, e.g. '24GiB', '1.5 GiB', '500MB', '4096'"
)

_SIZE = re.compile(r"^\s*([+-]?(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)\s*([a-z]*)\s*$", re.IGNORECASE)

_BINARY = (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))


def _refused(value: object, why: str) -> ValueError:
    return ValueError(f"fastpipe: {value!r} is not a size ({why}); a size is {ACCEPTED_FORMS}")


def parse_bytes(value: int | float | str) -> int:
    """``value`` in bytes, rounded down to a whole byte.

    Args:
        value: an int or float (bytes), or a string with a unit (see :data:`ACCEPTED_FORMS`).

    Returns:
        The number of bytes, at least 1.

    Raises:
        ValueError: a bool, NaN or infinity, a value that is not above 0 (or rounds down to 0
            bytes), a string that is not a number with one of the units, naming the accepted forms.
    """
    if isinstance(value, bool):
        raise _refused(value, "a bool")
    if isinstance(value, str):
        match = _SIZE.match(value)
        if match is None:
            raise _refused(value, "not a number followed by a unit")
        text, unit = match.group(1), match.group(2).lower() or "b"
        if unit not in UNITS:
            raise _refused(value, f"unknown unit {match.group(2)!r}")
        number = float(text)
        # Whole numbers stay exact at any size (a float would round 2**60 + 1).
        nbytes = int(text) * UNITS[unit] if text.lstrip("+-").isdigit() else None
    elif isinstance(value, numbers.Integral):
        number, nbytes = float(value), int(value)
    elif isinstance(value, numbers.Real):
        number, nbytes = float(value), None
    else:
        raise _refused(value, f"a {type(value).__name__}")
    if not math.isfinite(number):
        raise _refused(value, "not finite")
    if number <= 0:
        raise _refused(value, "not above 0")
    if nbytes is None:
        nbytes = math.floor(number * (UNITS[unit] if isinstance(value, str) else 1))
    if nbytes < 1:
        raise _refused(value, "below 1 byte")
    return nbytes


def format_bytes(nbytes: float) -> str:
    """``nbytes`` in the largest binary unit it reaches, two decimals: ``"1.50 GiB"``, ``"512 B"``.

    A negative count (a difference of two sizes) keeps its sign.
    """
    if not math.isfinite(nbytes):
        return f"{nbytes} B"
    size = abs(nbytes)
    sign = "-" if nbytes < 0 else ""
    for name, scale in _BINARY:
        if size >= scale:
            return f"{sign}{size / scale:.2f} {name}"
    return f"{sign}{size:.0f} B"

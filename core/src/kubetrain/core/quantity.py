"""Kubernetes resource quantities (`500m`, `16Gi`, `1e3`) as exact numbers, for the spec's checks and the pods'
sums; the strings that reach the API server keep their own units."""

from __future__ import annotations

import re
from decimal import Decimal

_QUANTITY = re.compile(r"^(?P<number>[0-9.]+(?:[eE][-+]?[0-9]+)?)(?P<suffix>[KMGTPE]i|[numkMGTPE])?$")


def scale_quantity(quantity: str, factor: int) -> str:
    """`factor` times a resource quantity, exactly, in the quantity's own unit ("500m" x 4 = "2000m")."""
    match = _QUANTITY.match(quantity)
    if match is None:
        raise ValueError(f"not a resource quantity: {quantity!r}")
    number = format((Decimal(match["number"]) * factor).normalize(), "f")
    return number + (match["suffix"] or "")


_SUFFIX_FACTORS = {"": Decimal(1), "n": Decimal("1e-9"), "u": Decimal("1e-6"), "m": Decimal("1e-3"),
                   **{s: Decimal(1000) ** (i + 1) for i, s in enumerate("kMGTPE")},
                   **{s + "i": Decimal(1024) ** (i + 1) for i, s in enumerate("KMGTPE")}}


def quantity_value(quantity: str) -> Decimal:
    """A resource quantity in base units (`16Gi` -> 17179869184)."""
    match = _QUANTITY.match(quantity)
    if match is None:
        raise ValueError(f"not a resource quantity: {quantity!r}")
    return Decimal(match["number"]) * _SUFFIX_FACTORS[match["suffix"] or ""]


def add_quantities(a: str, b: str) -> str:
    """a + b exactly: in their unit where they share one, else in base units (millis where fractional)."""
    ma, mb = _QUANTITY.match(a), _QUANTITY.match(b)
    if ma is None or mb is None:
        raise ValueError(f"not resource quantities: {a!r}, {b!r}")
    if ma["suffix"] == mb["suffix"]:
        return format((Decimal(ma["number"]) + Decimal(mb["number"])).normalize(), "f") + (ma["suffix"] or "")
    total = quantity_value(a) + quantity_value(b)
    if total == total.to_integral_value():
        return str(int(total))
    milli = total * 1000
    return f"{int(milli)}m" if milli == milli.to_integral_value() else format(total.normalize(), "f")

"""Numbers with SI prefixes chosen by magnitude: one formatter for every rate and time printed.

Three significant figures, at most four: ``712.0 TFLOP/s``, ``2.80 TB/s``, ``19.7 GB/s``,
``15.8 µs``. A prefix is never left at 1000 of itself (999.97 GB/s prints ``1.00 TB/s``).
"""

from __future__ import annotations

import math

_PREFIXES = ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k"), (1.0, ""),
             (1e-3, "m"), (1e-6, "µ"), (1e-9, "n"))


def si(value: float | None, unit: str) -> str:
    """``value`` in ``unit`` with the SI prefix that keeps 1 <= mantissa < 1000.

    Two decimals below 10, one above; ``-`` for a missing or non-finite value.

    Example:
        >>> si(712030.4e9, "FLOP/s"), si(2.8e12, "B/s"), si(19.7e9, "B/s"), si(1.58e-5, "s")
        ('712.0 TFLOP/s', '2.80 TB/s', '19.7 GB/s', '15.8 µs')
        >>> si(999.97e9, "B/s"), si(0.0, "s"), si(None, "s")
        ('1.00 TB/s', '0.00 s', '-')
    """
    if value is None or not math.isfinite(value):
        return "-"
    mag = abs(value)
    i = next((j for j, (scale, _) in enumerate(_PREFIXES) if mag >= scale), len(_PREFIXES) - 1)
    if mag == 0:
        i = _PREFIXES.index((1.0, ""))
    scale, prefix = _PREFIXES[i]
    x = value / scale
    digits = 2 if round(abs(x), 2) < 10 else 1
    if round(abs(x), digits) >= 1000 and i > 0:           # 999.97 G rounds to 1000.0 G: 1.00 T
        scale, prefix = _PREFIXES[i - 1]
        x, digits = value / scale, 2
    return f"{x:.{digits}f} {prefix}{unit}"


def duration(seconds: float | None) -> str:
    """A time in s, ms, µs or ns (``si(seconds, "s")``).

    Example:
        >>> duration(0.00063), duration(1.6443), duration(0.0229)
        ('630.0 µs', '1.64 s', '22.9 ms')
    """
    return si(seconds, "s")

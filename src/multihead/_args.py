"""Checks of plain arguments (counts, sizes, probabilities), one wording everywhere.

NumPy's integers (``np.int64(8)``, what indexing an array gives) and floats are numbers
too: they are accepted and returned as Python ints and floats, so what is stored, hashed
and printed is the same whichever kind the caller passed. ``bool`` is refused (``True``
is not a count).
"""

from __future__ import annotations

import numbers
import re

#: the largest count a tensor's size or index can hold (int64)
INT64_MAX = 2**63 - 1


def positive_int(name: str, value, *, least: int = 1, hint: str = "") -> int:
    """``value`` as an int of at least ``least`` and at most :data:`INT64_MAX` (every count
    becomes a tensor size or index), or a ValueError naming ``name`` and showing ``value``
    (then ``hint``, what the number means or how to pick it).

    Example:
        >>> import numpy as np
        >>> positive_int("num_heads", np.int64(8))
        8
        >>> positive_int("n", 0, least=0)
        0
        >>> positive_int("sliding_window size", 2**63)
        Traceback (most recent call last):
        ...
        ValueError: sliding_window size must be at most 2**63 - 1 (an int64), got 9223372036854775808
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < least:
        what = "a positive int" if least == 1 else f"an int >= {least}"
        import torch                        # (only for this message)
        if (isinstance(value, torch.Tensor) and value.numel() == 1
                and not value.is_floating_point() and value.dtype != torch.bool):
            hint = "pass int(...) of the tensor" + (f"; {hint}" if hint else "")
        raise ValueError(f"{name} must be {what}, got {value!r:.60}" + (f": {hint}" if hint else ""))
    if value > INT64_MAX:
        raise ValueError(f"{name} must be at most 2**63 - 1 (an int64), got {value!r:.60}"
                         + (f": {hint}" if hint else ""))
    return int(value)


def fraction(name: str, value) -> float:
    """``value`` as a float in ``[0, 1)`` (a dropout probability; NumPy's floats too), or a
    ValueError naming ``name`` and showing ``value``.

    Example:
        >>> import numpy as np
        >>> fraction("dropout_p", np.float32(0.25))
        0.25
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value < 1.0:
        hint = (f" (a {type(value).__name__}): pass a Python float in [0, 1) (a tensor's "
                f".item())" if hasattr(value, "item") and not isinstance(value, numbers.Real)
                else "")
        raise ValueError(f"{name} must be a float in [0, 1), got {value!r:.60}{hint}")
    return float(value)


def counted(n, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1: how counts read in messages.

    Example:
        >>> counted(1, "run"), counted(3, "length group")
        ('1 run', '3 length groups')
    """
    return f"{n} {noun}{'' if n == 1 else 's'}"


#: control characters (C0, DEL, C1), the bidirectional marks, overrides and isolates, and
#: the line and paragraph separators, which a terminal would obey (clear the screen, set
#: its title, reorder or break the line) rather than show; the HTML report escapes the same
#: ones (it reads this pattern), newlines and tabs of a text aside
CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200e\u200f\u2028\u2029"
                       "\u202a-\u202e\u2066-\u2069]")


def plain(text: str) -> str:
    r"""``text`` for a terminal: control and bidirectional-override characters escaped
    (``\x1b``), so that a user's text is shown, never obeyed; the rest unchanged.

    Example:
        >>> plain("it\x1b[2J is \u202eon; caf\u00e9 \U0001f600")
        'it\\x1b[2J is \\u202eon; café 😀'
    """
    return CONTROLS.sub(lambda m: m[0].encode("unicode_escape").decode("ascii"), text)

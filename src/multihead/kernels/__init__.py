"""Our own GPU kernels, in Triton; imported only when Triton is installed.

Tests run them on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import importlib.util


def available() -> bool:
    """True when Triton can be imported (the kernels' one dependency beyond torch).

    Example:
        >>> import multihead as mh
        >>> available() == ("triton" in mh.backends())     # the backend registers with it
        True
    """
    return importlib.util.find_spec("triton") is not None

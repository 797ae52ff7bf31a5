"""Our own GPU kernels, in Triton; imported only when Triton is installed.

Tests run them on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import importlib.util

#: |lse| in base 2 from which a backward recomputes a row's softmax statistics instead of
#: reading them from its lse, which may have lost the log of the row's sum (see
#: :mod:`._exact_rows`; natural 710, in practice reached only through a bias). The Triton
#: kernels and the torch backends share it
HUGE_LSE2 = 1024.0


def available() -> bool:
    """True when Triton can be imported (the kernels' one dependency beyond torch).

    Example:
        >>> import multihead as mh
        >>> available() == ("triton" in mh.backends())     # the backend registers with it
        True
    """
    return importlib.util.find_spec("triton") is not None

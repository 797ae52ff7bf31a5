"""A first-call race in the CPU math library, avoided at import.

Torch computes ``exp``, ``log`` and other elementwise functions of contiguous float
tensors on the CPU with oneMKL's vector math (VML). oneMKL 2024.2, which torch's CPU wheels
bundle, picks each function's kernel on its first call; when two threads make that first
call at once, one of them can run a low-accuracy kernel for its whole chunk (pytorch/pytorch
issue 188792; fixed in oneMKL 2025.0). Our blocksparse backend's first ``exp`` over a
multi-head score tile was hit: head 0 came out with errors of 3e-5 against fp64 where the
error rule allows about 1e-6, in a few percent of processes. Calling each function once on
one element, on one thread, before anything runs in parallel settles the choice.
"""

from __future__ import annotations

import torch

#: the elementwise functions our CPU paths (and the models we run) call
_FUNCTIONS = (torch.exp, torch.log, torch.exp2, torch.log1p, torch.expm1, torch.tanh,
              torch.erf, torch.sqrt, torch.rsqrt, torch.sigmoid)


def settle() -> None:
    """Make the first call of each function in :data:`_FUNCTIONS` here, on one element (so
    on this thread only), for float32 and float64.

    Example:
        >>> settle()
    """
    for dtype in (torch.float32, torch.float64):
        x = torch.full((1,), 0.5, dtype=dtype)
        for fn in _FUNCTIONS:
            fn(x)

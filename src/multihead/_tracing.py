"""``torch.jit.trace`` and multihead: refused, with what to use instead.

A trace records the tensor ops of one call and replays them for every later input. Our
calls choose a backend, a tile plan and RoPE's table rows from the sizes and the mask they
are given, in Python, so a replay with another mask or length would run the first call's
plan: silently wrong. ``torch.compile`` and ``torch.export.export`` trace those choices
exactly (with guards), so the refusal points there. The drop-in for
``torch.nn.MultiheadAttention`` is the exception: its trace runs torch's own forward.
"""

from __future__ import annotations

import torch


def refuse_jit_trace(what: str) -> None:
    """Raise a RuntimeError naming ``what`` while ``torch.jit.trace`` records.

    Example:
        >>> refuse_jit_trace("multihead.attention")      # not tracing: nothing happens
    """
    if torch.jit.is_tracing():
        raise RuntimeError(
            f"{what} cannot be recorded by torch.jit.trace: a trace keeps the plan of the "
            f"one call it saw (its backend, the tiles its mask rules out, RoPE's table), so "
            f"other masks or lengths would run it wrongly; use torch.export.export or "
            f"torch.compile, which trace it exactly (or, for a drop-in for "
            f"torch.nn.MultiheadAttention, multihead.nn.MultiheadAttention: its trace runs "
            f"torch's implementation)")

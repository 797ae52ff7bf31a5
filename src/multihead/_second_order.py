"""Second-order gradients: which backends give them, and the one error the others raise.

The ``reference`` backend computes attention with differentiable torch ops, so its
gradients can be differentiated again (``create_graph=True``, gradient penalties,
``torch.autograd.functional.hessian``); ``blocksparse`` gives the same by recomputing the
reference's gradients when a backward builds a graph. The Triton kernels' backward is
first-order only and raises this module's error at once instead of failing deep inside
torch; ``sdpa`` (``auto``'s usual choice) runs torch's fused kernels, whose backward torch
cannot differentiate again (torch's error, as with ``F.scaled_dot_product_attention``).
Forward-mode AD (jvp, jacfwd, dual tensors) runs on ``reference`` and ``rows``; the
capability ``forward_ad`` keeps ``auto`` on them.
"""

from __future__ import annotations

import torch


def refuse_second_order(backend: str) -> None:
    """Raise when a backward runs with ``create_graph=True`` (grad mode is on inside it).

    Example:
        >>> import torch
        >>> with torch.no_grad():                   # as in a plain backward
        ...     refuse_second_order("triton")
    """
    if torch.is_grad_enabled():
        raise RuntimeError(second_order_message(backend, "a backward with create_graph=True"))


def second_order_message(backend: str, what: str) -> str:
    """The error's text: what was asked, and the backend that gives it."""
    return (f"the {backend} backend's gradients are first-order only, and {what} (double "
            f"backward, a gradient penalty through attention, hessian) differentiates them "
            f"again: pass backend='reference' to multihead.attention (or set the module's "
            f"backend), whose gradients are differentiable")

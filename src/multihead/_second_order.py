"""Second-order gradients: which backends give them, and the one error the others raise.

The ``reference`` backend computes attention with differentiable torch ops, so its
gradients can be differentiated again (``create_graph=True``, gradient penalties,
``torch.autograd.functional.hessian``). The tiled backends' backward passes (blocksparse,
the Triton kernels) are first-order only; a backward asked to build a graph raises this
module's error at once instead of failing deep inside torch.
"""

from __future__ import annotations

import torch


def refuse_second_order(backend: str) -> None:
    """Raise when a backward runs with ``create_graph=True`` (grad mode is on inside it).

    Example:
        >>> refuse_second_order("blocksparse")          # a plain backward: grad mode is off
    """
    if torch.is_grad_enabled():
        raise RuntimeError(second_order_message(backend, "a backward with create_graph=True"))


def second_order_message(backend: str, what: str) -> str:
    """The error's text: what was asked, and the backend that gives it."""
    return (f"the {backend} backend's gradients are first-order only, and {what} (double "
            f"backward, a gradient penalty through attention, hessian) differentiates them "
            f"again: pass backend='reference' to multihead.attention (or set the module's "
            f"backend), whose gradients are differentiable")

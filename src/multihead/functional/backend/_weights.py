"""The attention weights of a call, from the Triton weights kernel, with gradients.

:func:`multihead.kernels.weights.attention_weights` writes the weights once in the inputs'
dtype; a caller's loss rarely uses them (``torch.nn.MultiheadAttention`` returns them by
default, and a training loop reads the output), so their gradient is not a kernel: where a
loss does use them, the backward recomputes the reference's weights in its compute dtype
(:func:`.reference.masked_scores`, :func:`.reference.safe_softmax`) and differentiates
them, with a graph where the backward builds one, so they differentiate again.
"""

from __future__ import annotations

import torch

from .._call import AttentionCall
from .reference import _Product, masked_scores, safe_softmax


class _KernelWeights(torch.autograd.Function):
    """The kernel's weights of ``(q, k)``; the reference's gradients."""

    @staticmethod
    def forward(ctx, q, k, call):
        from ...kernels.weights import attention_weights
        ctx.save_for_backward(q, k)
        ctx.call = call                       # its mask, scale and compute dtype
        return attention_weights(q, k, call.effective_mask, scale=call.scale)

    @staticmethod
    def backward(ctx, dw):
        q, k = ctx.saved_tensors
        wanted = [t for t, need in zip((q, k), ctx.needs_input_grad) if need]
        graph = torch.is_grad_enabled()       # (a backward that builds a graph)
        with torch.enable_grad():
            weights, _ = safe_softmax(masked_scores(ctx.call, q, k, _Product.apply), lse=False)
            grads = iter(torch.autograd.grad(weights, wanted, dw.to(weights.dtype),
                                             create_graph=graph, allow_unused=True))
        return (*(next(grads) if need else None for need in ctx.needs_input_grad[:2]), None)


def kernel_weights(call: AttentionCall) -> torch.Tensor:
    """The weights ``(B, H, Sq, Sk)`` of ``call`` in its inputs' dtype, from the kernel;
    differentiable in ``q`` and ``k`` where the call takes gradients.

    Example:
        >>> import torch, multihead as mh
        >>> from multihead.functional._call import make_call
        >>> q = torch.randn(1, 2, 64, 16, device="cuda", dtype=torch.float16)   # doctest: +SKIP
        >>> call = make_call(q, q, q, mask=mh.masks.causal(), scale=None, dropout_p=0.0,
        ...                  return_weights=True, return_lse=False)          # doctest: +SKIP
        >>> kernel_weights(call).shape                                         # doctest: +SKIP
        torch.Size([1, 2, 64, 64])
    """
    if call.q.requires_grad or call.k.requires_grad:
        return _KernelWeights.apply(call.q, call.k, call)
    from ...kernels.weights import attention_weights
    return attention_weights(call.q, call.k, call.effective_mask, scale=call.scale)

"""The attention weights of a call, from the Triton weights kernel, with gradients.

:func:`multihead.kernels.weights.attention_weights` writes the weights once in the inputs'
dtype; a caller's loss rarely uses them (``torch.nn.MultiheadAttention`` returns them by
default, and a training loop reads the output), so their gradient is not a kernel: where a
loss does use them, the backward recomputes the reference's weights in its compute dtype
(:func:`.reference.masked_scores`, :func:`.reference.safe_softmax`) and differentiates
them, with a graph where the backward builds one, so they differentiate again. The
weights' mean over the heads (``return_weights="mean"``) is the kernel's own, whose forward
never holds the weights per head (the backward, where a loss uses the mean, recomputes the
reference's per head, as for the weights themselves). With dropout, the weights are those
the attention kernels multiplied the values by (each kept one scaled by ``1 / (1 - rate)``,
the rate ``p`` rounded to a multiple of 2^-16, the dropped ones 0: the kernels' draws,
:mod:`multihead.kernels._dropout`), as ``torch.nn.MultiheadAttention`` returns them in
training; their gradient is the reference's times those draws.
"""

from __future__ import annotations

import torch

from .._call import AttentionCall
from .reference import _Product, masked_scores, safe_softmax


class _KernelWeights(torch.autograd.Function):
    """The kernel's weights of ``(q, k)`` (or their head mean); the reference's gradients."""

    @staticmethod
    def forward(ctx, q, k, call, config, dropout):
        ctx.save_for_backward(q, k)
        ctx.mask, ctx.scale = call.effective_mask, call.scale     # (no tensor of the call's)
        ctx.average, ctx.dropout = call.average_weights, dropout
        return _run(q, k, call, config, dropout)

    @staticmethod
    def backward(ctx, dw):
        q, k = ctx.saved_tensors
        graph = torch.is_grad_enabled()       # (a backward that builds a graph)
        with torch.enable_grad():
            # views: q and k may be one tensor (self-attention through mh.attention(x, x, x)),
            # whose gradient would be asked for twice and counted twice
            q, k = q.view_as(q), k.view_as(k)
            wanted = [t for t, need in zip((q, k), ctx.needs_input_grad) if need]
            call = AttentionCall(q, k, k, ctx.mask, ctx.scale, 0.0, True, False)
            weights, _ = safe_softmax(masked_scores(call, q, k, _Product.apply), lse=False)
            if ctx.dropout is not None:                                    # the same draws
                from ...kernels._dropout import keep_mask
                B, H, Sq, Sk = weights.shape
                keep = keep_mask(ctx.dropout, B, H, Sq, Sk)                # (B, H, Sq, Sk)
                weights = weights * (keep * ctx.dropout.keep_scale).to(weights.dtype)
            if ctx.average:
                weights = weights.mean(dim=1)                              # (B, Sq, Sk)
            grads = iter(torch.autograd.grad(weights, wanted, dw.to(weights.dtype),
                                             create_graph=graph, allow_unused=True))
        return (*(next(grads) if need else None for need in ctx.needs_input_grad[:2]),
                None, None, None)


def _run(q, k, call: AttentionCall, config, dropout) -> torch.Tensor:
    from ...kernels.weights import attention_weights
    return attention_weights(q, k, call.effective_mask, scale=call.scale,
                             average=call.average_weights, config=config, dropout=dropout)


def kernel_weights(call: AttentionCall, dropout=None) -> torch.Tensor:
    """The weights ``(B, H, Sq, Sk)`` of ``call`` (its ``average_weights``: their head mean
    ``(B, Sq, Sk)``) in its inputs' dtype, from the kernel; differentiable in ``q`` and
    ``k`` where the call takes gradients. ``dropout``: the call's
    (:class:`multihead.kernels._dropout.Dropout`, as its attention kernels drew it).

    Example:
        >>> import torch, multihead as mh
        >>> from multihead.functional._call import make_call
        >>> q = torch.randn(1, 2, 64, 16, device="cuda", dtype=torch.float16)   # doctest: +SKIP
        >>> call = make_call(q, q, q, mask=mh.masks.causal(), scale=None, dropout_p=0.0,
        ...                  return_weights=True, return_lse=False)          # doctest: +SKIP
        >>> kernel_weights(call).shape                                         # doctest: +SKIP
        torch.Size([1, 2, 64, 64])
    """
    from ...kernels._band import launch_config
    # the block-sparse forward's tiles (sized by the wider of D and Dv), so that a mask it
    # ran has its block lists already
    config = launch_config("fwd_sparse", call.D, call.Dv, queries=call.Sq)
    if call.q.requires_grad or call.k.requires_grad:
        return _KernelWeights.apply(call.q, call.k, call, config, dropout)
    return _run(call.q, call.k, call, config, dropout)

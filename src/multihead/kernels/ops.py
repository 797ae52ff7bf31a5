"""Our kernels as PyTorch operators: ``torch.ops.multihead.flash_attention`` (forward and
backward) and ``torch.ops.multihead.flash_decode`` (forward only).

Each is a ``torch.library.custom_op`` with a fake implementation (output shapes from input
shapes, no data read), so ``torch.compile(fullgraph=True)`` traces a call as one opaque node
instead of breaking the graph on Triton's Python launcher; the forward's autograd formula is
the backward kernels of :mod:`.flash_bwd`. The grids depend on shapes only and nothing reads
a device value back to the host, so CUDA graphs can capture a call.

A window of ``0`` means none (the schema has no room for ``None`` and an int in one place
that would not also recompile per value).

Notation: B batch, H query heads, Hkv K/V heads, Sq/Sk lengths, D/Dv head dims.
"""

from __future__ import annotations

import torch

from .decode import decode_forward
from .flash_bwd import flash_backward
from .flash_fwd import flash_forward


def _kw(scale, causal, window, offset, kv_lengths) -> dict:
    return dict(scale=scale, causal=causal, window=window or None, offset=offset,
                kv_lengths=kv_lengths)


@torch.library.custom_op("multihead::flash_attention", mutates_args=())
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    causal: bool, window: int, offset: int,
                    kv_lengths: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of :func:`.flash_forward` (``window=0``: no window).

    Example:
        >>> import torch
        >>> q = torch.randn(1, 2, 32, 16, device="cuda", dtype=torch.float16)   # doctest: +SKIP
        >>> out, lse = torch.ops.multihead.flash_attention(q, q, q, 0.25, True, 0, 0, None)  # doctest: +SKIP
    """
    return flash_forward(q, k, v, **_kw(scale, causal, window, offset, kv_lengths))


@flash_attention.register_fake
def _(q, k, v, scale, causal, window, offset, kv_lengths):
    B, H, Sq, _ = q.shape
    return q.new_empty(B, H, Sq, v.shape[-1]), q.new_empty(B, H, Sq, dtype=torch.float32)


@torch.library.custom_op("multihead::flash_attention_backward", mutates_args=())
def flash_attention_backward(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor,
                             k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                             lse: torch.Tensor, scale: float, causal: bool, window: int,
                             offset: int, kv_lengths: torch.Tensor | None,
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`.flash_backward`."""
    return flash_backward(dout, q, k, v, out, lse, dlse=dlse,
                          **_kw(scale, causal, window, offset, kv_lengths))


@flash_attention_backward.register_fake
def _(dout, dlse, q, k, v, out, lse, scale, causal, window, offset, kv_lengths):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup(ctx, inputs, output):
    q, k, v, scale, causal, window, offset, kv_lengths = inputs
    ctx.save_for_backward(q, k, v, *output, kv_lengths)
    ctx.args = (scale, causal, window, offset)


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, kv_lengths = ctx.saved_tensors
    dq, dk, dv = flash_attention_backward(dout.contiguous(), dlse, q, k, v, out, lse,
                                          *ctx.args, kv_lengths)
    return dq, dk, dv, None, None, None, None, None


flash_attention.register_autograd(_backward, setup_context=_setup)


@torch.library.custom_op("multihead::flash_decode", mutates_args=())
def flash_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                 window: int, offset: int,
                 kv_lengths: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of :func:`.decode_forward` (forward only; ``window=0``: no window)."""
    return decode_forward(q, k, v, **_kw(scale, causal, window, offset, kv_lengths))


@flash_decode.register_fake
def _(q, k, v, scale, causal, window, offset, kv_lengths):
    B, H, Sq, _ = q.shape
    return q.new_empty(B, H, Sq, v.shape[-1]), q.new_empty(B, H, Sq, dtype=torch.float32)

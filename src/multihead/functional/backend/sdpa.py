"""The sdpa backend: ``torch.nn.functional.scaled_dot_product_attention``.

PyTorch's fused kernels (flash on CPU and GPU) without materializing weights.
- no mask (or a mask that allows everything, such as causal at Sq=1): the plain kernel;
- a pure causal mask where torch's alignment agrees with ours: ``is_causal=True``;
- anything else: the mask is materialized as a bool (or additive float) tensor.
GQA never copies K/V: the query heads of a group are folded into the query axis when the
mask does not depend on the head (faster on CPU), else ``enable_gqa=True``.
Rows with nothing to attend to are opened before the kernel and zeroed after it, so they
return zeros with zero gradients on every torch version.
Limits: no weights, no log-sum-exp.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ._call import AttentionCall
from .reference import mask_terms
from .registry import Backend, register


def _uses_is_causal(call: AttentionCall) -> bool:
    """torch's is_causal is upper-left aligned: it matches ours when Sq == Sk."""
    return call.is_pure_causal and (call.effective_mask.align == "upper_left" or call.Sq == call.Sk)


def _plan_mask(call: AttentionCall):
    """Return (attn_mask or None, is_causal, row_ok or None) for SDPA."""
    m = call.effective_mask
    if m is None:
        return None, False, None
    if _uses_is_causal(call):
        return None, True, None
    allowed, bias = mask_terms(call, call.q.device)
    row_ok = None
    if allowed is not None:
        allowed = allowed.expand(*allowed.shape[:2], call.Sq, call.Sk)
        has_any = allowed.any(dim=-1, keepdim=True)                   # (B', H', Sq, 1)
        if torch.compiler.is_compiling() or not bool(has_any.all()):  # branch-free when tracing
            allowed = allowed | ~has_any                              # open empty rows ...
            row_ok = has_any                                          # ... zero them after
    if bias is None:
        return allowed, False, row_ok
    attn = bias.to(call.q.dtype)
    if allowed is not None:
        attn = attn.masked_fill(~allowed, float("-inf"))
    return attn, False, row_ok


class SDPA(Backend):
    name = "sdpa"
    summary = "torch's fused scaled_dot_product_attention (flash kernel); dense masks materialized"

    def unsupported(self, call):
        if call.return_weights:
            return "does not return attention weights"
        if call.return_lse:
            return "does not return the log-sum-exp"
        return None

    def cost(self, call):
        if call.effective_mask is None:
            return 1.0 * call.dense_work
        if _uses_is_causal(call):
            return 0.55 * call.dense_work
        return 1.25 * call.dense_work  # full work plus a materialized mask

    def cost_note(self, call):
        if call.effective_mask is None:
            return "no mask: plain fused kernel"
        if _uses_is_causal(call):
            return "is_causal=True: the fused kernel skips the upper triangle"
        return "mask materialized densely, every pair computed"

    def run(self, call):
        q, k, v = call.q, call.k, call.v
        attn_mask, is_causal, row_ok = _plan_mask(call)
        B, H, Hkv, G, Sq = call.B, call.H, call.Hkv, call.group, call.Sq
        kw = dict(dropout_p=call.dropout_p, scale=call.scale, is_causal=is_causal)
        head_free = attn_mask is None or attn_mask.shape[1] == 1
        if G > 1 and head_free and not is_causal:
            # fold the G query heads of each K/V head into the query axis: no K/V copies
            qf = q.reshape(B, Hkv, G * Sq, call.D)                    # (B, Hkv, G*Sq, D)
            if attn_mask is not None:
                Bm = attn_mask.shape[0]
                attn_mask = attn_mask.unsqueeze(2).expand(Bm, 1, G, Sq, call.Sk)
                attn_mask = attn_mask.reshape(Bm, 1, G * Sq, call.Sk)  # (B', 1, G*Sq, Sk)
            out = F.scaled_dot_product_attention(qf, k, v, attn_mask=attn_mask, **kw)
            out = out.view(B, H, Sq, call.Dv)                         # (B, H, Sq, Dv)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=attn_mask,
                                                 enable_gqa=G > 1, **kw)
        if row_ok is not None:
            out = out * row_ok.to(out.dtype)
        return out, None, None


register(SDPA())

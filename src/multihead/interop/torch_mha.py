"""``torch.nn.MultiheadAttention`` interop: conversion both ways, and a drop-in replacement.

torch's masks say ``True`` = *ignore*; ours say ``True`` = *may attend*. The inversion
happens here and nowhere else. The one deliberate difference of the drop-in: where torch
returns NaN (a query whose keys are all masked), it returns zeros.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import multihead as mh


def _refuse_extras(m: nn.MultiheadAttention) -> None:
    if m.bias_k is not None or m.bias_v is not None:
        raise ValueError("from_torch: add_bias_kv=True (bias_k/bias_v) has no counterpart in "
                         "multihead.MultiHeadAttention; use multihead.nn.MultiheadAttention, "
                         "which supports it")
    if m.add_zero_attn:
        raise ValueError("from_torch: add_zero_attn=True has no counterpart in "
                         "multihead.MultiHeadAttention; use multihead.nn.MultiheadAttention")


def _copy_weights(dst, src, packed: bool) -> None:
    """Copy projections between torch's and our module: both use torch's parameter names."""
    names = ["in_proj_weight"] if packed else [f"{r}_proj_weight" for r in "qkv"]
    for name in names + (["in_proj_bias"] if src.in_proj_bias is not None else []):
        getattr(dst, name).copy_(getattr(src, name))
    dst.out_proj.load_state_dict(src.out_proj.state_dict())


@torch.no_grad()
def from_torch(m: nn.MultiheadAttention) -> "mh.MultiHeadAttention":
    """An equivalent :class:`multihead.MultiHeadAttention` with copied weights.

    Example:
        >>> import torch, multihead as mh
        >>> t = torch.nn.MultiheadAttention(16, 4, batch_first=True)
        >>> ours = mh.MultiHeadAttention.from_torch(t)
        >>> x = torch.randn(2, 5, 16)
        >>> torch.allclose(ours(x), t(x, x, x, need_weights=False)[0], atol=1e-6)
        True
    """
    if not isinstance(m, nn.MultiheadAttention):
        raise TypeError(f"from_torch takes a torch.nn.MultiheadAttention, got {type(m).__name__}")
    _refuse_extras(m)
    p = m.out_proj.weight
    ours = mh.MultiHeadAttention(m.embed_dim, m.num_heads, bias=m.in_proj_bias is not None,
                                 dropout=m.dropout, kdim=m.kdim, vdim=m.vdim,
                                 device=p.device, dtype=p.dtype)
    _copy_weights(ours, m, packed=m._qkv_same_embed_dim)
    return ours.train(m.training)


@torch.no_grad()
def to_torch(ours: "mh.MultiHeadAttention") -> nn.MultiheadAttention:
    """An equivalent ``torch.nn.MultiheadAttention(batch_first=True)`` with copied weights."""
    if ours.num_kv_heads != ours.num_heads or ours.head_dim * ours.num_heads != ours.embed_dim:
        raise ValueError(f"to_torch: torch.nn.MultiheadAttention has no GQA/MQA and needs "
                         f"head_dim == embed_dim / num_heads; this module has {ours.num_heads} "
                         f"heads, {ours.num_kv_heads} kv heads, head_dim {ours.head_dim}")
    if ours.rope is not None:
        raise ValueError("to_torch: torch.nn.MultiheadAttention has no rotary embedding")
    p = ours.out_proj.weight
    t = nn.MultiheadAttention(ours.embed_dim, ours.num_heads, dropout=ours.dropout,
                              bias=ours.in_proj_bias is not None, kdim=ours.kdim, vdim=ours.vdim,
                              batch_first=True, device=p.device, dtype=p.dtype)
    _copy_weights(t, ours, packed=ours.packed)
    return t.train(ours.training)


def _torch_mask(mask, name: str, dtype) -> "mh.masks.Mask | None":
    """torch convention (bool True = ignore, or additive float) -> a multihead mask."""
    if mask is None:
        return None
    if not isinstance(mask, torch.Tensor):
        raise TypeError(f"{name} must be a tensor or None, got {type(mask).__name__}")
    if mask.dtype == torch.bool:
        return mh.masks.dense(~mask)
    if mask.is_floating_point():
        return mh.masks.bias(mask.to(dtype))
    raise TypeError(f"{name} must be bool (True = ignore) or float (added to scores), got {mask.dtype}")


class MultiheadAttention(nn.MultiheadAttention):
    """Drop-in for ``torch.nn.MultiheadAttention``: same constructor, forward, parameters and
    ``state_dict``; computed by :func:`multihead.attention`.

    Masks follow torch's convention here (bool ``True`` = ignore, or additive float).
    The one deliberate difference: a query whose keys are all masked gets zeros, not NaN.

    Example:
        >>> import torch, multihead as mh
        >>> t = torch.nn.MultiheadAttention(16, 4)
        >>> ours = mh.nn.MultiheadAttention(16, 4)
        >>> _ = ours.load_state_dict(t.state_dict())
        >>> x = torch.randn(5, 2, 16)                       # (L, B, E): batch_first=False
        >>> torch.allclose(ours(x, x, x)[0], t(x, x, x)[0], atol=1e-6)
        True
    """

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True,
                attn_mask=None, average_attn_weights=True, is_causal=False):
        if is_causal and attn_mask is None:
            raise RuntimeError("Need attn_mask if specifying the is_causal hint (torch's rule); "
                               "with multihead you can pass mask=multihead.masks.causal() instead")
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        if not self.batch_first or unbatched:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))  # (B, S, E)
        B, L, E = query.shape
        H, Dh = self.num_heads, self.head_dim
        if self._qkv_same_embed_dim:
            w_q, w_k, w_v = self.in_proj_weight.split(E)
        else:
            w_q, w_k, w_v = self.q_proj_weight, self.k_proj_weight, self.v_proj_weight
        b_q = b_k = b_v = None
        if self.in_proj_bias is not None:
            b_q, b_k, b_v = self.in_proj_bias.split(E)
        q = F.linear(query, w_q, b_q).view(B, L, H, Dh).transpose(1, 2)     # (B, H, L, Dh)
        k, v = F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)          # (B, S, E)
        extra = []                                                          # keys added at the end
        if self.bias_k is not None:
            k = torch.cat([k, self.bias_k.view(1, 1, E).expand(B, 1, E)], dim=1)
            v = torch.cat([v, self.bias_v.view(1, 1, E).expand(B, 1, E)], dim=1)
            extra.append(1)
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(B, 1, E)], dim=1)
            v = torch.cat([v, v.new_zeros(B, 1, E)], dim=1)
            extra.append(1)
        S = k.shape[1]
        k = k.view(B, S, H, Dh).transpose(1, 2)                             # (B, H, S, Dh)
        v = v.view(B, S, H, Dh).transpose(1, 2)
        mask = self._mask(attn_mask, key_padding_mask, B, L, S, sum(extra), q.dtype)
        p = self.dropout if self.training else 0.0
        res = mh.attention(q, k, v, mask=mask, dropout_p=p, return_weights=need_weights)
        out, w = res if need_weights else (res, None)
        out = self.out_proj(out.transpose(1, 2).reshape(B, L, E))          # (B, L, E)
        if not self.batch_first or unbatched:
            out = out.transpose(0, 1)
        if unbatched:
            out = out.squeeze(1)
        if w is not None:
            if average_attn_weights:
                w = w.mean(dim=1)                                           # (B, L, S)
            if unbatched:
                w = w.squeeze(0)
        return out, w

    def _mask(self, attn_mask, key_padding_mask, B, L, S, n_extra, dtype):
        """Combine torch-style masks into one multihead mask over (B, H, L, S)."""
        if attn_mask is not None and attn_mask.dim() == 3:
            if attn_mask.shape[0] != B * self.num_heads:
                raise ValueError(f"attn_mask 3-D must be (B*num_heads, L, S) = "
                                 f"({B * self.num_heads}, {L}, {S - n_extra}), got {tuple(attn_mask.shape)}")
            attn_mask = attn_mask.view(B, self.num_heads, *attn_mask.shape[1:])
        pad = lambda m: F.pad(m, (0, n_extra), value=False if m.dtype == torch.bool else 0.0) \
            if n_extra and m is not None else m
        attn, kpm = pad(attn_mask), pad(key_padding_mask)
        masks = [m for m in (_torch_mask(attn, "attn_mask", dtype),
                             _torch_mask(kpm.view(B, 1, 1, S) if kpm is not None else None,
                                         "key_padding_mask", dtype)) if m is not None]
        if not masks:
            return None
        return masks[0] if len(masks) == 1 else masks[0] & masks[1]

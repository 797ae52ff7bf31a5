"""``torch.nn.MultiheadAttention`` interop: conversion both ways, and a drop-in replacement.

torch's masks say ``True`` = *ignore*; ours say ``True`` = *may attend*. The inversion
happens here and nowhere else. The drop-in follows torch's rules as torch's own tests pin
them down: the inputs it refuses (with torch's exception type, which is also a
``ValueError``), the dtype mismatches it tolerates, the ``is_causal`` hint, TorchScript
(which compiles torch's implementation on the same parameters), NestedTensor inputs, the
memory layout of the output, and two float masks added as torch adds them (in the
query's dtype, or a mask's wider one: a sum past its range is ``-inf`` and hides its
key). The deliberate differences: where torch returns NaN (a query whose keys are all
masked), it returns zeros; a float mask holding NaN or +inf is refused (torch returns
NaN rows); a float mask of another dtype than the query's is added at its own precision
(torch refuses it on most paths and rounds it on others, where a finite value past the
query's range becomes ``-inf`` and hides its key).
"""

from __future__ import annotations

import inspect
from typing import Optional, Tuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

import multihead as mh
from multihead._dtypes import check_dtype
from multihead.modules.attention import _divisors
from multihead.masks._content import by_content
from multihead.modules.loading import AllOrNothing

from .torch_rules import (_AssertionArgError, _as_torch_raises, _check_inputs, _check_nested,
                          _FusedPathArgError, _lengths, _read_weights, _RuntimeArgError,
                          _takes_fast_path, _torch_mask)


def _refuse_extras(m: nn.MultiheadAttention) -> None:
    if m.bias_k is not None or m.bias_v is not None:
        raise ValueError("from_torch: add_bias_kv=True (bias_k/bias_v) has no counterpart in "
                         "multihead.MultiHeadAttention; use multihead.nn.MultiheadAttention, "
                         "which supports it")
    if m.add_zero_attn:
        raise ValueError("from_torch: add_zero_attn=True has no counterpart in "
                         "multihead.MultiHeadAttention; use multihead.nn.MultiheadAttention")
    if not m.batch_first:
        raise ValueError("from_torch: the torch module has batch_first=False (inputs (L, N, E)), "
                         "but multihead.MultiHeadAttention takes (N, L, E), so code fed as "
                         "before would attend across the batch: build the torch module with "
                         "batch_first=True, or keep torch's layout with "
                         "multihead.nn.MultiheadAttention(E, H).load_state_dict(m.state_dict())")


def _copy_weights(dst, src, packed: bool) -> None:
    """Copy projections between torch's and our module: both use torch's parameter names."""
    names = ["in_proj_weight"] if packed else [f"{r}_proj_weight" for r in "qkv"]
    for name in names + (["in_proj_bias"] if src.in_proj_bias is not None else []):
        getattr(dst, name).copy_(getattr(src, name))
    _copy_rest(dst, src)


def _copy_rest(dst, src) -> None:
    """The output projection, and which parameters are frozen, from ``src`` to ``dst``."""
    dst.out_proj.load_state_dict(src.out_proj.state_dict())
    frozen = {name: p.requires_grad for name, p in src.named_parameters()}
    for name, p in dst.named_parameters():          # a frozen layer stays frozen
        p.requires_grad_(frozen.get(name, p.requires_grad))


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
    p = m.out_proj.weight
    try:                                  # what our constructor refuses (kdim != vdim, ...)
        ours = mh.MultiHeadAttention(m.embed_dim, m.num_heads, bias=m.in_proj_bias is not None,
                                     dropout=m.dropout, kdim=m.kdim, vdim=m.vdim,
                                     device=p.device, dtype=p.dtype)
    except ValueError as e:
        advice = "" if "multihead.nn.MultiheadAttention" in str(e) else (
            "; use multihead.nn.MultiheadAttention, which takes every setting of torch's")
        raise ValueError(f"from_torch: {e}{advice}") from None
    _refuse_extras(m)
    _copy_weights(ours, m, packed=m._qkv_same_embed_dim)
    return ours.train(m.training)


@torch.no_grad()
def to_torch(ours: "mh.MultiHeadAttention") -> nn.MultiheadAttention:
    """An equivalent ``torch.nn.MultiheadAttention(batch_first=True)`` with copied weights.

    torch's module has one K/V head per query head: a GQA/MQA module's K/V projection
    rows are repeated for the query heads of their group (the same outputs, from a module
    with more parameters; converted back, it is an MHA module).

    Example:
        >>> import torch, multihead as mh
        >>> gqa = mh.MultiHeadAttention(16, 4, num_kv_heads=2)
        >>> t = gqa.to_torch()
        >>> x = torch.randn(2, 5, 16)
        >>> torch.allclose(gqa(x), t(x, x, x, need_weights=False)[0], atol=1e-6)
        True
    """
    if not isinstance(ours, mh.MultiHeadAttention):
        raise TypeError(f"to_torch takes a multihead.MultiHeadAttention, got "
                        f"{type(ours).__name__}")
    if ours.head_dim * ours.num_heads != ours.embed_dim:
        raise ValueError(f"to_torch: torch.nn.MultiheadAttention needs head_dim == embed_dim / "
                         f"num_heads; this module has {ours.num_heads} heads of head_dim "
                         f"{ours.head_dim} and embed_dim {ours.embed_dim}")
    if ours.rope is not None:
        raise ValueError("to_torch: torch.nn.MultiheadAttention has no rotary embedding")
    p = ours.out_proj.weight
    t = nn.MultiheadAttention(ours.embed_dim, ours.num_heads, dropout=ours.dropout,
                              bias=ours.in_proj_bias is not None, kdim=ours.kdim, vdim=ours.vdim,
                              batch_first=True, device=p.device, dtype=p.dtype)
    group, dh = ours.num_heads // ours.num_kv_heads, ours.head_dim
    w, b = [], []
    for role, repeat in (("q", 1), ("k", group), ("v", group)):
        proj = getattr(ours, f"{role}_proj")             # (heads*Dh, in), (heads*Dh,)
        w.append(proj.weight.unflatten(0, (-1, dh)).repeat_interleave(repeat, 0).flatten(0, 1))
        if proj.bias is not None:                        # w[-1]: (H*Dh, in), as torch's
            b.append(proj.bias.unflatten(0, (-1, dh)).repeat_interleave(repeat, 0).flatten())
    if t._qkv_same_embed_dim:
        t.in_proj_weight.copy_(torch.cat(w))                            # (3*E, E)
    else:
        for role, weight in zip("qkv", w):
            getattr(t, f"{role}_proj_weight").copy_(weight)
    if b:
        t.in_proj_bias.copy_(torch.cat(b))                              # (3*E,)
    _copy_rest(t, ours)
    return t.train(ours.training)


#: torch's constructor, whose arguments ours takes as they are
_SIGNATURE = inspect.signature(nn.MultiheadAttention.__init__)


def _project(query: Tensor, key: Tensor, value: Tensor, weights, same_qkv: bool,
             same_kv: bool) -> Tuple[Tensor, Tensor, Tensor]:
    """The input projections ``(q, k, v)`` ``(B, L|S, E)``, computed as torch's module does:
    where the weights are packed, one matmul for self-attention, one for the key and value
    where they are one tensor (torch's matmul shapes, and one launch, not three)."""
    w_q, w_k, w_v = weights.w_in                                        # (E, E|kdim|vdim)
    E = w_q.shape[0]
    b_in = None                                         # (torch adds a bias of another dtype)
    b_q = b_k = b_v = None
    if weights.b_in is not None:
        b_in = weights.b_in.to(w_q.dtype)
        b_q, b_k, b_v = b_in.split(E)
    packed = weights.packed
    if packed is not None and same_qkv:
        q, k, v = F.linear(query, packed, b_in).split(E, dim=-1)       # (B, L, 3E) -> 3x E
        return q, k, v
    q = F.linear(query, w_q, b_q)                                       # (B, L, E)
    if packed is not None and same_kv:
        k, v = F.linear(key, packed[E:], None if b_in is None else b_in[E:]).split(E, dim=-1)
        return q, k, v                                                  # (B, S, 2E) -> 2x E
    return q, F.linear(key, w_k, b_k), F.linear(value, w_v, b_v)


class MultiheadAttention(AllOrNothing, nn.MultiheadAttention):
    """Drop-in for ``torch.nn.MultiheadAttention``: same constructor, forward, parameters and
    ``state_dict``; computed by :func:`multihead.attention`.

    Masks follow torch's convention here (bool ``True`` = ignore, or additive float), and
    inputs are checked by torch's rules: what torch refuses is refused, with an exception that
    is both torch's type (``AssertionError`` or ``RuntimeError``) and ``ValueError`` (or
    ``TypeError`` for a mask's dtype), and a message that shows the shape it wanted. A
    ``dtype`` attention cannot compute in (float8, integer, complex), given to the
    constructor or reached by ``module.to(...)``, is refused before any weight is made or
    projected, as ``TypeError`` and ``RuntimeError``.
    ``is_causal=True`` with ``need_weights=False`` and no ``key_padding_mask`` applies the
    (upper-left) causal mask instead of ``attn_mask`` where torch's slower path would run,
    as torch does; where torch's fused inference kernel would run, and otherwise,
    ``attn_mask`` is used: a wrong hint gives torch's result on either path. The hint
    without ``attn_mask`` is refused on both paths (torch's fused kernel would ignore it),
    and so is the hint with NestedTensor inputs, which take no mask. NestedTensor inputs (``batch_first=True``, no masks) are padded, computed with a
    key padding mask, and returned nested, with the padded-query rows of the weights zero.

    ``torch.jit.script`` or ``torch.jit.trace`` of this module, or of a module holding it
    (a ``TransformerEncoderLayer`` whose ``self_attn`` it is), compiles torch's
    ``F.multi_head_attention_forward`` on the same parameters: the scripted or traced
    module runs torch's implementation, not multihead's (TorchScript cannot compile the
    dispatch, and a trace would freeze the plan of the one mask it saw).

    Deliberate differences: a query whose keys are all masked gets zeros, not NaN; a float
    mask holding NaN or +inf is refused; a float mask of another dtype than the query's is
    added at its own precision, never rounded into ``-inf`` (torch refuses most of these); a
    NaN or inf in a key or value that a mask hides does not reach the output; ``is_causal``
    without ``attn_mask`` is refused where torch's fused kernel would ignore it.

    Example:
        >>> import torch, multihead as mh
        >>> t = torch.nn.MultiheadAttention(16, 4)
        >>> ours = mh.nn.MultiheadAttention(16, 4)
        >>> _ = ours.load_state_dict(t.state_dict())
        >>> x = torch.randn(5, 2, 16)                       # (L, B, E): batch_first=False
        >>> torch.allclose(ours(x, x, x)[0], t(x, x, x)[0], atol=1e-6)
        True

    Shapes:
        L queries, S keys, N batch, E embed_dim; ``(L, N, E)``, or ``(N, L, E)`` with
        ``batch_first=True``, or ``(L, E)`` unbatched; masks ``(N, S)`` and ``(L, S)`` or
        ``(N * num_heads, L, S)``.
    """

    def __init__(self, embed_dim, num_heads, *args, **kwargs):
        if (isinstance(embed_dim, int) and isinstance(num_heads, int) and 0 < num_heads
                and 0 < embed_dim and embed_dim % num_heads):
            fits = _divisors(embed_dim)[:12]
            raise _AssertionArgError(f"embed_dim ({embed_dim}) must be divisible by num_heads "
                                     f"({num_heads}): try num_heads in {fits}")
        try:      # torch's signature: dtype is its 11th argument, or a keyword
            dtype = _SIGNATURE.bind(self, embed_dim, num_heads, *args, **kwargs).arguments.get("dtype")
        except TypeError:
            dtype = None                  # torch's own constructor says what is wrong
        _as_torch_raises(check_dtype, "dtype", dtype, optional=True)
        super().__init__(embed_dim, num_heads, *args, **kwargs)

    # torch's signature, for tools that read it (config instantiation, hyperparameter capture)
    __init__.__signature__ = _SIGNATURE

    def forward(self, query: Tensor, key: Tensor, value: Tensor,
                key_padding_mask: Optional[Tensor] = None, need_weights: bool = True,
                attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
                is_causal: bool = False) -> Tuple[Tensor, Optional[Tensor]]:
        if torch.jit.is_scripting() or torch.jit.is_tracing():
            return self._forward_scripted(query, key, value, key_padding_mask, need_weights,
                                          attn_mask, average_attn_weights, is_causal)
        return self._forward_ours(query, key, value, key_padding_mask, need_weights, attn_mask,
                                  average_attn_weights, is_causal)

    def _forward_scripted(self, query: Tensor, key: Tensor, value: Tensor,
                          key_padding_mask: Optional[Tensor], need_weights: bool,
                          attn_mask: Optional[Tensor], average_attn_weights: bool,
                          is_causal: bool) -> Tuple[Tensor, Optional[Tensor]]:
        """What TorchScript compiles or traces: torch's functional forward on this module's
        parameters."""
        batch_first = self.batch_first and query.dim() == 3
        if batch_first:                                   # (N, L, E) -> (L, N, E)
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        out, w = F.multi_head_attention_forward(
            query, key, value, self.embed_dim, self.num_heads, self.in_proj_weight,
            self.in_proj_bias, self.bias_k, self.bias_v, self.add_zero_attn, self.dropout,
            self.out_proj.weight, self.out_proj.bias, training=self.training,
            key_padding_mask=key_padding_mask, need_weights=need_weights, attn_mask=attn_mask,
            use_separate_proj_weight=not self._qkv_same_embed_dim,
            q_proj_weight=self.q_proj_weight, k_proj_weight=self.k_proj_weight,
            v_proj_weight=self.v_proj_weight, average_attn_weights=average_attn_weights,
            is_causal=is_causal)
        if batch_first:
            out = out.transpose(0, 1)                     # (N, L, E)
        return out, w

    @torch.jit.unused
    def _forward_ours(self, query: Tensor, key: Tensor, value: Tensor,
                      key_padding_mask: Optional[Tensor], need_weights: bool,
                      attn_mask: Optional[Tensor], average_attn_weights: bool,
                      is_causal: bool) -> Tuple[Tensor, Optional[Tensor]]:
        # torch reads the flags by their truth (np.True_, 1, a one-element tensor)
        need_weights, average_attn_weights, is_causal = (
            bool(f) for f in (need_weights, average_attn_weights, is_causal))
        if query.is_nested or key.is_nested or value.is_nested:
            return self._forward_nested(query, key, value, key_padding_mask, need_weights,
                                        attn_mask, average_attn_weights, is_causal)
        # self-attention (and key is value) are projected as torch does: one matmul of the
        # packed weights (and one of the key's and value's)
        same_kv = key is value
        same_qkv = same_kv and query is key
        # torch's other path applies the causal mask in place of attn_mask when it returns no
        # weights and has no padding mask; its fused kernel ignores the hint
        causal = is_causal and key_padding_mask is None and not need_weights
        # torch's test of its fused path, then one read of each parameter: a parametrization
        # runs as often as in torch's module (spectral_norm steps, a random one draws)
        fast = _takes_fast_path(self, query, key, value, key_padding_mask, attn_mask)
        weights = _read_weights(self)
        try:
            unbatched = not _check_inputs(self, query, key, value, key_padding_mask, attn_mask,
                                          causal, weights)
        except _AssertionArgError as e:           # torch's fused kernel raises RuntimeError
            if fast:
                raise _FusedPathArgError(str(e)) from None
            raise
        if causal and fast:
            causal = False
            _check_inputs(self, query, key, value, key_padding_mask, attn_mask, causal, weights)
        if is_causal and attn_mask is None:
            raise _RuntimeArgError(
                "Need attn_mask if specifying the is_causal hint (torch's rule): pass "
                "attn_mask=torch.nn.Transformer.generate_square_subsequent_mask(L); with "
                "multihead you can pass mask=multihead.masks.causal() instead")
        if unbatched:                                     # (L, E) -> (L, 1, E)
            query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)          # (1, S)
        if not self.batch_first or unbatched:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))  # (B, S, E)
        B, L, E = query.shape
        H, Dh = self.num_heads, self.head_dim
        q, k, v = _project(query, key, value, weights, same_qkv, same_kv)  # (B, L|S, E)
        q = q.reshape(B, L, H, Dh).transpose(1, 2)                          # (B, H, L, Dh)
        n_extra = 0                                                         # keys added at the end
        if weights.bias_k is not None:
            k = torch.cat([k, weights.bias_k.view(1, 1, E).expand(B, 1, E)], dim=1)
            v = torch.cat([v, weights.bias_v.view(1, 1, E).expand(B, 1, E)], dim=1)
            n_extra += 1
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(B, 1, E)], dim=1)
            v = torch.cat([v, v.new_zeros(B, 1, E)], dim=1)
            n_extra += 1
        S = k.shape[1]
        k = k.reshape(B, S, H, Dh).transpose(1, 2)                          # (B, H, S, Dh)
        v = v.reshape(B, S, H, Dh).transpose(1, 2)
        if causal:                                     # the hint: query i sees keys 0..i
            mask = mh.masks.causal(align="upper_left")
        else:
            # (each layer of a forward, each batch of one padding: the same mask object,
            # whose backend is chosen already)
            mask = by_content("torch's masks",
                              lambda a, p: self._mask(a, p, B, n_extra, q.dtype),
                              (attn_mask, key_padding_mask), (B, self.num_heads, n_extra, q.dtype))
        p = self.dropout if self.training else 0.0
        if not 0.0 <= p <= 1.0:          # (torch runs a negative one as 0 where it returns
            #                              weights, and fails where it does not)
            raise _RuntimeArgError(f"dropout probability has to be between 0 and 1, but got {p}: "
                                   f"build the module with dropout in [0, 1]")
        drop_all = p == 1.0
        res = mh.attention(q, k, v, mask=mask, dropout_p=0.0 if drop_all else p,
                           return_weights="mean" if need_weights and average_attn_weights
                           else need_weights)                   # (B, L, S) or (B, H, L, S)
        out, w = res if need_weights else (res, None)
        if drop_all:        # every weight dropped: torch's dropout multiplies by 0 there, so
            #                 the output is 0 and every parameter's gradient is 0, not None
            out, w = out * 0, (None if w is None else w * 0)
        # torch's memory layout: (L, B, E) contiguous, batch_first a transposed view of it
        # (a Dropout after this module draws its mask in memory order: same layout, same
        # mask), except where torch's fused inference kernel answers: (B, L, E) contiguous;
        # out_proj's weight and bias are read, not the module called, as torch does (its
        # hooks do not run; a parametrization's weight is the one used)
        if fast:
            out = out.transpose(1, 2).reshape(B, L, E)                      # (B, L, E)
        else:
            out = out.permute(2, 0, 1, 3).reshape(L, B, E)                  # (L, B, E)
        out = F.linear(out, weights.w_out, weights.b_out)
        if unbatched:
            out = out.squeeze(1)                                            # (L, E)
        elif self.batch_first and not fast:
            out = out.transpose(0, 1)                                       # (B, L, E)
        if w is not None and unbatched:
            w = w.squeeze(0)
        return out, w

    def _forward_nested(self, query, key, value, key_padding_mask, need_weights, attn_mask,
                        average_attn_weights, is_causal):
        """Nested ``(N, L*, E)`` inputs: pad, mask the padded keys, and return nested output."""
        _check_nested(self, query, key, value, key_padding_mask, attn_mask)
        if is_causal:
            raise _RuntimeArgError(
                "is_causal=True with NestedTensor inputs: torch's fused kernel ignores the hint "
                "(no causal mask), and nested inputs take no attn_mask. For causal attention, "
                "pad them (torch.nested.to_padded_tensor(x, 0.0)) and pass attn_mask="
                "torch.nn.Transformer.generate_square_subsequent_mask(L) with a "
                "key_padding_mask, or use multihead.MultiHeadAttention with "
                "mask=multihead.masks.causal() & multihead.masks.padding(lengths)")
        q_len, kv_len, v_len = _lengths(query), _lengths(key), _lengths(value)
        if v_len != kv_len:
            raise _AssertionArgError(f"NestedTensor inputs to MultiheadAttention: key and value "
                                     f"must hold sequences of the same lengths, got {kv_len} "
                                     f"and {v_len}")
        pad = lambda t: torch.nested.to_padded_tensor(t, 0.0)              # (N, L_max, E)
        q = pad(query)
        k = q if key is query else pad(key)
        v = k if value is key else pad(value)
        keys = torch.arange(k.shape[1], device=k.device)
        kpm = keys >= torch.tensor(kv_len, device=k.device)[:, None]       # (N, S_max) True = pad
        out, w = self._forward_ours(q, k, v, kpm, need_weights, None, average_attn_weights,
                                    is_causal)
        out = torch.nested.as_nested_tensor([o[:n] for o, n in zip(out, q_len)],
                                            layout=query.layout)
        if w is not None:                          # padded queries attend nothing, as in torch
            rows = torch.arange(q.shape[1], device=q.device)
            q_pad = rows >= torch.tensor(q_len, device=q.device)[:, None]  # (N, L_max)
            q_pad = q_pad[:, :, None] if average_attn_weights else q_pad[:, None, :, None]
            w = w.masked_fill(q_pad, 0.0)
        return out, w

    def _mask(self, attn_mask, key_padding_mask, B, n_extra, dtype):
        """Combine torch-style masks (already checked) into one multihead mask over (B, H, L, S);
        two float masks are summed as torch sums them, in ``dtype`` (the query's) at least."""
        if attn_mask is not None and attn_mask.dim() == 3:
            attn_mask = attn_mask.view(B, self.num_heads, *attn_mask.shape[1:])  # (B, H, L, S)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask[:, None, None, :]                # (B, 1, 1, S)
        pad = lambda m: F.pad(m, (0, n_extra), value=False if m.dtype == torch.bool else 0.0) \
            if n_extra and m is not None else m
        attn_mask, key_padding_mask = pad(attn_mask), pad(key_padding_mask)
        if all(m is not None and m.is_floating_point() for m in (attn_mask, key_padding_mask)):
            # torch adds two float masks as they are: a sum past the dtype's range is -inf,
            # which hides its key (where `&` of two biases would saturate at finfo.min); in
            # the query's dtype at least (torch takes no other)
            wide = torch.promote_types(torch.promote_types(attn_mask.dtype,
                                                           key_padding_mask.dtype), dtype)
            both = attn_mask.to(wide) + key_padding_mask.to(wide)          # (B, H|1, L, S)
            try:                                       # (one scan where all is well)
                return _torch_mask(both, "attn_mask + key_padding_mask")
            except ValueError:       # name the mask holding NaN or +inf, else the overflow
                _torch_mask(attn_mask, "attn_mask")
                _torch_mask(key_padding_mask, "key_padding_mask")
                raise ValueError("attn_mask + key_padding_mask (their sum overflows to +inf): "
                                 "only finite values and -inf (masked) are allowed (torch "
                                 "would return NaN rows)") from None
        masks = [m for m in (_torch_mask(attn_mask, "attn_mask"),
                             _torch_mask(key_padding_mask, "key_padding_mask"))
                 if m is not None]
        if not masks:
            return None
        return masks[0] if len(masks) == 1 else masks[0] & masks[1]

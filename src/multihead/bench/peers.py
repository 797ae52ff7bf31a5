"""Peers we did not write, as a user would call them (written out where they are not importable).

Notation used for tensor shapes: B batch, H heads, Hkv K/V heads, S length, D head dim, E width.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SeedTutorialMHA(nn.Module):
    """Seed 000's tutorial class, written out (w_q/w_k/w_v/w_o, ``mask == 0 -> -1e9``)."""

    def __init__(self, d_model, num_heads):
        super().__init__()
        self.num_heads, self.d_k = num_heads, d_model // num_heads
        self.w_q, self.w_k = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)
        self.w_v, self.w_o = nn.Linear(d_model, d_model), nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        b, s, d = x.size()
        q = self.w_q(x).view(b, s, self.num_heads, self.d_k).transpose(1, 2)
        k = self.w_k(x).view(b, s, self.num_heads, self.d_k).transpose(1, 2)
        v = self.w_v(x).view(b, s, self.num_heads, self.d_k).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(-2, -1)) / (self.d_k ** 0.5)
        if mask is not None:
            scores = scores.masked_fill(mask == 0, -1e9)
        w = F.softmax(scores, dim=-1)
        out = torch.matmul(w, v).transpose(1, 2).contiguous().view(b, s, d)
        return self.w_o(out), w


def tutorial_attention(q, k, v, allowed=None):
    """The seed tutorial's attention core on (B, H, S, D) tensors: scores, -1e9 mask, softmax.

    Example:
        >>> import multihead as mh
        >>> q = torch.randn(1, 2, 5, 8)
        >>> torch.allclose(tutorial_attention(q, q, q), mh.attention(q, q, q), atol=1e-6)
        True
    """
    scores = torch.matmul(q, k.transpose(-2, -1)) / (q.shape[-1] ** 0.5)     # (B, H, S, S)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, -1e9)
    return torch.matmul(F.softmax(scores, dim=-1), v)


def repeat_kv(x: torch.Tensor, g: int) -> torch.Tensor:
    """Hugging Face's ``repeat_kv``: (B, Hkv, S, D) -> (B, Hkv*g, S, D), a copy.

    Example:
        >>> repeat_kv(torch.arange(2.).view(1, 2, 1, 1), 2).flatten().tolist()
        [0.0, 0.0, 1.0, 1.0]
    """
    b, h, s, d = x.shape
    return x[:, :, None].expand(b, h, g, s, d).reshape(b, h * g, s, d)


def hf_gqa_eager(q, k, v):
    """Hugging Face's eager GQA attention: repeat K/V, matmul, softmax, matmul."""
    g = q.shape[1] // k.shape[1]
    k, v = repeat_kv(k, g), repeat_kv(v, g)
    w = torch.softmax((q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5, dim=-1)
    return w @ v


def hf_embed(hf, tokenizer, texts, batch: int = 32) -> torch.Tensor:
    """Sentence embeddings the way Hugging Face users write them: padded batches of 32."""
    out = []
    dev = next(hf.parameters()).device
    for i in range(0, len(texts), batch):
        enc = tokenizer(texts[i:i + batch], padding="longest", truncation=True, max_length=256,
                        return_tensors="pt").to(dev)
        h = hf(**enc).last_hidden_state                                     # (b, S, E)
        m = enc["attention_mask"].unsqueeze(-1).to(h.dtype)                 # (b, S, 1)
        out.append(F.normalize((h * m).sum(1) / m.sum(1), dim=-1))
    return torch.cat(out)


class HFLlamaDecoder:
    """Hugging Face's ``LlamaAttention`` with its rotary embedding and a ``DynamicCache``,
    holding the weights of one of our :class:`~multihead.MultiHeadAttention` (without
    biases, with a :class:`~multihead.RotaryEmbedding`): one layer of a Llama decoding loop,
    fed the same tokens as ours (needs ``transformers``).

    Args:
        ours: the module whose weights (and sizes, RoPE base) it takes.
        implementation: Hugging Face's attention, ``"sdpa"`` (its default) or ``"eager"``.

    Example:
        >>> import torch, multihead as mh
        >>> m = mh.MultiHeadAttention(32, 4, num_kv_heads=2, bias=False,
        ...                           rope=mh.RotaryEmbedding(8)).eval()
        >>> hf, cache = HFLlamaDecoder(m), m.make_cache(1, 16)
        >>> x = torch.randn(1, 5, 32)
        >>> with torch.no_grad():
        ...     same = torch.allclose(hf(x), m(x, cache=cache, mask=mh.masks.causal()), atol=1e-5)
        >>> same
        True
    """

    def __init__(self, ours, implementation: str = "sdpa"):
        from transformers import DynamicCache, LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
        if ours.rope is None or ours.in_proj_bias is not None or not ours.packed:
            raise ValueError("HFLlamaDecoder: the module must have rope, bias=False and "
                             "self-attention projections (a Llama layer's)")
        if ours.rope.rotary_dim != ours.head_dim or ours.rope.attention_factor != 1:
            raise ValueError("HFLlamaDecoder: the module's rope must rotate every channel with "
                             "attention_factor 1 (a plain Llama layer's)")
        E, H, Hkv, Dh = ours.embed_dim, ours.num_heads, ours.num_kv_heads, ours.head_dim
        w = ours.in_proj_weight.detach()
        config = LlamaConfig(hidden_size=E, num_attention_heads=H, num_key_value_heads=Hkv,
                             head_dim=Dh, rope_theta=ours.rope.base, attention_bias=False,
                             max_position_embeddings=1 << 20)
        config._attn_implementation = implementation
        self.attn = LlamaAttention(config, layer_idx=0).to(w.device, w.dtype).eval()
        with torch.no_grad():                          # rows of ours: [W_Q; W_K; W_V]
            for proj, rows in zip((self.attn.q_proj, self.attn.k_proj, self.attn.v_proj),
                                  w.split([H * Dh, Hkv * Dh, Hkv * Dh])):
                proj.weight.copy_(rows)
            self.attn.o_proj.weight.copy_(ours.out_proj.weight)
        self._rotary = LlamaRotaryEmbedding(config).to(w.device)
        self.cache, self.seen = DynamicCache(config=config), 0

    def rotary(self, x: torch.Tensor, start: int):
        """Hugging Face's ``(cos, sin)`` for the ``S`` tokens of ``x`` from position
        ``start`` (a model computes them once per forward, for all its layers)."""
        pos = torch.arange(start, start + x.shape[1], device=x.device)[None]     # (1, S)
        return self._rotary(x, pos)

    def __call__(self, x: torch.Tensor, position_embeddings=None) -> torch.Tensor:
        """The layer's output for the next ``S`` tokens ``x`` (B, S, E), all real;
        ``position_embeddings``: :meth:`rotary` of them, computed here if None."""
        S = x.shape[1]
        if position_embeddings is None:
            position_embeddings = self.rotary(x, self.seen)
        mask = None                  # one query sees every key; several see the keys up
        if S > 1:                    # to their own (an additive mask, numerically what a
            keys = self.seen + S     # Llama model's mask gives its layers)
            hidden = torch.ones(S, keys, dtype=torch.bool, device=x.device).triu(self.seen + 1)
            mask = torch.zeros(S, keys, dtype=x.dtype, device=x.device).masked_fill(
                hidden, torch.finfo(x.dtype).min)[None, None]                     # (1, 1, S, keys)
        out, _ = self.attn(x, position_embeddings, attention_mask=mask,
                           past_key_values=self.cache)
        self.seen += S
        return out

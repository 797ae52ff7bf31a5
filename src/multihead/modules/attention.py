"""``MultiHeadAttention``: projections, heads, RoPE and output projection around ``mh.attention``.

The module projects, splits heads, rotates, and calls :func:`multihead.attention`; it
holds no backend logic. Self-attention runs one fused QKV GEMM; cross-attention one Q GEMM
and one fused KV GEMM (when ``kdim == vdim == embed_dim``, the packed layout).

Notation used for tensor shapes:
    B batch, Sq query length, Sk key length, E embed_dim, H heads, Hkv K/V heads,
    Dh head_dim, Nq = H * Dh, Nkv = Hkv * Dh.
"""

from __future__ import annotations

import functools
import numbers
import re
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.linear import NonDynamicallyQuantizableLinear
from torch.nn.utils import parametrize

from .. import masks
from .._args import fraction, positive_int
from .._device import usable_device
from .._dtypes import AUTOCAST_CASTS, autocast_dtype, check_dtype, check_strided, check_weights
from .._tracing import concrete, eager_under_compile, refuse_jit_trace, shape_text, tracing
from ..masks.positioned import distances_in_tokens
from ..functional import attention
from ..functional.dispatch import check_backend
from ..functional._call import as_mask
from .kv_cache import KVCache
from .loading import AllOrNothing
from .paged_cache import PagedBatch, PagedView
from .rope import RotaryEmbedding


#: the state-dict keys of the projections' biases
_BIASES = ("in_proj_bias", "out_proj.bias")


class OutProjection(NonDynamicallyQuantizableLinear):
    """The output projection: ``nn.Linear``'s init, with the bias zero (as the module's
    own init leaves it), also where each submodule's ``reset_parameters`` is called in
    turn (FSDP's init of a model built on the meta device).

    Example:
        >>> proj = OutProjection(8, 4)                  # (in_features, out_features)
        >>> proj.reset_parameters()
        >>> proj.weight.shape, proj.bias.abs().max().item()
        (torch.Size([4, 8]), 0.0)
    """

    def reset_parameters(self) -> None:
        super().reset_parameters()               # (draws the bias too, as construction does)
        if self.bias is not None:
            nn.init.zeros_(self.bias)


def _check_cached_mask(mask, cross: bool, n: int) -> None:
    """Refuse a mask that would place a cached call's ``n`` queries wrongly: one aligned
    upper-left (with a cache they are the sequence's last ``n``), and, for cross-attention,
    any mask of query positions (a cache serves queries in steps, whose positions within
    the whole query sequence a mask of one call cannot know). Others pass (a mask of
    another type is refused by attention)."""
    if not isinstance(mask, masks.Mask):
        return
    for leaf in mask.leaves():
        if not isinstance(leaf, (masks.Window, masks.ALiBi)):
            continue
        if cross:
            raise ValueError(
                f"mask: {leaf.describe()} places queries by their index within the call, but a "
                f"cross-attention cache serves queries in steps, at positions a mask of one "
                f"call cannot know: use a mask without query positions (mh.masks.padding of "
                f"the keys, document with kv_ids, dense, bias), or attend without cache= "
                f"over all the queries")
        if leaf.align == "upper_left":
            raise ValueError(
                f"mask: {leaf.describe()} aligns the queries to the first keys, but with a "
                f"cache the {n} new queries are the sequence's last: use align='lower_right' "
                f"(the default, as in mh.masks.causal()), which is the same in a full forward")


def _refused_by_torch_func(e: BaseException) -> bool:
    """Whether ``e`` is torch.func refusing an in-place change (what a cache write is)
    inside one of its transforms; other errors (running out of memory, say) go on as
    they are."""
    return (type(e) is RuntimeError and torch._C._are_functorch_transforms_active()
            and re.search(r"in-?place|out-of-place operators", str(e)) is not None)


class Projection(NamedTuple):
    """A projection's weight ``(out, in)`` and bias ``(out,)`` (views into the module's parameters)."""

    weight: torch.Tensor
    bias: torch.Tensor | None


def _reads_weights_once(method):
    """Run ``method`` with each parametrized weight evaluated once (torch's parametrization
    cache): a forward reads ``out_proj.weight`` for its checks and its product, and a packed
    cross-attention ``in_proj_weight`` for q and for k, v, where a parametrization with
    effects would run each time (``spectral_norm`` steps its power iteration in training, a
    random one draws). A module without parametrizations is called as it is."""
    @functools.wraps(method)
    def run(self, *args, **kwargs):
        if not (parametrize.is_parametrized(self) or parametrize.is_parametrized(self.out_proj)):
            return method(self, *args, **kwargs)
        with parametrize.cached():
            return method(self, *args, **kwargs)
    return run


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


#: why a cached forward runs eagerly under ``torch.compile``: its writes, their undo on a
#: failed call, and its counts live in Python; traced, a step's write could be lost from the
#: journal (or fail inside torch's functionalization in grad mode), and the count each step
#: changes would recompile the graph every step anyway
_CACHED_NOT_COMPILED = ("a forward with cache= writes the cache and keeps its counts in "
                        "Python, so it runs eagerly (a graph break); compile the model's "
                        "other layers, or capture the decoding step in a CUDA graph")


class MultiHeadAttention(AllOrNothing):
    """Multi-head attention (Vaswani et al. 2017) with GQA/MQA, RoPE and cross-attention.

    Args:
        embed_dim: E, the model width of inputs and outputs.
        num_heads: H, query heads.
        num_kv_heads: Hkv, key/value heads (default H; 1 is MQA; ``H % Hkv == 0``).
        head_dim: Dh (default ``E // H``, the seeds' d_k = d_model / h).
        bias: biases on the four projections.
        dropout: dropout on the attention weights in training mode.
        kdim, vdim: the width of the context for cross-attention; equal, since keys and
            values come from one context (default E).
        rope: a :class:`RotaryEmbedding` applied to queries and keys.
        backend: passed to :func:`multihead.attention` (``"auto"`` by default).

    Example:
        >>> import torch, multihead as mh
        >>> attn = mh.MultiHeadAttention(64, 8, num_kv_heads=2)
        >>> x = torch.randn(2, 10, 64)
        >>> y, w = attn(x, mask=mh.masks.causal(), return_weights=True)
        >>> y.shape, w.shape
        (torch.Size([2, 10, 64]), torch.Size([2, 8, 10, 10]))

    Shapes:
        x (B, Sq, E); context (B, Sk, kdim); output (B, Sq, E); weights (B, H, Sq, Sk)
        or (B, Sq, Sk) averaged.
    """

    def __init__(self, embed_dim: int, num_heads: int, *, num_kv_heads: int | None = None,
                 head_dim: int | None = None, bias: bool = True, dropout: float = 0.0,
                 kdim: int | None = None, vdim: int | None = None,
                 rope: RotaryEmbedding | None = None, backend: str = "auto",
                 device=None, dtype=None):
        super().__init__()
        E = positive_int("embed_dim", embed_dim)
        H = positive_int("num_heads", num_heads)
        Hkv = H if num_kv_heads is None else positive_int("num_kv_heads", num_kv_heads)
        if head_dim is None:
            if E % H:
                raise ValueError(f"embed_dim ({E}) must be divisible by num_heads ({H}): try "
                                 f"num_heads in {_divisors(E)[:12]}, or pass head_dim explicitly")
            head_dim = E // H
        Dh = positive_int("head_dim", head_dim)
        if H % Hkv:
            raise ValueError(f"num_heads ({H}) must be a multiple of num_kv_heads ({Hkv}): try "
                             f"num_kv_heads in {_divisors(H)}")
        dropout = fraction("dropout", dropout)
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be True or False (whether the projections have "
                            f"biases), got {bias!r:.60}")
        if rope is not None:
            if not isinstance(rope, RotaryEmbedding):
                raise TypeError(f"rope must be a multihead.RotaryEmbedding, got {type(rope).__name__}")
            if rope.head_dim != Dh:
                partial = (f" (or, to rotate only the first {rope.rotary_dim} channels as "
                           f"GPT-NeoX's rotary_pct does, RotaryEmbedding({Dh}, rotary_dim="
                           f"{rope.rotary_dim}))" if rope.rotary_dim < Dh else "")
                raise ValueError(f"rope was built for head_dim {rope.head_dim} but the module's "
                                 f"head_dim is {Dh}: use RotaryEmbedding({Dh}){partial}")
        self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim = E, H, Hkv, Dh
        self.kdim = E if kdim is None else positive_int("kdim", kdim)
        self.vdim = E if vdim is None else positive_int("vdim", vdim)
        if self.kdim != self.vdim:
            raise ValueError(f"kdim ({self.kdim}) != vdim ({self.vdim}): this module takes keys "
                             f"and values from one context, of width kdim; give kdim == vdim, or "
                             f"use multihead.nn.MultiheadAttention for separate key and value "
                             f"inputs of different widths")
        check_backend(backend)            # (a backend registered later: register it first)
        self.dropout, self.backend, self.rope = float(dropout), backend, rope
        nq, nkv = H * Dh, Hkv * Dh
        fk = dict(device=None if device is None else usable_device("device", device),
                  dtype=check_dtype("dtype", dtype, optional=True))
        self.packed = self.kdim == self.vdim == E
        if self.packed:   # rows: [W_Q; W_K; W_V], one GEMM for self-attention
            self.in_proj_weight = nn.Parameter(torch.empty(nq + 2 * nkv, E, **fk))
            self.in_proj_bias = nn.Parameter(torch.empty(nq + 2 * nkv, **fk)) if bias else None
        else:
            self.q_proj_weight = nn.Parameter(torch.empty(nq, E, **fk))
            self.k_proj_weight = nn.Parameter(torch.empty(nkv, self.kdim, **fk))
            self.v_proj_weight = nn.Parameter(torch.empty(nkv, self.vdim, **fk))
            self.in_proj_bias = nn.Parameter(torch.empty(nq + 2 * nkv, **fk)) if bias else None
        # as torch's MHA: forward reads out_proj.weight, which dynamic quantization (it
        # swaps each nn.Linear for a packed one) would take away
        self.out_proj = OutProjection(nq, E, bias=bias, **fk)
        self._init_in_proj()

    def reset_parameters(self) -> None:
        """torch.nn.MultiheadAttention's init, of every parameter: ``out_proj.weight`` as
        ``nn.Linear``'s, Xavier-uniform input projections and zero biases. It draws the
        random numbers in the order construction does, so after ``torch.manual_seed(s)``
        both give the same weights (a module built on the meta device and materialized with
        ``to_empty`` gets its values here).

        Example:
            >>> import torch, multihead as mh
            >>> _ = torch.manual_seed(0); built = mh.MultiHeadAttention(16, 4)
            >>> other = mh.MultiHeadAttention(16, 4)
            >>> _ = torch.manual_seed(0); other.reset_parameters()
            >>> all(torch.equal(a, b) for a, b in zip(built.parameters(), other.parameters()))
            True
        """
        self.out_proj.reset_parameters()
        self._init_in_proj()

    def _init_in_proj(self) -> None:
        """Xavier-uniform input projections and zero biases (construction's last step)."""
        names = ["in_proj_weight"] if self.packed else [f"{r}_proj_weight" for r in "qkv"]
        for name in names:
            nn.init.xavier_uniform_(getattr(self, name))
        if self.in_proj_bias is not None:
            nn.init.zeros_(self.in_proj_bias)
            nn.init.zeros_(self.out_proj.bias)

    # -- per-role views -------------------------------------------------------------------
    def _rows(self, role: str) -> slice:
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        return {"q": slice(0, nq), "k": slice(nq, nq + nkv), "v": slice(nq + nkv, nq + 2 * nkv),
                "kv": slice(nq, nq + 2 * nkv)}[role]

    def _proj(self, role: str) -> Projection:
        rows = self._rows(role)
        b = self.in_proj_bias[rows] if self.in_proj_bias is not None else None
        w = self.in_proj_weight[rows] if self.packed else getattr(self, f"{role}_proj_weight")
        return Projection(w, b)

    @property
    def q_proj(self) -> Projection:
        """W_Q ``(H*Dh, E)`` and its bias, as views."""
        return self._proj("q")

    @property
    def k_proj(self) -> Projection:
        """W_K ``(Hkv*Dh, kdim)`` and its bias, as views."""
        return self._proj("k")

    @property
    def v_proj(self) -> Projection:
        """W_V ``(Hkv*Dh, vdim)`` and its bias, as views."""
        return self._proj("v")

    @property
    def num_parameters(self) -> int:
        """Parameter count; ``4*E**2 + 4*E`` for the default MHA (the seeds' count)."""
        return sum(p.numel() for p in self.parameters())

    def _layout_hint(self, keys: list[str]) -> str | None:
        """The fix for a checkpoint (its ``keys``) of another layout: Hugging Face's
        (separate q/k/v projections), torch's with ``add_bias_kv``, or one whose
        projections have biases where this module's have none (or the other way)."""
        names = {k.split(".")[0] for k in keys}
        if {"bias_k", "bias_v"} <= names:
            return ("The checkpoint is torch.nn.MultiheadAttention's with add_bias_kv=True, "
                    "which this module has no counterpart for: load it into "
                    "multihead.nn.MultiheadAttention, the drop-in, built as that module was")
        rest = lambda ks: {k for k in ks if k not in _BIASES and not k.startswith("rope.")}  # noqa: E731
        theirs = any(k in _BIASES for k in keys)
        if theirs != (self.in_proj_bias is not None) and rest(keys) == rest(self.state_dict()):
            return (f"The checkpoint's projections have {'' if theirs else 'no '}biases: build "
                    f"the module with bias={theirs}")
        if not {"q_proj", "k_proj", "v_proj"} <= names:
            return None
        weights = ("q_proj_weight = q_proj.weight (k_ and v_ likewise)" if self.kdim !=
                   self.embed_dim else "in_proj_weight = torch.cat([q_proj.weight, "
                   "k_proj.weight, v_proj.weight])")
        return (f"The checkpoint is in Hugging Face's layout (separate q_proj, k_proj, v_proj "
                f"and o_proj): convert it first, {weights}"
                + (", in_proj_bias = the same of their biases (zeros where one has none)"
                   if self.in_proj_bias is not None else "")
                + ", out_proj.* = o_proj.*")

    def _sizes(self) -> str:
        """The sizes that shape the parameters, as ``extra_repr`` and errors show them."""
        kind = "MHA" if self.num_kv_heads == self.num_heads else (
            "MQA" if self.num_kv_heads == 1 else "GQA")
        s = (f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, "
             f"num_kv_heads={self.num_kv_heads} ({kind}), head_dim={self.head_dim}")
        return s if self.packed else s + f", kdim={self.kdim}, vdim={self.vdim}"

    def extra_repr(self) -> str:
        return f"{self._sizes()}, dropout={self.dropout}, parameters={self.num_parameters:,}"

    # -- forward --------------------------------------------------------------------------
    def _check_input(self, name: str, t, width: int) -> None:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (B, S, {width}), got {type(t).__name__}")
        check_strided(name, t)
        p = self.out_proj.weight
        check_weights(p.dtype)                   # (the weights' dtype first: x's fix is theirs)
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point (the module's dtype "
                            f"{p.dtype}), got {t.dtype}: convert it with {name}.to({p.dtype})")
        if t.dim() != 3 or t.shape[-1] != width:
            raise ValueError(f"{name} must be (B, S, {width}), got shape {shape_text(t)}"
                             + (" (add a batch dim with x.unsqueeze(0))" if t.dim() == 2 else ""))
        if (t.dtype != p.dtype and not (t.dtype in AUTOCAST_CASTS and self._autocast_dtype())
                or t.device != p.device):      # (autocast casts x itself, as torch's modules)
            raise TypeError(f"{name} is {t.dtype} on {t.device} but the module is {p.dtype} on "
                            f"{p.device}: use module.to({name}.device, {name}.dtype) or convert {name}")

    def _check_parameters(self) -> None:
        """Refuse projections converted apart (``module.out_proj.half()``, or a tensor
        assigned to ``in_proj_weight.data``), which torch's matmul would refuse from deep
        inside: 2 us, of a forward's 150 at the smallest sizes on a CPU."""
        p = self.out_proj.weight
        for t in (*self._parameters.values(), *self.out_proj._parameters.values()):
            if t is not None and (t.dtype != p.dtype or t.device != p.device):
                held = ", ".join(f"{name} {t.dtype} on {t.device}" for name, t in
                                 self.named_parameters())
                raise TypeError(f"the module's parameters disagree ({held}): convert the "
                                f"whole module, e.g. module.to({p.device.type!r}, {p.dtype})")

    def _autocast_dtype(self) -> torch.dtype | None:
        """The dtype ``torch.autocast`` projects this module's inputs in (its q, k and v),
        None where autocast is off on the weights' device or leaves them (float64)."""
        p = self.out_proj.weight
        return None if p.dtype not in AUTOCAST_CASTS else autocast_dtype(p.device)

    def _kv_dtype(self) -> torch.dtype:
        """The dtype of the K/V this module computes now (the one its cache must hold)."""
        return self._autocast_dtype() or self.out_proj.weight.dtype

    def _heads(self, x: torch.Tensor, heads: int) -> torch.Tensor:
        B, S, _ = x.shape
        return x.view(B, S, heads, self.head_dim).transpose(1, 2)      # (B, heads, S, Dh)

    def _qkv(self, x, context, positions):
        """Projected, head-split (and rotated) q (B, H, Sq, Dh), k and v (B, Hkv, Sk, Dh)."""
        q, k, v = self._project(x, context)
        if self.rope is not None:
            q, k = self._rotate(q, k, positions, context is None)
        elif positions is not None:
            raise ValueError("positions are only used with rope=RotaryEmbedding(...); this module has none")
        return q, k, v

    def _project(self, x, context):
        """Projected, head-split q (B, H, Sq, Dh), k and v (B, Hkv, Sk, Dh); ``context=False``
        projects only q (cross-attention whose K/V are cached) and returns None for k, v."""
        self._check_input("x", x, self.embed_dim)
        self._check_parameters()
        nq, nkv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if context is None:
            if self.packed:
                qkv = F.linear(x, self.in_proj_weight, self.in_proj_bias)  # (B, Sq, Nq + 2*Nkv)
                q, k, v = qkv.split([nq, nkv, nkv], dim=-1)
            else:
                raise ValueError(f"self-attention needs kdim == vdim == embed_dim; this module has "
                                 f"kdim={self.kdim}, vdim={self.vdim}: pass context")
        elif context is False:
            return self._heads(F.linear(x, *self.q_proj), self.num_heads), None, None
        else:
            self._check_input("context", context, self.kdim)
            if context.shape[0] != x.shape[0]:
                raise ValueError(f"context batch ({context.shape[0]}) != x batch ({x.shape[0]})")
            q = F.linear(x, *self.q_proj)                                  # (B, Sq, Nq)
            if self.packed:
                kv = F.linear(context, *self._proj("kv"))                  # (B, Sk, 2*Nkv)
                k, v = kv.split([nkv, nkv], dim=-1)
            else:
                k, v = F.linear(context, *self.k_proj), F.linear(context, *self.v_proj)
        return self._heads(q, self.num_heads), self._heads(k, self.num_kv_heads), \
            self._heads(v, self.num_kv_heads)

    def _rotate(self, q, k, positions, self_attn):
        B, Sq = q.shape[0], q.shape[2]
        if positions is None:
            positions = 0                          # 0..Sq-1: rows of the rope's table
        elif isinstance(positions, bool):
            raise TypeError("positions must be an int (the first of Sq consecutive positions) "
                            "or an integer tensor (Sq,) or (B, Sq), got a bool")
        elif not isinstance(positions, numbers.Integral):
            try:
                positions = torch.as_tensor(positions, device="cpu") if not isinstance(
                    positions, torch.Tensor) else positions    # host ints: no sync
            except (TypeError, ValueError, RuntimeError):
                raise TypeError(f"positions must be an int (the first of Sq consecutive "
                                f"positions) or integer positions (Sq,) or (B, Sq) (a tensor, "
                                f"list or array), got {positions!r:.60}") from None
            if positions.dim() == 0:
                raise TypeError(f"positions must be an int (the first of Sq consecutive "
                                f"positions) or (Sq,) or (B, Sq) = ({Sq},) or ({B}, {Sq}) "
                                f"positions, got the scalar {positions.tolist()!r:.40}: pass "
                                f"an int, or one position per query")
            if positions.shape[-1:] != (Sq,) or positions.dim() not in (1, 2) or (
                    positions.dim() == 2 and positions.shape[0] != 1 and positions.shape[0] != B):
                B, Sq = concrete(B), concrete(Sq)
                raise ValueError(f"positions must be an int (the first of Sq consecutive "
                                 f"positions) or (Sq,) or (B, Sq) = ({Sq},) or ({B}, {Sq}), "
                                 f"got shape {shape_text(positions)}")
        if self_attn:
            return self.rope.rotate(q, k, positions=positions)
        return self.rope(q, positions), self.rope(k, 0)

    def _merge(self, heads: torch.Tensor) -> torch.Tensor:
        B, H, S, Dh = heads.shape
        return heads.transpose(1, 2).reshape(B, S, H * Dh)            # (B, Sq, H*Dh)

    @_reads_weights_once
    def forward(self, x: torch.Tensor, context: torch.Tensor | None = None, *, mask=None,
                return_weights: bool = False, average_weights: bool = False,
                positions: torch.Tensor | int | None = None, cache=None,
                valid: torch.Tensor | None = None):
        """Attend from ``x`` to itself (or to ``context``); see the class docstring for shapes.

        With ``cache`` (a :class:`KVCache` or ``PagedKVCache.batch(...)``), ``x`` holds only the
        new tokens: their keys/values are appended and attention covers everything cached.
        Pass the same ``mask`` as for a full forward (``mh.masks.causal()``); ``valid``
        ``(B, Sq)`` marks which new tokens are real when prompts are padded (left or right);
        RoPE positions continue from each sequence's count of real tokens (without a
        cache, ``positions`` gives them: ``(Sq,)``, ``(B, Sq)``, or an int, the first of
        ``Sq`` consecutive ones; default ``0``). For
        cross-attention, give ``context`` on the first call only: its keys/values are cached,
        and queries fed in steps are rotated at the positions they have in the full query
        sequence (the cache counts the queries it has served).

        Returns ``out`` (B, Sq, E), or ``(out, weights)`` when ``return_weights``; weights are
        per head ``(B, H, Sq, Sk)``, or their head mean ``(B, Sq, Sk)`` with ``average_weights``.
        """
        refuse_jit_trace("MultiHeadAttention")
        if average_weights and not return_weights:
            raise ValueError("average_weights=True averages the weights that return_weights=True "
                             "returns: pass both (or neither)")
        p = self.dropout if self.training else 0.0
        if cache is None:
            if valid is not None:
                raise ValueError("valid marks padded new tokens for a cache: pass cache=, or put "
                                 "padding in the mask (mh.masks.padding) for a full forward")
            q, k, v = self._qkv(x, context, positions)
            res = attention(q, k, v, mask=mask, dropout_p=p, backend=self.backend,
                            return_weights=_weights_arg(return_weights, average_weights))
        else:
            return self._forward_cached(x, context, mask, return_weights, average_weights,
                                        positions, cache, valid, p)
        return self._output(res, return_weights)

    @eager_under_compile(_CACHED_NOT_COMPILED)
    def _forward_cached(self, x, context, mask, return_weights, average_weights, positions,
                        cache, valid, p):
        """:meth:`forward` with a cache: written, and put back if the call fails. Always
        eager: under ``torch.compile`` it is a graph break (see :data:`_CACHED_NOT_COMPILED`)."""
        self._check_cache(cache)
        cache.begin()                # what this forward writes, rollback() undoes
        try:
            q, k, v, mask = self._cached(x, context, cache, mask, valid, positions,
                                         in_place=not return_weights and p == 0.0)
            if isinstance(k, PagedView):   # a decoding step reading pages in place
                res = _paged_decode(q, k, mask)
            else:
                res = attention(q, k, v, mask=mask, dropout_p=p, backend=self.backend,
                                return_weights=_weights_arg(return_weights, average_weights))
            y = self._output(res, return_weights)
        except BaseException as e:   # a failed call (to its last op) leaves the cache
            cache.rollback()         # as it found it
            if _refused_by_torch_func(e):
                raise RuntimeError(
                    "a cached forward writes its new keys and values into the cache in "
                    "place, which torch.func's transforms (grad, vmap, jacrev, ...) refuse; "
                    "the cache is unchanged. Run the cached step outside the transform, or "
                    f"call without cache= inside it ({e})") from e
            raise
        cache.commit()
        return y

    def _output(self, res, return_weights: bool):
        """The output projection of attention's result ``res`` (and the weights asked)."""
        out, w = res if return_weights else (res, None)
        y = self.out_proj(self._merge(out))                            # (B, Sq, E)
        return (y, w) if return_weights else y

    @_reads_weights_once
    def make_cache(self, batch_size: int, max_len: int) -> KVCache:
        """A :class:`KVCache` with this module's K/V heads, head_dim, dtype and device;
        made under ``torch.autocast``, in autocast's dtype (the K/V the module computes
        there), for calls made under it.

        Example:
            >>> import torch, multihead as mh
            >>> attn = mh.MultiHeadAttention(64, 8, num_kv_heads=2).eval()
            >>> with torch.autocast("cpu", dtype=torch.bfloat16):
            ...     cache = attn.make_cache(2, 16)
            ...     y = attn(torch.randn(2, 5, 64), cache=cache, mask=mh.masks.causal())
            >>> cache.dtype, y.dtype
            (torch.bfloat16, torch.bfloat16)
        """
        return KVCache(batch_size, max_len, self.num_kv_heads, self.head_dim,
                       dtype=self._kv_dtype(), device=self.out_proj.weight.device)

    @_reads_weights_once
    def cache_bytes_per_token(self, dtype: torch.dtype | None = None) -> int:
        """K/V cache bytes one token costs in this layer: ``2 * Hkv * Dh * itemsize``
        (the seeds' MQA/GQA memory argument: H/Hkv times less than MHA)."""
        size = torch.empty((), dtype=dtype or self._kv_dtype()).element_size()
        return 2 * self.num_kv_heads * self.head_dim * size

    def _check_cache(self, cache) -> None:
        """Raise unless ``cache`` is a cache this module can use (nothing is written)."""
        if not hasattr(cache, "update") or not hasattr(cache, "check_compatible"):
            raise TypeError(f"cache must be a multihead.KVCache or PagedKVCache.batch(...), got "
                            f"{type(cache).__name__}")
        p, kv = self.out_proj.weight, self._kv_dtype()
        if cache.dtype != kv and kv != p.dtype:
            raise TypeError(f"cache is {cache.dtype} but under torch.autocast({kv}) this module "
                            f"computes K/V in {kv}: build the cache with dtype={kv} "
                            f"(module.make_cache(...) inside the autocast context does; "
                            f"PagedKVCache(..., dtype={kv}) for pages)")
        if cache.dtype != kv and cache.dtype in (torch.float16, torch.bfloat16) \
                and p.dtype in AUTOCAST_CASTS:
            raise TypeError(f"cache is {cache.dtype} but this module computes K/V in {p.dtype}: "
                            f"build the cache with the module's dtype, or call it under "
                            f"torch.autocast(device_type, dtype={cache.dtype}) as the cache was "
                            f"made for")
        cache.check_compatible(self.num_kv_heads, self.head_dim, self.head_dim, kv, p.device)

    def _cached(self, x, context, cache, mask, valid, positions, in_place=False):
        """q and the cached k/v (new tokens appended), and the mask with cached padding;
        ``in_place``: for a step :func:`_reads_pages` accepts, a :class:`PagedView` as k."""
        if positions is not None:
            raise ValueError("positions come from the cache when cache= is given (each "
                             "sequence continues from its length): drop positions=")
        self._check_input("x", x, self.embed_dim)
        if x.shape[0] != cache.batch_size:
            raise ValueError(f"x has batch {x.shape[0]} but the cache holds {cache.batch_size} "
                             f"sequences: use one cache per batch (or PagedKVCache.batch(ids))")
        _check_cached_mask(mask, context is not None or cache.cross, x.shape[1])
        if context is not None or cache.cross:                         # cross-attention
            if valid is not None:
                raise ValueError("valid marks padded new tokens of a self-attention cache; for "
                                 "cross-attention mask the context with mask=mh.masks.padding(...)")
            if context is not None:
                q, k, v = self._project(x, context)
                if self.rope is not None:                              # as _rotate does
                    k = self.rope(k, 0)
                cache.store_context(k, v)
            else:
                q, _, _ = self._project(x, False)
            k, v = cache.context()
            start = cache._serve_queries(q.shape[2])                   # queries continue
            if self.rope is not None:
                q = self.rope(q, start)
            return q, k, v, mask
        q, k, v = self._project(x, None)
        valid = cache._check_valid(valid, q.shape[2])                  # checked, moved once
        if self.rope is not None:
            q, k = self.rope.rotate(q, k, positions=cache.rope_positions(q.shape[2], valid))
        if in_place and _reads_pages(cache, q, mask, valid, self.backend):
            return q, cache.update_in_place(k, v), None, mask
        k, v, key_valid = cache.update(k, v, valid)
        if key_valid is not None:
            pad = masks.padding(key_valid)
            mask = as_mask(mask)
            if mask is not None:       # (its sizes named, not the padding it is combined with)
                mask.check(x.shape[0], self.num_heads, q.shape[2], k.shape[2])
            # (a tensor mask combines with the padding; distances count tokens, not slots)
            mask = distances_in_tokens(mask, key_valid, q.shape[2])
            mask = pad if mask is None else mask & pad
        return q, k, v, mask

    @_reads_weights_once
    def head_contributions(self, x: torch.Tensor, context: torch.Tensor | None = None, *,
                           mask=None, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Each head's write into the output, ``head_i @ W_O^(i)`` (seed 004): ``(B, H, Sq, E)``.

        Their sum over heads plus ``out_proj.bias`` equals :meth:`forward`'s output.

        Example:
            >>> import torch, multihead as mh
            >>> attn = mh.MultiHeadAttention(16, 4).eval()
            >>> x = torch.randn(1, 3, 16)
            >>> parts = attn.head_contributions(x)
            >>> torch.allclose(parts.sum(1) + attn.out_proj.bias, attn(x), atol=1e-6)
            True
        """
        q, k, v = self._qkv(x, context, positions)
        p = self.dropout if self.training else 0.0
        out = attention(q, k, v, mask=mask, dropout_p=p, backend=self.backend)  # (B, H, Sq, Dh)
        w_o = self.out_proj.weight.view(self.embed_dim, self.num_heads, self.head_dim)  # (E, H, Dh)
        return torch.einsum("bhsd,ehd->bhse", out, w_o)

    # -- interop --------------------------------------------------------------------------
    @classmethod
    def from_torch(cls, m: nn.MultiheadAttention) -> "MultiHeadAttention":
        """Build the equivalent module from a ``torch.nn.MultiheadAttention`` (same outputs)."""
        from ..interop.torch_mha import from_torch
        return from_torch(m)

    def to_torch(self) -> nn.MultiheadAttention:
        """The equivalent ``torch.nn.MultiheadAttention`` (``batch_first=True``)."""
        from ..interop.torch_mha import to_torch
        return to_torch(self)


def _reads_pages(cache, q: torch.Tensor, mask, valid, backend) -> bool:
    """True when a step reads a :class:`PagedKVCache` batch through its block table (the
    Triton split-K decode kernel, :func:`multihead.kernels.decode.paged_decode_forward`)
    instead of gathering its pages into contiguous K/V: at most 16 queries, on a GPU, in
    float16/bfloat16, without gradients, every token real (no ``valid`` now or before), the
    mask None or a lower-right ``causal``/``sliding_window``, the backend ``auto`` or
    ``triton``, dtypes and head dims the kernels take (up to 256), pages a multiple of 16
    tokens, Triton installed and no ``torch.compile`` tracing."""
    from .. import kernels
    if not isinstance(cache, PagedBatch) or valid is not None or cache.padded:
        return False
    if backend not in (None, "auto", "triton") or cache.pool.page_size % 16:
        return False
    if (q.device.type != "cuda" or q.shape[2] > 16
            or (torch.is_grad_enabled() and q.requires_grad)):
        return False
    if mask is not None and not (type(mask) is masks.Window and mask.align == "lower_right"):
        return False
    if not kernels.available() or tracing():
        return False            # a traced graph reads the gathered pages through ops.decode
    from ..kernels._band import DTYPES, MAX_HEAD_DIM
    return q.dtype in DTYPES and max(q.shape[-1], cache.value_dim) <= MAX_HEAD_DIM


def _weights_arg(return_weights: bool, average_weights: bool):
    """:func:`~multihead.attention`'s ``return_weights`` for the module's two flags (the
    head mean is attention's own: the Triton backend's forward writes it without the
    weights per head)."""
    return "mean" if average_weights else return_weights


def _paged_decode(q: torch.Tensor, view: PagedView, mask) -> torch.Tensor:
    """Attention of ``q (B, H, Sq, Dh)`` over the pages of ``view``: ``(B, H, Sq, Dh)``."""
    from ..functional._call import default_scale
    from ..kernels.decode import paged_decode_forward
    out, _ = paged_decode_forward(q, view.k, view.v, view.table, view.lengths,
                                  max_len=view.max_len, page_size=view.page_size,
                                  scale=default_scale(q.shape[-1]), causal=mask is not None,
                                  window=mask.size if mask is not None else None)
    return out

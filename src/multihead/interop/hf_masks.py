"""Hugging Face mask functions read as structured masks: no 4-D tensor for the common cases.

``transformers`` (5.x) builds every mask from a *mask function* ``f(b, h, q, kv) -> bool``
composed from a few known pieces (causal, sliding-window overlay, padding, packed
sequences, ``and_masks``/``or_masks``) and asks the registered mask builder to turn it into
whatever its attention function wants. :func:`build_mask` reads those pieces back from the
closures and returns an :class:`HFMask`: one of our masks (``causal() & padding(...)``,
``sliding_window(w) & document(ids)``, ...) plus how many keys it can ever see. A piece we
do not know (a model's own overlay, chunked attention) is evaluated by Hugging Face's own
``sdpa_mask`` into a dense bool mask, so the result is always exact; :attr:`HFMask.dense`
says when that happened.
"""

from __future__ import annotations

import functools
import inspect
import operator
from typing import NamedTuple

import torch

from .. import masks as M
from .._tracing import shape_text, tracing


class _Overlay(NamedTuple):
    """HF's sliding-window overlay: keys after ``q - size``; a window only with causal."""

    size: int


class HFMask:
    """What our mask builder hands to our attention function, once per model call.

    Attributes:
        mask: a :class:`multihead.masks.Mask`, or None when every key may be attended.
        keys: how many keys (from the first) the attention uses; the rest are never
            visible (a static cache's unused slots, future positions), so they are skipped.
        dense: True when the mask function held a piece we do not read as structure and
            was evaluated by ``transformers`` into a dense bool mask.

    It answers ``shape``/``ndim``/``contiguous()`` like the 4-D masks ``transformers``
    passes around, so generation code that prepares masks ahead of time carries it along.
    """

    def __init__(self, mask, keys: int, shape: tuple, dense: bool = False):
        self.mask, self.keys, self.shape, self.dense = mask, keys, shape, dense
        self.ndim = 4

    def contiguous(self):
        return self

    def to(self, device=None, *args, **kwargs):
        """The mask on ``device`` (accelerate moves a layer's arguments to its device)."""
        if isinstance(device, (str, torch.device)) and self.mask is not None:
            return HFMask(self.mask.to(device), self.keys, self.shape, self.dense)
        return self

    MISUSE = ("this model uses its attention mask as a tensor outside transformers' "
              "AttentionInterface, so attn_implementation='multihead' cannot run it: load it "
              "with attn_implementation='eager' (or 'sdpa', where the model supports it)")

    def _misuse(self, *args, **kwargs):
        raise TypeError(self.MISUSE)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        """A torch function given the mask (``scores.masked_fill(mask, ...)``, MPT's)."""
        raise TypeError(cls.MISUSE)

    __getitem__ = __add__ = __radd__ = __mul__ = __and__ = __invert__ = _misuse

    def __getattr__(self, name):            # only for names HFMask does not have
        raise AttributeError(f"HFMask has no {name!r}: {self.MISUSE}")

    def describe(self) -> str:
        what = "all keys" if self.mask is None else self.mask.describe()
        return f"{what} over the first {self.keys} keys" + (" (dense)" if self.dense else "")

    __repr__ = describe


#: model types whose layers use the attention mask as a tensor (Bloom adds ALiBi to it, MPT
#: fills scores through it, XGLM/MVP/LED/Doge read its size or dtype, DeepSeek-V3.2's indexer
#: slices it): every forward fails, so they are refused before any layer writes a cache
MASK_AS_TENSOR = frozenset({"bloom", "mpt", "deepseek_v32", "xglm", "mvp", "led", "doge"})

#: model types whose attention layers add learned sink logits (refused before any layer runs)
SINK_MODELS = frozenset({"gpt_oss", "granite_swa", "granitemoe_swa", "mimo_v2_flash", "flint",
                         "deepseek_v4", "hy_v4", "openai_privacy_filter", "inkling2"})


#: the attention kinds of ``config.layer_types``; other kinds (linear attention, Mamba,
#: convolutions) keep caches that hold no keys per token
_ATTENTION_KINDS = frozenset({"full_attention", "sliding_attention", "chunked_attention"})


def hybrid_hint(config) -> str:
    """Why a mask may be sized for other keys than a layer's, where ``config.layer_types``
    mixes in layers that are not attention ("" where it does not).

    Example:
        >>> from types import SimpleNamespace as NS
        >>> hybrid_hint(NS(layer_types=["full_attention", "sliding_attention"]))
        ''
        >>> hybrid_hint(NS(layer_types=["linear_attention", "full_attention"]))[:57]
        " (SimpleNamespace.layer_types mixes in 'linear_attention'"
    """
    kinds = getattr(config, "layer_types", None)
    others = sorted({k for k in kinds if isinstance(k, str)} - _ATTENTION_KINDS) \
        if isinstance(kinds, (list, tuple)) else []
    if not others:
        return ""
    return (f" ({type(config).__name__}.layer_types mixes in {', '.join(map(repr, others))}: "
            f"transformers sizes this model's mask from the cache of such a layer, which holds "
            f"no keys per token)")


def _declares(config, field: str) -> bool:
    """Whether ``config``'s class has ``field`` (a model of that class may read it), rather
    than the instance holding an extra attribute its model never reads."""
    cls = type(config)
    if any(field in getattr(k, "__annotations__", {}) for k in cls.__mro__):
        return True
    try:
        return field in inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):              # (cannot tell: as if it did)
        return True


def check_config(config) -> None:
    """Refuse, before any layer runs (and so before a cache is written), a model whose
    attention we do not compute (logit softcapping, attention sinks) or whose layers use
    the mask as a tensor (:data:`MASK_AS_TENSOR`). Softcapping is refused where the config's
    class has the field (Gemma2's, Gemma3's): an attribute added to another config is one
    its model never reads (a layer that passes ``softcap`` is refused where it does)."""
    cap = getattr(config, "attn_logit_softcapping", None)
    name = type(config).__name__
    if cap is not None and _declares(config, "attn_logit_softcapping"):
        raise ValueError(f"attn_implementation='multihead' does not support attention logit "
                         f"softcapping ({name}.attn_logit_softcapping is {cap}): load this "
                         f"model with attn_implementation='eager' instead")
    kind = getattr(config, "model_type", None)
    shares_kv = kind in ("gemma4", "gemma4_text") and getattr(config, "num_kv_shared_layers", 0)
    if kind in MASK_AS_TENSOR or shares_kv:        # (Gemma4's KV-sharing layers slice it)
        raise TypeError(f"{HFMask.MISUSE} ({name}, model_type {kind!r}"
                        f"{', num_kv_shared_layers > 0' if shares_kv else ''}: refused before "
                        f"any layer runs)")
    if kind in SINK_MODELS:
        raise ValueError(f"attn_implementation='multihead' does not support attention sinks "
                         f"({name}: each attention layer's learned sinks): load this model "
                         f"with attn_implementation='eager' instead")


def unreadable_mask(attention_mask, expected: str) -> TypeError:
    """The error for an ``attention_mask`` we cannot read, showing its type and shape."""
    return TypeError(f"attn_implementation='multihead' reads {expected}, got "
                     f"{type(attention_mask).__name__} of shape "
                     f"{shape_text(attention_mask)}: pass attention_mask to the "
                     f"model as (B, S) with 1 = real token, or as a 4-D (B, 1, Sq, Sk) bool or "
                     f"additive mask")


def _closure(fn) -> dict:
    """A closure's free variables by name."""
    try:
        cells = fn.__closure__ or ()
    except AttributeError:  # torch.compile cannot read the cells of a function made in its trace
        raise _Unknown("a mask function made while torch.compile traces") from None
    return dict(zip(fn.__code__.co_freevars, (c.cell_contents for c in cells)))


def _where(fn) -> tuple | None:
    """Where a function's code is (file, line, name): how ``transformers``' mask pieces are
    recognized (strings, not code objects: ``torch.compile`` guards on them as constants)."""
    code = getattr(fn, "__code__", None)
    return None if code is None else (code.co_filename, code.co_firstlineno, code.co_name)


def _codes():
    """Where the code of each of ``transformers``' mask pieces is, to recognize their closures."""
    from transformers import masking_utils as mu
    t = torch.zeros(1, 1)
    return {
        _where(mu.causal_mask_function): "causal",
        _where(mu.bidirectional_mask_function): "full",
        _where(mu.and_masks(mu.causal_mask_function)): "and",
        _where(mu.or_masks(mu.causal_mask_function)): "or",
        _where(mu.sliding_window_overlay(1)): "overlay",
        _where(mu.padding_mask_function(t)): "padding",
        _where(mu.packed_sequence_mask_function(t)): "packed",
        _where(mu.remap_positions_for_packed_sequence(mu.causal_mask_function, t)): "remap",
    }


_CODES: dict | None = None


class _Unknown(Exception):
    """A piece of the mask function we do not read as structure."""


def _read(fn, offsets: bool = False, packed: bool = False):
    """The structure of an HF mask function: None (all), an overlay, or a Mask.

    Windows here are on absolute positions; the caller aligns them. Tensors read from the
    closures (padding, packed ids) index positions from 0, so they are read only when the
    call has no offsets (``offsets``); otherwise the function is not read. ``packed`` is True
    inside a packed-sequence ``and``, where positions restart per document: a band mask
    (causal, window) depends only on distances, which are the same within a document.
    """
    global _CODES
    if _CODES is None:
        _CODES = _codes()
    kind = _CODES.get(_where(fn))
    if kind == "causal":
        return M.causal()
    if kind == "full":
        return None
    if kind == "overlay":
        size = int(_closure(fn)["sliding_window"])
        if size < 1:                 # (Qwen2-MoE builds one of 0 that no layer uses: as given)
            raise _Unknown(f"a sliding-window overlay of {size} tokens")
        return _Overlay(size)
    if kind in ("padding", "packed") and offsets:
        raise _Unknown(f"a {kind} tensor in the mask function of a call with offsets")
    if kind == "padding":
        return M.padding(_closure(fn)["padding_mask"].bool())
    if kind == "packed":
        return M.document(_closure(fn)["packed_sequence_mask"])
    if kind == "remap" and packed:
        inner = _read(_closure(fn)["mask_function"], offsets)
        if inner is None or isinstance(inner, M.Window):
            return inner
        raise _Unknown("a packed-sequence remap of a mask that is not a band")
    if kind in ("and", "or"):
        parts = _closure(fn)["mask_functions"]
        is_packed = kind == "and" and any(
            _CODES.get(_where(p)) == "packed" for p in parts)
        return _combine(kind, [_read(p, offsets, is_packed) for p in parts])
    raise _Unknown(getattr(fn, "__qualname__", repr(fn)))


def _combine(kind: str, parts: list):
    """``and``/``or`` of read pieces; a window overlay must meet a causal mask in an ``and``."""
    overlays = [p for p in parts if isinstance(p, _Overlay)]
    rest = [p for p in parts if not isinstance(p, _Overlay)]
    if overlays:
        causal = [p for p in rest if isinstance(p, M.Window) and p.size is None]
        if kind != "and" or len(overlays) != 1 or not causal:
            raise _Unknown("a sliding-window overlay without a causal mask")
        rest.remove(causal[0])
        rest.append(M.sliding_window(overlays[0].size))
    if kind == "and":                               # None (everything) is the unit of &
        rest = [p for p in rest if p is not None]
        return functools.reduce(operator.and_, rest) if rest else None
    if any(p is None for p in rest):                # ... and absorbs |
        return None
    return functools.reduce(operator.or_, rest)


def _bounded_by_band(mask) -> bool:
    """Whether a band (causal, window) rules out every key after the last query's position:
    a band, an ``&`` with one, or an ``|`` of such."""
    if isinstance(mask, M.Window):
        return True
    if isinstance(mask, M.And):
        return _bounded_by_band(mask.a) or _bounded_by_band(mask.b)
    if isinstance(mask, M.Or):
        return _bounded_by_band(mask.a) and _bounded_by_band(mask.b)
    return False


def _realign(mask, d: int, keys: int, q_length: int):
    """Our windows align lower-right (offset ``keys - q_length``); HF's are at offset d."""
    if keys - q_length == d:
        return mask
    if d == 0:
        return _rebuild(mask, "upper_left")
    raise _Unknown(f"a band mask at offset {d} over {keys} keys")


def _rebuild(mask, align: str):
    if isinstance(mask, M.Window):
        return M.Window(mask.size, align)
    if isinstance(mask, (M.And, M.Or)):
        return type(mask)(_rebuild(mask.a, align), _rebuild(mask.b, align))
    return mask


def _padding(attention_mask, kv_offset: int, keys: int):
    """Key padding over the keys used: ``attention_mask[:, kv_offset:]`` padded with False."""
    pm = attention_mask[:, kv_offset:kv_offset + keys].bool()           # (B, <= keys)
    if pm.shape[1] < keys:
        pm = torch.nn.functional.pad(pm, (0, keys - pm.shape[1]))       # (B, keys)
    if pm.device.type == "cpu" and not tracing():                       # (reads values)
        lengths = pm.sum(1)                                             # (B,)
        if bool(pm.all()):
            return None
        if torch.equal(pm, torch.arange(keys) < lengths[:, None]):      # right padding
            return M.padding(lengths)
    return M.padding(pm)


def _check_columns(attention_mask, tokens: int, slots: int, config=None) -> None:
    """A 2-D mask must cover every key that is a token so far: transformers pads a shorter
    one with zeros (the tokens past its end are then masked, every key of a query in a
    window too: silently wrong), and reads only the columns it needs of a longer one.

    ``tokens``: the queries' end (cached + new); ``slots``: the keys' end (a static cache's
    slots; a cross-attention's encoder length). A mask as long as either is right.
    """
    cols, shape = attention_mask.shape[1], shape_text(attention_mask)
    least_keys, most_keys = min(tokens, slots), max(tokens, slots)
    if cols < least_keys:
        raise ValueError(f"attention_mask has {cols} columns (shape {shape}) but there are "
                         f"{least_keys} keys so far: give one column per key token (with a "
                         f"cache, the cached ones included, not only the new tokens'; 1 = real "
                         f"token, 0 = padding)")
    if cols > most_keys:
        raise ValueError(f"attention_mask has {cols} columns (shape {shape}) but there are "
                         f"only {most_keys} keys: give one column per key token so far, not "
                         f"the mask of a longer input{hybrid_hint(config)}")


def build_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset=0,
               mask_function=None, attention_mask=None, **kwargs) -> HFMask:
    """The ``AttentionMaskInterface`` entry: an :class:`HFMask` instead of a 4-D tensor.

    Called by ``transformers``' ``create_causal_mask`` and friends with the arguments it
    gives every mask builder (``kwargs`` holds the ones we do not need: dtype, ...; the
    ``config`` is checked for options we do not run, see :func:`check_config`).

    Args:
        batch_size, q_length, kv_length: the mask covers ``(B, 1, Sq, Sk)``.
        q_offset, kv_offset: absolute positions of the first query and key (a cache's).
        mask_function: transformers' ``f(b, h, q, kv) -> bool``, read back as structure.
        attention_mask: the model's 2-D ``(B, S)`` padding mask (1 = real token) or None.

    Always an :class:`HFMask`, even where nothing is masked: ``sdpa``'s builder gives None
    there, and a layer given None decides by its ``is_causal`` (Phi4-multimodal's vision
    encoder would then run causal), so BEiT, which adds its bias to the mask, is refused.

    Raises:
        TypeError: an ``attention_mask`` that is not 2-D (shape shown).
        ValueError: a model option we do not run (softcapping, sinks), before any layer runs.

    Example:
        >>> import torch
        >>> from transformers.masking_utils import causal_mask_function
        >>> build_mask(2, 1, 6, 5, 0, causal_mask_function, torch.tensor([[1] * 6, [0] + [1] * 5]))
        (causal(align='lower_right') & padding(mask of shape (2, 6))) over the first 6 keys
        >>> build_mask(1, 3, 8, 2, 0, causal_mask_function)      # a static cache's 8 slots
        causal(align='lower_right') over the first 5 keys
    """
    check_config(kwargs.get("config"))
    if isinstance(attention_mask, HFMask):          # prepared ahead by generate()
        return attention_mask
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or attention_mask.dim() != 2:
            raise unreadable_mask(attention_mask, "a 2-D padding mask (B, S) here")
        if attention_mask.shape[0] != batch_size:       # (transformers reads rows 0..B-1)
            raise ValueError(f"attention_mask has {attention_mask.shape[0]} rows (shape "
                             f"{shape_text(attention_mask)}) but the batch has {batch_size} "
                             f"sequences: pass one row per sequence (1 = real token)")
        attention_mask = attention_mask.bool()          # (0/1 ints, as tokenizers give)
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    if attention_mask is not None:
        _check_columns(attention_mask, q_offset + q_length, kv_offset + kv_length,
                       kwargs.get("config"))
    shape = (batch_size, 1, q_length, kv_length)
    try:
        offsets = bool(q_offset or kv_offset)
        mask = _read(mask_function, offsets) if mask_function is not None else None
        keys = kv_length
        if _bounded_by_band(mask):                  # no key after the last query is visible
            d = q_offset - kv_offset
            keys = min(kv_length, max(q_length + d, 0))
            mask = _realign(mask, d, keys, q_length)
        if attention_mask is not None:
            pad = _padding(attention_mask, kv_offset, keys)
            if pad is not None:
                mask = pad if mask is None else mask & pad
        return HFMask(mask, keys, shape)
    except _Unknown:
        from transformers.masking_utils import sdpa_mask
        kwargs.pop("allow_is_causal_skip", None)
        kwargs.pop("allow_is_bidirectional_skip", None)
        kwargs["use_vmap"] = True
        allowed = sdpa_mask(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function,
                            attention_mask, allow_is_causal_skip=False,
                            allow_is_bidirectional_skip=False, **kwargs)    # (B, 1, Sq, Sk)
        return HFMask(None if allowed is None else M.dense(allowed), kv_length, shape, True)

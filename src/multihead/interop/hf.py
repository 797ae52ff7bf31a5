"""Hugging Face ``transformers`` on multihead: ``attn_implementation="multihead"``.

Importing this module registers ``"multihead"`` in two registries of ``transformers`` (5.x): as an
attention function (``AttentionInterface``) that runs every attention layer through
:func:`multihead.attention`, and as a mask builder (``AttentionMaskInterface``) that hands
it our structured masks (causal, padding, sliding window, packed documents from
``position_ids``) instead of a dense 4-D tensor::

    import multihead.interop.hf   # registers "multihead"
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="multihead")

GQA runs on the K/V heads as they are (no ``repeat_kv`` copies), and
``output_attentions=True`` stays on our attention (the weights come from the same call).
Logit softcapping and attention sinks are refused with an error naming the model option.
"""

from __future__ import annotations

import weakref

import torch

from .. import masks as M
from ..functional import attention
from ..masks import Mask
from ..masks._content import by_content
from ..masks.structured import ids_from_offsets
from .hf_masks import HFMask, build_mask, hybrid_hint, unreadable_mask
from .._tracing import check_when_run, shape_text, tracing

NAME = "multihead"


def register(name: str = NAME) -> str:
    """Register ``name`` as an attention implementation and mask builder in ``transformers``.

    Idempotent; importing this module already calls it. Returns the name.

    Raises:
        ImportError: ``transformers`` (5.x, with ``AttentionMaskInterface``) is not installed.

    Example:
        >>> import multihead.interop.hf as hf
        >>> hf.register()
        'multihead'
        >>> from transformers import AttentionInterface
        >>> "multihead" in AttentionInterface._global_mapping
        True
    """
    hint = "multihead.interop.hf needs transformers 5.x: pip install 'transformers>=5'"
    try:
        import transformers
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface
    except ImportError as e:
        raise ImportError(hint) from e
    if int(transformers.__version__.split(".")[0]) < 5:     # 4.x calls mask builders differently
        raise ImportError(f"{hint} (found {transformers.__version__})")
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, _forward_mask)
    return name


def _forward_mask(*args, **kwargs) -> HFMask:
    """:func:`~multihead.interop.hf_masks.build_mask`, called once per model forward before
    its layers run: a new forward reads its packing offsets afresh (their values may have
    changed without a version bump: a numpy buffer's, an inference tensor's)."""
    _forget_packed(None)
    return build_mask(*args, **kwargs)


def _refuse(what: str, where: str):
    raise ValueError(f"attn_implementation='multihead' does not support {what} ({where}): load "
                     f"this model with attn_implementation='eager' instead")


#: arguments models pass to every attention function that do not change what it computes
#: (the mask builder already folded sliding windows and packing from position_ids into the
#: mask, and FlashAttention's packing arguments are read by :func:`_flash_packing`; the loss's
#: token count and shifted labels, a mixture of experts' router logits and the sequence
#: ids of a flattening collator reach the attention layer through a model's ``**kwargs``)
HARMLESS = frozenset({
    "position_ids", "output_attentions", "output_hidden_states", "use_cache", "return_dict",
    "sliding_window", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k",
    "deterministic", "cache_position", "past_key_values", "layer_idx", "token_type_ids",
    "cache", "position_embeddings", "encoder_hidden_states", "logits_to_keep",
    "num_items_in_batch", "shift_labels", "output_router_logits", "seq_idx"})


def _check_options(module, kwargs):
    """Options of some models that our attention does not run: refused, never ignored."""
    config = getattr(module, "config", None)
    config = type(config).__name__ if config is not None else "the model's config"
    layer = type(module).__name__
    if kwargs.get("softcap") is not None:
        _refuse("attention logit softcapping",
                f"{config}.attn_logit_softcapping is {kwargs['softcap']}")
    sinks = next((kwargs[n] for n in ("s_aux", "sinks") if kwargs.get(n) is not None),
                 getattr(module, "sinks", None))
    if sinks is not None:
        _refuse("attention sinks", f"{layer}.sinks, the learned sink logits of each head")
    other = sorted(n for n, x in kwargs.items()
                   if x is not None and x is not False and n not in HARMLESS
                   and n not in ("softcap", "s_aux", "sinks", "position_bias"))
    if other:                  # e.g. sparse attention's indices: never silently dropped
        _refuse(f"the argument(s) {', '.join(other)} its attention layer passes",
                f"{layer} passes {other[0]}={_show(kwargs[other[0]])}")
    cache = kwargs.get("cache")
    if cache is not None and type(cache).__name__ == "PagedAttentionCache":
        raise ValueError("attn_implementation='multihead' does not run transformers' continuous "
                         "batching (a PagedAttentionCache): use model.generate() with its default "
                         "cache, or attn_implementation='sdpa' for generate_batch()")


def _show(x) -> str:
    return f"tensor of shape {shape_text(x)}" if isinstance(x, torch.Tensor) else repr(x)[:60]


def _mask_for(module, attention_mask, q_len: int, k_len: int, is_causal):
    """Our mask and the number of keys used, from whatever the model passed."""
    if isinstance(attention_mask, HFMask):
        if tuple(attention_mask.shape[2:]) != (q_len, k_len):
            raise ValueError(f"attn_implementation='multihead': the model built its mask for "
                             f"{attention_mask.shape[2]} queries and {attention_mask.shape[3]} "
                             f"keys but this layer attends with {q_len} queries to {k_len} "
                             f"keys, so the mask cannot say which keys each query sees (eager "
                             f"and sdpa broadcast such a mask, and their results then differ "
                             f"from a forward without the cache where it masks anything). "
                             f"transformers sizes this model's mask apart from its cache (a "
                             f"layer kind its mask code does not size, or a sliding window "
                             f"shorter than a cached step needs)"
                             f"{hybrid_hint(getattr(module, 'config', None))}: run it with "
                             f"attn_implementation='eager' if you accept that, or without a "
                             f"cache")
        return attention_mask.mask, attention_mask.keys
    if attention_mask is None:       # (a layer without is_causal: not causal, as eager does)
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", False)
        if causal and q_len > 1:                      # as transformers' sdpa: query i sees 0..i
            return M.causal(align="upper_left"), k_len
        return None, k_len
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 4:
        if attention_mask.shape[-1] > k_len:          # (its first columns may be other keys')
            raise ValueError(f"attention_mask has {attention_mask.shape[-1]} key columns "
                             f"(shape {shape_text(attention_mask)}) but the layer has {k_len} "
                             f"keys: a 4-D mask has one column per key the layer attends to "
                             f"(its cache's and this call's), (B, 1, {q_len}, {k_len})")
        # (every layer of a forward passes the same one: one mask object, decided once)
        if attention_mask.dtype == torch.bool:        # a model's own 4-D mask, True = attend
            return by_content("a model's 4-D mask", M.dense, (attention_mask,)), k_len
        if attention_mask.is_floating_point():        # additive, as eager adds it
            return by_content("a model's 4-D bias", M.bias, (attention_mask,)), k_len
        raise TypeError(f"attention_mask is a 4-D {attention_mask.dtype} tensor (shape "
                        f"{shape_text(attention_mask)}): a 4-D mask is bool (True = attend) or "
                        f"additive float (0 = attend, -inf = masked); pass mask.bool() for a "
                        f"0/1 mask, or a (B, S) mask with 1 = real token")
    raise unreadable_mask(attention_mask, "its own masks, None or a 4-D mask in attention")


#: the documents last read from a ``cu_seq_lens_k`` tensor: (a weak reference to it, its
#: version, the mask), so that every layer of one forward reads its values once (forgotten
#: when a forward builds its mask: values changed without a version bump are read again)
_PACKED: list = [None, -1, None]


def _flash_packing(kwargs, mask, batch: int, q_len: int, k_len: int):
    """``mask`` with the documents of FlashAttention's packing arguments (``cu_seq_lens_q`` /
    ``cu_seq_lens_k``, as ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``
    gives them without ``position_ids``): documents attend only within themselves, as
    FlashAttention's varlen kernel runs them. Ignoring them would let every document of
    the packed row attend to the others."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return mask
    traced = tracing()                                  # (the offsets hold no values)
    if not traced and mask is not None and any(leaf.kind == "document"
                                               for leaf in mask.leaves()):
        return mask                                     # (position_ids gave them already)
    # (traced, transformers gives documents from position_ids even where it made them
    # itself, as arange: one document, so the offsets' are joined to them)
    if cu_q is None or cu_k is None or batch != 1 or q_len != k_len or (
            cu_q is not cu_k and (cu_q.shape != cu_k.shape if traced
                                  else not torch.equal(cu_q, cu_k))):
        _refuse("packed sequences other than one row of self-attention with equal "
                "cu_seq_lens_q and cu_seq_lens_k",
                f"cu_seq_lens_q={_show(cu_q)}, cu_seq_lens_k={_show(cu_k)}, batch {batch}, "
                f"{q_len} queries, {k_len} keys")
    docs = _traced_packing(cu_q, cu_k, k_len) if traced else _read_packing(cu_k, k_len)
    return docs if mask is None else mask & docs


def _read_packing(cu_k: torch.Tensor, length: int) -> Mask:
    """The documents of the offsets, read on the host once per forward (every layer of it
    gets the same mask)."""
    ref, version, docs = _PACKED
    now = _version(cu_k)
    if ref is None or ref() is not cu_k or version != now:
        try:
            docs = M.document(cu_seqlens=cu_k)         # (reads the offsets: once per forward)
        except ValueError as e:
            raise ValueError(f"cu_seq_lens_k: {e}") from None
        if docs.ids.shape[1] != length:         # (the offsets are wrong: not for eager)
            raise ValueError(f"cu_seq_lens_k ends at {docs.ids.shape[1]}, but the packed row "
                             f"has {length} tokens: its last offset must be the row's length "
                             f"(offsets [0, len1, len1 + len2, ..., {length}])")
        _PACKED[:] = [weakref.ref(cu_k, _forget_packed), now, docs]
    return docs


def _traced_packing(cu_q: torch.Tensor, cu_k: torch.Tensor, length) -> Mask:
    """The documents of the row's ``length`` tokens, their ids computed in the graph from
    the offsets (traced, they cannot be read). The graph checks host offsets when it runs,
    as an eager call does; offsets on a GPU are taken as given, as FlashAttention's varlen
    kernel takes them."""
    cu = cu_k.long()
    check_when_run(cu, lambda: ((cu[0] == 0) & (cu[-1] == length) & (cu.diff() >= 0).all()
                                & (cu_q.long() == cu).all()),
                   "attn_implementation='multihead': cu_seq_lens_k must start at 0, never "
                   "decrease and end at the row's length, and cu_seq_lens_q must equal it (one "
                   "row of packed self-attention)")
    return M.document(ids_from_offsets(cu, length))


def _forget_packed(_ref) -> None:
    """Drop the documents of a ``cu_seq_lens_k`` that is gone (their ids on the device)."""
    _PACKED[:] = [None, -1, None]


def _version(t: torch.Tensor) -> int:
    """``t``'s version counter (0 for an inference tensor, which keeps none and cannot be
    written outside inference mode: its identity alone tells it apart)."""
    try:
        return t._version
    except RuntimeError:
        return 0


def _wants_weights(kwargs) -> bool:
    """``output_attentions=True``, passed down (most models) or only to transformers'
    output collector (GPT-2 keeps the flag from its attention function)."""
    if kwargs.get("output_attentions"):
        return True
    try:
        from transformers.utils.output_capturing import _active_collector
        wanted = _active_collector.get() or {}
    except (ImportError, AttributeError, LookupError):
        return False
    return any(k.endswith("attentions") for k in wanted)


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      is_causal=None, **kwargs):
    """The ``AttentionInterface`` entry: ``(B, H, Sq, D)`` inputs, ``(B, Sq, H, Dv)`` output.

    Args:
        module: the model's attention layer (read for ``is_causal`` and its config's name).
        query: ``(B, H, Sq, D)``.
        key: ``(B, Hkv, Sk, D)``; GQA/MQA heads are used in place.
        value: ``(B, Hkv, Sk, Dv)``.
        attention_mask: an :class:`~multihead.interop.hf_masks.HFMask` from our mask builder,
            None, or a 4-D bool (True = attend) or additive float mask.
        scaling: score multiplier (the layer's ``scaling``); default ``1/sqrt(D)``.
        dropout: dropout on the weights (transformers passes 0.0 at evaluation).
        is_causal: the layer's causal flag when no mask is given.
        **kwargs: ``output_attentions`` returns the weights; ``position_bias`` (T5's) is
            added to the scores; FlashAttention's ``cu_seq_lens_q/k`` keep documents apart;
            options we do not run (softcapping, sinks) raise.

    Returns:
        ``(out, weights)``: ``out`` ``(B, Sq, H, Dv)``; ``weights`` ``(B, H, Sq, Sk)`` with
        ``output_attentions=True``, else None.

    Raises:
        ValueError: an option we do not run (named), or a mask built for other sizes.
        TypeError: an ``attention_mask`` we cannot read (its type and shape shown).

    Example:
        >>> import torch
        >>> from transformers.masking_utils import causal_mask_function
        >>> q, kv = torch.randn(2, 8, 5, 16), torch.randn(2, 2, 5, 16)    # GQA: 8 heads, 2 K/V
        >>> mask = build_mask(2, 5, 5, 0, 0, causal_mask_function)
        >>> out, w = attention_forward(torch.nn.Module(), q, kv, kv, mask, output_attentions=True)
        >>> out.shape, w.shape
        (torch.Size([2, 5, 8, 16]), torch.Size([2, 8, 5, 5]))
    """
    _check_options(module, kwargs)
    q_len, k_len = query.shape[2], key.shape[2]
    mask, keys = _mask_for(module, attention_mask, q_len, k_len, is_causal)
    mask = _flash_packing(kwargs, mask, query.shape[0], q_len, k_len)
    bias = kwargs.get("position_bias")
    if bias is not None:            # T5's relative position bias (B or 1, H, Sq, Sk): added
        if bias.shape[-1] not in (1, k_len):            # before the mask, as eager adds it
            _refuse("a position_bias of another width than the keys",
                    f"position_bias {_show(bias)}, {k_len} keys")
        bias = M.bias(bias[..., :keys])
        mask = bias if mask is None else mask & bias
    if keys < k_len:                                   # never-visible keys are skipped
        key, value = key[:, :, :keys], value[:, :, :keys]              # (B, Hkv, keys, D)
    want = _wants_weights(kwargs)
    res = attention(query, key, value, mask=mask, scale=scaling, dropout_p=float(dropout),
                    return_weights=want)
    out, weights = res if want else (res, None)
    if want and keys < k_len:                          # as long as the keys the model holds
        weights = torch.nn.functional.pad(weights, (0, k_len - keys))  # (B, H, Sq, Sk)
    return out.transpose(1, 2).contiguous(), weights                   # (B, Sq, H, Dv)


try:                                                   # import-time registration
    register()
except ImportError:
    import importlib.util
    if importlib.util.find_spec("transformers") is not None:
        raise                                          # installed but too old: say so now
    # not installed: importing this module is harmless, register() says what is missing

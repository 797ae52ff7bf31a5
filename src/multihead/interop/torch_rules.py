"""The input rules of ``torch.nn.MultiheadAttention``, as the drop-in enforces them.

Shapes of inputs and masks checked in torch's order, with torch's wording first (so code
matching torch's messages keeps working), then the bad shape, the expected one and the
likely fix; errors of torch's exception type that are also ``ValueError``; mask dtype
rules; and the NestedTensor inputs torch's inference path accepts.
"""

from __future__ import annotations

import warnings
from typing import NamedTuple, Optional

import torch
from torch import nn

import multihead as mh
from multihead._dtypes import SUPPORTED_DTYPES, check_weights
from multihead._tracing import concrete, shape_text


# -- errors: torch's exception type and ours at once ------------------------------------

class _AssertionArgError(ValueError, AssertionError):
    """A bad argument where torch raises ``AssertionError``: catch it as either."""


class _RuntimeArgError(ValueError, RuntimeError):
    """A bad argument where torch raises ``RuntimeError``: catch it as either."""


class _FusedPathArgError(_AssertionArgError, RuntimeError):
    """A bad argument where torch's fused inference kernel would have answered: torch raises
    ``RuntimeError`` there (its other path ``AssertionError``): catch it as any of them."""


class _RuntimeTypeError(TypeError, RuntimeError):
    """A dtype attention cannot compute in, refused where it is passed: torch fails on most
    of these later with ``RuntimeError`` (an integer weight cannot require gradients; float8
    has no uniform init; a complex module builds, then fails in its forward): catch it as
    either."""


class _DtypeArgError(TypeError, AssertionError):
    """A mask of a dtype torch refuses (with ``AssertionError``): catch it as either."""


def _as_torch_raises(check, *args, **kwargs):
    """``check(...)``, one of multihead's dtype checks, whose ``TypeError`` is raised as a
    :class:`_RuntimeTypeError` (torch fails on these dtypes with ``RuntimeError``)."""
    try:
        return check(*args, **kwargs)
    except TypeError as e:
        raise _RuntimeTypeError(str(e)) from None


def _torch_mask(mask, name: str) -> "mh.masks.Mask | None":
    """torch convention (bool True = ignore, or additive float) -> a multihead mask. A float
    mask keeps its own precision (as every bias: a value past the query dtype's range stays
    a number, where rounding it first would make it ``-inf``, which ignores the key)."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return mh.masks.dense(~mask)
    try:
        return mh.masks.bias(mask)
    except ValueError as e:                          # what is wrong, said of the argument
        raise ValueError(f"{name}: {e} (torch would return NaN rows)") from None


# -- torch's input rules (``_mha_shape_check``, ``_canonical_mask`` and the size checks) --

def _check_mask_dtypes(key_padding_mask, attn_mask) -> None:
    """bool or float masks only; mixing the two kinds warns, as in torch (not while
    ``torch.compile`` traces: Dynamo cannot trace ``warnings.warn``, and torch's module
    fails under ``fullgraph=True`` there)."""
    for name, m in (("key_padding_mask", key_padding_mask), ("attn_mask", attn_mask)):
        if m is None:
            continue
        if not isinstance(m, torch.Tensor):
            raise TypeError(f"{name} must be a tensor or None, got {type(m).__name__}")
        if m.dtype != torch.bool and not m.is_floating_point():
            raise _DtypeArgError(
                f"only bool and floating types of {name} are supported: got {m.dtype}; pass "
                f"{name}.bool() (True = ignore) or an additive float mask (-inf = ignore)")
    if (key_padding_mask is not None and attn_mask is not None
            and key_padding_mask.dtype != attn_mask.dtype
            and not torch.compiler.is_compiling()):
        warnings.warn("Support for mismatched key_padding_mask and attn_mask is deprecated. "
                      "Use same type for both instead.", stacklevel=4)


class _Weights(NamedTuple):
    """The parameters one forward computes with, each read once (see :func:`_read_weights`)."""
    w_in: tuple                           # (W_q, W_k, W_v): (E, E|kdim|vdim) each
    b_in: Optional[torch.Tensor]
    bias_k: Optional[torch.Tensor]
    bias_v: Optional[torch.Tensor]
    w_out: object                         # a tensor, unless out_proj is not a Linear
    b_out: object
    packed: Optional[torch.Tensor] = None  # (3*E, E): W_q, W_k, W_v stacked, where packed


def _read_weights(m: nn.MultiheadAttention) -> _Weights:
    """Read each parameter once, in the order torch's call to its functional forward reads
    them: a parametrization runs on every read (``spectral_norm`` steps its power iteration
    in training, a random one draws): after :func:`_takes_fast_path`'s reads, the
    module's parametrizations have run as often as in torch's module, and give the same
    weights."""
    packed, b_in = m.in_proj_weight, m.in_proj_bias        # (in_proj_weight is None unless packed)
    bias_k, bias_v = m.bias_k, m.bias_v
    w_out, b_out = getattr(m.out_proj, "weight", None), getattr(m.out_proj, "bias", None)
    w_in = tuple(packed.split(m.embed_dim)) if m._qkv_same_embed_dim else (
        m.q_proj_weight, m.k_proj_weight, m.v_proj_weight)          # packed: views of (3*E, E)
    return _Weights(w_in, b_in, bias_k, bias_v, w_out, b_out,
                    packed if m._qkv_same_embed_dim else None)


def _check_input_dtypes(m: nn.MultiheadAttention, query, key, value, weights: _Weights) -> None:
    """query, key and value in the dtype of the weights that project them (torch's
    projection refuses others, except under autocast, which casts them)."""
    w = weights.w_out
    if not isinstance(w, torch.Tensor):
        what = (f"out_proj is a {type(m.out_proj).__module__}.{type(m.out_proj).__name__} "
                f"whose weight is a {type(w).__name__}, not a tensor")
        if type(m.out_proj).__module__.startswith("torch.ao.nn.quantized"):
            raise _RuntimeTypeError(
                f"{what}: torch's eager quantization (prepare/convert) swaps "
                f"torch.nn.MultiheadAttention by its exact type, so it converted this module's "
                f"out_proj alone; quantize a torch.nn.MultiheadAttention holding these weights "
                f"(load_state_dict(state_dict())) instead")
        raise _RuntimeTypeError(f"{what}: out_proj must be a Linear whose weight the forward "
                                f"reads, as torch's does")
    _as_torch_raises(check_weights, w.dtype)
    kind = query.device.type                  # (meta has no autocast: asking it raises)
    if torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind):
        return
    for name, t, w in zip(("query", "key", "value"), (query, key, value), weights.w_in):
        want = w.dtype
        if getattr(t, "dtype", want) != want:
            module = (f" or convert the module with .to({t.dtype})"
                      if t.dtype in SUPPORTED_DTYPES else "")   # (never to int64 or complex)
            raise _RuntimeArgError(
                f"{name} is {t.dtype} but the module's weights are {want} (torch's projection "
                f"refuses mixed dtypes): pass {name}.to({want}){module}")


def _attn_mask_error(shape, batched: bool, N: int, H: int, L: int, S: int) -> str:
    """What an attn_mask of ``shape`` should have been, and the likely fix."""
    shape, (N, H, L, S) = tuple(map(concrete, shape)), map(concrete, (N, H, L, S))
    want = (f"(L, S) = ({L}, {S}) shared by the batch, or (N*num_heads, L, S) = "
            f"({N * H}, {L}, {S}) per sequence and head" if batched else
            f"(L, S) = ({L}, {S}), or (num_heads, L, S) = ({H}, {L}, {S}) per head "
            f"(the query is unbatched)")
    hint = ""
    if len(shape) == 4:
        hint = "; a (N, num_heads, L, S) mask is attn_mask.flatten(0, 1)"
    elif len(shape) == 1:
        hint = "; a mask over keys only is key_padding_mask"
    elif len(shape) == 2 and 1 in shape:
        hint = f"; broadcast it first: attn_mask.expand({L}, {S})"
    elif len(shape) == 3 and shape[0] == 1:
        hint = "; one mask for the whole batch is 2-D: attn_mask[0]"
    elif len(shape) == 3 and shape[0] == N and batched:
        hint = "; one mask per sequence is attn_mask.repeat_interleave(num_heads, dim=0)"
    return f"attn_mask has shape {shape}, expected {want}{hint}"


def _kpm_error(shape, batched: bool, N: int, S: int) -> str:
    """What a key_padding_mask of ``shape`` should have been, and the likely fix."""
    shape, (N, S) = tuple(map(concrete, shape)), map(concrete, (N, S))
    want = f"(N, S) = ({N}, {S})" if batched else f"(S,) = ({S},) (the query is unbatched)"
    hint = ("; it looks transposed: pass key_padding_mask.transpose(0, 1)"
            if batched and shape == (S, N) else "")
    return f"key_padding_mask has shape {shape}, expected {want} with True at keys to ignore{hint}"


def _check_inputs(m: nn.MultiheadAttention, query, key, value, key_padding_mask, attn_mask,
                  causal_hint: bool, weights: _Weights) -> bool:
    """Refuse every input torch refuses, with torch's exception type; return ``batched``.

    ``causal_hint``: the ``is_causal`` hint replaces ``attn_mask``, whose size is then not
    checked (torch checks its rank and dtype only). ``weights``: the module's, as
    :func:`_read_weights` read them (read here, a parametrization would run again).
    """
    _check_input_dtypes(m, query, key, value, weights)
    _check_mask_dtypes(key_padding_mask, attn_mask)
    kpm, am = key_padding_mask, attn_mask
    for name, mask in (("key_padding_mask", kpm), ("attn_mask", am)):
        if mask is not None and mask.device != query.device:
            raise _RuntimeArgError(f"{name} is on {mask.device} but query is on "
                                   f"{query.device}: pass {name}.to('{query.device}')")
    qd, kd, vd = query.dim(), key.dim(), value.dim()
    if qd not in (2, 3):
        raise _AssertionArgError(
            f"query should be unbatched 2D or batched 3D tensor but received {qd}-D query "
            f"tensor (shape {shape_text(query)}): pass (L, N, E), (N, L, E) with "
            f"batch_first=True, or (L, E)")
    batched = qd == 3
    tag = "batched (3-D)" if batched else "unbatched (2-D)"
    if kd != qd or vd != qd:
        raise _AssertionArgError(
            f"For {tag} `query`, expected `key` and `value` to be {qd}-D but found {kd}-D and "
            f"{vd}-D tensors respectively: shapes {shape_text(key)} and {shape_text(value)}")
    # (N, L, S) in the caller's layout
    if not batched:
        N, L, S = 1, query.shape[0], key.shape[0]
    elif m.batch_first:
        N, L, S = query.shape[0], query.shape[1], key.shape[1]
    else:
        N, L, S = query.shape[1], query.shape[0], key.shape[0]
    if kpm is not None and kpm.dim() != qd - 1:
        raise _AssertionArgError(
            f"For {tag} `query`, expected `key_padding_mask` to be `None` or {qd - 1}-D but "
            f"found {kpm.dim()}-D tensor instead: " + _kpm_error(tuple(kpm.shape), batched, N, S))
    if am is not None:
        err = lambda: _attn_mask_error(tuple(am.shape), batched, N, m.num_heads, L, S)  # noqa: E731
        if am.dim() not in (2, 3):
            raise _AssertionArgError(f"For {tag} `query`, expected `attn_mask` to be `None`, "
                                     f"2-D or 3-D but found {am.dim()}-D tensor instead: {err()}")
        if not batched and am.dim() == 3 and tuple(am.shape) != (m.num_heads, L, S):
            raise _AssertionArgError(f"Expected `attn_mask` shape to be "
                                     f"{(m.num_heads, concrete(L), concrete(S))} "
                                     f"but got {shape_text(am)}: {err()}")
    if query.shape[-1] != m.embed_dim:
        raise _AssertionArgError(
            f"was expecting embedding dimension of {m.embed_dim}, but got "
            f"{concrete(query.shape[-1])}: "
            f"query has shape {shape_text(query)}, its last dim must be embed_dim")
    if m._qkv_same_embed_dim and key.shape != value.shape:
        raise _AssertionArgError(f"key shape {shape_text(key)} does not match value shape "
                                 f"{shape_text(value)}")
    if key.shape[:-1] != value.shape[:-1]:
        raise _AssertionArgError(
            f"key's sequence and batch dims {tuple(map(concrete, key.shape[:-1]))} do not match "
            f"value's {tuple(map(concrete, value.shape[:-1]))}")
    # torch's packed projection fails in its matmul (RuntimeError), the separate ones on
    # an assertion of the weights' shapes
    wrong_width = _RuntimeArgError if m._qkv_same_embed_dim else _AssertionArgError
    for name, t, dim in (("key", key, m.kdim), ("value", value, m.vdim)):
        if t.shape[-1] != dim:
            raise wrong_width(f"{name} has shape {shape_text(t)}: its last dim must be "
                              f"{'kdim' if name == 'key' else 'vdim'} = {dim}")
    if batched and key.shape[1 - int(m.batch_first)] != N:
        raise _RuntimeArgError(f"key has batch size {concrete(key.shape[1 - int(m.batch_first)])} "
                               f"but query has {concrete(N)}: shapes {shape_text(key)} and "
                               f"{shape_text(query)} (batch_first={m.batch_first})")
    if am is not None and not causal_hint:
        if am.dim() == 2 and tuple(am.shape) != (L, S):
            raise _RuntimeArgError(f"The shape of the 2D attn_mask is "
                                   f"{torch.Size(tuple(map(concrete, am.shape)))}, but should "
                                   f"be {(concrete(L), concrete(S))}: {err()}")
        if am.dim() == 3 and tuple(am.shape) != (N * m.num_heads, L, S):
            raise _RuntimeArgError(f"The shape of the 3D attn_mask is "
                                   f"{torch.Size(tuple(map(concrete, am.shape)))}, but should "
                                   f"be {tuple(map(concrete, (N * m.num_heads, L, S)))}: "
                                   f"{err()}")
    want = (N, S) if batched else (S,)
    if kpm is not None and tuple(kpm.shape) != want:
        i = 0 if kpm.shape[0] != want[0] else 1                 # the first dim that is off
        raise _AssertionArgError(f"Expected key_padded_mask.shape[{i}] to be {concrete(want[i])}, "
                                 f"but got {concrete(kpm.shape[i])}: "
                                 + _kpm_error(tuple(kpm.shape), batched, N, S))
    return batched


def _check_nested(m: nn.MultiheadAttention, query, key, value, key_padding_mask,
                  attn_mask) -> None:
    """NestedTensor inputs: all three nested, batch first, no masks (their lengths are the mask)."""
    kinds = ", ".join(f"{n} {'nested' if t.is_nested else 'plain'}"
                      for n, t in (("query", query), ("key", key), ("value", value)))
    if not (query.is_nested and key.is_nested and value.is_nested):
        why = f"query, key and value must all be NestedTensors or all plain tensors, got {kinds}"
    elif not m.batch_first:
        why = ("they need batch_first=True (a NestedTensor's first dim is its batch): build "
               "the module with batch_first=True")
    elif key_padding_mask is not None or attn_mask is not None:
        why = ("key_padding_mask and attn_mask cannot be given with them (the lengths of the "
               "sequences are the mask): pass padded tensors and a key_padding_mask instead")
    elif query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        why = (f"query should be unbatched 2D or batched 3D tensor but received {query.dim()}-D "
               f"query tensor; nested inputs must be (N, L*, E) with {key.dim()}-D key and "
               f"{value.dim()}-D value alike")
    elif not query.size(0) == key.size(0) == value.size(0):
        why = (f"query, key and value hold {query.size(0)}, {key.size(0)} and {value.size(0)} "
               f"sequences; they must hold the same number")
    else:
        return
    raise _AssertionArgError(f"NestedTensor inputs to MultiheadAttention: {why}")


def _lengths(nt: torch.Tensor) -> list[int]:
    """The length of each sequence of a nested ``(N, L*, E)`` tensor."""
    return [t.shape[0] for t in nt.unbind()]


def _takes_fast_path(m: nn.MultiheadAttention, query, key, value, key_padding_mask,
                     attn_mask) -> bool:
    """Whether torch's module would answer this call with its fused inference kernel,
    whose output is a contiguous ``(N, L, E)`` (its other path returns a transposed view of
    a contiguous ``(L, N, E)``): torch's conditions, in its order (while ``torch.compile``
    traces, torch's make_fx test is not asked: it reads as tracing there, but torch's
    compiled module takes its fused kernel).

    It reads the module's parameters where torch's test reads them, as often: a
    parametrization runs on every read, and torch's module computes with the next read
    (:func:`_read_weights`), after its test.
    """
    if not isinstance(query, torch.Tensor):        # (refused after, by _check_inputs)
        return False
    float_mask = any(isinstance(t, torch.Tensor) and t.is_floating_point()
                     for t in (key_padding_mask, attn_mask))
    # torch's chain of conditions, each parameter read as in its own (float masks end the
    # path after the chain, which torch reads all the same)
    if not (torch.backends.mha.get_fastpath_enabled() and query.dim() == 3
            and query is key and key is value):
        return False
    if m.in_proj_bias is not None and query.dtype != m.in_proj_bias.dtype:
        return False
    if m.in_proj_weight is None or query.dtype != m.in_proj_weight.dtype:
        return False
    if (m.training or m.num_heads % 2 or not m.batch_first or m.bias_k is not None
            or m.bias_v is not None or m.add_zero_attn or not m._qkv_same_embed_dim
            or torch.is_autocast_enabled() or float_mask):
        return False
    tensors = (query, m.in_proj_weight, m.in_proj_bias, m.out_proj.weight, m.out_proj.bias)
    if not all(t is None or isinstance(t, torch.Tensor) for t in tensors):
        return False                               # (out_proj is not a Linear: refused after)
    devices = ("cpu", "cuda", torch.utils.backend_registration._privateuse1_backend_name)
    if (torch.overrides.has_torch_function(tensors)
            or not all(t is None or t.device.type in devices for t in tensors)
            or (torch.is_grad_enabled()
                and any(t is not None and t.requires_grad for t in tensors))
            or not (torch.compiler.is_compiling() or not _make_fx_tracing())):
        return False
    return m.in_proj_bias is not None and m.in_proj_weight is not None   # (torch's last test)


def _make_fx_tracing() -> bool:
    """torch's own test (its fused kernel is not traced by make_fx); False where this torch
    does not have it."""
    test = getattr(nn.modules.activation, "_is_make_fx_tracing", None)
    return bool(test()) if test is not None else False

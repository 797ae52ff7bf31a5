"""Validation of an attention call, and the facts about it that backends decide on.

Every user mistake is caught here, before any backend runs, with a message that names the
argument, shows the bad shape or value, and says how to fix it.
"""

from __future__ import annotations

import math
import numbers

import torch
import torch.autograd.forward_ad as fwAD

from .. import masks as M
from .._args import fraction
from .._dtypes import SUPPORTED_DTYPES, check_strided
from .._tracing import concrete, shape_text, vmapped, vmapped_empty
from ..masks._content import by_content
from ..masks.base import uncalled
from ..masks.structured import _offset


def forward_ad_active() -> bool:
    """A forward-mode AD level is open (``forward_ad.dual_level``), or a ``torch.func``
    transform runs (``jvp`` opens its own): a cheap test before looking for tangents.

    Example:
        >>> import torch.autograd.forward_ad as fwAD
        >>> forward_ad_active()
        False
        >>> with fwAD.dual_level():
        ...     forward_ad_active()
        True
    """
    return fwAD._current_level >= 0 or torch._C._are_functorch_transforms_active()


def has_tangent(*items) -> bool:
    """Whether a tensor among ``items`` (tensors, or masks: the tensors they hold) carries a
    forward-mode tangent; False at once where no forward-mode AD runs. Under a ``torch.func``
    jvp transform (``jacfwd``, ``hessian``), a tensor wrapped at that transform's level
    counts as carrying one: from inside a ``jacrev`` an outer level's tangent is not seen.

    Example:
        >>> import torch.autograd.forward_ad as fwAD
        >>> x = torch.zeros(2, 3)                                       # any shapes
        >>> with fwAD.dual_level():
        ...     has_tangent(x, M.bias(x)), has_tangent(x, fwAD.make_dual(x, torch.ones(2, 3)))
        (False, True)
    """
    if not forward_ad_active():
        return False
    tensors = [t for x in items for t in (
        [x] if isinstance(x, torch.Tensor) else x._tensors() if isinstance(x, M.Mask) else [])]
    if torch._C._are_functorch_transforms_active() and _at_a_jvp_level(tensors):
        return True
    return any(fwAD.unpack_dual(t).tangent is not None for t in tensors)


def _at_a_jvp_level(tensors) -> bool:
    """Whether a tensor among ``tensors`` is wrapped (at any depth) at the level of a
    running jvp transform: it may carry that transform's tangent."""
    from torch._C._functorch import TransformType, get_unwrapped, maybe_get_level
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
    jvp = {i.level() for i in retrieve_all_functorch_interpreters()
           if i.key() == TransformType.Jvp}
    for t in tensors if jvp else ():
        while (level := maybe_get_level(t)) != -1:
            if level in jvp:
                return True
            t = get_unwrapped(t)
    return False


def traced(*sizes) -> bool:
    """Whether a size among ``sizes`` is symbolic (``torch.export`` with a ``Dim``, whose
    default non-strict tracing runs this code on symbolic sizes): a fact about it that
    would need a guard is then taken the way that is exact for every size. Under Dynamo
    (``torch.compile``, ``torch.export(strict=True)``) sizes reach this code as ints: a
    fact about them guards, and ``torch.compile`` recompiles where it changes.

    Example:
        >>> traced(3, 4)
        False
    """
    return any(isinstance(n, torch.SymInt) for n in sizes)


def reverse_over_reverse() -> bool:
    """Whether two or more reverse-mode ``torch.func`` transforms (``grad``, ``vjp``,
    ``jacrev``) run around the call: an outer one then differentiates an inner one's
    backward (``grad(grad(f))``, ``jacrev(jacrev(f))``).

    Example:
        >>> reverse_over_reverse()                                  # no transform
        False
    """
    if not torch._C._are_functorch_transforms_active():
        return False
    from torch._C._functorch import TransformType
    from torch._functorch.pyfunctorch import retrieve_all_functorch_interpreters
    return sum(i.key() == TransformType.Grad for i in retrieve_all_functorch_interpreters()) > 1


def _check_tensor(name: str, t, legend: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {legend}, got {type(t).__name__}")
    check_strided(name, t)
    if t.dim() != 4:
        hint = (" (for (B, S, E) inputs use multihead.MultiHeadAttention, or split heads with "
                "x.view(B, S, H, D).transpose(1, 2))" if t.dim() == 3 else "")
        raise ValueError(f"{name} must be 4-D {legend}, got shape {shape_text(t)}{hint}")
    if t.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32, "
                        f"float64 (convert with {name}.float())")


def as_mask(mask) -> M.Mask | None:
    """Accept a Mask, a bool tensor (dense, True = may attend), a float tensor (bias) or None."""
    if mask is None or isinstance(mask, M.Mask):
        return mask
    if isinstance(mask, torch.Tensor):
        if mask.dtype == torch.bool:
            return M.dense(mask)
        if mask.is_floating_point():
            return M.bias(mask)
        raise TypeError(f"mask has dtype {mask.dtype}: pass a bool tensor (True = may attend), a "
                        f"float tensor (additive bias), or a multihead.masks object: mask.bool() "
                        f"where nonzero means may attend; a torch.nn.MultiheadAttention mask, "
                        f"where nonzero means ignore, is ~mask.bool()")
    raise TypeError(f"mask must be a multihead.masks object, a bool/float tensor or None, got "
                    f"{type(mask).__name__}{uncalled(mask)}")


def shared_mask(mask):
    """``mask``, where a tensor of small host contents: its :func:`as_mask`, one object for
    tensors of equal contents (:func:`multihead.masks._content.by_content`), so that its
    decision is made once, not at every call that passes such a tensor; another tensor's
    :func:`as_mask`, marked as made for this call
    (:meth:`~multihead.masks.Mask.made_for_call`). Anything else, and a tensor
    :func:`as_mask` refuses (:func:`make_call` says so, after what it checks first), as it
    is.

    Example:
        >>> import torch
        >>> a = shared_mask(torch.tensor([[True, False]]))
        >>> a is shared_mask(torch.tensor([[True, False]])), shared_mask(None)
        (True, None)
    """
    if not isinstance(mask, torch.Tensor):
        return mask
    try:                            # (a GPU or large tensor: made afresh, marked so)
        return by_content("attention's mask", as_mask, (mask,))
    except (TypeError, ValueError):
        return mask


class AttentionCall:
    """A validated attention call: the inputs, their sizes, and facts derived from them.

    Attributes:
        q, k, v, mask, scale, dropout_p, return_weights, return_lse: the arguments
            (``mask`` as a :class:`multihead.masks.Mask` or None, ``scale`` resolved,
            ``return_weights`` a bool).
        average_weights: whether the weights asked for are their mean over the heads
            (``return_weights="mean"``).
        B, H, Hkv, Sq, Sk, D, Dv: the sizes.
    """

    __slots__ = ("q", "k", "v", "mask", "scale", "dropout_p", "return_weights", "return_lse",
                 "average_weights", "B", "H", "Hkv", "Sq", "Sk", "D", "Dv", "_memo")

    def __init__(self, q, k, v, mask, scale: float, dropout_p: float, return_weights: bool,
                 return_lse: bool, shapes: tuple | None = None, *, average_weights: bool = False):
        self.q, self.k, self.v, self.mask = q, k, v, mask
        self.scale, self.dropout_p = scale, dropout_p
        self.return_weights, self.return_lse = return_weights, return_lse
        self.average_weights = average_weights
        qs, ks, vs = shapes or (q.shape, k.shape, v.shape)
        self.B, self.H, self.Sq, self.D = qs
        _, self.Hkv, self.Sk, _ = ks
        self.Dv = vs[3]
        self._memo = {}

    @property
    def group(self) -> int:
        """Query heads per K/V head (1 for MHA, H for MQA)."""
        return self.H // self.Hkv

    @property
    def requires_grad(self) -> bool:
        return torch.is_grad_enabled() and (             # (the mask's tensors read last)
            self.q.requires_grad or self.k.requires_grad or self.v.requires_grad
            or (self.mask is not None and self.mask.requires_grad))

    @property
    def second_order(self) -> bool:
        """Whether the call's backward will itself be differentiated under ``torch.func``
        (:func:`reverse_over_reverse`, gradients needed); outside a transform such a
        backward is met by :mod:`multihead._second_order` instead."""
        return self.requires_grad and reverse_over_reverse()

    @property
    def forward_ad(self) -> bool:
        """Whether q, k, v or a tensor of the mask carries a forward-mode tangent
        (``torch.func.jvp``, ``jacfwd``, a ``torch.autograd.forward_ad`` dual tensor)."""
        return has_tangent(self.q, self.k, self.v, self.mask)

    @property
    def vmapped_empty(self) -> bool:
        """Whether ``torch.func.vmap`` batches q, k or v over a dimension of size 0."""
        return self.memo("vmapped_empty", lambda: vmapped_empty(self.q, self.k, self.v))

    def memo(self, name: str, compute):
        """A fact derived from this call, computed once (backends cache their analyses here)."""
        if name not in self._memo:
            self._memo[name] = compute()
        return self._memo[name]

    @property
    def effective_mask(self) -> M.Mask | None:
        """The mask, or None when it allows every pair and adds no bias (e.g. causal at Sq=1)."""
        return self.memo("effective", lambda: in_effect(self.mask, self.Sq, self.Sk))

    @property
    def pairs(self) -> int:
        """(query, key) pairs of dense attention, B*H*Sq*Sk."""
        return self.B * self.H * self.Sq * self.Sk

    def io_bytes(self, kv_reads: float = 1.0) -> float:
        """Bytes of q and out, plus k and v read ``kv_reads`` times, in the inputs' dtype."""
        size = self.q.element_size()
        return size * (self.B * self.H * self.Sq * (self.D + self.Dv)
                       + kv_reads * self.B * self.Hkv * self.Sk * (self.D + self.Dv))

    @property
    def compute_dtype(self) -> torch.dtype:
        """float32 for half-precision inputs (what backends built of torch ops compute in)."""
        return torch.float32 if self.q.dtype in (torch.float16, torch.bfloat16) else self.q.dtype

    @property
    def is_pure_causal(self) -> bool:
        m = self.effective_mask
        return type(m) is M.Window and m.size is None


def in_effect(mask, sq: int, sk: int):
    """``mask``, or None where it allows every pair of ``sq`` queries and ``sk`` keys and
    adds no bias: a causal mask whose first query already sees the last key.

    Example:
        >>> import multihead as mh
        >>> in_effect(mh.masks.causal(), 1, 100) is None     # one query sees every key
        True
        >>> in_effect(mh.masks.causal(), 2, 100) is None
        False
    """
    if type(mask) is M.Window and mask.size is None \
            and sk - 1 <= _offset(mask.align, sq, sk):
        return None
    return mask


def default_scale(head_dim: int) -> float:
    """``1 / sqrt(D)``, the seeds' scale (one formula for every path).

    Example:
        >>> default_scale(64)
        0.125
    """
    return 1.0 / math.sqrt(head_dim)


def make_call(q, k, v, *, mask, scale, dropout_p, return_weights, return_lse) -> AttentionCall:
    """Validate the arguments of :func:`multihead.attention` and bundle them."""
    _check_tensor("q", q, "(B, H, Sq, D)")
    _check_tensor("k", k, "(B, Hkv, Sk, D)")
    _check_tensor("v", v, "(B, Hkv, Sk, Dv)")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}: "
                        f"cast them with .to({q.dtype})")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got q on {q.device}, k on {k.device}, "
                         f"v on {v.device}")
    (B, H, Sq, D), (Bk, Hkv, Sk, Dk), (Bv, Hv, Skv, _) = q.shape, k.shape, v.shape
    if not (B == Bk == Bv):
        raise ValueError(f"batch sizes differ: q {shape_text(q)}, k {shape_text(k)}, "
                         f"v {shape_text(v)} (dim 0 must match)")
    if D != Dk:
        raise ValueError(f"head_dim of q ({concrete(D)}) and k ({concrete(Dk)}) must match: "
                         f"q {shape_text(q)}, k {shape_text(k)}")
    if Hkv != Hv or Sk != Skv:
        raise ValueError(f"k {shape_text(k)} and v {shape_text(v)} must agree on heads (dim 1) and "
                         f"sequence length (dim 2)")
    if H == 0:
        raise ValueError(f"q has 0 heads ({shape_text(q)}): give at least one head (dim 1)")
    if Hkv == 0 or H % Hkv != 0:
        H, Hkv = concrete(H), concrete(Hkv)
        divisors = [d for d in range(1, H + 1) if H % d == 0]
        raise ValueError(f"q has {H} heads and k/v have {Hkv}: the number of query heads must be "
                         f"a multiple of the K/V heads (GQA); K/V heads could be one of {divisors}")
    if D == 0:
        raise ValueError(f"head_dim must be positive, got q {shape_text(q)}")
    if scale is None:
        scale = default_scale(D)
    else:
        if isinstance(scale, torch.Tensor):
            if scale.device.type == "meta":
                raise TypeError("scale is a tensor on the meta device, which holds no value: "
                                "pass a Python float")
            if vmapped(scale):
                raise TypeError("scale is batched by torch.func.vmap, but it is one float "
                                "for the whole call: pass a float, or scale q per sample "
                                "(q * (s * sqrt(D)), keeping the default scale)")
            if scale.numel() != 1 or not scale.is_floating_point() or scale.requires_grad:
                raise TypeError(f"scale must be a float, got a tensor of shape "
                                f"{shape_text(scale)}, {scale.dtype}"
                                + (" that requires grad (it would get no gradient: scale q "
                                   "instead)" if scale.requires_grad else ""))
            scale = float(scale)
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(f"scale must be a float, got {type(scale).__name__}")
        try:
            scale, past = float(scale), None
        except OverflowError:                                    # an int past any float
            scale, past = math.inf, (f"{'a negative' if scale < 0 else 'an'} int of "
                                     f"{abs(int(scale)).bit_length()} bits, past any float")
        if not 0 < scale < math.inf:            # (NaN too; comparisons, which a float
            #                                     traced by torch.compile takes as guards)
            raise ValueError(f"scale must be finite and > 0, got {past or concrete(scale)} "
                             f"(default: 1/sqrt(D) = {default_scale(concrete(D)):.4g})")
        scores = torch.promote_types(q.dtype, torch.float32)          # what scores are in
        if scale > torch.finfo(scores).max:
            raise ValueError(f"scale {concrete(scale):g} is past the largest {scores} "
                             f"({torch.finfo(scores).max:.4g}), which the scores are computed "
                             f"in: every score would overflow; give a smaller scale (default: "
                             f"1/sqrt(D) = {default_scale(concrete(D)):.4g})")
    fraction("dropout_p", dropout_p)
    if not (isinstance(return_weights, bool) or weights_mean(return_weights)):
        raise TypeError(f"return_weights must be True, False or \"mean\" (their mean over the "
                        f"heads, (B, Sq, Sk)), got {return_weights!r}")
    if not isinstance(return_lse, bool):
        raise TypeError(f"return_lse must be True or False, got {return_lse!r}")
    m = as_mask(mask)
    if m is not None:
        m.check(B, H, Sq, Sk, q.device)
    return AttentionCall(q, k, v, m, float(scale), float(dropout_p),
                         bool(return_weights), bool(return_lse),
                         average_weights=weights_mean(return_weights))


def weights_mean(return_weights) -> bool:
    """Whether ``return_weights`` asks for the weights' mean over the heads (``"mean"``).

    Example:
        >>> weights_mean("mean"), weights_mean(True)
        (True, False)
    """
    return isinstance(return_weights, str) and return_weights == "mean"

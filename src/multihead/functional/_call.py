"""Validation of an attention call, and the facts about it that backends decide on.

Every user mistake is caught here, before any backend runs, with a message that names the
argument, shows the bad shape or value, and says how to fix it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .. import masks as M

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def shape_str(t: torch.Tensor) -> str:
    return "(" + ", ".join(str(s) for s in t.shape) + ")"


def _check_tensor(name: str, t, legend: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {legend}, got {type(t).__name__}")
    if t.dim() != 4:
        hint = (" (for (B, S, E) inputs use multihead.MultiHeadAttention, or split heads with "
                "x.view(B, S, H, D).transpose(1, 2))" if t.dim() == 3 else "")
        raise ValueError(f"{name} must be 4-D {legend}, got shape {shape_str(t)}{hint}")
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
                        f"float tensor (additive bias), or a multihead.masks object")
    raise TypeError(f"mask must be a multihead.masks object, a bool/float tensor or None, got "
                    f"{type(mask).__name__}")


#: tile maps of tensor-free masks (causal, sliding windows), keyed by what determines them
_SHARED_TILE_MAPS: dict = {}


@dataclass
class AttentionCall:
    """A validated attention call: the inputs plus derived sizes and mask facts."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: M.Mask | None
    scale: float
    dropout_p: float
    return_weights: bool
    return_lse: bool
    B: int = field(init=False)
    H: int = field(init=False)
    Hkv: int = field(init=False)
    Sq: int = field(init=False)
    Sk: int = field(init=False)
    D: int = field(init=False)
    Dv: int = field(init=False)

    def __post_init__(self):
        self.B, self.H, self.Sq, self.D = self.q.shape
        self.Hkv, self.Sk, self.Dv = self.k.shape[1], self.k.shape[2], self.v.shape[3]

    @property
    def group(self) -> int:
        """Query heads per K/V head (1 for MHA, H for MQA)."""
        return self.H // self.Hkv

    @property
    def requires_grad(self) -> bool:
        bias_grad = self.mask is not None and self.mask.requires_grad
        return torch.is_grad_enabled() and (
            self.q.requires_grad or self.k.requires_grad or self.v.requires_grad or bias_grad)

    @property
    def dense_work(self) -> float:
        """Multiply-adds of dense attention, B*H*Sq*Sk*(D+Dv): the unit of the cost model."""
        return float(self.B * self.H * self.Sq * self.Sk * (self.D + self.Dv))

    def memo(self, name: str, compute):
        """A fact derived from this call, computed once (backends cache their analyses here)."""
        if name not in self.__dict__:
            self.__dict__[name] = compute()
        return self.__dict__[name]

    @property
    def effective_mask(self) -> M.Mask | None:
        """The mask, or None when it allows every pair and adds no bias (e.g. causal at Sq=1)."""
        def compute():
            m = self.mask
            if isinstance(m, M.Window) and m.size is None:
                # causal allows everything iff the first query already sees the last key
                off = self.Sk - self.Sq if m.align == "lower_right" else 0
                m = None if self.Sk - 1 <= off else m
            return m
        return self.memo("_effective", compute)

    @property
    def is_pure_causal(self) -> bool:
        m = self.effective_mask
        return isinstance(m, M.Window) and m.size is None

    def tile_map(self, tile_q: int, tile_k: int) -> M.TileMap:
        """The mask's tile classification for this call (cached per tile size; masks made of
        no tensors, such as causal and sliding windows, also across calls)."""
        cache = self.__dict__.setdefault("_tile_maps", {})
        key = (tile_q, tile_k)
        if key not in cache:
            m = self.effective_mask
            shared = None if m._tensors() else (m.describe(), self.Sq, self.Sk, tile_q, tile_k,
                                                str(self.q.device))
            if shared is not None and shared in _SHARED_TILE_MAPS:
                cache[key] = _SHARED_TILE_MAPS[shared]
            else:
                cache[key] = m.tiles(self.Sq, self.Sk, tile_q=tile_q, tile_k=tile_k,
                                     device=self.q.device)
                if shared is not None:
                    if len(_SHARED_TILE_MAPS) >= 256:
                        _SHARED_TILE_MAPS.pop(next(iter(_SHARED_TILE_MAPS)))
                    _SHARED_TILE_MAPS[shared] = cache[key]
        return cache[key]


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
        raise ValueError(f"batch sizes differ: q {shape_str(q)}, k {shape_str(k)}, v {shape_str(v)} "
                         f"(dim 0 must match)")
    if D != Dk:
        raise ValueError(f"head_dim of q ({D}) and k ({Dk}) must match: q {shape_str(q)}, "
                         f"k {shape_str(k)}")
    if Hkv != Hv or Sk != Skv:
        raise ValueError(f"k {shape_str(k)} and v {shape_str(v)} must agree on heads (dim 1) and "
                         f"sequence length (dim 2)")
    if Hkv == 0 or H % Hkv != 0:
        divisors = [d for d in range(1, H + 1) if H % d == 0]
        raise ValueError(f"q has {H} heads and k/v have {Hkv}: the number of query heads must be "
                         f"a multiple of the K/V heads (GQA); K/V heads could be one of {divisors}")
    if D == 0:
        raise ValueError(f"head_dim must be positive, got q {shape_str(q)}")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    else:
        if isinstance(scale, torch.Tensor) and scale.numel() == 1:
            scale = float(scale)
        if isinstance(scale, bool) or not isinstance(scale, (int, float)):
            raise TypeError(f"scale must be a float, got {type(scale).__name__}")
        if not math.isfinite(scale) or scale <= 0:
            raise ValueError(f"scale must be finite and > 0, got {scale} (default: 1/sqrt(D) = "
                             f"{1 / math.sqrt(D):.4g})")
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, (int, float)) or not (0.0 <= dropout_p < 1.0):
        raise ValueError(f"dropout_p must be a float in [0, 1), got {dropout_p!r}")
    m = as_mask(mask)
    if m is not None:
        m.check(B, H, Sq, Sk, q.device)
    return AttentionCall(q, k, v, m, float(scale), float(dropout_p),
                         bool(return_weights), bool(return_lse))

"""Masks that wrap tensors (``dense``, ``bias``) and the ALiBi bias.

``dense`` is the escape hatch for any pattern: a bool tensor broadcastable to
``(B, H, Sq, Sk)``. ``bias`` is an additive float term (``-inf`` entries mean "masked");
``alibi`` is the linear distance bias of Press et al. (2022), computed on the fly.
"""

from __future__ import annotations

import math

import torch

from .._args import positive_int
from .._dtypes import check_strided
from .._device import to_device
from .._tracing import concrete, shape_text, tracing
from .base import Index, Mask, TileIndex, grid_shape, range_of


def _as_4d(t: torch.Tensor, name: str) -> torch.Tensor:
    check_strided(name, t)
    if t.dim() == 0 or t.dim() > 4:
        raise ValueError(f"{name} must have 1 to 4 dims broadcastable to (B, H, Sq, Sk), "
                         f"got shape {shape_text(t)}")
    return t.reshape((1,) * (4 - t.dim()) + tuple(t.shape))             # (B|1, H|1, Sq|1, Sk|1)


def _gather4(t: torch.Tensor, ix: Index) -> torch.Tensor:
    """``t[b, h, q, k]`` for a 4-D tensor whose size-1 dims broadcast (a half-precision
    ``t`` that takes a gradient is read as float32, so that its gradient is summed over the
    broadcast in float32, not in its dtype; the values are the same).

    Where each index is a range of its dim (:func:`.base.axis_range`: :meth:`Mask.index`'s
    grid, a row's keys) or the dim broadcasts, the result is a slice of ``t``, expanded: a
    view that shares its memory, to read, never to write into (a gather took 2.7 ns per
    entry on a CPU: 11 ms for one 2048 x 2048 grid).
    """
    axes = (ix.b, ix.h, ix.q, ix.k)
    if t.dtype in (torch.float16, torch.bfloat16) and t.requires_grad and torch.is_grad_enabled():
        t = t.float()
    t = t.to(ix.q.device)
    spans = [range_of(i, d) for d, i in enumerate(axes)]
    if all(i.dim() == 4 for i in axes) and all(
            n == 1 or (s is not None and s[1] <= n) for s, n in zip(spans, t.shape)):
        for d, (s, n) in enumerate(zip(spans, t.shape)):
            if n > 1 and (s[0] or s[1] != n):           # (a dim read whole: not narrowed)
                t = t.narrow(d, s[0], s[1] - s[0])
        # (every index a range, as Mask.index makes them: the grid is their lengths)
        grid = [s[1] - s[0] for s in spans] if None not in spans else \
            grid_shape(*(i.shape for i in axes))
        return t.expand(grid)                                               # (B', H', Sq, Sk)
    # a broadcast (size-1) dim reads index 0; ``i * 0`` keeps the index's rank
    idx = [i if n > 1 else i * 0 for i, n in zip(axes, t.shape)]
    return t[idx[0], idx[1], idx[2], idx[3]]


def _tile_reduce(allowed: torch.Tensor, tile_q: int, tile_k: int):
    """Per-tile any/all of a 4-D bool tensor (size-1 dims stay size 1)."""
    b, h, sq, sk = allowed.shape
    tq = tile_q if sq > 1 else 1
    tk = tile_k if sk > 1 else 1
    nq, nk = -(-sq // tq), -(-sk // tk)
    x = allowed.to(torch.int8)
    # pad with -1: ignored by max (any) and by min-over-ones trick below
    x = torch.nn.functional.pad(x, (0, nk * tk - sk, 0, nq * tq - sq), value=-1)
    x = x.view(b, h, nq, tq, nk, tk)                                   # (B', H', nQ, tq, nK, tk)
    any_ = x.amax(dim=(3, 5)) == 1
    all_ = x.masked_fill(x == -1, 1).amin(dim=(3, 5)) == 1
    return any_, all_


def _check_broadcast(mask: Mask, t: torch.Tensor, batch, heads, sq, sk) -> None:
    want = (batch, heads, sq, sk)
    if any(n != 1 and n != w for n, w in zip(t.shape, want)):     # (symbolic sizes: no `in`)
        hint = ""
        if t.shape[:2] == (1, 1) and t.shape[2] == batch and t.shape[3] == sk:
            hint = "; a (B, Sk) key padding " + (
                "mask goes in as mh.masks.padding(mask) (True = real token) or as "
                if t.dtype == torch.bool else "bias goes in as ") + "mask[:, None, None, :]"
        wrong = ", ".join(f"{name} {n} where the inputs have {concrete(w)}" for name, n, w in
                          zip(("B", "H", "Sq", "Sk"), t.shape, want) if n != 1 and n != w)
        raise ValueError(f"mask: {mask.describe()} does not broadcast to (B, H, Sq, Sk) = "
                         f"{tuple(map(concrete, want))} ({wrong}): each dim must be 1 or equal "
                         f"to the inputs'{hint}")


def _own_dim(t: torch.Tensor, dim: int) -> int | None:
    """The batch (``dim`` 0) or head (1) count a (B|1, H|1, Sq|1, Sk|1) tensor is built for,
    None where it broadcasts; read from the tensor as it is (one assigned in place of a
    mask's own is followed)."""
    return t.shape[dim] if t.shape[dim] > 1 else None


def _broadcasts(t: torch.Tensor) -> tuple:
    """A (B|1, H|1, Sq|1, Sk|1) tensor's part in a mask's structure: its batch and heads,
    and whether it broadcasts over Sq and Sk (a length that does not is the call's, which
    the call's structure holds within a factor of 2: a growing cache's steps share a
    choice)."""
    b, h, sq, sk = t.shape
    return b, h, sq == 1, sk == 1


class _RowsRead(Mask):
    """A tensor mask whose host tensor is read for rows with nothing to attend to: its
    :meth:`_read_facts` sets ``_live`` (every row has a key; None: unknown) and stamps it.
    Writes in place are followed (read again); writes through ``.data`` or a shared numpy
    array are not seen (as by :meth:`~multihead.masks.Mask.cached`): build a new mask. A
    subclass's rows, and every row while ``torch.compile`` traces (a graph is kept for
    later calls, whose tensors it cannot read), are opened where empty."""

    _live = None

    def may_have_empty_rows(self, sq, sk):
        if sq > 0 and sk == 0 or not self.memoizable or tracing():
            return True
        return not self._fact("_live")


class Dense(_RowsRead):
    """Any pattern, as a bool tensor broadcastable to (B, H, Sq, Sk); True = may attend.

    Whether a row of a host (CPU) tensor allows no key is read at its first call (and again
    after a write into it), so that backends open and zero rows only where there are such
    rows; a device tensor is not read (that would synchronize), and its rows are opened.
    """

    kind = "dense"
    _immutable = True
    _own_tensors = False                  # (the caller's tensor, not a copy)
    _banded = True

    def __init__(self, allowed: torch.Tensor):
        if not isinstance(allowed, torch.Tensor):
            raise TypeError(f"dense() takes a bool tensor, got {type(allowed).__name__}")
        if allowed.dtype != torch.bool:
            raise TypeError(
                f"dense() takes a bool tensor (True = may attend), got dtype {allowed.dtype}: "
                f"use mask > 0 for a 0/1 tensor, or multihead.masks.bias(t) for additive floats")
        self.t = _as_4d(allowed, "dense mask")

    def _read_facts(self, check: bool = True) -> None:
        # whether every row allows a key (a row broadcast over the keys: its one entry)
        t = self.t
        self._live = read_back(t, lambda: t.shape[-1] > 0 and bool(t.any(dim=-1).all()))
        if self._live is not None:
            self._stamp()

    batch_size = property(lambda self: _own_dim(self.t, 0))
    num_heads = property(lambda self: _own_dim(self.t, 1))

    def _tensors(self):
        return [self.t]

    def _to(self, device):
        return self._moved(device, "t")

    def structure(self):
        return ("dense", _broadcasts(self.t)) if self.memoizable else None

    def describe(self):
        return f"dense(shape {shape_text(self.t)})"

    def _preview_size(self):        # the tensor's own lengths (repr says when too large)
        return self.t.shape[2], self.t.shape[3]

    def _preview_cap(self):
        return _cap(self.t)

    _lengths = _preview_cap         # a dim the tensor does not broadcast is a call's length

    def _check(self, batch, heads, sq, sk):
        _check_broadcast(self, self.t, batch, heads, sq, sk)

    def _allowed(self, ix: Index):
        return _gather4(self.t, ix)

    def _tile_bounds(self, tx: TileIndex):
        return tuple(map(tx.cols, _tile_reduce(self.t.to(tx.q0.device), tx.tile_q, tx.tile_k)))


def _cap(t: torch.Tensor) -> tuple[int | None, int | None]:
    """A 4-D tensor's (Sq, Sk) where it does not broadcast."""
    return tuple(n if n > 1 else None for n in t.shape[2:])


def dense(allowed: torch.Tensor) -> Dense:
    """Wrap a bool tensor broadcastable to ``(B, H, Sq, Sk)`` (True = may attend).

    Example:
        >>> import torch, multihead as mh
        >>> m = mh.masks.dense(torch.tensor([[True, False], [True, True]]))
        >>> m.materialize(2, 2)[0, 0].int().tolist()
        [[1, 0], [1, 1]]
    """
    return Dense(allowed)


class Bias(_RowsRead):
    """An additive float bias; ``-inf`` entries are masked. Gradients flow to the bias.

    Every backend adds it to float32 scores at the bias's own precision (never rounded to
    half-precision inputs first); finite values, however negative (``finfo(dtype).min``),
    are numbers, not masks: a float64 value past the scores' range saturates at their most
    negative number (a row of it is uniform), never ``-inf``.

    The mask reads its tensor as it is at each call (a learned bias may be updated in place
    between calls, and gradients reach it every time). A host (CPU) bias is checked for NaN
    and +inf when the mask is built (not while ``torch.compile`` traces, where reading it
    would break the graph, nor under ``vmap`` or a fake-tensor mode, where its values
    cannot be read); a GPU bias is not read (that would synchronize), so a
    NaN or +inf in it gives NaN rows on every backend, as in torch.

    The same pass over a host bias (each row's largest value) tells whether a row is
    ``-inf`` everywhere (:meth:`may_have_empty_rows`); while no row is, and the tensor is
    not written in place, backends pass it to their kernels as it is (SDPA takes it as its
    ``attn_mask``, with no predicate split off and joined back).
    """

    kind = "bias"
    has_bias = True
    has_predicate = True          # -inf entries mask
    _immutable = True
    _own_tensors = False                  # (the caller's tensor, not a copy)
    _banded = True

    def __init__(self, values: torch.Tensor):
        if not isinstance(values, torch.Tensor) or not values.is_floating_point():
            what = values.dtype if isinstance(values, torch.Tensor) else type(values).__name__
            raise TypeError(f"bias() takes a floating-point tensor, got {what}: use "
                            f"multihead.masks.dense(t) for bool masks")
        t = _as_4d(values, "bias")
        self.raw = t                                           # (B|1, H|1, Sq|1, Sk|1)
        if t.device.type == "cpu" and not tracing() and self._read_facts():
            bad = (torch.isnan(values) | torch.isposinf(values)).nonzero()
            at = tuple(bad[0].tolist())
            raise ValueError(f"bias contains NaN or +inf ({len(bad)} of {values.numel()} values; "
                             f"the first at index {at}: {values[at].item()}): only finite values "
                             f"and -inf (masked) are allowed: mask a pair with -inf, e.g. "
                             f"torch.where(bias.isnan(), float('-inf'), bias), and give +inf a "
                             f"finite value")

    def _read_facts(self, check: bool = True) -> bool:
        # One pass: each row's largest value is NaN where the row holds a NaN (max keeps
        # it), +inf where it holds +inf, -inf where every entry is -inf. Sets whether every
        # row has a finite entry (None: the values cannot be read now) and returns whether
        # a NaN or +inf was seen (which the constructor refuses, naming the entry).
        peaks = read_back(self.raw, lambda: _row_peaks(self.raw))
        if peaks is None:                                  # (vmap, fake tensors: unknown)
            self._live = None
            return False
        self._live = not peaks[1]
        self._stamp()
        return peaks[0]

    def _additive_at(self, ix, dtype):
        if self._as_it_is(dtype):
            return _gather4(self.raw, ix).to(dtype)
        return super()._additive_at(ix, dtype)

    def _additive_view(self, dtype):
        return self.raw.dtype == dtype and self._as_it_is(dtype)

    def _as_it_is(self, dtype) -> bool:
        # whether the tensor, -inf and all, is its own additive form in ``dtype``: ``dtype``
        # holds each of its values exactly, and its keys lie along its last dim in memory
        # order (not broadcast, not strided), the layout fused kernels read a mask in; not
        # for a subclass, whose _bias or _allowed may read it otherwise
        t = self.raw
        return self.memoizable and torch.promote_types(t.dtype, dtype) == dtype and \
            t.shape[-1] > 1 and t.stride(-1) == 1

    batch_size = property(lambda self: _own_dim(self.raw, 0))
    num_heads = property(lambda self: _own_dim(self.raw, 1))

    @property
    def values(self) -> torch.Tensor:
        """The finite part of the bias (``-inf`` entries as 0), as the tensor is now."""
        return self.raw.masked_fill(torch.isneginf(self.raw), 0.0)

    def _tensors(self):
        return [self.raw]

    def _to(self, device):
        return self._moved(device, "raw")

    def structure(self):
        return ("bias", _broadcasts(self.raw), self.raw.dtype) if self.memoizable else None

    def describe(self):
        return f"bias(shape {shape_text(self.raw)})"

    def _preview_size(self):        # the tensor's own lengths (repr says when too large)
        return self.raw.shape[2], self.raw.shape[3]

    def _preview_cap(self):
        return _cap(self.raw)

    _lengths = _preview_cap         # a dim the tensor does not broadcast is a call's length

    def _check(self, batch, heads, sq, sk):
        _check_broadcast(self, self.raw, batch, heads, sq, sk)

    def _allowed(self, ix):                    # gather first: a tile reads its entries only
        return ~torch.isneginf(_gather4(self.raw, ix))

    def _tile_bounds(self, tx):
        allowed = ~torch.isneginf(self.raw.to(tx.q0.device))
        return tuple(map(tx.cols, _tile_reduce(allowed, tx.tile_q, tx.tile_k)))

    def _bias(self, ix):
        b = _gather4(self.raw, ix)
        return b.masked_fill(torch.isneginf(b), 0.0)


def bias(values: torch.Tensor) -> Bias:
    """An additive bias broadcastable to ``(B, H, Sq, Sk)``; ``-inf`` entries are masked.

    Example:
        >>> import torch, multihead as mh
        >>> b = mh.masks.bias(torch.tensor([[0.0, float("-inf")], [0.5, 0.0]]))
        >>> b.materialize(2, 2)[0, 0].int().tolist()
        [[1, 0], [1, 1]]
    """
    return Bias(values)


def _row_peaks(t: torch.Tensor) -> tuple[bool, bool]:
    """``(NaN or +inf anywhere, some row -inf everywhere)`` of a ``(B, H, Sq, Sk)`` tensor,
    from one pass (each row's maximum: 2.3-4 ms for 8 x 2048 x 2048 on a 2-core CPU, where
    ``isnan(t).any()`` and ``isposinf(t).any()`` took 31-116, their bool buffers mapped fresh).

    Example:
        >>> inf = float("inf")
        >>> _row_peaks(torch.tensor([[[[0.0, -inf], [-inf, -inf]]]]))
        (False, True)
        >>> _row_peaks(torch.tensor([[[[1.0, float("nan")]]]]))
        (True, False)
    """
    with torch.no_grad():
        peaks = t.amax(dim=-1) if t.shape[-1] else t.new_full(t.shape[:-1], -math.inf)
        return bool((peaks.isnan() | peaks.isposinf()).any()), bool(peaks.isneginf().any())


def read_back(t: torch.Tensor, read):
    """``read()``, facts of ``t``'s values on the host; None where they cannot be read now (a
    tensor batched by ``torch.func.vmap``, a fake tensor): such a tensor is not checked, as
    a GPU one is not.

    Shapes:
        ``t`` any; ``read`` reads it (or anything derived from it).

    Example:
        >>> from torch._subclasses.fake_tensor import FakeTensorMode
        >>> t = torch.ones(2)
        >>> read_back(t, lambda: bool(t.all()))
        True
        >>> with FakeTensorMode():
        ...     f = torch.ones(2)
        ...     print(read_back(f, lambda: bool(f.all())))
        None
    """
    try:
        return read()
    except RuntimeError:
        from torch._subclasses.fake_tensor import is_fake
        if torch._C._are_functorch_transforms_active() or is_fake(t):
            return None
        raise


def read_free(t: torch.Tensor, read):
    """``read()`` where reading ``t``'s values back costs nothing: a CPU tensor, outside
    ``torch.compile``; None elsewhere (a device, where a read stalls its queue; a traced,
    batched or fake tensor, see :func:`read_back`).

    Shapes:
        ``t`` any; ``read`` reads it (or anything derived from it).

    Example:
        >>> t = torch.tensor([1.0, float("-inf")])
        >>> read_free(t, lambda: bool(t.isneginf().any()))
        True
    """
    if t.device.type != "cpu" or tracing():
        return None
    return read_back(t, read)


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """ALiBi's per-head slopes (Press et al. 2022), the geometric sequence ``2^(-8i/n)``.

    For a head count that is not a power of two, the slopes of the next lower power of
    two are followed by every other slope of the next higher one, as in the paper's code.

    Example:
        >>> import multihead as mh
        >>> mh.masks.alibi_slopes(4).tolist()
        [0.25, 0.0625, 0.015625, 0.00390625]
    """
    return torch.tensor(_slope_values(_check_heads("alibi_slopes", num_heads)),
                        dtype=torch.float32)


#: more heads than any attention call holds (the slopes are a Python tuple, one per head)
MAX_ALIBI_HEADS = 2 ** 20


def _check_heads(fn: str, num_heads) -> int:
    n = positive_int(f"{fn}: num_heads", num_heads)
    if n > MAX_ALIBI_HEADS:          # (2**40 heads built a list of 2**40 floats, for hours)
        raise ValueError(f"{fn}: num_heads must be at most {MAX_ALIBI_HEADS}, got {n}: pass the "
                         f"number of heads of your attention (H of its (B, H, S, D) queries)")
    return n


def _slope_values(num_heads: int) -> list[float]:
    # Python floats (powers of two, exact in fp32): no tensor, so that a mask built while
    # torch.compile traces needs no read of one
    def pow2(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start * start ** i for i in range(n)]

    if math.log2(num_heads).is_integer():
        return pow2(num_heads)
    closest = 2 ** math.floor(math.log2(num_heads))
    return pow2(closest) + pow2(2 * closest)[0::2][: num_heads - closest]


class ALiBi(Mask):
    """Bias ``-slope_h * |(q + offset) - k|``: a penalty linear in distance, per head."""

    kind = "alibi"
    has_bias = True
    has_predicate = False
    _immutable = True

    def __init__(self, num_heads: int, align: str = "lower_right"):
        from .structured import _check_align
        self._heads, self._align = _check_heads("alibi", num_heads), _check_align(align)
        self._slopes = tuple(_slope_values(self._heads))

    @property
    def num_heads(self) -> int:
        """H, the heads the slopes are for. Read-only."""
        return self._heads

    @property
    def align(self) -> str:
        return self._align

    @property
    def slopes(self) -> torch.Tensor:
        """The per-head slopes ``(H,)`` (a fresh tensor: changing it changes no mask)."""
        return torch.tensor(self._slopes, dtype=torch.float32)

    def describe(self):
        return f"alibi({self.num_heads}, align={self.align!r})"

    def cache_key(self):
        return ("alibi", self._heads, self._align) if type(self) is ALiBi else None

    def _bias(self, ix: Index):
        from .structured import _offset
        wide = ix.dtype == torch.float64          # slopes such as 2^(-1/2), exact in it
        slopes = self.cached("slopes", (str(ix.q.device), wide), lambda: to_device(
            torch.tensor(self._slopes, dtype=torch.float64 if wide else torch.float32,
                         device="cpu"), ix.q.device))                         # (H,)
        # |d| converted once (as the product would convert it for every head: the same values)
        dist = (ix.q + _offset(self.align, ix.sq, ix.sk) - ix.k).abs_().to(slopes.dtype)
        h = ix.h if self.num_heads > 1 else ix.h * 0    # one slope broadcasts to every head
        return -slopes[h] * dist

    def __repr__(self):
        sl = ", ".join(f"{s:.4g}" for s in self._slopes[:4])
        return f"{self.describe()}: slopes [{sl}{', ...' if self.num_heads > 4 else ''}]"


def alibi(num_heads: int, *, align: str = "lower_right") -> ALiBi:
    """ALiBi additive bias for ``num_heads`` heads; combine with ``causal()`` for decoders.

    Example:
        >>> import multihead as mh
        >>> mh.masks.alibi(2).additive(1, 3)[0, :, 0].tolist()
        [[-0.125, -0.0625, 0.0], [-0.0078125, -0.00390625, 0.0]]
    """
    return ALiBi(num_heads, align)

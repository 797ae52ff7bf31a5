"""The mask model: small objects that say which keys each query may attend to.

One convention everywhere: ``True`` means *may attend*. A mask is a predicate over
``(batch, head, query, key)`` index tensors (like FlexAttention's ``mask_mod``), optionally
with an additive bias (ALiBi, relative-position biases). Because a mask is a predicate and
not a tensor, kernels evaluate it only on the tiles they compute, and :meth:`Mask.tiles`
classifies ``(query tile, key tile)`` pairs as empty, partial or full without ever building
the ``(Sq, Sk)`` matrix, so work a mask rules out is skipped.

Tile classification is *sound*, never optimistic: a tile reported ``EMPTY`` has no allowed
pair and a tile reported ``FULL`` has only allowed pairs; anything in doubt is ``PARTIAL``
(which costs a little work, never a wrong answer).

Notation used for tensor shapes:
    B: batch, H: query heads, Sq: queries, Sk: keys, nQ/nK: query/key tiles.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import math
from dataclasses import dataclass

import torch
from torch.utils.weak import WeakIdKeyDictionary

from .._cache import BoundedCache
from .. import _device as devices
from .._device import to_device
from .._args import positive_int
from .._dtypes import check_dtype
from .._tracing import concrete, tracing

EMPTY, PARTIAL, FULL = 0, 1, 2

#: facts derived from masks that are fully determined by their cache_key(), shared by calls
_SHARED = BoundedCache(max_entries=256, max_bytes=64 << 20)
#: the same for facts kept on one mask object (tensor masks), per object
_MEMO_ENTRIES, _MEMO_BYTES = 64, 32 << 20
#: a pickled mask's stamp (see Mask.__getstate__): its host facts held when it was copied
_FACTS_HELD = "held when copied"


@dataclass(frozen=True)
class Index:
    """Broadcastable int64 index tensors handed to a mask's predicate.

    ``b``, ``h``, ``q``, ``k`` all have the same rank and broadcast against each other;
    ``sq`` and ``sk`` are the logical query and key lengths of the call (for alignment);
    ``dtype`` is the scores' (float32, or float64 for float64 inputs): a bias computed from
    exact values (ALiBi's slopes, a sum of biases) is computed at least that precisely.
    """

    b: torch.Tensor
    h: torch.Tensor
    q: torch.Tensor
    k: torch.Tensor
    sq: int
    sk: int
    dtype: torch.dtype = torch.float32


def axis_range(start: int, stop: int, dim: int, device) -> torch.Tensor:
    """``arange(start, stop)`` along ``dim`` of a 4-D index (1 elsewhere), marked as that
    range: a tensor mask indexed by it reads a slice of the dim, with no gather (see
    :func:`range_of`).

    Example:
        >>> t = axis_range(2, 5, 3, "cpu")
        >>> tuple(t.shape), range_of(t, 3), range_of(t + 0, 3)
        ((1, 1, 1, 3), (2, 5), None)
    """
    shape = [1, 1, 1, 1]
    shape[dim] = stop - start
    t = torch.arange(start, stop, device=device).view(shape)        # (n at dim, 1 elsewhere)
    if not tracing():    # (traced: no attributes on a graph's tensors)
        t._multihead_range = (dim, start, stop, _version(t))
    return t


#: the axes of recent index grids, by (sizes, device): a small call's grid took 20 us to
#: make (four aranges, marked), a fifth of the call's time beside its kernel
_GRIDS = BoundedCache(max_entries=64, max_bytes=1 << 20)


def _grid_axes(sizes: tuple, device: torch.device, keep: bool = True) -> tuple:
    """The four :func:`axis_range` axes ``(b, h, q, k)`` of a grid of ``sizes``: with
    ``keep``, kept between calls where the sizes are ints, outside ``torch.compile`` and
    any ``TorchDispatchMode`` (a fake tensor's mode, say: its tensors hold no values);
    one written into since is made again, and they are made as normal tensors in inference
    mode (an inference tensor could not be saved for a backward outside it).

    Example:
        >>> a = _grid_axes((2, 1, 3, 4), torch.device("cpu"))
        >>> [tuple(t.shape) for t in a], a[3] is _grid_axes((2, 1, 3, 4), torch.device("cpu"))[3]
        ([(2, 1, 1, 1), (1, 1, 1, 1), (1, 1, 3, 1), (1, 1, 1, 4)], True)
    """
    if (not keep or tracing() or torch._C._len_torch_dispatch_stack()
            or not all(type(n) is int for n in sizes)):
        return tuple(axis_range(0, n, dim, device) for dim, n in enumerate(sizes))
    key = (sizes, device)
    axes = _GRIDS.get(key)
    if axes is None or any(range_of(t, dim) is None for dim, t in enumerate(axes)):
        with torch.inference_mode(False):
            axes = tuple(axis_range(0, n, dim, device) for dim, n in enumerate(sizes))
        _GRIDS.put(key, axes)
    return axes


def _version(t: torch.Tensor) -> int | None:
    """``t``'s version counter; None for an inference tensor, which has none."""
    return None if t.is_inference() else t._version


def grid_shape(*shapes) -> list:
    """The shape that shapes of one rank which broadcast together take: in each dim the
    size other than 1, if any (0 included). :func:`torch.broadcast_shapes` without its
    import of sympy on first use (0.35 s) or its cost per call (70 us, a third of a small
    call).

    Example:
        >>> grid_shape((2, 1, 5, 1), (1, 1, 1, 7), (2, 1, 1, 1))
        [2, 1, 5, 7]
    """
    return [next((n for n in sizes if n != 1), 1) for sizes in zip(*shapes)]


def range_of(t: torch.Tensor, dim: int) -> tuple[int, int] | None:
    """``(start, stop)`` where index ``t`` is :func:`axis_range` along ``dim``, unchanged
    since it was made (an index sliced, copied or written in place is not); else None.

    Example:
        >>> t = axis_range(0, 4, 2, "cpu")                                # (1, 1, 4, 1)
        >>> range_of(t, 2), range_of(t, 3), range_of(t[:, :, 1:], 2)
        ((0, 4), None, None)
    """
    if tracing():        # (traced: marks are not read, as not made)
        return None
    mark = getattr(t, "_multihead_range", None)
    if mark is None or mark[0] != dim or mark[3] != _version(t):
        return None
    return mark[1], mark[2]


_SERIALS = WeakIdKeyDictionary()
_NEXT_SERIAL = itertools.count()


def _serial(t: torch.Tensor) -> int:
    """A number of ``t``'s own for as long as this process runs (``id()`` is reused once a
    tensor is freed: a new tensor assigned in place of a mask's old one could match the old
    one's cached facts by its id and a fresh version counter)."""
    n = _SERIALS.get(t)
    if n is None:
        n = _SERIALS[t] = next(_NEXT_SERIAL)
    return n


@dataclass(frozen=True)
class TileIndex:
    """First and last query/key index of every tile, shaped to broadcast to (B, H, nQ, nK).

    A *banded* index (``kt`` set) names, for each query tile, only the ``W`` key tiles its
    band may reach: ``k0``/``k1`` are then ``(1, 1, nQ, W)`` and a bound computed per key tile
    (a ``(..., nK)`` tensor) is read through :meth:`cols`.
    """

    b: torch.Tensor   # (B, 1, 1, 1) or (1, 1, 1, 1)
    h: torch.Tensor   # (1, H, 1, 1) or (1, 1, 1, 1)
    q0: torch.Tensor  # (1, 1, nQ, 1)
    q1: torch.Tensor  # (1, 1, nQ, 1), inclusive, clamped to Sq - 1
    k0: torch.Tensor  # (1, 1, 1, nK)
    k1: torch.Tensor  # (1, 1, 1, nK), inclusive, clamped to Sk - 1
    sq: int
    sk: int
    tile_q: int
    tile_k: int
    kt: torch.Tensor | None = None  # (1, 1, nQ, W) key tile of each column when banded

    def cols(self, t: torch.Tensor) -> torch.Tensor:
        """A bound of one value per key tile, ``(B', H', nQ or 1, nK or 1)``, at this index's
        columns: as it is, or read at each query tile's key tiles when banded."""
        if self.kt is None or t.shape[-1] == 1:
            return t
        b, h, _, nk = t.shape
        n, w = self.kt.shape[2:]
        return t.expand(b, h, n, nk).gather(-1, self.kt.expand(b, h, n, w))  # (B', H', nQ, W)


@dataclass(frozen=True)
class TileMap:
    """Classification of every ``(query tile, key tile)`` pair of a call.

    Attributes:
        state: int8 tensor ``(B', H', nQ, nK)`` with ``EMPTY`` (0), ``PARTIAL`` (1) or
            ``FULL`` (2); ``B'`` is 1 when the mask does not depend on the batch, ``H'``
            likewise for heads.
        tile_q, tile_k: the tile sizes.
        sq, sk: the sequence lengths.
        key_tiles: None, or for a *banded* map (kept by the kernels' planners, never
            returned by :meth:`Mask.tiles`) the key tile of each column, ``(nQ, W)``:
            ``state`` is then ``(B', H', nQ, W)``, and every key tile a query tile's row
            does not name is EMPTY.

    Example:
        >>> import multihead as mh
        >>> tm = mh.masks.causal().tiles(256, 256, tile_q=64, tile_k=64)
        >>> tm.state[0, 0].tolist()[1]
        [2, 1, 0, 0]
        >>> round(tm.density, 3)
        0.625
    """

    state: torch.Tensor
    tile_q: int
    tile_k: int
    sq: int
    sk: int
    key_tiles: torch.Tensor | None = None

    @property
    def density(self) -> float:
        """Fraction of tile pairs that must be computed (partial or full)."""
        total = self._pairs()
        return int((self.state != EMPTY).sum()) / total if total else 0.0

    def counts(self) -> dict[str, int]:
        """Number of empty, partial and full tile pairs."""
        partial, full = (int((self.state == code).sum()) for code in (PARTIAL, FULL))
        return {"empty": self._pairs() - partial - full, "partial": partial, "full": full}

    def _pairs(self) -> int:
        """All ``B' x H' x nQ x nK`` tile pairs, a banded map's unnamed key tiles included."""
        if self.key_tiles is None:
            return self.state.numel()
        b, h, nq, _ = self.state.shape
        return b * h * nq * -(-self.sk // self.tile_k)


def versioned():
    """A context in which new tensors keep a version counter, also inside
    ``torch.inference_mode()`` (whose tensors keep none): the copies a mask keeps of its
    tensors are made in it, so writes into them are seen (:meth:`Mask._facts_hold`).

    Example:
        >>> import torch
        >>> with torch.inference_mode(), versioned():
        ...     torch.zeros(2).is_inference()
        False
    """
    if not tracing() and torch.is_inference_mode_enabled():
        return torch.inference_mode(False)
    return contextlib.nullcontext()


def _outside_transforms(mask: "Mask", compute):
    """``compute`` for :meth:`Mask.cached` inside a ``torch.func`` transform: run outside
    it where the mask's tensors are plain (what it makes is then plain too, fit to keep for
    later calls; inside, each op's result is wrapped at the transform's level, and a
    wrapped tensor kept would escape it), else as it is (the cache keeps nothing wrapped)."""
    if any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in mask._tensors()):
        return compute

    def plain():
        with torch._C._DisableFuncTorch():
            return compute()
    return plain


def bias_sum(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``a + b`` (finite biases) at the widest of their precisions and ``dtype`` (the
    scores'), saturating at that dtype's largest magnitude: two biases in half precision
    are not rounded to it, and two ``finfo.min`` add to a number, not ``-inf``. Only an
    overflow saturates: a ``+inf`` (or NaN) entry of either, which a device bias may hold
    (it is never scanned), sums to NaN, so its row is NaN as with one bias.

    Example:
        >>> import torch
        >>> m = torch.tensor([torch.finfo(torch.float16).min], dtype=torch.float16)
        >>> bias_sum(m, m, torch.float32).tolist(), bias_sum(m, m, torch.float32).dtype
        ([-131008.0], torch.float32)
        >>> big = torch.tensor([-3e38])
        >>> bias_sum(big, big, torch.float32).tolist()
        [-3.4028234663852886e+38]

    Shapes:
        ``a`` and ``b`` broadcast; the result has their broadcast shape.
    """
    wide = torch.promote_types(torch.promote_types(a.dtype, b.dtype),
                               torch.promote_types(dtype, torch.float32))
    most = torch.finfo(wide).max
    total = (a.to(wide) + b.to(wide)).nan_to_num(nan=math.nan, posinf=most, neginf=-most)
    return total.masked_fill(torch.isposinf(a) | torch.isposinf(b), math.nan)


def with_minus_inf(values: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """``values`` with ``-inf`` where ``allowed`` is False: a mask's additive form, from its
    bias and its predicate, broadcast to both. A predicate of fewer entries (causal over
    ALiBi's heads) is added as 0 or -inf (``1 - 1/1 = 0``, ``1 - 1/0 = -inf``: exact in every
    dtype), 15x faster on a CPU than ``masked_fill``'s broadcast of a bool mask (0.28
    against 4.1 ms for 8 x 512 x 512); a predicate as large as the values fills them.

    Example:
        >>> v = torch.tensor([[[1.0, 2.0], [3.0, 4.0]]])
        >>> with_minus_inf(v, torch.tensor([[True, False], [True, True]])).tolist()
        [[[1.0, -inf], [3.0, 4.0]]]

    Shapes:
        ``values`` and ``allowed`` broadcast together; the result has their joint shape.
    """
    if allowed.numel() < values.numel():
        return values + allowed.to(values.dtype).reciprocal_().neg_().add_(1)
    return values.masked_fill(~allowed, float("-inf"))


def bias_as(bias: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A mask's bias values (finite) in the scores' ``dtype``, saturating at its largest
    magnitude: a finite bias is a number on every backend, never ``-inf`` (which masks),
    even where a wider one (float64 on float32 scores) is past the narrower range.

    Example:
        >>> import torch
        >>> bias_as(torch.tensor([-1e39, 2.0], dtype=torch.float64), torch.float32).tolist()
        [-3.4028234663852886e+38, 2.0]

    Shapes:
        any; the result has ``bias``'s shape.
    """
    if bias.dtype == dtype:
        return bias
    most = torch.finfo(dtype).max
    if torch.finfo(bias.dtype).max > most:
        bias = bias.clamp(-most, most)
    return bias.to(dtype)


class Mask:
    """Base class of every mask. Compose masks with ``&``, ``|`` and ``~``.

    A chain of one operator built in a loop (``m = m & w`` a thousand times) is kept as a
    balanced tree of its operands; compositions that alternate operators may nest at most
    :data:`~multihead.masks.combine.MAX_DEPTH` deep (a clear error past it).

    Subclasses implement :meth:`_allowed` (a predicate over :class:`Index`), optionally
    :meth:`_bias`, and :meth:`_tile_bounds` (sound per-tile ``any``/``all`` bounds).
    """

    #: a cached value that refers to a mask does not own its tensors: caches neither count
    #: them nor order them across streams (see :func:`multihead._cache.nbytes`)
    _cache_opaque = True
    #: batch size the mask applies to, or None when it does not depend on the batch (ours
    #: read it from their tensors as they are, and it is read-only there)
    batch_size: int | None = None
    #: number of heads the mask was built for, or None when it does not depend on the head
    num_heads: int | None = None
    #: True when the mask adds a bias (a float term) to the scores
    has_bias: bool = False
    #: True when the mask rules some pairs out (False for a pure bias such as ALiBi)
    has_predicate: bool = True
    #: the structure backends read ("causal", "window", "padding", "document", "dense",
    #: "bias", "alibi"; "and"/"or"/"not" for compositions; "custom" for a user's own class.
    #: A subclass of one of ours keeps its parent's kind: code that compiles a mask checks
    #: the exact class, since a subclass may redefine the predicate)
    kind: str = "custom"
    #: set to True in the body of each of our own mask classes: they never change after
    #: construction (or, for tensors they share with the caller, are version-tracked), so
    #: facts derived from them may be cached. Not inherited: a user's subclass is not cached.
    _immutable: bool = False
    #: False where the mask holds a tensor as the caller gave it (dense, bias, positions):
    #: the caller may write into it through ``.data`` or a numpy array, unseen by version
    #: counters, so what is derived from it is not kept past a call (its own copies, or
    #: tensors no caller holds, mark it True)
    _own_tensors: bool = True
    #: how many compositions (``&``, ``|``, ``~``) nest above the deepest leaf (0: a leaf)
    _depth: int = 0
    #: in a chain of one operator: how deep it may grow before it is rebuilt balanced
    #: (twice its depth when it last was; see :func:`_compose`)
    _limit: int = 0

    # -- what backends read ------------------------------------------------------------------
    def cache_key(self):
        """A hashable value that fully determines this mask, or None.

        Facts derived from a mask with a key (tile maps, plans, dispatch decisions) are
        shared by every call and every mask with the same key. The default is None: a
        subclass (also of one of our masks) is only shared if it overrides this to say what
        determines it. Masks holding tensors return None (their facts are cached on the object
        instead, while its tensors are unmodified).

        Example:
            >>> import multihead as mh
            >>> mh.masks.sliding_window(8).cache_key()
            ('window', 8, 'lower_right')
        """
        return None

    def structure(self):
        """What a mask is made of, without its contents: kind, sizes, alignment, which
        tensors (by shape and dtype) and host facts. Masks of one structure share a dispatch
        choice (never a plan, which may depend on contents). None (the default, and for a
        user's subclass): not shared.

        Example:
            >>> import torch, multihead as mh
            >>> (mh.masks.causal() & mh.masks.padding(torch.tensor([3, 5]))).structure()
            ('&', ('window', None, 'lower_right'), ('padding', 'key', 2, 'lengths'))
        """
        return self.cache_key()

    def made_for_call(self) -> bool:
        """Whether this mask (or a mask it is composed of) was built by multihead for one
        call from a tensor the caller passed (a GPU or large tensor given as ``mask=``, a
        drop-in's ``key_padding_mask`` on a GPU): a new object at every call, so nothing
        derived from it is kept for the next (the Triton kernels' block lists are built
        each call, and priced so).

        Example:
            >>> import torch, multihead as mh
            >>> mh.masks.dense(torch.ones(2, 2, dtype=torch.bool)).made_for_call()
            False
        """
        return any(leaf.__dict__.get("_per_call", False) for leaf in self.leaves())

    def _mark_per_call(self) -> "Mask":
        """This mask, its leaves marked as :meth:`made_for_call`."""
        for leaf in self.leaves():
            leaf.__dict__["_per_call"] = True
        return self

    def leaves(self):
        """The masks this one is composed of (itself for a mask that is not a composition).

        Example:
            >>> import multihead as mh
            >>> [m.kind for m in (mh.masks.causal() & mh.masks.alibi(2)).leaves()]
            ['causal', 'alibi']
        """
        yield self

    def may_have_empty_rows(self, sq: int, sk: int) -> bool:
        """False only if every query row surely has a key to attend to (decided on the host,
        from sizes and host facts, never by reading a device tensor). True when unsure.

        Example:
            >>> import multihead as mh
            >>> mh.masks.causal().may_have_empty_rows(4, 9), mh.masks.causal().may_have_empty_rows(9, 4)
            (False, True)
        """
        return self.has_predicate or (sq > 0 and sk == 0)     # (no key: every row is empty)

    @property
    def memoizable(self) -> bool:
        """True when facts derived from this object may be cached on it: masks of our own
        classes (exactly: a user's subclass of one of them is not)."""
        return type(self).__dict__.get("_immutable", False)

    def __getstate__(self):
        """Copies and pickles start without this object's cached facts; the host facts read
        from its tensors (lengths, document runs) travel only while they still describe them
        (a copy's tensors count their versions afresh, so a stamp of the old counters could
        match the copy's and vouch for facts of values written over since)."""
        state = {k: v for k, v in self.__dict__.items() if k != "_memo"}
        if "_facts_at" in state:
            state["_facts_at"] = _FACTS_HELD if self._facts_hold() else None
        return state

    def __setstate__(self, state):
        self.__dict__.update(state)
        if isinstance(self, (_Binary, Not)) and "_depth" not in state:
            # a composition pickled before compositions kept their depth
            parts = (self.m,) if isinstance(self, Not) else (self.a, self.b)
            self.__dict__["_depth"] = _nested(1 + max(p._depth for p in parts))
        if state.get("_facts_at") == _FACTS_HELD:      # the copy's own counters vouch now
            self.__dict__["_facts_at"] = self._versions()

    def cached(self, what: str, args: tuple, compute, limit: int | None = None):
        """``compute()``, cached by what determines it: globally under :meth:`cache_key`, else
        on this object while its tensors are unmodified (their version counters), else not;
        with ``limit``, a value holding more tensor bytes than that is not kept.

        Changes that bypass version counters (writes through ``.data`` or a shared numpy
        array) are not seen: build a new mask after such a change.

        While a CUDA graph captures, facts of a mask's tensors are computed in the graph (a
        graph's inputs change between replays, written in place, and the graph must see
        their contents at each replay, not those a cache kept), and nothing is stored; nor
        while a fake-tensor or tracing mode is on (its tensors hold no values to keep).

        Example:
            >>> import torch, multihead as mh
            >>> m = mh.masks.dense(torch.ones(4, 4, dtype=torch.bool))
            >>> m.cached("n", (), lambda: 1), m.cached("n", (), lambda: 2)     # kept
            (1, 1)
            >>> m.t[0, 0] = False                                             # modified
            >>> m.cached("n", (), lambda: 3)
            3
        """
        if tracing():  # traced: the graph recomputes it on each call
            return compute()
        if torch._C._are_functorch_transforms_active():
            compute = _outside_transforms(self, compute)
        key = self.cache_key()
        if key is not None:
            try:
                hash(key)
            except TypeError:
                raise TypeError(f"{type(self).__name__}.cache_key() must return a hashable value "
                                f"(a tuple of ints and strings, say), got {key!r}") from None
            full = (key, what, args)
            return _SHARED.get_or_compute(full, compute, limit)
        versions = self._versions()
        if not self.memoizable or devices.capturing() or versions is None:
            return compute()
        store = self.__dict__.get("_memo")
        if store is None:                  # setdefault: one store even if threads race here
            store = self.__dict__.setdefault("_memo", BoundedCache(_MEMO_ENTRIES, _MEMO_BYTES))
        return store.get_or_compute((what, args, versions), compute, limit)

    def kept(self, what: str, args: tuple):
        """What :meth:`cached` keeps on this object for ``what`` and ``args`` while its
        tensors are as they are now, or None; computes and stores nothing (a mask with a
        :meth:`cache_key` keeps nothing on itself).

        Example:
            >>> import torch, multihead as mh
            >>> m = mh.masks.dense(torch.ones(4, 4, dtype=torch.bool))
            >>> m.kept("n", ()) is None, m.cached("n", (), lambda: 1), m.kept("n", ())
            (True, 1, 1)
        """
        store = self.__dict__.get("_memo")
        if store is None or tracing() or self.cache_key() is not None:
            return None
        versions = self._versions()
        return None if versions is None else store.peek((what, args, versions))

    def _versions(self) -> tuple | None:
        """The version counters of the tensors this mask holds, each with the tensor's
        identity (a tensor assigned in place of another starts its own count, which may
        equal the old one's); None if one keeps none, as inference tensors do. While
        ``torch.compile`` traces, the counters alone."""
        try:
            if tracing():
                return tuple(t._version for t in self._tensors())
            return tuple((t._version, _serial(t)) for t in self._tensors())
        except RuntimeError:
            return None

    def _check_unchanged(self, versions: tuple | None, fn: str) -> None:
        """Raise when a tensor of this mask was written in place since ``versions`` (its
        :meth:`_versions` when the forward ran): a backward that evaluates the mask again
        would differentiate another forward than the one that ran (as torch refuses to
        for the tensors autograd saves)."""
        now = self._versions()
        if versions is not None and now is not None and now != versions:
            raise RuntimeError(
                f"{fn}: a tensor of the mask {self.describe()} was written in place (or "
                f"replaced) after the forward ran, and the backward evaluates the mask again: "
                f"build a new mask for each forward (or write into its tensors only after the "
                f"backward)")

    def _stamp(self) -> None:
        """Record that the host facts just derived (lengths read once, document runs)
        describe this mask's tensors as they are now (see :meth:`_facts_hold`)."""
        self.__dict__["_facts_at"] = self._versions()

    def _facts_hold(self) -> bool:
        """True while the host facts of the last :meth:`_stamp` still describe this mask's
        tensors: each keeps a version counter (the mask's own copies always do) and none
        was written in place since, and no CUDA graph is capturing a call on tensors of a
        device (a graph's inputs are rewritten in place between replays: it must read them,
        not facts of their contents at capture). While ``torch.compile`` traces, a stamp is
        trusted.
        """
        at = self.__dict__.get("_facts_at")
        if at is None:                      # never stamped, or a tensor keeps no counter
            return False
        if tracing():
            return True
        if devices.capturing() and any(t.device.type != "cpu" for t in self._tensors()):
            return False
        return at == self._versions()

    def _fact(self, name: str):
        """The host fact ``name`` (an attribute :meth:`_read_facts` sets, then stamps), or
        None where it may no longer hold and cannot be read again without a sync: a device
        tensor written in place since, a CUDA graph capturing, ``torch.compile`` tracing.
        Host tensors written in place since are read again."""
        if not self._facts_hold():
            if tracing() or not self.on_host:
                return None
            self._read_facts(check=False)
        return getattr(self, name)

    def _read_facts(self, check: bool = True) -> None:
        """Read this mask's host facts from its (host) tensors and :meth:`_stamp` them;
        ``check``: also raise on values the mask refuses."""
        raise NotImplementedError(f"{type(self).__name__} must implement _read_facts to "
                                  f"keep host facts")

    # -- what subclasses implement ---------------------------------------------------------
    def _allowed(self, ix: Index) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement _allowed")

    def _bias(self, ix: Index) -> torch.Tensor | None:
        return None

    def _tile_bounds(self, tx: TileIndex) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(any, all)`` bool tensors broadcastable to (B, H, nQ, nK)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _tile_bounds")

    def _key_span(self, tx: TileIndex) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(first, last)``: int64 tensors broadcastable to ``(B, H, nQ, 1)``, the least and
        greatest key any query of each query tile may attend (every key outside is ruled
        out; ``last < first`` where none is allowed), or None where unknown (any key).
        Reads ``tx``'s rows only (``q0``, ``q1``, ``b``, ``h``, the lengths)."""
        return None

    def _takes_bands(self) -> bool:
        """Whether :meth:`_tile_bounds` accepts a banded :class:`TileIndex`: set as
        ``_banded = True`` in the body of each of our classes that does (not inherited: a
        user's subclass may redefine its bounds). Compositions also ask their operands."""
        return type(self).__dict__.get("_banded", False)

    def _tensors(self) -> list[torch.Tensor]:
        """Tensors the mask holds (for device checks)."""
        return []

    def _check(self, batch: int, heads: int, sq: int, sk: int) -> None:
        """Raise ValueError when the mask cannot apply to a call of these sizes."""
        # (== and != only: under torch.compile `n not in (1, batch)` misreads a symbolic batch)
        if self.batch_size is not None and self.batch_size != 1 and self.batch_size != batch:
            raise ValueError(
                f"mask: {self.describe()} was built for batch size {concrete(self.batch_size)}, "
                f"but the inputs have batch size {concrete(batch)}: build the mask from this "
                f"batch's lengths/ids")
        if self.num_heads is not None and self.num_heads != 1 and self.num_heads != heads:
            raise ValueError(
                f"mask: {self.describe()} was built for {concrete(self.num_heads)} heads, but q "
                f"has {concrete(heads)} heads: build it with num_heads={concrete(heads)}")

    # -- public API ------------------------------------------------------------------------
    def check(self, batch: int, heads: int, sq: int, sk: int,
              device: torch.device | str | None = None) -> None:
        """Validate the mask against a call's sizes and device; raises ``ValueError``.

        Example:
            >>> import torch, multihead as mh
            >>> mh.masks.padding(torch.tensor([3, 2])).check(batch=2, heads=4, sq=5, sk=5)
        """
        self._check(batch, heads, sq, sk)
        if device is not None:
            device = torch.device(device)
            for t in self._tensors():
                if t.device.type != device.type or (
                        device.index is not None and t.device.index not in (None, device.index)):
                    raise ValueError(
                        f"mask: {self!s} holds a tensor on {t.device}, but the inputs are on "
                        f"{device}: move it with mask.to({str(device)!r}) or build it there")

    def _additive_at(self, ix: Index, dtype: torch.dtype) -> torch.Tensor | None:
        """The additive form at the positions ``ix`` in the float ``dtype``: the bias
        (saturated to ``dtype``, see :func:`bias_as`) with ``-inf`` where the mask rules a
        pair out, broadcastable to the index tensors' shape; None where it neither rules out
        nor adds. Read it, never write into it: a tensor bias's may be a view of its own
        tensor (see :meth:`_additive_view`)."""
        allowed, bias = self.at(ix)
        out = None if bias is None else bias_as(bias, dtype)
        if allowed is None:
            return out
        if out is None:
            out = torch.zeros((), dtype=dtype, device=allowed.device)
        return with_minus_inf(out, allowed)

    def _additive_view(self, dtype: torch.dtype) -> bool:
        """True where :meth:`_additive_at` on :meth:`index`'s grid is a view of this mask's
        own tensor in ``dtype`` (no pass over the grid, no new buffer)."""
        return False

    def at(self, ix: Index) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The mask at the positions ``ix``: ``(allowed or None, bias or None)``, each
        broadcastable to the index tensors' shape (None: rules nothing out / adds nothing).
        Backends evaluate masks through this, on the tiles they compute. Read the results,
        never write into them: on :meth:`index`'s grid a tensor mask's are views of its
        own tensor.

        Example:
            >>> import multihead as mh
            >>> m = mh.masks.causal() & mh.masks.alibi(1)
            >>> allowed, bias = m.at(m.index(2, 2))
            >>> allowed[0, 0].tolist(), bias[0, 0].tolist()
            ([[True, False], [True, True]], [[-0.0, -0.00390625], [-0.00390625, -0.0]])
        """
        return (self._allowed(ix) if self.has_predicate else None,
                self._bias(ix) if self.has_bias else None)

    @property
    def on_host(self) -> bool:
        """True when the mask can be analysed without reading a device tensor: it holds no
        tensor, or only tensors on the CPU. False while ``torch.compile`` traces a mask that
        holds tensors (a graph's tensors have no values to read)."""
        tensors = self._tensors()
        if tensors and tracing():
            return False
        return all(t.device.type == "cpu" for t in tensors)

    def index(self, sq: int, sk: int, device=None, dtype: torch.dtype = torch.float32) -> Index:
        """The (B', H', Sq, Sk) index grid this mask is materialized on, for scores of
        ``dtype`` (float32, or float64): tensors of the caller's own."""
        return self._index_grid(sq, sk, device, dtype, keep=False)

    def _index_grid(self, sq: int, sk: int, device=None, dtype: torch.dtype = torch.float32,
                    *, keep: bool = True) -> Index:
        """:meth:`index`, whose axes are kept between calls (``keep``) where only the
        library's own masks read them (a user's mask could write into them unseen, through
        ``.numpy()`` or ``.data``, and every later call would read the writes)."""
        device = torch.device(device) if device is not None else self._device()
        sizes = (_size(self.batch_size), _size(self.num_heads), sq, sk)
        keep = keep and all(leaf.memoizable for leaf in self.leaves())
        return Index(*_grid_axes(sizes, device, keep), sq, sk, dtype)

    def _check_sizes(self, fn: str, sq, sk) -> tuple:
        """``(sq, sk)`` as ints, after checking they are lengths the mask applies to (a
        dense mask's tensor is never cropped or overrun): a ValueError naming ``fn``."""
        sq, sk = _length(fn, "sq", sq), _length(fn, "sk", sk)
        try:
            self._check(_size(self.batch_size), _size(self.num_heads), sq, sk)
        except ValueError as e:
            raise ValueError(f"{fn}: {e}") from None
        return sq, sk

    def materialize(self, sq: int, sk: int, device=None) -> torch.Tensor:
        """The dense bool tensor ``(B', H', Sq, Sk)``; True = may attend.

        ``B'`` is the mask's batch size (1 when it does not depend on the batch), ``H'``
        likewise for heads; the result broadcasts to ``(B, H, Sq, Sk)``.

        Example:
            >>> import multihead as mh
            >>> mh.masks.causal().materialize(2, 3)[0, 0].int().tolist()
            [[1, 1, 0], [1, 1, 1]]
        """
        return self._grid(sq, sk, device)

    def _grid(self, sq: int, sk: int, device=None, first: bool = False) -> torch.Tensor:
        """:meth:`materialize`; ``first``: batch 0 and head 0 only, ``(1, 1, Sq, Sk)`` (what
        repr draws, in memory of one grid however many sequences the mask was built for)."""
        sq, sk = self._check_sizes("materialize", sq, sk)
        ix = self._index_grid(sq, sk, device)
        if first:
            ix = dataclasses.replace(ix, b=ix.b[:1], h=ix.h[:1])
        full = torch.ones(len(ix.b), len(ix.h), sq, sk, dtype=torch.bool, device=ix.q.device)
        if not self.has_predicate:
            return full
        allowed = self._allowed(ix)     # (a tensor mask's own heads and batch may come whole)
        return full & (allowed[:1, :1] if first else allowed)

    def additive(self, sq: int, sk: int, device=None, dtype=torch.float32) -> torch.Tensor:
        """The additive float form ``(B', H', Sq, Sk)``: the bias, and ``-inf`` where masked.

        Example:
            >>> import multihead as mh
            >>> mh.masks.causal().additive(2, 2)[0, 0].tolist()
            [[0.0, -inf], [0.0, 0.0]]
        """
        sq, sk = self._check_sizes("additive", sq, sk)
        if dtype == torch.bool:
            raise TypeError("additive: dtype must be a floating-point dtype (the form holds "
                            "-inf where masked), got torch.bool: use materialize() for bool")
        check_dtype("additive: dtype", dtype)
        ix = self._index_grid(sq, sk, device, torch.promote_types(dtype, torch.float32))
        out = torch.zeros(len(ix.b), len(ix.h), sq, sk, dtype=dtype, device=ix.q.device)
        form = self._additive_at(ix, dtype)
        return out if form is None else out + form      # (a new tensor: never a view)

    def tiles(self, sq: int, sk: int, *, tile_q: int = 64, tile_k: int = 64,
              device=None, batch: int | None = None, heads: int | None = None) -> TileMap:
        """Classify every (query tile, key tile) pair as EMPTY, PARTIAL or FULL.

        Args:
            sq, sk: query and key lengths.
            tile_q, tile_k: tile sizes; the last tile of each axis may be short.
            device: where to compute (defaults to the mask's device).
            batch, heads: sizes to classify for (default: the mask's own).

        Returns:
            A :class:`TileMap` whose ``state`` is ``(B', H', ceil(Sq/tile_q), ceil(Sk/tile_k))``,
            the caller's own copy: maps are cached (see :meth:`cached`) and the kernels'
            block lists come from them, so writing into one changes no later call.

        Example:
            >>> import multihead as mh
            >>> mh.masks.sliding_window(64).tiles(256, 256).counts()
            {'empty': 9, 'partial': 7, 'full': 0}
        """
        tm = self._tile_map(sq, sk, tile_q=tile_q, tile_k=tile_k, device=device, batch=batch,
                            heads=heads)
        return dataclasses.replace(tm, state=tm.state.clone())

    def _tile_map(self, sq: int, sk: int, *, tile_q: int = 64, tile_k: int = 64,
                  device=None, batch: int | None = None, heads: int | None = None,
                  banded: bool = False) -> TileMap:
        """:meth:`tiles` as cached, shared with every later call: only to read. ``banded``:
        on the host, a banded map (see :class:`TileMap`) where the mask bounds each query
        tile's keys to fewer than half the key tiles (memory and time linear in the length
        for a window or packed documents, not quadratic)."""
        tile_q, tile_k = (_length("tiles", name, n, least=1)
                          for name, n in (("tile_q", tile_q), ("tile_k", tile_k)))
        batch, heads = (None if n is None else _length("tiles", name, n)
                        for name, n in (("batch", batch), ("heads", heads)))
        for name, n, own in (("batch", batch, self.batch_size), ("heads", heads, self.num_heads)):
            if n is not None and own is not None and own != 1 and own != n:
                raise ValueError(f"tiles: {name}={n}, but {self!s} was built for {own}: pass "
                                 f"{name}={own} (or leave it out: the mask's own)")
        sq, sk = self._check_sizes("tiles", sq, sk)
        device = torch.device(device) if device is not None else self._device()
        args = (sq, sk, tile_q, tile_k, batch, heads, banded and device.type == "cpu")
        if self.cache_key() is not None and device.type != "cpu":
            # determined by ints: classify on the host once, copy to the device without a sync
            host = self.cached("tiles", (*args, "cpu"), lambda: self._classify(*args, "cpu"))
            return self.cached("tiles", (*args, str(device)), lambda: TileMap(
                to_device(host.state, device), tile_q, tile_k, sq, sk))
        return self.cached("tiles", (*args, str(device)), lambda: self._classify(*args, device))

    def _classify(self, sq, sk, tile_q, tile_k, batch, heads, banded, device) -> TileMap:
        device = torch.device(device)
        nq, nk = -(-sq // tile_q), -(-sk // tile_k)
        q0 = torch.arange(nq, device=device) * tile_q
        k0 = torch.arange(nk, device=device) * tile_k
        tx = TileIndex(
            b=torch.arange(_size(self.batch_size if batch is None else batch),
                           device=device).view(-1, 1, 1, 1),
            h=torch.arange(_size(self.num_heads if heads is None else heads),
                           device=device).view(1, -1, 1, 1),
            q0=q0.view(1, 1, nq, 1), q1=(q0 + tile_q - 1).clamp(max=max(sq - 1, 0)).view(1, 1, nq, 1),
            k0=k0.view(1, 1, 1, nk), k1=(k0 + tile_k - 1).clamp(max=max(sk - 1, 0)).view(1, 1, 1, nk),
            sq=sq, sk=sk, tile_q=tile_q, tile_k=tile_k)
        shape, inside = (1, 1, nq, nk), None
        if banded and self.has_predicate and nq * nk and self._takes_bands():
            band = self._band(tx, nk)
            if band is not None:
                kt, inside = band                                           # (nQ, W) each
                tx = dataclasses.replace(tx, k0=(kt * tile_k)[None, None],
                                         k1=(kt * tile_k + tile_k - 1).clamp(max=sk - 1)[None, None],
                                         kt=kt[None, None])
                shape = (1, 1, *kt.shape)
        if not self.has_predicate:
            state = torch.full(shape, FULL, dtype=torch.int8, device=device)
        else:
            any_, all_ = self._tile_bounds(tx)
            any_ = torch.broadcast_to(any_, grid_shape(any_.shape, shape))  # (both 4-D)
            if inside is not None:
                any_ = any_ & inside                                        # past a row's band
            all_ = torch.broadcast_to(all_, any_.shape) & any_
            state = torch.where(all_, FULL, torch.where(any_, PARTIAL, EMPTY)).to(torch.int8)
        return TileMap(state=state, tile_q=tile_q, tile_k=tile_k, sq=sq, sk=sk,
                       key_tiles=None if inside is None else tx.kt[0, 0])

    def _band(self, tx: TileIndex, nk: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """``(kt, inside)``, both ``(nQ, W)``: the key tiles each query tile may reach (from
        :meth:`_key_span`, over every sequence and head), first to last, and whether each
        column is one of them (a row that reaches fewer names later tiles in its last
        columns, the last tile at most: marked outside, they are EMPTY); None where the span
        is unknown or reaches half the key tiles (a dense map is then as cheap), or where
        there is no sequence or head to bound."""
        span = self._key_span(tx)
        if span is None or any(t.numel() == 0 for t in span):
            return None
        nq = tx.q0.shape[2]
        first, last = (torch.broadcast_to(t, (*t.shape[:2], nq, 1))  # (B', H', nQ, 1) keys
                       for t in torch.broadcast_tensors(*span))
        some = last >= first                                        # (a sequence that sees
        first = torch.where(some, first, tx.sk).amin(dim=(0, 1))    # none widens no band)
        last = torch.where(some, last, -1).amax(dim=(0, 1))
        first = first.view(nq).clamp(min=0) // tx.tile_k            # (nQ,) key tiles
        last = last.view(nq).clamp(max=tx.sk - 1) // tx.tile_k
        count = (last - first + 1).clamp(min=0)                              # (nQ,)
        width = int(count.max())
        if 2 * width > nk:
            return None
        cols = torch.arange(max(width, 1), device=first.device)                # (W,)
        kt = (first[:, None] + cols).clamp(max=nk - 1)                       # (nQ, W)
        return kt, cols < count[:, None]

    @property
    def requires_grad(self) -> bool:
        """True when a tensor the mask holds (a learned bias, say) requires gradients."""
        return any(t.requires_grad for t in self._tensors())

    def to(self, device) -> "Mask":
        """A copy of the mask with its tensors on ``device`` (itself when it holds none).

        Host tensors are copied without synchronizing the device, and the host facts the
        mask derived from them (lengths, document runs) travel along: build masks from host
        (CPU) data, then move them. A mask keeps its tensors' dtypes (a bias is cast to the
        scores' dtype by the call).

        Example:
            >>> import torch, multihead as mh
            >>> mh.masks.padding(torch.tensor([2, 3])).to("cpu").lengths.device
            device(type='cpu')
            >>> mh.masks.causal().to(torch.float16)
            Traceback (most recent call last):
            ...
            TypeError: Mask.to takes a device (a torch.device or a name such as 'cuda:0'), got torch.float16: a mask keeps its dtypes (a bias is cast to the scores' dtype by the call)
        """
        try:
            torch.device(device)
        except (RuntimeError, TypeError):
            raise TypeError(f"Mask.to takes a device (a torch.device or a name such as "
                            f"'cuda:0'), got {device!r:.60}: a mask keeps its dtypes (a bias "
                            f"is cast to the scores' dtype by the call)") from None
        return self._to(device)

    def _to(self, device) -> "Mask":
        """:meth:`to` for a device it checked; a mask that holds tensors moves them."""
        return self

    def _moved(self, device, *names: str) -> "Mask":
        """A shallow copy whose tensor attributes ``names`` are on ``device`` (host facts kept
        while they hold)."""
        state = self.__getstate__()                     # (a copy's: see there)
        for name in names:
            if state[name] is not None:
                with versioned():
                    state[name] = to_device(state[name], device)
        new = object.__new__(type(self))
        new.__setstate__(state)
        return new

    def _device(self) -> torch.device:
        ts = self._tensors()
        return ts[0].device if ts else torch.device("cpu")

    # -- composition -----------------------------------------------------------------------
    def __and__(self, other: "Mask") -> "Mask":
        return _compose(And, self, _as_mask(other, "&"))

    def __or__(self, other: "Mask") -> "Mask":
        return _compose(Or, self, _as_mask(other, "|"))

    def __invert__(self) -> "Mask":
        return self.m if type(self) is Not else Not(self)     # ~~m allows what m allows

    def __rand__(self, other):
        return _compose(And, _as_mask(other, "&"), self)

    def __ror__(self, other):
        return _compose(Or, _as_mask(other, "|"), self)

    # -- equality: masks determined by their ints are values -------------------------------
    def __eq__(self, other):
        """Equal when both have a :meth:`cache_key` and the keys are equal (``causal() ==
        causal()``); a mask holding tensors equals only itself.

        Example:
            >>> import multihead as mh
            >>> mh.masks.causal() == mh.masks.causal(), len({mh.masks.alibi(4), mh.masks.alibi(4)})
            (True, 1)
        """
        if self is other:
            return True
        if not isinstance(other, Mask):
            return NotImplemented
        key = self.cache_key()
        return key is not None and key == other.cache_key()

    def __hash__(self):
        key = self.cache_key()
        if key is None:
            return object.__hash__(self)
        try:
            return hash(key)
        except TypeError:           # a user's key that does not hash: equal masks must
            return hash(type(self))  # still hash alike

    # -- display ---------------------------------------------------------------------------
    #: the largest Sq or Sk repr draws (a larger mask is described, not drawn)
    _DRAWN = 32

    def _preview_size(self) -> tuple[int, int]:
        return 8, 8

    def _preview_sizes(self) -> list[tuple[int, int]]:
        """The (Sq, Sk) repr may draw the mask at, best first: it draws the first where
        the mask allows something."""
        return [self._preview_size()]

    def _preview_cap(self) -> tuple[int | None, int | None]:
        """The largest (Sq, Sk) a tensor of the mask covers (None: any size)."""
        return None, None

    def _lengths(self) -> tuple[int | None, int | None]:
        """The (Sq, Sk) every call of the mask must have (None: any), for composition to
        refuse masks no call fits."""
        return None, None

    def _least(self) -> tuple[int, int]:
        """The (Sq, Sk) every call of the mask must reach at least (known from host facts:
        the longest padding length), for composition to refuse masks no call fits."""
        return 0, 0

    def describe(self) -> str:
        """One-line description, e.g. ``causal(align='lower_right')``."""
        return type(self).__name__

    def __str__(self) -> str:
        return self.describe()

    def __repr__(self) -> str:
        try:
            batch = self.batch_size            # (ours follow their tensors: rows may disagree)
        except ValueError as exc:               # a repr must never raise
            return f"{self.describe()} ({exc})"
        if batch == 0:
            return f"{self.describe()} (an empty batch: nothing to draw)"
        drawn = None                            # (Sq, Sk, grid) of the first size drawable
        for sq, sk in self._preview_sizes():
            if max(sq, sk) > self._DRAWN:
                continue
            try:
                grid = self._grid(sq, sk, device="cpu", first=True)[0, 0]
            except Exception as exc:  # a repr must never raise
                return f"{self.describe()} (preview unavailable: {exc})"
            drawn = drawn or (sq, sk, grid)
            if grid.any():
                drawn = (sq, sk, grid)
                break
        if drawn is None:
            sq, sk = self._preview_size()
            return (f"{self.describe()} (Sq={sq}, Sk={sk}: too large to draw here; "
                    f"m.materialize(Sq, Sk) gives it at a call's lengths)")
        sq, sk, grid = drawn
        rows = [" ".join("1" if x else "." for x in row.tolist()) for row in grid]
        what = f"Sq={sq}, Sk={sk}"
        if self.batch_size or self.num_heads:
            what += ", batch 0, head 0"
        return f"{self.describe()}\n  {what}:\n" + "\n".join("  " + r for r in rows)


def uncalled(obj) -> str:
    """``": call it: ..."`` for one of our mask factories passed where its mask belongs
    (``mask=mh.masks.causal``), else ``""``.

    Example:
        >>> import multihead as mh
        >>> uncalled(mh.masks.causal)
        ': call it: multihead.masks.causal(...)'
    """
    module = getattr(obj, "__module__", None) or ""
    if callable(obj) and not isinstance(obj, type) and module.startswith("multihead.masks"):
        return f": call it: multihead.masks.{obj.__name__}(...)"
    return ""


def one_batch(what: str, rows: dict) -> int | None:
    """The batch size named by sizes of tensors that hold one row per sequence or one row
    for all (``rows``: a name -> size, None where absent): the one size other than 1, None
    when there is none. Read from the tensors as they are, so a tensor assigned in place of
    a mask's own is followed.

    Raises:
        ValueError: two sizes other than 1 differ (``what`` names the mask).

    Example:
        >>> one_batch("document", {"ids": 3, "kv_ids": 1}), one_batch("document", {"ids": 1})
        (3, None)
    """
    # (==/!= only: a batch traced as symbolic by torch.compile stays so)
    named = [(name, n) for name, n in rows.items() if n is not None and n != 1]
    for name, n in named[1:]:
        if n != named[0][1]:
            sizes = ", ".join(f"{k} {v}" for k, v in rows.items() if v is not None)
            raise ValueError(f"{what}: the batch sizes disagree ({sizes}): give one row per "
                             f"sequence, or one row for all")
    return named[0][1] if named else None


def _max_opt(a: int | None, b: int | None) -> int | None:
    """The broadcast of two sizes (None: the mask does not depend on that dim; 1 broadcasts
    to anything, an empty batch included)."""
    sizes = [x for x in (a, b) if x is not None and x != 1]
    return (0 if 0 in sizes else max(sizes)) if sizes else (1 if 1 in (a, b) else None)


def _length(fn: str, name: str, n, least: int = 0):
    """``n`` as an int of at least ``least`` (a traced symbolic size passes as it is), or
    a ValueError naming ``fn``'s argument ``name``."""
    return n if isinstance(n, torch.SymInt) else positive_int(f"{fn}: {name}", n, least=least)


def _size(n: int | None) -> int:
    """A dim's length on an index grid: 1 where the mask does not depend on it."""
    return 1 if n is None else n


# the combinators, here by name too (pickles of masks name them as multihead.masks.base's)
from .combine import (BALANCE_DEPTH, MAX_DEPTH, And, Not, Or, _Binary,  # noqa: E402,F401
                      _as_mask, _compose, _nested)

"""Combining masks: ``a & b`` (:class:`And`), ``a | b`` (:class:`Or`) and ``~m`` (:class:`Not`).

Every analysis of a mask (its predicate, its bias, its tile bounds, its checks) walks the
composition recursively, so chains of one operator are kept shallow (:func:`_compose`)
and a mixed composition may not nest deeper than :data:`MAX_DEPTH`.

Notation used for tensor shapes:
    B: batch, H: query heads, Sq: queries, Sk: keys.
"""

from __future__ import annotations

import torch

from .base import Index, Mask, TileIndex, _max_opt, bias_sum, uncalled, with_minus_inf


def _as_mask(other, op: str) -> Mask:
    if isinstance(other, Mask):
        return other
    raise TypeError(f"masks combine with {op} only with other masks, got {type(other).__name__}"
                    + (uncalled(other) or ": wrap tensors in multihead.masks.dense(...) or "
                       "multihead.masks.bias(...)"))


#: a chain of one operator deeper than this (or than twice its depth when it was last
#: rebuilt) is rebuilt as a balanced tree of the same operands in the same order (``&`` and
#: ``|`` are associative: the pairs allowed are the same; biases add in the same order,
#: grouped otherwise), so a mask built in a loop stays shallow: every analysis of a mask
#: walks it recursively
BALANCE_DEPTH = 32
#: the deepest composition a mask may be (mixed operators, which no rebalancing flattens)
MAX_DEPTH = 128


def _compose(cls, a: Mask, b: Mask) -> Mask:
    """``cls(a, b)`` (``And`` or ``Or``), rebuilt as a balanced tree of the chain's operands
    where it would nest deeper than :data:`BALANCE_DEPTH` or than twice its depth when last
    rebuilt (so a long chain is rebuilt each time it doubled, not at every link).

    Example:
        >>> import multihead as mh
        >>> m = mh.masks.causal()
        >>> for n in range(1000):
        ...     m = m & mh.masks.sliding_window(n + 1)
        >>> m._depth <= 32, len(list(m.leaves()))
        (True, 1001)
    """
    limit = max([BALANCE_DEPTH] + [x._limit for x in (a, b) if type(x) is cls])
    if 1 + max(a._depth, b._depth) <= limit:
        m = cls(a, b)
        m._limit = limit
        return m
    cls._validate(a, b)                       # (its errors name the operands as given)
    m = _balanced(cls, _operands(cls, a) + _operands(cls, b))
    m._limit = min(MAX_DEPTH, max(BALANCE_DEPTH, 2 * m._depth))
    return m


def _operands(cls, m: Mask) -> list:
    """The operands of the chain of ``cls`` (exactly: a subclass may mean another thing)
    that ``m`` is, left to right (without recursion: the chain may be deep)."""
    out, stack = [], [m]
    while stack:
        x = stack.pop()
        if type(x) is cls:
            stack += [x.b, x.a]
        else:
            out.append(x)
    return out


def _balanced(cls, ops: list) -> Mask:
    """``ops[0] op ops[1] op ...`` as a balanced tree, unchecked: the operands were checked
    together when the chain was built (the checks hold for any grouping)."""
    if len(ops) == 1:
        return ops[0]
    half = len(ops) // 2
    return cls._join(_balanced(cls, ops[:half]), _balanced(cls, ops[half:]))


def _nested(depth: int) -> int:
    """``depth``, or a ValueError past :data:`MAX_DEPTH`."""
    if depth > MAX_DEPTH:
        raise ValueError(f"mask: this composition would nest {depth} deep, more than "
                         f"{MAX_DEPTH}: chains of one operator (a & b & c ...) are kept "
                         f"shallow, but alternating &, | and ~ are not; combine the masks of "
                         f"each kind first (e.g. build the | of all alternatives, then & it)")
    return depth


class _Binary(Mask):
    op = "?"

    def __init__(self, a: Mask, b: Mask):
        self._validate(a, b)
        self._set(a, b)

    @classmethod
    def _join(cls, a: Mask, b: Mask) -> Mask:
        """``a op b`` without :meth:`_validate` (for operands known to fit)."""
        m = cls.__new__(cls)
        m._set(a, b)
        return m

    def _set(self, a: Mask, b: Mask) -> None:
        self._depth = _nested(1 + max(a._depth, b._depth))
        self._a, self._b = a, b
        self.kind = {"&": "and", "|": "or"}[self.op]
        self.has_bias = a.has_bias or b.has_bias
        self.has_predicate = a.has_predicate or b.has_predicate

    def _takes_bands(self):
        return super()._takes_bands() and all(not m.has_predicate or m._takes_bands()
                                               for m in (self.a, self.b))

    @classmethod
    def _validate(cls, a: Mask, b: Mask) -> None:
        """Raise unless some call fits both ``a`` and ``b`` (this check holds or fails
        alike for any grouping of a chain's operands)."""
        for what, x, y in (("batch size", a.batch_size, b.batch_size),
                           ("heads", a.num_heads, b.num_heads)):
            if None not in (x, y) and 1 not in (x, y) and x != y:
                raise ValueError(f"mask: {a.describe()} {cls.op} {b.describe()}: built for "
                                 f"{what} {x} and {y}, which no call fits: build both for "
                                 f"the call's {what}")
        for what, (xa, xb), (la, lb) in zip(("Sq", "Sk"), zip(a._lengths(), b._lengths()),
                                            zip(a._least(), b._least())):
            # two exact lengths that differ, or one's exact length below the other's least
            clashes = ([(xa, f"{what} = {xb}")] if None not in (xa, xb) and xa != xb else []) + [
                (x, f"{what} >= {n}") for x, n in ((xa, lb), (xb, la)) if x is not None and x < n]
            if clashes:
                x, other = clashes[0]
                raise ValueError(f"mask: {a.describe()} {cls.op} {b.describe()}: one needs "
                                 f"{what} = {x}, the other {other}, which no call fits")

    @property
    def batch_size(self) -> int | None:
        return _max_opt(self.a.batch_size, self.b.batch_size)   # (its leaves' as they are now)

    @property
    def num_heads(self) -> int | None:
        return _max_opt(self.a.num_heads, self.b.num_heads)

    @property
    def a(self) -> Mask:
        """The left operand. Read-only (the composition's hash and cached facts follow it)."""
        return self._a

    @property
    def b(self) -> Mask:
        """The right operand. Read-only."""
        return self._b

    def _check(self, batch, heads, sq, sk):
        self.a._check(batch, heads, sq, sk)
        self.b._check(batch, heads, sq, sk)

    def _tensors(self):
        return self.a._tensors() + self.b._tensors()

    def leaves(self):
        yield from self.a.leaves()
        yield from self.b.leaves()

    @property
    def memoizable(self) -> bool:
        return type(self) in (And, Or) and self.a.memoizable and self.b.memoizable

    def cache_key(self):
        ka, kb = self.a.cache_key(), self.b.cache_key()
        return None if ka is None or kb is None or not self.memoizable else (self.op, ka, kb)

    def structure(self):
        sa, sb = self.a.structure(), self.b.structure()
        return None if sa is None or sb is None or not self.memoizable else (self.op, sa, sb)

    def _to(self, device):
        return type(self)(self.a.to(device), self.b.to(device))

    def _preview_size(self):
        (a0, a1), (b0, b1) = self.a._preview_size(), self.b._preview_size()
        return self._fit(max(a0, b0), max(a1, b1))

    def _preview_sizes(self):
        """The size covering both sides first, then each side's own (``window & padding``:
        the window's wide preview may leave no key the padding keeps)."""
        sizes = [self._preview_size()]
        for q, k in self.a._preview_sizes() + self.b._preview_sizes():
            fit = self._fit(q, k)
            if fit not in sizes:
                sizes.append(fit)
        return sizes

    def _fit(self, q, k):
        """(q, k) within what a call of the composition may have."""
        cq, ck = self._preview_cap()
        cq, ck = cq or ck, ck or cq                   # one capped side: keep the preview square
        q, k = (q if cq is None else min(q, cq)), (k if ck is None else min(k, ck))
        (eq, ek), (lq, lk) = self._lengths(), self._least()     # what a call must have
        return (max(q, lq) if eq is None else eq), (max(k, lk) if ek is None else ek)

    def _preview_cap(self):
        (a0, a1), (b0, b1) = self.a._preview_cap(), self.b._preview_cap()
        smaller = lambda x, y: y if x is None else x if y is None else min(x, y)
        return smaller(a0, b0), smaller(a1, b1)

    def _lengths(self):
        return tuple(x if y is None else y for x, y in zip(self.a._lengths(), self.b._lengths()))

    def _least(self):
        return tuple(map(max, self.a._least(), self.b._least()))

    def describe(self) -> str:
        return f"({self.a.describe()} {self.op} {self.b.describe()})"


def _pred(m: Mask, ix: Index) -> torch.Tensor | None:
    return m._allowed(ix) if m.has_predicate else None


def _bounds(m: Mask, tx: TileIndex):
    if not m.has_predicate:
        t = torch.ones((), dtype=torch.bool, device=tx.q0.device)
        return t, t
    return m._tile_bounds(tx)


class And(_Binary):
    """Both masks allow the pair; biases add. Built by ``a & b``."""

    op = "&"
    _banded = True

    def _allowed(self, ix):
        pa, pb = _pred(self.a, ix), _pred(self.b, ix)
        return pb if pa is None else pa if pb is None else pa & pb

    def _additive_at(self, ix, dtype):
        split = self._bias_and_predicate()
        if split is None:
            return super()._additive_at(ix, dtype)
        x, y = split                       # x's own additive form, -inf where y rules out
        return with_minus_inf(x._additive_at(ix, dtype), y._allowed(ix))

    def _bias_and_predicate(self) -> tuple[Mask, Mask] | None:
        """``(x, y)``: the side with a bias and the side that only rules pairs out (a
        drop-in's float ``attn_mask`` and its key padding), or None where the sides are not
        so split: :meth:`_additive_at` joins y's predicate to x's own additive form (a
        tensor bias's tensor) in one pass."""
        for x, y in ((self.a, self.b), (self.b, self.a)):
            if x.has_bias and not y.has_bias and y.has_predicate:
                return x, y
        return None

    def _bias(self, ix):
        ba = self.a._bias(ix) if self.a.has_bias else None
        bb = self.b._bias(ix) if self.b.has_bias else None
        return bb if ba is None else ba if bb is None else bias_sum(ba, bb, ix.dtype)

    def _tile_bounds(self, tx):
        (any_a, all_a), (any_b, all_b) = _bounds(self.a, tx), _bounds(self.b, tx)
        return any_a & any_b, all_a & all_b

    def _key_span(self, tx):
        spans = [m._key_span(tx) for m in (self.a, self.b) if m.has_predicate]
        known = [s for s in spans if s is not None]
        if len(known) < 2:
            return known[0] if known else None
        (fa, la), (fb, lb) = known
        return torch.maximum(fa, fb), torch.minimum(la, lb)       # keys both allow

    def may_have_empty_rows(self, sq, sk):
        if not (self.a.has_predicate and self.b.has_predicate):  # a bias rules nothing out
            return (self.a if self.a.has_predicate else self.b).may_have_empty_rows(sq, sk)
        return True


class Or(_Binary):
    """Either mask allows the pair. Built by ``a | b``; biases cannot be or-ed."""

    op = "|"
    _banded = True

    @classmethod
    def _validate(cls, a: Mask, b: Mask) -> None:
        if a.has_bias or b.has_bias:
            raise TypeError(
                f"cannot combine {a.describe()} | {b.describe()}: a mask with an additive bias "
                f"has no meaning under |; combine biases with & (biases add) instead")
        if not (a.has_predicate and b.has_predicate):
            raise TypeError("| with a pure bias mask is meaningless; use & to add a bias")
        super()._validate(a, b)

    def _allowed(self, ix):
        return self.a._allowed(ix) | self.b._allowed(ix)

    def _tile_bounds(self, tx):
        (any_a, all_a), (any_b, all_b) = self.a._tile_bounds(tx), self.b._tile_bounds(tx)
        return any_a | any_b, all_a | all_b

    def _key_span(self, tx):
        sa, sb = self.a._key_span(tx), self.b._key_span(tx)
        if sa is None or sb is None:
            return None
        return torch.minimum(sa[0], sb[0]), torch.maximum(sa[1], sb[1])  # keys either allows

    def may_have_empty_rows(self, sq, sk):
        return self.a.may_have_empty_rows(sq, sk) and self.b.may_have_empty_rows(sq, sk)


class Not(Mask):
    """The complement of a boolean mask. Built by ``~m``."""

    kind = "not"
    _banded = True

    def __init__(self, m: Mask):
        if m.has_bias or not m.has_predicate:
            raise TypeError(f"~ applies to boolean masks only, not to {m.describe()} (it has a bias)")
        self._depth = _nested(1 + m._depth)
        self._m = m

    @property
    def batch_size(self) -> int | None:
        return self.m.batch_size

    @property
    def num_heads(self) -> int | None:
        return self.m.num_heads

    def _check(self, batch, heads, sq, sk):
        self.m._check(batch, heads, sq, sk)

    def _takes_bands(self):
        return super()._takes_bands() and self.m._takes_bands()

    def _tensors(self):
        return self.m._tensors()

    def leaves(self):
        yield from self.m.leaves()

    @property
    def memoizable(self) -> bool:
        return type(self) is Not and self.m.memoizable

    def cache_key(self):
        k = self.m.cache_key()
        return None if k is None or not self.memoizable else ("~", k)

    def structure(self):
        k = self.m.structure()
        return None if k is None or not self.memoizable else ("~", k)

    def may_have_empty_rows(self, sq, sk):
        return True

    @property
    def m(self) -> Mask:
        """The mask complemented. Read-only."""
        return self._m

    def _to(self, device):
        return Not(self.m.to(device))

    def _preview_size(self):
        return self.m._preview_size()

    def _preview_sizes(self):
        return self.m._preview_sizes()

    def _preview_cap(self):
        return self.m._preview_cap()

    def _lengths(self):
        return self.m._lengths()

    def _least(self):
        return self.m._least()

    def describe(self):
        return f"~{self.m.describe()}"

    def _allowed(self, ix):
        return ~self.m._allowed(ix)

    def _tile_bounds(self, tx):
        any_m, all_m = self.m._tile_bounds(tx)
        # sound: ~m has an allowed pair unless m is surely full; it is full only if m is surely empty
        return ~all_m, ~any_m

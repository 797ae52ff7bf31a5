"""Structured masks: causal, sliding window, padding, packed documents.

Each is a predicate over index tensors plus *exact* per-tile bounds computed from tile
corners, so classifying an ``(Sq, Sk)`` problem costs ``O(nQ * nK)``, never ``O(Sq * Sk)``.

Causal alignment, drawn for Sq=2, Sk=5 (1 = may attend)::

    lower_right (default)     upper_left
    1 1 1 1 0                 1 0 0 0 0
    1 1 1 1 1                 1 1 0 0 0

Lower-right means query ``i`` sits at key position ``i + Sk - Sq``: the last query sees the
last key, which is what decoding with a KV cache needs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .._args import counted, positive_int
from .._dtypes import check_strided, host_tensor, integer_tensor
from .._device import check_fits
from .._tracing import check_when_run, concrete, eager_under_compile, shape_text, tracing, vmapped
from .base import Index, Mask, TileIndex, one_batch, versioned

_ALIGNS = ("lower_right", "upper_left")


def _check_align(align: str) -> str:
    if align not in _ALIGNS:
        raise ValueError(f"align must be one of {_ALIGNS}, got {align!r}")
    return align


_INT64_MIN = -(1 << 63)


def _offset(align: str, sq: int, sk: int) -> int:
    return sk - sq if align == "lower_right" else 0


class Window(Mask):
    """Queries see keys whose distance ``d = (q + offset) - k`` lies in ``[0, size)``.

    ``size=None`` is plain causal attention. Built by :func:`causal` and :func:`sliding_window`.
    """

    _immutable = True
    _banded = True

    def __init__(self, size: int | None, align: str = "lower_right"):
        if size is not None:
            size = positive_int("sliding_window size", size, hint="a query sees itself and "
                                "the size-1 keys before it")
        self._size, self._align = size, _check_align(align)
        ours = type(self) is Window           # a user's subclass is a mask of its own kind
        self.kind = ("causal" if size is None else "window") if ours else "custom"
        self._key = ("window", size, self._align) if ours else None

    @property
    def size(self) -> int | None:
        """Keys a query sees (itself included); None for plain causal. Read-only."""
        return self._size

    @property
    def align(self) -> str:
        """``"lower_right"`` or ``"upper_left"``. Read-only."""
        return self._align

    def cache_key(self):
        return self._key

    def may_have_empty_rows(self, sq: int, sk: int) -> bool:
        # query q sees keys k in [q + off - size + 1, q + off] (no lower end for causal)
        off = _offset(self.align, sq, sk)
        if sq == 0:
            return False
        if off < 0 or sk == 0:                         # the first query is before every key
            return True
        return self.size is not None and (sq - 1 + off) - self.size + 1 > sk - 1

    def describe(self) -> str:
        if self.size is None:
            return f"causal(align={self.align!r})"
        return f"sliding_window({self.size}, align={self.align!r})"

    def _preview_size(self):        # fewer queries than keys: the alignment shows
        n = 8 if self.size is None else min(max(self.size + 4, 8), 16)
        return n // 2, n

    def _allowed(self, ix: Index) -> torch.Tensor:
        # 0 <= d < size as k <= q + offset < k + size: the query's edge is computed on the
        # small query index, and the (Sq, Sk) grid is only compared (no int64 distances)
        edge = ix.q + _offset(self.align, ix.sq, ix.sk)
        ok = ix.k <= edge
        if self.size is None:
            return ok
        # (saturated, never wrapped: a window near 2**63 at negative positions sees all)
        low = edge.clamp(min=_INT64_MIN + self.size) - self.size
        return ok & (ix.k > low)

    def _tile_bounds(self, tx: TileIndex):
        off = _offset(self.align, tx.sq, tx.sk)
        dmin = tx.q0 + off - tx.k1  # smallest distance in the tile
        dmax = tx.q1 + off - tx.k0  # largest distance in the tile
        if self.size is None:
            return dmax >= 0, dmin >= 0
        return (dmax >= 0) & (dmin < self.size), (dmin >= 0) & (dmax < self.size)

    def _key_span(self, tx: TileIndex):
        off = _offset(self.align, tx.sq, tx.sk)
        last = tx.q1 + off                  # (1, 1, nQ, 1): distance 0 from the tile's last query
        first = last * 0 if self.size is None else tx.q0 + off - self.size + 1
        return first, last


def causal(align: str = "lower_right") -> Window:
    """Causal mask: each query sees its own position and every earlier key.

    Args:
        align: ``"lower_right"`` (default; the last query sees the last key, right for
            decoding with a cache) or ``"upper_left"`` (query ``i`` sees keys ``0..i``).

    Example:
        >>> import multihead as mh
        >>> mh.masks.causal().materialize(3, 3)[0, 0].int().tolist()
        [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """
    return Window(None, align)


def sliding_window(size: int, *, align: str = "lower_right") -> Window:
    """Causal local window: a query sees itself and the ``size - 1`` keys before it.

    Example:
        >>> import multihead as mh
        >>> mh.masks.sliding_window(2).materialize(3, 3)[0, 0].int().tolist()
        [[1, 0, 0], [1, 1, 0], [0, 1, 1]]
    """
    return Window(size, align)


def _as_long_1d_or_2d(x, name: str) -> torch.Tensor:
    t = integer_tensor(name, x)
    if t.dim() not in (1, 2):
        raise ValueError(f"{name} must be 1-D (S,) or 2-D (B, S), got shape {shape_text(t)}")
    return t


def _not_vmapped(name: str, t: torch.Tensor) -> None:
    """Refuse values the mask reads on the host that ``torch.func.vmap`` batches (each
    sample's are its own: vmap cannot read them)."""
    if vmapped(t):
        raise ValueError(f"{name} are batched by torch.func.vmap, but the mask reads them on "
                         f"the host, for every sample at once: build the mask outside the "
                         f"vmapped function, or give each sample's as a tensor with "
                         f"multihead.masks.dense(...) (True = may attend)")


def _check_readable(name: str, t: torch.Tensor) -> None:
    """Refuse values the mask must read when built that a meta tensor does not hold, or
    that ``torch.func.vmap`` batches."""
    _not_vmapped(name, t)
    if t.device.type == "meta":
        raise ValueError(f"{name} are on the meta device, which holds no values to read when the "
                         f"mask is built: build it from real ones, then move it with .to('meta')")


def _tile_minmax(ids: torch.Tensor, tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tile min and max of ``ids`` (B, S) -> two (B, ceil(S / tile)) tensors."""
    b, s = ids.shape
    n = -(-s // tile)
    padded = torch.cat([ids, ids[:, -1:].expand(b, n * tile - s)], dim=1)  # (B, n * tile)
    tiles = padded.view(b, n, tile)                                        # (B, n, tile)
    return tiles.amin(-1), tiles.amax(-1)


def true_span(live: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ``[first, end)`` of True columns of ``live`` ``(R, N)``; ``(0, 0)`` if none.

    Example:
        >>> true_span(torch.tensor([[False, True, True, False], [False] * 4]))
        (tensor([1, 0]), tensor([3, 0]))
    """
    idx = torch.arange(live.shape[1], device=live.device)
    end = torch.where(live, idx, -1).amax(1) + 1                                   # (R,)
    first = torch.where(live, idx, live.shape[1]).amin(1)                         # (R,)
    return torch.where(end > 0, first, 0), end


class Padding(Mask):
    """Only real (non-padding) positions may be attended (``side="key"``) or may attend.

    A query-side padding mask rules out whole rows: those rows return zeros.

    Lengths are copied and validated when the mask is built, which reads them: build it
    from host (CPU) lengths and move it with ``.to(device)`` to keep that read off the GPU's
    queue. A ``(B, S)`` bool tensor on a GPU is neither copied nor read (the mask then
    reads it as it is at each call). Lengths written in place later (``mask.lengths.copy_``,
    before a CUDA graph's replay, say) are followed: what was read from the old values is
    dropped (and read again from host lengths). Built while ``torch.compile`` or
    ``torch.export`` traces, from lengths the traced function takes, host lengths are
    checked by the graph each time it runs (a RuntimeError); GPU lengths are then not
    checked (that check would be a device-side assert, which ends the CUDA context).
    """

    kind = "padding"
    _immutable = True
    _banded = True

    def __init__(self, lengths_or_mask, side: str = "key"):
        if side not in ("key", "query"):
            raise ValueError(f"side must be 'key' or 'query', got {side!r}")
        self._side = side
        t = host_tensor("padding: lengths_or_mask", lengths_or_mask, "lengths (a list of ints "
                        "or a 1-D integer tensor (B,)) or a (B, S) bool tensor",
                    "one length per sequence")
        check_strided("padding's lengths_or_mask", t)
        if t.dtype == torch.bool:
            _not_vmapped("padding's bool mask values", t)
            if t.dim() != 2:
                raise ValueError(f"padding: a bool mask must be (B, S) with True = real token, "
                                 f"got shape {shape_text(t)}")
            if t.device.type == "cpu" and not tracing():
                with versioned():
                    t = t.clone()              # a private copy: its facts stay true
            else:
                self._own_tensors = False      # the caller's tensor, read at each call
            self.lengths, self.real = None, t
        else:
            if t.is_floating_point() or t.is_complex() or t.dim() != 1:
                raise TypeError(f"padding: lengths must be a 1-D integer tensor (B,) or a (B, S) "
                                f"bool tensor, got dtype {t.dtype} and shape {shape_text(t)}")
            if not tracing():
                _check_readable("padding's lengths", t)
            with versioned():
                self.lengths, self.real = t.long().clone(), None    # a private copy, as above
        self._lengths_read = self._longest = self._fewest = None
        if not tracing():  # built while tracing: the values are unknown
            self._read_facts()

    def _read_facts(self, check: bool = True) -> None:
        # The host facts: the lengths as a host tensor (device lengths are read back: a
        # sync), the longest and the fewest real positions; a device bool mask is not read.
        # Negative lengths raise when the mask is built; written later, a call's check does.
        if self.real is None:
            host = self.lengths.cpu()
            if check and host.numel() and int(host.min()) < 0:
                raise ValueError(f"padding: lengths must be >= 0, got {host.tolist()}")
            self._lengths_read = host
            self._longest = int(host.max()) if host.numel() else 0
            self._fewest = int(host.min()) if host.numel() else 0
        elif self.real.device.type == "cpu":
            self._fewest = int(self.real.sum(1).min()) if self.real.numel() else 0
        self._stamp()

    @property
    def batch_size(self) -> int:
        # of the tensor as it is (one assigned in place of the mask's own is followed); not
        # len(): a batch traced as symbolic stays symbolic
        return self._tensors()[0].shape[0]

    @property
    def side(self) -> str:
        """``"key"`` or ``"query"``. Read-only (a tile map made for one side stays cached)."""
        return self._side

    @property
    def _host_lengths(self) -> torch.Tensor | None:
        """The lengths as a host tensor, when known without a sync."""
        return self._fact("_lengths_read")

    @property
    def _max_len(self) -> int | None:
        return self._fact("_longest")

    @property
    def _min_count(self) -> int | None:
        return self._fact("_fewest")

    def _tensors(self):
        return [self.lengths if self.real is None else self.real]

    def _to(self, device):
        return self._moved(device, "lengths", "real")

    def may_have_empty_rows(self, sq: int, sk: int) -> bool:
        return self.side == "query" or self._min_count is None or self._min_count <= 0

    def structure(self):
        if not self.memoizable:
            return None
        # (a bool mask's length is the call's Sq or Sk, which the call's structure holds
        # within a factor of 2: a padded cache's growing steps share one choice)
        return ("padding", self.side, self.batch_size, "lengths" if self.real is None
                else "bool")

    def describe(self) -> str:
        side = "" if self.side == "key" else ", side='query'"
        if self.real is not None:
            return f"padding(mask of shape {shape_text(self.real)}{side})"
        # (traced, the host copy of the lengths is a graph input: no values to format)
        if tracing() or self._host_lengths is None:
            return f"padding(lengths of shape ({concrete(self.batch_size)},){side})"
        vals = self._host_lengths.tolist()
        listed = ", ".join(map(str, vals[:6])) + (", ..." if len(vals) > 6 else "")
        return f"padding(lengths=[{listed}]{side})"

    def _preview_size(self):
        n = self.real.shape[1] if self.real is not None else max(self._max_len or 0, 1)
        return n, n                                 # (the lengths must fit: not capped)

    def _preview_cap(self):
        if self.real is None:
            return None, None
        return (None, self.real.shape[1]) if self.side == "key" else (self.real.shape[1], None)

    _lengths = _preview_cap         # a (B, S) row covers exactly its side's length

    def _least(self):               # lengths: the longest must fit its side
        n = (self._max_len or 0) if self.real is None else 0
        return (0, n) if self.side == "key" else (n, 0)

    def _check(self, batch, heads, sq, sk):
        super()._check(batch, heads, sq, sk)
        s, what = (sk, "Sk") if self.side == "key" else (sq, "Sq")
        if self.real is not None and self.real.shape[1] != s:
            raise ValueError(f"mask: {self.describe()} covers {concrete(self.real.shape[1])} "
                             f"positions but {what} = {concrete(s)}: the (B, S) mask must have "
                             f"S == {what}")
        if self.real is None and self._min_count is not None and self._min_count < 0:
            raise ValueError(f"mask: {self.describe()} has a negative length: lengths count "
                             f"real tokens (written in place since the mask was built?)")
        if self.real is None and self._max_len is not None and self._max_len > s:
            raise ValueError(f"mask: {self.describe()} has a length {concrete(self._max_len)} > "
                             f"{what} = {concrete(s)}: lengths count real tokens and cannot "
                             f"exceed the sequence")
        if tracing() and self.real is None and self._max_len is None:
            n = self.lengths                    # traced: no values to read (checked when run)
            check_when_run(n, lambda: ((n >= 0) & (n <= s)).all(),
                           f"mask: padding(side={self.side!r}) has a length < 0 or > {what}: "
                           f"lengths count real tokens and cannot exceed the sequence (lengths "
                           f"of the untruncated inputs?)")

    def _row(self, b: torch.Tensor) -> torch.Tensor:
        """Batch indices into this mask's rows: one sequence broadcasts to every batch."""
        return b * 0 if self.batch_size == 1 else b     # (an empty batch indexes nothing)

    def _allowed(self, ix: Index):
        pos = ix.k if self.side == "key" else ix.q
        if self.real is None:
            return pos < self.lengths.to(pos.device)[self._row(ix.b)]
        return self.real.to(pos.device)[self._row(ix.b), pos]

    def _tile_bounds(self, tx: TileIndex):
        first, last = (tx.k0, tx.k1) if self.side == "key" else (tx.q0, tx.q1)
        if self.real is None:
            n = self.lengths.to(first.device)[self._row(tx.b)]  # (B, 1, 1, 1)
            return first < n, last < n
        tile = tx.tile_k if self.side == "key" else tx.tile_q
        real = self.real.to(first.device).long()
        lo, hi = _tile_minmax(real, tile)           # (B, n): all real iff min == 1
        B, n = lo.shape                             # (n = 0 for no positions: no -1 to infer)
        shape = (B, 1, 1, n) if self.side == "key" else (B, 1, n, 1)
        return tx.cols((hi == 1).view(shape)), tx.cols((lo == 1).view(shape))

    def _key_span(self, tx: TileIndex):
        if self.side != "key":
            return None
        if self.real is None:
            n = self.lengths.to(tx.q0.device)[self._row(tx.b)]  # (B, 1, 1, 1)
            return n * 0, n - 1
        first, end = true_span(self.real.to(tx.q0.device))      # (B,) real keys
        return first.view(-1, 1, 1, 1), end.view(-1, 1, 1, 1) - 1


def padding(lengths_or_mask, *, side: str = "key") -> Padding:
    """Padding mask from per-sequence lengths ``(B,)`` or a ``(B, S)`` bool tensor (True = real).

    Args:
        lengths_or_mask: lengths (right padding: positions ``>= length`` are padding), or
            a bool tensor for any layout (left padding included).
        side: ``"key"`` (default) hides padded keys; ``"query"`` marks padded queries,
            whose rows return zeros.

    Example:
        >>> import torch, multihead as mh
        >>> mh.masks.padding(torch.tensor([2, 3])).materialize(1, 3)[:, 0, 0].int().tolist()
        [[1, 1, 0], [1, 1, 1]]
    """
    return Padding(lengths_or_mask, side)


class DocumentRuns(NamedTuple):
    """Where a document mask's documents lie, on the host: per row of ids (``B'`` rows),
    the start and length of every run of equal ids.

    Attributes:
        contiguous: True when every document id forms one run in its row (what packing
            produces); False when an id occurs in two separate places.
        starts: one ``(runs,)`` int64 host tensor per row.
        lengths: one ``(runs,)`` int64 host tensor per row.
    """

    contiguous: bool
    starts: list
    lengths: list


def _find_runs(ids: torch.Tensor) -> DocumentRuns:
    """The runs of equal values in each row of a host tensor ``(B', S)``."""
    S = ids.shape[1]
    change = torch.ones_like(ids, dtype=torch.bool)                     # (B', S): a run starts
    change[:, 1:] = ids[:, 1:] != ids[:, :-1]
    starts = [row.nonzero().flatten() for row in change]
    contiguous = all(len(st) == row.unique().numel() for st, row in zip(starts, ids))
    lengths = [torch.diff(st, append=torch.tensor([S], device=st.device)) for st in starts]
    return DocumentRuns(contiguous, starts, lengths)


#: why cu_seqlens cannot be read while a graph is traced
_OFFSETS_TRACED = ("document(cu_seqlens=...) reads the offsets when the mask is built (the "
                   "ids' length is their last entry), which a traced graph or fake tensors "
                   "cannot: build the mask outside the compiled, exported or make_fx-traced "
                   "function (or FakeTensorMode), or pass ids "
                   "(torch.bucketize(torch.arange(S), cu_seqlens[1:], right=True))")


@eager_under_compile(_OFFSETS_TRACED)
def _offsets_to_ids(cu_seqlens) -> torch.Tensor:
    """The document id of each position ``(total,)`` from cumulative lengths (read on the
    host: under ``torch.compile`` a graph break; ``fullgraph=True`` and ``torch.export``
    refuse it with the reason)."""
    if tracing():        # torch.export, fake tensors: no graph break to run it in
        raise ValueError(f"document: {_OFFSETS_TRACED}")
    cu = _as_long_1d_or_2d(cu_seqlens, "cu_seqlens")
    _check_readable("document's cu_seqlens", cu)
    if cu.dim() != 1 or len(cu) < 1 or int(cu[0]) != 0 or bool((cu.diff() < 0).any()):
        raise ValueError(f"document: cu_seqlens must be 1-D, start at 0 and never "
                         f"decrease, got {cu.tolist()[:10]}")
    total = int(cu[-1])
    need = 16 * total                                                  # (positions and ids)
    check_fits(need, cu.device, f"document: cu_seqlens ends at {total:,} tokens, whose ids "
               f"would take", "is its last entry the total length of the packed documents?")
    return ids_from_offsets(cu, total)


def ids_from_offsets(cu_seqlens: torch.Tensor, length) -> torch.Tensor:
    """The document id of each of ``length`` positions ``(length,)`` from cumulative
    lengths ``cu_seqlens (documents + 1,)`` (position ``j`` is in document ``d`` where
    ``cu_seqlens[d] <= j < cu_seqlens[d + 1]``). Reads no value: traceable with a symbolic
    ``length``.

    Example:
        >>> import torch
        >>> ids_from_offsets(torch.tensor([0, 2, 5]), 5).tolist()
        [0, 0, 1, 1, 1]
    """
    pos = torch.arange(length, device=cu_seqlens.device)                 # (length,)
    return torch.bucketize(pos, cu_seqlens[1:], right=True)


class Document(Mask):
    """Packed sequences: a query attends only to keys of the same document id.

    The mask keeps a copy of its ids. Built from host (CPU) ids or ``cu_seqlens``, it knows
    where its documents lie without reading a device tensor, also after ``.to(device)``;
    see :meth:`runs`. ``cu_seqlens`` on a GPU are read once, when the mask is built. Ids
    written in place later (``mask.ids.copy_``, before a CUDA graph's replay, say) are
    followed: where the documents lay is forgotten (and found again from host ids).
    """

    kind = "document"
    _immutable = True
    _banded = True
    #: built from cu_seqlens (its last entry is the ids' length): errors name it
    _from_cu_seqlens = False

    def __init__(self, ids=None, *, kv_ids=None, cu_seqlens=None):
        if (ids is None) == (cu_seqlens is None):
            raise ValueError("document: pass exactly one of ids (per-token document ids) or "
                             "cu_seqlens (cumulative lengths starting at 0)")
        if cu_seqlens is not None:
            ids = _offsets_to_ids(cu_seqlens)
            self._from_cu_seqlens = True
        self._runs = None                                  # DocumentRuns, once known
        with versioned():
            self.ids = _as_long_1d_or_2d(ids, "ids").clone()   # private: its runs stay true
        _not_vmapped("document's ids", self.ids)
        if self.ids.dim() == 1:
            self.ids = self.ids.unsqueeze(0)                          # (1, S)
        self.kv_ids = None
        if kv_ids is not None:
            with versioned():
                self.kv_ids = _as_long_1d_or_2d(kv_ids, "kv_ids").clone()
            _not_vmapped("document's kv_ids", self.kv_ids)
            if self.kv_ids.dim() == 1:
                self.kv_ids = self.kv_ids.unsqueeze(0)                # (1, Sk)
        self.batch_size                                    # (raises if the rows disagree)

    @property
    def batch_size(self) -> int | None:
        return one_batch("document", {"ids": self.ids.shape[0], "kv_ids": None if self.kv_ids
                                      is None else self.kv_ids.shape[0]})

    def _tensors(self):
        return [self.ids] + ([self.kv_ids] if self.kv_ids is not None else [])

    def _to(self, device):
        if self.ids.device.type == "cpu" and self.kv_ids is None:
            self.runs()                                    # free on the host: take it along
        return self._moved(device, "ids", "kv_ids")

    @property
    def runs_known(self) -> bool:
        """True when :meth:`runs` needs no read of a device tensor (never while
        ``torch.compile`` traces: a graph's tensors have no values to read)."""
        if tracing():
            return False
        return self.ids.device.type == "cpu" or (self._runs is not None and self._facts_hold())

    def runs(self) -> DocumentRuns:
        """Where the documents lie (host tensors), computed once.

        Free for masks built from host ids or ``cu_seqlens`` (also after ``.to(device)``);
        for ids that were born on a GPU, the first call reads them back (a host sync).

        Example:
            >>> import torch, multihead as mh
            >>> r = mh.masks.document(torch.tensor([0, 0, 1, 1, 1])).runs()
            >>> r.contiguous, r.starts[0].tolist(), r.lengths[0].tolist()
            (True, [0, 2], [2, 3])
        """
        if self._runs is None or not self._facts_hold():     # (ids written since: again)
            self._runs = _find_runs(self.ids.cpu())
            self._stamp()
        return self._runs

    def segments(self, batch: int) -> torch.Tensor | None:
        """Where each of ``batch`` sequences' documents lie: host rows ``(b, first,
        length)`` of shape ``(documents, 3)``, int64, a shared row of ids repeated for every
        sequence; None when an id occurs in two separate runs (not packing). Built from
        :meth:`runs` (free for host ids), once per batch size.

        Example:
            >>> import torch, multihead as mh
            >>> mh.masks.document(torch.tensor([0, 0, 1])).segments(2).tolist()
            [[0, 0, 2], [0, 2, 1], [1, 0, 2], [1, 2, 1]]
        """
        return self.cached("segments", (batch,), lambda: self._segments(batch))

    def _segments(self, batch: int) -> torch.Tensor | None:
        runs = self.runs()
        if not runs.contiguous:
            return None
        rows = [torch.zeros(0, 3, dtype=torch.long, device="cpu")]              # host runs
        for b in range(batch):                    # runs of one row (shared) or of B rows
            r = b if len(runs.starts) > 1 else 0
            n = len(runs.starts[r])
            rows.append(torch.stack([torch.full((n,), b, device="cpu"), runs.starts[r],
                                     runs.lengths[r]], 1))
        return torch.cat(rows)                                        # (documents, 3)

    def may_have_empty_rows(self, sq: int, sk: int) -> bool:
        return self.kv_ids is not None            # without kv_ids every query sees itself

    def structure(self):
        if not self.memoizable:
            return None
        # rows only: the lengths are the call's (as padding's)
        kv = None if self.kv_ids is None else self.kv_ids.shape[0]
        return ("document", self.ids.shape[0], kv, self.runs_known)

    def describe(self):
        if self.runs_known and self.ids.numel():
            n = counted(sum(len(s) for s in self.runs().starts), "run")
        else:
            n = f"on {self.ids.device}"
        extra = "" if self.kv_ids is None else f", kv_ids of shape {shape_text(self.kv_ids)}"
        return f"document(ids of shape {shape_text(self.ids)}, {n}{extra})"

    def _preview_size(self):                    # (one id per key: not capped)
        n = self.ids.shape[1]
        return n, (n if self.kv_ids is None else self.kv_ids.shape[1])

    def _preview_cap(self):
        kv = self.ids if self.kv_ids is None else self.kv_ids
        return self.ids.shape[1], kv.shape[1]

    def _lengths(self):            # without kv_ids, the queries are any last Sq of the keys
        return None if self.kv_ids is None else self.ids.shape[1], self._preview_cap()[1]

    def _check(self, batch, heads, sq, sk):
        super()._check(batch, heads, sq, sk)
        if self.kv_ids is None and sq > sk:
            raise ValueError(f"mask: {self.describe()} without kv_ids aligns queries with the last "
                             f"Sq keys, but Sq = {concrete(sq)} > Sk = {concrete(sk)}: pass ids "
                             f"(length Sq) and kv_ids (length Sk)")
        if self.kv_ids is None and self.ids.shape[1] != sk and self._from_cu_seqlens:
            raise ValueError(f"mask: {self.describe()} was built from cu_seqlens ending at "
                             f"{concrete(self.ids.shape[1])}, but Sk = {concrete(sk)}: the last "
                             f"entry of cu_seqlens is the packed length, which must be Sk")
        if self.kv_ids is None and self.ids.shape[1] != sk:
            raise ValueError(
                f"mask: {self.describe()} has {concrete(self.ids.shape[1])} ids but Sk = "
                f"{concrete(sk)}: give one id per key (queries are the last Sq of them), or "
                f"pass kv_ids for cross-attention")
        if self.kv_ids is not None and (self.ids.shape[1] != sq or self.kv_ids.shape[1] != sk):
            raise ValueError(f"mask: {self.describe()} needs ids of length Sq = {concrete(sq)} "
                             f"and kv_ids of length Sk = {concrete(sk)}")

    def _q_k_ids(self, sq: int, sk: int, device):
        ids = self.ids.to(device)
        if self.kv_ids is None:
            return ids[:, sk - sq:], ids                               # (B', Sq), (B', Sk)
        return ids, self.kv_ids.to(device)

    def _allowed(self, ix: Index):
        qid, kid = self._q_k_ids(ix.sq, ix.sk, ix.q.device)               # (B', Sq), (B', Sk)
        # one row of ids serves every sequence: the sequence's own row by clamping (b of a
        # batch of B' rows is below B'; one row is row 0), not by a test of the row count,
        # which would be a guard on a batch size torch.export traces as dynamic; ix.b may
        # name some sequences only (repr draws sequence 0)
        row = lambda ids: ix.b.clamp(max=ids.shape[0] - 1)
        return qid[row(qid), ix.q] == kid[row(kid), ix.k]

    def _tile_bounds(self, tx: TileIndex):
        qid, kid = self._q_k_ids(tx.sq, tx.sk, tx.q0.device)
        qlo, qhi = _tile_minmax(qid, tx.tile_q)        # (B', nQ)
        klo, khi = _tile_minmax(kid, tx.tile_k)        # (B', nK)
        qlo, qhi = qlo[:, None, :, None], qhi[:, None, :, None]  # (B', 1, nQ, 1)
        klo, khi = tx.cols(klo[:, None, None, :]), tx.cols(khi[:, None, None, :])  # (B', 1, 1, nK)
        any_ = (qlo <= khi) & (klo <= qhi)
        all_ = (qlo == qhi) & (klo == khi) & (qlo == klo)
        return any_, all_

    def _key_span(self, tx: TileIndex):
        qid, kid = self._q_k_ids(tx.sq, tx.sk, tx.q0.device)       # (B', Sq), (B', Sk)
        if kid.shape[1] > 1 and not bool((kid[:, 1:] >= kid[:, :-1]).all()):
            return None                     # ids out of order: a document's keys may be anywhere
        qlo, qhi = _tile_minmax(qid, tx.tile_q)                     # (B', nQ)
        b = max(len(qlo), len(kid))
        kid, qlo, qhi = (t.expand(b, t.shape[1]).contiguous() for t in (kid, qlo, qhi))
        first = torch.searchsorted(kid, qlo)                        # (B, nQ) keys of the
        last = torch.searchsorted(kid, qhi, right=True) - 1         # tile's least/greatest id
        return first[:, None, :, None], last[:, None, :, None]      # (B, 1, nQ, 1)


def document(ids=None, *, kv_ids=None, cu_seqlens=None) -> Document:
    """Packed-sequence mask: tokens attend only within their own document.

    Args:
        ids: per-token document ids, ``(S,)`` or ``(B, S)`` (S = Sk; queries are the last
            Sq positions, matching lower-right causal alignment).
        kv_ids: ids of the keys when they differ from the queries' (cross-attention);
            ``ids`` then has length Sq.
        cu_seqlens: cumulative document lengths ``[0, l0, l0+l1, ...]`` instead of ``ids``.

    Example:
        >>> import torch, multihead as mh
        >>> m = mh.masks.document(cu_seqlens=torch.tensor([0, 2, 3]))
        >>> m.materialize(3, 3)[0, 0].int().tolist()
        [[1, 1, 0], [1, 1, 0], [0, 0, 1]]
    """
    return Document(ids, kv_ids=kv_ids, cu_seqlens=cu_seqlens)

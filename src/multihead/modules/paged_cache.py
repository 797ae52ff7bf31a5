"""A paged KV cache: one shared pool of fixed-size pages and a block table per sequence.

Sequences are added and freed independently (continuous batching); memory grows with the
tokens stored, not with a maximum length. A forward runs on a batch of live sequences,
``cache.batch([id_a, id_b])``; each sequence's keys are gathered from its pages and
right-aligned, so ``mh.masks.causal()`` (lower-right) is right for every sequence whatever
its length.

The host keeps the bookkeeping it decides with (block tables, slots written, which sequences
were written with ``valid``), and works out from it the pool slots a write fills; per step,
these and the batch's block tables reach the device in one non-blocking copy. The gather's
slot indices, key validity and real-token counts are computed on the device, so a forward
never waits for it. Cross-attention contexts are not paged: use a
:class:`KVCache` for those.

Notation used for tensor shapes:
    P pages, p page_size, Hkv K/V heads, D head_dim, Dv value dim, B sequences in a batch,
    n new tokens, L longest sequence of the batch.
"""

from __future__ import annotations

import array
import functools
import numbers
import weakref
from typing import NamedTuple

import torch

from .._device import to_device
from .._args import positive_int
from .._tracing import valueless
from .kv_cache import _CacheBase


def _slot(table: torch.Tensor, pos: torch.Tensor, page_size: int) -> torch.Tensor:
    """Pool slots of token positions: ``table`` (B, Pmax) page ids, ``pos`` (B, m) -> (B, m)."""
    return table.gather(1, pos // page_size) * page_size + pos % page_size


#: a write or a gather of at most this many slots in all (batch x tokens) works them out
#: in plain Python on the host, one run per page (a decoding step: a few operations); a
#: larger one with the vectorized formula of :func:`_slot` (a prefill, a long gather), whose
#: few ops cost less than Python's per-slot work past about this size (2-core Xeon)
HOST_SLOTS = 512


def _longs(values: list[int]) -> torch.Tensor:
    """``values`` as an int64 CPU tensor, through a C array (``torch.tensor`` of a long
    list costs about 110 ns an element, this about 15).

    Example:
        >>> _longs([3, 1, 4]).tolist(), _longs([]).shape
        ([3, 1, 4], torch.Size([0]))
    """
    if not values:
        return torch.empty(0, dtype=torch.long, device="cpu")
    if valueless():                 # (frombuffer makes a real tensor inside a fake mode)
        return torch.tensor(values, dtype=torch.long, device="cpu")
    return torch.frombuffer(array.array("q", values), dtype=torch.long)


def _host_slots(table: list[int], start: int, n: int, page_size: int) -> list[int]:
    """Pool slots of one sequence's positions ``start .. start + n - 1``, on the host: one
    run of consecutive slots per page they touch (a decoding step's one slot costs a few
    Python operations, not the torch ops that :func:`_slot` costs).

    Example:
        >>> _host_slots([3, 1, 0], 1, 4, 2)    # positions 1..4: page 3's second slot, ...
        [7, 2, 3, 0]
    """
    out, j, end = [], start, start + n
    while j < end:
        page = j // page_size
        stop = min(end, (page + 1) * page_size)
        shift = (table[page] - page) * page_size             # slot of position i: i + shift
        out.extend(range(j + shift, stop + shift))
        j = stop
    return out


class UnknownSequence(KeyError):
    """A sequence id the pool does not hold (never given, or freed); a ``KeyError`` whose
    message is shown as written (a plain ``KeyError`` shows it quoted)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class PagedKVCache(_CacheBase):
    """A pool of ``num_pages`` pages of ``page_size`` token slots, shared by sequences.

    The buffers' ``dtype`` and ``device`` default to torch's defaults, as a module's
    parameters do (pass the module's where they differ).

    Example:
        >>> import torch, multihead as mh
        >>> attn = mh.MultiHeadAttention(32, 4, num_kv_heads=1).eval()
        >>> pool = mh.PagedKVCache(num_pages=8, page_size=4, num_kv_heads=1, head_dim=8)
        >>> a, b = pool.add_sequence(), pool.add_sequence()
        >>> y = attn(torch.randn(2, 3, 32), cache=pool.batch([a, b]), mask=mh.masks.causal())
        >>> y = attn(torch.randn(1, 2, 32), cache=pool.batch([b]), mask=mh.masks.causal())
        >>> pool.length(a), pool.length(b), pool.pages_used
        (3, 5, 3)
        >>> pool.free(b); pool.pages_used
        1

    Shapes:
        k (P*p, Hkv, D), v (P*p, Hkv, Dv) (slot-major), valid (P*p,).
    """

    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int, *,
                 value_dim: int | None = None, dtype: torch.dtype | None = None, device=None):
        P = positive_int("num_pages", num_pages, hint="the pool's size in pages, e.g. 1024")
        p = positive_int("page_size", page_size, hint="token slots per page, e.g. 16")
        self.num_pages, self.page_size = P, p
        fk = self._geometry(num_kv_heads, head_dim, value_dim, dtype, device, P * p,
                            f"num_pages={P} x page_size={p}")
        self.k = torch.zeros(P * p, self.num_kv_heads, self.head_dim, **fk)     # (P*p, Hkv, D)
        self.v = torch.zeros(P * p, self.num_kv_heads, self.value_dim, **fk)    # (P*p, Hkv, Dv)
        self.valid = torch.zeros(P * p, dtype=torch.bool, device=self.device)   # (P*p,)
        self._free = list(range(P))
        self._tables: dict[int, list[int]] = {}
        self._written: dict[int, int] = {}     # slots written per sequence (host ints)
        self._real: dict[int, torch.Tensor] = {}   # real tokens per sequence, 0-dim on the device
        self._padded: set[int] = set()         # sequences written with `valid` (host flags)
        self._zero = torch.zeros((), dtype=torch.long, device=self.device)   # never written to
        self._next_id = 0                      # (an int, not itertools.count: Python 3.14
        #                                        cannot copy or pickle one)
        self._frees = 0                        # sequences freed so far (a batch's check)

    def __setstate__(self, state: dict) -> None:
        """A pool pickled before ids were counted with an int (``_ids``, an
        ``itertools.count``) goes on from the id it would have given next."""
        ids = state.pop("_ids", None)
        if "_next_id" not in state:
            state["_next_id"] = next(ids) if ids is not None else 0
        self.__dict__.update(state)

    def _calls_open(self) -> bool:
        """A batch of this pool between ``begin()`` and its end (not one that is gone)."""
        return any(b._journal is not None for b in self.__dict__.get("_open", ()))

    # -- sequences ---------------------------------------------------------------------
    def add_sequence(self) -> int:
        """Start a new, empty sequence; returns its id (no page is taken until it writes)."""
        sid, self._next_id = self._next_id, self._next_id + 1
        self._tables[sid], self._written[sid], self._real[sid] = [], 0, self._zero
        return sid

    def _check_id(self, sid) -> int:
        """``sid`` as the int :meth:`add_sequence` gave, if live: a bool, a float or a tensor
        is refused (``True == 1`` would name sequence 1)."""
        if isinstance(sid, bool) or not isinstance(sid, numbers.Integral):
            hint = ": pass int(...) of it" if isinstance(sid, torch.Tensor) else ""
            raise TypeError(f"a sequence id is the int add_sequence() returned, got {sid!r} "
                            f"({type(sid).__name__}){hint}")
        if sid not in self._tables:
            raise UnknownSequence(f"unknown sequence id {sid!r}: live sequences are "
                                  f"{sorted(self._tables)}")
        return int(sid)

    def free(self, sid: int) -> None:
        """Return a sequence's pages to the pool, zeroed (every slot holding no token holds
        zeros: see :mod:`.kv_cache`); its id is no longer valid.

        Example:
            >>> import torch, multihead as mh
            >>> pool = mh.PagedKVCache(num_pages=4, page_size=2, num_kv_heads=1, head_dim=4)
            >>> sid = pool.add_sequence()
            >>> _ = pool.batch([sid]).update(torch.ones(1, 1, 3, 4), torch.ones(1, 1, 3, 4))
            >>> pool.free(sid); pool.pages_used, pool.k.abs().sum().item()
            (0, 0.0)
        """
        sid = self._check_id(sid)
        self._check_writable(f"free sequence {sid}")
        pages = self._tables[sid]
        if pages:                                  # every slot of its pages (m*p,)
            ar = torch.arange(len(pages) * self.page_size, device="cpu")
            slots = _slot(_longs(pages)[None], ar[None], self.page_size).flatten()
            slots = to_device(slots, self.device)      # worked out on the host
            for t in self._slot_tensors():
                self._clear(slots, t)
        self._free.extend(self._tables.pop(sid))
        self._frees += 1
        del self._written[sid], self._real[sid]
        self._padded.discard(sid)

    def _return(self, table: list[int], pages: list[int]) -> None:
        """Give a live sequence's ``pages`` (the last a write took, in the order taken) back
        to the free list, in its order, from any point of their taking: off the end of its
        ``table`` if they are there, and onto the free list unless they still are on it.

        Example:
            >>> pool = PagedKVCache(num_pages=4, page_size=2, num_kv_heads=1, head_dim=4)
            >>> table = [pool._free.pop(), pool._free.pop()]; pool._free, table
            ([0, 1], [3, 2])
            >>> pool._return(table, [3, 2]); pool._free, table
            ([0, 1, 2, 3], [])
        """
        m = len(pages)
        if m and table[-m:] == pages:
            del table[-m:]
        free = set(self._free)
        self._free.extend(pg for pg in reversed(pages) if pg not in free)

    def _clear(self, slots: torch.Tensor, t: torch.Tensor) -> None:
        # these slots of buffer t (k, v or valid) hold no token: zeros (False)
        t.index_fill_(0, slots, 0)

    def length(self, sid: int) -> int:
        """Real tokens stored for sequence ``sid``.

        An explicit host query: the count lives on the device (it depends on ``valid``), so
        this reads it back and synchronizes; forwards never call it.
        """
        return int(self._real[self._check_id(sid)])

    @property
    def sequences(self) -> list[int]:
        """Ids of the live sequences."""
        return sorted(self._tables)

    @property
    def pages_used(self) -> int:
        """Pages held by live sequences (``num_pages`` minus the free ones)."""
        return self.num_pages - len(self._free)

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V held by pages in use (grows with the tokens stored)."""
        return self.pages_used * self.page_size * self.bytes_per_token()

    def batch(self, seq_ids) -> "PagedBatch":
        """The cache view a forward uses for these sequences (rows of x in this order).

        Args:
            seq_ids: a list (or tuple) of distinct ids from :meth:`add_sequence`.

        Example:
            >>> pool = PagedKVCache(num_pages=4, page_size=2, num_kv_heads=1, head_dim=4)
            >>> a, b = pool.add_sequence(), pool.add_sequence()
            >>> pool.batch([b, a]).ids
            [1, 0]
            >>> pool.batch([True])
            Traceback (most recent call last):
            ...
            TypeError: a sequence id is the int add_sequence() returned, got True (bool)
        """
        if not isinstance(seq_ids, (list, tuple)):
            raise TypeError(f"batch takes a list of sequence ids, got {seq_ids!r} "
                            f"({type(seq_ids).__name__}): e.g. pool.batch([sid])")
        ids = [self._check_id(sid) for sid in seq_ids]
        if not ids:
            raise ValueError("batch needs at least one sequence id, got none: e.g. "
                             "pool.batch([pool.add_sequence()])")
        twice = sorted({s for s in ids if ids.count(s) > 1})
        if twice:
            raise ValueError(f"batch needs distinct sequence ids, got {ids} ({twice} more than "
                             f"once): one row of x per sequence")
        return PagedBatch(self, ids)

    def __repr__(self) -> str:
        return (f"PagedKVCache(num_pages={self.num_pages}, page_size={self.page_size}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"sequences={len(self._tables)}, pages_used={self.pages_used}, "
                f"{str(self.dtype).replace('torch.', '')}, {self.device}, "
                f"{(self.k.nbytes + self.v.nbytes) / 2**20:.1f} MiB)")

    # -- slots ---------------------------------------------------------------------------
    def _device_tables(self, ids: list[int], n: int = 0) -> tuple[torch.Tensor, ...]:
        """Slots written once ``n`` more are ``(B,)``, block tables ``(B, Pmax)`` (padded
        with page 0), the pool slots of each sequence's next ``n`` positions ``(B*n,)``,
        and the slots written again ``(B,)`` in memory of their own (the real-token counts
        of sequences without padding, which a caller's in-place change of the first cannot
        reach), on the device: worked out on the host (the tables are host lists) and sent
        in one copy that does not wait, so a write launches no kernel to find its slots.

        Example:
            >>> pool = PagedKVCache(num_pages=4, page_size=2, num_kv_heads=1, head_dim=4)
            >>> a = pool.add_sequence(); pool._tables[a], pool._written[a] = [3, 1], 3
            >>> [t.tolist() for t in pool._device_tables([a], 1)]   # position 3: page 1, slot 1
            [[4], [[3, 1]], [3], [4]]
        """
        B, tables = len(ids), [self._tables[s] for s in ids]
        pmax = max(1, max(map(len, tables)))
        written = [self._written[s] for s in ids]
        after, flat = [w + n for w in written], []
        for table in tables:
            flat += table + [0] * (pmax - len(table))
        if B * n <= HOST_SLOTS:               # a decoding step's few slots: plain Python
            slots = [x for t, w in zip(tables, written) for x in _host_slots(t, w, n, self.page_size)]
            host = _longs(after + flat + slots + after)
        else:                                 # a prefill's many: the vectorized formula
            head = _longs(after + flat)                                   # (B + B*Pmax,)
            pos = _longs(written)[:, None] + torch.arange(n, device="cpu")          # (B, n)
            slots = _slot(head[B:].view(B, pmax), pos, self.page_size)               # (B, n)
            host = torch.cat([head, slots.flatten(), head[:B]])
        dev = to_device(host, self.device)
        ends = (B, B * (1 + pmax), B * (1 + pmax + n))
        return (dev[:ends[0]], dev[ends[0]:ends[1]].view(B, pmax),          # (B,), (B, Pmax),
                dev[ends[1]:ends[2]], dev[ends[2]:])                        # (B*n,), (B,)


class PagedView(NamedTuple):
    """A batch's keys and values where they lie: the pool, each sequence's block table
    ``(B, pages)`` and length ``(B,)`` on the device, the longest length (host) and the
    page size. Sequence ``b``'s key ``j`` is slot ``table[b, j // page_size] * page_size +
    j % page_size`` of ``k`` ``(P*p, Hkv, D)`` and ``v`` ``(P*p, Hkv, Dv)``."""

    k: torch.Tensor
    v: torch.Tensor
    table: torch.Tensor
    lengths: torch.Tensor
    max_len: int
    page_size: int


class PagedBatch(_CacheBase):
    """A batch of live sequences of a :class:`PagedKVCache`, used as ``cache=`` by a module."""

    cross = False

    def __init__(self, pool: PagedKVCache, ids: list[int]):
        self.pool, self.ids, self.batch_size = pool, ids, len(ids)
        self._frees = pool._frees              # none of ids is freed before this count
        for a in ("num_kv_heads", "head_dim", "value_dim", "dtype", "device"):
            setattr(self, a, getattr(pool, a))

    def _slot_tensors(self):
        return self.pool._slot_tensors()

    def __repr__(self) -> str:
        lengths = [self.pool.length(s) if s in self.pool._tables else "freed" for s in self.ids]
        return f"PagedBatch(ids={self.ids}, lengths={lengths}, pool={self.pool!r})"

    # its undo steps act on the pool: the pool notes the batch (weakly: one dropped while
    # its call is open does not hold the pool) and refuses to be copied meanwhile
    def begin(self) -> None:
        """As :meth:`KVCache.begin`; refused too while another batch's open call holds one of
        this batch's sequences (its rollback could not undo this call's pages)."""
        self._refuse_nested("this batch")
        open_calls = self.pool.__dict__.setdefault("_open", weakref.WeakSet())
        busy = sorted({s for b in open_calls if b._journal is not None for s in b.ids}
                      .intersection(self.ids))
        if busy:
            raise RuntimeError(
                f"PagedBatch: a call writing sequence(s) {busy} is still open (a forward called "
                f"from inside another that uses them, from a hook say); nothing was written. "
                f"Write them after the outer call returns, or use other sequences")
        open_calls.add(self)
        super().begin()

    def _end_call(self) -> None:
        self.pool.__dict__.get("_open", weakref.WeakSet()).discard(self)
        super()._end_call()

    def _real_counts(self) -> torch.Tensor:
        self._check_live()
        return torch.stack([self.pool._real[s] for s in self.ids])              # (B,)

    def _host_counts(self) -> list[int] | None:
        self._check_live()
        return None if self.padded else [self.pool._written[s] for s in self.ids]

    def _check_live(self) -> None:
        """Refuse a batch whose sequences were freed since it was made (looked up only
        when the pool freed any since the last look: a step asks several times)."""
        if self._frees == self.pool._frees:
            return
        gone = [s for s in self.ids if s not in self.pool._tables]
        if gone:
            raise ValueError(f"cache: sequence(s) {gone} of this PagedKVCache batch were freed "
                             f"(live sequences: {self.pool.sequences}); make a new batch of live "
                             f"ids with pool.batch([...])")
        self._frees = self.pool._frees

    def check_compatible(self, *sizes) -> None:
        """Also refuses a batch whose sequences were freed since it was made."""
        self._check_live()
        super().check_compatible(*sizes)

    def store_context(self, k, v) -> None:
        """Refused: a paged pool holds self-attention tokens only (nothing is written)."""
        raise TypeError("cache: a PagedKVCache batch does not hold cross-attention contexts; "
                        "for cross-attention use a KVCache, e.g. module.make_cache(batch_size, "
                        "context_len), and give context on the first call")

    def update(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None = None):
        """Append ``n`` tokens to every sequence of the batch; returns right-aligned
        ``(k_all (B, Hkv, L, D), v_all, key_valid (B, L) or None)``. Checks the pool has room
        first (a refused write changes nothing)."""
        out = self._gather(*self._write(k, v, valid))
        self.pool._drop_history()                                          # the views keep it
        return out

    def update_in_place(self, k: torch.Tensor, v: torch.Tensor) -> "PagedView":
        """Append ``n`` tokens to every sequence (no ``valid``: all real), and return the
        :class:`PagedView` kernels read the pages through, instead of gathering them.

        Example:
            >>> import torch, multihead as mh
            >>> pool = mh.PagedKVCache(num_pages=4, page_size=2, num_kv_heads=1, head_dim=4)
            >>> batch = pool.batch([pool.add_sequence()])
            >>> view = batch.update_in_place(torch.ones(1, 1, 3, 4), torch.ones(1, 1, 3, 4))
            >>> view.max_len, view.lengths.tolist(), view.table.shape
            (3, [3], torch.Size([1, 2]))
        """
        if self.padded:
            raise ValueError(
                f"update_in_place: sequences {sorted(self.pool._padded.intersection(self.ids))} "
                f"hold padding (written with valid=), which a PagedView's lengths cannot mark: "
                f"use update(), which returns the keys' validity; nothing was written")
        lengths, table = self._write(k, v, None)
        pool = self.pool
        view = PagedView(pool.k, pool.v, table, lengths, max(pool._written[s] for s in self.ids),
                         pool.page_size)
        pool._drop_history()                                               # the view keeps it
        return view

    @property
    def padded(self) -> bool:
        """True when a sequence of the batch holds padding (written with ``valid``)."""
        return bool(self.pool._padded.intersection(self.ids))

    def _write(self, k, v, valid):
        """Write the new tokens; returns the device lengths ``(B,)`` and block table."""
        pool, p = self.pool, self.pool.page_size
        self._check_live()
        valid = self._check_new(k, v, valid)
        n = k.shape[2]
        need = [-(-(pool._written[s] + n) // p) - len(pool._tables[s]) for s in self.ids]
        if sum(need) > len(pool._free):
            raise ValueError(f"PagedKVCache is out of pages: this step needs {sum(need)} more page(s) "
                             f"but {len(pool._free)} of {pool.num_pages} are free; nothing was "
                             f"written. Free finished sequences, or build a larger pool")
        taken = {}                     # the pages this write takes, per sequence
        saved = {s: (pool._written[s], pool._real[s], s in pool._padded) for s in self.ids}
        slots = None                   # the slots written (they held no token: zeros)
        B, Hkv = len(self.ids), self.num_kv_heads

        def undo():                    # for the sequences still live (one freed before the
            live = [b for b, sid in enumerate(self.ids) if sid in pool._tables]  # rollback):
            try:                                           # their slots zero again, their
                if slots is not None and live:             # pages back to the pool in its
                    rows = slots.view(B, n) if len(live) == B else slots.view(B, n).index_select(
                        0, to_device(torch.tensor(live), slots.device))     # order, their
                    pool._put_back(*(functools.partial(pool._clear, rows.flatten(), t)  # counts
                                     for t in pool._slot_tensors()))      # as they were (even
            finally:                                                      # if a clear fails)
                for sid, pages in reversed(list(taken.items())):
                    if sid in pool._tables:
                        pool._return(pool._tables[sid], pages)
                for sid, (written, real, padded) in saved.items():
                    if sid in pool._tables:
                        pool._written[sid], pool._real[sid] = written, real
                        (pool._padded.add if padded else pool._padded.discard)(sid)

        def write():
            nonlocal slots
            for sid, m in zip(self.ids, need):
                got = taken[sid] = pool._free[len(pool._free) - m:][::-1]  # as pop() takes them
                del pool._free[len(pool._free) - m:]
                pool._tables[sid] += got
            after, table, slots, real = pool._device_tables(self.ids, n)
            pool.k.index_copy_(0, slots, k.transpose(1, 2).reshape(B * n, Hkv, self.head_dim))
            pool.v.index_copy_(0, slots, v.transpose(1, 2).reshape(B * n, Hkv, self.value_dim))
            if valid is None:                                             # (B*n, Hkv, D) above
                pool.valid.index_fill_(0, slots, True)
                counts = real if not self.padded else self._real_counts() + n      # (B,)
            else:
                pool.valid.index_copy_(0, slots, valid.reshape(B * n))
                counts = self._real_counts() + valid.sum(1)                        # (B,)
                if n:                                  # (nothing written: still unpadded)
                    pool._padded.update(self.ids)
            for b, sid in enumerate(self.ids):
                pool._written[sid] += n
                pool._real[sid] = counts[b]              # a view: nothing copied or read back
            return after, table
        return self._change(undo, write)

    def _gather(self, lens: torch.Tensor, table: torch.Tensor):
        """Each sequence's keys/values, right-aligned to the longest: ``(B, Hkv, L, D)``, and
        which of those keys are real ``(B, L)`` (None when the host knows they all are)."""
        pool, B, p = self.pool, len(self.ids), self.pool.page_size
        written = [pool._written[s] for s in self.ids]
        L = max(written)
        if B * L <= HOST_SLOTS:       # the slots of each row, on the host: its padding reads
            rows = []                 # the slot of its position 0 (masked below), as clamped
            for sid, w in zip(self.ids, written):                      # positions do here:
                t = pool._tables[sid]
                rows += [t[0] * p if t else 0] * (L - w) + _host_slots(t, 0, w, p)
            idx = to_device(_longs(rows), self.device)                           # (B*L,)
        else:
            rel = torch.arange(L, device=self.device) - (L - lens)[:, None]      # (B, L)
            idx = _slot(table, rel.clamp(min=0), p).flatten()                    # (B*L,)
        k = pool.k.index_select(0, idx).view(B, L, self.num_kv_heads, self.head_dim)
        v = pool.v.index_select(0, idx).view(B, L, self.num_kv_heads, self.value_dim)
        k, v = k.transpose(1, 2), v.transpose(1, 2)                              # (B, Hkv, L, D)
        if len(set(written)) == 1 and not self.padded:
            return k, v, None
        real = torch.arange(L, device=self.device) >= (L - lens)[:, None]       # (B, L)
        return k, v, real & pool.valid.index_select(0, idx).view(B, L)

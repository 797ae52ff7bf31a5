"""A paged KV cache: one shared pool of fixed-size pages and a block table per sequence.

Sequences are added and freed independently (continuous batching); memory grows with the
tokens stored, not with a maximum length. A forward runs on a batch of live sequences,
``cache.batch([id_a, id_b])``; each sequence's keys are gathered from its pages and
right-aligned, so ``mh.masks.causal()`` (lower-right) is right for every sequence whatever
its length.

Notation used for tensor shapes:
    P pages, p page_size, Hkv K/V heads, D head_dim, Dv value dim, B sequences in a batch,
    n new tokens, L longest sequence of the batch.
"""

from __future__ import annotations

import itertools

import torch

from .kv_cache import _CacheBase, _pos_int


class PagedKVCache(_CacheBase):
    """A pool of ``num_pages`` pages of ``page_size`` token slots, shared by sequences.

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
                 value_dim: int | None = None, dtype: torch.dtype = torch.float32, device=None):
        P, p = _pos_int("num_pages", num_pages), _pos_int("page_size", page_size)
        self.num_pages, self.page_size = P, p
        fk = self._geometry(num_kv_heads, head_dim, value_dim, dtype, device)
        self.k = torch.zeros(P * p, self.num_kv_heads, self.head_dim, **fk)     # (P*p, Hkv, D)
        self.v = torch.zeros(P * p, self.num_kv_heads, self.value_dim, **fk)    # (P*p, Hkv, Dv)
        self.valid = torch.zeros(P * p, dtype=torch.bool, device=self.device)   # (P*p,)
        self._free = list(range(P))
        self._tables: dict[int, list[int]] = {}
        self._written: dict[int, int] = {}     # slots written per sequence
        self._real: dict[int, int] = {}        # real (non-padding) tokens per sequence
        self._ids = itertools.count()

    # -- sequences ---------------------------------------------------------------------
    def add_sequence(self) -> int:
        """Start a new, empty sequence; returns its id (no page is taken until it writes)."""
        sid = next(self._ids)
        self._tables[sid], self._written[sid], self._real[sid] = [], 0, 0
        return sid

    def _check_id(self, sid) -> None:
        if sid not in self._tables:
            raise KeyError(f"unknown sequence id {sid!r}: live sequences are {sorted(self._tables)}")

    def free(self, sid: int) -> None:
        """Return a sequence's pages to the pool; its id is no longer valid."""
        self._check_id(sid)
        self._free.extend(self._tables.pop(sid))
        del self._written[sid], self._real[sid]

    def length(self, sid: int) -> int:
        """Real tokens stored for sequence ``sid``."""
        self._check_id(sid)
        return self._real[sid]

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
        per_slot = self.num_kv_heads * (self.head_dim + self.value_dim) * self.k.element_size()
        return self.pages_used * self.page_size * per_slot

    def batch(self, seq_ids) -> "PagedBatch":
        """The cache view a forward uses for these sequences (rows of x in this order)."""
        ids = list(seq_ids)
        if not ids or len(set(ids)) != len(ids):
            raise ValueError(f"batch needs distinct sequence ids, got {ids}")
        for sid in ids:
            self._check_id(sid)
        return PagedBatch(self, ids)

    def __repr__(self) -> str:
        return (f"PagedKVCache(num_pages={self.num_pages}, page_size={self.page_size}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, "
                f"sequences={len(self._tables)}, pages_used={self.pages_used})")

    # -- slots ---------------------------------------------------------------------------
    def _slots(self, sid: int, start: int, stop: int) -> torch.Tensor:
        """Pool slot index of positions ``start..stop-1`` of sequence ``sid``."""
        pos = torch.arange(start, stop)
        table = torch.tensor(self._tables[sid], dtype=torch.long)
        return table[pos // self.page_size] * self.page_size + pos % self.page_size


class PagedBatch(_CacheBase):
    """A batch of live sequences of a :class:`PagedKVCache`, used as ``cache=`` by a module."""

    cross = False

    def __init__(self, pool: PagedKVCache, ids: list[int]):
        self.pool, self.ids, self.batch_size = pool, ids, len(ids)
        for a in ("num_kv_heads", "head_dim", "value_dim", "dtype", "device"):
            setattr(self, a, getattr(pool, a))

    def _real_counts(self) -> torch.Tensor:
        return torch.tensor([self.pool._real[s] for s in self.ids], device=self.device)

    def update(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None = None):
        """Append ``n`` tokens to every sequence of the batch; returns right-aligned
        ``(k_all (B, Hkv, L, D), v_all, key_valid (B, L))``. Checks the pool has room first."""
        pool, p = self.pool, self.pool.page_size
        valid = self._check_new(k, v, valid)
        n = k.shape[2]
        need = [-(-(pool._written[s] + n) // p) - len(pool._tables[s]) for s in self.ids]
        if sum(need) > len(pool._free):
            raise ValueError(f"PagedKVCache is out of pages: this step needs {sum(need)} more page(s) "
                             f"but {len(pool._free)} of {pool.num_pages} are free; nothing was "
                             f"written. Free finished sequences, or build a larger pool")
        for sid, m in zip(self.ids, need):
            pool._tables[sid] += [pool._free.pop() for _ in range(m)]
        slots = torch.cat([pool._slots(s, pool._written[s], pool._written[s] + n)
                           for s in self.ids]).to(self.device)                # (B*n,)
        B, Hkv = len(self.ids), self.num_kv_heads
        pool.k.index_copy_(0, slots, k.transpose(1, 2).reshape(B * n, Hkv, self.head_dim))
        pool.v.index_copy_(0, slots, v.transpose(1, 2).reshape(B * n, Hkv, self.value_dim))
        new_valid = torch.ones(B * n, dtype=torch.bool, device=self.device) if valid is None \
            else valid.reshape(B * n)
        pool.valid.index_copy_(0, slots, new_valid)
        real = [n] * B if valid is None else valid.sum(1).tolist()
        for sid, r in zip(self.ids, real):
            pool._written[sid] += n
            pool._real[sid] += int(r)
        return self._gather()

    def _gather(self):
        """Each sequence's keys/values, right-aligned to the longest: ``(B, Hkv, L, D)``."""
        pool = self.pool
        lens = [pool._written[s] for s in self.ids]
        L = max(lens)
        idx = torch.zeros(len(self.ids), L, dtype=torch.long)                 # (B, L)
        present = torch.zeros(len(self.ids), L, dtype=torch.bool)             # (B, L)
        for b, (sid, n) in enumerate(zip(self.ids, lens)):
            idx[b, L - n:] = pool._slots(sid, 0, n)
            present[b, L - n:] = True
        idx, present = idx.to(self.device), present.to(self.device)
        flat = idx.flatten()                                                  # (B*L,)
        k = pool.k.index_select(0, flat).view(len(self.ids), L, self.num_kv_heads, self.head_dim)
        v = pool.v.index_select(0, flat).view(len(self.ids), L, self.num_kv_heads, self.value_dim)
        key_valid = present & pool.valid[idx]                                 # (B, L)
        mask = None if bool(key_valid.all()) else key_valid
        return k.transpose(1, 2), v.transpose(1, 2), mask                    # (B, Hkv, L, D)

"""Key/value caches for incremental decoding: a static preallocated one and a paged pool.

Both keep keys/values *after* RoPE, write new tokens in time order, and remember which
slots hold real tokens, so prompts padded on the left or on the right are masked by the
cache, not by the caller: the caller passes the same ``mh.masks.causal()`` as for a full
forward (lower-right aligned, so it is right for the prefill and for every step).

Every write is checked before anything is stored: a cache that refuses a write is left
bit-for-bit unchanged.

Every slot that holds no token holds zeros (keys and values) and False (validity): the
buffers start so, and :meth:`KVCache.reset` and :meth:`PagedKVCache.free` zero what they
release. So a write never replaces bytes anyone needs, and undoing a failed call's writes
(:meth:`_CacheBase.rollback`) only zeroes its slots again: journaling a call copies
nothing (on a GPU, no copy kernels per layer and decoding step).

A write is undone exactly from any point it reached (an interrupt lands between any two
ops): its undo is recorded before it starts and puts back what it finds changed. In grad
mode the caches hold constants: the buffers keep no autograd history (the views a write
returns do), so a call's gradients reach the keys and values it wrote, never a graph an
earlier call's backward freed. A call's backward must run before the next call writes
(the write changes, in place, a buffer its graph saved).

A cache is not thread-safe: one thread writes it at a time. ``reset()`` or ``free()`` of a
sequence between a failed call's write and its rollback is safe (the rollback leaves it).

Nothing here reads a device tensor back on the hot path (no host-device sync): what the
host must know (slots written, whether any write carried a ``valid``, queries served) is
kept as host ints and flags; what depends on ``valid``'s values (real-token counts, RoPE
positions, key validity) stays on the device. Where no sequence holds padding, the RoPE
positions are host ints (:meth:`_CacheBase.rope_positions`), which a
:class:`~multihead.modules.rope.RotaryEmbedding` reads from its table without device ops.

Notation used for tensor shapes:
    B batch (sequences), Hkv K/V heads, D head_dim, Dv value dim, T max_len (slots),
    n new tokens, P pages, p page_size.
"""

from __future__ import annotations

import functools

import torch

from .._args import positive_int
from .._device import check_fits, to_device, usable_device
from .._dtypes import check_dtype, check_strided
from .._tracing import shape_text
from ..analysis.params import human_bytes


def _count(name: str, n) -> int:
    """A number of new tokens or queries: an int >= 0 (numpy's ints too)."""
    return positive_int(name, n, least=0, hint="how many new tokens")


class _CacheBase:
    """What both caches share: geometry checks and the per-token validity bookkeeping."""

    num_kv_heads: int
    head_dim: int
    value_dim: int
    #: undo steps of the call in progress (between ``begin`` and its end); None outside one
    _journal: list | None = None
    dtype: torch.dtype
    device: torch.device

    def _geometry(self, num_kv_heads, head_dim, value_dim, dtype, device, slots: int,
                  sizes: str) -> dict:
        """Validate and store the per-token geometry; returns the buffers' dtype/device kwargs.

        ``slots`` tokens' buffers must fit in the device's free memory (``sizes`` names the
        arguments that made them): a cache too large is refused by name, not by the allocator.
        """
        self.num_kv_heads = positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = positive_int("head_dim", head_dim)
        self.value_dim = head_dim if value_dim is None else positive_int("value_dim", value_dim)
        # None: torch's default dtype, as for the module's parameters
        self.dtype = check_dtype("dtype", dtype, optional=True) or torch.get_default_dtype()
        # the concrete device ("cuda" -> "cuda:0"), so it compares equal to the module's
        self.device = usable_device("device", device)
        need = slots * (self.num_kv_heads * (self.head_dim + self.value_dim)
                        * self.dtype.itemsize + 1)                      # k, v and valid
        check_fits(need, self.device, f"{type(self).__name__}: {sizes} make {slots:,} token "
                   f"slots of {human_bytes(need // slots)} each, taking", "build a smaller cache")
        return dict(dtype=self.dtype, device=self.device)

    def check_compatible(self, num_kv_heads: int, head_dim: int, value_dim: int,
                         dtype: torch.dtype, device: torch.device) -> None:
        """Raise if a module with these sizes cannot use this cache (nothing is written)."""
        mine = (self.num_kv_heads, self.head_dim, self.value_dim)
        if mine != (num_kv_heads, head_dim, value_dim):
            raise ValueError(f"cache holds num_kv_heads={mine[0]}, head_dim={mine[1]}, "
                             f"value_dim={mine[2]} but the module has num_kv_heads={num_kv_heads}, "
                             f"head_dim={head_dim}, value_dim={value_dim}: build the cache with "
                             f"the module's sizes (module.make_cache(...))")
        if self.dtype != dtype or torch.device(self.device) != torch.device(device):
            raise TypeError(f"cache is {self.dtype} on {self.device} but the module is {dtype} on "
                            f"{device}: build the cache with dtype/device of the module")

    def bytes_per_token(self) -> int:
        """K/V bytes one token costs in one layer: ``Hkv * (D + Dv) * itemsize``.

        Example:
            >>> import torch, multihead as mh
            >>> mh.KVCache(1, 8, num_kv_heads=2, head_dim=64, dtype=torch.float16).bytes_per_token()
            512
            >>> mh.PagedKVCache(4, 16, num_kv_heads=2, head_dim=64).bytes_per_token()
            1024
        """
        return self.num_kv_heads * (self.head_dim + self.value_dim) * self.dtype.itemsize

    def _real_counts(self) -> torch.Tensor:
        """Real (non-padding) tokens stored per sequence, ``(B,)``."""
        raise NotImplementedError

    # -- a forward's writes, undone if the forward fails after them ----------------------
    def begin(self) -> None:
        """Start recording writes: :meth:`rollback` undoes exactly those made since.

        Refused while a call on this cache is open (a forward called from a hook of another
        forward writing the same cache): the outer call's rollback could not undo the
        inner's writes, and its keys were gathered before them.

        Example:
            >>> import torch, multihead as mh
            >>> cache = mh.KVCache(1, 8, num_kv_heads=1, head_dim=4)
            >>> cache.begin()
            >>> try:
            ...     cache.begin()
            ... except RuntimeError as e:
            ...     print(str(e)[:52])
            KVCache: a call writing this cache is still open (a
        """
        self._refuse_nested("this cache")
        self._journal = []

    def _refuse_nested(self, what: str) -> None:
        """Raise where this cache's call is open (``what``: how the error names it)."""
        if self._journal is not None:
            raise RuntimeError(
                f"{type(self).__name__}: a call writing {what} is still open (a forward called "
                f"from inside another that uses it, from a hook say); nothing was written. Give "
                f"the inner call a cache of its own, or make it after the outer one returns")

    def rollback(self) -> None:
        """Undo the writes since :meth:`begin` (the module calls this when attention fails
        after the cache was written): the cache then holds the tokens, lengths, padding and
        positions it held before, byte for byte (the slots written are zero again, as every
        slot holding no token is).

        Example:
            >>> import torch, multihead as mh
            >>> cache = mh.KVCache(1, 8, num_kv_heads=1, head_dim=4)
            >>> cache.begin(); _ = cache.update(torch.ones(1, 1, 3, 4), torch.ones(1, 1, 3, 4))
            >>> cache.rollback(); cache.seen, cache.lengths.tolist()
            (0, [0])
        """
        try:
            for undo in reversed(self._journal or []):
                undo()
        finally:                     # (an undo that fails ends the call all the same)
            self._end_call()

    def commit(self) -> None:
        """Stop recording: the writes since :meth:`begin` stay (the module calls this when
        a forward succeeds, so a later :meth:`rollback` cannot undo a finished step).

        Example:
            >>> import torch, multihead as mh
            >>> cache = mh.KVCache(1, 8, num_kv_heads=1, head_dim=4)
            >>> cache.begin(); _ = cache.update(torch.ones(1, 1, 3, 4), torch.ones(1, 1, 3, 4))
            >>> cache.commit(); cache.rollback(); cache.seen                 # kept
            3
        """
        self._end_call()

    def _end_call(self) -> None:
        self._journal = None

    def __getstate__(self) -> dict:
        """pickle, ``copy.deepcopy``, ``torch.save``: refused between :meth:`begin` and its
        end, whose undo steps act on this cache (a copy's rollback would undo this one), and
        for a paged pool while a batch of it is between them (its steps act on the pool)."""
        if self._journal is not None or self._calls_open():
            raise RuntimeError(f"{type(self).__name__}: cannot copy or save a cache between "
                               f"begin() and commit()/rollback() (its undo steps act on this "
                               f"cache, not on a copy): end the call first")
        # (_open: a pool's weak set of its open batches, not state)
        return {k: v for k, v in self.__dict__.items() if k != "_open"}

    def _calls_open(self) -> bool:
        """Whether calls of other objects (a paged pool's batches) are open on this one."""
        return False

    def _record(self, undo) -> None:
        if self._journal is not None:
            self._journal.append(undo)

    def _change(self, undo, change):
        """Run ``change()`` (a write into the cache) with ``undo`` recorded first; where
        ``change`` fails, ``undo`` runs at once and the error goes on. ``undo`` puts the
        cache back as it was before ``change`` began from whatever point ``change`` reached,
        and may run twice (here, then by :meth:`rollback`): an interrupt anywhere in a write,
        even as an op returns, leaves nothing changed.

        Example:
            >>> import torch
            >>> a, done = torch.zeros(3), []
            >>> def change(): a.fill_(1); done.append(1); raise KeyboardInterrupt
            >>> try:
            ...     _CacheBase()._change(lambda: a.zero_(), change)
            ... except KeyboardInterrupt:
            ...     print(a.tolist(), done)
            [0.0, 0.0, 0.0] [1]
        """
        self._record(undo)
        try:
            return change()
        except BaseException:
            undo()
            raise

    @staticmethod
    def _put_back(*steps) -> None:
        """Run each step, an in-place change that puts a buffer back. A step that torch.func
        refuses is skipped: its transforms refuse in-place changes of the cache's tensors,
        so they refused the write being undone too."""
        for step in steps:
            try:
                step()
            except RuntimeError:
                if not torch._C._are_functorch_transforms_active():
                    raise

    def _drop_history(self) -> None:
        """The buffers ``k`` and ``v`` without autograd history (the same storage): a cache
        holds constants. A write ends so, once the views it returns are taken (they keep its
        graph), so the next write links its new tokens to its own call only, not to every
        earlier call's graph (which a backward frees)."""
        self.k, self.v = (t.detach() if t.requires_grad else t for t in (self.k, self.v))

    def _check_valid(self, valid, n: int):
        """``valid`` (B, n) bool on the cache's device, or None; a clear error otherwise."""
        if valid is None:
            return None
        batch = self.batch_size
        wrong = not isinstance(valid, torch.Tensor) or valid.dtype != torch.bool
        if wrong or tuple(valid.shape) != (batch, n):
            kind = "" if isinstance(valid, torch.Tensor) else (
                f"a {type(valid).__module__.split('.')[0]}.{type(valid).__name__} of ")
            fix = (": pass torch.from_numpy(valid)" if type(valid).__module__ == "numpy"
                   else "")
            raise (TypeError if wrong else ValueError)(
                f"valid must be a bool tensor (B, n) = ({batch}, {n}) marking the real new "
                f"tokens, got {kind}{getattr(valid, 'dtype', type(valid).__name__)} "
                f"{tuple(getattr(valid, 'shape', ()))}{fix}")
        check_strided("valid", valid)
        if valid.is_meta and self.device.type != "meta":
            raise ValueError(f"valid is on the meta device (it holds no values), the cache on "
                             f"{self.device}: pass valid as a real tensor, e.g. on {self.device}")
        return to_device(valid, self.device)

    def positions(self, n: int, valid: torch.Tensor | None = None) -> torch.Tensor:
        """RoPE positions ``(B, n)`` of ``n`` new tokens: each sequence's count of real tokens
        continues (padding does not advance it)."""
        n = _count("n", n)
        valid = self._check_valid(valid, n)
        steps = torch.ones(self.batch_size, n, dtype=torch.long, device=self.device) \
            if valid is None else valid.long()
        return self._real_counts()[:, None] + steps.cumsum(1) - 1              # (B, n)

    def rope_positions(self, n: int, valid: torch.Tensor | None = None):
        """:meth:`positions` as the host knows them where it can: an int (the first of
        ``n`` consecutive positions, the same for every sequence) or a host tensor
        ``(B, n)`` when no sequence holds padding and ``valid`` is None, else the device
        tensor of :meth:`positions`. :class:`RotaryEmbedding` reads the former from its
        table with no device op (an int) or one gather, instead of computing angles.

        Example:
            >>> import torch, multihead as mh
            >>> cache = mh.KVCache(2, 8, num_kv_heads=1, head_dim=4)
            >>> _ = cache.update(torch.ones(2, 1, 3, 4), torch.ones(2, 1, 3, 4))
            >>> cache.rope_positions(2), cache.positions(2).tolist()
            (3, [[3, 4], [3, 4]])
        """
        n = _count("n", n)
        counts = self._host_counts() if valid is None else None
        if counts is None:
            return self.positions(n, valid)
        if len(set(counts)) == 1:
            return counts[0]
        return torch.tensor(counts, device="cpu")[:, None] + torch.arange(n, device="cpu")  # (B, n)

    def _host_counts(self) -> list[int] | None:
        """Each sequence's real tokens where the host knows them (no padding), else None
        (unknown: :meth:`rope_positions` takes the device's)."""
        return None

    def _slot_tensors(self) -> tuple[torch.Tensor, ...]:
        """The tensors the cache writes into (each holds zeros where it holds no token)."""
        return self.k, self.v, self.valid

    def _check_writable(self, action: str) -> None:
        """Refuse, before anything changes, a write torch would refuse part way: into
        buffers made under ``torch.inference_mode()`` from outside it."""
        if torch.is_inference_mode_enabled() or not self._slot_tensors()[0].is_inference():
            return
        raise RuntimeError(f"{type(self).__name__}: cannot {action}: the cache was built under "
                           f"torch.inference_mode(), and torch lets its tensors change only "
                           f"inside it; run this under torch.inference_mode() too, or build the "
                           f"cache outside it (under torch.no_grad() it keeps no history "
                           f"either). Nothing was changed")

    def _check_new(self, k, v, valid):
        self._check_writable("write new tokens")
        for name, t, d, width in (("k", k, "D", self.head_dim), ("v", v, "Dv", self.value_dim)):
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
                raise ValueError(f"cache update: {name} must be a tensor (B, Hkv, n, {d}) = "
                                 f"({self.batch_size}, {self.num_kv_heads}, n, {width}), got {got}")
            check_strided(f"cache update: {name}", t)
        n, batch = k.shape[2], self.batch_size
        want_k, want_v = (batch, self.num_kv_heads, n, self.head_dim), \
            (batch, self.num_kv_heads, n, self.value_dim)
        if tuple(k.shape) != want_k or tuple(v.shape) != want_v:
            raise ValueError(f"cache update: k {shape_text(k)} / v {shape_text(v)} must be "
                             f"{want_k} / {want_v}")
        if k.dtype != self.dtype or v.dtype != self.dtype:
            raise TypeError(f"cache update: k/v are {k.dtype}/{v.dtype}, the cache is {self.dtype}")
        if k.device != self.device or v.device != self.device:     # (a copy across would hide it)
            raise TypeError(f"cache update: k/v are on {k.device}/{v.device}, the cache on "
                             f"{self.device}: build the cache on the module's device "
                             f"(module.make_cache does)")
        return self._check_valid(valid, n)


class KVCache(_CacheBase):
    """A preallocated cache for a batch of ``batch_size`` sequences of up to ``max_len`` tokens.

    Slots are written in time order, the same number for every sequence; ``lengths`` (a
    tensor) counts each sequence's real tokens, which is where its RoPE positions continue.

    Args:
        batch_size, max_len, num_kv_heads, head_dim: the buffers' sizes.
        value_dim: Dv (default head_dim).
        dtype, device: of the buffers (match the module's; default: torch's default dtype
            and device, as for the module's parameters).

    Example:
        >>> import torch, multihead as mh
        >>> attn = mh.MultiHeadAttention(64, 8, num_kv_heads=2).eval()
        >>> cache = mh.KVCache(1, 32, num_kv_heads=2, head_dim=8)
        >>> prompt, nxt = torch.randn(1, 5, 64), torch.randn(1, 1, 64)
        >>> y = attn(prompt, cache=cache, mask=mh.masks.causal())      # prefill
        >>> y = attn(nxt, cache=cache, mask=mh.masks.causal())         # one decode step
        >>> cache.seen, cache.lengths.tolist(), cache.nbytes
        (6, [6], 4096)

    Shapes:
        k (B, Hkv, T, D), v (B, Hkv, T, Dv), lengths (B,), valid (B, T).
    """

    def __init__(self, batch_size: int, max_len: int, num_kv_heads: int, head_dim: int, *,
                 value_dim: int | None = None, dtype: torch.dtype | None = None, device=None):
        B, T = positive_int("batch_size", batch_size), positive_int("max_len", max_len)
        self.batch_size, self.max_len = B, T
        fk = self._geometry(num_kv_heads, head_dim, value_dim, dtype, device, B * T,
                            f"batch_size={B} x max_len={T}")
        self.k = torch.zeros(B, self.num_kv_heads, T, self.head_dim, **fk)     # (B, Hkv, T, D)
        self.v = torch.zeros(B, self.num_kv_heads, T, self.value_dim, **fk)    # (B, Hkv, T, Dv)
        self.valid = torch.zeros(B, T, dtype=torch.bool, device=self.device)   # (B, T)
        self.lengths = torch.zeros(B, dtype=torch.long, device=self.device)    # (B,)
        self.seen = 0            # slots written (a shape, known on the host without a sync)
        self.padded = False      # True once a write came with `valid` (its values are not read)
        self.cross = False       # True when it holds a cross-attention context
        self.queries = 0         # cross-attention queries served: where their positions continue

    @property
    def nbytes(self) -> int:
        """Bytes of the K/V buffers (what the seeds' MQA/GQA argument is about)."""
        return self.k.nbytes + self.v.nbytes

    def reset(self) -> None:
        """Forget every sequence; the buffers are kept and reused, the slots written zeroed
        (what a slot holding no token holds: see the module docstring).

        Example:
            >>> import torch, multihead as mh
            >>> cache = mh.KVCache(1, 8, num_kv_heads=1, head_dim=4)
            >>> _ = cache.update(torch.ones(1, 1, 3, 4), torch.ones(1, 1, 3, 4))
            >>> cache.reset(); cache.seen, cache.k.abs().sum().item(), cache.valid.any().item()
            (0, 0.0, False)
        """
        self._check_writable("reset")
        for t in self._slot_tensors():
            self._clear(slice(0, self.seen), t)
        self.lengths.zero_()
        self._journal = None           # a failed call's rollback after this undoes nothing
        self.seen, self.padded, self.cross, self.queries = 0, False, False, 0

    def _real_counts(self) -> torch.Tensor:
        return self.lengths

    def _host_counts(self) -> list[int] | None:
        return None if self.padded else [self.seen]

    def update(self, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor | None = None):
        """Append ``n`` new tokens; return ``(k_all, v_all, key_valid or None)`` to attend to.

        Raises before writing anything if the tokens do not fit (the cache is unchanged).
        Once a write came with ``valid``, ``key_valid`` is returned from then on: whether every
        token was real is never read back from the device.
        """
        valid = self._check_new(k, v, valid)
        n = k.shape[2]
        if self.seen + n > self.max_len:
            raise ValueError(f"KVCache is full: it holds {self.seen} of max_len={self.max_len} "
                             f"slots and {n} more do not fit; nothing was written. Build it "
                             f"with max_len >= {self.seen + n}, or reset() it")
        s = slice(self.seen, self.seen + n)                 # slots holding no token: zeros
        added = n if valid is None else valid.sum(1)                           # (B,) or n
        before = (self.seen, self.padded)

        def undo():                    # the slots zero again, the counts as they were (the
            try:                       # real tokens of the slots before s), even if a clear fails
                self._put_back(
                    *(functools.partial(self._clear, s, t) for t in self._slot_tensors()),
                    lambda: self.lengths.copy_(self.valid[:, :before[0]].sum(1)))
            finally:
                self.seen, self.padded = before

        def write():
            self.k[:, :, s].copy_(k)
            self.v[:, :, s].copy_(v)
            if valid is None:
                self.valid[:, s].fill_(True)
            else:
                self.valid[:, s].copy_(valid)
            self.lengths += added
            self.padded = self.padded or (valid is not None and n > 0)   # (nothing written:
            self.seen += n                                                # still unpadded)
        self._change(undo, write)
        t = self.seen
        out = self.k[:, :, :t], self.v[:, :, :t], (self.valid[:, :t] if self.padded else None)
        self._drop_history()                                               # the views keep it
        return out

    def _clear(self, s: slice, t: torch.Tensor) -> None:
        # slots s of buffer t (k, v or valid) hold no token: zeros (False), as the module
        # docstring says; the slots are dim 2 of k and v, dim 1 of valid
        t.narrow(2 if t.dim() == 4 else 1, s.start, s.stop - s.start).zero_()

    def store_context(self, k: torch.Tensor, v: torch.Tensor) -> None:
        """Keep a cross-attention context's keys/values (once; reset() to replace them)."""
        if self.seen or self.cross:                   # (a context may be of 0 tokens)
            raise ValueError("this cache already holds tokens or a context: call reset() before "
                             "caching a new cross-attention context")
        self._record(lambda: setattr(self, "cross", False))
        self.update(k, v)
        self.cross = True

    def context(self):
        """The cached cross-attention keys and values ``(B, Hkv, Sk, D)``, ``(B, Hkv, Sk, Dv)``."""
        if not self.cross:
            raise ValueError("this cache holds no cross-attention context: pass context on the "
                             "first call")
        return self.k[:, :, :self.seen], self.v[:, :, :self.seen]

    def cross_positions(self, n: int) -> torch.Tensor:
        """RoPE positions ``(n,)`` of the next ``n`` cross-attention queries; counts them served.

        A full cross-attention forward rotates its queries at ``0..Sq-1``, so queries fed in
        steps continue from the number served before (the same for every sequence: a host
        int, no device read); ``reset()`` starts again at 0.

        Example:
            >>> import torch, multihead as mh
            >>> cache = mh.KVCache(1, 8, num_kv_heads=1, head_dim=4)
            >>> cache.store_context(torch.ones(1, 1, 5, 4), torch.ones(1, 1, 5, 4))
            >>> cache.cross_positions(2).tolist(), cache.cross_positions(1).tolist()
            ([0, 1], [2])
        """
        start = self._serve_queries(_count("n", n))
        return torch.arange(start, start + n, device=self.device)

    def _serve_queries(self, n: int) -> int:
        """Count ``n`` more cross-attention queries served; returns the first one's position."""
        self.context()                                     # raises if no context is cached
        start, self.queries = self.queries, self.queries + n
        self._record(lambda: setattr(self, "queries", start))
        return start

    def __repr__(self) -> str:
        return (f"KVCache(batch_size={self.batch_size}, max_len={self.max_len}, "
                f"num_kv_heads={self.num_kv_heads}, head_dim={self.head_dim}, seen={self.seen}, "
                f"{str(self.dtype).replace('torch.', '')}, {self.nbytes / 2**20:.1f} MiB)")

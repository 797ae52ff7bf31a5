"""A small memo table that is safe under threads and bounded by the bytes it keeps.

Every cache of derived facts in the library (tile maps of masks, plans, auto's choices)
is one of these. Values are kept in insertion order and the oldest go first once the
entries or the bytes of the tensors they hold pass the limits. A value is computed
outside the lock (two threads may compute it at once; one result is kept), so a slow
computation never blocks other threads and a computation may itself use the cache.

While a CUDA graph captures, nothing is stored: a value computed then has its contents only
once the graph replays, and an eager call must not read it before. A value read then is held
for the life of the process: the graph reads its memory at every replay, after the cache may
have let it go. Nothing is stored either while a fake-tensor, ``make_fx`` or
functionalization mode is on: its tensors hold no values.

CUDA tensors in a value are made on one stream and may be read on another (a second thread,
a side stream). Such a read first waits for their making, and their memory is kept from
reuse until that stream's kernels are done, even if the cache lets them go meanwhile
(:class:`multihead._device.StreamUse`).
"""

from __future__ import annotations

import dataclasses
import functools
import threading

import torch

from . import _device
from ._fork import renew_after_fork
from ._tracing import valueless

_MISSING = object()


def nbytes(value, depth: int = 8) -> int:
    """Bytes of the tensors reachable from ``value`` (through containers, dataclasses,
    named tuples and plain objects, ``depth`` levels deep): each storage counted once, at
    its own size (an expanded view costs what it holds, not what it shows). The walk does
    not enter objects the value refers to but does not own: masks and other caches (their
    classes set ``_cache_opaque``), nor those whose class holds no tensors by design
    (``_cache_no_tensors``: a plan's cost figures).

    Example:
        >>> import torch
        >>> t = torch.zeros(4)
        >>> nbytes({"a": t, "b": (torch.zeros(2, dtype=torch.int8), t.expand(100, 4), 3)})
        18
    """
    return sum(size for _, size in _tensors(value, depth))


#: types that hold no tensor (the walk below returns at once)
_LEAVES = frozenset({int, float, complex, str, bool, bytes, type(None), torch.dtype,
                     torch.device, torch.Size})


@functools.lru_cache(maxsize=None)
def _field_names(cls) -> tuple[str, ...]:
    # a dataclass's fields, once per class (dataclasses.fields is slow Python)
    return tuple(f.name for f in dataclasses.fields(cls))


def _tensors(value, depth: int = 8) -> list:
    """``[(tensor, bytes of its storage)]``: one tensor per storage reachable from
    ``value`` (see :func:`nbytes`)."""
    seen_storages, seen_objects, found = set(), set(), []

    def walk(v, depth: int) -> None:
        if isinstance(v, torch.Tensor):
            try:
                st = v.untyped_storage()
                key, size = (st.data_ptr(), st.device), st.nbytes()
            except (RuntimeError, NotImplementedError):     # no storage (meta, wrappers)
                key, size = id(v), 0
            if key not in seen_storages:
                seen_storages.add(key)
                found.append((v, size))
            return
        if depth == 0 or v is None or isinstance(v, (int, float, str, bool, bytes)):
            return
        if id(v) in seen_objects or (v is not value and getattr(type(v), "_cache_opaque", False)):
            return
        if getattr(type(v), "_cache_no_tensors", False):     # (a class that says so)
            return
        seen_objects.add(id(v))
        if isinstance(v, dict):
            items = v.values()
        elif isinstance(v, (list, tuple, set, frozenset)):
            items = v
        elif dataclasses.is_dataclass(v) and not isinstance(v, type):
            items = [getattr(v, name) for name in _field_names(type(v))]
        elif hasattr(v, "__dict__"):
            items = vars(v).values()
        else:
            items = [getattr(v, s) for s in getattr(type(v), "__slots__", ()) if hasattr(v, s)]
        for x in items:
            try:
                leaf = type(x) in _LEAVES        # (most of a plan's fields: no call)
            except TypeError:                    # a class made unhashable by its metaclass
                leaf = False
            if not leaf:
                walk(x, depth - 1)

    walk(value, depth)
    return found


class BoundedCache:
    """A thread-safe memo table bounded by entries and by the tensor bytes it holds.

    Args:
        max_entries: the most values kept.
        max_bytes: the most tensor bytes kept; a single value larger than this is
            returned but not kept.
        keep_on_repeat: keep a value only when its key is put a second time (the first
            put only notes the key, among at most ``4 * max_entries`` noted keys): keys
            that never come back (a decoding loop's, whose length grows every step)
            then cost no walk for tensors and push out no kept value.

    Example:
        >>> import torch
        >>> c = BoundedCache(max_entries=2, max_bytes=64)
        >>> c.get_or_compute("a", lambda: torch.zeros(8)).shape      # 32 bytes, kept
        torch.Size([8])
        >>> _ = c.get_or_compute("b", lambda: torch.zeros(12))       # 48 bytes: "a" goes
        >>> "a" in c, "b" in c, c.nbytes
        (False, True, 48)
        >>> r = BoundedCache(max_entries=2, max_bytes=64, keep_on_repeat=True)
        >>> r.put("a", 1); "a" in r
        False
        >>> r.put("a", 1); "a" in r
        True
    """

    #: a value holding a cache does not own what the cache holds (see :func:`nbytes`)
    _cache_opaque = True

    def __init__(self, max_entries: int, max_bytes: int, keep_on_repeat: bool = False):
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._data: dict = {}            # key -> (value, bytes, StreamUse or None)
        self._bytes = 0
        self._lock = threading.Lock()
        self._noted: set | None = set() if keep_on_repeat else None   # keys put once
        renew_after_fork(self)

    def _renew_after_fork(self) -> None:
        """In a child forked while another thread held the lock (that thread is not in the
        child, the lock would never be released): a fresh lock, and the cache emptied (it
        may have been caught mid-update)."""
        if self._lock.locked():
            self._lock = threading.Lock()
            self._data.clear()
            self._bytes = 0
            if self._noted is not None:
                self._noted.clear()

    def __getstate__(self):
        """Copied or pickled empty (what it holds is recomputed on use; a lock cannot be
        pickled): a plan or an ``explain()`` result that holds one can be saved."""
        return self.max_entries, self.max_bytes, self._noted is not None

    def __setstate__(self, state):
        self.__init__(*state)

    def __contains__(self, key) -> bool:
        with self._lock:
            return key in self._data

    def __len__(self) -> int:
        return len(self._data)

    @property
    def nbytes(self) -> int:
        """Tensor bytes held now."""
        return self._bytes

    def get(self, key, default=None):
        with self._lock:
            hit = self._data.get(key, _MISSING)
        if hit is _MISSING:
            return default
        value, _, streams = hit
        if _device.capturing():
            return _device.hold(value)
        if streams is not None:          # CUDA tensors: safe on the stream reading them now
            streams.order_here()
        return value

    def peek(self, key, default=None):
        """The value under ``key`` (or ``default``) for a caller that only looks at it: no
        stream is ordered after its tensors, and none is held for a capturing graph."""
        with self._lock:
            hit = self._data.get(key, _MISSING)
        return default if hit is _MISSING else hit[0]

    def put(self, key, value, limit: int | None = None) -> None:
        """Keep ``value`` under ``key``, dropping the oldest entries to stay in bounds.

        Nothing is kept while a CUDA graph captures or a fake-tensor, ``make_fx`` or
        functionalization mode is on (what is made there is a graph's, or holds no values:
        :func:`multihead._tracing.valueless`); nor a value holding a tensor a
        ``torch.func`` transform wrapped, which belongs to that transform's level (kept, it
        would escape it, and a later transform that met it failed inside functorch); nor
        one of more tensor bytes than ``limit``, where given, or than ``max_bytes``."""
        if _device.capturing() or valueless():
            return
        if self._noted is not None:
            with self._lock:
                if key not in self._noted:
                    if len(self._noted) >= 4 * self.max_entries:
                        self._noted.clear()
                    self._noted.add(key)
                    return
                self._noted.discard(key)
        tensors = _tensors(value)
        if torch._C._are_functorch_transforms_active() and any(
                torch._C._functorch.is_functorch_wrapped_tensor(t) for t, _ in tensors):
            return
        size = sum(n for _, n in tensors)
        most = self.max_bytes if limit is None else min(limit, self.max_bytes)
        streams = _device.StreamUse.of(t for t, _ in tensors) if size <= most else None
        with self._lock:
            old = self._data.pop(key, None)
            if old is not None:
                self._bytes -= old[1]
            if size > most:
                return
            while self._data and (len(self._data) >= self.max_entries
                                  or self._bytes + size > self.max_bytes):
                self._bytes -= self._data.pop(next(iter(self._data)))[1]
            self._data[key] = (value, size, streams)
            self._bytes += size

    def get_or_compute(self, key, compute, limit: int | None = None):
        """The value under ``key``, computing and keeping it on a miss (not kept where it
        holds more tensor bytes than ``limit``: see :meth:`put`)."""
        hit = self.get(key, _MISSING)
        if hit is not _MISSING:
            return hit
        value = compute()
        hit = self.get(key, _MISSING)    # another thread may have kept one meanwhile
        if hit is not _MISSING:
            return hit
        self.put(key, value, limit)
        return value

    def clear(self) -> None:
        with self._lock:
            self._data.clear()
            self._bytes = 0
            if self._noted is not None:
                self._noted.clear()

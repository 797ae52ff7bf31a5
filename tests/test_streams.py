"""Cached device tensors read on another CUDA stream than the one that made them.

The library caches tensors derived from masks (tile maps, block lists, step plans, index
lists). A second thread or a side stream may then read them while (1) the stream that made
them has not yet run the kernels that write them, or (2) the cache lets them go while a
kernel of the reading stream still reads them, and torch's allocator hands their memory to
the making stream's next allocation. A read on another stream must wait for the making, and
the memory must be kept until the reading stream is done with it.

Without a GPU the streams are simulated: :data:`multihead._device._CUDA` (the seam through
which all stream calls go) is replaced by a recorder in which every tensor counts as a CUDA
tensor. The ``cuda`` tests make both hazards happen on real streams.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from unittest import mock

import pytest
import torch

import multihead as mh
from multihead import _device
from multihead._cache import BoundedCache, _tensors

M = mh.masks


class FakeStream:
    def __init__(self, log: list, sid: int):
        self.log, self.id = log, sid
        self.cuda_stream = sid                            # its raw handle, as torch's has

    def wait_event(self, event):
        self.log.append(("wait", self.id, event))


class Recorder:
    """Stands in for the CUDA calls: every tensor is on device 0, ``now`` is the current
    stream, events are named by the stream they were recorded on."""

    def __init__(self):
        self.log, self.now, self.events = [], 1, 0

    def index(self, t):
        return 0

    def current_id(self, index):
        return self.now

    def current(self, index):
        return FakeStream(self.log, self.now)

    def event_on(self, stream):
        self.events += 1
        return f"event {self.events} on stream {stream.id}"

    def keep_for(self, t, stream):
        self.log.append(("keep", stream.id, t.data_ptr()))


@contextlib.contextmanager
def streams():
    rec = Recorder()
    with mock.patch.object(_device, "_CUDA", rec):
        yield rec


def test_a_read_on_another_stream_waits_for_the_making_and_keeps_the_memory_once():
    cache = BoundedCache(max_entries=4, max_bytes=1 << 20)
    a, b = torch.zeros(3), torch.ones(2)
    with streams() as rec:
        cache.put("value", {"lists": (a, a[1:], b)})        # made on stream 1
        cache.get("value")
        assert rec.log == [] and rec.events == 0             # same stream: nothing to do
        rec.now = 2
        cache.get("value")
        assert rec.log[0] == ("wait", 2, "event 1 on stream 1")   # what 1 queued by now
        kept = sorted(p for kind, sid, p in rec.log[1:] if kind == "keep" and sid == 2)
        assert kept == sorted([a.data_ptr(), b.data_ptr()])  # each storage once
        assert len(rec.log) == 3
        cache.get_or_compute("value", lambda: pytest.fail("a hit recomputes nothing"))
        assert len(rec.log) == 3                             # stream 2 pays once
        rec.now = 3
        cache.get("value")
        assert rec.log[3] == ("wait", 3, "event 2 on stream 1") and len(rec.log) == 6


def test_values_without_device_tensors_and_reads_during_a_capture_do_no_stream_work():
    cache = BoundedCache(max_entries=4, max_bytes=1 << 20)
    with streams() as rec:
        cache.put("plain", (1, "two", None))
        assert cache._data["plain"][2] is None
        cache.put("tensor", torch.zeros(2))
        assert cache._data["tensor"][2] is not None
        rec.now = 2
        with mock.patch.object(_device, "capturing", lambda: True), \
                mock.patch.dict(_device._HELD, clear=False):
            cache.get("tensor")               # held for the graph instead (see test_graph_capture)
        assert rec.log == [] and rec.events == 0
        cache.put("big", torch.zeros(1 << 19))          # returned, not kept
        assert "big" not in cache


def test_an_attention_call_on_a_second_stream_orders_every_cached_tensor_it_reads():
    """Through the library: blocksparse's step plan (kept on the plan a tensor mask keeps),
    made by a call on stream 1, is read by the same call on stream 2: waited for and kept
    for stream 2, and the result is the same."""
    from multihead.functional import dispatch
    q = torch.randn(1, 2, 64, 16)
    mask = M.document(torch.tensor([[0] * 20 + [1] * 30 + [2] * 14]))
    dispatch.clear_cache()
    with streams() as rec:
        first = mh.attention(q, q, q, mask=mask, backend="blocksparse")
        assert rec.log == [] and rec.events == 0
        rec.now = 2
        second = mh.attention(q, q, q, mask=mask, backend="blocksparse")
    torch.testing.assert_close(second, first)
    waits = [e for kind, sid, e in rec.log if kind == "wait"]
    assert waits and all(sid == 2 for _, sid, _ in rec.log)
    assert all(e.endswith("on stream 1") for e in waits)
    memo = vars(mask)["_memo"]._data            # a tensor mask keeps its plans on itself
    (backend, plan), = [v for key, (v, _, _) in memo.items() if key[0] == "plan"]
    steps = plan.detail._data["steps"][0]
    assert backend.name == "blocksparse"
    kept = {p for kind, _, p in rec.log if kind == "keep"}
    assert {t.data_ptr() for t, _ in _tensors(steps)} <= kept


def test_a_cached_value_that_refers_to_a_mask_neither_counts_nor_orders_its_tensors():
    """A plan refers to the call's mask (the user's, with its own tensors and caches): the
    cache owns only what the plan itself holds."""
    bias = torch.zeros(1, 1, 512, 512)
    mask = M.bias(bias) & M.causal()
    vars(mask.a).setdefault("_memo", BoundedCache(4, 1 << 30)).put("x", bias + 1)
    own = torch.zeros(4)
    plan = {"detail": (mask, [own]), "inner": BoundedCache(2, 1 << 20)}
    plan["inner"].put("y", torch.zeros(8))
    assert _tensors(plan) == [(own, 16)]
    cache = BoundedCache(max_entries=4, max_bytes=1 << 10)
    with streams() as rec:
        cache.put("plan", plan)               # 16 bytes: kept, though the bias has 1 MiB
        rec.now = 2
        assert cache.get("plan") is plan
    assert [p for kind, _, p in rec.log if kind == "keep"] == [own.data_ptr()]


#: GPU cycles a stream sleeps for (about two seconds on an H100): far longer than the host
#: takes to queue what follows
HOLD_UP = 4_000_000_000


def _inputs(seed: int):
    g = torch.Generator().manual_seed(seed)
    B, H, S, D = 2, 4, 1024, 64
    q, k, v = (torch.randn(B, H, S, D, generator=g).to("cuda", torch.bfloat16)
               for _ in range(3))
    ids = torch.sort(torch.randint(0, 9, (B, S), generator=g), dim=1).values.to("cuda")
    want = mh.attention(q.float(), k.float(), v.float(), mask=M.document(ids.clone()),
                        backend="reference")
    return q, k, v, ids, want


@pytest.mark.cuda
def test_a_hit_on_another_stream_waits_for_the_kernels_that_make_the_value_on_cuda():
    """Stream A is held up, then makes a document mask's block lists (queued behind the
    hold-up); stream B, which never waited for A, calls with the same mask at once. Its
    kernels must wait for the lists, not read the memory they are yet to be written to."""
    pytest.importorskip("triton")
    q, k, v, ids, want = _inputs(0)
    side = torch.cuda.Stream()
    # kernels compiled, pools warm, with other documents: the memory the test's lists get
    # then holds other lists, which B would read if it did not wait
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            mh.attention(q, k, v, mask=M.document(torch.zeros_like(ids)), backend="triton")
    mask = M.document(ids)
    torch.cuda.synchronize()
    torch.cuda._sleep(HOLD_UP)                               # stream A
    held = torch.cuda.Event()
    held.record()
    mh.attention(q, k, v, mask=mask, backend="triton")       # lists made on A, after it
    with torch.cuda.stream(side):
        got = mh.attention(q, k, v, mask=mask, backend="triton")   # B: a cache hit
    assert not held.query(), "the hold-up ended before B queued its call: inconclusive"
    torch.cuda.synchronize()
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
def test_a_value_the_cache_lets_go_keeps_its_memory_while_another_stream_reads_it_on_cuda():
    """Stream B queues a read of the cached block lists behind a hold-up; meanwhile stream A
    drops them from every cache and allocates all the free memory of their sizes. None of
    A's allocations may overlap the lists while B has yet to read them."""
    pytest.importorskip("triton")
    from multihead.functional import dispatch
    q, k, v, ids, want = _inputs(1)
    mask = M.document(ids)
    side = torch.cuda.Stream()
    mh.attention(q, k, v, mask=mask, backend="triton")       # made on A
    with torch.cuda.stream(side):
        mh.attention(q, k, v, mask=M.document(ids.clone()), backend="triton")   # B warm
    memo = vars(mask)["_memo"]
    cached = {key: [t for t, _ in _tensors(entry[0]) if t.is_cuda]
              for key, entry in memo._data.items()}
    storage = {key: [(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()) for t in ts]
               for key, ts in cached.items()}
    alive = [weakref.ref(t) for ts in cached.values() for t in ts]
    del cached
    torch.cuda.synchronize()
    torch.cuda.empty_cache()                 # little free memory left to search below
    read, get = set(), memo.get              # the entries B's call reads (a hit needs no
    memo.get = lambda key, *default: read.add(key) or get(key, *default)  # other entry)
    with torch.cuda.stream(side):
        torch.cuda._sleep(HOLD_UP)
        held = torch.cuda.Event()
        held.record()
        got = mh.attention(q, k, v, mask=mask, backend="triton")   # B reads them later
    del memo.get
    lists = [at for key in read & storage.keys() for at in storage[key]]
    assert lists, f"B's call read no cached tensor (read {read}, cached {list(storage)})"
    memo.clear()
    dispatch.clear_cache()
    gc.collect()
    assert not any(ref() is not None for ref in alive), "the lists are still referenced"
    stats = torch.cuda.memory_stats()
    free = {pool: stats[f"reserved_bytes.{pool}.current"] - stats[f"allocated_bytes.{pool}.current"]
            for pool in ("small_pool", "large_pool")}
    taken = []
    for ptr, size in lists:                  # take every free block that could hold one
        budget = free["small_pool" if size <= 1 << 20 else "large_pool"] + size
        block = -(-max(size, 1) // 512) * 512    # the allocator's rounding of a request
        while budget > 0:
            t = torch.empty(max(size, 1), dtype=torch.uint8, device="cuda")
            taken.append(t)
            budget -= block
            start = t.data_ptr()
            assert not (start < ptr + size and ptr < start + t.numel()), (
                "memory B has yet to read was handed to A")
    assert not held.query(), "the hold-up ended before A allocated: inconclusive"
    torch.cuda.synchronize()
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)

"""Our caches while a CUDA graph captures. A captured graph records work to run at each
replay: a value computed during the capture holds its contents only once the graph has
replayed, the graph reads a cached value's memory at every replay (after the cache may have
let it go), and the graph's inputs change in place between replays (so facts of a mask's
tensors must be computed in the graph, not taken from a cache).

Without a GPU the capture is simulated (``_device.capturing`` answers True); the ``cuda``
tests capture and replay real graphs."""

from __future__ import annotations

import contextlib
import gc
import weakref
from unittest import mock

import pytest
import torch

import multihead as mh
from multihead import _device
from multihead._cache import BoundedCache

M = mh.masks


@contextlib.contextmanager
def simulated_capture():
    with mock.patch.object(_device, "capturing", lambda: True), \
            mock.patch.dict(_device._HELD, clear=False):
        yield


def test_a_cache_stores_nothing_while_a_graph_captures_and_keeps_what_the_graph_read():
    cache = BoundedCache(max_entries=4, max_bytes=1 << 20)
    kept = torch.arange(3.0)
    cache.put("kept", kept)
    with simulated_capture():
        assert cache.get("kept") is kept
        assert cache.get_or_compute("kept", lambda: torch.zeros(3)) is kept
        made = cache.get_or_compute("new", lambda: torch.ones(2))
        cache.put("put", torch.ones(1))
        assert "new" not in cache and "put" not in cache and len(cache) == 1
        assert torch.equal(made, torch.ones(2))
        read = weakref.ref(kept)
        del kept
        cache.clear()                     # the cache lets the value go ...
        gc.collect()
        assert read() is not None         # ... the graph still reads it: kept alive
        assert any(v is read() for v in _device._HELD.values())
    assert cache.get_or_compute("new", lambda: torch.ones(2)) is not made   # after: stored
    assert "new" in cache


def test_facts_of_a_masks_tensors_are_computed_in_the_graph_not_taken_from_the_cache():
    """A document mask's tile map (what the kernels' block lists come from) cached before a
    capture must not reach the graph: the ids are the graph's input, rewritten in place
    between replays, and a map from the old ids would skip or leak whole key blocks."""
    ids = torch.tensor([[0, 0, 0, 1, 1, 1, 2, 2]])
    mask = M.document(ids)
    before = mask._tile_map(8, 8, tile_q=2, tile_k=2)
    assert mask._tile_map(8, 8, tile_q=2, tile_k=2) is before            # eager: cached
    with simulated_capture():
        during = mask._tile_map(8, 8, tile_q=2, tile_k=2)
        assert during is not before                                  # computed afresh
        assert torch.equal(during.state, before.state)
    assert mask._tile_map(8, 8, tile_q=2, tile_k=2) is before            # nothing stored


def test_host_facts_of_a_masks_device_tensors_are_unknown_to_a_graph():
    """Lengths and document runs read on the host when a mask was built describe its
    tensors at that time; a graph reads the tensors at each replay instead."""
    pad = M.padding(torch.tensor([3, 8])).to("meta")             # meta stands for a GPU
    doc = M.document(cu_seqlens=torch.tensor([0, 3, 8])).to("meta")
    host_pad = M.padding(torch.tensor([3, 8]))
    assert not pad.may_have_empty_rows(8, 8) and doc.runs_known
    with simulated_capture():
        assert pad.may_have_empty_rows(8, 8) and pad._host_lengths is None
        assert not doc.runs_known
        assert not host_pad.may_have_empty_rows(8, 8)            # host tensors: no graph input
    assert not pad.may_have_empty_rows(8, 8) and doc.runs_known


def test_facts_of_a_mask_made_of_integers_are_shared_with_the_graph_and_kept():
    window = M.sliding_window(3)
    before = window._tile_map(16, 16, tile_q=4, tile_k=4)
    with simulated_capture():
        assert M.sliding_window(3)._tile_map(16, 16, tile_q=4, tile_k=4) is before
        assert any(v is before for v in _device._HELD.values())
        fresh = M.sliding_window(5)._tile_map(16, 16, tile_q=4, tile_k=4)   # a miss: not kept
    assert M.sliding_window(5)._tile_map(16, 16, tile_q=4, tile_k=4) is not fresh


def test_a_call_decided_while_a_graph_captures_is_not_remembered():
    from multihead.functional import dispatch
    q = torch.randn(1, 2, 5, 8)
    window, padding = M.sliding_window(3), M.causal() & M.padding(torch.tensor([4]))
    dispatch.clear_cache()
    with simulated_capture():
        captured = [mh.attention(q, q, q, mask=m) for m in (window, padding)]
        assert len(dispatch._DECISIONS) == 0 and len(dispatch._CHOICES) == 0
        assert "_memo" not in vars(padding)       # a tensor mask keeps its plans on itself
    for m, out in zip((window, padding), captured):
        torch.testing.assert_close(out, mh.attention(q, q, q, mask=m))
    assert len(dispatch._DECISIONS) == 0    # the capture did not count as a first time
    mh.attention(q, q, q, mask=window)      # an eager call is kept from its second time
    assert len(dispatch._DECISIONS) == 1 and len(vars(padding)["_memo"]) > 0


def test_facts_kept_on_plans_and_tables_are_not_filled_in_by_a_capture():
    """The blocksparse backend keeps its step plan on the (shared) plan, varlen its index
    lists, and the kernels keep a documents table's device schedule per table: all only
    from eager calls."""
    from multihead.functional import registry
    from multihead.functional._call import make_call
    from multihead.functional.profiles import profile_for
    q = torch.randn(1, 2, 16, 8)
    call = make_call(q, q, q, mask=M.sliding_window(4), scale=None, dropout_p=0.0,
                     return_weights=False, return_lse=False)
    backend = registry.get("blocksparse")
    plan = backend.plan(call, profile_for(q.device))
    with simulated_capture():
        captured = backend.run(call, plan)[0]
    assert "steps" not in plan.detail
    torch.testing.assert_close(backend.run(call, plan)[0], captured)
    assert "steps" in plan.detail

    # varlen keeps each length group's index lists per device on its plan
    ids = torch.tensor([[0] * 5 + [1] * 4 + [2] * 3 + [3] * 4])       # lengths 5, 4, 3, 4
    call = make_call(q, q, q, mask=M.document(ids), scale=None, dropout_p=0.0,
                     return_weights=False, return_lse=False)
    backend = registry.get("varlen")
    plan = backend.plan(call, profile_for(q.device))
    with simulated_capture():
        captured = backend.run(call, plan)[0]
    assert len(plan.detail._on) == 0
    torch.testing.assert_close(backend.run(call, plan)[0], captured)
    assert len(plan.detail._on) > 0

    pytest.importorskip("triton")
    from multihead.kernels import _band
    docs = torch.tensor([[0, 0, 40], [0, 40, 24]])                  # (b, first, length)
    made = []
    build = lambda: made.append(1) or len(made)                     # noqa: E731
    with simulated_capture():
        assert _band._derived(docs, "key", build) == 1
        assert _band._derived(docs, "key", build) == 2              # computed, not kept
    assert _band._derived(docs, "key", build) == 3
    assert _band._derived(docs, "key", build) == 3                  # eager: kept


@pytest.mark.cuda
@pytest.mark.parametrize("born", ["on the GPU", "on the host"])
def test_a_captured_document_mask_follows_its_ids_rewritten_between_replays(born):
    """The packed-documents step of a training loop under a CUDA graph: the mask's ids are
    a static input, rewritten in place before each replay."""
    pytest.importorskip("triton")
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 4, 256, 64, generator=g).to("cuda", torch.float16)
               for _ in range(3))
    ids = torch.zeros(1, 256, dtype=torch.long)                      # one document
    mask = M.document(ids.cuda()) if born == "on the GPU" else M.document(ids).to("cuda")
    run = lambda: mh.attention(q, k, v, mask=mask, backend="triton")   # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()                                                       # warm up: caches filled
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run()
    for cuts in ([100], [64, 130, 200], [1, 255]):
        new = torch.bucketize(torch.arange(256), torch.tensor(cuts), right=True)
        mask.ids.copy_(new[None])                 # the mask's own ids: the graph's input
        graph.replay()
        want = mh.attention(q, k, v, mask=M.document(new[None].cuda()), backend="sdpa")
        torch.testing.assert_close(captured, want, atol=2e-3, rtol=2e-3)


def test_no_compile_ahead_starts_while_a_graph_captures():
    """What compiling ahead prepares on the device (a plan's block lists) would be captured
    into every replay: during a capture nothing is prepared, and the first call after it
    still starts its compile."""
    pytest.importorskip("triton")
    from multihead.kernels import _ahead
    prepared, key = [], ("test: captured first", object())
    with simulated_capture():
        _ahead.compile_ahead(key, torch.device("cpu"), lambda: prepared.append(1))
    assert key not in _ahead._STARTED and not prepared
    with mock.patch.object(_ahead, "enabled", lambda: True):
        _ahead.compile_ahead(key, torch.device("cpu"), lambda: prepared.append(1))
    assert key in _ahead._STARTED and prepared == [1]


@pytest.mark.cuda
def test_a_host_copy_captured_in_a_graph_keeps_its_source():
    host = torch.arange(1000)
    held = len(_device._HELD)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = _device.to_device(host, "cuda") * 2
    assert len(_device._HELD) == held + 1                           # the pinned source
    for _ in range(20):                                             # pinned memory reused
        torch.full((1000,), -1).pin_memory()
    graph.replay()
    assert torch.equal(out.cpu(), host * 2)

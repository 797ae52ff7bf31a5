"""Decoding over a PagedKVCache through its block table (no gather), under Triton's
interpreter on the CPU (compiled on a GPU): the kernel against the fp64 oracle, and a
module's decoding steps reading pages in place against the same steps gathering them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import multihead as mh

pytest.importorskip("triton")
from multihead.kernels.decode import decode_forward, paged_decode_forward  # noqa: E402
from multihead.modules import attention as attention_module  # noqa: E402

M = mh.masks
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _pool(page_size, lengths, Hkv=2, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    pool = mh.PagedKVCache(num_pages=40, page_size=page_size, num_kv_heads=Hkv, head_dim=D,
                           dtype=torch.float16, device=DEV)
    ids = [pool.add_sequence() for _ in lengths]
    for sid, n in zip(ids, lengths):        # written one sequence at a time: pages interleave
        k, v = (torch.randn(1, Hkv, n, D, generator=g).to(DEV, torch.float16) for _ in "kv")
        batch = pool.batch([sid])
        batch.begin()
        batch.update(k, v)
        batch.commit()
    return pool, ids


@pytest.mark.parametrize("page_size", [16, 64])
@pytest.mark.parametrize("band", ["causal", "window 20", "none"])
def test_paged_decoding_equals_the_fp64_oracle_on_each_sequence(band, page_size):
    lengths = [150, 37, 64]                 # the longest, one mid-page, one page-aligned
    pool, ids = _pool(page_size, lengths)
    lens, table, *_ = pool._device_tables(ids)
    q = torch.randn(3, 4, 2, 16, generator=torch.Generator().manual_seed(1)).to(DEV, torch.float16)
    window = int(band.split()[1]) if band.startswith("window") else None
    out, lse = paged_decode_forward(q, pool.k, pool.v, table, lens, max_len=max(lengths),
                                    page_size=page_size, scale=0.25, causal=band != "none",
                                    window=window)
    mask = {"causal": M.causal(), "none": None}.get(band, M.sliding_window(window or 1))
    for b, sid in enumerate(ids):
        k, v, _ = pool.batch([sid])._gather(lens[b:b + 1], table[b:b + 1])    # (1, Hkv, n, D)
        ref, ref_lse = mh.attention(q[b:b + 1].double(), k.double(), v.double(), mask=mask,
                                    scale=0.25, backend="reference", return_lse=True)
        torch.testing.assert_close(out[b:b + 1].double(), ref, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(lse[b:b + 1].double(), ref_lse, atol=1e-4, rtol=1e-4)


def _three_sequences(splits):
    """A pool of sequences of 150, 37 and 64 keys, one decoding query each, and a step over
    them with the given table and lengths (``splits`` as decode_forward takes it; None: the
    public paged_decode_forward)."""
    pool, ids = _pool(64, [150, 37, 64])
    lens, table, *_ = pool._device_tables(ids)
    q = torch.randn(3, 4, 1, 16, generator=torch.Generator().manual_seed(1)).to(DEV, torch.float16)
    k, v = (x.permute(1, 0, 2)[None].expand(3, -1, -1, -1)[:, :, :150]   # (3, Hkv, 150, D)
            for x in (pool.k, pool.v))

    def run(table, lens):
        if splits is None:
            return paged_decode_forward(q, pool.k, pool.v, table, lens, max_len=150,
                                        page_size=64, scale=0.25, causal=True)
        return decode_forward(q, k, v, scale=0.25, causal=True, offset=149, kv_lengths=lens,
                              block_table=table, page_size=64, pages=40, splits=splits)

    return run, table, lens


def _only_sequence_1_is_nan(out, lse, good):
    assert out[1].isnan().all() and lse[1].isnan().all()
    for b in (0, 2):
        torch.testing.assert_close(out[b], good[0][b], atol=0, rtol=0)
        torch.testing.assert_close(lse[b], good[1][b], atol=0, rtol=0)


@pytest.mark.parametrize("bad_page", [40, 10**6, -1])
@pytest.mark.parametrize("splits", [None, 1])
def test_a_page_id_outside_the_pool_gives_nan_rows_not_other_memory(bad_page, splits):
    """A hand-made table whose used entry points past the pool (or below it): that
    sequence's rows are NaN (the kernel checks each id it uses, with no host sync and no
    read outside the pool); the other sequences are untouched, and an entry past a
    sequence's length (padding) is never used."""
    run, table, lens = _three_sequences(splits)
    good = run(table, lens)
    table = table.clone()
    table[1, 0] = bad_page                  # used by sequence 1 (37 keys: its only page)
    table[2, 2] = bad_page                  # past sequence 2's 64 keys: padding, unused
    _only_sequence_1_is_nan(*run(table, lens), good)


@pytest.mark.parametrize("bad_length", [151, 10**6, -3], ids=["past", "far-past", "negative"])
@pytest.mark.parametrize("splits", [None, 1])
def test_a_length_past_max_len_gives_nan_rows_not_a_silent_cut(bad_length, splits):
    """max_len is a host int the kernel trusts for its sizes; a sequence whose device
    length is past it (its keys after max_len would be dropped) or negative gets NaN rows,
    and the others are untouched."""
    run, table, lens = _three_sequences(splits)
    good = run(table, lens)
    lens = lens.clone()
    lens[1] = bad_length
    _only_sequence_1_is_nan(*run(table, lens), good)


def _decode_steps(in_place, monkeypatch, mask):
    """Prefill two sequences of different lengths, then three decoding steps; returns the
    step outputs and the pool's lengths."""
    torch.manual_seed(0)
    attn = mh.MultiHeadAttention(64, 8, num_kv_heads=2).to(DEV, torch.float16).eval()
    pool = mh.PagedKVCache(num_pages=16, page_size=16, num_kv_heads=2, head_dim=8,
                           dtype=torch.float16, device=DEV)
    a, b = pool.add_sequence(), pool.add_sequence()
    g = torch.Generator().manual_seed(2)
    x = lambda n: torch.randn(1, n, 64, generator=g).to(DEV, torch.float16)  # noqa: E731
    steps = []
    calls = []
    real = attention_module._paged_decode
    monkeypatch.setattr(attention_module, "_reads_pages",       # the rule as on a GPU:
                        lambda cache, q, *rest: in_place and q.shape[2] <= 16)  # steps only
    monkeypatch.setattr(attention_module, "_paged_decode",
                        lambda *args: calls.append(1) or real(*args))
    with torch.no_grad():
        attn(x(21), cache=pool.batch([a]), mask=mask)
        attn(x(40), cache=pool.batch([b]), mask=mask)
        for _ in range(3):
            steps.append(attn(torch.cat([x(1), x(1)]), cache=pool.batch([a, b]), mask=mask))
    return steps, (pool.length(a), pool.length(b)), len(calls)


@pytest.mark.parametrize("mask", [M.causal(), M.sliding_window(9), None],
                         ids=["causal", "window", "none"])
def test_a_module_decodes_a_paged_batch_in_place_as_it_does_by_gathering(mask, monkeypatch):
    got, lengths, calls = _decode_steps(True, monkeypatch, mask)
    want, lengths_gathered, none = _decode_steps(False, monkeypatch, mask)
    assert calls == 3 and none == 0 and lengths == lengths_gathered == (24, 43)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-3, rtol=2e-3)


def test_steps_that_must_gather_are_named_by_the_rule():
    pool = mh.PagedKVCache(num_pages=4, page_size=16, num_kv_heads=1, head_dim=8,
                           dtype=torch.float16)
    batch = pool.batch([pool.add_sequence()])
    q = torch.empty(1, 2, 1, 8, dtype=torch.float16)
    rule = attention_module._reads_pages
    assert not rule(batch, q, M.causal(), None, "auto")                  # CPU: gather
    assert not rule(mh.KVCache(1, 8, 1, 8), q, None, None, "auto")       # not paged
    q = q.to("meta")                                                     # still not cuda
    assert not rule(batch, q, M.causal(), None, "auto")
    odd = mh.PagedKVCache(num_pages=4, page_size=8, num_kv_heads=1, head_dim=8)
    assert not rule(odd.batch([odd.add_sequence()]), q, None, None, "auto")

    def on_cuda(D, dtype=torch.float16, n=1):          # what the rule reads of a GPU query
        return SimpleNamespace(device=torch.device("cuda"), dtype=dtype, shape=(1, 2, n, D),
                               requires_grad=False)
    assert rule(batch, on_cuda(8), M.causal(), None, "auto")                 # the fast path
    assert rule(batch, on_cuda(8), M.sliding_window(4), None, "triton")
    assert not rule(batch, on_cuda(8), M.causal(align="upper_left"), None, "auto")
    assert not rule(batch, on_cuda(8), M.causal(), None, "sdpa")
    assert not rule(batch, on_cuda(8, torch.float32), M.causal(), None, "auto")
    assert not rule(batch, on_cuda(8, n=17), M.causal(), None, "auto")      # not a step
    assert not rule(batch, on_cuda(8), M.causal(), torch.ones(1, 1, dtype=torch.bool), "auto")
    wide = mh.PagedKVCache(num_pages=4, page_size=16, num_kv_heads=1, head_dim=288)
    assert not rule(wide.batch([wide.add_sequence()]), on_cuda(288), None, None, "auto")


@pytest.mark.parametrize("kw, match", [
    (dict(page_size=48), "multiple of the key block 64"),
    (dict(block_table=torch.zeros(2, 3, dtype=torch.long)), r"block_table must be .*B=1"),
    (dict(kv_lengths=None), "needs kv_lengths"),
    (dict(block_table=torch.zeros(1, 1, dtype=torch.long)), "fewer than the 128 keys"),
    (dict(pages=0), "pages must be the pool's number of pages, a positive integer, got 0"),
    (dict(pages=2.0), "pages must be .* got 2.0"),
])
def test_decode_refuses_a_bad_block_table_by_name(kw, match):
    q = torch.randn(1, 2, 1, 16, dtype=torch.float16)
    k = torch.randn(1, 1, 128, 16, dtype=torch.float16)
    args = dict(scale=1.0, kv_lengths=torch.tensor([100]),
                block_table=torch.zeros(1, 2, dtype=torch.long), page_size=64)
    args.update(kw)
    with pytest.raises(ValueError, match=f"decode_forward: .*{match}"):
        decode_forward(q, k, k, **args)


@pytest.mark.cuda
def test_a_paged_batch_decodes_in_place_on_cuda_as_a_static_cache_does():
    """The same prompts through a KVCache and a PagedKVCache (pages of 64: the fast path),
    then greedy-free decoding steps: outputs agree, and the paged steps never gather."""
    torch.manual_seed(0)
    attn = mh.MultiHeadAttention(256, 16, num_kv_heads=4).to("cuda", torch.bfloat16).eval()
    pool = mh.PagedKVCache(num_pages=64, page_size=64, num_kv_heads=4, head_dim=16,
                           dtype=torch.bfloat16, device="cuda")
    seqs = [pool.add_sequence() for _ in range(2)]
    static = attn.make_cache(batch_size=2, max_len=1024)
    x = torch.randn(2, 300, 256, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        attn(x, cache=static, mask=M.causal())
        for i, s in enumerate(seqs):
            attn(x[i:i + 1], cache=pool.batch([s]), mask=M.causal())
        for _ in range(4):
            step = torch.randn(2, 1, 256, device="cuda", dtype=torch.bfloat16)
            want = attn(step, cache=static, mask=M.causal())
            got = attn(step, cache=pool.batch(seqs), mask=M.causal())
            torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("change, match", [
    (dict(q=(2, 1, 16)), r"q must be 4-D \(B, H, Sq, D\), got shape \(2, 1, 16\)"),
    (dict(pool=(2, 32, 1, 16)), r"k_pool must be 3-D .* got shape \(2, 32, 1, 16\)"),
    (dict(pool=(40, 1, 16)), "the pools' 40 slots are not whole pages of 16"),
    (dict(table=torch.zeros(1, 4, dtype=torch.bool)), "block_table must be an integer"),
    (dict(lengths=torch.tensor([True])), "kv_lengths must be an integer tensor"),
    (dict(max_len=40.0), "max_len must be the longest sequence's length, an integer of at "
                         "most the pool's 64 slots, got 40.0"),
    (dict(max_len=65), "max_len must be .* got 65"),
])
def test_paged_decoding_refuses_a_bad_pool_or_table_by_name(change, match):
    """A pool or query of the wrong rank, a pool that ends inside a page (its last page
    would be read past the end), booleans for page ids or lengths: errors by name."""
    q = torch.randn(change.get("q", (1, 2, 1, 16))).half()
    pool = torch.randn(change.get("pool", (64, 1, 16))).half()
    table = change.get("table", torch.zeros(1, 4, dtype=torch.long))
    lengths = change.get("lengths", torch.tensor([40]))
    with pytest.raises(ValueError, match=match):
        paged_decode_forward(q, pool, pool, table, lengths, max_len=change.get("max_len", 40),
                             page_size=16, scale=1.0)


@pytest.mark.parametrize("page_size", [8, 16.0])
def test_paged_decoding_refuses_pages_that_are_not_a_multiple_of_16(page_size):
    q = torch.randn(1, 2, 1, 16, dtype=torch.float16)
    pool = torch.randn(64, 1, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match=f"page_size must be an integer multiple of 16, got "
                                         f"{page_size!r}"):
        paged_decode_forward(q, pool, pool, torch.zeros(1, 8, dtype=torch.long),
                             torch.tensor([40]), max_len=40, page_size=page_size, scale=1.0)


def test_a_numpy_page_size_decodes_as_an_int_does():
    import numpy as np
    pool, ids = _pool(16, [40, 23])
    lens, table, *_ = pool._device_tables(ids)
    q = torch.randn(2, 4, 1, 16, generator=torch.Generator().manual_seed(2)).to(DEV, torch.float16)
    runs = [paged_decode_forward(q, pool.k, pool.v, table, lens, max_len=40, page_size=p,
                                 scale=0.25, causal=True) for p in (16, np.int64(16))]
    torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=0)


def test_a_failing_in_place_step_leaves_the_pool_as_it_was(monkeypatch):
    """The step's tokens are written before the kernel runs; if it raises, the module's
    rollback returns the pages and lengths exactly as they were."""
    attn = mh.MultiHeadAttention(64, 8, num_kv_heads=2).to(DEV, torch.float16).eval()
    pool = mh.PagedKVCache(num_pages=8, page_size=16, num_kv_heads=2, head_dim=8,
                           dtype=torch.float16, device=DEV)
    a = pool.add_sequence()
    x = torch.randn(1, 16, 64).to(DEV, torch.float16)
    with torch.no_grad():
        attn(x, cache=pool.batch([a]), mask=M.causal())        # fills exactly one page
    before = (pool.length(a), pool.pages_used, pool.k.clone(), pool.valid.clone())

    def fail(*args):
        raise RuntimeError("kernel failed")
    monkeypatch.setattr(attention_module, "_reads_pages", lambda cache, q, *rest: True)
    monkeypatch.setattr(attention_module, "_paged_decode", fail)
    with torch.no_grad(), pytest.raises(RuntimeError, match="kernel failed"):
        attn(x[:, :1], cache=pool.batch([a]), mask=M.causal())   # would take a new page
    assert (pool.length(a), pool.pages_used) == before[:2]
    assert torch.equal(pool.k, before[2]) and torch.equal(pool.valid, before[3])

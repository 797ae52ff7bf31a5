"""KV caches: cached decoding equals one full causal forward (MHA/GQA/MQA, RoPE, padded
prompts of different lengths, fp32 and bf16), chunked prefill, paged == static,
cross-attention caching, and caches left unchanged by refused writes."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch

import multihead as mh

E, H = 32, 4
CAUSAL = mh.masks.causal()


def _module(kv, rope, dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    m = mh.MultiHeadAttention(E, H, num_kv_heads=kv,
                              rope=mh.RotaryEmbedding(E // H) if rope else None).eval()
    return m.to(dtype)


def _data(lengths, steps, dtype, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n + steps, E, generator=g).to(dtype) for n in lengths]


def _decode(m, seqs, lengths, steps, cache, side):
    """Prefill padded prompts (one padding side), then `steps` single-token steps."""
    B, P = len(seqs), max(lengths)
    x = torch.zeros(B, P, E, dtype=seqs[0].dtype)
    valid = torch.zeros(B, P, dtype=torch.bool)
    for b, (s, n) in enumerate(zip(seqs, lengths)):
        sl = slice(0, n) if side == "right" else slice(P - n, P)
        x[b, sl], valid[b, sl] = s[:n], True
    y = m(x, cache=cache, mask=CAUSAL, valid=valid)
    outs = [[y[b, valid[b]]] for b in range(B)]
    for t in range(steps):
        xt = torch.stack([s[n + t] for s, n in zip(seqs, lengths)])[:, None]   # (B, 1, E)
        yt = m(xt, cache=cache, mask=CAUSAL)
        for b in range(B):
            outs[b].append(yt[b])
    return [torch.cat(o) for o in outs]


def _full(m, seqs):
    return [m(s[None], mask=CAUSAL)[0] for s in seqs]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
@pytest.mark.parametrize("kv", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_token_by_token_equals_full_forward_fp32(kv, rope, side):
    lengths, steps = [5, 3, 1], 4
    m = _module(kv, rope)
    seqs = _data(lengths, steps, torch.float32)
    with torch.no_grad():
        got = _decode(m, seqs, lengths, steps, m.make_cache(3, 16), side)
        want = _full(m, seqs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kv", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_bf16_within_twice_the_full_forward_error(kv):
    lengths, steps = [6, 2], 3
    m32 = _module(kv, True).double()
    m16 = copy.deepcopy(m32).to(torch.bfloat16)
    seqs = _data(lengths, steps, torch.float64)
    with torch.no_grad():
        ref = _full(m32, seqs)
        got = _decode(m16, [s.bfloat16() for s in seqs], lengths, steps, m16.make_cache(2, 12),
                      "right")
        base = _full(m16, [s.bfloat16() for s in seqs])
    for g, b, r in zip(got, base, ref):
        assert (g.double() - r).abs().max() <= 2 * (b.double() - r).abs().max() + 1e-3


def test_chunked_prefill_equals_prefill_at_once():
    m = _module(2, True)
    x = torch.randn(2, 11, E)
    with torch.no_grad():
        once = m(x, cache=m.make_cache(2, 16), mask=CAUSAL)
        cache = m.make_cache(2, 16)
        chunks = [m(x[:, a:b], cache=cache, mask=CAUSAL) for a, b in ((0, 4), (4, 5), (5, 11))]
    torch.testing.assert_close(torch.cat(chunks, 1), once, atol=2e-6, rtol=1e-5)
    assert cache.seen == 11 and cache.lengths.tolist() == [11, 11]


def test_paged_equals_static_and_frees_pages():
    m = _module(2, True)
    lengths, steps = [7, 2], 5
    seqs = _data(lengths, steps, torch.float32)
    pool = mh.PagedKVCache(num_pages=16, page_size=4, num_kv_heads=2, head_dim=E // H)
    ids = [pool.add_sequence(), pool.add_sequence()]
    with torch.no_grad():
        static = _decode(m, seqs, lengths, steps, m.make_cache(2, 16), "right")
        # paged: each sequence prefilled on its own (continuous batching), then decoded together
        paged = [[m(s[None, :n], cache=pool.batch([i]), mask=CAUSAL)[0]]
                 for s, n, i in zip(seqs, lengths, ids)]
        for t in range(steps):
            xt = torch.stack([s[n + t] for s, n in zip(seqs, lengths)])[:, None]
            yt = m(xt, cache=pool.batch(ids), mask=CAUSAL)
            for b in range(2):
                paged[b].append(yt[b])
    for s, p in zip(static, paged):
        torch.testing.assert_close(torch.cat(p), s, atol=2e-6, rtol=1e-5)
    assert [pool.length(i) for i in ids] == [12, 7]
    assert pool.pages_used == 3 + 2 and pool.nbytes == 5 * 4 * 2 * 2 * (E // H) * 4
    pool.free(ids[0])
    assert pool.pages_used == 2
    with pytest.raises(KeyError, match="unknown sequence id 0"):
        pool.free(ids[0])
    with pytest.raises(KeyError, match="unknown sequence id"):
        pool.batch([ids[0]])
    with pytest.raises(ValueError, match=r"distinct sequence ids, got \[1, 1\]"):
        pool.batch([ids[1], ids[1]])
    with pytest.raises(ValueError, match="page_size must be a positive int"):
        mh.PagedKVCache(num_pages=4, page_size=0, num_kv_heads=2, head_dim=8)


def test_cross_attention_cache_equals_recomputing():
    m = _module(2, False)
    ctx, x = torch.randn(2, 9, E), torch.randn(2, 4, E)
    cache = m.make_cache(2, 9)
    with torch.no_grad():
        first = m(x[:, :2], ctx, cache=cache)
        later = m(x[:, 2:], cache=cache)                 # context not given again
        full = m(x, ctx)
    torch.testing.assert_close(torch.cat([first, later], 1), full, atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="already holds"):
        m(x, ctx, cache=cache)
    with pytest.raises(ValueError, match="valid marks padded new tokens of a self-attention"):
        m(x, cache=cache, valid=torch.ones(2, 4, dtype=torch.bool))


def _snapshot(c):
    return [t.clone() for t in (c.k, c.v, c.valid)] + [getattr(c, "lengths", torch.tensor(0)).clone()]


def test_overflow_leaves_static_cache_unchanged():
    m = _module(2, True)
    cache = m.make_cache(1, 8)
    m(torch.randn(1, 6, E), cache=cache, mask=CAUSAL)
    before, seen = _snapshot(cache), cache.seen
    with pytest.raises(ValueError, match="KVCache is full: it holds 6 of max_len=8 slots and 3 more"):
        m(torch.randn(1, 3, E), cache=cache, mask=CAUSAL)
    assert cache.seen == seen
    for a, b in zip(before, _snapshot(cache)):
        assert torch.equal(a, b)


def test_overflow_leaves_paged_cache_unchanged():
    m = _module(2, False)
    pool = mh.PagedKVCache(num_pages=3, page_size=4, num_kv_heads=2, head_dim=E // H)
    a, b = pool.add_sequence(), pool.add_sequence()
    m(torch.randn(1, 8, E), cache=pool.batch([a]), mask=CAUSAL)
    before, used, lens = _snapshot(pool), pool.pages_used, (pool.length(a), pool.length(b))
    with pytest.raises(ValueError, match="out of pages: this step needs 2 more"):
        m(torch.randn(2, 3, E), cache=pool.batch([a, b]), mask=CAUSAL)
    assert (pool.pages_used, pool.length(a), pool.length(b)) == (used, *lens)
    for x, y in zip(before, _snapshot(pool)):
        assert torch.equal(x, y)


def test_mismatches_and_reset():
    m = _module(2, True)
    x = torch.randn(2, 3, E)
    with pytest.raises(ValueError, match="num_kv_heads=4.*module has num_kv_heads=2"):
        m(x, cache=mh.KVCache(2, 8, num_kv_heads=4, head_dim=8), mask=CAUSAL)
    with pytest.raises(ValueError, match="head_dim=4"):
        m(x, cache=mh.KVCache(2, 8, num_kv_heads=2, head_dim=4), mask=CAUSAL)
    with pytest.raises(TypeError, match="cache is torch.float64"):
        m(x, cache=mh.KVCache(2, 8, num_kv_heads=2, head_dim=8, dtype=torch.float64))
    with pytest.raises(ValueError, match="x has batch 2 but the cache holds 3"):
        m(x, cache=m.make_cache(3, 8))
    with pytest.raises(ValueError, match="valid must be a bool tensor"):
        m(x, cache=m.make_cache(2, 8), valid=torch.ones(2, 3))
    with pytest.raises(ValueError, match="valid marks padded new tokens"):
        m(x, valid=torch.ones(2, 3, dtype=torch.bool))
    with pytest.raises(ValueError, match="positions come from the cache"):
        m(x, cache=m.make_cache(2, 8), positions=torch.arange(3))
    with pytest.raises(ValueError, match="max_len must be a positive int"):
        mh.KVCache(1, 0, num_kv_heads=1, head_dim=8)
    cache = m.make_cache(2, 8)
    with torch.no_grad():
        first = m(x, cache=cache, mask=CAUSAL)
        m(torch.randn(2, 4, E), cache=cache, mask=CAUSAL)
        cache.reset()
        assert cache.seen == 0 and cache.lengths.tolist() == [0, 0]
        again = m(x, cache=cache, mask=CAUSAL)            # reuse after reset: a fresh cache
    torch.testing.assert_close(again, first)


def test_gqa_decode_reads_each_kv_head_once():
    m = _module(1, False)
    cache = m.make_cache(1, 64)
    m(torch.randn(1, 40, E), cache=cache, mask=CAUSAL)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    with mock.patch("torch.Tensor.repeat_interleave", side_effect=AssertionError("K/V copied")), \
            mock.patch("torch.nn.functional.scaled_dot_product_attention", wraps=sdpa) as f:
        m(torch.randn(1, 1, E), cache=cache, mask=CAUSAL)
    k = f.call_args.args[1]
    assert k.shape[1] == 1 and k.data_ptr() == cache.k.data_ptr()   # a view of the cache


def test_cache_sizes_make_the_mqa_argument():
    mha, gqa, mqa = (mh.MultiHeadAttention(4096, 32, num_kv_heads=h) for h in (32, 8, 1))
    per = [x.cache_bytes_per_token(torch.bfloat16) for x in (mha, gqa, mqa)]
    assert per == [2 * 32 * 128 * 2, 2 * 8 * 128 * 2, 2 * 1 * 128 * 2]
    assert mh.KVCache(1, 4096, 8, 128, dtype=torch.bfloat16).nbytes == 4096 * per[1]

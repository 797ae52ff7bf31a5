"""KV caches: cached decoding equals one full causal forward (MHA/GQA/MQA, RoPE, padded
prompts of different lengths, static and paged, fp32 and bf16), chunked prefill, paged ==
static, cross-attention caching (with RoPE), caches left unchanged by refused writes, and
no host-device sync in cached decoding (on the meta device, under NoReadBack).

The helpers here (_module, _data, _cache, _decode, _decode_paged, _cross_decode, _full,
_assert_rule, SYNC_SCENARIOS) also serve tests/test_cuda_modules.py."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import multihead as mh
from nosync import NoReadBack

E, H = 32, 4
CAUSAL = mh.masks.causal()
M_WINDOW_ALIBI = mh.masks.sliding_window(3) & mh.masks.alibi(H)


def _module(kv, rope, dtype=torch.float32, seed=0, device="cpu"):
    torch.manual_seed(seed)
    m = mh.MultiHeadAttention(E, H, num_kv_heads=kv,
                              rope=mh.RotaryEmbedding(E // H) if rope else None).eval()
    return m.to(device, dtype)


def _data(lengths, steps, dtype, seed=1, device="cpu"):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n + steps, E, generator=g).to(device, dtype) for n in lengths]


def _pool(m, num_pages=16, page_size=4):
    p = m.out_proj.weight
    return mh.PagedKVCache(num_pages=num_pages, page_size=page_size, num_kv_heads=m.num_kv_heads,
                           head_dim=m.head_dim, dtype=p.dtype, device=p.device)


def _decode(m, seqs, lengths, steps, cache, side, mask=CAUSAL):
    """Prefill padded prompts (one padding side), then `steps` single-token steps."""
    B, P, dev = len(seqs), max(lengths), seqs[0].device
    x = torch.zeros(B, P, E, dtype=seqs[0].dtype, device=dev)
    valid = torch.zeros(B, P, dtype=torch.bool, device=dev)
    for b, (s, n) in enumerate(zip(seqs, lengths)):
        sl = slice(0, n) if side == "right" else slice(P - n, P)
        x[b, sl], valid[b, sl] = s[:n], True
    y = m(x, cache=cache, mask=mask, valid=valid)
    outs = [[y[b, valid[b]]] for b in range(B)]
    for t in range(steps):
        xt = torch.stack([s[n + t] for s, n in zip(seqs, lengths)])[:, None]   # (B, 1, E)
        yt = m(xt, cache=cache, mask=mask)
        for b in range(B):
            outs[b].append(yt[b])
    return [torch.cat(o) for o in outs]


def _decode_paged(m, seqs, lengths, steps, pool):
    """Continuous batching: each prompt prefilled on its own, then all decoded together."""
    ids = [pool.add_sequence() for _ in seqs]
    outs = [[m(s[None, :n], cache=pool.batch([i]), mask=CAUSAL)[0]]
            for s, n, i in zip(seqs, lengths, ids)]
    for t in range(steps):
        xt = torch.stack([s[n + t] for s, n in zip(seqs, lengths)])[:, None]   # (B, 1, E)
        yt = m(xt, cache=pool.batch(ids), mask=CAUSAL)
        for b in range(len(seqs)):
            outs[b].append(yt[b])
    return [torch.cat(o) for o in outs], ids


def _full(m, seqs, mask=CAUSAL):
    return [m(s[None], mask=mask)[0] for s in seqs]


def _assert_rule(got, base, ref, slack):
    """The error rule: ``got``'s error against the fp64 ``ref`` is at most twice the error of
    ``base`` (the same computation done plainly in the same dtype), plus ``slack``."""
    for g, b, r in zip(got, base, ref):
        err, base_err = (g.double() - r).abs().max(), (b.double() - r).abs().max()
        assert err <= 2 * base_err + slack, f"error {err:.3g} > 2 x {base_err:.3g} + {slack:.3g}"


def _cache(kind, m, B):
    """A fresh cache for ``B`` sequences: a static KVCache or a batch of a new paged pool."""
    if kind == "static":
        return m.make_cache(B, 16)
    pool = _pool(m)
    return pool.batch([pool.add_sequence() for _ in range(B)])


@pytest.mark.parametrize("kind", ["static", "paged"])
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
@pytest.mark.parametrize("kv", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_token_by_token_equals_full_forward_fp32(kv, rope, side, kind):
    lengths, steps = [5, 3, 1], 4
    m = _module(kv, rope)
    seqs = _data(lengths, steps, torch.float32)
    with torch.no_grad():
        got = _decode(m, seqs, lengths, steps, _cache(kind, m, 3), side)
        want = _full(m, seqs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
@pytest.mark.parametrize("kind", ["static", "paged"])
def test_a_compiled_module_decodes_with_a_cache_as_eager_does(kind, grad):
    """A cached forward runs eagerly inside torch.compile (a graph break): same outputs,
    same cache; in grad mode a traced write failed inside torch and left the cache's counts
    behind its tensors. fullgraph=True says why it cannot, and writes nothing."""
    lengths, steps = [5, 3], 3
    m = _module(2, True)
    seqs = _data(lengths, steps, torch.float32)
    torch._dynamo.reset()
    compiled = torch.compile(m, backend="aot_eager")
    with torch.set_grad_enabled(grad):
        got = _decode(compiled, seqs, lengths, steps, cache := _cache(kind, m, 2), "left")
        want = _decode(m, seqs, lengths, steps, eager := _cache(kind, m, 2), "left")
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)
    if kind == "static":
        assert cache.seen == eager.seen and torch.equal(cache.k, eager.k)
        torch.testing.assert_close(cache.lengths, eager.lengths)
        before = copy.deepcopy(cache)
        with pytest.raises(Exception, match="cache= writes the cache.*runs eagerly"):
            torch.compile(m, backend="aot_eager", fullgraph=True)(
                seqs[0][None, :1], cache=cache, mask=CAUSAL)
        assert cache.seen == before.seen and torch.equal(cache.valid, before.valid)


def test_fullgraph_says_why_a_cached_forward_runs_eagerly_on_a_first_compile():
    """With no compile before it in the process, the graph break's wrapper was built inside
    the trace, which Dynamo refused as "marked as skipped" without our reason."""
    m = _module(2, True).eval()
    cache = m.make_cache(batch_size=2, max_len=16)
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(Exception, match="cache= writes the cache.*runs eagerly"):
        torch.compile(m, backend="aot_eager", fullgraph=True)(torch.randn(2, 3, m.embed_dim),
                                                              cache=cache, mask=CAUSAL)
    assert cache.seen == 0


def test_importing_multihead_does_not_import_the_compiler():
    """torch._dynamo takes about a second to import: the cached step's graph break is made
    on its first traced call, not when the module is defined (every CLI call paid it)."""
    import subprocess
    import sys
    code = "import sys, multihead; print('torch._dynamo' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


DISTANCE = {"window": mh.masks.sliding_window(3), "alibi": mh.masks.alibi(H) & CAUSAL,
            "window and alibi": mh.masks.sliding_window(2) & mh.masks.alibi(H)}


@pytest.mark.parametrize("kind", ["static", "paged"])
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("mask", DISTANCE)
def test_distance_masks_count_tokens_not_the_padding_between_them(mask, side, kind):
    """Right padding leaves empty slots between a prompt and the tokens generated after it:
    a window or ALiBi measures the distance in tokens, as the full forward does."""
    lengths, steps = [5, 3, 1], 4
    m = _module(2, True, torch.float64)
    seqs = _data(lengths, steps, torch.float64)
    with torch.no_grad():
        got = _decode(m, seqs, lengths, steps, _cache(kind, m, 3), side, DISTANCE[mask])
        want = _full(m, seqs, DISTANCE[mask])
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("kind", ["static", "paged"])
def test_a_paused_sequence_keeps_its_window(kind):
    """A step where one sequence of the batch is padding (valid False) does not widen its
    window for the steps after."""
    m, w = _module(2, True, torch.float64), mh.masks.sliding_window(3)
    seqs = _data([4, 4], 5, torch.float64)                       # 9 tokens each
    cache, seen = _cache(kind, m, 2), [4, 4]
    with torch.no_grad():
        y = m(torch.stack([s[:4] for s in seqs]), cache=cache, mask=w)
        outs = [[y[0]], [y[1]]]
        for step in range(5):
            run = [True, step not in (1, 2)]                     # the second pauses twice
            xt = torch.stack([s[n] for s, n in zip(seqs, seen)])[:, None]   # (2, 1, E)
            yt = m(xt, cache=cache, mask=w, valid=torch.tensor(run)[:, None])
            for b in range(2):
                if run[b]:
                    outs[b].append(yt[b])
                    seen[b] += 1
        want = _full(m, [s[:n] for s, n in zip(seqs, seen)], w)
    for o, wt in zip(outs, want):
        torch.testing.assert_close(torch.cat(o), wt, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("tensor", [torch.ones(1, 3, dtype=torch.bool), torch.zeros(1, 3)],
                         ids=["bool", "bias"])
def test_a_tensor_mask_combines_with_a_padded_cache(tensor):
    m = _module(2, False)
    x = torch.randn(2, 3, E)
    with torch.no_grad():
        out = {}
        for name, mask in (("tensor", tensor), ("none", None)):
            cache = m.make_cache(2, 8)
            m(x[:, :2], cache=cache, valid=torch.tensor([[True, True], [False, True]]))
            out[name] = m(x[:, 2:], cache=cache, mask=mask)
    torch.testing.assert_close(out["tensor"], out["none"], atol=0, rtol=0)


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
    _assert_rule(got, base, ref, 1e-3)


@pytest.mark.parametrize("kind", ["static", "paged"])
def test_an_fp32_module_decodes_under_autocast(kind):
    """Under torch.autocast the projections give bf16 K/V: a cache of the module's fp32 was
    refused ("k/v are bfloat16, the cache is float32"), and a bf16 one too ("the module is
    float32"), so mixed-precision generation could not use a cache at all."""
    lengths, steps = [6, 2], 3
    m = _module(2, True)
    seqs = _data(lengths, steps, torch.float32)
    with torch.no_grad():
        ref = _full(m.double(), [s.double() for s in seqs])
        m.float()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            base = _full(m, seqs)
            if kind == "static":
                cache = m.make_cache(2, 12)
                assert cache.dtype == torch.bfloat16
                got = _decode(m, seqs, lengths, steps, cache, "left")
            else:
                pool = mh.PagedKVCache(num_pages=16, page_size=4, num_kv_heads=2,
                                       head_dim=E // H, dtype=torch.bfloat16)
                got, _ = _decode_paged(m, seqs, lengths, steps, pool)
            assert {g.dtype for g in got + base} == {torch.bfloat16}
            # x in the autocast dtype is what autocast would make of it: the same output
            torch.testing.assert_close(m(seqs[0][None].bfloat16(), mask=CAUSAL)[0], base[0],
                                       atol=0, rtol=0)
    _assert_rule(got, base, ref, 1e-3)


def test_a_cache_of_another_dtype_than_the_call_computes_is_refused_with_the_fix():
    m, x = _module(2, True), torch.randn(2, 3, E)
    fp32, bf16 = m.make_cache(2, 8), mh.KVCache(2, 8, 2, E // H, dtype=torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(
            TypeError, match=r"cache is torch.float32 but under torch.autocast\(torch.bfloat16\) "
                             r"this module computes K/V in torch.bfloat16: build the cache with "
                             r"dtype=torch.bfloat16 \(module.make_cache"):
        m(x, cache=fp32, mask=CAUSAL)
    with pytest.raises(TypeError, match=r"cache is torch.bfloat16 but this module computes K/V "
                                        r"in torch.float32: .* or call it under torch.autocast"):
        m(x, cache=bf16, mask=CAUSAL)
    with pytest.raises(TypeError, match="x is torch.bfloat16 on cpu but the module is torch.float32"):
        m(x.bfloat16(), mask=CAUSAL)                 # outside autocast: not cast for you
    assert fp32.seen == bf16.seen == 0


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
    with torch.no_grad():
        static = _decode(m, seqs, lengths, steps, m.make_cache(2, 16), "right")
        paged, ids = _decode_paged(m, seqs, lengths, steps, pool)
    for s, p in zip(static, paged):
        torch.testing.assert_close(p, s, atol=2e-6, rtol=1e-5)
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


def _cross_decode(m, x, ctx, cache, chunks):
    """Queries fed in chunks of these sizes; the context is given on the first call only."""
    outs, start = [], 0
    for i, n in enumerate(chunks):
        outs.append(m(x[:, start:start + n], ctx if i == 0 else None, cache=cache))
        start += n
    return torch.cat(outs, 1)                                         # (B, Sq, E)


@pytest.mark.parametrize("chunks", [[1] * 7, [2, 4, 1]], ids=["token_by_token", "chunks"])
@pytest.mark.parametrize("rope", [False, True], ids=["plain", "rope"])
@pytest.mark.parametrize("kv", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
def test_cross_attention_cache_equals_full_forward(kv, rope, chunks):
    m = _module(kv, rope)
    ctx, x = torch.randn(2, 9, E), torch.randn(2, 7, E)
    cache = m.make_cache(2, 9)
    with torch.no_grad():
        got = _cross_decode(m, x, ctx, cache, chunks)
        full = m(x, ctx)                                 # queries at 0..6, keys at 0..8
        torch.testing.assert_close(got, full, atol=2e-6, rtol=1e-5)
        assert cache.queries == 7
        cache.reset()                                    # forgets the queries served too
        torch.testing.assert_close(_cross_decode(m, x, ctx, cache, chunks), got, atol=0, rtol=0)


def test_cross_attention_cache_errors():
    m = _module(2, True)
    ctx, x = torch.randn(2, 9, E), torch.randn(2, 4, E)
    cache = m.make_cache(2, 9)
    with torch.no_grad():
        m(x, ctx, cache=cache)
    with pytest.raises(ValueError, match="already holds"):
        m(x, ctx, cache=cache)
    with pytest.raises(ValueError, match="valid marks padded new tokens of a self-attention"):
        m(x, cache=cache, valid=torch.ones(2, 4, dtype=torch.bool))
    assert cache.queries == 4                            # refused calls served no query
    with pytest.raises(ValueError, match="holds no cross-attention context"):
        m.make_cache(2, 9).cross_positions(1)


def _snapshot(c):
    return [t.clone() for t in (c.k, c.v, c.valid)] + [getattr(c, "lengths", torch.tensor(0)).clone()]


def test_paged_cache_refuses_cross_attention_and_stays_unchanged():
    m = _module(2, True)
    pool = _pool(m)
    a, b = pool.add_sequence(), pool.add_sequence()
    m(torch.randn(1, 3, E), cache=pool.batch([a]), mask=CAUSAL)
    before, used = _snapshot(pool), pool.pages_used
    with pytest.raises(TypeError, match="PagedKVCache batch does not hold cross-attention "
                                        "contexts.*use a KVCache.*make_cache"):
        m(torch.randn(2, 2, E), torch.randn(2, 5, E), cache=pool.batch([a, b]))
    assert (pool.pages_used, pool.length(a), pool.length(b)) == (used, 3, 0)
    for x, y in zip(before, _snapshot(pool)):
        assert torch.equal(x, y)


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
    with pytest.raises(TypeError, match="valid must be a bool tensor"):
        m(x, cache=m.make_cache(2, 8), valid=torch.ones(2, 3))
    with pytest.raises(ValueError, match=r"valid must be a bool tensor \(B, n\) = \(2, 3\)"):
        m(x, cache=m.make_cache(2, 8), valid=torch.ones(2, 4, dtype=torch.bool))
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


# -- no host-device sync ----------------------------------------------------------------------
# Each scenario runs a module (on the meta device here, on a GPU in test_cuda_modules.py) from
# fresh caches: a forward, prefills, decode steps, padded prompts, paged batches.


def _rand(m, *shape):
    return torch.randn(*shape, device=m.out_proj.weight.device)


def _new_kv(m, B, n):
    """Keys and values ``(B, Hkv, n, Dh)`` to write into a cache without attention."""
    return _rand(m, B, m.num_kv_heads, n, m.head_dim), _rand(m, B, m.num_kv_heads, n, m.head_dim)


def _left_padded(m, B, n):
    """``valid`` (B, n) built on the device: sequence b is left-padded by b tokens."""
    dev = m.out_proj.weight.device
    return torch.arange(n, device=dev)[None] >= torch.arange(B, device=dev)[:, None]


def _forward_causal(m):
    m(_rand(m, 2, 7, E), mask=CAUSAL)


def _prefill_causal(m):
    m(_rand(m, 2, 7, E), cache=m.make_cache(2, 16), mask=CAUSAL)


def _decode_steps(m):
    cache = m.make_cache(2, 16)
    cache.update(*_new_kv(m, 2, 5))                      # a prompt written without attention
    for _ in range(2):
        m(_rand(m, 2, 1, E), cache=cache, mask=CAUSAL)


def _padded_prefill_decode(m):
    cache = m.make_cache(2, 16)
    m(_rand(m, 2, 5, E), cache=cache, mask=CAUSAL, valid=_left_padded(m, 2, 5))
    m(_rand(m, 2, 1, E), cache=cache, mask=CAUSAL)


def _padded_window_decode(m):
    """Distances in tokens (masks.at_positions over the cache's padding): no read-back."""
    cache, mask = m.make_cache(2, 16), M_WINDOW_ALIBI
    m(_rand(m, 2, 5, E), cache=cache, mask=mask, valid=_left_padded(m, 2, 5))
    m(_rand(m, 2, 1, E), cache=cache, mask=mask, valid=_left_padded(m, 2, 1))
    m(_rand(m, 2, 1, E), cache=cache, mask=mask)


def _paged_decode_steps(m):
    pool = _pool(m)
    ids = [pool.add_sequence(), pool.add_sequence()]
    pool.batch(ids).update(*_new_kv(m, 2, 5))
    for _ in range(2):
        m(_rand(m, 2, 1, E), cache=pool.batch(ids), mask=CAUSAL)


def _paged_uneven_decode(m):
    pool = _pool(m)
    a, b = pool.add_sequence(), pool.add_sequence()
    pool.batch([a]).update(*_new_kv(m, 1, 6))
    pool.batch([b]).update(*_new_kv(m, 1, 2))
    m(_rand(m, 2, 1, E), cache=pool.batch([a, b]), mask=CAUSAL)


def _cache_bookkeeping(m):
    """The caches' own API (positions, writes with and without valid, cross-attention)."""
    valid = _left_padded(m, 2, 5)
    cache = m.make_cache(2, 16)
    cache.positions(5, valid)
    assert cache.update(*_new_kv(m, 2, 5), valid)[2] is not None     # padded: never read back
    cache.positions(1)
    cache.update(*_new_kv(m, 2, 1))
    cross = m.make_cache(2, 9)
    cross.store_context(*_new_kv(m, 2, 9))
    cross.context(), cross.cross_positions(3)
    pool = _pool(m)
    a, b = pool.add_sequence(), pool.add_sequence()
    pool.batch([a, b]).positions(5, valid)
    pool.batch([a, b]).update(*_new_kv(m, 2, 5), valid)
    pool.batch([b]).update(*_new_kv(m, 1, 3))
    pool.batch([a, b]).positions(1)
    assert pool.batch([a, b]).update(*_new_kv(m, 2, 1))[2] is not None


SYNC_SCENARIOS = {
    "forward_causal": _forward_causal,
    "prefill_causal": _prefill_causal,
    "decode_steps": _decode_steps,
    "padded_prefill_decode": _padded_prefill_decode,
    "padded_window_decode": _padded_window_decode,
    "paged_decode_steps": _paged_decode_steps,
    "paged_uneven_decode": _paged_uneven_decode,
    "cache_bookkeeping": _cache_bookkeeping,
}


@pytest.mark.parametrize("name", SYNC_SCENARIOS)
def test_cached_decoding_never_syncs_on_meta(name):
    m = _module(2, True, device="meta")                  # GQA, RoPE
    with torch.no_grad(), NoReadBack():
        SYNC_SCENARIOS[name](m)


def test_a_forward_that_fails_after_writing_leaves_every_cache_as_it_was():
    """The mask is checked by attention(), after the new keys were written: the write is
    undone, and decoding goes on exactly as if the failing call had never been made."""
    m = _module(2, True)
    bad = mh.masks.padding(torch.tensor([1, 2, 3]))                 # built for batch 3
    seqs = _data([4, 4], 2, torch.float32)
    x = torch.stack([s[:4] for s in seqs])                           # (2, 4, E)
    nxt = torch.stack([s[4:5] for s in seqs])                        # (2, 1, E)

    cache, pool = m.make_cache(2, 16), _pool(m)
    ids = [pool.add_sequence(), pool.add_sequence()]
    cross = m.make_cache(2, 16)
    with torch.no_grad():
        m(x, cache=cache, mask=CAUSAL)
        m(x, cache=pool.batch(ids), mask=CAUSAL)
        m(x, torch.randn(2, 6, E), cache=cross)
        state = (cache.seen, cache.lengths.clone(), cache.valid.clone(), cache.padded)
        paged = (pool.pages_used, [pool.length(i) for i in ids], sorted(pool._free))
        for fail in (lambda: m(nxt, cache=cache, mask=CAUSAL & bad),
                     lambda: m(nxt, cache=pool.batch(ids), mask=CAUSAL & bad),
                     lambda: m(nxt, cache=cross, mask=bad)):
            with pytest.raises(ValueError, match="built for batch size 3"):
                fail()
        assert (cache.seen, cache.padded) == (state[0], state[3])
        assert torch.equal(cache.lengths, state[1]) and torch.equal(cache.valid, state[2])
        assert (pool.pages_used, [pool.length(i) for i in ids], sorted(pool._free)) == paged
        assert cross.queries == 4
        got = m(nxt, cache=cache, mask=CAUSAL)[:, 0]
        want = torch.stack([m(s[None, :5], mask=CAUSAL)[0, -1] for s in seqs])
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


class _DeviceOps(TorchDispatchMode):
    """Records the name of every op whose output is on the ``meta`` device (which stands in
    for a GPU: each such op would be a kernel launch), views left out."""

    VIEWS = {"view", "slice", "select", "transpose", "_unsafe_view", "detach", "alias"}

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if (isinstance(out, torch.Tensor) and out.device.type == "meta"
                and name not in self.VIEWS):
            self.ops.append(name)
        return out


def test_a_paged_write_launches_no_kernel_to_find_its_slots():
    """The block tables are host lists: a write's pool slots are worked out on the host and
    reach the device in the tables' one copy. On the device (``meta`` standing in) a
    decoding step's write runs that copy and the three writes: with no padding, the real-token
    counts are the copied lengths."""
    pool = mh.PagedKVCache(num_pages=8, page_size=4, num_kv_heads=2, head_dim=8, device="meta")
    batch = pool.batch([pool.add_sequence(), pool.add_sequence()])
    prompt, new = torch.empty(2, 2, 5, 8, device="meta"), torch.empty(2, 2, 1, 8, device="meta")
    batch.update_in_place(prompt, prompt)
    with NoReadBack(), _DeviceOps() as mode:
        view = batch.update_in_place(new, new)
    assert mode.ops == ["_to_copy", "index_copy_", "index_copy_", "index_fill_"], mode.ops
    assert view.max_len == 6 and view.table.shape == (2, 2)


def test_host_slots_equal_the_device_formula():
    """The host's run-by-run slots of a write equal ``_slot``'s gather of the block table,
    for random tables, page sizes, starts and lengths (crossing pages or not)."""
    from multihead.modules.paged_cache import _host_slots, _slot
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        p = int(torch.randint(1, 9, (), generator=g))
        table = torch.randperm(12, generator=g)[:int(torch.randint(1, 7, (), generator=g))]
        room = len(table) * p
        start = int(torch.randint(0, room, (), generator=g))
        n = int(torch.randint(0, room - start + 1, (), generator=g))
        want = _slot(table[None], torch.arange(start, start + n)[None], p)[0].tolist()
        assert _host_slots(table.tolist(), start, n, p) == want, (table, p, start, n)


def test_a_paged_views_lengths_are_not_the_pools_counts():
    """The lengths a PagedView hands out are the caller's: changing them in place leaves
    the pool's real-token counts (where RoPE positions continue) as they were."""
    pool = mh.PagedKVCache(num_pages=4, page_size=4, num_kv_heads=1, head_dim=4)
    a = pool.add_sequence()
    view = pool.batch([a]).update_in_place(torch.ones(1, 1, 3, 4), torch.ones(1, 1, 3, 4))
    view.lengths.add_(100)
    assert pool.length(a) == 3 and pool.batch([a]).positions(1).tolist() == [[3]]


def test_long_and_short_writes_find_the_same_slots(monkeypatch):
    """A prefill's slots come from torch's formula, a decoding step's from plain Python:
    both give the same copied tables, slots and counts."""
    import multihead.modules.paged_cache as pc
    pool = mh.PagedKVCache(num_pages=64, page_size=4, num_kv_heads=1, head_dim=4)
    ids = [pool.add_sequence() for _ in range(3)]
    for sid, (table, written) in zip(ids, [([5, 9, 2, 10], 9), ([7, 11], 1),
                                           ([1, 3, 8, 4, 6], 17)]):
        pool._tables[sid], pool._written[sid] = table, written
    for n in (0, 1, 2, 3):                  # crossing a page or not; room for 3 in each
        python = [t.tolist() for t in pool._device_tables(ids, n)]
        monkeypatch.setattr(pc, "HOST_SLOTS", -1)
        assert [t.tolist() for t in pool._device_tables(ids, n)] == python, n
        monkeypatch.undo()


@pytest.mark.parametrize("padded", [False, True], ids=["real", "padded"])
def test_a_gather_finds_the_same_keys_on_the_host_and_on_the_device(monkeypatch, padded):
    """Small gathers work out their slots on the host, large ones on the device: both give
    the same keys, values and validity, for sequences of unequal lengths (one empty)."""
    import multihead.modules.paged_cache as pc
    g = torch.Generator().manual_seed(0)
    pool = mh.PagedKVCache(num_pages=16, page_size=4, num_kv_heads=2, head_dim=3)
    ids = [pool.add_sequence() for _ in range(3)]
    for n, sub in ((7, ids[:1]), (2, ids[:2]), (5, ids[:1])):
        kv = torch.randn(len(sub), 2, n, 3, generator=g)
        valid = torch.rand(len(sub), n, generator=g) > 0.3 if padded else None
        pool.batch(sub).update(kv, kv, valid)
    batch = pool.batch(ids)
    lens, table, *_ = pool._device_tables(ids)
    host = batch._gather(lens, table)
    monkeypatch.setattr(pc, "HOST_SLOTS", -1)
    device = batch._gather(lens, table)
    for a, b in zip(host, device):
        assert torch.equal(a, b)
    assert host[2] is not None and host[2].shape == (3, 14) and not host[2][2].any()


def test_token_distances_cost_a_padded_step_one_op_and_only_where_a_mask_measures_them():
    def cumsums(mask):
        m = _module(2, True, device="meta")
        cache = m.make_cache(2, 16)
        with torch.no_grad():
            m(_rand(m, 2, 5, E), cache=cache, mask=mask, valid=_left_padded(m, 2, 5))
            with _DeviceOps() as mode:
                m(_rand(m, 2, 1, E), cache=cache, mask=mask)
        return mode.ops.count("cumsum")                  # (RoPE's positions take one too)
    plain = cumsums(None)
    assert cumsums(CAUSAL) == plain                      # order needs no positions
    assert cumsums(M_WINDOW_ALIBI) == plain + 1          # the keys' token positions, once

"""Caches survive misuse: every error a cached forward can raise (and an interrupt) leaves
the static, paged and cross-attention caches exactly as they were, and decoding then goes
on as if the failing call had never been made. A randomized test (fixed seed) mixes good
steps with failing ones and checks every output against one full causal forward."""

from __future__ import annotations

import random
from unittest import mock

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import multihead as mh

E, H, KV = 32, 4, 2
M = mh.masks
CAUSAL = M.causal()


class _Interrupting(M.Window):
    """A causal mask whose evaluation is interrupted (as Ctrl-C would) mid-call."""

    def _allowed(self, ix):
        raise KeyboardInterrupt


def _module(seed=0):
    torch.manual_seed(seed)
    return mh.MultiHeadAttention(E, H, num_kv_heads=KV, dropout=0.1,
                                 rope=mh.RotaryEmbedding(E // H)).eval()


def _failures(m, B, L):
    """(name, call) pairs: each makes a cached forward of one new token per row fail.
    ``L`` is the key length that step would have (cached tokens + 1)."""
    x = torch.randn(B, 1, E)

    def with_backend(name, **kw):
        def call(cache):
            old = m.backend
            m.backend = name
            try:
                return m(x, cache=cache, mask=CAUSAL, **kw)
            finally:
                m.backend = old
        return call

    def training(cache):
        m.train()
        try:
            return with_backend("blocksparse")(cache)
        finally:
            m.eval()

    return {
        "mask of a wrong type": lambda c: m(x, cache=c, mask="causal"),
        "mask of a wrong size": lambda c: m(x, cache=c, mask=M.dense(
            torch.ones(1, 1, 1, L + 3, dtype=torch.bool))),
        "mask of a wrong batch": lambda c: m(x, cache=c, mask=CAUSAL & M.padding(
            torch.ones(B + 2, dtype=torch.long))),
        "mask of a wrong head count": lambda c: m(x, cache=c, mask=CAUSAL & M.alibi(H + 1)),
        "weights from a backend without them": with_backend("sdpa", return_weights=True),
        "dropout on a backend without it": training,
        "unknown backend": with_backend("flashy"),
        "valid of a wrong shape": lambda c: m(x, cache=c, mask=CAUSAL,
                                              valid=torch.ones(B, 2, dtype=torch.bool)),
        "x of a wrong width": lambda c: m(torch.randn(B, 1, E + 1), cache=c, mask=CAUSAL),
        "x of a wrong batch": lambda c: m(torch.randn(B + 1, 1, E), cache=c, mask=CAUSAL),
        "interrupt during attention": lambda c: m(x, cache=c, mask=_Interrupting(None)),
    }


def _state(cache):
    """Everything a cache holds, as comparable values: its bookkeeping (the free pages in
    the order they will be taken) and every byte of its buffers (also slots no sequence
    reads yet)."""
    if isinstance(cache, mh.KVCache):
        return (cache.seen, cache.padded, cache.cross, cache.queries, cache.lengths.tolist(),
                cache.valid.clone(), cache.k.clone(), cache.v.clone())
    pool = cache.pool
    return (pool.pages_used, list(pool._free), dict(pool._written), sorted(pool._padded),
            [pool.length(s) for s in cache.ids], {s: list(t) for s, t in pool._tables.items()},
            pool.k.clone(), pool.v.clone(), pool.valid.clone())


def _same(a, b) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


def _caches(m, B):
    pool = mh.PagedKVCache(num_pages=32, page_size=4, num_kv_heads=KV, head_dim=E // H)
    return {"static": m.make_cache(B, 32),
            "paged": pool.batch([pool.add_sequence() for _ in range(B)])}


ERRORS = list(_failures(_module(), 2, 5))


def _prefilled(kind: str, B: int, t0: int, seed: int):
    """``(module, seqs (B, 6, E), cache)``: a ``kind`` cache holding ``seqs``' first ``t0``
    tokens."""
    m = _module()
    seqs = torch.randn(B, 6, E, generator=torch.Generator().manual_seed(seed))
    cache = _caches(m, B)[kind]
    with torch.no_grad():
        m(seqs[:, :t0], cache=cache, mask=CAUSAL)
    return m, seqs, cache


def _decoding_goes_on(m, cache, seqs, t0):
    """Decoding tokens ``t0..`` of ``seqs`` one at a time on ``cache`` (holding ``t0``
    tokens) gives what the uncached call gives for them."""
    with torch.no_grad():
        got = torch.cat([m(seqs[:, t:t + 1], cache=cache, mask=CAUSAL)
                         for t in range(t0, seqs.shape[1])], 1)
        want = m(seqs, mask=CAUSAL)[:, t0:]
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["static", "paged"])
@pytest.mark.parametrize("error", ERRORS)
def test_every_failing_cached_call_leaves_the_cache_unchanged(error, kind):
    B = 2
    m, seqs, cache = _prefilled(kind, B, 4, seed=1)
    with torch.no_grad():
        before = _state(cache)
        with pytest.raises((ValueError, TypeError, KeyboardInterrupt)) as info:
            _failures(m, B, 5)[error](cache)
        if info.type is not KeyboardInterrupt:
            assert len(str(info.value)) > 20                      # says what is wrong
        assert _same(_state(cache), before), error
    _decoding_goes_on(m, cache, seqs, 4)


@pytest.mark.parametrize("transform", ["grad", "vmap"])
@pytest.mark.parametrize("kind", ["static", "paged"])
def test_a_cached_call_refused_under_torch_func_leaves_the_cache_unchanged(kind, transform):
    """Writing into a cache is an in-place change of a tensor the transform captured, which
    torch.func refuses: the call fails, and the rollback (itself in-place) must not fail
    too (a paged pool once kept the page the refused write had taken)."""
    m, seqs, cache = _prefilled(kind, 2, 3, seed=3)
    before = _state(cache)
    step = seqs[:, 3:5]                                      # a second page on the paged pool
    with pytest.raises(RuntimeError, match="Run the cached step outside the transform"):
        if transform == "grad":
            torch.func.grad(lambda x: m(x, cache=cache, mask=CAUSAL).sum())(step)
        else:
            torch.func.vmap(lambda x: m(x, cache=cache, mask=CAUSAL))(step[None])
    assert _same(_state(cache), before)
    _decoding_goes_on(m, cache, seqs, 3)


@pytest.mark.parametrize("error", ["mask of a wrong type", "mask of a wrong batch",
                                   "weights from a backend without them", "unknown backend",
                                   "interrupt during attention"])
def test_failing_cross_attention_calls_leave_the_context_and_positions(error):
    m, B = _module(), 2
    g = torch.Generator().manual_seed(2)
    x, ctx = torch.randn(B, 3, E, generator=g), torch.randn(B, 5, E, generator=g)
    cache = m.make_cache(B, 8)
    with torch.no_grad():
        first = m(x[:, :2], ctx, cache=cache)
        before = _state(cache)
        call = _failures(m, B, 5)[error]
        with pytest.raises((ValueError, TypeError, KeyboardInterrupt)):
            if error == "interrupt during attention":
                m(x[:, 2:], cache=cache, mask=_Interrupting(None, align="upper_left"))
            else:
                call(cache)
        assert _same(_state(cache), before)
        got = torch.cat([first, m(x[:, 2:], cache=cache)], 1)
        want = m(x, ctx)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("kind", ["static", "paged"])
def test_random_misuse_never_changes_what_decoding_computes(kind):
    """40 random steps per seed: good steps of 1-3 tokens and failing calls, interleaved."""
    m = _module()
    for seed in range(3):
        rng = random.Random(seed)
        B = rng.choice([1, 2, 3])
        g = torch.Generator().manual_seed(seed)
        seqs = torch.randn(B, 64, E, generator=g)
        cache, done, outs = _caches(m, B)[kind], 0, []
        with torch.no_grad():
            for _ in range(40):
                if rng.random() < 0.5 and done:
                    name = rng.choice(ERRORS)
                    before = _state(cache)
                    with pytest.raises((ValueError, TypeError, KeyboardInterrupt)):
                        _failures(m, B, done + 1)[name](cache)
                    assert _same(_state(cache), before), (seed, name)
                else:
                    n = rng.randint(1, 3)
                    if done + n > 32:
                        break
                    outs.append(m(seqs[:, done:done + n], cache=cache, mask=CAUSAL))
                    done += n
            want = m(seqs[:, :done], mask=CAUSAL)
        torch.testing.assert_close(torch.cat(outs, 1), want, atol=3e-6, rtol=1e-5)


def test_rollback_after_a_successful_forward_undoes_nothing():
    """The journal stayed open after a successful forward: a later rollback() undid it, and
    on a paged pool returned pages another live sequence held."""
    m = _module()
    pool = mh.PagedKVCache(num_pages=8, page_size=4, num_kv_heads=KV, head_dim=E // H)
    a, b = pool.add_sequence(), pool.add_sequence()
    with torch.no_grad():
        m(torch.randn(1, 3, E), cache=pool.batch([a]), mask=CAUSAL)
        x = pool.batch([a])
        m(torch.randn(1, 2, E), cache=x, mask=CAUSAL)          # a takes a second page
        m(torch.randn(1, 8, E), cache=pool.batch([b]), mask=CAUSAL)
        tables = {s: list(t) for s, t in pool._tables.items()}
        x.rollback()
    assert {s: list(t) for s, t in pool._tables.items()} == tables
    held = {p for t in pool._tables.values() for p in t}
    assert not held & set(pool._free) and pool.length(a) == 5 and pool.length(b) == 8
    cache = m.make_cache(1, 16)
    with torch.no_grad():
        m(torch.randn(1, 3, E), cache=cache, mask=CAUSAL)
    cache.rollback()
    assert cache.seen == 3 and cache.lengths.tolist() == [3]


# -- slots holding no token hold zeros: a write keeps no copy, an undo zeroes ----------------


class _InterruptWrite(TorchDispatchMode):
    """Raises KeyboardInterrupt (as Ctrl-C would) at the in-place write to ``buffers``
    (tensors) numbered ``at`` (0: the first): before it runs, or with ``after`` as it
    returns (a real Ctrl-C lands between two bytecodes, so there too), letting the earlier
    ones run; records every op's name in ``ops``."""

    def __init__(self, buffers, at=None, after=False):
        super().__init__()
        self.ptrs = {t.untyped_storage().data_ptr() for t in buffers}
        self.at, self.after, self.writes, self.ops = at, after, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func.__name__)
        first = args[0] if args else None
        if not (func._schema.name.endswith("_") and isinstance(first, torch.Tensor)
                and first.untyped_storage().data_ptr() in self.ptrs):
            return func(*args, **(kwargs or {}))
        hit, self.writes = self.writes == self.at, self.writes + 1
        if hit:
            self.at = None                       # once: the undo's writes after it run
            if self.after:
                func(*args, **(kwargs or {}))
            raise KeyboardInterrupt
        return func(*args, **(kwargs or {}))


def _buffers(cache):
    """The tensors a write into ``cache`` changes in place."""
    if isinstance(cache, mh.KVCache):
        return cache.k, cache.v, cache.valid, cache.lengths
    return cache.pool.k, cache.pool.v, cache.pool.valid


@pytest.mark.parametrize("kind, at", [("static", at) for at in range(4)]   # k, v, valid,
                         + [("paged", at) for at in range(3)])           # (static) lengths
@pytest.mark.parametrize("after", [False, True])         # as the write starts, or returns
@pytest.mark.parametrize("journal", [True, False])   # through the module, or update() alone
def test_a_write_interrupted_at_any_of_its_writes_leaves_the_cache_unchanged(kind, at, after, journal):
    m, seqs, cache = _prefilled(kind, 2, 3, seed=5)
    before = _state(cache)
    k = v = torch.randn(2, KV, 1, E // H)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        with _InterruptWrite(_buffers(cache), at, after) as mode:
            if journal:
                m(seqs[:, 3:4], cache=cache, mask=CAUSAL)
            else:
                cache.update(k, v)
    assert mode.writes > at                          # the earlier writes did run
    assert _same(_state(cache), before)              # ... and were undone
    _decoding_goes_on(m, cache, seqs, 3)


class _BrokenBuffers(TorchDispatchMode):
    """Every in-place write to ``buffers`` fails (as on a device that has failed), the
    undo's writes included."""

    def __init__(self, buffers):
        super().__init__()
        self.ptrs = {t.untyped_storage().data_ptr() for t in buffers}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        first = args[0] if args else None
        if (func._schema.name.endswith("_") and isinstance(first, torch.Tensor)
                and first.untyped_storage().data_ptr() in self.ptrs):
            raise RuntimeError("the device failed")
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kind", ["static", "paged"])
def test_a_write_whose_undo_also_fails_still_puts_the_bookkeeping_back(kind):
    m, seqs, cache = _prefilled(kind, 2, 4, seed=6)       # full pages: the write takes one
    before = _state(cache)
    with torch.no_grad(), pytest.raises(RuntimeError, match="the device failed"):
        with _BrokenBuffers(_buffers(cache)):
            m(seqs[:, 4:5], cache=cache, mask=CAUSAL)
    assert _same(_state(cache), before)             # pages, counts (and, here, the bytes)
    _decoding_goes_on(m, cache, seqs, 4)


@pytest.mark.parametrize("kind", ["static", "paged"])
def test_a_cache_built_under_inference_mode_is_refused_outside_it(kind):
    with torch.inference_mode():
        m, seqs, cache = _prefilled(kind, 2, 3, seed=8)
    before = _state(cache)
    pool = None if kind == "static" else cache.pool
    calls = {"forward": lambda: m(seqs[:, 3:4], cache=cache, mask=CAUSAL),
             "release": cache.reset if pool is None else lambda: pool.free(cache.ids[0])}
    for what, call in calls.items():
        with pytest.raises(RuntimeError, match=r"built under torch.inference_mode\(\).*Nothing "
                                               r"was changed"):
            call()
        assert _same(_state(cache), before), what
    with torch.inference_mode():
        _decoding_goes_on(m, cache, seqs, 3)


@pytest.mark.parametrize("kind", ["static", "paged"])
def test_a_call_failing_in_its_output_projection_leaves_the_cache_unchanged(kind):
    """The cache is committed once the call has its output: a caller who got none (an
    interrupt, or memory running out, in the last matmul) retries the step on the cache
    as it was."""
    m, seqs, cache = _prefilled(kind, 2, 3, seed=7)
    before = _state(cache)
    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        with mock.patch.object(m.out_proj, "forward", side_effect=KeyboardInterrupt):
            m(seqs[:, 3:4], cache=cache, mask=CAUSAL)
    assert _same(_state(cache), before)
    _decoding_goes_on(m, cache, seqs, 3)


@pytest.mark.parametrize("kind", ["static", "paged"])
def test_a_journaled_write_copies_nothing(kind):
    """The slots a write fills held no token, so held zeros: a call's journal keeps no copy
    of them (on a GPU, copy kernels in every layer and decoding step), and its undo zeroes
    them again, which a rollback test above compares byte for byte."""
    ops = {}
    for journal in (False, True):
        _, _, cache = _prefilled(kind, 2, 3, seed=5)
        k = v = torch.randn(2, KV, 1, E // H)
        if journal:
            cache.begin()
        with _InterruptWrite(_buffers(cache)) as mode:
            cache.update(k, v)
        ops[journal] = mode.ops
    assert ops[True] == ops[False]
    assert "clone" not in ops[True]


def test_reset_and_free_zero_what_they_release():
    m, _, static = _prefilled("static", 2, 5, seed=6)
    _, _, paged = _prefilled("paged", 2, 5, seed=6)
    assert all(t.any() for t in _buffers(static) + _buffers(paged))
    static.reset()
    for sid in paged.ids:
        paged.pool.free(sid)
    assert not any(t.any() for t in _buffers(static) + _buffers(paged))


def test_freeing_a_sequence_before_a_failed_call_rolls_back_spares_the_others():
    """A sequence of a failing call's batch freed before the rollback (a cancelled
    request), its pages taken by a new sequence: the rollback undoes the write of the
    sequence still live, and leaves the new sequence's tokens and pages alone; every page
    is then either free or held, once."""
    pool = mh.PagedKVCache(num_pages=6, page_size=2, num_kv_heads=1, head_dim=4)
    old, kept = pool.add_sequence(), pool.add_sequence()
    pool.batch([kept]).update(torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4))
    before = _state(pool.batch([kept]))
    batch = pool.batch([old, kept])
    batch.begin()                                     # as a module's forward does
    batch.update(torch.ones(2, 1, 3, 4), torch.ones(2, 1, 3, 4))
    pool.free(old)                                    # cancelled meanwhile
    new = pool.add_sequence()
    keys = torch.arange(12.).view(1, 1, 3, 4)
    pool.batch([new]).update(keys, keys)
    batch.rollback()                                  # the call fails
    held = pool._tables[new] + pool._tables[kept]
    assert sorted(held + pool._free) == list(range(6)) and pool.pages_used == 3
    k, _, _ = pool.batch([new]).update(torch.zeros(1, 1, 0, 4), torch.zeros(1, 1, 0, 4))
    assert torch.equal(k, keys)
    assert (pool._written[kept], pool._tables[kept]) == (1, before[5][kept])
    k, _, _ = pool.batch([kept]).update(torch.zeros(1, 1, 0, 4), torch.zeros(1, 1, 0, 4))
    assert torch.equal(k, torch.ones(1, 1, 1, 4))
    assert not pool.k[pool._tables[kept][0] * 2 + 1].any()     # its written slot zero again


def test_resetting_a_static_cache_during_a_call_that_then_fails_leaves_it_reset():
    cache = mh.KVCache(1, 8, num_kv_heads=1, head_dim=4)
    cache.begin()
    cache.update(torch.ones(1, 1, 3, 4), torch.ones(1, 1, 3, 4))
    cache.reset()                                     # another thread starts over
    cache.rollback()                                  # the call fails
    assert (cache.seen, cache.lengths.tolist()) == (0, [0])
    assert not any(t.any() for t in _buffers(cache))


@pytest.mark.parametrize("kind", ["static", "paged"])
def test_decoding_in_grad_mode_keeps_no_graph_in_the_cache(kind):
    """A cache holds constants: each call's gradients reach the keys and values it wrote
    (and the weights), and a later call's backward does not reach back into a graph an
    earlier backward freed; a new sequence after reset()/free() trains as the first did."""
    m, seqs, cache = _prefilled(kind, 2, 3, seed=8)
    x = seqs[:, 3:4].clone().requires_grad_()
    for step in range(2):                              # two steps, each with its backward
        y = m(x, cache=cache, mask=CAUSAL)
        (gx,) = torch.autograd.grad(y.sum(), x)
        assert torch.isfinite(gx).all() and gx.abs().sum() > 0
    # the new keys' gradient is the uncached forward's, with the cached ones held constant
    m2, _, cache2 = _prefilled(kind, 2, 3, seed=8)
    x2 = seqs[:, 3:4].clone().requires_grad_()
    y2 = m2(x2, cache=cache2, mask=CAUSAL)
    full = m2(torch.cat([seqs[:, :3], x2], 1), mask=CAUSAL)[:, 3:]
    torch.testing.assert_close(y2, full, atol=2e-6, rtol=1e-5)
    torch.testing.assert_close(torch.autograd.grad(y2.sum(), x2)[0],
                               torch.autograd.grad(full.sum(), x2)[0], atol=2e-6, rtol=1e-5)
    if kind == "static":
        cache.reset()
    else:
        for sid in cache.ids:
            cache.pool.free(sid)
        cache = cache.pool.batch([cache.pool.add_sequence() for _ in range(2)])
    y = m(seqs[:, :2].clone().requires_grad_(), cache=cache, mask=CAUSAL)
    y.sum().backward()           # reaches no graph an earlier backward freed
    assert all(t.grad_fn is None for t in _buffers(cache)[:2])   # the buffers keep none


@pytest.mark.parametrize("mask", [M.causal(align="upper_left"),
                                  M.sliding_window(2, align="upper_left"),
                                  M.alibi(H, align="upper_left") & CAUSAL])
@pytest.mark.parametrize("kind", ["static", "paged"])
def test_an_upper_left_mask_is_refused_with_a_cache(mask, kind):
    """With a cache the new queries are the sequence's last: a mask aligned upper-left
    would place them first (no error, wrong numbers before). Refused, cache unchanged."""
    m, _, cache = _prefilled(kind, 2, 3, seed=9)
    before = _state(cache)
    with torch.no_grad(), pytest.raises(ValueError, match="align='lower_right'"):
        m(torch.randn(2, 1, E), cache=cache, mask=mask)
    assert _same(_state(cache), before)


@pytest.mark.parametrize("mask", [CAUSAL, M.sliding_window(3), M.alibi(H),
                                  M.padding(torch.tensor([6, 4])) & CAUSAL])
def test_a_mask_of_query_positions_is_refused_by_a_cross_attention_cache(mask):
    """A cross-attention cache serves queries in steps; a causal, window or ALiBi mask of
    one call places them by their index in the call, which is not their position."""
    m = _module()
    cache = m.make_cache(2, 8)
    with torch.no_grad():
        m(torch.randn(2, 2, E), torch.randn(2, 6, E), cache=cache)
        before = _state(cache)
        with pytest.raises(ValueError, match="cross-attention cache serves queries in steps"):
            m(torch.randn(2, 1, E), cache=cache, mask=mask)
    assert _same(_state(cache), before)
    with torch.no_grad():                          # a mask without query positions serves
        m(torch.randn(2, 1, E), cache=cache, mask=M.padding(torch.tensor([6, 4])))


def test_update_in_place_refuses_a_padded_sequence():
    pool = mh.PagedKVCache(num_pages=4, page_size=2, num_kv_heads=1, head_dim=4)
    batch = pool.batch([pool.add_sequence()])
    batch.update(torch.ones(1, 1, 2, 4), torch.ones(1, 1, 2, 4),
                 valid=torch.tensor([[False, True]]))
    before = _state(batch)
    with pytest.raises(ValueError, match=r"sequences \[0\] hold padding"):
        batch.update_in_place(torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4))
    assert _same(_state(batch), before)


def test_only_torch_funcs_refusal_is_reworded():
    """A cached call failing inside a torch.func transform is reworded only for the refusal
    of its in-place write; another error (memory running out) keeps its type and text."""
    from multihead.modules.attention import _refused_by_torch_func

    def seen(_):
        return torch.tensor([_refused_by_torch_func(e) for e in (
            RuntimeError("attempted to call in-place operation"),
            RuntimeError("vmap: inplace arithmetic(self, *extra_args)"),
            RuntimeError("vmap: aten::index_copy_ is not possible ... use out-of-place "
                         "operators instead"),
            torch.OutOfMemoryError("in-place"), RuntimeError("shape mismatch"))])
    assert torch.func.vmap(seen)(torch.zeros(1))[0].tolist() == [True, True, True, False, False]
    assert not _refused_by_torch_func(RuntimeError("in-place"))   # outside a transform


@pytest.mark.parametrize("call, error, match", [
    (lambda c: c.update(torch.zeros(2, 4), torch.zeros(2, 4)), ValueError,
     r"k must be a tensor \(B, Hkv, n, D\) = \(2, 2, n, 8\), got \(2, 4\)"),
    (lambda c: c.update([[0.0]], torch.zeros(2, 2, 1, 8)), ValueError, r"k must be .* got list"),
    (lambda c: c.update(torch.zeros(2, 2, 1, 8), None), ValueError, r"v must be .* got NoneType"),
    (lambda c: c.update(torch.zeros(2, 2, 1, 8).to_sparse(), torch.zeros(2, 2, 1, 8)), TypeError,
     r"cache update: k is a torch.sparse_coo tensor; .* \.to_dense\(\)"),
    (lambda c: c.positions(-1), ValueError, r"n must be an int >= 0, got -1: how many new tokens"),
    (lambda c: c.rope_positions(-1), ValueError, r"n must be an int >= 0, got -1: how many new tokens"),
], ids=["k 2-D", "k list", "v None", "k sparse", "positions", "rope_positions"])
def test_public_cache_methods_name_what_is_wrong_and_change_nothing(call, error, match):
    cache = mh.KVCache(2, 16, num_kv_heads=2, head_dim=8)
    cache.update(torch.ones(2, 2, 3, 8), torch.ones(2, 2, 3, 8))
    before = (cache.seen, cache.k.clone(), cache.lengths.clone(), cache.cross)
    with pytest.raises(error, match=match):
        call(cache)
    assert cache.seen == before[0] and torch.equal(cache.k, before[1])
    assert torch.equal(cache.lengths, before[2]) and cache.cross == before[3]


@pytest.mark.parametrize("device, match", [
    ("gpu", r"device must be a torch.device or a name such as 'cpu' or 'cuda:0', got 'gpu'"),
    ("cuda:99", r"device 'cuda:99' cannot be used here \(.+\): pass device='cpu'")])
def test_a_cache_on_a_device_this_machine_lacks_is_refused_by_name(device, match):
    for build in (lambda: mh.KVCache(1, 8, num_kv_heads=1, head_dim=4, device=device),
                  lambda: mh.PagedKVCache(num_pages=2, page_size=4, num_kv_heads=1,
                                          head_dim=4, device=device)):
        with pytest.raises(ValueError, match=match):
            build()


def test_a_context_longer_than_the_cache_says_so():
    cache = mh.KVCache(2, 16, num_kv_heads=2, head_dim=8)
    with pytest.raises(ValueError, match=r"it holds 0 of max_len=16 slots and 20 more do not "
                                         r"fit; nothing was written. Build it with max_len >= 20"):
        cache.store_context(torch.zeros(2, 2, 20, 8), torch.zeros(2, 2, 20, 8))
    assert cache.seen == 0 and not cache.cross


def test_numpy_sizes_build_a_cache():
    np = pytest.importorskip("numpy")
    cache = mh.KVCache(np.int64(2), np.int32(8), num_kv_heads=np.int64(1), head_dim=4)
    assert (cache.batch_size, cache.max_len, cache.num_kv_heads) == (2, 8, 1)
    assert type(cache.batch_size) is int


@pytest.mark.parametrize("sid, error, match", [
    (True, TypeError, r"a sequence id is the int add_sequence\(\) returned, got True \(bool\)"),
    (1.0, TypeError, r"got 1.0 \(float\)"),
    (torch.tensor(1), TypeError, r"got tensor\(1\) \(Tensor\): pass int\(...\) of it"),
    (7, KeyError, r"unknown sequence id 7: live sequences are \[0, 1\]")])
def test_a_sequence_id_must_be_a_live_int(sid, error, match):
    """True == 1 == 1.0 in Python: read as ids, a bool would write into (or free) sequence 1."""
    pool = mh.PagedKVCache(num_pages=4, page_size=2, num_kv_heads=1, head_dim=4)
    pool.add_sequence(), pool.add_sequence()
    for call in (lambda: pool.batch([sid]), lambda: pool.free(sid), lambda: pool.length(sid)):
        with pytest.raises(error, match=match):
            call()
    assert pool.sequences == [0, 1] and pool.pages_used == 0
    with pytest.raises(TypeError, match=r"batch takes a list of sequence ids, got 1 \(int\): "
                                        r"e.g. pool.batch\(\[sid\]\)"):
        pool.batch(1)


def test_a_batch_of_no_ids_or_repeated_ids_says_which():
    pool = mh.PagedKVCache(num_pages=4, page_size=2, num_kv_heads=1, head_dim=4)
    a, b = pool.add_sequence(), pool.add_sequence()
    with pytest.raises(ValueError, match=r"at least one sequence id, got none"):
        pool.batch([])
    with pytest.raises(ValueError, match=r"got \[1, 0, 1\] \(\[1\] more than once\)"):
        pool.batch([b, a, b])


def test_pool_sizes_given_as_tensors_or_zero_say_what_to_pass():
    with pytest.raises(ValueError, match=r"num_pages must be a positive int, got tensor\(4\): "
                                         r"pass int\(\.\.\.\) of the tensor"):
        mh.PagedKVCache(torch.tensor(4), 2, 1, 4)
    with pytest.raises(ValueError, match=r"page_size must be a positive int, got 0: token slots"):
        mh.PagedKVCache(4, 0, 1, 4)


def test_a_numpy_valid_says_to_convert_it():
    np = pytest.importorskip("numpy")
    cache = mh.KVCache(1, 4, num_kv_heads=1, head_dim=4)
    with pytest.raises(TypeError, match=r"got a numpy.ndarray of bool \(1, 1\): pass "
                                        r"torch.from_numpy\(valid\)"):
        cache.update(torch.ones(1, 1, 1, 4), torch.ones(1, 1, 1, 4), valid=np.ones((1, 1), bool))
    assert cache.seen == 0


def test_pool_and_batch_reprs_show_their_state():
    pool = mh.PagedKVCache(num_pages=4, page_size=2, num_kv_heads=1, head_dim=4,
                           dtype=torch.float16)
    a = pool.add_sequence()
    batch = pool.batch([a])
    batch.update(torch.ones(1, 1, 3, 4, dtype=torch.float16), torch.ones(1, 1, 3, 4,
                                                                       dtype=torch.float16))
    assert repr(pool).endswith("sequences=1, pages_used=2, float16, cpu, 0.0 MiB)")
    assert repr(batch).startswith("PagedBatch(ids=[0], lengths=[3], pool=PagedKVCache(")
    assert pool.bytes_per_token() == batch.bytes_per_token() == 2 * 4 * 2
    assert pool.nbytes == 2 * 2 * pool.bytes_per_token()
    pool.free(a)
    assert "lengths=['freed']" in repr(batch)


def test_a_batch_of_a_freed_sequence_is_refused_by_its_own_methods():
    pool = mh.PagedKVCache(num_pages=4, page_size=2, num_kv_heads=1, head_dim=4)
    a, b = pool.add_sequence(), pool.add_sequence()
    batch = pool.batch([a, b])
    pool.free(a)
    gone = r"sequence\(s\) \[0\] of this PagedKVCache batch were freed \(live sequences: \[1\]\)"
    for call in (lambda: batch.update(torch.ones(2, 1, 1, 4), torch.ones(2, 1, 1, 4)),
                 lambda: batch.positions(1), lambda: batch.rope_positions(1)):
        with pytest.raises(ValueError, match=gone):
            call()
    assert pool.length(b) == 0 and pool.pages_used == 0


def test_a_cross_attention_cache_keeps_an_empty_context_as_any_other():
    """A context of 0 tokens is a context: a second one needs reset(), and the queries'
    RoPE positions do not run on from the first context's."""
    m = mh.MultiHeadAttention(16, 4, rope=mh.RotaryEmbedding(4)).eval()
    cache = m.make_cache(1, 8)
    with torch.no_grad():
        m(torch.randn(1, 2, 16), torch.randn(1, 0, 16), cache=cache)
        with pytest.raises(ValueError, match=r"already holds tokens or a context: call reset\(\)"):
            m(torch.randn(1, 1, 16), torch.randn(1, 3, 16), cache=cache)
        assert cache.cross and cache.seen == 0 and cache.queries == 2
        cache.reset()
        x, ctx = torch.randn(1, 1, 16), torch.randn(1, 3, 16)
        assert torch.allclose(m(x, ctx, cache=cache), m(x, ctx), atol=1e-6)


@pytest.mark.parametrize("kind", ["static", "paged"])
def test_new_tokens_on_another_device_are_refused_not_copied(kind):
    cache = mh.KVCache(1, 8, num_kv_heads=1, head_dim=4)
    if kind == "paged":
        pool = mh.PagedKVCache(num_pages=4, page_size=2, num_kv_heads=1, head_dim=4)
        cache = pool.batch([pool.add_sequence()])
    with pytest.raises(TypeError, match=r"k/v are on meta/cpu, the cache on cpu: build the cache "
                                         r"on the module's device"):
        cache.update(torch.ones(1, 1, 2, 4, device="meta"), torch.ones(1, 1, 2, 4))


@pytest.mark.parametrize("kind", ["static", "paged"])
def test_a_valid_mask_on_the_meta_device_is_refused_by_name(kind):
    attn = mh.MultiHeadAttention(32, 4).eval()
    if kind == "static":
        cache = attn.make_cache(2, 8)
    else:
        pool = mh.PagedKVCache(num_pages=8, page_size=2, num_kv_heads=4, head_dim=8)
        cache = pool.batch([pool.add_sequence(), pool.add_sequence()])
    with pytest.raises(ValueError, match=r"valid is on the meta device \(it holds no values\), "
                                         r"the cache on cpu: pass valid as a real tensor"), \
            torch.no_grad():
        attn(torch.randn(2, 1, 32), cache=cache, mask=mh.masks.causal(),
             valid=torch.ones(2, 1, dtype=torch.bool, device="meta"))
    assert cache._real_counts().tolist() == [0, 0] and not cache.padded


@pytest.mark.parametrize("kind", ["static", "paged"])
def test_a_step_of_no_tokens_with_valid_leaves_the_cache_unpadded(kind):
    """Nothing written: the cache stays on its unpadded path (a paged pool's in-place GPU
    decode is refused for a padded sequence)."""
    attn = mh.MultiHeadAttention(32, 4).eval()
    if kind == "static":
        cache = attn.make_cache(1, 8)
    else:
        pool = mh.PagedKVCache(num_pages=8, page_size=2, num_kv_heads=4, head_dim=8)
        cache = pool.batch([pool.add_sequence()])
    with torch.no_grad():
        attn(torch.randn(1, 0, 32), cache=cache, mask=mh.masks.sliding_window(2),
             valid=torch.zeros(1, 0, dtype=torch.bool))
        assert not cache.padded
        attn(torch.randn(1, 2, 32), cache=cache, mask=mh.masks.causal(),
             valid=torch.tensor([[False, True]]))
        assert cache.padded and cache._real_counts().tolist() == [1]


def test_a_paged_pool_copies_and_pickles_without_itertools_count():
    """itertools.count cannot be copied or pickled from Python 3.14 (3.12 and 3.13 warn)."""
    import copy
    import itertools
    import pickle
    pool = mh.PagedKVCache(num_pages=4, page_size=2, num_kv_heads=1, head_dim=4)
    pool.add_sequence()
    assert not any(isinstance(v, itertools.count) for v in vars(pool).values())
    for twin in (copy.deepcopy(pool), pickle.loads(pickle.dumps(pool))):
        assert twin.add_sequence() == 1 and twin.sequences == [0, 1]     # (ids go on)
    old = copy.copy(pool)                   # a pool pickled before: its ids an itertools.count
    del old._next_id
    old._ids = itertools.count(5)
    assert pickle.loads(pickle.dumps(old)).add_sequence() == 5
    with pytest.raises(KeyError) as e:
        pool.batch([9])
    assert str(e.value).startswith("unknown sequence id 9: live")        # (not quoted)


@pytest.mark.parametrize("build, match", [
    (lambda: mh.KVCache(10**9, 10**9, 8, 128), r"KVCache: batch_size=1000000000 x max_len="
                                                r"1000000000 make 1,000,000,000,000,000,000 "
                                                r"token slots of 8.0 KiB each"),
    (lambda: mh.PagedKVCache(10**12, 16, 8, 128), r"PagedKVCache: num_pages=1000000000000 x "
                                                   r"page_size=16 make .* each, taking .* PiB, but cpu "
                                                   r"has .* free: build a smaller cache")])
def test_a_cache_larger_than_free_memory_is_refused_by_its_sizes(build, match):
    with pytest.raises(ValueError, match=match):
        build()


def test_free_memory_unknown_is_no_reason_to_refuse(monkeypatch):
    """Without /proc/meminfo (macOS, Windows) free memory is not known: the check is
    skipped, not made against a guess."""
    import builtins

    from multihead._device import free_memory
    real = builtins.open

    def no_meminfo(path, *args, **kwargs):
        if str(path) == "/proc/meminfo":
            raise FileNotFoundError(path)
        return real(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_meminfo)
    assert free_memory(torch.device("cpu")) is None
    assert free_memory(torch.device("meta")) is None
    cache = mh.KVCache(2**12, 2**12, 8, 128, device="meta")            # 64 GiB, on meta
    assert cache.k.shape == (2**12, 8, 2**12, 128)



@pytest.mark.parametrize("kind", ["static", "paged"])
@pytest.mark.parametrize("how", ["deepcopy", "pickle", "torch.save"])
def test_a_cache_is_not_copied_in_the_middle_of_a_call(kind, how):
    """Between begin() and its end the undo steps act on this cache: a copy's rollback
    would undo the original. Copying is refused there, and works again after the call."""
    import copy
    import io
    import pickle
    m, seqs, cache = _prefilled(kind, 2, 3, seed=4)
    copy_of = {"deepcopy": copy.deepcopy, "pickle": lambda c: pickle.loads(pickle.dumps(c)),
               "torch.save": lambda c: torch.save(c, io.BytesIO())}[how]
    before = _state(cache)
    cache.begin()
    cache.update(torch.ones(2, KV, 1, E // H), torch.ones(2, KV, 1, E // H))
    # (a paged batch's undo steps act on its pool, which is what a model holds)
    for held in [cache] + ([cache.pool] if kind == "paged" else []):
        with pytest.raises(RuntimeError, match=r"cannot copy or save a cache between "
                           r"begin\(\) and commit\(\)/rollback\(\).*end the call first"):
            copy_of(held)
    cache.rollback()                               # the call's write undone, as before
    assert _same(_state(cache), before)
    copy_of(cache)
    if kind == "paged":
        copy_of(cache.pool)
    _decoding_goes_on(m, cache, seqs, 3)


@pytest.mark.parametrize("kind", ["static", "paged"])
def test_a_mask_of_a_wrong_size_on_a_padded_cache_is_named_by_the_call_sizes(kind):
    """The cache's own padding is combined with the caller's mask: the error names the
    caller's mask and the call's sizes, not a composition with a padding it never passed."""
    m = _module()
    cache = _caches(m, 2)[kind]
    with torch.no_grad():
        m(torch.randn(2, 3, E), cache=cache, mask=CAUSAL,
          valid=torch.tensor([[True, True, True], [False, True, True]]))
    before = _state(cache)
    wrong = M.dense(torch.ones(2, 1, 1, 3, dtype=torch.bool))       # Sk 3; the call has 4
    with pytest.raises(ValueError, match=r"^mask: dense\(shape \(2, 1, 1, 3\)\) does not "
                       r"broadcast to \(B, H, Sq, Sk\) = \(2, 4, 1, 4\)"):
        m(torch.randn(2, 1, E), cache=cache, mask=wrong)
    assert _same(_state(cache), before)


def test_a_batch_dropped_in_the_middle_of_a_call_does_not_hold_its_pool():
    """A pool refuses copies while a batch of it is between begin() and its end; a batch
    made inline and dropped there (a rollback that itself failed) no longer holds it."""
    import copy
    import gc
    m, seqs, batch = _prefilled("paged", 2, 3, seed=6)
    pool = batch.pool
    batch.begin()
    with pytest.raises(RuntimeError, match="cannot copy or save a cache between begin"):
        copy.deepcopy(pool)
    del batch
    gc.collect()
    copy.deepcopy(pool)                            # (nothing open on it any more)
    again = pool.batch(pool.sequences)
    _decoding_goes_on(m, again, seqs, 3)


@pytest.mark.parametrize("kind, inner_ids", [("static", "same"), ("paged", "same"),
                                             ("paged", "overlapping"), ("paged", "other")])
def test_a_forward_reentered_from_a_hook_cannot_write_what_the_outer_call_holds(kind, inner_ids):
    """A hook of a cached forward running another forward on the same cache (or sequences):
    the inner call is refused before it writes, so the outer call's failure puts the cache
    back as it was (the outer's undo did not see the inner's writes: a page went to two
    sequences, a static cache kept both calls' tokens). Other sequences of a pool may be
    written meanwhile."""
    m, seqs, cache = _prefilled(kind, 2, 3, seed=7)
    inner = _module(seed=1)
    if kind == "paged":
        pool = cache.pool
        spare = pool.add_sequence()
        ids = {"same": cache.ids, "overlapping": [spare, cache.ids[1]], "other": [spare]}[inner_ids]
        before = _state(cache)
        inner_cache = lambda: pool.batch(ids)                                  # noqa: E731
    else:
        before = _state(cache)
        inner_cache = lambda: cache                                            # noqa: E731
    seen = []

    def hook(*_):
        x = torch.randn(len(getattr(inner_cache(), "ids", [0, 0])), 2, E)
        try:
            inner(x, cache=inner_cache(), mask=CAUSAL)
            seen.append("ran")
        except RuntimeError as e:
            seen.append(str(e))
        raise KeyboardInterrupt                     # the outer call fails after it

    with torch.no_grad(), pytest.raises(KeyboardInterrupt):
        with m.out_proj.register_forward_hook(hook):
            m(seqs[:, 3:4], cache=cache, mask=CAUSAL)
    if inner_ids == "other":                    # (the spare sequence's write stays)
        assert seen == ["ran"] and pool.length(spare) == 2
        assert [pool.length(s) for s in cache.ids] == [3, 3]
    else:
        assert len(seen) == 1 and "is still open" in seen[0] and "nothing was written" in seen[0]
        assert _same(_state(cache), before)
    _decoding_goes_on(m, cache, seqs, 3)
    if kind == "paged":                             # every page owned once, or free
        owned = [pg for t in pool._tables.values() for pg in t]
        assert sorted(owned + pool._free) == list(range(pool.num_pages))

"""What an adversarial pass broke outside the numerics: memory-hungry plans, the shared
caches under threads and long sequences, and crashes on legal but unusual inputs (batch-1
masks that broadcast, empty batches, misused paged batches)."""

from __future__ import annotations

import dataclasses
import os
import threading

import pytest
import torch

import multihead as mh
from conftest import BACKENDS, oracle
from multihead.functional import dispatch, profiles
from multihead.masks import base as mask_base

M = mh.masks


def _qkv(B, H, S, D=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(3)]


# -- structured biases must not be materialized where they do not fit ---------------------
def test_alibi_at_16k_is_not_sent_to_a_plan_that_materializes_it():
    """auto used to send alibi(8) at S=16384 to sdpa: 11.5 GB peak (OOM at 32k)."""
    q = torch.empty(1, 8, 16384, 64)
    machine = dataclasses.replace(profiles.get_profile("cpu"), memory=24 << 30)   # this one's
    e = mh.explain(q, q, q, mask=M.alibi(8), profile=machine)
    assert e.chosen == "blocksparse"
    sdpa = next(r for r in e.rows if r.name == "sdpa")
    assert sdpa.plan is None and any("scratch memory" in r for r in sdpa.reasons)


def test_a_named_backend_whose_plan_does_not_fit_is_refused_by_attention(monkeypatch):
    q = torch.randn(1, 2, 2048, 16)
    small = dataclasses.replace(profiles.get_profile("cpu"), memory=16 << 20)
    monkeypatch.setattr(profiles, "profile_for", lambda device: small)
    dispatch.clear_cache()
    with pytest.raises(ValueError, match=r"backend='reference' cannot run this call: it needs "
                                         r"96.5 MiB of scratch memory; cpu .* has 16.0 MiB; use "
                                         r"backend='auto' or one of \['sdpa'\]"):
        mh.attention(q, q, q, backend="reference")


def test_a_plan_that_does_not_fit_the_device_is_refused_with_its_size():
    q = torch.empty(2, 8, 4096, 64)
    pad = M.padding(torch.tensor([3900, 4096]))
    small = dataclasses.replace(profiles.get_profile("cpu"), memory=256 << 20)
    e = mh.explain(q, q, q, mask=pad, profile=small)
    refused = {r.name: r.reasons for r in e.rows if r.plan is None}
    assert "reference" in refused and "sdpa" in refused, refused
    assert any("GiB of scratch memory" in x or "MiB of scratch memory" in x
               for x in refused["sdpa"])
    assert e.chosen == "blocksparse"


# -- the shared caches ---------------------------------------------------------------------
def test_the_shared_tile_cache_is_bounded_by_bytes():
    """300 long-sequence explain() calls used to keep 302 MiB of tile maps."""
    mask_base._SHARED.clear()
    q = torch.empty(1, 1, 1, 8)
    for s in range(32768, 32768 + 300 * 64, 64):
        qs = q.expand(1, 1, s, 8)
        mh.explain(qs, qs, qs, mask=M.sliding_window(128 + s % 7))
    assert mask_base._SHARED.nbytes <= 64 << 20
    assert dispatch._DECISIONS.nbytes <= 64 << 20


def test_masks_and_plans_are_safe_under_16_threads():
    """Unlocked caches raised KeyError / 'dictionary changed size' under 16 threads."""
    masks = [M.causal(), M.sliding_window(5), M.alibi(2) & M.causal(),
             M.padding(torch.tensor([7, 3]))]
    errors = []

    def work(i):
        try:
            for j in range(40):
                S = 8 + (i * 7 + j) % 24
                q, k, v = (t.float() for t in _qkv(2, 2, S, 8, seed=j))
                m = masks[(i + j) % len(masks)]
                if isinstance(m, M.Padding):
                    m = M.padding(torch.tensor([S, S // 2]))
                out = mh.attention(q, k, v, mask=m)
                ref = oracle(q, k, v, m)
                torch.testing.assert_close(out.double(), ref, atol=1e-5, rtol=1e-5)
                if j % 8 == 0:
                    mask_base._SHARED.clear()                # evictions race with readers
        except Exception as e:                              # reported in the main thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:3]


# -- crashes on legal inputs ---------------------------------------------------------------
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["padding(B=1) & dense(B=2)", "alibi(1) & dense(H=4)",
                                  "padding bool(B=1) & dense(B=2)", "document(B=1) & bias(B=2)"])
def test_batch_1_and_head_1_masks_broadcast_in_compositions(name, backend):
    """These raised IndexError: a mask leaf of batch (or heads) 1 must broadcast."""
    B, H, S = 2, 4, 8
    q, k, v = _qkv(B, H, S)
    g = torch.Generator().manual_seed(3)
    dense = M.dense(torch.rand(B, 1, S, S, generator=g) > 0.3)
    mask = {
        "padding(B=1) & dense(B=2)": M.padding(torch.tensor([5])) & dense,
        "alibi(1) & dense(H=4)": M.alibi(1) & M.dense(torch.rand(1, H, S, S, generator=g) > 0.3),
        "padding bool(B=1) & dense(B=2)": M.padding(torch.arange(S)[None] < 6) & dense,
        "document(B=1) & bias(B=2)": M.document(torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]]))
        & M.bias(torch.randn(B, 1, S, S, generator=g)),
    }[name]
    torch.testing.assert_close(mh.attention(q, k, v, mask=mask, backend=backend),
                               oracle(q, k, v, mask), atol=1e-10, rtol=1e-9)


@pytest.mark.parametrize("backend", ["auto"] + BACKENDS + ["varlen"])
@pytest.mark.parametrize("name", ["padding lengths", "padding bool", "document", "none"])
def test_an_empty_batch_returns_an_empty_result(name, backend):
    """B=0 with padding or document masks crashed (IndexError in tile classification)."""
    q, k, v = _qkv(0, 2, 8)
    mask = {"padding lengths": M.padding(torch.zeros(0, dtype=torch.long)),
            "padding bool": M.padding(torch.zeros(0, 8, dtype=torch.bool)),
            "document": M.document(torch.zeros(0, 8, dtype=torch.long)), "none": None}[name]
    if backend == "varlen" and name != "document":        # it says why, and what can
        with pytest.raises(ValueError, match="varlen.*cannot run.*one of .*'sdpa'"):
            mh.attention(q, k, v, mask=mask, backend=backend)
        return
    out = mh.attention(q.requires_grad_(), k, v, mask=mask, backend=backend)
    assert out.shape == (0, 2, 8, 16)
    out.sum().backward()
    assert q.grad.shape == q.shape
    assert "empty" in str(mh.explain(q, k, v, mask=mask))


@pytest.mark.parametrize("backend", ["auto"] + BACKENDS)
@pytest.mark.parametrize("strides", [(1, 2, 4, 1), (2, 1, 4, 1), (1, 1, 1, 1)])
@pytest.mark.parametrize("mask", [None, M.causal(), M.padding([5, 8])], ids=["none", "causal", "padding"])
def test_a_query_whose_elements_share_memory_gives_the_right_answer(strides, mask, backend):
    """A query viewed with overlapping strides (``as_strided``) gave garbage from the sdpa
    backend, auto's CPU choice, without an error (errors up to 1e36): torch's fused CPU
    kernel misreads it. The same values, contiguous, are the oracle."""
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1000, generator=g).as_strided((2, 2, 8, 4), strides).requires_grad_()
    k, v = (torch.randn(2, 2, 8, 4, generator=g) for _ in range(2))
    out = mh.attention(q, k, v, mask=mask, backend=backend)
    qc = q.detach().contiguous().requires_grad_()
    want = oracle(qc, k, v, mask)
    assert (out.double() - want).abs().max() < 1e-5
    grad, = torch.autograd.grad(out.sum(), q)
    want_grad, = torch.autograd.grad(want.sum(), qc)
    assert (grad.double() - want_grad).abs().max() < 1e-5


def test_an_empty_batch_through_the_module():
    m = mh.MultiHeadAttention(16, 4, num_kv_heads=2).eval()
    x = torch.randn(0, 5, 16)
    assert m(x, mask=M.causal() & M.padding(torch.zeros(0, dtype=torch.long))).shape == (0, 5, 16)


def test_a_paged_batch_used_after_free_says_so():
    """It raised a bare KeyError from inside update()."""
    m = mh.MultiHeadAttention(16, 4, num_kv_heads=2).eval()
    pool = mh.PagedKVCache(8, 4, 2, 4)
    a, b = pool.add_sequence(), pool.add_sequence()
    batch = pool.batch([a, b])
    m(torch.randn(2, 3, 16), cache=batch, mask=M.causal())
    pool.free(a)
    used = pool.pages_used
    with pytest.raises(ValueError, match=r"sequence\(s\) \[0\] of this PagedKVCache batch were "
                                         r"freed.*pool.batch"):
        m(torch.randn(2, 1, 16), cache=batch, mask=M.causal())
    assert pool.pages_used == used and pool.length(b) == 3


def test_cross_attention_context_with_a_paged_batch_is_a_clear_error():
    m = mh.MultiHeadAttention(16, 4, num_kv_heads=2).eval()
    pool = mh.PagedKVCache(8, 4, 2, 4)
    batch = pool.batch([pool.add_sequence(), pool.add_sequence()])
    with pytest.raises(TypeError, match="does not hold cross-attention contexts.*KVCache"):
        m(torch.randn(2, 1, 16), torch.randn(2, 5, 16), cache=batch)
    assert pool.pages_used == 0


def test_an_empty_batch_mask_composes_materializes_and_draws():
    m = M.padding(torch.zeros(0, dtype=torch.long)) & M.causal()
    assert m.batch_size == 0
    assert m.materialize(3, 3).shape == (0, 1, 3, 3)
    assert m.tiles(3, 3).state.shape[0] == 0
    assert "empty batch" in repr(m)
    assert (M.padding(torch.tensor([2])) & M.dense(torch.ones(2, 1, 3, 3, dtype=torch.bool))
            ).batch_size == 2


def test_the_cache_counts_each_storage_once_and_survives_cycles():
    from multihead._cache import BoundedCache, nbytes
    t = torch.zeros(4)
    assert nbytes(t.expand(10_000_000, 4)) == 16                 # not 160 MB
    assert nbytes([t, t[1:], {"again": t}]) == 16                # one storage
    c = BoundedCache(4, 64)
    c.put("view", t.expand(1000, 4))
    assert "view" in c and c.nbytes == 16

    class Node:
        pass
    nodes = [Node() for _ in range(200)]
    for n in nodes:
        n.others = nodes                                          # 200-wide cycles
    assert nbytes(nodes[0]) == 0


def test_the_caches_walk_skips_classes_that_hold_no_tensors():
    from multihead._cache import _tensors
    from multihead.functional.cost import Work

    class Figures:
        _cache_no_tensors = True                 # (a class's own word: not entered)

        def __init__(self):
            self.t = torch.zeros(3)
    assert _tensors(Figures()) == [] and _tensors(Work(flops=1.0)) == []
    held = (Work(), torch.zeros(2))
    assert [t is held[1] for t, _ in _tensors(held)] == [True]


# ------------------------------------------------------------------ torch's defaults

_HOST_MASKS = {
    "causal": lambda: mh.masks.causal(),
    "padding": lambda: mh.masks.padding(torch.tensor([30, 40])),
    "documents": lambda: mh.masks.document(torch.arange(40) // 13),
    "scattered documents": lambda: mh.masks.document(torch.tensor([0, 0, 1, 1, 0, 0] * 6 + [2] * 4)),
    "alibi and window": lambda: mh.masks.alibi(4) & mh.masks.sliding_window(5),
}


@pytest.mark.parametrize("name", _HOST_MASKS)
@pytest.mark.parametrize("backend", ["auto", "blocksparse", "rows", "sdpa", "varlen"])
def test_another_default_device_does_not_move_the_host_work(name, backend):
    """``torch.set_default_device`` (here a ``torch.device`` context) changes where tensors
    made without a device go: the plans, runs and tiles worked out on the host must stay on
    it (a meta default device stands for a GPU one; its tensors hold no data, so work that
    strayed there fails)."""
    g = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(2, h, 40, 16, generator=g) for h in (4, 2, 2))
    mask = _HOST_MASKS[name]()
    want = oracle(q, k, v, mask)
    try:
        with torch.device("meta"):
            out = mh.attention(q, k, v, mask=mask, backend=backend)
            assert mh.explain(q, k, v, mask=mask, backend=backend).chosen
    except ValueError as e:                       # a backend that cannot run this mask
        assert "cannot run this call" in str(e) and backend != "auto"
        return
    torch.testing.assert_close(out.double(), want, atol=2e-5, rtol=1e-4)


def test_another_default_device_and_dtype_through_the_module_and_caches():
    """Positions given as a list and the caches' host bookkeeping stay on the host; a cache
    built without a dtype takes torch's default dtype, as the module's parameters do."""
    g = torch.Generator().manual_seed(9)
    m = mh.MultiHeadAttention(32, 4, num_kv_heads=2, rope=mh.RotaryEmbedding(8))
    x = torch.randn(2, 12, 32, generator=g)
    full = m(x, mask=mh.masks.causal())
    rotated = m(x[:, 3:6], positions=torch.arange(3, 6))
    with torch.device("meta"):
        torch.testing.assert_close(m(x[:, 3:6], positions=[3, 4, 5]), rotated)
        cache = m.make_cache(batch_size=2, max_len=16)
        steps = [m(x[:, :9], cache=cache, mask=mh.masks.causal())]
        steps += [m(x[:, i:i + 1], cache=cache, mask=mh.masks.causal()) for i in range(9, 12)]
        pool = mh.PagedKVCache(num_pages=8, page_size=16, num_kv_heads=2, head_dim=8,
                               device="cpu")
        ids = [pool.add_sequence(), pool.add_sequence()]
        paged = [m(x[:, :9], cache=pool.batch(ids), mask=mh.masks.causal())]
        paged += [m(x[:, i:i + 1], cache=pool.batch(ids), mask=mh.masks.causal())
                  for i in range(9, 12)]
        pool.free(ids[0])
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(torch.cat(paged, 1), full, atol=1e-5, rtol=1e-5)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        m64 = mh.MultiHeadAttention(32, 4, num_kv_heads=2)
        pool = mh.PagedKVCache(num_pages=4, page_size=16, num_kv_heads=2, head_dim=8)
        assert mh.KVCache(2, 8, 2, 8).dtype == pool.dtype == torch.float64
        y = m64(torch.randn(1, 3, 32), cache=pool.batch([pool.add_sequence()]),
                mask=mh.masks.causal())
        assert y.dtype == torch.float64
    finally:
        torch.set_default_dtype(previous)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
@pytest.mark.parametrize("held", ["a plan cache", "the rope tables"])
def test_a_child_forked_while_a_thread_holds_a_lock_can_still_attend(held):
    """A lock held by another thread at fork stays held in the child, where that thread does
    not exist: its first call that took it waited forever (a DataLoader worker forked while
    a serving thread was inside attention())."""
    import time
    from multihead.functional import dispatch
    from multihead.modules import rope
    x = torch.randn(1, 2, 16, 8)
    attn = mh.MultiHeadAttention(16, 2, rope=mh.RotaryEmbedding(8))
    lock = dispatch._DECISIONS._lock if held == "a plan cache" else rope._GROWING
    taken, release = threading.Event(), threading.Event()

    def hold():
        with lock:
            taken.set()
            release.wait(30)
    holder = threading.Thread(target=hold)
    holder.start()
    taken.wait(10)
    try:
        pid = os.fork()
        if pid == 0:                                   # the child: one call of each kind
            try:      # (one thread: torch's OpenMP pool, forked after use, can hang alone)
                torch.set_num_threads(1)
                mh.attention(x, x, x, mask=mh.masks.causal())
                attn(torch.randn(1, 5000, 16))         # (a longer table than any yet)
                os._exit(0)
            except BaseException:                      # noqa: BLE001
                os._exit(3)
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        if done[0] == 0:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        assert done[0] == pid and os.waitstatus_to_exitcode(done[1]) == 0, "the child hung"
    finally:
        release.set()
        holder.join()


def test_rows_leaves_out_a_predicate_that_rules_nothing_out_in_a_sequence(monkeypatch):
    """A padded batch's full-length sequence (and each sequence's span of real keys) is left
    whole by the padding: rows skipped evaluating and applying the predicate there (a pass
    over the scores each), but still adds the bias; outputs, weights and lse stay the
    oracle's, GQA included."""
    g = torch.Generator().manual_seed(11)
    q = torch.randn(3, 4, 48, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(3, 2, 48, 8, generator=g, dtype=torch.float64) for _ in range(2))
    lens = torch.tensor([48, 20, 0])
    table = torch.randn(3, 4, 48, 48, generator=g, dtype=torch.float64)
    evaluated = []
    real_at = mh.masks.Mask.at

    def at(self, ix):
        evaluated.append(int(ix.b.reshape(-1)[0]))
        return real_at(self, ix)
    for mask in (mh.masks.padding(lens), mh.masks.padding(lens) & mh.masks.alibi(4),
                 mh.masks.padding(lens) & mh.masks.bias(table)):
        evaluated.clear()
        monkeypatch.setattr(mh.masks.Mask, "at", at)
        out, w, lse = mh.attention(q, k, v, mask=mask, backend="rows", return_weights=True,
                                   return_lse=True)
        monkeypatch.setattr(mh.masks.Mask, "at", real_at)
        ref, ref_w, ref_lse = mh.attention(q, k, v, mask=mask, backend="reference",
                                           return_weights=True, return_lse=True)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=0)
        torch.testing.assert_close(w, ref_w, atol=1e-12, rtol=0)
        torch.testing.assert_close(lse, ref_lse, atol=1e-12, rtol=0)
        assert evaluated == []                    # neither sequence's span needed the mask
    # a predicate that rules keys out inside the span is still applied
    mask = mh.masks.padding(lens) & mh.masks.causal()
    out = mh.attention(q, k, v, mask=mask, backend="rows")
    torch.testing.assert_close(out, oracle(q, k, v, mask), atol=1e-12, rtol=0)


def test_rows_evaluates_a_query_dependent_mask_one_sequence_at_a_time(monkeypatch):
    """Key and query padding together vary by query: rows materialized them whole, (B, 1,
    Sq, Sk) bools (5.8 GB for B=64, S=8192, where one sequence was real). Each sequence's
    mask is now evaluated on its own live keys; the outputs stay the oracle's."""
    g = torch.Generator().manual_seed(4)
    lens = torch.tensor([0, 40, 0, 17, 64, 0])
    q = torch.randn(6, 2, 64, 8, generator=g, dtype=torch.float64)
    k, v = torch.randn(6, 2, 64, 8, generator=g, dtype=torch.float64), torch.randn(6, 2, 64, 8, generator=g, dtype=torch.float64)
    seen = []
    real_at = mh.masks.Mask.at

    def at(self, ix):
        out = real_at(self, ix)
        seen.append(torch.broadcast_shapes(ix.b.shape, ix.h.shape, ix.q.shape, ix.k.shape))
        return out
    # (the sequence of all 64 tokens: its padding rules nothing out, so it is not evaluated)
    for mask, live in ((mh.masks.padding(lens) & mh.masks.padding(lens, side="query"), 40 + 17),
                       (mh.masks.padding(lens) & mh.masks.padding(lens, side="query")
                        & mh.masks.causal() & mh.masks.alibi(2), 40 + 17 + 64)):
        seen.clear()
        monkeypatch.setattr(mh.masks.Mask, "at", at)
        out = mh.attention(q, k, v, mask=mask, backend="rows")
        monkeypatch.setattr(mh.masks.Mask, "at", real_at)
        torch.testing.assert_close(out, oracle(q, k, v, mask), atol=1e-12, rtol=0)
        assert seen and all(b == 1 and sk <= 64 for b, _, _, sk in seen)
        assert sum(sk for *_, sk in seen) == live                 # the live keys, row by row

"""Our Triton kernels against the fp64 oracle. Without a GPU (CI) they run on the CPU under
Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest), on small shapes; on a GPU
the ``cuda`` tests run them compiled, through the backend and ``auto``."""

from __future__ import annotations

from unittest import mock

import pytest
import torch

import multihead as mh
from conftest import assert_kernel_matches_oracle, oracle

triton = pytest.importorskip("triton")
from multihead.kernels.flash_fwd import flash_forward  # noqa: E402

M = mh.masks
DEV = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [  # B, H, Hkv, Sq, Sk, D, Dv, mask
    (1, 2, 2, 40, 40, 16, 16, "none"),
    (2, 4, 2, 37, 53, 32, 16, "causal"),
    (2, 4, 1, 53, 37, 32, 32, "causal"),                       # MQA; early rows see nothing
    (1, 2, 1, 70, 70, 16, 16, "window 5"),
    (2, 2, 2, 33, 65, 64, 64, "window 9 upper_left"),
    (2, 4, 2, 20, 40, 16, 16, "causal & padding"),
    (2, 2, 2, 20, 40, 16, 48, "padding"),                      # a sequence of length 0
    (3, 2, 1, 1, 50, 32, 32, "window 7 & padding"),            # a decoding step
    (1, 2, 2, 45, 70, 16, 16, "causal"),                       # offset 25: mid-block edges
    (1, 2, 1, 100, 120, 16, 16, "window 40"),                  # interior blocks in the band
    (1, 2, 1, 100, 120, 16, 16, "window 80"),                  # interior for 16x32 tiles too
    (2, 2, 2, 96, 96, 32, 32, "window 40 & padding"),
]


def _mask(name: str, B: int, Sk: int = 50):
    lengths = torch.tensor([40, 13, 25][:B]) if "padding" in name else None
    if name == "padding":
        lengths = torch.tensor([0, 13][:B])
    band = None
    if name.startswith("causal"):
        band = M.causal()
    elif name.startswith("window"):
        parts = name.split()
        band = M.sliding_window(int(parts[1]), align="upper_left" if "upper_left" in name
                                else "lower_right")
    pad = M.padding(lengths.clamp(max=Sk)) if lengths is not None else None
    return band if pad is None else pad if band is None else band & pad


def _inputs(B, H, Hkv, Sq, Sk, D, Dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEV, dtype)  # noqa: E731
    return mk(B, H, Sq, D), mk(B, Hkv, Sk, D), mk(B, Hkv, Sk, Dv)


#: launch configs: the table's default, and 16x16 tiles so that small shapes cross many
#: blocks (edge blocks that evaluate the mask and interior blocks that do not)
CONFIGS = [None, (16, 16, 4, 1)]


@pytest.mark.parametrize("config", CONFIGS, ids=["default", "tiles16"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[7]}-{c[3]}x{c[4]}-H{c[1]}kv{c[2]}"
                                             for c in CASES])
def test_forward_and_lse_equal_the_fp64_oracle_within_the_error_rule(case, dtype, config):
    if dtype == torch.bfloat16 and DEV == "cpu":
        pytest.skip("Triton's interpreter gives wrong bf16 results (numpy has no bf16); "
                    "bf16 runs in the cuda tests")
    B, H, Hkv, Sq, Sk, D, Dv, name = case
    q, k, v = _inputs(B, H, Hkv, Sq, Sk, D, Dv, dtype)
    mask = _mask(name, B, Sk)
    m = mask.to(DEV) if mask is not None else None
    band = mh.functional.backend.triton._band(
        mh.functional._call.make_call(q, k, v, mask=m, scale=None, dropout_p=0.0,
                                      return_weights=False, return_lse=False))
    lens = band.padding.lengths.expand(B).contiguous() if band.padding is not None else None
    out, lse = flash_forward(q, k, v, scale=D ** -0.5, causal=band.causal, window=band.window,
                             offset=band.offset, kv_lengths=lens, config=config)
    assert_kernel_matches_oracle(out, lse, q, k, v, m)


def test_the_backend_declines_what_it_cannot_run_and_says_why():
    q = torch.randn(1, 2, 8, 16, dtype=torch.float16)
    e = mh.explain(q, q, q, mask=M.sliding_window(4) & M.alibi(2), profile="h100")
    row = next(r for r in e.rows if r.name == "triton")
    assert row.plan is not None and "block lists" in row.plan.note   # not a band: lists
    e = mh.explain(q.float(), q.float(), q.float(), mask=M.sliding_window(4), profile="h100")
    row = next(r for r in e.rows if r.name == "triton")
    assert row.plan is None and any("float32" in r for r in row.reasons)
    e = mh.explain(q, q, q, mask=M.sliding_window(4), dropout_p=0.1, profile="h100")
    row = next(r for r in e.rows if r.name == "triton")                # dropout: bands run it
    assert row.plan is not None and "dropout drawn in the kernels" in row.plan.note
    e = mh.explain(q, q, q, mask=M.sliding_window(4) & M.alibi(2), dropout_p=0.1,
                   profile="h100")
    row = next(r for r in e.rows if r.name == "triton")                # ... block lists too
    assert "block lists" in row.plan.note and "dropout drawn in the kernels" in row.plan.note
    e = mh.explain(q, q, q, mask=M.sliding_window(4), dropout_p=0.1, return_weights=True,
                   profile="h100")
    row = next(r for r in e.rows if r.name == "triton")                # ... and weights
    assert "dropout drawn in the kernels" in row.plan.note and "weights" in row.plan.note
    g = q.clone().requires_grad_()                      # gradients: the training kernels
    e = mh.explain(g, q, q, mask=M.sliding_window(4), profile="h100", backend="triton")
    assert "split-K" not in str(e)


def test_auto_prices_the_band_it_skips_on_an_h100():
    """On the H100 profile auto picks the kernel for windows (it computes ~3% of the pairs
    at 16k) and keeps SDPA where both would do the same work (dense, causal, decoding)."""
    def chosen(B, H, Hkv, Sq, Sk, mask):
        q = torch.empty(B, H, Sq, 128, dtype=torch.bfloat16, device="meta")
        k = torch.empty(B, Hkv, Sk, 128, dtype=torch.bfloat16, device="meta")
        return mh.explain(q, k, k, mask=mask, profile="h100").chosen
    assert chosen(2, 16, 16, 16384, 16384, M.sliding_window(256)) == "triton"
    assert chosen(1, 16, 16, 16384, 16384, M.causal()) == "sdpa"
    assert chosen(1, 16, 16, 4096, 4096, None) == "sdpa"
    assert chosen(1, 32, 8, 1, 32768, M.causal()) == "sdpa"


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["causal", "window 9 upper_left", "causal & padding",
                                  "window 7 & padding"])
def test_the_backend_through_attention_on_cuda(name):
    for B, H, Hkv, Sq, Sk, D, Dv, _ in CASES:
        q, k, v = _inputs(B, H, Hkv, Sq, Sk, D, Dv, torch.bfloat16)
        mask = _mask(name, B, Sk).to("cuda")
        out = mh.attention(q, k, v, mask=mask, backend="triton")
        ref = oracle(q, k, v, mask)
        plain = mh.attention(q.float(), k.float(), v.float(), mask=mask, backend="sdpa")
        base = (plain.to(torch.bfloat16).double() - ref).abs().max()
        assert (out.double() - ref).abs().max() <= 2 * base + 1e-2


# -- the split-K decode kernel -------------------------------------------------------------

from multihead.kernels.decode import decode_forward, num_splits  # noqa: E402

DECODE = [  # B, H, Hkv, Sq, Sk, D, mask, splits
    (2, 8, 2, 1, 200, 32, "causal", 3),                   # GQA decode step, 3 splits
    (1, 4, 1, 3, 130, 16, "window 20", 2),                # MQA, a 3-token draft to verify
    (3, 4, 4, 2, 64, 16, "none", 5),                      # MHA, more splits than key blocks
    (3, 6, 2, 5, 150, 32, "causal & padding", 4),         # a cache with one empty sequence
    (2, 4, 2, 16, 90, 64, "window 7 & padding", None),    # the most queries it takes
    (1, 2, 1, 1, 2600, 16, "causal", 40),                 # the merge reads splits in chunks
    (2, 8, 2, 3, 100, 32, "causal & padding", 1),         # one split: writes the output itself
]


def _decode_mask(name: str, B: int, Sk: int):
    band = None if name.startswith("none") else M.causal() if name.startswith("causal") \
        else M.sliding_window(int(name.split()[1]))
    if "padding" not in name:
        return band
    pad = M.padding(torch.tensor([Sk, 0, Sk - 17][:B]))
    return pad if band is None else band & pad


def _band_of(q, k, v, mask):
    return mh.functional.backend.triton._band(
        mh.functional._call.make_call(q, k, v, mask=mask, scale=None, dropout_p=0.0,
                                      return_weights=False, return_lse=False))


def _check_decode(q, k, v, mask, splits=None):
    band = _band_of(q, k, v, mask)
    B = q.shape[0]
    lens = band.padding.lengths.expand(B).contiguous() if band.padding is not None else None
    out, lse = decode_forward(q, k, v, scale=q.shape[-1] ** -0.5, causal=band.causal,
                              window=band.window, offset=band.offset, kv_lengths=lens,
                              splits=splits)
    assert_kernel_matches_oracle(out, lse, q, k, v, mask)


@pytest.mark.parametrize("case", DECODE, ids=[f"{c[6]}-{c[3]}x{c[4]}-H{c[1]}kv{c[2]}"
                                              for c in DECODE])
def test_split_k_decode_equals_the_fp64_oracle(case):
    B, H, Hkv, Sq, Sk, D, name, splits = case
    q, k, v = _inputs(B, H, Hkv, Sq, Sk, D, D, torch.float16)
    mask = _decode_mask(name, B, Sk)
    _check_decode(q, k, v, mask.to(DEV) if mask is not None else None, splits)


def test_split_k_decode_reads_a_kv_cache_in_place():
    """The kernel takes the cache's own strided buffers (max_len slots, lengths filled)."""
    cache = mh.KVCache(2, 256, 2, 32, dtype=torch.float16, device=DEV)
    g = torch.Generator().manual_seed(3)
    for n in (100, 1, 1):
        kv = [torch.randn(2, 2, n, 32, generator=g).to(DEV, torch.float16) for _ in range(2)]
        k, v, _ = cache.update(*kv)                   # views of the cache's buffers
    assert k.data_ptr() == cache.k.data_ptr() and not k.is_contiguous()
    q = torch.randn(2, 8, 1, 32, generator=g).to(DEV, torch.float16)
    _check_decode(q, k, v, M.causal())


@pytest.mark.parametrize("bad_length", [301, -3], ids=["past-Sk", "negative"])
@pytest.mark.parametrize("splits", [None, 1])
def test_a_decode_length_past_the_keys_gives_nan_rows_not_a_silent_cut(bad_length, splits):
    """The lengths stay on the device (reading them is a sync): a sequence whose length is
    past the keys given (its later keys would be dropped) or negative gets NaN rows and
    lse, as in the paged kernel, and the other sequences are untouched."""
    q, k, v = _inputs(3, 8, 2, 1, 300, 16, 16, torch.float16)
    lens = torch.tensor([300, 120, 7], device=q.device)
    run = lambda n: decode_forward(q, k, v, scale=0.25, kv_lengths=n, splits=splits)  # noqa: E731
    good_out, good_lse = run(lens)
    bad = lens.clone()
    bad[1] = bad_length
    out, lse = run(bad)
    assert out[1].isnan().all() and lse[1].isnan().all()
    torch.testing.assert_close(out[::2], good_out[::2], rtol=0, atol=0)
    torch.testing.assert_close(lse[::2], good_lse[::2], rtol=0, atol=0)
    assert not good_out.isnan().any()


def test_the_last_split_merges_and_leaves_every_ticket_at_zero():
    """Each (batch, K/V head) merges once, in the program taking its last ticket, which
    sets the ticket back to 0: the next launch on the same buffer starts clean (a ticket
    left over would make a later step merge too early, or never)."""
    from multihead.kernels import decode as dec
    q, k, v = _inputs(3, 8, 2, 1, 300, 16, 16, torch.float16)
    tickets = torch.zeros(6, dtype=torch.int32, device=q.device)
    with mock.patch.object(dec, "_tickets", lambda device, n: tickets):
        for splits in (5, 2, 5):                       # the same tickets, three launches
            _check_decode(q, k, v, M.causal(), splits)
            assert int(tickets.abs().sum()) == 0


def test_num_splits_fills_the_device_with_whole_key_blocks():
    assert num_splits(1, 8, 32768) == 16            # 132 programs (an H100's SMs) over 8 heads
    assert num_splits(8, 8, 32768) == 2
    assert num_splits(1, 8, 100) == 2               # never more splits than key blocks
    assert num_splits(64, 8, 4096) == 1


def test_decoding_calls_plan_the_split_k_kernel_and_auto_keeps_sdpa_until_measured():
    q = torch.empty(1, 32, 1, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 8, 32768, 128, dtype=torch.bfloat16, device="meta")
    e = mh.explain(q, k, k, mask=M.causal(), profile="h100", backend="triton")
    assert "split-K decode: the keys in 16 splits" in str(e) and "the 4 query heads of" in str(e)
    one = mh.explain(q[:, :8], k[:1, :1, :64], k[:1, :1, :64], profile="h100", backend="triton")
    assert "the keys in 1 split, " in str(one) and "the 8 query heads of" in str(one)
    assert mh.explain(q, k, k, mask=M.causal(), profile="h100").chosen == "sdpa"


# -- the backward kernels --------------------------------------------------------------------

from multihead.kernels import ops  # noqa: E402
from multihead.kernels.flash_bwd import flash_backward  # noqa: E402


def _grads(q, k, v, mask, fn, with_lse=False):
    """Gradients of ``sum(out * w) (+ sum of the finite lse)`` through ``fn``."""
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(out.shape, generator=g).to(out.device, out.dtype)
    loss = (out * w).sum()
    if with_lse:
        loss = loss + torch.where(torch.isfinite(lse), lse, 0).sum()
    loss.backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("op", ["attention", "flash_attention"], ids=["eager", "custom_op"])
@pytest.mark.parametrize("with_lse", [False, True], ids=["out", "out+lse"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[7]}-{c[3]}x{c[4]}-H{c[1]}kv{c[2]}"
                                             for c in CASES])
def test_gradients_through_the_operator_equal_the_fp64_oracle(case, with_lse, op):
    """dQ, dK, dV (GQA summed over the group) from the backward kernels, for every mask
    kind of the backend, within the error rule against an fp32 run of the oracle."""
    B, H, Hkv, Sq, Sk, D, Dv, name = case
    dtype = torch.float16
    q, k, v = _inputs(B, H, Hkv, Sq, Sk, D, Dv, dtype, seed=1)
    mask = _mask(name, B, Sk)
    m = mask.to(DEV) if mask is not None else None
    band = _band_of(q, k, v, m)
    lens = band.padding.lengths.expand(B).contiguous() if band.padding is not None else None

    def ours(q, k, v):
        return getattr(ops, op)(q, k, v, D ** -0.5, band.causal, band.window or 0,
                                   band.offset, lens)

    def reference(q, k, v):
        return mh.attention(q, k, v, mask=m, backend="reference", return_lse=True)
    got = _grads(q, k, v, m, ours, with_lse)
    ref = _grads(q.double(), k.double(), v.double(), m, reference, with_lse)
    plain = _grads(q.float(), k.float(), v.float(), m, reference, with_lse)
    for name_, a, r, p in zip("qkv", got, ref, plain):
        err = (a.double() - r).abs().max()
        base = (p.to(dtype).double() - r).abs().max()
        assert torch.isfinite(a).all(), name_
        assert err <= 2 * base + 4 * torch.finfo(dtype).eps * r.abs().max(), (name_, err, base)


@pytest.mark.parametrize("kv_tiles", [(16, 16, 4, 1), (16, 32, 4, 1)],
                         ids=["queries-left", "keys-left"])
@pytest.mark.parametrize("name", ["causal", "window 40", "window 80", "window 40 & padding",
                                  "causal & padding"])
def test_backward_with_small_tiles_crosses_edge_and_interior_blocks(name, kv_tiles):
    """16x16 tiles: the dK/dV loop visits edge and interior query blocks, dQ key blocks;
    with 32 keys per dK/dV program it computes its blocks transposed (keys_left), and
    "causal" and "window 80" still have interior query blocks at that width."""
    case = next(c for c in CASES if c[7] == name)
    B, H, Hkv, Sq, Sk, D, Dv, _ = case
    q, k, v = _inputs(B, H, Hkv, Sq, Sk, D, Dv, torch.float16, seed=2)
    _check_small_tiles(q, k, v, _mask(name, B, Sk).to(DEV), kv_tiles, seed=3)


def _check_small_tiles(q, k, v, m, kv_tiles, seed, forward=False):
    """The band kernels at 16x16 tiles (``kv_tiles`` for dK/dV) against the fp64 reference
    under mask ``m``: the gradients, and with ``forward`` the output and lse too."""
    band = _band_of(q, k, v, m)
    B, D = q.shape[0], q.shape[-1]
    lens = band.padding.lengths.expand(B).contiguous() if band.padding is not None else None
    kw = dict(scale=D ** -0.5, causal=band.causal, window=band.window, offset=band.offset,
              kv_lengths=lens)
    tiles = (16, 16, 4, 1)
    out, lse = flash_forward(q, k, v, config=tiles, **kw)
    if forward:
        assert_kernel_matches_oracle(out, lse, q, k, v, mask=m)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed))
    dout = dout.to(DEV, out.dtype)
    got = flash_backward(dout, q, k, v, out, lse, config=(kv_tiles, tiles), **kw)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    mh.attention(*leaves, mask=m, backend="reference").backward(dout.double())
    for a, t in zip(got, leaves):
        torch.testing.assert_close(a.double(), t.grad, atol=2e-2, rtol=2e-2)


#: (Sq, Sk, window, key lengths): windows narrower than, equal to and just past a 16-key
#: tile, lower-right offsets both ways, and padding that cuts the band
EDGES = [(48, 48, 1, None), (40, 56, 15, None), (56, 40, 16, None), (48, 48, 17, None),
         (33, 65, 31, None), (64, 64, 33, (64, 21)), (50, 50, 48, (37, 50))]


@pytest.mark.parametrize("Sq, Sk, window, lengths", EDGES,
                         ids=[f"{e[0]}x{e[1]}-w{e[2]}{'-pad' if e[3] else ''}" for e in EDGES])
def test_every_edge_of_the_window_band_equals_the_oracle(Sq, Sk, window, lengths):
    """With 16x16 tiles, each key block of a window band is tested as its place needs: the
    window's lower edge alone, the diagonal and the key lengths, both, or nothing. Forward
    and gradients against the fp64 reference, wherever the edges fall."""
    B, H, Hkv, D = (len(lengths) if lengths else 1), 2, 1, 16
    q, k, v = _inputs(B, H, Hkv, Sq, Sk, D, D, torch.float16, seed=window)
    m = M.sliding_window(window)
    if lengths:
        m = m & M.padding(torch.tensor(lengths))
    _check_small_tiles(q, k, v, m.to(DEV), (16, 16, 4, 1), seed=5, forward=True)


def test_the_backward_is_deterministic():
    B, H, Hkv, Sq, Sk, D, Dv, name = CASES[5]
    q, k, v = _inputs(B, H, Hkv, Sq, Sk, D, Dv, torch.float16, seed=4)
    out, lse = flash_forward(q, k, v, scale=0.25, causal=True)
    dout = torch.randn_like(out)
    first = flash_backward(dout, q, k, v, out, lse, scale=0.25, causal=True)
    again = flash_backward(dout, q, k, v, out, lse, scale=0.25, causal=True)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


# -- the operators: torch.compile, CUDA graphs, compilations, memory -------------------------

def test_the_operators_pass_torch_library_opcheck():
    """Schema, fake implementation (shapes without data) and autograd registration agree
    with the real kernels (checked by torch's own op tester)."""
    q, k, v = _inputs(1, 4, 2, 24, 40, 16, 16, torch.float16, seed=5)
    lens = torch.tensor([30], device=DEV)
    for t in (q, k, v):
        t.requires_grad_()
    torch.library.opcheck(ops.flash_attention, (q, k, v, 0.25, True, 8, 16, lens))
    docs = torch.tensor([[0, 0, 9], [0, 9, 15]])             # packed documents (host table)
    torch.library.opcheck(ops.flash_attention, (q, q.detach().clone().requires_grad_(),
                                                q.detach().clone().requires_grad_(), 0.25,
                                                True, 0, 0, None, docs))
    torch.library.opcheck(ops.flash_decode, (q[:, :, :2].detach(), k.detach(), v.detach(),
                                             0.25, True, 0, 38, None))
    qt = q.detach().transpose(1, 2).contiguous().transpose(1, 2)      # a module's layout
    out, lse = ops.flash_attention(qt, k.detach(), v.detach(), 0.25, True, 8, 16, lens)
    torch.library.opcheck(ops.flash_attention_backward,      # the fake's strides: the
                          (torch.randn_like(out), None, qt, k.detach(), v.detach(), out,
                           lse, 0.25, True, 8, 16, lens))     # kernels' contiguous ones


def test_fullgraph_compile_traces_the_operator_forward_and_backward():
    q, k, v = _inputs(1, 4, 2, 24, 40, 16, 16, torch.float16, seed=6)

    def loss(q, k, v):
        out, lse = ops.attention(q, k, v, 0.25, True, 0, 16, None)   # the custom op, traced
        return out.float().square().sum()
    compiled = torch.compile(loss, fullgraph=True, backend="aot_eager")
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    compiled(*leaves).backward()
    plain = [t.clone().requires_grad_() for t in (q, k, v)]
    loss(*plain).backward()
    for a, b in zip(leaves, plain):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.cuda
def test_training_through_attention_on_cuda_matches_the_oracle():
    """Gradients through ``mh.attention(backend="triton")`` at GPU sizes, bf16, GQA."""
    g = torch.Generator().manual_seed(8)
    for mask, Sq, Sk in [(M.causal(), 1000, 1000), (M.sliding_window(128), 1500, 1500),
                         (M.causal() & M.padding(torch.tensor([700, 1200])), 900, 1200)]:
        q = torch.randn(2, 8, Sq, 128, generator=g).to("cuda", torch.bfloat16)
        k, v = (torch.randn(2, 2, Sk, 128, generator=g).to("cuda", torch.bfloat16)
                for _ in range(2))
        m = mask.to("cuda")
        dout = torch.randn(2, 8, Sq, 128, generator=g).to("cuda", torch.bfloat16)
        got = _grads_of(q, k, v, dout, lambda *t: mh.attention(*t, mask=m, backend="triton"))
        ref = _grads_of(q.double(), k.double(), v.double(), dout.double(),
                        lambda *t: oracle(*t, m))
        plain = _grads_of(q.float(), k.float(), v.float(), dout.float(),
                          lambda *t: mh.attention(*t, mask=m, backend="sdpa"))
        for a, r, p in zip(got, ref, plain):
            base = (p.to(torch.bfloat16).double() - r).abs().max()
            assert (a.double() - r).abs().max() <= 2 * base + 1e-2


def _grads_of(q, k, v, dout, fn):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    fn(*leaves).backward(dout)
    return [t.grad for t in leaves]


@pytest.mark.cuda
def test_changing_lengths_and_windows_never_recompiles_a_kernel():
    """Triton compiles per constexpr (mask kind, head dim, tile); S, B, the window and the
    offset are plain arguments, so a new length or window reuses the compiled kernel."""
    from multihead.kernels import decode as dec, flash_bwd as bwd, flash_fwd as fwd

    def compiled():
        return sum(len(c) for kern in (fwd._forward, bwd._dkdv, bwd._dq, dec._partial)
                   for c in kern.device_caches.values()
                   for c in c[:1])
    g = torch.Generator().manual_seed(9)

    def step(S, window, B):
        q = torch.randn(B, 8, S, 64, generator=g).to("cuda", torch.bfloat16).requires_grad_()
        kv = torch.randn(B, 2, S, 64, generator=g).to("cuda", torch.bfloat16)
        mh.attention(q, kv, kv, mask=M.sliding_window(window), backend="triton").sum().backward()
        with torch.no_grad():
            mh.attention(q[:, :, -1:], kv, kv, mask=M.sliding_window(window), backend="triton")
    step(1000, 100, 1)
    before = compiled()
    for S, window, B in [(1001, 100, 1), (3000, 37, 2), (4096, 512, 3), (777, 1, 1)]:
        step(S, window, B)
    assert compiled() == before


@pytest.mark.cuda
def test_s_32768_trains_in_memory_linear_in_s():
    q = torch.randn(1, 4, 32768, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    kv = torch.randn(1, 4, 32768, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = mh.attention(q, kv, kv, mask=M.sliding_window(256), backend="triton")
    out.backward(torch.ones_like(out))
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < 16 * q.nbytes, peak          # a score matrix would be 2048x q.nbytes
    assert torch.isfinite(q.grad).all() and torch.isfinite(kv.grad).all()


@pytest.mark.cuda
def test_fullgraph_compile_and_cuda_graph_capture_of_attention():
    g = torch.Generator().manual_seed(10)
    q = torch.randn(2, 8, 512, 64, generator=g).to("cuda", torch.bfloat16)
    kv = torch.randn(2, 2, 512, 64, generator=g).to("cuda", torch.bfloat16)
    mask = M.sliding_window(64)
    eager = mh.attention(q, kv, kv, mask=mask, backend="triton")
    fn = torch.compile(lambda q, k, v: mh.attention(q, k, v, mask=mask, backend="triton"),
                       fullgraph=True)
    torch.testing.assert_close(fn(q, kv, kv), eager)
    step = q[:, :, -1:].clone()
    run = lambda: mh.attention(step, kv, kv, mask=M.causal(), backend="triton")  # noqa: E731
    want = run()
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        run()                                           # warm up off the capture
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        captured = run()
    step.copy_(torch.randn(step.shape, generator=g).to("cuda", torch.bfloat16))
    graph.replay()
    torch.testing.assert_close(captured, run())
    assert not torch.equal(captured, want)


def test_auto_trains_windows_on_the_kernel_and_keeps_sdpa_for_causal_training():
    """Measured on an H100: our backward runs at ~0.6 of cuDNN's rate, so causal training
    stays on SDPA, while a window's skipped blocks still make the kernel the cheapest."""
    def chosen(mask):
        q = torch.empty(1, 16, 16384, 128, dtype=torch.bfloat16, device="meta",
                        requires_grad=True)
        k = torch.empty(1, 16, 16384, 128, dtype=torch.bfloat16, device="meta")
        return mh.explain(q, k, k, mask=mask, profile="h100").chosen
    assert chosen(M.causal()) == "sdpa"
    assert chosen(M.sliding_window(256)) == "triton"
    assert chosen(M.sliding_window(2048)) == "triton"


# -- bad input: a clear error naming the argument, nothing launched ---------------------------

@pytest.mark.parametrize("config, splits", [((24, 16, 4, 1), None), ((64, 64, 0, 1), None),
                                           ((2**20, 16, 4, 1), None), ((16, 4, 1), None),
                                           ((16, 4, 1), -1), ((16, 4, 1), 0),
                                           ((16, 16, 4, 1), 2), ((512, 4, 1), 2)])
def test_the_kernels_refuse_a_bad_config_or_split_count_by_name(config, splits):
    """Tiles that are not powers of two from 16 to 256, no warps, a tuple of the other
    kernel's length, or no splits: an error naming the argument, not the interpreter's or
    the compiler's (or an unpacking error, or a division by zero)."""
    q, k, v = _inputs(1, 4, 2, 8, 8, 16, 16, torch.float16)
    if splits is not None and splits >= 1:
        with pytest.raises(ValueError, match=r"decode_forward: config must be \(BLOCK_N, "):
            decode_forward(q[:, :, :1], k, v, scale=0.25, config=config, splits=splits)
    elif splits is None:
        with pytest.raises(ValueError, match=r"flash_forward: config must be .* got \("):
            flash_forward(q, k, v, scale=0.25, config=config)
        out, lse = flash_forward(q, k, v, scale=0.25)
        with pytest.raises(ValueError, match=r"flash_backward: config must be .* got \("):
            flash_backward(out, q, k, v, out, lse, scale=0.25, config=(config, config))
    else:
        with pytest.raises(ValueError, match=f"decode_forward: splits must be a positive "
                                             f"integer .* got {splits}"):
            decode_forward(q[:, :, :1], k, v, scale=0.25, config=config, splits=splits)


@pytest.mark.parametrize("config", [(64, 64, 4, 2), 64, ((64, 64, 4, 2),), "64x64",
                                    ((64, 64, 4, 2), (64, 48, 4, 2)),
                                    ((64, 64, 4, 2), (64, 64, 3, 2))])
def test_the_backward_kernels_take_their_config_as_a_pair_by_name(config):
    """A backward's config is (dkdv, dq): a single tuple, a bare int or a bad tile is an
    error naming the argument (a bare tuple used to reach ``len()`` of an int)."""
    from multihead.kernels.flash_sparse import sparse_backward, sparse_forward
    q, k, v = _inputs(1, 2, 2, 8, 8, 16, 16, torch.float16)
    out, lse = flash_forward(q, k, v, scale=0.25)
    with pytest.raises(ValueError, match=r"flash_backward: config must be .*got "):
        flash_backward(out, q, k, v, out, lse, scale=0.25, config=config)
    m = M.alibi(2)
    out, lse = sparse_forward(q, k, v, m, scale=0.25)
    with pytest.raises(ValueError, match=r"sparse_backward: config must be .*got "):
        sparse_backward(out, q, k, v, out, lse, m, scale=0.25, config=config)


@pytest.mark.parametrize("kw, match", [
    (dict(config=(64, 48, 4, 2)), r"config must be .* got \(64, 48, 4, 2\)"),
    (dict(config=(64, 64, 6, 2)), r"config must be .*warps a power of two up to 32, got \(64, 64, 6, 2\)"),
    (dict(config=(64, 64, 4)), r"config must be .* got \(64, 64, 4\)"),
    (dict(scale=float("inf")), "scale must be a finite number, got inf"),
])
def test_the_block_sparse_kernels_check_scale_and_config_by_name(kw, match):
    from multihead.kernels.flash_sparse import sparse_backward, sparse_forward
    q, k, v = _inputs(1, 2, 2, 8, 8, 16, 16, torch.float16)
    m = M.alibi(2)
    with pytest.raises(ValueError, match=f"sparse_forward: {match}"):
        sparse_forward(q, k, v, m, **{"scale": 0.25, **kw})
    if "scale" in kw:
        out, lse = sparse_forward(q, k, v, m, scale=0.25)
        with pytest.raises(ValueError, match=f"sparse_backward: {match}"):
            sparse_backward(out, q, k, v, out, lse, m, scale=kw["scale"])


def test_numpy_and_fraction_arguments_run_as_python_numbers():
    """A NumPy integer offset, window or split count, a ``Fraction`` or NumPy scale and
    NumPy launch tiles pass the checks, so they reach the kernels as Python numbers (Triton
    cannot specialize them): the same results as with ints and floats."""
    import fractions

    import numpy as np
    from multihead.kernels.flash_sparse import sparse_backward, sparse_forward
    q, k, v = _inputs(1, 4, 2, 40, 40, 16, 16, torch.float16, seed=5)
    i64, tiles = np.int64, tuple(np.int64(c) for c in (16, 16, 4, 1))
    plain = dict(scale=0.25, window=9, offset=0, config=(16, 16, 4, 1))
    numpy = dict(scale=fractions.Fraction(1, 4), window=i64(9), offset=i64(0), config=tiles)
    want = flash_forward(q, k, v, **plain)
    got = flash_forward(q, k, v, **numpy)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    dout = torch.randn_like(want[0])
    grads = [flash_backward(dout, q, k, v, *want, **{**kw, "config": (kw["config"],) * 2})
             for kw in (plain, numpy)]
    torch.testing.assert_close(grads[1], grads[0], rtol=0, atol=0)
    step = [decode_forward(q[:, :, -1:], k, v, scale=s, causal=True, window=w, offset=o,
                           splits=n)
            for s, w, o, n in ((0.25, 9, 39, 2), (np.float32(0.25), i64(9), i64(39), i64(2)))]
    torch.testing.assert_close(step[1], step[0], rtol=0, atol=0)
    m = M.alibi(4)
    out = [sparse_forward(q, k, v, m, scale=s, config=c)
           for s, c in ((0.25, (16, 16, 4, 1)), (np.float64(0.25), tiles))]
    torch.testing.assert_close(out[1], out[0], rtol=0, atol=0)
    sparse = [sparse_backward(dout, q, k, v, *out[0], m, scale=s, config=(c, c))
              for s, c in ((0.25, (16, 16, 4, 1)), (fractions.Fraction(1, 4), tiles))]
    torch.testing.assert_close(sparse[1], sparse[0], rtol=0, atol=0)


@pytest.mark.parametrize("bad, match", [
    (dict(q=(1, 3, 8, 16)), "q has 3 heads, not a multiple of k's 2 K/V heads"),
    (dict(v=(1, 2, 9, 16)), "must share B"),
    (dict(q=(3, 8, 16)), "q must be 4-D"),
    (dict(dtype=torch.float32), "the kernels take float16 or bfloat16"),
    (dict(lens=torch.tensor([1.5])), "kv_lengths must be an integer tensor of shape"),
    (dict(lens=torch.tensor([3, 4])), "kv_lengths must be an integer tensor of shape"),
    (dict(lens=torch.tensor([True])), "kv_lengths must be an integer tensor of shape"),
    (dict(window=0), "window must be a positive number of keys .* got 0"),
    (dict(window=-5), "window must be a positive number of keys .* got -5"),
    (dict(scale=float("nan")), "scale must be a finite number, got nan"),
    (dict(scale="x"), "scale must be a finite number, got 'x'"),
    (dict(offset=1.5), "offset must be an integer, got 1.5"),
    (dict(scale=None), "scale must be a finite number, got None: pass head_dim"),
    (dict(causal="no"), "causal must be True or False, got 'no'"),
    (dict(causal=None), "causal must be True or False, got None"),
    (dict(k=(1, 0, 8, 16), v=(1, 0, 8, 16)), r"k and v have 0 K/V heads \(k \(1, 0, 8, 16\)\)"),
])
def test_the_kernels_refuse_bad_input_by_name(bad, match):
    shapes = dict(q=(1, 4, 8, 16), k=(1, 2, 8, 16), v=(1, 2, 8, 16))
    dtype = bad.get("dtype", torch.float16)
    q, k, v = (torch.randn(bad.get(n, shapes[n])).to(DEV, dtype if n == "q" else torch.float16)
               for n in ("q", "k", "v"))
    lens = bad["lens"].to(DEV) if "lens" in bad else None
    kw = {n: bad[n] for n in ("window", "offset") if n in bad}
    for fn in (flash_forward, decode_forward):
        with pytest.raises(ValueError, match=match):
            fn(q[:, :, :4] if fn is decode_forward and q.dim() == 4 else q, k, v,
               scale=bad.get("scale", 0.25), kv_lengths=lens, causal=bad.get("causal", True),
               **kw)
    good_q, good_k, good_v = _inputs(1, 4, 2, 8, 8, 16, 16, torch.float16)
    out, lse = flash_forward(good_q, good_k, good_v, scale=0.25)
    with pytest.raises(ValueError, match="flash_backward: dout must have shape"):
        flash_backward(out[:, :, :4], good_q, good_k, good_v, out, lse, scale=0.25)


@pytest.mark.parametrize("offset, window", [
    (2**31 - 1, None), (2**31 - 10, None), (2**40, None), (-2**31, None),
    (2**31 - 1, 2**31 - 1), (0, 2**40), (5, 2**31 - 3), (2**40, 2**40 + 3),
    (-2**31 + 5, 2**31 - 1), (-3, 2), (50, 20), (30, 10**12)])
def test_a_band_near_or_past_int32_selects_the_keys_it_names(offset, window):
    """Offsets and windows are added to int32 positions in the kernels: one near 2**31
    wrapped and selected the wrong keys. Every row must see exactly the keys
    ``i + offset - window < j <= i + offset``, as the fp64 oracle of that dense mask does."""
    q, k, v = _inputs(1, 2, 2, 32, 40, 16, 16, torch.float16, seed=4)
    i, j = torch.arange(32)[:, None], torch.arange(40)[None]
    allowed = (j <= i + offset) & ((j > i + offset - window) if window else True)
    for fn, rows in ((flash_forward, 32), (decode_forward, 3)):
        out, lse = fn(q[:, :, :rows], k, v, scale=0.25, causal=True, offset=offset,
                      window=window)
        ref, ref_lse = mh.attention(q[:, :, :rows].double(), k.double(), v.double(),
                                    mask=M.dense(allowed[:rows].to(DEV)), scale=0.25,
                                    backend="reference", return_lse=True)
        torch.testing.assert_close(out.double(), ref, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)
    band = dict(scale=0.25, causal=True, offset=offset, window=window)
    out, lse = flash_forward(q, k, v, **band)
    dout = torch.randn_like(out)
    grads = flash_backward(dout, q, k, v, out, lse, **band)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    ref = mh.attention(*leaves, mask=M.dense(allowed.to(DEV)), scale=0.25, backend="reference")
    for got, want in zip(grads, torch.autograd.grad(ref, leaves, dout.double())):
        torch.testing.assert_close(got.double(), want, atol=5e-3, rtol=5e-3)


def test_a_bad_launch_table_file_is_named_in_the_error(tmp_path, monkeypatch):
    from multihead.kernels._band import launch_config
    for i, text in enumerate(['{"fwd": {"128": [128, 64]}}', '{"nonsense": {}}', '{"fwd": [']):
        bad = tmp_path / f"launch{i}.json"
        bad.write_text(text)
        monkeypatch.setenv("MULTIHEAD_TRITON_LAUNCH", str(bad))
        with pytest.raises(ValueError, match="MULTIHEAD_TRITON_LAUNCH=.*not a launch table"):
            launch_config("fwd", 128, 128)
    good = tmp_path / "good.json"
    good.write_text('{"bwd_q": {"128": [32, 32, 2, 1]}}')
    monkeypatch.setenv("MULTIHEAD_TRITON_LAUNCH", str(good))
    assert launch_config("bwd_q", 128, 128) == (32, 32, 2, 1)
    assert launch_config("fwd", 128, 128) == (128, 64, 8, 3)      # the rest: the built-in table
    for i, text in enumerate(['{"decode": {"128": [64, 4, 3, 1]}}',
                              '{"bwd_kv": {"128": [64, 4, 3]}}', '{"fwd": {"128": [48, 64, 4, 3]}}']):
        bad = tmp_path / f"arity{i}.json"
        bad.write_text(text)
        monkeypatch.setenv("MULTIHEAD_TRITON_LAUNCH", str(bad))
        with pytest.raises(ValueError, match=r"not a launch table .*each entry is \["):
            launch_config("fwd", 128, 128)


def test_the_decode_kernel_takes_its_tiles_from_the_launch_table(tmp_path, monkeypatch):
    """The table's "decode" entry (as ``triton_tune --write`` measures it) is what decoding
    launches, and what it computes stays the oracle's."""
    from multihead.kernels import decode
    q, k, v = _inputs(1, 4, 2, 1, 100, 16, 16, torch.float16, seed=3)
    seen = []
    real = decode.launch

    def record(kernel, grid, *args, **kw):
        seen.append((kw["BLOCK_N"], kw["num_warps"], kw["num_stages"]))
        return real(kernel, grid, *args, **kw)

    monkeypatch.setattr(decode, "launch", record)
    table = tmp_path / "launch.json"
    table.write_text('{"decode": {"16": [16, 2, 1]}}')
    monkeypatch.setenv("MULTIHEAD_TRITON_LAUNCH", str(table))
    out, lse = decode.decode_forward(q, k, v, scale=0.25, causal=True, offset=99)
    monkeypatch.delenv("MULTIHEAD_TRITON_LAUNCH")
    decode.decode_forward(q, k, v, scale=0.25, causal=True, offset=99)
    assert seen == [(16, 2, 1), (64, 4, 3)]
    assert_kernel_matches_oracle(out, lse, q, k, v, M.causal(), 0.25)


def test_the_tuner_writes_the_decode_winner_into_the_launch_table():
    """``triton_tune --write`` keeps the fastest (BLOCK_N, warps, stages) at the default
    number of splits over every decoding case, so ``MULTIHEAD_TRITON_LAUNCH`` can use it."""
    from benchmarks.triton_tune import winners
    rows = [dict(part="decode", B=B, L=L, graph=g, config=(*c, 16), mult=mult, us=us)
            for B, L in ((1, 4096), (8, 32768)) for g in (False, True)
            for c, mult, us in (((64, 4, 3), 1.0, 10.0), ((128, 4, 2), 1.0, 9.0),
                                ((32, 2, 3), 2.0, 1.0))]
    rows.append(dict(part="decode", B=1, L=4096, graph=False, config=(16, 4, 3, 16), mult=1.0,
                     error=1.0))
    assert winners(rows) == {"decode": {"128": [128, 4, 2]}}


def test_a_strided_output_gradient_gives_the_same_gradients():
    """dO as autograd hands it over from a transposed use of the output (not contiguous)."""
    q, k, v = _inputs(2, 4, 2, 40, 40, 16, 16, torch.float16, seed=11)
    w = torch.randn(2, 40, 4, 16, generator=torch.Generator().manual_seed(12)).to(DEV, q.dtype)

    def grads(transposed):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out, _ = ops.attention(*leaves, 0.25, True, 0, 0, None)
        loss = (out.transpose(1, 2) * w).sum() if transposed else (out * w.transpose(1, 2)).sum()
        loss.backward()
        return [t.grad for t in leaves]
    for a, b in zip(grads(True), grads(False)):
        torch.testing.assert_close(a, b)


# -- torch.func: functorch's wrapped tensors expose no device memory --------------------------

def test_under_a_torch_func_transform_auto_plans_another_backend():
    """A plain call's choice (the kernels) is cached; under vmap the same call is decided
    afresh and the triton row says why it declines."""
    def explain(q):
        return mh.explain(q, q, q, mask=M.sliding_window(256), profile="h100")
    q = torch.empty(1, 16, 16384, 128, dtype=torch.bfloat16, device="meta")
    assert explain(q).chosen == "triton"
    seen = []
    torch.func.vmap(lambda x: seen.append(explain(x)) or x)(q.unsqueeze(0))
    assert seen[0].chosen != "triton"
    assert "does not run under torch.func transforms" in str(seen[0])
    assert explain(q).chosen == "triton"                   # and plain calls are unaffected


def test_under_a_torch_func_transform_no_decision_is_shared(monkeypatch):
    """Decisions are cached by shapes, which a transform's wrapped tensors share with plain
    ones: under vmap nothing is read from or written to the plan caches."""
    from multihead.functional import dispatch
    seen = []

    class Spy:
        def __init__(self, real):
            self.real = real

        def get(self, key):
            seen.append(key)
            return self.real.get(key)

        def put(self, key, value):
            seen.append(key)
            self.real.put(key, value)
    for name in ("_DECISIONS", "_CHOICES"):
        monkeypatch.setattr(dispatch, name, Spy(getattr(dispatch, name)))
    q = torch.randn(2, 1, 2, 8, 16)
    torch.func.vmap(lambda x: mh.attention(x, x, x, mask=M.causal()))(q)
    seen2 = []
    torch.func.vmap(lambda x: seen2.append(mh.explain(x, x, x, mask=M.causal())) or x)(q)
    assert seen == [] and seen2[0].reused is None
    mh.attention(q[0], q[0], q[0], mask=M.causal())                       # a plain call: cached
    assert seen


def test_the_kernels_refuse_torch_func_transforms_by_name():
    from multihead.kernels import ops
    x = torch.randn(1, 2, 8, 16).to(DEV, torch.float16)
    calls = {"attention": lambda t: ops.attention(t, t, t, 0.25, True, 0, 0, None)[0],
             "sparse": lambda t: ops.sparse(t, t, t, M.alibi(2), 0.25)[0],
             "decode": lambda t: ops.decode(t[:, :, :1], t, t, 0.25, True, 0, 7, None)[0]}
    for name, call in calls.items():
        with pytest.raises(RuntimeError, match="do not run under torch.func transforms"):
            torch.func.grad(lambda t: call(t).float().sum())(x)
        with pytest.raises(RuntimeError, match="do not run under torch.func transforms"):
            torch.func.vmap(call)(x.unsqueeze(0))
        assert call(x).isfinite().all(), name              # outside a transform: they run
    # a plain forward whose backward then runs batched (vmap over the output gradients)
    for name in ("attention", "sparse"):
        leaf = x.clone().requires_grad_()
        out = calls[name](leaf)
        with pytest.raises(RuntimeError, match="batched gradients"):
            torch.autograd.grad(out, leaf, torch.ones(2, *out.shape, dtype=out.dtype,
                                                      device=out.device),
                                is_grads_batched=True)


@pytest.mark.cuda
def test_torch_func_grad_through_auto_on_cuda_equals_autograd():
    q, k, v = (t.requires_grad_() for t in _inputs(1, 4, 2, 300, 300, 64, 64, torch.bfloat16))
    mask = M.sliding_window(64)
    mh.attention(q, k, v, mask=mask).float().sum().backward()    # the plain call: the kernels
    assert mh.explain(q, k, v, mask=mask).chosen == "triton"
    grads = torch.func.grad(lambda a, b, c: mh.attention(a, b, c, mask=mask).float().sum(),
                            argnums=(0, 1, 2))(q.detach(), k.detach(), v.detach())
    for got, want in zip(grads, (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)

"""Property-based: random shapes, GQA ratios, masks and backends all equal the fp64 oracle."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import multihead as mh
from conftest import BACKENDS, make_masks, oracle, small_tiles


@st.composite
def calls(draw):
    B = draw(st.integers(1, 2))
    Hkv = draw(st.integers(1, 3))
    H = Hkv * draw(st.integers(1, 3))
    sk = draw(st.integers(1, 40))
    sq = draw(st.integers(1, 40))
    D, Dv = draw(st.integers(1, 9)), draw(st.integers(1, 9))
    names = [n for n in make_masks(1, 1, 2, 2) if not (n == "document" and sq > sk)]
    a = draw(st.sampled_from(names))
    b = draw(st.sampled_from(names))
    backend = draw(st.sampled_from(BACKENDS))
    tile = draw(st.sampled_from([1, 3, 8, 64]))
    seed = draw(st.integers(0, 2**16))
    return B, H, Hkv, sq, sk, D, Dv, a, b, backend, tile, seed


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(calls())
def test_random_calls_equal_the_oracle(args):
    B, H, Hkv, sq, sk, D, Dv, a, b, backend, tile, seed = args
    masks = make_masks(B, H, sq, sk, seed=seed)
    ma, mb = masks[a], masks[b]
    if ma is None or mb is None:
        mask = ma or mb
    else:
        mask = ma & mb
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, H, sq, D, generator=g, requires_grad=True)
    k = torch.randn(B, Hkv, sk, D, generator=g, requires_grad=True)
    v = torch.randn(B, Hkv, sk, Dv, generator=g, requires_grad=True)
    with small_tiles(tile=tile, budget=tile * tile * 4):
        out = mh.attention(q, k, v, mask=mask, backend=backend)
        grads = torch.autograd.grad(out.sum(), (q, k, v))
    ref = oracle(q, k, v, mask)
    want = torch.autograd.grad(ref.sum(), (q, k, v))
    torch.testing.assert_close(out.double(), ref, atol=3e-5, rtol=1e-4)
    for x, y in zip(grads, want):
        torch.testing.assert_close(x.double(), y.double(), atol=1e-4, rtol=1e-4)

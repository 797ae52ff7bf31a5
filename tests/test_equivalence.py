"""Every backend equals the fp64 reference: masks x GQA ratios x Sq != Sk x dtypes, fwd and grads."""

import pytest
import torch

import multihead as mh
from conftest import (ALL_BACKENDS, BACKENDS, MASK_NAMES, make_masks, oracle, plain_torch,
                      skip_unless_runs, small_tiles)

# (H, Hkv): MHA, GQA, MQA. (Sq, Sk): cross-attention and decoding shapes, none a tile multiple.
HEADS = [(4, 4), (4, 2), (4, 1)]
SHAPES = [(19, 19), (13, 29), (29, 11)]
SUPPORTS_GRAD = {"reference", "sdpa", "blocksparse"}


def _inputs(B, H, Hkv, sq, sk, D=8, Dv=12, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype).requires_grad_()
    return mk(B, H, sq, D), mk(B, Hkv, sk, D), mk(B, Hkv, sk, Dv)


def _grads(out, inputs, seed=1):
    g = torch.Generator().manual_seed(seed)
    go = torch.randn(out.shape, generator=g).to(out.dtype)
    return torch.autograd.grad(out, inputs, go, allow_unused=True)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("mask_name", MASK_NAMES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"H{h[0]}kv{h[1]}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_fp32_forward_and_grads_equal_fp64_reference(backend, mask_name, heads, shape):
    (H, Hkv), (sq, sk), B = heads, shape, 2
    mask = make_masks(B, H, sq, sk)[mask_name]
    q, k, v = _inputs(B, H, Hkv, sq, sk)
    skip_unless_runs(backend, q, k, v, mask=mask)
    with small_tiles():
        out = mh.attention(q, k, v, mask=mask, backend=backend)
    ref = oracle(q, k, v, mask)
    assert out.shape == (B, H, sq, 12) and out.dtype == torch.float32
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    with small_tiles():
        got = _grads(out, (q, k, v))
    want = _grads(ref, (q, k, v))
    for name, a, b in zip("qkv", got, want):
        assert torch.isfinite(a).all(), f"d{name} not finite"
        torch.testing.assert_close(a.double(), b.double(), atol=5e-5, rtol=1e-4)


def _err(x, ref):
    return (x.double() - ref).abs().max().item()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("mask_name", ["none", "causal", "sliding_window", "padding_query",
                                       "document", "bias", "causal&alibi"])
@pytest.mark.parametrize("shape", [(37, 53), (53, 53)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_half_types_within_twice_plain_pytorch_error(dtype, backend, mask_name, shape):
    """The FlashAttention rule: error vs fp64 <= 2x the error of plain PyTorch in that dtype."""
    (sq, sk), B, H, Hkv = shape, 2, 4, 2
    mask = make_masks(B, H, sq, sk)[mask_name]
    q, k, v = _inputs(B, H, Hkv, sq, sk, D=16, Dv=16, dtype=dtype)
    skip_unless_runs(backend, q, k, v, mask=mask)
    ref = oracle(q, k, v, mask)
    base = plain_torch(q, k, v, mask)
    with small_tiles():
        out = mh.attention(q, k, v, mask=mask, backend=backend)
    assert out.dtype == dtype
    assert _err(out, ref) <= 2 * _err(base, ref) + 1e-6
    with small_tiles():
        got = _grads(out, (q, k, v))
    base_g = _grads(base, (q, k, v))
    want = _grads(ref, (q, k, v))
    for a, b, w in zip(got, base_g, want):
        assert _err(a, w) <= 2 * _err(b, w) + 1e-5


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("mask_name", ["causal&padding", "document", "alibi", "padding_query"])
@pytest.mark.parametrize("shape", [(21, 30), (30, 30)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_fp64_inputs(backend, mask_name, shape):
    (sq, sk), B, H, Hkv = shape, 1, 2, 1
    mask = make_masks(B, H, sq, sk)[mask_name]
    q, k, v = _inputs(B, H, Hkv, sq, sk, dtype=torch.float64)
    skip_unless_runs(backend, q, k, v, mask=mask)
    with small_tiles():
        out = mh.attention(q, k, v, mask=mask, backend=backend)
    assert out.dtype == torch.float64
    torch.testing.assert_close(out, oracle(q, k, v, mask), atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("backend", ["reference", "blocksparse"])
@pytest.mark.parametrize("mask_name", ["none", "causal&padding", "window&document", "alibi",
                                       "padding_query", "causal|dense"])
def test_gradcheck_fp64(backend, mask_name):
    B, H, Hkv, sq, sk = 1, 2, 1, 6, 9
    mask = make_masks(B, H, sq, sk, seed=3)[mask_name]
    q, k, v = _inputs(B, H, Hkv, sq, sk, D=3, Dv=2, dtype=torch.float64)
    with small_tiles(tile=4, budget=64):
        assert torch.autograd.gradcheck(
            lambda a, b, c: mh.attention(a, b, c, mask=mask, backend=backend), (q, k, v))


@pytest.mark.parametrize("backend", ["reference", "blocksparse"])
def test_lse_matches_logsumexp_of_scores(backend):
    B, H, Hkv, sq, sk = 2, 4, 2, 17, 23
    mask = make_masks(B, H, sq, sk)["causal&padding"]
    q, k, v = _inputs(B, H, Hkv, sq, sk, dtype=torch.float64)
    with small_tiles():
        _, lse = mh.attention(q, k, v, mask=mask, backend=backend, return_lse=True)
    s = (q @ k.repeat_interleave(2, 1).transpose(-1, -2)) / 8 ** 0.5
    s = s.masked_fill(~mask.materialize(sq, sk), float("-inf"))
    torch.testing.assert_close(lse, torch.logsumexp(s, -1))
    # d lse / d q through blocksparse's backward equals autograd through the formula
    with small_tiles():
        g1 = torch.autograd.grad(mh.attention(q, k, v, mask=mask, backend=backend,
                                              return_lse=True)[1].exp().sum(), q)[0]
    g2 = torch.autograd.grad(torch.logsumexp(s, -1).exp().sum(), q)[0]
    torch.testing.assert_close(g1, g2)


def test_weights_are_the_softmax_rows():
    q, k, v = _inputs(2, 4, 2, 9, 14)
    mask = mh.masks.causal() & mh.masks.alibi(4)
    out, w = mh.attention(q, k, v, mask=mask, return_weights=True)
    assert w.shape == (2, 4, 9, 14)
    torch.testing.assert_close(w.sum(-1), torch.ones(2, 4, 9))
    assert (w.masked_select(~mh.masks.causal().materialize(9, 14)) == 0).all()
    torch.testing.assert_close(out, w @ v.repeat_interleave(2, 1))


def test_inputs_are_not_modified():
    q, k, v = _inputs(1, 4, 2, 70, 90)
    copies = [t.detach().clone() for t in (q, k, v)]
    for backend in BACKENDS:
        mh.attention(q, k, v, mask=mh.masks.sliding_window(9), backend=backend).sum().backward()
    for t, c in zip((q, k, v), copies):
        assert torch.equal(t.detach(), c)


def test_noncontiguous_inputs():
    x = torch.randn(2, 50, 4, 8)           # (B, S, H, D): heads split without a copy
    q = k = v = x.transpose(1, 2)           # (B, H, S, D), non-contiguous
    ref = oracle(q, k, v, mh.masks.sliding_window(7))
    for backend in BACKENDS:
        out = mh.attention(q, k, v, mask=mh.masks.sliding_window(7), backend=backend)
        torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)


def test_learned_bias_inside_a_composed_mask_gets_its_gradient():
    """A trainable bias under & must not be routed to blocksparse (which has no bias grad)."""
    q, k, v = _inputs(1, 2, 2, 70, 70)
    b = torch.randn(1, 2, 70, 70, requires_grad=True)
    mask = mh.masks.sliding_window(8) & mh.masks.bias(b)
    assert mh.explain(q, k, v, mask=mask).chosen != "blocksparse"
    with pytest.raises(ValueError, match="no gradient w.r.t. a bias"):
        mh.attention(q, k, v, mask=mask, backend="blocksparse")
    out = mh.attention(q, k, v, mask=mask)
    (g,) = torch.autograd.grad(out.sum(), b)
    ref = mh.attention(q, k, v, mask=mask, backend="reference")
    (want,) = torch.autograd.grad(ref.sum(), b)
    torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-4)

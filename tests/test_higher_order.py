"""Transforms and second-order gradients: under ``torch.func`` (grad, vmap, jacrev) auto
leaves the tiled backend, whose autograd Function cannot run there, and a named one says
so; a backward that builds a graph (``create_graph=True``) through blocksparse gives the
gradients the reference backend's differentiable ops give, so double backward, gradient
penalties and hessian-vector products agree with it (fp64)."""

from __future__ import annotations

import pytest
import torch
from torch.autograd import forward_ad

import multihead as mh

M = mh.masks
WIDE = {"window": M.sliding_window(16), "documents": M.causal() & M.document(
    torch.arange(2048) // 700)}


@pytest.mark.parametrize("mask", WIDE)
def test_auto_leaves_blocksparse_under_torch_func(mask):
    q = torch.randn(1, 2, 2048, 16)
    t = q.clone().requires_grad_()                                 # training, no transform:
    assert mh.explain(t, t, t, mask=WIDE[mask]).chosen == "blocksparse"

    def loss(backend):
        return lambda t: mh.attention(t, q, q, mask=WIDE[mask], backend=backend).sum()
    torch.testing.assert_close(torch.func.grad(loss("auto"))(q),
                               torch.func.grad(loss("reference"))(q), atol=2e-5, rtol=1e-4)
    out = torch.func.vmap(lambda t: mh.attention(t, q, q, mask=WIDE[mask]))(
        torch.stack([q, 2 * q]))                                    # (2, B, H, S, D)
    want = [mh.attention(t, q, q, mask=WIDE[mask], backend="reference") for t in (q, 2 * q)]
    torch.testing.assert_close(out, torch.stack(want), atol=2e-6, rtol=1e-5)


def test_vmap_over_per_sample_masks():
    """A mask that is itself vmapped (one padding per sample): auto leaves the backends
    that read the mask back to the host (rows) and gives what a loop over samples gives,
    as does the drop-in with a vmapped key_padding_mask, equal to torch's module."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(3, 2, 4, 5, 8, generator=g)                   # (vmapped, B, H, S, D)
    keep = torch.ones(3, 2, 5, dtype=torch.bool)
    keep[0, 1, 3:] = keep[2, 0, 1:] = False

    def one(t, m):
        return mh.attention(t, t, t, mask=M.dense(m[:, None, None, :]))
    want = torch.stack([one(t, m) for t, m in zip(q, keep)])
    torch.testing.assert_close(torch.func.vmap(one)(q, keep), want)
    torch.manual_seed(0)
    theirs = torch.nn.MultiheadAttention(16, 4, batch_first=True)
    ours = mh.nn.MultiheadAttention(16, 4, batch_first=True)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(3, 2, 5, 16, generator=g)
    want, got = (torch.func.vmap(lambda t, m: module(t, t, t, key_padding_mask=m)[0])(x, ~keep)
                 for module in (theirs, ours))                    # (3, B, S, E) each
    torch.testing.assert_close(got, want)


def test_blocksparse_named_under_torch_func_is_refused_with_the_reason():
    q = torch.randn(1, 2, 64, 16)
    with pytest.raises(ValueError, match="blocksparse.*does not run under torch.func transforms"):
        torch.func.grad(lambda t: mh.attention(t, q, q, backend="blocksparse").sum())(q)


def _second_order(backend, q, k, mask):
    out, lse = mh.attention(q, k, k, mask=mask, backend=backend, return_lse=True)
    g = torch.autograd.grad(out.pow(2).sum() + lse.sum(), (q, k), create_graph=True)
    return g, torch.autograd.grad(sum(x.pow(2).sum() for x in g), (q, k))


@pytest.mark.parametrize("mask", [M.sliding_window(32), M.causal() & M.alibi(4), None],
                         ids=["window", "alibi", "none"])
def test_double_backward_through_blocksparse_equals_the_reference(mask):
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 200, 8, dtype=torch.float64, generator=g).requires_grad_()
    k = torch.randn(1, 2, 200, 8, dtype=torch.float64, generator=g).requires_grad_()  # GQA; v is k
    got, want = (_second_order(b, q, k, mask) for b in ("blocksparse", "reference"))
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_a_gradient_penalty_through_the_module():
    torch.manual_seed(0)
    m = mh.MultiHeadAttention(32, 4, num_kv_heads=2).double()
    x = torch.randn(1, 1024, 32, dtype=torch.float64, requires_grad=True)
    mask = M.sliding_window(64)
    t = torch.randn(1, 4, 1024, 8, dtype=torch.float64, requires_grad=True)
    assert mh.explain(t, t, t, mask=mask).chosen == "blocksparse"
    pens = {}
    for backend in ("auto", "reference"):
        m.backend = backend
        gx, = torch.autograd.grad(m(x, mask=mask).pow(2).sum(), x, create_graph=True)
        pens[backend] = torch.autograd.grad(gx.pow(2).sum(), m.in_proj_weight)[0]
    torch.testing.assert_close(pens["auto"], pens["reference"], atol=1e-9, rtol=1e-9)


def _plain(q, k, v, allowed):
    """torch's own ops, whose forward-mode rules torch wrote: the oracle for tangents."""
    scores = (q @ k.transpose(-2, -1)) / q.shape[-1] ** 0.5
    return torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v


@pytest.mark.parametrize("mask", ["none", "causal", "padding"])
def test_forward_mode_ad_equals_torchs_own_ops(mask):
    """jvp, jacfwd and dual tensors through auto: what torch's forward-mode rules give on
    the formula written with plain ops (fp64), masked or not."""
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(2, 2, 5, 8, dtype=torch.float64, generator=g) for _ in range(3))
    tq, tk, tv = (torch.randn_like(t) for t in (q, k, v))
    m = {"none": None, "causal": M.causal(), "padding": M.padding(torch.tensor([5, 3]))}[mask]
    allowed = torch.ones(2, 1, 5, 5, dtype=torch.bool) if m is None else m.materialize(5, 5)
    ours = lambda q, k, v: mh.attention(q, k, v, mask=m)
    _, want = torch.func.jvp(lambda *t: _plain(*t, allowed), (q, k, v), (tq, tk, tv))
    _, got = torch.func.jvp(ours, (q, k, v), (tq, tk, tv))
    torch.testing.assert_close(got, want)
    with forward_ad.dual_level():
        duals = [forward_ad.make_dual(t, d) for t, d in ((q, tq), (k, tk), (v, tv))]
        assert "forward-mode derivatives" in str(mh.explain(*duals, mask=m))
        torch.testing.assert_close(forward_ad.unpack_dual(ours(*duals)).tangent, want)
    jac = torch.func.jacfwd(lambda q: ours(q, k, v))(q)           # (B, H, Sq, Dv, B, H, Sq, D)
    torch.testing.assert_close(jac, torch.func.jacfwd(lambda q: _plain(q, k, v, allowed))(q))


@pytest.mark.parametrize("weights", [False, True])
def test_hessian_forward_over_reverse_equals_torchs_own_ops(weights):
    """torch.func.hessian is jacfwd over jacrev: inside the jacrev the outer tangent is not
    seen on the inputs, and the reference backend's product without a jvp raised
    NotImplementedError (the drop-in's need_weights=True runs it)."""
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 2, 3, 4, dtype=torch.float64, generator=g) for _ in range(3))
    allowed = M.causal().materialize(3, 3)

    def ours(q):
        out = mh.attention(q, k, v, mask=M.causal(), return_weights=weights)
        return (out[0] * out[1].sum()).sum() if weights else out.square().sum()

    def plain(q):
        out = _plain(q, k, v, allowed)
        if not weights:
            return out.square().sum()
        w = torch.softmax((q @ k.transpose(-2, -1) / 2).masked_fill(~allowed, float("-inf")), -1)
        return (out * w.sum()).sum()

    torch.testing.assert_close(torch.func.hessian(ours)(q), torch.func.hessian(plain)(q))


def test_attention_of_constants_under_a_jvp_is_not_taken_for_a_tangent():
    """Inputs from outside the transform carry no tangent: sdpa (no forward-mode rule) runs."""
    q = torch.randn(1, 2, 4, 8, generator=torch.Generator().manual_seed(1))
    const = mh.attention(q, q, q, backend="sdpa").sum()
    _, tangent = torch.func.jvp(lambda x: x * mh.attention(q, q, q, backend="sdpa").sum(),
                                (torch.tensor(2.0),), (torch.tensor(1.0),))
    torch.testing.assert_close(tangent, const)


def test_forward_mode_ad_ignores_a_hidden_nan_key():
    """The rule for non-finite inputs holds for tangents too: a NaN in a key no query may
    see changes neither the output nor its tangent."""
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(1, 1, 4, 8, dtype=torch.float64, generator=g) for _ in range(3))
    k_bad, v_bad = k.clone(), v.clone()
    k_bad[0, 0, 3], v_bad[0, 0, 3] = float("nan"), float("nan")
    pad = M.padding(torch.tensor([3]))
    tangents = tuple(torch.randn_like(t) for t in (q, k, v))
    f = lambda k, v: (lambda *t: mh.attention(*t, mask=pad))
    _, want = torch.func.jvp(f(k, v), (q, k, v), tangents)
    _, got = torch.func.jvp(f(k_bad, v_bad), (q, k_bad, v_bad), tangents)
    assert not got.isnan().any()
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", ["blocksparse", "sdpa"])
def test_forward_mode_ad_through_a_fused_backend_names_the_backend_that_has_it(backend):
    q = torch.randn(1, 2, 64, 16)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(q, torch.randn_like(q))
        with pytest.raises(ValueError, match=f"backend='{backend}' cannot run this call: it "
                                             f"gives no forward-mode derivatives"):
            mh.attention(dual, q, q, backend=backend)
        assert mh.attention(q, q, q, backend=backend).shape == q.shape   # no tangent: runs


def test_a_plan_made_without_a_tangent_is_not_reused_for_one():
    """Inside one dual level and at one shape, a plain call's plan (sdpa) must not serve a
    call whose q, or whose bias, carries a tangent."""
    g = torch.Generator().manual_seed(13)
    q, k, v = (torch.randn(1, 2, 6, 8, dtype=torch.float64, generator=g) for _ in range(3))
    bias = torch.randn(6, 6, dtype=torch.float64, generator=g)
    tangent = torch.randn_like(q)
    _, want = torch.func.jvp(lambda q: _plain(q, k, v, torch.ones(6, 6, dtype=torch.bool)),
                             (q,), (tangent,))
    with forward_ad.dual_level():
        for _ in range(2):
            mh.attention(q, k, v), mh.attention(q, k, v, mask=bias)
        dual = forward_ad.unpack_dual(mh.attention(forward_ad.make_dual(q, tangent), k, v))
        torch.testing.assert_close(dual.tangent, want)
        dual_bias = forward_ad.make_dual(bias, torch.ones_like(bias))
        assert "forward-mode" in str(mh.explain(q, k, v, mask=dual_bias))
        out = forward_ad.unpack_dual(mh.attention(q, k, v, mask=dual_bias))
        assert out.tangent is not None and torch.isfinite(out.tangent).all()
        with pytest.raises(ValueError, match="gives no forward-mode derivatives"):
            mh.attention(forward_ad.make_dual(q, tangent), k, v, backend="sdpa")

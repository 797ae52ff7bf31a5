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


def test_forward_mode_ad_through_blocksparse_names_the_backend_that_has_it():
    q = torch.randn(1, 2, 64, 16)
    with forward_ad.dual_level():
        dual = forward_ad.make_dual(q, torch.randn_like(q))
        with pytest.raises(RuntimeError, match="first-order only.*backend='reference'"):
            mh.attention(dual, q, q, backend="blocksparse")

"""Transforms and second-order gradients: under ``torch.func`` (grad, vmap, jacrev) auto
leaves the tiled backend, whose autograd Function cannot run there, and a named one says
so; a backward that builds a graph (``create_graph=True``) through any backend (torch's
fused SDPA kernels included, which have no double backward of their own) gives the
gradients the reference backend's differentiable ops give, so double backward, gradient
penalties and hessian-vector products agree with it (fp64) and with torch's numerical
second derivatives (``gradgradcheck``)."""

from __future__ import annotations

import re

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


def test_a_second_order_transform_of_alibi_leaves_later_transforms_working():
    """ALiBi's slopes are shared by every alibi(H) mask: made inside a hessian, they were
    kept wrapped by it, and every later torch.func call with ALiBi failed inside functorch
    (an INTERNAL ASSERT), for the rest of the process."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, 2, s, 4, generator=g, dtype=torch.float64) for s in (3, 5, 5))

    def f(x):
        return mh.attention(x, k, v, mask=M.alibi(2, align="upper_left")).sin().sum()

    def ref(x):                                  # fp64 by hand: -slope * |q - k| on the scores
        slopes = torch.tensor([2.0 ** -4, 2.0 ** -8], dtype=torch.float64)[:, None, None]
        dist = (torch.arange(3)[:, None] - torch.arange(5)).abs()
        s = x @ k.transpose(-1, -2) / 2 - slopes * dist
        return (s.softmax(-1) @ v).sin().sum()
    want = torch.func.jacrev(ref)(q)
    torch.testing.assert_close(torch.func.hessian(f)(q), torch.func.hessian(ref)(q))
    torch.testing.assert_close(torch.func.jacrev(f)(q), want)
    gg = [torch.func.grad(lambda x: torch.func.grad(fn)(x).pow(2).sum())(q) for fn in (f, ref)]
    torch.testing.assert_close(*gg)
    torch.testing.assert_close(torch.func.jacfwd(f)(q), want)


@pytest.mark.parametrize("mask", [M.alibi(2), M.document([[0, 0, 1, 1, 1]])], ids=["alibi", "document"])
def test_facts_made_inside_torch_func_are_kept_for_later_calls(mask, monkeypatch):
    """What a mask computes once (ALiBi's slopes, a document's segments) is made outside the
    transform and kept, plain: not recomputed at every grad or vmap step (on a GPU, reading
    ids back to the host is a sync each time)."""
    from multihead.masks import base
    base._SHARED.clear()
    made, real = [], base.Mask.cached

    def counting(self, what, args, compute):
        return real(self, what, args, lambda: made.append(what) or compute())
    monkeypatch.setattr(base.Mask, "cached", counting)
    x = torch.randn(1, 2, 5, 4)
    for f, inputs in ((torch.func.grad, x), (torch.func.grad, x),
                      (torch.func.vmap, x.expand(3, 1, 2, 5, 4))):     # (vmapped 3, B, H, S, D)
        f(lambda t: mh.attention(t, t, t, mask=mask).sum())(inputs)
    assert made and len(made) == len(set(made)), made          # each fact once
    kept = [v for v, _, _ in base._SHARED._data.values()] + [
        v for v, _, _ in getattr(mask.__dict__.get("_memo"), "_data", {}).values()]
    assert kept and not any(torch._C._functorch.is_functorch_wrapped_tensor(t)
                            for v in kept for t in (v if isinstance(v, tuple) else (v,))
                            if isinstance(t, torch.Tensor))


@pytest.mark.parametrize("mask", [None, M.causal(), M.padding([3, 5]), M.bias(torch.randn(5, 5))],
                         ids=["none", "causal", "padding", "bias"])
def test_vmap_over_an_empty_dimension_gives_an_empty_result(mask):
    """torch's fused CPU kernel has no batching rule, and its loop over the samples cannot
    run over none: auto picked it, and the call failed inside functorch."""
    q = torch.randn(0, 2, 2, 5, 4)                                # (vmapped 0, B, H, S, D)
    said = []

    def one(t):
        said.append(str(mh.explain(t, t, t, mask=mask)))
        return mh.attention(t, t, t, mask=mask)
    assert torch.func.vmap(one)(q).shape == (0, 2, 2, 5, 4)
    assert re.search(r"\* reference .*\n.*\n +sdpa +cannot run: cannot run under torch.func.vmap "
                     r"over a dimension of size 0", said[0]), said[0]
    g = torch.func.vmap(torch.func.grad(lambda t: mh.attention(t, t, t, mask=mask).sum()))
    assert g(q).shape == (0, 2, 2, 5, 4)


@pytest.mark.parametrize("build, name", [
    (lambda t, x: M.padding(x.sum(-1).long()), "padding's lengths"),
    (lambda t, x: M.padding(x > 0), "padding's bool mask values"),
    (lambda t, x: M.document(x.long()), "document's ids"),
    (lambda t, x: M.document(torch.zeros(2, 5, dtype=torch.long), kv_ids=x.long()),
     "document's kv_ids"),
])
def test_a_mask_built_from_values_vmap_batches_is_refused_naming_them(build, name):
    """They are read on the host when the mask is built (vmap cannot: torch's .item() or
    nonzero message); dense(...) takes a mask per sample."""
    q = torch.randn(3, 2, 2, 5, 4)
    x = torch.ones(3, 2, 5)
    with pytest.raises(ValueError, match=rf"{name} are batched by torch.func.vmap, but the "
                                         r"mask reads them on the host.*masks.dense"):
        torch.func.vmap(lambda t, m: mh.attention(t, t, t, mask=build(t, m)))(q, x)
    with pytest.raises(TypeError, match=r"scale is batched by torch.func.vmap, but it is one "
                                        r"float for the whole call"):
        torch.func.vmap(lambda t, s: mh.attention(t, t, t, scale=s))(q, torch.rand(3))


def test_blocksparse_named_under_torch_func_is_refused_with_the_reason():
    q = torch.randn(1, 2, 64, 16)
    with pytest.raises(ValueError, match="blocksparse.*does not run under torch.func transforms"):
        torch.func.grad(lambda t: mh.attention(t, q, q, backend="blocksparse").sum())(q)


def _second_order(backend, q, k, mask, lse=True):
    """First-order gradients built as a graph, and the gradients of their squares."""
    got = mh.attention(q, k, k, mask=mask, backend=backend, return_lse=lse)
    loss = got[0].pow(2).sum() + got[1].sum() if lse else got.pow(2).sum()
    g = torch.autograd.grad(loss, (q, k), create_graph=True)
    return g, torch.autograd.grad(sum(x.pow(2).sum() for x in g), (q, k))


DOCS = torch.tensor([[0] * 70 + [1] * 130])                      # (1, 200) document ids
SECOND_ORDER = {                                 # backend -> masks it runs (and lse or not)
    "blocksparse": [M.sliding_window(32), M.causal() & M.alibi(4), None],
    "sdpa": [None, M.causal(), M.padding(torch.tensor([150])) & M.alibi(4)],
    "varlen": [M.document(DOCS)],
    "auto": [None],
}


@pytest.mark.parametrize("backend,mask", [(b, m) for b, ms in SECOND_ORDER.items() for m in ms],
                         ids=lambda x: x if isinstance(x, str) else
                         "none" if x is None else x.describe())
def test_double_backward_through_every_backend_equals_the_reference(backend, mask):
    """The fused backends (torch's SDPA kernels, our tiles) give gradients that can be
    differentiated again, equal to the reference's; torch's own SDPA fails there."""
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 200, 8, dtype=torch.float64, generator=g).requires_grad_()
    k = torch.randn(1, 2, 200, 8, dtype=torch.float64, generator=g).requires_grad_()  # GQA; v is k
    if backend == "auto":
        assert mh.explain(q, k, k, mask=mask).chosen == "sdpa"
    lse = backend == "blocksparse"                                  # (the others return none)
    got, want = (_second_order(b, q, k, mask, lse) for b in (backend, "reference"))
    for a, b in zip(got[0] + got[1], want[0] + want[1]):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("mask", ["none", "causal"])
def test_grad_of_grad_under_torch_func_equals_torchs_own_ops(mask):
    """Reverse over reverse inside torch.func (grad of grad, jacrev of jacrev), where no
    autograd Function can stand in for the fused kernels: auto leaves them, and a named
    fused backend says why."""
    g = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(1, 2, 5, 4, dtype=torch.float64, generator=g) for _ in range(3))
    m = {"none": None, "causal": M.causal()}[mask]
    allowed = torch.ones(5, 5, dtype=torch.bool) if m is None else m.materialize(5, 5)

    def twice(f):
        inner = torch.func.grad(lambda q: f(q).pow(2).sum())
        return torch.func.grad(lambda q: inner(q).pow(3).sum())(q)
    ours = lambda q: mh.attention(q, k, v, mask=m)                      # noqa: E731
    torch.testing.assert_close(twice(ours), twice(lambda q: _plain(q, k, v, allowed)))
    jac2 = lambda f: torch.func.jacrev(torch.func.jacrev(lambda q: f(q).sum(-1)))(q)  # noqa: E731
    torch.testing.assert_close(jac2(ours), jac2(lambda q: _plain(q, k, v, allowed)))
    with pytest.raises(ValueError, match="backend='sdpa' cannot run this call: it gives no "
                                         "second-order gradients under nested torch.func"):
        twice(lambda q: mh.attention(q, k, v, mask=m, backend="sdpa"))
    assert torch.func.grad(lambda q: mh.attention(q, k, v, backend="sdpa").sum())(q).shape \
        == q.shape                                                     # one level: it runs


def test_torchs_own_sdpa_has_no_double_backward():
    """What the test above guards against: the error torch gives on the same call."""
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64, requires_grad=True)
    g, = torch.autograd.grad(torch.nn.functional.scaled_dot_product_attention(q, q, q)
                             .pow(2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="derivative for .* is not implemented"):
        torch.autograd.grad(g.sum(), q)


@pytest.mark.parametrize("backend", ["sdpa", "blocksparse"])
def test_gradgradcheck_against_numerical_second_derivatives(backend):
    """torch's numerical check of the gradients' own gradients, masked (causal and a
    padding that empties no row), GQA, q, k and v apart."""
    g = torch.Generator().manual_seed(4)
    q = torch.randn(2, 2, 6, 4, dtype=torch.float64, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 1, 6, 4, dtype=torch.float64, generator=g, requires_grad=True)
            for _ in range(2))
    mask = M.causal() & M.padding(torch.tensor([6, 4]))
    f = lambda q, k, v: mh.attention(q, k, v, mask=mask, backend=backend)   # noqa: E731
    assert torch.autograd.gradcheck(f, (q, k, v))
    assert torch.autograd.gradgradcheck(f, (q, k, v))


def test_double_backward_reaches_a_learned_bias_through_sdpa():
    g = torch.Generator().manual_seed(5)
    q = torch.randn(1, 2, 12, 8, dtype=torch.float64, generator=g, requires_grad=True)
    bias = torch.randn(2, 12, 12, dtype=torch.float64, generator=g, requires_grad=True)
    grads = {}
    for backend in ("sdpa", "reference"):
        out = mh.attention(q, q, q, mask=M.bias(bias) & M.causal(), backend=backend)
        gq, gb = torch.autograd.grad(out.pow(2).sum(), (q, bias), create_graph=True)
        grads[backend] = (gq, gb, *torch.autograd.grad(gq.pow(2).sum() + gb.pow(3).sum(),
                                                       (q, bias)))
    for a, b in zip(grads["sdpa"], grads["reference"]):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_our_tiled_backend_differentiates_again_in_its_own_backward():
    """blocksparse's autograd Function gives the reference's gradients itself when the
    backward builds a graph: its outputs carry no second node (host time per call), and a
    mask written after the forward is refused there too."""
    q = torch.randn(1, 2, 64, 8, dtype=torch.float64, requires_grad=True)
    window = M.sliding_window(8)
    out = mh.attention(q, q, q, mask=window, backend="blocksparse")
    assert out.grad_fn.name() == "_BlockSparseAttentionBackward"
    g, = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    want, = torch.autograd.grad(mh.attention(q, q, q, mask=window, backend="reference")
                                .pow(2).sum(), q, create_graph=True)
    torch.testing.assert_close(torch.autograd.grad(g.pow(2).sum(), q),
                               torch.autograd.grad(want.pow(2).sum(), q), atol=1e-10, rtol=0)
    keep = torch.ones(64, 64, dtype=torch.bool)
    out = mh.attention(q, q, q, mask=M.dense(keep) & window, backend="blocksparse")
    keep[5, 3] = False
    with pytest.raises(RuntimeError, match="written in place"):
        torch.autograd.grad(out.sum(), q, create_graph=True)


@pytest.mark.parametrize("backend", ["blocksparse", "reference"])
def test_second_order_when_the_lse_depends_on_nothing_that_takes_a_gradient(backend):
    """Only v takes a gradient, and the loss uses the lse (which depends on q and k only):
    the lse's part of the graph-building backward is nothing, not an error."""
    g = torch.Generator().manual_seed(9)
    q, k = (torch.randn(1, 2, 96, 8, dtype=torch.float64, generator=g) for _ in range(2))
    v = torch.randn(1, 2, 96, 8, dtype=torch.float64, generator=g, requires_grad=True)
    out, lse = mh.attention(q, k, v, mask=M.sliding_window(16), backend=backend,
                            return_lse=True)
    gv, = torch.autograd.grad(out.pow(2).sum() + lse.sum(), v, create_graph=True)
    want, = torch.autograd.grad(mh.attention(q, k, v, mask=M.sliding_window(16),
                                             backend="reference").pow(2).sum(), v,
                                create_graph=True)
    torch.testing.assert_close(gv, want)
    torch.testing.assert_close(*(torch.autograd.grad(t.pow(2).sum(), v)[0] for t in (gv, want)))


@pytest.mark.parametrize("backend", ["sdpa", "blocksparse"])
def test_a_plain_backward_frees_q_k_v_while_the_output_lives_on(backend):
    """As torch's own nodes do (activation checkpointing relies on it): neither the
    backend's Function nor the second-order node keeps the call's inputs once its backward
    has run."""
    import gc
    import weakref
    x = torch.randn(1, 2, 64, 16, requires_grad=True)
    q, k, v = x * 1, x * 2, x * 3
    refs = [weakref.ref(t) for t in (q, k, v)]
    out = mh.attention(q, k, v, mask=M.sliding_window(8), backend=backend)
    del q, k, v
    out.sum().backward()
    gc.collect()
    assert [r() for r in refs] == [None] * 3 and out.shape == (1, 2, 64, 16)


def test_a_plain_backward_still_runs_the_backends_own_kernels(monkeypatch):
    """The second-order path costs O(Sq * Sk): a backward that builds no graph must not
    take it (it would be slower, and on a GPU much larger)."""
    from multihead import _second_order
    def refuse(*args):
        raise AssertionError("the reference gradients ran in a plain backward")
    monkeypatch.setattr(_second_order, "reference_gradients", refuse)
    q = torch.randn(1, 2, 64, 8, requires_grad=True)
    for backend in ("sdpa", "blocksparse"):
        mh.attention(q, q, q, mask=M.causal(), backend=backend).sum().backward()
    with pytest.raises(AssertionError, match="plain backward"):     # (the patch is live)
        out = mh.attention(q, q, q, backend="sdpa")
        torch.autograd.grad(out.sum(), q, create_graph=True)


def test_dropout_keeps_the_kernels_gradients_under_a_backward_that_builds_a_graph():
    """The fused kernel's dropout cannot be replayed: its gradients serve a backward that
    builds a graph but does not differentiate them (a hessian-vector product of the layers
    after attention); reference differentiates its own."""
    torch.manual_seed(0)
    attn = mh.MultiHeadAttention(16, 4, dropout=0.1).train()
    head = torch.nn.Linear(16, 1)
    x = torch.randn(2, 6, 16)
    assert mh.explain(torch.randn(2, 4, 6, 4, requires_grad=True), *[torch.randn(2, 4, 6, 4)] * 2,
                      mask=M.causal(), dropout_p=0.1).chosen == "sdpa"
    loss = head(attn(x, mask=M.causal())).pow(2).mean()
    loss.backward(create_graph=True)                     # (through attention's backward)
    assert attn.in_proj_weight.grad is not None
    hvp, = torch.autograd.grad(head.weight.grad.pow(2).sum(), head.weight)
    assert torch.isfinite(hvp).all()
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    out = mh.attention(q, q, q, dropout_p=0.1, backend="reference")
    g, = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    assert g.requires_grad                                         # the way to differentiate


@pytest.mark.parametrize("needs", ["q", "kv", "bias"])
def test_second_order_with_some_inputs_frozen(needs):
    """Frozen keys and values (a cross-attention over a fixed memory), or a learned bias
    over frozen q, k, v: gradients only for what requires them, at both orders."""
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 2, 7, 4, dtype=torch.float64, generator=g) for _ in range(3))
    bias = torch.randn(2, 7, 7, dtype=torch.float64, generator=g)
    wrt = {"q": (q,), "kv": (k, v), "bias": (bias,)}[needs]
    for t in wrt:
        t.requires_grad_()
    grads = {}
    for backend in ("sdpa", "reference"):
        out = mh.attention(q, k, v, mask=M.bias(bias), backend=backend)
        first = torch.autograd.grad(out.pow(2).sum(), wrt, create_graph=True)
        grads[backend] = (*first, *torch.autograd.grad(sum(x.pow(2).sum() for x in first), wrt))
    for a, b in zip(grads["sdpa"], grads["reference"]):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_a_mask_written_after_the_forward_is_refused_by_a_second_order_backward():
    q = torch.randn(1, 2, 8, 4, dtype=torch.float64, requires_grad=True)
    allowed = torch.ones(8, 8, dtype=torch.bool).tril()
    out = mh.attention(q, q, q, mask=M.dense(allowed), backend="sdpa")
    allowed[5, 0] = False                              # another mask than the forward's
    with pytest.raises(RuntimeError, match="written in place"):
        torch.autograd.grad(out.sum(), q, create_graph=True)


def test_writing_into_the_output_in_place_is_caught_as_on_torchs_own_output():
    """The second-order node's output shares memory and version counter with the
    kernel's: a write in place is still caught by torch's check of the saved output."""
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    out = mh.attention(q, q, q, backend="sdpa")
    out.mul_(2)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


@pytest.mark.parametrize("S,mask,chosen", [(1024, M.sliding_window(64), "blocksparse"),
                                            (48, None, "sdpa")], ids=["window", "none"])
def test_a_gradient_penalty_through_the_module(S, mask, chosen):
    """WGAN-GP's penalty: the input gradient's norm, differentiated for the weights."""
    torch.manual_seed(0)
    m = mh.MultiHeadAttention(32, 4, num_kv_heads=2).double()
    x = torch.randn(1, S, 32, dtype=torch.float64, requires_grad=True)
    t = torch.randn(1, 4, S, 8, dtype=torch.float64, requires_grad=True)
    assert mh.explain(t, t, t, mask=mask).chosen == chosen
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

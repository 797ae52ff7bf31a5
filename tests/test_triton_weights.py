"""The Triton weights kernel (``return_weights=True`` on a GPU; ``torch.nn.MultiheadAttention``'s
default ``need_weights=True`` through the drop-in) against the fp64 oracle, under Triton's
interpreter on the CPU (compiled on a GPU): every mask kind and composition, GQA/MQA,
``Sq != Sk``, empty rows, non-finite inputs, huge biases, per head and their head mean
(``return_weights="mean"``); its gradients (and their gradients) against the reference's;
``multihead.attention`` through the backend; the plan that prices it; on a GPU, the backend
and the drop-in against torch's module in bfloat16."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

import multihead as mh
from conftest import MASK_NAMES, make_masks

triton = pytest.importorskip("triton")
from multihead.functional._call import make_call  # noqa: E402
from multihead.functional.backend import triton as tb  # noqa: E402
from multihead.functional.backend._weights import kernel_weights  # noqa: E402
from multihead.kernels.weights import attention_weights  # noqa: E402

M = mh.masks
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [  # B, H, Hkv, Sq, Sk, D
    (2, 4, 2, 40, 48, 16),         # GQA, Sq < Sk
    (2, 2, 1, 45, 30, 32),         # MQA, Sq > Sk: early rows of a lower-right band see nothing
]
TILES = (16, 16, 4, 1)             # many blocks: FULL, PARTIAL and EMPTY ones


def _inputs(B, H, Hkv, Sq, Sk, D, seed=0, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEV, dtype)  # noqa: E731
    return mk(B, H, Sq, D), mk(B, Hkv, Sk, D)


def _oracle_weights(q, k, m, dtype=torch.float64, average=False, factor=None):
    """The reference's weights in ``dtype``, times ``factor`` (``(B, H, Sq, Sk)``, say a
    dropout's kept pairs scaled) where given (``average``: their mean over the heads, taken
    here in ``dtype``, not by the call)."""
    if isinstance(m, M.Bias) and dtype == torch.float64:
        m = M.bias(m.raw.double())
    q, k = q.to(dtype), k.to(dtype)
    w = mh.attention(q, k, k, mask=m, backend="reference", return_weights=True)[1]
    if factor is not None:
        w = w * factor.to(dtype)
    return w.mean(dim=1) if average else w


def _assert_matches_oracle(w, q, k, m, average=False):
    """Within the error rule: twice an fp32 reference's error once rounded to the inputs'
    dtype, plus 2 ulp; NaN exactly where the oracle's are; rows with nothing to attend to
    exactly zero."""
    ref = _oracle_weights(q, k, m, average=average)
    plain = _oracle_weights(q, k, m, torch.float32, average).to(q.dtype)
    assert w.shape == ref.shape and w.dtype == q.dtype
    assert torch.equal(w.isnan(), ref.isnan())
    fin = ~ref.isnan()
    err = (w.double() - ref)[fin].abs().max()
    base = (plain.double() - ref)[fin].abs().max()
    assert err <= 2 * base + 2 * torch.finfo(q.dtype).eps, (err, base)
    empty = (ref == 0).all(dim=-1)
    assert (w[empty] == 0).all()


@pytest.mark.parametrize("average", [False, True], ids=["heads", "mean"])
@pytest.mark.parametrize("config", [None, TILES], ids=["default", "tiles16"])
@pytest.mark.parametrize("shape", SHAPES, ids=["GQA", "MQA"])
@pytest.mark.parametrize("name", MASK_NAMES)
def test_weights_equal_the_fp64_oracle_for_every_mask(name, shape, config, average):
    B, H, Hkv, Sq, Sk, D = shape
    q, k = _inputs(B, H, Hkv, Sq, Sk, D)
    m = make_masks(B, H, Sq, Sk)[name]
    m = m.to(DEV) if m is not None else None
    w = attention_weights(q, k, m, scale=D ** -0.5, average=average, config=config)
    _assert_matches_oracle(w, q, k, m, average)


def test_the_head_mean_of_a_mask_that_differs_by_head():
    """A dense mask of its own per head (block lists per head: the mean's kernel evaluates
    the mask on every block) with a key block hidden from every head, a row one head sees
    nothing in and a row no head sees anything in."""
    B, H, Hkv, Sq, Sk, D = 2, 4, 2, 40, 70, 16
    q, k = _inputs(B, H, Hkv, Sq, Sk, D, seed=7)
    allowed = torch.rand(1, H, Sq, Sk, generator=torch.Generator().manual_seed(1)) > 0.4
    allowed[..., 16:32] = False                # an EMPTY block (of 16) for every head
    allowed[0, 1, 5] = False                   # row 5 sees nothing in head 1
    allowed[0, :, 9] = False                   # row 9 sees nothing in any head
    m = M.dense(allowed).to(DEV)
    w = attention_weights(q, k, m, scale=0.25, average=True, config=TILES)
    _assert_matches_oracle(w, q, k, m, average=True)
    assert (w[:, 9] == 0).all() and (w[..., 16:32] == 0).all()


def _nonfinite_cases(B, H, Sq, Sk):
    k_nan, k_inf, q_nan = (torch.zeros(B, H, n, 16) for n in (Sk, Sk, Sq))
    k_nan[0, 0, Sk - 2] = float("nan")         # a padded key: hidden from every row
    k_inf[1, 1, 4] = float("inf")              # seen by every row of a lower-right band
    q_nan[0, 1, 2] = float("nan")              # one query row
    huge = torch.zeros(B, 1, Sq, Sk)
    huge[0, :, 3] = -1e30                      # a row of huge biases: its lse loses log(sum)
    huge[1, :, :, 5:] = float("-inf")
    huge[0, :, 5] = float("-inf")              # a row with nothing to attend to
    return {"NaN in a hidden key": (0, k_nan, 0, M.padding([Sk - 3, Sk])),
            "NaN in a visible key": (0, k_nan, 0, None),
            "inf in a visible key": (0, k_inf, 0, M.causal()),
            "NaN in a query": (q_nan, 0, 0, M.causal()),
            # (its query block has EMPTY key blocks: NaN there too)
            "NaN in a query, upper-left": (q_nan, 0, 0, M.causal(align="upper_left")),
            "huge and -inf biases": (0, 0, 0, M.bias(huge)),
            "finfo.min bias": (0, 0, 0, M.bias(torch.full((1, 1, Sq, Sk), -3.4e38)))}


@pytest.mark.parametrize("case", list(_nonfinite_cases(2, 2, 20, 37)))
def test_non_finite_inputs_and_huge_biases_give_the_references_weights(case):
    """A row that sees a NaN or inf is NaN at every key (hidden ones too), as torch's and the
    reference's softmax; a hidden NaN reaches no row; a row of ``-1e30`` biases still sums
    to one (its statistics come from the scores, not from an lse that lost its sum)."""
    q, k = _inputs(2, 2, 2, 20, 37, 16, seed=3)
    dq, dk, _, m = _nonfinite_cases(2, 2, 20, 37)[case]
    q, k = q + torch.as_tensor(dq).to(q), k + torch.as_tensor(dk).to(k)
    m = m.to(DEV) if m is not None else None
    w = attention_weights(q, k, m, scale=0.25, config=TILES)
    ref = mh.attention(q, k, k, mask=m, scale=0.25, backend="reference", return_weights=True)[1]
    # the head mean: NaN across a row NaN in any head, finite rows the heads' mean
    mean = attention_weights(q, k, m, scale=0.25, average=True, config=TILES)
    assert torch.equal(mean.isnan(), ref.isnan().any(1))
    torch.testing.assert_close(mean.nan_to_num(), ref.float().mean(1).nan_to_num().half(),
                               atol=2e-3, rtol=0)
    assert torch.equal(w.isnan(), ref.isnan())
    torch.testing.assert_close(w.nan_to_num(), ref.nan_to_num(), atol=2e-3, rtol=0)
    live = ~ref.isnan().any(-1) & (ref != 0).any(-1)
    torch.testing.assert_close(w[live].float().sum(-1), torch.ones(int(live.sum())),
                               atol=1e-2, rtol=0)


def test_empty_shapes_and_bad_arguments():
    q, k = _inputs(1, 2, 2, 0, 5, 16)
    assert attention_weights(q, k, None, scale=0.25).shape == (1, 2, 0, 5)
    assert attention_weights(q, k, None, scale=0.25, average=True).shape == (1, 0, 5)
    q, k = _inputs(1, 2, 2, 4, 0, 16)
    assert attention_weights(q, k, None, scale=0.25).shape == (1, 2, 4, 0)
    q, k = _inputs(1, 2, 2, 4, 5, 16)
    with pytest.raises(TypeError, match="average must be True or False, got 'mean'"):
        attention_weights(q, k, None, scale=0.25, average="mean")
    with pytest.raises(ValueError, match="attention_weights.*scale"):
        attention_weights(q, k, None, scale=float("nan"))
    with pytest.raises(ValueError, match="attention_weights"):
        attention_weights(q, k, M.padding([1, 2, 3]).to(DEV), scale=0.25)


def _call(q, k, m, weights=True):
    return make_call(q, k, k, mask=m, scale=None, dropout_p=0.0, return_weights=weights,
                     return_lse=False)


@pytest.mark.parametrize("weights", [True, "mean"], ids=["heads", "mean"])
@pytest.mark.parametrize("name", ["none", "causal&padding", "bias", "window&document"])
def test_gradients_through_the_weights_equal_the_references(name, weights):
    """A loss of the weights (or of their head mean): dQ and dK (summed over each GQA
    group) are the reference's, and so are their own gradients (a backward that builds a
    graph)."""
    B, H, Hkv, Sq, Sk, D = SHAPES[0]
    q0, k0 = _inputs(B, H, Hkv, Sq, Sk, D, seed=5)
    m = make_masks(B, H, Sq, Sk)[name]
    m = m.to(DEV) if m is not None else None
    g = torch.Generator().manual_seed(9)
    dw = torch.randn(B, *(() if weights == "mean" else (H,)), Sq, Sk, generator=g).to(DEV)

    def grads(fn):
        q, k = (t.detach().clone().requires_grad_() for t in (q0, k0))
        w = fn(q, k)
        dq, dk = torch.autograd.grad((w.float() * dw).sum(), (q, k), create_graph=True)
        again = torch.autograd.grad((dq.float() ** 2).sum() + (dk.float() ** 2).sum(), (q, k))
        return dq, dk, *again

    ours = grads(lambda q, k: kernel_weights(_call(q, k, m, weights)))
    ref = grads(lambda q, k: mh.attention(q, k, k, mask=m, backend="reference",
                                          return_weights=weights)[1])
    for name_, a, r in zip(("dq", "dk", "d(dq)", "d(dk)"), ours, ref):
        assert a.dtype == r.dtype and torch.isfinite(a).all(), name_
        torch.testing.assert_close(a, r, atol=2e-3, rtol=2e-3, msg=name_)


@pytest.mark.parametrize("wanted", ["both", "q", "k"])
def test_a_gradient_is_counted_once_where_q_is_k_or_only_one_takes_it(wanted):
    """Self-attention as ``mh.attention(x, x, x)`` passes one tensor as q and k: its
    gradient is the sum of both roles, once (not twice); an input that takes no gradient
    gets none."""
    x0, y0 = _inputs(2, 3, 3, 17, 17, 16, seed=11)
    dw = torch.randn(2, 3, 17, 17, generator=torch.Generator().manual_seed(4)).to(DEV)

    def grads(fn):
        x = x0.clone().requires_grad_()
        q, k = {"both": (x, x), "q": (x, y0), "k": (y0, x)}[wanted]
        return torch.autograd.grad((fn(q, k).float() * dw).sum(), x)[0]

    m = M.causal()
    ours = grads(lambda q, k: kernel_weights(_call(q, k, m)))
    ref = grads(lambda q, k: mh.attention(q, k, k, mask=m, backend="reference",
                                          return_weights=True)[1])
    torch.testing.assert_close(ours, ref, atol=2e-3, rtol=2e-3)


def test_weights_need_no_gradient_where_the_inputs_take_none():
    q, k = _inputs(*SHAPES[0])
    v = k.clone().requires_grad_()                 # gradients for v only: weights need none
    call = make_call(q, k, v, mask=None, scale=None, dropout_p=0.0, return_weights=True,
                     return_lse=False)
    assert kernel_weights(call).grad_fn is None


@pytest.mark.parametrize("name", ["none", "causal&padding", "bias", "alibi", "dense_per_head"])
def test_attention_returns_the_head_mean_through_the_backend(name, triton_on_this_device):
    """``mh.attention(..., backend="triton", return_weights="mean")``: the kernel's head mean
    (no second mean over it), the reference's output and mean; a query row that is NaN in
    one head is NaN across the mean (the NaN rule's second run on a host tensor)."""
    B, H, Hkv, Sq, Sk, D = SHAPES[0]
    q, k = _inputs(B, H, Hkv, Sq, Sk, D, seed=8)
    v = k.flip(-1).contiguous()
    masks = make_masks(B, H, Sq, Sk)
    masks["dense_per_head"] = M.dense(torch.rand(1, H, Sq, Sk,
                                                 generator=torch.Generator().manual_seed(3)) > 0.5)
    m = masks[name]
    m = m.to(DEV) if m is not None else None
    out, w = mh.attention(q, k, v, mask=m, backend="triton", return_weights="mean")
    assert w.shape == (B, Sq, Sk)
    _assert_matches_oracle(w, q, k, m, average=True)
    ref = mh.attention(q, k, v, mask=m, backend="reference")
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    q[1, 3, 7, 0] = float("nan")
    w = mh.attention(q, k, v, mask=m, backend="triton", return_weights="mean")[1]
    ref = mh.attention(q, k, v, mask=m, backend="reference", return_weights=True)[1]
    assert torch.equal(w.isnan(), ref.isnan().any(1)) and w[1, 7].isnan().all()


def test_auto_prices_the_weights_kernel_on_an_h100():
    """bf16 weights of a large call: the kernel (weights written once in bf16) against the
    reference's fp32 passes over the scores; float32 stays off the Triton kernels."""
    def explain(dtype, mask=None):
        q = torch.empty(8, 16, 2048, 64, dtype=dtype, device="meta")
        return mh.explain(q, q, q, mask=mask, return_weights=True, profile="h100")
    e = explain(torch.bfloat16, M.padding([2000] * 8).to("meta"))
    assert e.chosen == "triton"
    row = next(r for r in e.rows if r.name == "triton")
    assert "weights written once in bfloat16" in row.plan.note
    ref = next(r for r in e.rows if r.name == "reference")
    assert ref.seconds > 5 * row.seconds
    assert explain(torch.bfloat16).chosen == "triton"
    assert explain(torch.float32).chosen != "triton"
    # the head mean: a head's worth of memory, not the weights per head
    q = torch.empty(8, 16, 2048, 64, dtype=torch.bfloat16, device="meta")
    per_head, mean = (next(r for r in mh.explain(q, q, q, return_weights=w, profile="h100").rows
                           if r.name == "triton").plan for w in (True, "mean"))
    assert "the weights' head mean written once" in mean.note
    weights = 8 * 16 * 2048 * 2048 * 2
    assert per_head.work.memory - mean.work.memory >= weights * 15 / 16 - 8 * 16 * 2048 * 8


def test_block_lists_the_forward_did_not_build_are_priced_where_the_call_builds_them():
    """A band mask (its forward needs no lists) kept across calls: one launch more for the
    weights kernel; in a decoding step, the lists' ops at their host time."""
    def launches(sq, mask, weights):
        q = torch.empty(2, 8, sq, 64, dtype=torch.bfloat16, device="meta")
        k = torch.empty(2, 8, 512, 64, dtype=torch.bfloat16, device="meta")
        e = mh.explain(q, k, k, mask=mask, return_weights=weights, profile="h100",
                       backend="triton")
        return e.plan.work.launches
    band = M.sliding_window(64)
    assert launches(256, band, True) == launches(256, band, False) + 1
    step = launches(4, band, True) - launches(4, band, False)
    assert step >= 1 + tb.HOST_OP_LAUNCHES * tb.LIST_OPS


def test_the_backend_refuses_weights_while_tracing():
    q, k = _inputs(*SHAPES[0])
    backend = tb.TritonFlash()
    assert backend.check(_call(q, k, M.causal())) is None
    seen = []
    make_fx(lambda q: seen.append(backend.check(_call(q, k, M.causal()))) or q)(q)
    assert seen and "eager calls only" in seen[0]


# -- on a GPU --------------------------------------------------------------------------------

@pytest.mark.cuda
@pytest.mark.parametrize("name", ["none", "causal", "padding_left_bool", "bias", "alibi",
                                  "window&document"])
def test_the_backend_returns_weights_through_attention_on_cuda(name):
    B, H, Hkv, Sq, Sk, D = 2, 8, 2, 300, 300, 64
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(B, n, Sq, D, generator=g).to("cuda", torch.bfloat16)
               for n in (H, Hkv, Hkv))
    m = make_masks(B, H, Sq, Sk)[name]
    m = m.to("cuda") if m is not None else None
    out, w = mh.attention(q, k, v, mask=m, backend="triton", return_weights=True)
    _assert_matches_oracle(w, q, k, m)
    ref = mh.attention(q, k, v, mask=m, backend="reference")
    torch.testing.assert_close(out, ref, atol=2e-2, rtol=2e-2)
    # a decoding step's size (the split-K kernel for the output)
    step = mh.attention(q[:, :, -3:], k, v, mask=None, backend="triton", return_weights=True)
    _assert_matches_oracle(step[1], q[:, :, -3:], k, None)


@pytest.mark.cuda
def test_gradients_through_weights_from_attention_on_cuda():
    """``mh.attention(x, x, x, return_weights=True)`` on the backend: a loss of the output
    and the weights gives the reference's gradients (x in every role counted once)."""
    g = torch.Generator().manual_seed(6)
    x0 = torch.randn(2, 4, 130, 32, generator=g).to("cuda", torch.bfloat16)
    r = torch.randn(2, 4, 130, 130, generator=g).to("cuda")

    def grad(backend):
        x = x0.clone().requires_grad_()
        out, w = mh.attention(x, x, x, mask=M.causal(), backend=backend, return_weights=True)
        (out.float().square().sum() + (w.float() * r).sum()).backward()
        return x.grad.float()
    ours, ref = grad("triton"), grad("reference")
    assert (ours - ref).norm() / ref.norm() < 0.02


@pytest.mark.cuda
@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_the_drop_in_returns_torchs_weights_in_bf16_on_cuda(train):
    """``need_weights=True`` (torch's default) with a key padding mask, bfloat16: outputs,
    averaged weights and every parameter's gradient close to torch's module."""
    torch.manual_seed(0)
    E, Hn, B, S = 512, 8, 4, 1024             # large enough that auto picks the kernels
    t = torch.nn.MultiheadAttention(E, Hn, batch_first=True).to("cuda", torch.bfloat16)
    ours = mh.nn.MultiheadAttention(E, Hn, batch_first=True).to("cuda", torch.bfloat16)
    ours.load_state_dict(t.state_dict())
    t.train(train), ours.train(train)
    x = torch.randn(B, S, E, device="cuda", dtype=torch.bfloat16)
    kpm = torch.zeros(B, S, dtype=torch.bool, device="cuda")
    kpm[0, 768:] = True
    backend, ran = mh.functional.registry.get("triton"), []
    real = backend.run
    with mock.patch.object(backend, "run", side_effect=lambda c, p: ran.append(
            (c.return_weights, c.average_weights)) or real(c, p)):
        a_out, a_w = ours(x, x, x, key_padding_mask=kpm)
    assert ran == [(True, True)]               # our kernels gave the head mean
    b_out, b_w = t(x, x, x, key_padding_mask=kpm)
    for a, b in ((a_out, b_out), (a_w, b_w)):  # (torch rounds its scores to bf16)
        rel = (a.float() - b.float()).norm() / b.float().norm()
        assert rel < 0.03, rel
    assert (a_w[0, :, 768:] == 0).all()
    if train:                                  # a loss of both: the weights' gradient too
        r = torch.randn(a_w.shape, device="cuda")
        for out, w in ((a_out, a_w), (b_out, b_w)):
            (out.float().square().mean() + (w.float() * r).sum()).backward()
        theirs = dict(t.named_parameters())
        for n, p in ours.named_parameters():
            q = theirs[n]
            rel = (p.grad.float() - q.grad.float()).norm() / q.grad.float().norm()
            assert rel < 0.05, (n, rel)

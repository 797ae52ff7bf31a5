"""Dropout inside our Triton kernels (band masks, key padding, packed documents, and every
other mask through the block-sparse kernels; the weights kernel) against the fp64 oracle:
the reference's weights times the pairs the kernels keep
(:func:`multihead.kernels._dropout.keep_mask`), scaled by ``1 / (1 - rate)``. Without a GPU
the kernels run interpreted on the CPU (fp16, small shapes)."""

from __future__ import annotations

import pytest
import torch

import multihead as mh

triton = pytest.importorskip("triton")
from multihead.kernels import _dropout as drop, ops  # noqa: E402
from multihead.kernels.flash_bwd import flash_backward  # noqa: E402
from multihead.kernels.flash_fwd import flash_forward  # noqa: E402
from multihead.kernels.flash_sparse import sparse_backward, sparse_forward  # noqa: E402
from multihead.kernels.weights import attention_weights  # noqa: E402
from conftest import make_masks  # noqa: E402
from test_triton import _mask as band_mask  # noqa: E402
from test_triton_weights import _oracle_weights  # noqa: E402

M = mh.masks
DEV = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [  # B, H, Hkv, Sq, Sk, D, mask, p
    (1, 2, 2, 40, 40, 16, "none", 0.3),
    (2, 4, 2, 37, 53, 16, "causal", 0.1),                 # offset 16: lower-right
    (2, 4, 1, 53, 37, 32, "causal", 0.5),                 # MQA; early rows see nothing
    (1, 2, 1, 70, 70, 16, "window 9", 0.25),
    (2, 2, 2, 33, 65, 16, "window 9 upper_left", 0.2),
    (2, 4, 2, 20, 40, 16, "padding", 0.3),                # a sequence of length 0
    (2, 2, 2, 96, 96, 32, "window 40 & padding", 0.15),
]
IDS = [f"{c[6]}-{c[3]}x{c[4]}-H{c[1]}kv{c[2]}-p{c[7]}" for c in CASES]


def _mask(name: str, B: int, Sk: int):
    """The band masks of ``tests/test_triton.py`` by name, on the kernels' device."""
    mask = band_mask(name, B, Sk)
    return mask.to(DEV) if mask is not None else None


def _inputs(B, H, Hkv, Sq, Sk, D, seed=0, dtype=torch.float16):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEV, dtype)  # noqa: E731
    return mk(B, H, Sq, D), mk(B, Hkv, Sk, D), mk(B, Hkv, Sk, D)


def _oracle(q, k, v, mask, keep, keep_scale):
    """``(out, lse)`` with dropout: the reference's weights (in q's dtype: fp64 or fp32)
    times ``keep * keep_scale``, then the values (GQA: each K/V head serves its group)."""
    out, w = mh.attention(q, k, v, mask=mask, backend="reference", return_weights=True)
    _, lse = mh.attention(q, k, v, mask=mask, backend="reference", return_lse=True)
    v = v.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return (w * keep.to(w.dtype) * keep_scale) @ v, lse


def _loss(out, lse, with_lse):
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out)
    loss = (out * w).sum()
    return loss + torch.where(torch.isfinite(lse), lse, 0).sum() if with_lse else loss


def _check(got, q, k, v, mask, keep, keep_scale, with_lse=False):
    """``got = (out, lse, dq, dk, dv)`` of the kernels within the error rule: twice the
    error of an fp32 run of the oracle rounded to q's dtype (plus a few ulp), against fp64."""
    runs = []
    for dtype in (torch.float64, torch.float32):
        leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out, lse = _oracle(*leaves, mask, keep, keep_scale)
        _loss(out, lse, with_lse).backward()
        runs.append((out, lse, *(t.grad for t in leaves)))
    ref, plain = runs
    eps = torch.finfo(q.dtype).eps
    for name, a, r, p in zip(("out", "lse", "dq", "dk", "dv"), got, ref, plain):
        if name == "lse":                                # the undropped softmax's
            fin = torch.isfinite(r)
            assert torch.equal(torch.isinf(a), torch.isinf(r))
            torch.testing.assert_close(a[fin].double(), r[fin], atol=1e-4, rtol=1e-4)
            continue
        err = (a.double() - r).abs().max()
        base = (p.to(q.dtype).double() - r).abs().max()
        assert torch.isfinite(a).all(), name
        assert err <= 2 * base + 4 * eps * max(r.abs().max(), 1.0), (name, err, base)


def _band_args(q, k, mask):
    """The kernels' band arguments of ``mask`` (as the triton backend derives them)."""
    from multihead.functional._call import make_call
    from multihead.functional.backend.triton import _band
    call = make_call(q, k, k, mask=mask, scale=None, dropout_p=0.0, return_weights=False,
                     return_lse=False)
    band = _band(call)
    lens = band.padding.lengths.expand(q.shape[0]).contiguous() if band.padding else None
    return dict(causal=band.causal, window=band.window, offset=band.offset, kv_lengths=lens)


@pytest.mark.parametrize("config", [None, ((16, 16, 4, 1), (16, 32, 4, 1))],
                         ids=["default", "tiles16-keys-left"])
@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_forward_and_gradients_with_dropout_equal_the_oracle_with_the_kernels_draws(case,
                                                                                     config):
    """The forward drops the pairs :func:`keep_mask` names and scales the rest by
    ``1 / (1 - rate)``; both backward kernels drop the same pairs whatever their tiles (the
    dK/dV kernel's blocks transposed too, 32 keys per program against 16 queries), so
    every gradient is the oracle's for that draw. The lse is the undropped softmax's."""
    B, H, Hkv, Sq, Sk, D, name, p = case
    q, k, v = _inputs(B, H, Hkv, Sq, Sk, D, seed=1)
    mask = _mask(name, B, Sk)
    kw = dict(scale=D ** -0.5, **_band_args(q, k, mask))
    d = drop.draw(p, q.device)
    fwd_cfg, kv_cfg = (None, None) if config is None else config
    out, lse = flash_forward(q, k, v, config=fwd_cfg, dropout=d, **kw)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out)
    grads = flash_backward(dout, q, k, v, out, lse, dropout=d,
                           config=None if config is None else (kv_cfg, fwd_cfg), **kw)
    keep = drop.keep_mask(d, B, H, Sq, Sk)
    assert 0 < keep.float().mean() < 1
    _check((out, lse, *grads), q, k, v, mask, keep, d.keep_scale)


TILES = (16, 16, 4, 1)                 # FULL, PARTIAL and EMPTY blocks at these sizes
# (the draws do not depend on the mask: these cover what the mask changes around them, FULL
# and PARTIAL blocks, EMPTY ones skipped, rows with nothing to attend to, a bias's rows)
SPARSE_CASES = [(name, TILES, TILES) for name in (
    "document", "dense", "bias", "padding_query", "causal|dense",
    "positions(window&alibi)&padding")] + [
    ("causal&alibi", None, None),                          # the default tiles
    ("causal&alibi", TILES, (16, 32, 4, 1)),               # dK/dV keys-left, transposed lists
    ("document", TILES, (16, 32, 4, 1)),
    ("~dense&alibi", TILES, (16, 32, 4, 1)),
]


@pytest.mark.parametrize("name, tiles, kv_tiles", SPARSE_CASES,
                         ids=[f"{c[0]}-{'default' if c[1] is None else 'tiles16'}"
                              f"{'-keys-left' if c[2] and c[2][1] == 32 else ''}"
                              for c in SPARSE_CASES])
def test_block_list_kernels_with_dropout_equal_the_oracle_with_the_kernels_draws(
        name, tiles, kv_tiles):
    """Every mask kind and composition on the block-sparse kernels (GQA, ``Sq < Sk``, a
    bias's exact rows in dQ): the forward and both backward kernels drop the pairs
    :func:`keep_mask` names at their positions in the sequences, over FULL and PARTIAL
    blocks and the transposed lists of the dK/dV loop, so every output and gradient is the
    oracle's for that draw."""
    B, H, Hkv, Sq, Sk, D = 2, 4, 2, 40, 48, 16
    q, k, v = _inputs(B, H, Hkv, Sq, Sk, D, seed=2)
    mask = make_masks(B, H, Sq, Sk)[name].to(DEV)
    d = drop.draw(0.3, q.device)
    out, lse = sparse_forward(q, k, v, mask, scale=D ** -0.5, config=tiles, dropout=d)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out)
    grads = sparse_backward(dout, q, k, v, out, lse, mask, scale=D ** -0.5, dropout=d,
                            config=None if tiles is None else (kv_tiles, tiles))
    keep = drop.keep_mask(d, B, H, Sq, Sk)
    _check((out, lse, *grads), q, k, v, mask, keep, d.keep_scale)


def test_packed_documents_draw_per_document_and_train_as_the_oracle():
    """Packed documents (one program per document and block): a document's rows and keys
    are counted from its first token, its stream from that token; the oracle's keep mask
    is assembled from each document's own."""
    B, H, S, D = 2, 2, 48, 16
    q, k, v = _inputs(B, H, H, S, S, D, seed=3)
    ids = torch.tensor([[0] * 13 + [1] * 30 + [2] * 5, [0] * 40 + [1] * 8])
    docs = torch.tensor([[b, f, n] for b, row in enumerate(ids.tolist())
                         for f, n in _runs(row)])
    d = drop.draw(0.3, q.device)
    out, lse = flash_forward(q, q, q, scale=0.25, causal=True, documents=docs, dropout=d)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    got, glse = ops.attention(*leaves, 0.25, True, 0, 0, None, docs, None, 0.3, d.seed)
    _loss(got, glse, True).backward()
    torch.testing.assert_close(out, flash_forward(q, q, q, scale=0.25, causal=True,
                                                  documents=docs, dropout=d)[0])
    keep = torch.zeros(B, H, S, S, dtype=torch.bool, device=DEV)
    for b, f, n in docs.tolist():
        keep[b, :, f:f + n, f:f + n] = drop.keep_mask(d, B, H, n, n, first=f)[b]
    mask = (M.document(ids) & M.causal()).to(DEV)
    _check((got, glse, *(t.grad for t in leaves)), q, k, v, mask, keep, d.keep_scale, True)


def _runs(row):
    """``(first, length)`` of each run of equal ids in ``row``."""
    out, first = [], 0
    for i in range(1, len(row) + 1):
        if i == len(row) or row[i] != row[first]:
            out.append((first, i - first))
            first = i
    return out


def test_the_draws_are_a_function_of_seed_stream_and_pair_at_the_asked_rate():
    """The same seed keeps the same pairs in any tiling; another seed, head, sequence or
    document start keeps others (agreement near p² + (1-p)², as for independent draws);
    the kept share is ``1 - round(p * 65536) / 65536`` within four standard deviations."""
    torch.manual_seed(0)
    p = 0.3
    d = drop.draw(p, torch.device(DEV))
    keep = drop.keep_mask(d, 2, 2, 128, 128)
    assert torch.equal(keep, drop.keep_mask(d, 2, 2, 128, 128))
    n = keep.numel()
    rate = 1 - drop.drop_threshold(p) / drop.LEVELS
    assert abs(keep.float().mean().item() - rate) < 4 * (rate * (1 - rate) / n) ** 0.5
    independent = p * p + (1 - p) * (1 - p)
    others = [keep[0, 1], keep[1, 0], drop.keep_mask(d, 2, 2, 128, 128, first=8)[0, 0],
              drop.keep_mask(drop.draw(p, torch.device(DEV)), 2, 2, 128, 128)[0, 0],
              keep[0, 0, 1:].t()[:, 1:].t()]                # (rows shifted by one)
    for other in others:
        agree = (keep[0, 0, :other.shape[0], :other.shape[1]] == other).float().mean()
        assert abs(agree.item() - independent) < 0.03, agree
    torch.manual_seed(0)
    assert torch.equal(drop.draw(p, torch.device(DEV)).seed, d.seed)     # torch's generator


def test_a_rate_of_one_drops_everything_without_nan():
    """``p = 1``: every pair dropped, the output and every gradient zeros (no ``0 * inf``),
    the lse still the softmax's."""
    q, k, v = _inputs(1, 2, 2, 24, 24, 16, seed=4)
    d = drop.draw(1.0, q.device)
    assert d.keep_scale == 0.0
    out, lse = flash_forward(q, k, v, scale=0.25, causal=True, dropout=d)
    assert (out == 0).all() and torch.isfinite(lse).all()
    grads = flash_backward(torch.ones_like(out), q, k, v, out, lse, scale=0.25, causal=True,
                           dropout=d)
    assert all((g == 0).all() for g in grads)


@pytest.mark.parametrize("bad, match", [
    (dict(p=0.0), r"dropout.p must be a float in \(0, 1\], got 0.0"),
    (dict(p=1.5), r"dropout.p must be a float in \(0, 1\], got 1.5"),
    (dict(seed=torch.zeros(2, dtype=torch.int64)), r"dropout.seed must be one int64"),
    (dict(seed=torch.zeros(1)), r"dropout.seed must be one int64 .* got \(1,\) torch.float32"),
])
def test_the_kernels_refuse_a_bad_dropout_by_name(bad, match):
    q, k, v = _inputs(1, 2, 2, 16, 16, 16)
    d = drop.Dropout(bad.get("p", 0.1), bad.get("seed", torch.zeros(1, dtype=torch.int64,
                                                                     device=DEV)))
    with pytest.raises(ValueError, match="flash_forward: " + match):
        flash_forward(q, k, v, scale=0.25, dropout=d)


def test_attention_with_dropout_on_the_backend_draws_from_torchs_generator(triton_on_this_device):
    """``mh.attention(dropout_p=...)`` on the triton backend: the seed comes from torch's
    generator (``torch.manual_seed`` repeats a call, another seed changes it), and the call
    trains as the oracle with the kernels' draws; a decoding step's size with dropout runs
    the attention kernel (the decode kernel has none)."""
    q, k, v = _inputs(2, 4, 2, 1, 40, 16, seed=5)
    mask = (M.sliding_window(9) & M.padding(torch.tensor([40, 22]))).to(DEV)
    plan = mh.explain(q, k, v, mask=mask, dropout_p=0.2, backend="triton")
    assert "dropout drawn in the kernels" in str(plan) and "split-K" not in str(plan)
    q, k, v = _inputs(2, 4, 2, 30, 40, 16, seed=5)
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(11)
    out = mh.attention(*leaves, mask=mask, dropout_p=0.2, backend="triton")
    _loss(out, out.new_zeros(1), False).backward()
    torch.manual_seed(11)
    again = mh.attention(q, k, v, mask=mask, dropout_p=0.2, backend="triton")
    other = mh.attention(q, k, v, mask=mask, dropout_p=0.2, backend="triton")
    assert torch.equal(out.detach(), again) and not torch.equal(again, other)
    torch.manual_seed(11)
    d = drop.draw(0.2, q.device)
    keep = drop.keep_mask(d, 2, 4, 30, 40)
    lse = mh.attention(q, k, v, mask=mask, backend="reference", return_lse=True)[1]
    _check((out.detach(), lse, *(t.grad for t in leaves)), q, k, v, mask, keep,
           d.keep_scale)


def _dropped_weights(q, k, mask, keep, keep_scale, dtype, average=False):
    """The reference's weights in ``dtype`` times ``keep * keep_scale`` (``average``: their
    head mean)."""
    return _oracle_weights(q, k, mask, dtype, average, factor=keep.double() * keep_scale)


@pytest.mark.parametrize("average", [False, True], ids=["heads", "mean"])
@pytest.mark.parametrize("name", ["none", "causal", "causal&alibi", "dense", "padding_query"])
def test_the_weights_kernel_drops_the_pairs_the_attention_kernels_drop(name, average):
    """The weights per head and their head mean, with the attention kernels' draws (kept
    weights scaled by ``1 / (1 - rate)``, dropped ones 0), as torch's module returns them in
    training: no mask, a band, a bias's block lists, a mask whose lists differ by head (the
    mean evaluates every block), rows with nothing to attend to (zeros)."""
    B, H, Hkv, Sq, Sk, D = 2, 4, 2, 40, 48, 16
    q, k, _ = _inputs(B, H, Hkv, Sq, Sk, D, seed=13)
    mask = make_masks(B, H, Sq, Sk).get(name)
    mask = mask.to(DEV) if mask is not None else None
    d = drop.draw(0.3, q.device)
    w = attention_weights(q, k, mask, scale=D ** -0.5, average=average, config=TILES,
                          dropout=d)
    keep = drop.keep_mask(d, B, H, Sq, Sk)
    ref = _dropped_weights(q, k, mask, keep, d.keep_scale, torch.float64, average)
    plain = _dropped_weights(q, k, mask, keep, d.keep_scale, torch.float32, average)
    err = (w.double() - ref).abs().max()
    base = (plain.to(q.dtype).double() - ref).abs().max()
    assert w.shape == ref.shape and err <= 2 * base + 2 * torch.finfo(q.dtype).eps, (err, base)
    if not average:                                # every dropped pair exactly 0
        assert (w[~keep] == 0).all() and ((w == 0) & (ref != 0)).sum() == 0


@pytest.mark.parametrize("name", ["window & padding", "alibi & causal", "packed documents"])
def test_the_weights_with_dropout_are_those_the_output_was_made_of(name,
                                                                  triton_on_this_device):
    """``mh.attention(dropout_p=..., return_weights=True)`` on the triton backend: the output
    is the returned weights times the values (one draw for both kernels), their head mean
    is the weights' (the same seed under the same generator state), and the weights' own
    gradient is the reference's times the draws. Packed documents (which the band kernels
    would draw per document) go through the block lists."""
    B, H, Hkv, S, D = 2, 4, 2, 40, 16
    q, k, v = _inputs(B, H, Hkv, S, S, D, seed=14)
    mask = {"window & padding": M.sliding_window(9) & M.padding(torch.tensor([40, 23])),
            "alibi & causal": M.alibi(H) & M.causal(),
            "packed documents": M.document(torch.arange(S) // 11)}[name].to(DEV)
    plan = str(mh.explain(q, k, v, mask=mask, dropout_p=0.25, return_weights=True,
                          backend="triton"))
    assert "dropout drawn in the kernels" in plan and "weights kernel" in plan
    assert ("block lists" in plan) == (name != "window & padding")
    assert ("packed documents through block lists" in plan) == (name == "packed documents")
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(4)
    out, w = mh.attention(*leaves, mask=mask, dropout_p=0.25, return_weights=True,
                          backend="triton")
    made = w.double() @ v.double().repeat_interleave(H // Hkv, dim=1)
    torch.testing.assert_close(out.double(), made, atol=4e-3, rtol=4e-3)
    torch.manual_seed(4)
    _, mean = mh.attention(q, k, v, mask=mask, dropout_p=0.25, return_weights="mean",
                           backend="triton")
    torch.testing.assert_close(mean.float(), w.detach().float().mean(dim=1), atol=1e-3,
                               rtol=1e-3)
    r = torch.randn(w.shape, generator=torch.Generator().manual_seed(15)).to(DEV)
    (w.float() * r).sum().backward()
    torch.manual_seed(4)
    d = drop.draw(0.25, q.device)
    keep = drop.keep_mask(d, B, H, S, S)
    for dtype in (torch.float64, torch.float32):
        qk = [t.detach().to(dtype).requires_grad_() for t in (q, k)]
        (_dropped_weights(*qk, mask, keep, d.keep_scale, dtype) * r.to(dtype)).sum().backward()
        if dtype == torch.float64:
            ref = [t.grad for t in qk]
        else:
            base = [(t.grad.to(q.dtype).double() - g).abs().max() for t, g in zip(qk, ref)]
    for leaf, g, b in zip(leaves, ref, base):
        err = (leaf.grad.double() - g).abs().max()
        assert err <= 2 * b + 4 * torch.finfo(q.dtype).eps * g.abs().max(), (err, b)


def test_a_block_list_mask_with_dropout_runs_the_sparse_kernels_from_torchs_generator(
        triton_on_this_device):
    """``mh.attention(dropout_p=...)`` with ALiBi & padding rows (block lists): the plan
    says so, ``torch.manual_seed`` repeats the call, and it trains as the oracle with the
    kernels' draws."""
    q, k, v = _inputs(2, 4, 2, 30, 40, 16, seed=12)
    mask = (M.alibi(4) & M.padding(torch.arange(40) < torch.tensor([[40], [17]]))).to(DEV)
    plan = str(mh.explain(q, k, v, mask=mask, dropout_p=0.2, backend="triton"))
    assert "block lists" in plan and "dropout drawn in the kernels" in plan
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    torch.manual_seed(5)
    out = mh.attention(*leaves, mask=mask, dropout_p=0.2, backend="triton")
    _loss(out, out.new_zeros(1), False).backward()
    torch.manual_seed(5)
    assert torch.equal(out.detach(), mh.attention(q, k, v, mask=mask, dropout_p=0.2,
                                                  backend="triton"))
    torch.manual_seed(5)
    d = drop.draw(0.2, q.device)
    lse = mh.attention(q, k, v, mask=mask, backend="reference", return_lse=True)[1]
    _check((out.detach(), lse, *(t.grad for t in leaves)), q, k, v, mask,
           drop.keep_mask(d, 2, 4, 30, 40), d.keep_scale)


def test_auto_runs_a_training_window_with_dropout_on_the_kernels_on_an_h100():
    """The cost model on an H100 (meta tensors): a 256-key window over 16k tokens with
    dropout runs our kernels (SDPA would materialize the mask and compute every pair);
    causal training with dropout keeps SDPA's fused kernel."""
    q = torch.empty(1, 16, 16384, 128, dtype=torch.bfloat16, device="meta",
                    requires_grad=True)
    plan = mh.explain(q, q, q, mask=M.sliding_window(256), dropout_p=0.1, profile="h100")
    assert plan.chosen == "triton"
    plan = mh.explain(q[:, :, :4096], q[:, :, :4096], q[:, :, :4096], mask=M.causal(),
                      dropout_p=0.1, profile="h100")
    assert plan.chosen == "sdpa"


def test_the_operators_with_dropout_pass_torch_library_opcheck():
    """Schema, fake and autograd registration of ``multihead::flash_attention`` and
    ``multihead::flash_sparse`` with their dropout arguments agree with the kernels (the
    seed fixes the draws between runs)."""
    from multihead.kernels.flash_sparse import KERNELS, flatten, plan
    q, k, v = (t.requires_grad_() for t in _inputs(1, 4, 2, 24, 40, 16, seed=6))
    seed = drop.draw(0.2, q.device).seed
    lens = torch.tensor([30], device=DEV)
    torch.library.opcheck(ops.flash_attention, (q, k, v, 0.25, True, 8, 16, lens, None, 0.2,
                                                seed))
    mask = (M.alibi(4) & M.causal()).to(DEV)
    args = flatten(*plan(mask, q, k, v, kernels=tuple(KERNELS)), 24, 40)
    torch.library.opcheck(ops.flash_sparse, (q, k, v, 0.25, *args, 0.2, seed))


def test_every_kernel_and_operator_refuses_a_bad_dropout_by_name_even_with_nothing_to_do():
    """The kernels' wrappers name themselves and ``dropout``, also for empty inputs (no
    launch); the operators name ``dropout_p``."""
    from multihead.kernels.flash_sparse import KERNELS, flatten, plan
    bad = drop.Dropout(2.0, torch.zeros(1, dtype=torch.int64, device=DEV))
    q, k, v = _inputs(1, 2, 2, 16, 16, 16)
    for n in (16, 0):
        e = q[:, :, :n]
        with pytest.raises(ValueError, match=r"attention_weights: dropout.p must be a float"):
            attention_weights(e, k, None, scale=0.25, dropout=bad)
        for fn in (flash_forward, lambda *a, **kw: sparse_forward(*a, M.causal(), **kw)):
            with pytest.raises(ValueError, match=r"_forward: dropout.p must be a float"):
                fn(e, k, v, scale=0.25, dropout=bad)
        out, lse = flash_forward(e, k, v, scale=0.25)
        with pytest.raises(ValueError, match=r"flash_backward: dropout.p must be a float"):
            flash_backward(out, e, k, v, out, lse, scale=0.25, dropout=bad)
        with pytest.raises(ValueError, match=r"sparse_backward: dropout.p must be a float"):
            sparse_backward(out, e, k, v, out, lse, M.causal(), scale=0.25, dropout=bad)
    args = flatten(*plan(M.causal(), q, k, v, kernels=tuple(KERNELS)), 16, 16)
    for p in (-0.1, 1.5, float("nan")):
        with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\] \(0: no dropout\)"):
            ops.flash_sparse(q, k, v, 0.25, *args, p, bad.seed)
        with pytest.raises(ValueError, match=r"dropout_p must be in \[0, 1\]"):
            ops.flash_attention(q, k, v, 0.25, True, 0, 0, None, None, p, bad.seed)


@pytest.mark.parametrize("mask", [M.causal(), M.alibi(2) & M.causal()],
                         ids=["band", "block-lists"])
def test_a_backward_that_builds_a_graph_keeps_the_dropout_gradients(mask,
                                                                    triton_on_this_device):
    """As torch's fused kernels do with dropout (whose draws cannot be replayed by the
    reference), a backward with ``create_graph=True`` gives the kernels' gradients, equal to
    a plain backward's, and differentiating them again (a gradient penalty) raises instead
    of losing attention's part silently: band and block-sparse kernels alike."""
    q, k, v = _inputs(1, 2, 2, 24, 24, 16, seed=8)
    mask = mask.to(DEV)
    grads = []
    for graph in (False, True):
        leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        torch.manual_seed(3)
        out = mh.attention(*leaves, mask=mask, dropout_p=0.25, backend="triton")
        grads.append(torch.autograd.grad(out.float().square().sum(), leaves,
                                         create_graph=graph))
    for a, b in zip(*grads):
        assert torch.equal(a, b)
    with pytest.raises(RuntimeError, match="first-order only.*under dropout"):
        sum(g.float().square().sum() for g in grads[1]).backward()
    k1, v1 = (t.detach().clone().requires_grad_() for t in (k, v))   # q takes no gradient
    out = mh.attention(q, k1, v1, mask=mask, dropout_p=0.25, backend="triton")
    gk, gv = torch.autograd.grad(out.float().square().sum(), (k1, v1), create_graph=True)
    with pytest.raises(RuntimeError, match="first-order only.*under dropout"):
        (gk.float().square().sum() + gv.float().square().sum()).backward()


@pytest.mark.parametrize("p", [1e-6, 1 - 1e-6])
def test_a_rate_the_draws_cannot_resolve_is_declined(p, triton_on_this_device):
    """A rate that rounds to 0 or 1 at 2^-16 is declined, saying so (auto runs another
    backend), rather than silently not dropping or dropping everything."""
    q = _inputs(1, 2, 2, 16, 16, 16)[0]
    with pytest.raises(ValueError, match=r"resolution of 2\^-16, where dropout_p = "):
        mh.attention(q, q, q, mask=M.causal(), dropout_p=p, backend="triton")


@pytest.mark.parametrize("mask", [M.sliding_window(7), M.alibi(2) & M.sliding_window(7)],
                         ids=["band", "block-lists"])
def test_fullgraph_compile_draws_the_seed_in_the_graph(mask, triton_on_this_device):
    """Under ``torch.compile(fullgraph=True)`` the seed's draw and the operator (band or
    block-sparse, its lists traced too) trace into one graph: with the same generator state
    it gives the eager call's output, and the backward runs the operator's own (a new state,
    a new draw)."""
    q = _inputs(1, 2, 2, 32, 32, 16, seed=9)[0].requires_grad_()
    mask = mask.to(DEV)
    fn = lambda q: mh.attention(q, q, q, mask=mask, dropout_p=0.2, backend="triton")  # noqa: E731
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    torch.manual_seed(0)
    out = compiled(q)
    out.float().sum().backward()
    torch.manual_seed(0)
    assert torch.equal(out.detach(), fn(q.detach())) and torch.isfinite(q.grad).all()
    torch.manual_seed(1)
    assert not torch.equal(out.detach(), compiled(q).detach())

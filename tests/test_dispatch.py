"""backend="auto" picks the cheapest exact backend; explain() says why; dispatch verified by mock."""

from unittest import mock

import pytest
import torch

import multihead as mh
from multihead.functional import registry

M = mh.masks


def _qkv(S=256, H=4, Hkv=4, D=32, B=1, Sq=None):
    return (torch.randn(B, H, Sq or S, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D))


CASES = [
    # (name, kwargs builder, expected backend)
    ("no mask", lambda: dict(), "sdpa"),
    ("causal", lambda: dict(mask=M.causal()), "sdpa"),
    ("weights", lambda: dict(mask=M.causal(), return_weights=True), "reference"),
    ("lse", lambda: dict(return_lse=True), "blocksparse"),
    ("sparse window", lambda: dict(mask=M.sliding_window(64), S=2048), "blocksparse"),
    ("packed documents", lambda: dict(mask=M.document(torch.arange(2048) // 128), S=2048), "varlen"),
    ("interleaved documents", lambda: dict(mask=M.document(torch.arange(2048) // 128 % 4), S=2048),
     "blocksparse"),
    ("dense random", lambda: dict(mask=M.dense(torch.rand(256, 256) > 0.5)), "sdpa"),
    ("window + dropout", lambda: dict(mask=M.sliding_window(64), S=2048, dropout_p=0.1), "sdpa"),
    ("decode step, causal", lambda: dict(mask=M.causal(), Sq=1), "sdpa"),
]


@pytest.mark.parametrize("name,build,expected", CASES, ids=[c[0] for c in CASES])
def test_auto_choice_and_actual_dispatch(name, build, expected):
    kw = build()
    S, Sq = kw.pop("S", 256), kw.pop("Sq", None)
    q, k, v = _qkv(S=S, Sq=Sq)
    assert mh.explain(q, k, v, **kw).chosen == expected
    ran = []
    for n, b in registry.all_backends().items():
        orig = b.run
        def spy(call, _n=n, _orig=orig):
            ran.append(_n)
            return _orig(call)
        mock.patch.object(b, "run", side_effect=spy).start()
    try:
        mh.attention(q, k, v, **kw)
    finally:
        mock.patch.stopall()
    assert ran == [expected]


def test_sdpa_uses_is_causal_only_when_aligned():
    q, k, v = _qkv(S=64)
    with mock.patch("torch.nn.functional.scaled_dot_product_attention",
                    wraps=torch.nn.functional.scaled_dot_product_attention) as f:
        mh.attention(q, k, v, mask=M.causal(), backend="sdpa")
        assert f.call_args.kwargs["is_causal"] and f.call_args.kwargs["attn_mask"] is None
        q2 = q[:, :, :10]
        mh.attention(q2, k, v, mask=M.causal(), backend="sdpa")   # Sq != Sk: lower-right
        assert not f.call_args.kwargs["is_causal"]
        assert f.call_args.kwargs["attn_mask"] is not None


def test_sdpa_gqa_never_copies_kv():
    q, k, v = _qkv(S=64, H=8, Hkv=2)
    with mock.patch("torch.nn.functional.scaled_dot_product_attention",
                    wraps=torch.nn.functional.scaled_dot_product_attention) as f:
        mh.attention(q, k, v, backend="sdpa")
        args = f.call_args.args
        assert args[1] is k and args[2] is v                     # same tensors, not expanded
        assert args[0].shape == (1, 2, 4 * 64, 32)               # query heads folded in
        mh.attention(q, k, v, mask=M.causal(), backend="sdpa")   # is_causal: enable_gqa
        assert f.call_args.args[1] is k and f.call_args.kwargs["enable_gqa"]


def test_explain_report_lists_every_backend_with_a_reason():
    q, k, v = _qkv()
    rep = mh.explain(q, k, v, mask=M.causal(), return_weights=True)
    text = str(rep)
    assert "backend: reference" in text
    assert "sdpa" in text and "cannot run: does not return attention weights" in text
    assert "blocksparse" in text and "never forms them" in text
    rep = mh.explain(*_qkv(S=2048), mask=M.sliding_window(64))
    assert "computes" in str(rep) and "of the tiles" in str(rep)
    assert "est. cost" in str(rep)


def test_explicit_backend_runs_even_if_not_cheapest():
    q, k, v = _qkv()
    assert mh.explain(q, k, v, backend="reference").chosen == "reference"
    assert "requested" in str(mh.explain(q, k, v, backend="reference"))


def test_open_mask_is_dropped():
    q, k, v = _qkv(Sq=1)
    rep = mh.explain(q, k, v, mask=M.causal())
    assert "allows every pair: dropped" in str(rep)


def test_backends_listing():
    assert set(mh.backends()) == {"reference", "sdpa", "blocksparse", "varlen"}

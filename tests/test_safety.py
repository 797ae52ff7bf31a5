"""Safe semantics on every backend: empty rows, Sk == 0, huge logits, fp16 masking, dropout."""

import pytest
import torch

import multihead as mh
from conftest import BACKENDS, oracle, small_tiles


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fully_masked_rows_give_zeros_and_zero_grads(backend, dtype):
    q = torch.randn(2, 4, 10, 8, dtype=dtype, requires_grad=True)
    k = torch.randn(2, 2, 12, 8, dtype=dtype, requires_grad=True)
    v = torch.randn(2, 2, 12, 8, dtype=dtype, requires_grad=True)
    # batch 1 has no real keys at all; query rows 7.. of batch 0 are padding
    mask = mh.masks.padding(torch.tensor([12, 0])) & mh.masks.padding(torch.tensor([7, 10]), side="query")
    with small_tiles():
        out = mh.attention(q, k, v, mask=mask, backend=backend)
        out.float().pow(2).sum().backward()
    assert torch.isfinite(out).all()
    assert (out[1] == 0).all() and (out[0, :, 7:] == 0).all()
    assert out[0, :, :7].abs().sum() > 0
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all()
    assert (q.grad[1] == 0).all() and (k.grad[1] == 0).all() and (v.grad[1] == 0).all()


@pytest.mark.parametrize("backend", ["reference", "blocksparse"])
def test_fully_masked_rows_have_zero_weights_and_minus_inf_lse(backend):
    q = k = v = torch.randn(1, 2, 6, 4)
    mask = mh.masks.padding(torch.tensor([3]), side="query")
    res = mh.attention(q, k, v, mask=mask, backend=backend, return_lse=True,
                       return_weights=backend == "reference")
    lse = res[-1]
    assert torch.isneginf(lse[..., 3:]).all() and torch.isfinite(lse[..., :3]).all()
    if backend == "reference":
        assert (res[1][..., 3:, :] == 0).all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_keys_returns_zeros(backend):
    q = torch.randn(2, 4, 5, 8, requires_grad=True)
    k, v = torch.randn(2, 2, 0, 8), torch.randn(2, 2, 0, 6)
    out, lse = mh.attention(q, k, v, backend="blocksparse" if backend == "sdpa" else backend,
                            return_lse=True)
    assert out.shape == (2, 4, 5, 6) and (out == 0).all() and torch.isneginf(lse).all()
    out.sum().backward()
    assert (q.grad == 0).all()
    assert mh.attention(q, k, v, backend=backend).shape == (2, 4, 5, 6)
    w = mh.attention(q, k, v, return_weights=True)[1]
    assert w.shape == (2, 4, 5, 0)


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_queries(backend):
    q, k, v = torch.randn(1, 2, 0, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    assert mh.attention(q, k, v, backend=backend).shape == (1, 2, 0, 4)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_huge_logits_do_not_overflow(backend, dtype):
    q = torch.randn(1, 2, 9, 4)
    q = (q / q.norm(dim=-1, keepdim=True) * 100).to(dtype)   # |q.k| * scale up to 1e4 / 2
    k = (q.float() * 1.0).to(dtype)
    v = torch.randn(1, 2, 9, 4).to(dtype)
    with small_tiles():
        out = mh.attention(q, k, v, mask=mh.masks.causal(), backend=backend, scale=1.0)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), oracle(q, k, v, mh.masks.causal(), scale=1.0),
                               atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_masking_never_leaks(backend):
    """-1e9 style constants overflow in fp16 (seed 004, exercise 2); masked keys must get 0."""
    q = torch.randn(1, 1, 6, 8, dtype=torch.float16)
    k = torch.randn(1, 1, 6, 8, dtype=torch.float16)
    v = torch.zeros(1, 1, 6, 8, dtype=torch.float16)
    v[..., 5, :] = 1000.0                                     # only a masked key carries signal
    mask = mh.masks.dense(torch.arange(6) < 5)               # key 5 is masked for every query
    with small_tiles():
        out = mh.attention(q, k, v, mask=mask, backend=backend)
    assert (out == 0).all()


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_dropout_is_deterministic_under_a_seed_and_preserves_the_mean(backend):
    q, k, v = torch.randn(2, 4, 64, 16), torch.randn(2, 4, 64, 16), torch.randn(2, 4, 64, 16)
    torch.manual_seed(7)
    a = mh.attention(q, k, v, dropout_p=0.3, backend=backend)
    torch.manual_seed(7)
    b = mh.attention(q, k, v, dropout_p=0.3, backend=backend)
    assert torch.equal(a, b)
    clean = mh.attention(q, k, v, backend=backend)
    assert not torch.allclose(a, clean)
    mean = torch.stack([mh.attention(q, k, v, dropout_p=0.3, backend=backend)
                        for _ in range(200)]).mean(0)
    # inverted dropout keeps the expectation: the average converges to the clean output
    assert (mean - clean).abs().mean() < 0.1 * clean.abs().mean()


def test_dropout_zeroes_weights_at_the_requested_rate():
    q = k = v = torch.randn(4, 4, 128, 16)
    torch.manual_seed(0)
    _, w = mh.attention(q, k, v, dropout_p=0.25, return_weights=True)
    rate = (w == 0).float().mean().item()
    assert abs(rate - 0.25) < 0.01
    # surviving weights are rescaled by 1 / (1 - p): rows sum to 1 on average
    assert abs(w.sum(-1).mean().item() - 1.0) < 0.01


def test_dropout_rejected_by_blocksparse_with_a_pointer():
    q = torch.randn(1, 1, 4, 4)
    with pytest.raises(ValueError, match=r"blocksparse.*dropout.*'reference', 'sdpa'"):
        mh.attention(q, q, q, dropout_p=0.1, backend="blocksparse")


def test_explain_an_empty_call():
    q, k = torch.randn(1, 2, 0, 8), torch.randn(1, 2, 5, 8)
    for args in ((q, k, k), (k, q, q)):
        text = str(mh.explain(*args, mask=mh.masks.causal()))
        assert "backend: none (B, Sq or Sk is 0: the output is empty or zeros" in text
    with pytest.raises(ValueError, match="backend='varlen' cannot run this call"):
        mh.explain(q, k, k, backend="varlen", mask=mh.masks.causal())


def test_a_report_that_fails_on_its_second_file_leaves_the_first_as_it_was(tmp_path):
    from multihead.inspect.files import write_all
    (tmp_path / "a.json").write_text("old")
    (tmp_path / "b.html").mkdir()                        # in the way of the second file
    with pytest.raises(ValueError, match="--out: cannot write .*b.html"):
        write_all(tmp_path, {"a.json": b"new", "b.html": b"<p>"})
    assert (tmp_path / "a.json").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.json", "b.html"]   # no temporaries

"""The varlen backend equals the fp64 reference on packed documents; auto picks it where it
is cheapest and explains why it cannot run anything else."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from conftest import oracle, plain_torch

M = mh.masks


def _qkv(B, H, Hkv, S, D=8, Dv=12, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(dtype).requires_grad_()
    return mk(B, H, S, D), mk(B, Hkv, S, D), mk(B, Hkv, S, Dv)


def _grads(out, inputs):
    go = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    return torch.autograd.grad(out, inputs, go)


LENGTHS = {"sorted": [9, 9, 9, 5, 5, 2, 1], "shuffled": [3, 9, 1, 5, 9, 2, 5, 9],
           "one": [23], "near-equal": [10, 9, 10, 9, 8]}


@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (4, 1)], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("name", list(LENGTHS))
def test_cu_seqlens_equal_reference_fwd_and_grads(heads, name):
    lengths = LENGTHS[name]
    cu = torch.tensor([0] + lengths).cumsum(0)
    mask = M.document(cu_seqlens=cu)
    q, k, v = _qkv(2, *heads, int(cu[-1]))
    out = mh.attention(q, k, v, mask=mask, backend="varlen")
    ref = oracle(q, k, v, mask)
    torch.testing.assert_close(out.double(), ref, atol=2e-5, rtol=1e-5)
    for a, b in zip(_grads(out, (q, k, v)), _grads(ref, (q, k, v))):
        torch.testing.assert_close(a.double(), b.double(), atol=5e-5, rtol=1e-4)


def test_per_batch_ids_and_half_precision_error_rule():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3], [5, 6, 6, 6, 6, 6, 7, 7, 8, 8]])
    mask = M.document(ids)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        q, k, v = _qkv(2, 4, 2, 10, D=16, Dv=16, dtype=dtype)
        out = mh.attention(q, k, v, mask=mask, backend="varlen")
        ref = oracle(q, k, v, mask)
        err = (out.double() - ref).abs().max()
        base = (plain_torch(q, k, v, mask).double() - ref).abs().max()
        assert out.dtype == dtype and err <= 2 * base + 1e-6


@pytest.mark.parametrize("mask,reason", [
    (M.document(torch.tensor([0, 0, 1, 1, 0, 0])), "needs document ids in contiguous runs"),
    (M.document(torch.tensor([0, 0, 1, 1, 2, 2])) & M.causal(), "does not apply composed masks"),
    (M.causal(), "does not apply causal masks"),
])
def test_unsupported_is_explained(mask, reason):
    q, k, v = _qkv(1, 2, 2, 6)
    row = {r.name: "; ".join(r.reasons) for r in mh.explain(q, k, v, mask=mask).rows}
    assert reason in row["varlen"]
    with pytest.raises(ValueError, match=rf"backend='varlen' cannot run this call: it {reason}"):
        mh.attention(q, k, v, mask=mask, backend="varlen")


def test_auto_picks_varlen_for_many_short_documents():
    lengths = [37, 120, 64, 8, 90, 15] * 8
    cu = torch.tensor([0] + lengths).cumsum(0)
    q, k, v = (t.detach() for t in _qkv(1, 4, 4, int(cu[-1]), D=32, Dv=32))
    e = mh.explain(q, k, v, mask=M.document(cu_seqlens=cu))
    assert e.chosen == "varlen", str(e)
    assert "48 documents in 6 length groups" in str(e)

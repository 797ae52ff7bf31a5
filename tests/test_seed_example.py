"""Seed 004's worked example: three tokens, d_k = 2, reproduced on every backend."""

import pytest
import torch

import multihead as mh
from conftest import BACKENDS

Q = K = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
V = torch.tensor([[10.0, 0.0], [0.0, 10.0], [5.0, 5.0]])


def _run(backend, **kw):
    q, k, v = (t.view(1, 1, 3, 2).double() for t in (Q, K, V))
    return mh.attention(q, k, v, backend=backend, **kw)


def test_row_one_weights_to_the_printed_precision():
    _, w = _run("reference", return_weights=True)
    assert [round(x, 3) for x in w[0, 0, 0].tolist()] == [0.401, 0.198, 0.401]


@pytest.mark.parametrize("backend", BACKENDS)
def test_row_one_output_is_the_exact_value(backend):
    out = _run(backend)
    # the seed prints (6.02, 3.99) from rounded weights; the exact value is (6.017, 3.983)
    assert [round(x, 3) for x in out[0, 0, 0].tolist()] == [6.017, 3.983]
    e = torch.exp(torch.tensor(2.0 ** -0.5, dtype=torch.float64))
    w0, w1 = e / (2 * e + 1), 1 / (2 * e + 1)
    torch.testing.assert_close(out[0, 0, 0], torch.stack([15 * w0, 10 * w1 + 5 * w0]))


def test_removing_the_scale_sharpens_row_three():
    # the seed: without 1/sqrt(d_k) row 3 moves toward (0.21, 0.21, 0.58)
    _, w = _run("reference", scale=1.0, return_weights=True)
    assert [round(x, 2) for x in w[0, 0, 2].tolist()] == [0.21, 0.21, 0.58]

"""Randomized differential tests, fixed seed: every backend that accepts a call agrees with
the fp64 oracle, on random shapes (MHA/GQA/MQA, Sq != Sk, B = 0 and 1), random mask trees
(every leaf kind, ``&``, ``|``, ``~``, batch-1 and head-1 leaves that broadcast), in fp64
exactly, and in fp16/bf16 within the error rule (at most twice the error of plain PyTorch
in that dtype, against fp64).
"""

from __future__ import annotations

import random

import pytest
import torch

import multihead as mh
from conftest import ALL_BACKENDS, oracle, plain_torch

M = mh.masks
CASES = 120


def _leaf(rng: random.Random, g: torch.Generator, B: int, H: int, sq: int, sk: int):
    """A random mask leaf for a call of these sizes (batch and head dims of 1 included)."""
    b = rng.choice([1, B]) if B else B
    kind = rng.choice(["causal", "upper_left", "window", "padding", "padding_bool", "query_pad",
                       "document", "dense", "bias", "alibi"])
    if kind == "causal":
        return M.causal()
    if kind == "upper_left":
        return M.causal(align="upper_left")
    if kind == "window":
        return M.sliding_window(rng.randint(1, max(1, sk)))
    if kind == "padding":
        return M.padding(torch.randint(0, sk + 1, (b,), generator=g))
    if kind == "padding_bool":
        return M.padding(torch.rand(b, sk, generator=g) > 0.3)
    if kind == "query_pad":
        return M.padding(torch.randint(0, sq + 1, (b,), generator=g), side="query")
    if kind == "document":
        kv = torch.sort(torch.randint(0, 3, (b, sk), generator=g), dim=1).values
        qi = torch.sort(torch.randint(0, 3, (b, sq), generator=g), dim=1).values
        return M.document(qi, kv_ids=kv) if sq != sk else M.document(kv)
    if kind == "dense":
        return M.dense(torch.rand(b, rng.choice([1, H]), sq, sk, generator=g) > 0.3)
    if kind == "bias":
        t = torch.randn(b, rng.choice([1, H]), sq, sk, generator=g) * rng.choice([0.5, 4.0])
        t[torch.rand(t.shape, generator=g) > 0.85] = float("-inf")
        return M.bias(t)
    return M.alibi(rng.choice([1, H]))


def _tree(rng, g, B, H, sq, sk, depth=0):
    """A random composition of leaves; ``|`` only over masks without a bias."""
    if depth >= 2 or rng.random() < 0.45:
        return _leaf(rng, g, B, H, sq, sk)
    a, b = _tree(rng, g, B, H, sq, sk, depth + 1), _tree(rng, g, B, H, sq, sk, depth + 1)
    op = rng.choice(["&", "|", "~"])
    if op == "~" and not a.has_bias:
        return ~a
    if op == "|" and not (a.has_bias or b.has_bias):
        return a | b
    return a & b


def _case(i: int):
    rng, g = random.Random(i), torch.Generator().manual_seed(i)
    B = rng.choice([0, 1, 2, 2, 3]) if i % 17 == 0 else rng.choice([1, 2, 3])
    Hkv = rng.choice([1, 2])
    H = Hkv * rng.choice([1, 2, 4])
    sq, sk = rng.randint(1, 40), rng.randint(1, 40)
    D, Dv = rng.choice([8, 16]), rng.choice([8, 16, 12])
    mask = None if rng.random() < 0.08 else _tree(rng, g, B, H, sq, sk)
    if i % 10 == 5:                             # packed documents alone (what varlen runs)
        sq = sk
        mask = M.document(torch.sort(torch.randint(0, 4, (B, sk), generator=g), 1).values)
    q = torch.randn(B, H, sq, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, Hkv, sk, D, generator=g, dtype=torch.float64)
    v = torch.randn(B, Hkv, sk, Dv, generator=g, dtype=torch.float64)
    return q, k, v, mask


def _runs(backend, q, k, v, mask) -> bool:
    try:
        mh.explain(q, k, v, mask=mask, backend=backend)
        return True
    except ValueError as e:                     # says why, naming the backend
        assert f"backend={backend!r} cannot run this call" in str(e)
        return False


def _runs_on_this_device(backend: str) -> None:
    devices = mh.functional.registry.get(backend).capabilities.devices
    if devices is not None and "cpu" not in devices:
        pytest.skip(f"{backend} runs on {sorted(devices)} only (its own tests cover it)")


def _err(x, ref):
    return (x.double() - ref).abs().max().item() if x.numel() else 0.0


def _cases_for(backend: str) -> list:
    """The random cases ``backend`` runs on this device: ``(i, q, k, v, mask)``."""
    _runs_on_this_device(backend)
    return [(i, *c) for i, c in ((i, _case(i)) for i in range(CASES)) if _runs(backend, *c)]


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_every_backend_equals_the_fp64_oracle_on_random_calls(backend):
    cases = _cases_for(backend)
    for i, q, k, v, mask in cases:
        out = mh.attention(q, k, v, mask=mask, backend=backend)
        ref = oracle(q, k, v, mask)
        assert out.shape == ref.shape
        assert not out.isnan().any(), f"case {i}: NaN from {backend} ({mask})"
        torch.testing.assert_close(out, ref, atol=1e-10, rtol=1e-9,
                                   msg=lambda m: f"case {i}, mask {mask}: {m}")
    assert len(cases) >= (CASES // 12 if backend == "varlen" else CASES // 2), len(cases)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_half_precision_within_the_error_rule_on_random_calls(backend, dtype):
    for i in range(0, CASES, 3):
        q, k, v, mask = _case(i)
        if not _runs(backend, q.to(dtype), k.to(dtype), v.to(dtype), mask):
            continue
        qh, kh, vh = q.to(dtype), k.to(dtype), v.to(dtype)
        ref = oracle(qh, kh, vh, mask)
        out = mh.attention(qh, kh, vh, mask=mask, backend=backend)
        base = plain_torch(qh, kh, vh, mask)
        slack = 2 * torch.finfo(dtype).eps
        assert _err(out, ref) <= 2 * _err(base, ref) + slack, f"case {i}, mask {mask}"


@pytest.mark.parametrize("backend", ["reference", "sdpa", "blocksparse"])
def test_gradients_equal_the_fp64_oracle_on_random_calls(backend):
    for i in range(0, CASES, 4):
        q, k, v, mask = _case(i)
        if not _runs(backend, q, k, v, mask) or q.numel() == 0:
            continue
        ins = [t.clone().requires_grad_() for t in (q, k, v)]
        refs = [t.clone().requires_grad_() for t in (q, k, v)]
        g = torch.randn(q.shape[:3] + (v.shape[-1],), dtype=torch.float64,
                        generator=torch.Generator().manual_seed(i))
        (mh.attention(*ins, mask=mask, backend=backend) * g).sum().backward()
        (oracle(*refs, mask) * g).sum().backward()
        for a, b in zip(ins, refs):
            torch.testing.assert_close(a.grad, b.grad, atol=1e-9, rtol=1e-8,
                                       msg=lambda m: f"case {i}, mask {mask}: {m}")


WEIGHT_BACKENDS = [b for b in ALL_BACKENDS if mh.functional.registry.get(b).capabilities.weights]


@pytest.mark.parametrize("backend", [b for b in WEIGHT_BACKENDS if b != "reference"])
def test_weights_and_lse_equal_the_oracle_on_random_calls(backend):
    """A backend that returns weights (``rows`` crops each sequence to its live keys) gives
    the oracle's output, weights (zeros where masked and on empty rows), their head mean
    (``return_weights="mean"``) and lse."""
    cases = _cases_for(backend)
    for i, q, k, v, mask in cases:
        got = mh.attention(q, k, v, mask=mask, backend=backend, return_weights=True,
                           return_lse=True)
        want = mh.attention(q, k, v, mask=mask, backend="reference", return_weights=True,
                            return_lse=True)
        mean = mh.attention(q, k, v, mask=mask, backend=backend, return_weights="mean")[1]
        for name, a, b in zip(("out", "weights", "lse", "head mean"), (*got, mean),
                              (*want, want[1].mean(dim=1))):
            assert a.shape == b.shape and not a.isnan().any(), (i, name)
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-9,
                                       msg=lambda m: f"case {i} {name}, mask {mask}: {m}")
    assert len(cases) >= CASES // 2, len(cases)


@pytest.mark.parametrize("backend", WEIGHT_BACKENDS)
def test_a_row_a_bias_rules_out_entirely_gives_zeros_on_weight_backends(backend):
    _runs_on_this_device(backend)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 3, 4, generator=g, dtype=torch.float64) for _ in range(3))
    b = torch.zeros(2, 1, 3, 3, dtype=torch.float64)
    b[1, :, 1] = float("-inf")                                      # batch 1, query 1: nothing
    out, w, lse = mh.attention(q, k, v, mask=M.bias(b), backend=backend, return_weights=True,
                               return_lse=True)
    assert out[1, :, 1].eq(0).all() and w[1, :, 1].eq(0).all() and lse[1, :, 1].eq(-torch.inf).all()
    assert not out.isnan().any() and w[0].sum(-1).allclose(torch.ones(2, 3, dtype=torch.float64))

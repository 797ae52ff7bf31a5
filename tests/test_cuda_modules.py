"""On a CUDA GPU (marker ``cuda``; skipped cleanly without one): the module equals
torch.nn.MultiheadAttention, GQA/MQA equals MHA with repeated K/V weights, fused equals split
projections, token-by-token decoding with a KVCache and a PagedKVCache equals a full causal
forward (RoPE, GQA, prompts padded left and right), the cross-attention cache with RoPE
equals a full forward, the drop-in ``multihead.nn.MultiheadAttention`` equals torch's with
key_padding_mask and attn_mask, and neither a forward nor cached decoding synchronizes host
and device (``torch.cuda.set_sync_debug_mode("error")``).

Low precision follows the error rule (DESIGN.md): our error against an fp64 reference is at
most twice the error of plain PyTorch in the same dtype, plus one rounding step at the
reference's largest value. The helpers are the CPU tests' own (imported, not copied).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import multihead as mh
from nosync import cuda_sync_is_an_error
from peers.test_torch_mha import _inputs, _masks, _pair
from test_kv_cache import (E, SYNC_SCENARIOS, _assert_rule, _cache, _cross_decode, _data,
                           _decode, _decode_paged, _full, _module, _pool)
from test_module import gqa_and_repeated_mha, split_forward

pytestmark = pytest.mark.cuda
DEV = "cuda"
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
F64 = torch.float64


def _slack(dtype, ref) -> float:
    """One rounding step of ``dtype`` at the reference's largest value."""
    return torch.finfo(dtype).eps * max(float(r.abs().max()) for r in ref)


def _rule(got, base, ref, dtype):
    got, base, ref = ([t] if isinstance(t, torch.Tensor) else t for t in (got, base, ref))
    _assert_rule(got, base, ref, _slack(dtype, ref))


# -- the module against code we did not write ------------------------------------------------
def _two_conventions(kind, sq, sk):
    """The same mask for us (``True`` = may attend) and for torch (``True`` = ignore)."""
    if kind == "none":
        return None, None
    if kind == "causal":
        allowed = torch.ones(sq, sk, dtype=torch.bool, device=DEV).tril(sk - sq)  # lower-right
        return mh.masks.causal(), ~allowed
    allowed = torch.rand(sq, sk, device=DEV) > 0.3
    allowed[:, 0] = True                                      # every query sees a key
    return mh.masks.dense(allowed), ~allowed


@pytest.mark.parametrize("mask", ["none", "causal", "dense"])
@pytest.mark.parametrize("kdim", [None, 24], ids=["self", "cross"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_module_equals_torch_mha(dtype, kdim, mask):
    torch.manual_seed(0)
    t64 = nn.MultiheadAttention(64, 8, kdim=kdim, vdim=kdim, batch_first=True,
                                device=DEV, dtype=F64).eval()
    with torch.no_grad():
        t64.in_proj_bias.normal_(std=0.1), t64.out_proj.bias.normal_(std=0.1)
    t = copy.deepcopy(t64).to(dtype)
    ours = mh.MultiHeadAttention.from_torch(t)
    x64 = torch.randn(3, 10, 64, device=DEV, dtype=F64)
    c64 = x64 if kdim is None else torch.randn(3, 13, kdim, device=DEV, dtype=F64)
    ours_mask, torch_mask = _two_conventions(mask, x64.shape[1], c64.shape[1])
    x, c = x64.to(dtype), c64.to(dtype)
    ref = t64(x64, c64, c64, attn_mask=torch_mask, need_weights=False)[0]
    base = t(x, c, c, attn_mask=torch_mask, need_weights=False)[0]
    with torch.no_grad():
        got = ours(x, None if kdim is None else c, mask=ours_mask)
    _rule(got, base.detach(), ref.detach(), dtype)


@pytest.mark.parametrize("kv_heads", [2, 1], ids=["GQA", "MQA"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_gqa_equals_mha_with_repeated_kv_weights(kv_heads, dtype):
    g, full = (m.to(DEV) for m in gqa_and_repeated_mha(kv_heads))
    x64 = torch.randn(2, 9, 32, device=DEV, dtype=F64)
    causal = mh.masks.causal()
    with torch.no_grad():
        ref = copy.deepcopy(full).double()(x64, mask=causal)
        base = copy.deepcopy(full).to(dtype)(x64.to(dtype), mask=causal)
        got = g.to(dtype)(x64.to(dtype), mask=causal)
    _rule(got, base, ref, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fused_equals_split_projections(dtype):
    torch.manual_seed(0)
    m64 = mh.MultiHeadAttention(64, 8, device=DEV, dtype=F64).eval()
    m = copy.deepcopy(m64).to(dtype)
    x64 = torch.randn(2, 12, 64, device=DEV, dtype=F64)
    with torch.no_grad():
        _rule(m(x64.to(dtype)), split_forward(m, x64.to(dtype)), split_forward(m64, x64), dtype)


# -- cached decoding equals a full forward ---------------------------------------------------
def _pair_in(kv, dtype):
    """The fp64 reference module and its copy in ``dtype``, both with RoPE, on the GPU."""
    m64 = _module(kv, True, F64, device=DEV)
    return m64, copy.deepcopy(m64).to(dtype)


def _check_decoding(kv, dtype, lengths, steps, decode):
    """``decode(m, seqs)`` (cached, in ``dtype``) against full forwards, by the error rule."""
    m64, m = _pair_in(kv, dtype)
    seqs64 = _data(lengths, steps, F64, device=DEV)
    seqs = [s.to(dtype) for s in seqs64]
    with torch.no_grad():
        _rule(decode(m, seqs), _full(m, seqs), _full(m64, seqs64), dtype)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("kind", ["static", "paged"])
@pytest.mark.parametrize("kv", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_token_by_token_equals_full_forward(dtype, kv, kind, side):
    lengths, steps = [6, 3, 1], 4                        # padded prompts, then 4 steps
    _check_decoding(kv, dtype, lengths, steps, lambda m, seqs: _decode(
        m, seqs, lengths, steps, _cache(kind, m, len(seqs)), side))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_paged_continuous_batching_equals_full_forward(dtype):
    lengths, steps = [7, 2, 4], 5                        # prompts prefilled one by one
    _check_decoding(2, dtype, lengths, steps, lambda m, seqs: _decode_paged(
        m, seqs, lengths, steps, _pool(m))[0])


@pytest.mark.parametrize("kv", [4, 2, 1], ids=["MHA", "GQA", "MQA"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_cross_attention_cache_with_rope(dtype, kv):
    m64, m = _pair_in(kv, dtype)
    x64, c64 = (torch.randn(2, n, E, device=DEV, dtype=F64) for n in (7, 9))
    x, c = x64.to(dtype), c64.to(dtype)
    with torch.no_grad():
        ref, base = m64(x64, c64), m(x, c)
        got = _cross_decode(m, x, c, m.make_cache(2, 9), [1, 2, 1, 3])
    _rule(got, base, ref, dtype)


# -- the drop-in against torch.nn.MultiheadAttention -----------------------------------------
@pytest.mark.parametrize("mask_kind", ["kpm", "attn2d", "attn3d", "both"])
@pytest.mark.parametrize("mask_dtype", ["bool", "float"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_drop_in_equals_torch_fp32(mask_kind, mask_dtype, need_weights):
    t, ours = (m.to(DEV) for m in _pair(True, None, None, True))
    q, k, v = (a.detach().to(DEV).requires_grad_() for a in _inputs(True, None, None))
    kw = {n: m.to(DEV) for n, m in _masks(mask_kind, mask_dtype).items()}
    a_out, a_w = ours(q, k, v, need_weights=need_weights, **kw)
    b_out, b_w = t(q, k, v, need_weights=need_weights, **kw)
    torch.testing.assert_close(a_out, b_out, atol=1e-5, rtol=1e-4)
    if need_weights:
        torch.testing.assert_close(a_w, b_w, atol=1e-6, rtol=1e-4)
    ga = torch.autograd.grad(a_out.sum(), (q, k, v, *ours.parameters()))
    gb = torch.autograd.grad(b_out.sum(), (q, k, v, *t.parameters()))
    for x, y in zip(ga, gb):
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("mask_kind", ["kpm", "attn2d", "attn3d", "both"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
def test_drop_in_low_precision_within_the_error_rule(dtype, mask_kind):
    t, ours = (m.to(DEV) for m in _pair(True, None, None, True))
    t64 = copy.deepcopy(t).double()
    q, k, v = (a.detach().to(DEV, F64) for a in _inputs(True, None, None))
    kw = {n: m.to(DEV) for n, m in _masks(mask_kind, "bool").items()}
    low = lambda mod, *xs: mod.to(dtype)(*(x.to(dtype) for x in xs), need_weights=False, **kw)[0]
    with torch.no_grad():
        ref = t64(q, k, v, need_weights=False, **kw)[0]
        _rule(low(ours, q, k, v), low(t, q, k, v), ref, dtype)


# -- no host-device synchronization ----------------------------------------------------------


@pytest.mark.parametrize("name", SYNC_SCENARIOS)        # the scenarios run on the meta device
def test_no_host_device_sync(name):
    m = _module(2, True, device=DEV)                          # GQA, RoPE
    with torch.no_grad():
        SYNC_SCENARIOS[name](m)                               # warm-up: lazy init may sync
        with cuda_sync_is_an_error():
            SYNC_SCENARIOS[name](m)

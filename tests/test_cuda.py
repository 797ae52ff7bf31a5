"""attention() on a CUDA GPU (marker ``cuda``; skipped cleanly without one).

- Every registered backend x every mask kind x fp16/bf16/fp32 x MHA/GQA/MQA x Sq != Sk,
  forward and gradients, under the error rule against the fp64 oracle on the same GPU.
- No host-device sync for any mask kind, in a call whose decision is made afresh and in a
  cached one, under ``torch.cuda.set_sync_debug_mode("error")`` (the CPU twin on the meta
  device is ``test_nosync.py``; the scenarios are the same).
- Dispatch knows the device: the GPU's profile prices the calls (explain() names it), and
  sliding windows no longer go to the Python tile loop.
"""

from __future__ import annotations


import pytest
import torch

import multihead as mh
from nosync import cuda_sync_is_an_error
from conftest import (ALL_BACKENDS, MASK_NAMES, make_masks, oracle, plain_torch,
                      skip_unless_runs, small_tiles)
from test_nosync import NAMES, scenarios

pytestmark = pytest.mark.cuda
DEV = "cuda"
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
HEADS = [(4, 4), (4, 2), (4, 1)]
SHAPES = [(37, 37), (13, 70), (70, 13)]


def _err(x, ref):
    return (x.double() - ref.double()).abs().max().item()


def _grads(out, inputs, seed=1):
    g = torch.Generator(device=DEV).manual_seed(seed)
    go = torch.randn(out.shape, generator=g, device=DEV).to(out.dtype)
    return torch.autograd.grad(out, inputs, go, allow_unused=True)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("mask_name", MASK_NAMES)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"H{h[0]}kv{h[1]}")
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
def test_every_backend_mask_dtype_and_shape_within_the_error_rule(backend, mask_name, dtype,
                                                                  heads, shape):
    (H, Hkv), (sq, sk), B = heads, shape, 2
    mask = make_masks(B, H, sq, sk)[mask_name]
    mask = mask.to(DEV) if mask is not None else None
    g = torch.Generator(device=DEV).manual_seed(0)
    q, k, v = (torch.randn(B, h, s, 32, generator=g, device=DEV).to(dtype).requires_grad_()
               for h, s in ((H, sq), (Hkv, sk), (Hkv, sk)))
    skip_unless_runs(backend, q, k, v, mask=mask)
    ref = oracle(q, k, v, mask)
    base = plain_torch(q, k, v, mask)
    with small_tiles():
        out = mh.attention(q, k, v, mask=mask, backend=backend)
    assert out.dtype == dtype and out.shape == (B, H, sq, 32) and out.device.type == DEV
    assert torch.isfinite(out).all()
    slack = 1e-6 if dtype == torch.float32 else 1e-3
    assert _err(out, ref) <= 2 * _err(base, ref) + slack
    with small_tiles():
        got = _grads(out, (q, k, v))
    base_g, want = _grads(base, (q, k, v)), _grads(ref, (q, k, v))
    for name, a, b, w in zip("qkv", got, base_g, want):
        assert torch.isfinite(a).all(), f"d{name} not finite"
        assert _err(a, w) <= 2 * _err(b, w) + 10 * slack, f"d{name}"


def test_fp32_gqa_through_sdpa():
    """The crash measured on the H100: fp32 GQA made SDPA return a transposed layout."""
    q = torch.randn(2, 8, 130, 64, device=DEV)
    k, v = (torch.randn(2, 2, 130, 64, device=DEV) for _ in range(2))
    for mask in (None, mh.masks.sliding_window(33), mh.masks.padding(torch.tensor([130, 7]))):
        mask = mask.to(DEV) if mask is not None else None
        out = mh.attention(q, k, v, mask=mask, backend="sdpa")
        torch.testing.assert_close(out.double(), oracle(q, k, v, mask), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("name", NAMES)
def test_attention_never_syncs_on_cuda(name):
    def build():
        return next(s for s in scenarios(DEV) if s[0] == name)[1:]
    q, k, v, mask = build()
    mh.attention(q, k, v, mask=mask)                     # kernels loaded, decision cached
    mh.functional.dispatch.clear_cache()
    q, k, v, mask = build()                              # a fresh mask object: decided afresh
    with cuda_sync_is_an_error():
        mh.attention(q, k, v, mask=mask)
        mh.attention(q, k, v, mask=mask)                 # cached
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    mh.attention(qg, kg, vg, mask=mask).sum().backward()
    with cuda_sync_is_an_error():
        mh.attention(qg, kg, vg, mask=mask).sum().backward()


def test_module_forward_never_syncs_on_cuda():
    attn = mh.MultiHeadAttention(256, 8, num_kv_heads=2, rope=mh.RotaryEmbedding(32),
                                 device=DEV, dtype=torch.bfloat16)
    x = torch.randn(2, 100, 256, device=DEV, dtype=torch.bfloat16)
    attn(x, mask=mh.masks.causal())
    with cuda_sync_is_an_error():
        attn(x, mask=mh.masks.causal())


def test_dispatch_knows_the_gpu():
    q = torch.randn(1, 16, 4096, 128, device=DEV, dtype=torch.bfloat16)
    e = mh.explain(q, q, q, mask=mh.masks.sliding_window(256))
    assert e.profile.device_type == "cuda" and torch.cuda.get_device_name() in str(e)
    assert e.chosen != "blocksparse", str(e)
    decode = mh.explain(q[:, :, :1], q[:, :8], q[:, :8].clone(), mask=mh.masks.causal())
    assert decode.chosen == "sdpa" and not decode.plan.detail.fold


@pytest.mark.parametrize("backend", ["sdpa", "triton", "auto"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=lambda d: str(d)[6:])
def test_double_backward_on_the_gpu_equals_the_reference(backend, dtype):
    """torch's CUDA SDPA nodes (flash, efficient, cuDNN) and our kernels take the undefined
    gradient the second-order node gives them in a backward that builds a graph; the
    gradients and their own gradients are the reference's (a loss linear in the output,
    so both see the same output gradient)."""
    g = torch.Generator(device=DEV).manual_seed(2)
    q = torch.randn(2, 8, 96, 64, generator=g, device=DEV).to(dtype).requires_grad_()
    k, v = (torch.randn(2, 2, 96, 64, generator=g, device=DEV).to(dtype).requires_grad_()
            for _ in range(2))
    w = torch.randn(q.shape, generator=g, device=DEV).to(dtype)
    mask = mh.masks.causal()
    skip_unless_runs(backend, q, k, v, mask=mask)
    grads = []
    for b in (backend, "reference"):
        out = mh.attention(q, k, v, mask=mask, backend=b)
        first = torch.autograd.grad((out * w).sum(), (q, k, v), create_graph=True)
        grads.append((*first, *torch.autograd.grad(sum(x.float().pow(2).sum() for x in first),
                                                   (q, k, v))))
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)

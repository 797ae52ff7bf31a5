"""No host-device sync in attention(), its dispatch, or the module, for every mask kind.

On the ``meta`` device (standing in for a GPU, priced with the H100's profile) under
:class:`nosync.NoReadBack`, which fails on any read of device data, any data-dependent
shape and any blocking host-to-device copy. The first call (which validates, plans and
caches the decision) and a cached second call are both checked. The same scenarios run on
a real GPU under ``torch.cuda.set_sync_debug_mode("error")`` in ``test_cuda.py``.
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead.functional import profiles
from nosync import NoReadBack

M = mh.masks


@pytest.fixture(autouse=True)
def meta_is_a_gpu():
    profiles.set_profile("meta", "h100")
    yield
    profiles.set_profile("meta", None)


def scenarios(device, B=2, H=8, Hkv=2, S=96):
    """(name, q, k, v, mask) for every mask kind, masks built from host data and moved."""
    lengths = torch.tensor([S, S // 2])
    cu = torch.tensor([0, 10, 40, S])
    bias = torch.randn(1, H, S, S)
    real = torch.arange(S)[None, :] < lengths[:, None]                    # (B, S) bool
    q = torch.randn(B, H, S, 32, device=device)
    k, v = (torch.randn(B, Hkv, S, 32, device=device) for _ in range(2))
    kv_mha = (torch.randn(B, H, S, 32, device=device) for _ in range(2))
    masks = {
        "none": None,
        "causal": M.causal(),
        "causal upper_left": M.causal(align="upper_left"),
        "sliding window": M.sliding_window(16),
        "padding(lengths)": M.padding(lengths),
        "padding(bool)": M.padding(real),
        "padding query side": M.padding(lengths, side="query"),
        "document(cu_seqlens)": M.document(cu_seqlens=cu),
        "document(ids) & causal": M.document(torch.arange(S) // 7) & M.causal(),
        "causal & padding": M.causal() & M.padding(lengths),
        "alibi": M.alibi(H),
        "causal & alibi": M.causal() & M.alibi(H),
        "dense bool": M.dense(torch.rand(S, S) > 0.3),
        "bias": M.bias(bias),
        "window | dense": M.sliding_window(8) | M.dense(torch.eye(S, dtype=torch.bool)),
    }
    for name, m in masks.items():
        yield name, q, k, v, (m.to(device) if m is not None else None)
    mha_k, mha_v = kv_mha
    yield "MHA causal", q, mha_k, mha_v, M.causal()
    yield "decode step", q[:, :, -1:], k, v, M.causal()
    yield "chunk of 5 (lower-right causal)", q[:, :, -5:], k, v, M.causal()


NAMES = [s[0] for s in scenarios("cpu")]


@pytest.mark.parametrize("name", NAMES)
def test_attention_never_syncs(name):
    _, q, k, v, mask = next(s for s in scenarios("meta") if s[0] == name)
    with NoReadBack():
        out = mh.attention(q, k, v, mask=mask)          # miss: validate, plan, cache
        again = mh.attention(q, k, v, mask=mask)        # hit
    assert out.shape == again.shape == (*q.shape[:3], v.shape[-1])
    assert out.device.type == "meta"


@pytest.mark.parametrize("name", ["causal", "padding(lengths)", "document(cu_seqlens)", "alibi"])
def test_training_step_never_syncs(name):
    _, q, k, v, mask = next(s for s in scenarios("meta") if s[0] == name)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    with NoReadBack():
        mh.attention(q, k, v, mask=mask).sum().backward()
    assert q.grad.shape == q.shape


def test_module_forward_with_causal_mask_never_syncs():
    attn = mh.MultiHeadAttention(64, 8, num_kv_heads=2, rope=mh.RotaryEmbedding(8),
                                 device="meta")
    x = torch.randn(2, 40, 64, device="meta")
    with NoReadBack():
        for _ in range(2):
            assert attn(x, mask=M.causal()).shape == (2, 40, 64)


def test_a_plan_that_would_sync_is_said_so_and_avoided():
    """Document ids born on the device: the varlen plan would read them back; auto takes a
    sync-free plan on a GPU, and explain() says why."""
    S = 64
    q = k = v = torch.randn(1, 4, S, 16, device="meta")
    mask = M.document(torch.zeros(S, dtype=torch.long, device="meta"))
    e = mh.explain(q, k, v, mask=mask)
    varlen = next(r for r in e.rows if r.name == "varlen")
    assert varlen.plan.work.syncs == 1 and "sync" in varlen.plan.note
    assert e.chosen == "sdpa" and e.plan.work.syncs == 0
    with NoReadBack():
        mh.attention(q, k, v, mask=mask)

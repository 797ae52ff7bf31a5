"""``torch.export`` with dynamic lengths: an exported module runs every length in the
``Dim``'s range as the module does, for GQA/MQA, windows, ALiBi, RoPE and cross-attention
with two dynamic lengths (where the lengths met while tracing, equal or not, must not be
baked into the program as a guard: a later call with other ones fails with "Guard
failed", and an export whose guard narrows the range fails with "Constraints violated")."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import multihead as mh

M = mh.masks
E, H, B = 32, 4, 2

SELF = {
    "gqa": (dict(num_kv_heads=2), None),
    "gqa window": (dict(num_kv_heads=2), M.sliding_window(5)),
    "mqa causal": (dict(num_kv_heads=1), M.causal()),
    "gqa alibi & causal": (dict(num_kv_heads=2), M.alibi(H) & M.causal()),
    "gqa rope window": (dict(num_kv_heads=2, rope=mh.RotaryEmbedding(E // H)),
                        M.sliding_window(7)),
}


class _Self(nn.Module):
    def __init__(self, attn, mask):
        super().__init__()
        self.attn, self.mask = attn, mask

    def forward(self, x):
        return self.attn(x, mask=self.mask)


class _Attend(nn.Module):
    def __init__(self, mask):
        super().__init__()
        self.mask = mask

    def forward(self, q, k, v):
        return mh.attention(q, k, v, mask=self.mask)


class _Cross(nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, x, context):
        return self.attn(x, context, mask=M.causal())


@pytest.mark.parametrize("name", SELF)
def test_an_exported_self_attention_runs_every_length(name):
    torch.manual_seed(0)
    kw, mask = SELF[name]
    module = _Self(mh.MultiHeadAttention(E, H, **kw).eval(), mask)
    S = torch.export.Dim("S", min=2, max=256)
    exported = torch.export.export(module, (torch.randn(B, 6, E),),
                                   dynamic_shapes=({1: S},)).module()
    for n in (2, 17, 200):                 # shorter and longer than the window, past 16
        x = torch.randn(B, n, E)
        torch.testing.assert_close(exported(x), module(x), atol=1e-6, rtol=1e-5)


def test_an_exported_cross_attention_runs_every_pair_of_lengths():
    """Traced at Sq < Sk; run at Sq == Sk (is_causal's alignment agrees there) and Sq > Sk
    (lower-right causal rows with no key: zeros)."""
    torch.manual_seed(0)
    module = _Cross(mh.MultiHeadAttention(E, H, num_kv_heads=2).eval())
    S, T = torch.export.Dim("S", min=2, max=256), torch.export.Dim("T", min=2, max=256)
    exported = torch.export.export(module, (torch.randn(B, 6, E), torch.randn(B, 9, E)),
                                   dynamic_shapes=({1: S}, {1: T})).module()
    for n, t in ((6, 6), (40, 40), (5, 30), (200, 30)):
        x, c = torch.randn(B, n, E), torch.randn(B, t, E)
        got = exported(x, c)
        torch.testing.assert_close(got, module(x, c), atol=1e-6, rtol=1e-5)
    assert (got[:, :200 - 30] == module.attn.out_proj.bias).all()   # rows with no key


@pytest.mark.parametrize("threads", [1, 2, 64])
@pytest.mark.parametrize("heads", [(1, 1), (8, 1), (8, 8)], ids=["H1", "H8kv1", "H8"])
def test_an_export_does_not_depend_on_the_machines_core_count(threads, heads):
    """The cost model stretches a plan with fewer independent pieces than the device has
    units: compared as numbers, a traced count of pieces was a guard (``ceil(S/128) < 2``
    with two threads, one head) that torch.export refused, on some machines only."""
    H, Hkv = heads
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for mask in (None, M.sliding_window(5), M.causal() & M.alibi(H)):
            module = _Attend(mask)
            S = torch.export.Dim("S", min=2, max=4096)
            q, kv = torch.randn(1, H, 6, 8), torch.randn(1, Hkv, 6, 8)
            exported = torch.export.export(module, (q, kv, kv),
                                           dynamic_shapes=({2: S}, {2: S}, {2: S})).module()
            for n in (2, 300):
                q, kv = torch.randn(1, H, n, 8), torch.randn(1, Hkv, n, 8)
                torch.testing.assert_close(exported(q, kv, kv), module(q, kv, kv))
    finally:
        torch.set_num_threads(before)


class _Packed(nn.Module):
    def __init__(self, attn):
        super().__init__()
        self.attn = attn

    def forward(self, x, ids):
        return self.attn(x, mask=M.document(ids) & M.causal())


def test_an_export_with_a_dynamic_batch_of_packed_documents():
    """Document ids ``(B, S)`` as an input, batch and length dynamic: the mask read the
    number of rows of ids as a Python bool, a guard on the batch."""
    torch.manual_seed(0)
    module = _Packed(mh.MultiHeadAttention(E, H, num_kv_heads=2).eval())
    Bd, S = torch.export.Dim("B", min=1, max=16), torch.export.Dim("S", min=2, max=256)
    ids = lambda b, n: torch.sort(torch.randint(0, 3, (b, n)), dim=1).values  # noqa: E731
    exported = torch.export.export(module, (torch.randn(3, 6, E), ids(3, 6)),
                                   dynamic_shapes=({0: Bd, 1: S}, {0: Bd, 1: S})).module()
    for b, n in ((1, 5), (3, 40), (7, 200)):
        x, d = torch.randn(b, n, E), ids(b, n)
        torch.testing.assert_close(exported(x, d), module(x, d), atol=1e-6, rtol=1e-5)

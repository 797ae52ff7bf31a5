"""The drop-in on a GPU: parity with torch.nn.MultiheadAttention, the is_causal hint,
NestedTensor inputs and TorchScript, with every tensor (masks, lengths) on the device."""

import pytest
import torch
from torch import nn

import multihead as mh

pytestmark = pytest.mark.cuda

E, H, L, S, B = 32, 4, 9, 13, 3
DEV = "cuda"


def _pair(**kw):
    torch.manual_seed(0)
    t = nn.MultiheadAttention(E, H, device=DEV, **kw)
    ours = mh.nn.MultiheadAttention(E, H, device=DEV, **kw)
    ours.load_state_dict(t.state_dict())
    return t.eval(), ours.eval()


def _masks(dtype):
    g = torch.Generator(device=DEV).manual_seed(1)
    am = torch.rand(L, S, device=DEV, generator=g) > 0.7
    kpm = torch.rand(B, S, device=DEV, generator=g) > 0.7
    am[:, 0] = kpm[:, 0] = False                     # every query keeps a key (torch: NaN)
    if dtype == torch.bool:
        return am, kpm
    to_float = lambda m: torch.zeros(m.shape, device=DEV).masked_fill(m, float("-inf"))
    return to_float(am), to_float(kpm)


@pytest.mark.parametrize("mask_dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("batch_first", [True, False])
def test_parity_with_torch_on_the_gpu(mask_dtype, need_weights, batch_first):
    t, ours = _pair(batch_first=batch_first)
    shape = lambda n: (B, n, E) if batch_first else (n, B, E)
    q, kv = torch.randn(shape(L), device=DEV), torch.randn(shape(S), device=DEV)
    am, kpm = _masks(mask_dtype)
    for kw in (dict(), dict(attn_mask=am), dict(key_padding_mask=kpm),
               dict(attn_mask=am, key_padding_mask=kpm)):
        kw["need_weights"] = need_weights
        a, b = ours(q, kv, kv, **kw), t(q, kv, kv, **kw)
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
        assert a[0].stride() == b[0].stride()


def test_is_causal_hint_on_the_gpu():
    t, ours = _pair(batch_first=True)
    q, kv = torch.randn(B, L, E, device=DEV), torch.randn(B, S, E, device=DEV)
    kw = dict(attn_mask=torch.zeros(L, S, dtype=torch.bool, device=DEV), is_causal=True,
              need_weights=False)
    torch.testing.assert_close(ours(q, kv, kv, **kw), t(q, kv, kv, **kw), atol=1e-4, rtol=1e-4)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@torch.no_grad()
def test_nested_inputs_on_the_gpu_match_torchs_fast_path():
    t, ours = _pair(batch_first=True)
    x = torch.nested.nested_tensor([torch.randn(n, E) for n in (4, 9, 1)], device=DEV)
    (a, wa), (b, wb) = ours(x, x, x), t(x, x, x)
    assert a.is_nested and a.device.type == "cuda"
    for ai, bi in zip(a.unbind(), b.unbind()):
        torch.testing.assert_close(ai, bi, atol=1e-4, rtol=1e-4)
    # torch's CUDA kernel pads its weights to a multiple of 8 and gives its padded query rows
    # uniform weights (its CPU kernel gives zeros); ours are (N, L_max, S_max), those rows zero
    assert wa.shape == (3, 9, 9) and wb[..., 9:].abs().sum() == 0
    for i, n in enumerate((4, 9, 1)):
        torch.testing.assert_close(wa[i, :n], wb[i, :n, :9], atol=1e-4, rtol=1e-4)
        assert wa[i, n:].abs().sum() == 0


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_torchscript_on_the_gpu_matches_eager():
    _, ours = _pair(batch_first=True)
    scripted = torch.jit.script(ours)
    q = torch.randn(B, L, E, device=DEV)
    am, kpm = _masks(torch.bool)
    am, kpm = am[:, :L], kpm[:, :L]
    kw = dict(attn_mask=am, key_padding_mask=kpm)
    torch.testing.assert_close(scripted(q, q, q, **kw), ours(q, q, q, **kw), atol=1e-4, rtol=1e-4)

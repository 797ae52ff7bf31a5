"""Our Triton kernels against the fp64 oracle. Without a GPU (CI) they run on the CPU under
Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest), on small shapes; on a GPU
the ``cuda`` tests run them compiled, through the backend and ``auto``."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from conftest import oracle

triton = pytest.importorskip("triton")
from multihead.kernels.flash_fwd import flash_forward  # noqa: E402

M = mh.masks
DEV = "cuda" if torch.cuda.is_available() else "cpu"

CASES = [  # B, H, Hkv, Sq, Sk, D, Dv, mask
    (1, 2, 2, 40, 40, 16, 16, "none"),
    (2, 4, 2, 37, 53, 32, 16, "causal"),
    (2, 4, 1, 53, 37, 32, 32, "causal"),                       # MQA; early rows see nothing
    (1, 2, 1, 70, 70, 16, 16, "window 5"),
    (2, 2, 2, 33, 65, 64, 64, "window 9 upper_left"),
    (2, 4, 2, 20, 40, 16, 16, "causal & padding"),
    (2, 2, 2, 20, 40, 16, 48, "padding"),                      # a sequence of length 0
    (3, 2, 1, 1, 50, 32, 32, "window 7 & padding"),            # a decoding step
]


def _mask(name: str, B: int, Sk: int = 50):
    lengths = torch.tensor([40, 13, 25][:B]) if "padding" in name else None
    if name == "padding":
        lengths = torch.tensor([0, 13][:B])
    band = None
    if name.startswith("causal"):
        band = M.causal()
    elif name.startswith("window"):
        parts = name.split()
        band = M.sliding_window(int(parts[1]), align="upper_left" if "upper_left" in name
                                else "lower_right")
    pad = M.padding(lengths.clamp(max=Sk)) if lengths is not None else None
    return band if pad is None else pad if band is None else band & pad


def _inputs(B, H, Hkv, Sq, Sk, D, Dv, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEV, dtype)  # noqa: E731
    return mk(B, H, Sq, D), mk(B, Hkv, Sk, D), mk(B, Hkv, Sk, Dv)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[f"{c[7]}-{c[3]}x{c[4]}-H{c[1]}kv{c[2]}"
                                             for c in CASES])
def test_forward_and_lse_equal_the_fp64_oracle_within_the_error_rule(case, dtype):
    if dtype == torch.bfloat16 and DEV == "cpu":
        pytest.skip("Triton's interpreter gives wrong bf16 results (numpy has no bf16); "
                    "bf16 runs in the cuda tests")
    B, H, Hkv, Sq, Sk, D, Dv, name = case
    q, k, v = _inputs(B, H, Hkv, Sq, Sk, D, Dv, dtype)
    mask = _mask(name, B, Sk)
    m = mask.to(DEV) if mask is not None else None
    band = mh.functional.backend.triton._band(
        mh.functional._call.make_call(q, k, v, mask=m, scale=None, dropout_p=0.0,
                                      return_weights=False, return_lse=False))
    lens = band.padding.lengths.expand(B).contiguous() if band.padding is not None else None
    out, lse = flash_forward(q, k, v, scale=D ** -0.5, causal=band.causal, window=band.window,
                             offset=band.offset, kv_lengths=lens)
    ref, ref_lse = mh.attention(q.double(), k.double(), v.double(), mask=m,
                                backend="reference", return_lse=True)
    plain = mh.attention(q.float(), k.float(), v.float(), mask=m, backend="reference").to(dtype)
    err, base = (out.double() - ref).abs().max(), (plain.double() - ref).abs().max()
    assert err <= 2 * base + 2 * torch.finfo(dtype).eps, (err, base)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))          # empty rows: -inf
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin].double(), ref_lse[fin], atol=1e-4, rtol=1e-4)
    assert (out[~fin] == 0).all()                                       # ... and zeros


def test_the_backend_declines_what_it_cannot_run_and_says_why():
    q = torch.randn(1, 2, 8, 16, dtype=torch.float16)
    e = mh.explain(q, q, q, mask=M.sliding_window(4) & M.alibi(2), profile="h100")
    row = next(r for r in e.rows if r.name == "triton")
    assert row.plan is None and any("alibi" in r or "band" in r for r in row.reasons)
    g = q.clone().requires_grad_()
    e = mh.explain(g, q, q, mask=M.sliding_window(4), profile="h100")
    row = next(r for r in e.rows if r.name == "triton")
    assert "has no backward (gradients are needed)" in row.reasons


def test_auto_prices_the_band_it_skips_on_an_h100():
    """On the H100 profile auto picks the kernel for windows (it computes ~3% of the pairs
    at 16k) and keeps SDPA where both would do the same work (dense, causal, decoding)."""
    def chosen(B, H, Hkv, Sq, Sk, mask):
        q = torch.empty(B, H, Sq, 128, dtype=torch.bfloat16, device="meta")
        k = torch.empty(B, Hkv, Sk, 128, dtype=torch.bfloat16, device="meta")
        return mh.explain(q, k, k, mask=mask, profile="h100").chosen
    assert chosen(2, 16, 16, 16384, 16384, M.sliding_window(256)) == "triton"
    assert chosen(1, 16, 16, 16384, 16384, M.causal()) == "sdpa"
    assert chosen(1, 16, 16, 4096, 4096, None) == "sdpa"
    assert chosen(1, 32, 8, 1, 32768, M.causal()) == "sdpa"


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["causal", "window 9 upper_left", "causal & padding",
                                  "window 7 & padding"])
def test_the_backend_through_attention_on_cuda(name):
    for B, H, Hkv, Sq, Sk, D, Dv, _ in CASES:
        q, k, v = _inputs(B, H, Hkv, Sq, Sk, D, Dv, torch.bfloat16)
        mask = _mask(name, B, Sk).to("cuda")
        out = mh.attention(q, k, v, mask=mask, backend="triton")
        ref = oracle(q, k, v, mask)
        plain = mh.attention(q.float(), k.float(), v.float(), mask=mask, backend="sdpa")
        base = (plain.to(torch.bfloat16).double() - ref).abs().max()
        assert (out.double() - ref).abs().max() <= 2 * base + 1e-2

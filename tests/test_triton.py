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


# -- the split-K decode kernel -------------------------------------------------------------

from multihead.kernels.decode import decode_forward, num_splits  # noqa: E402

DECODE = [  # B, H, Hkv, Sq, Sk, D, mask, splits
    (2, 8, 2, 1, 200, 32, "causal", 3),                   # GQA decode step, 3 splits
    (1, 4, 1, 3, 130, 16, "window 20", 2),                # MQA, a 3-token draft to verify
    (3, 4, 4, 2, 64, 16, "none", 5),                      # MHA, more splits than key blocks
    (3, 6, 2, 5, 150, 32, "causal & padding", 4),         # a cache with one empty sequence
    (2, 4, 2, 16, 90, 64, "window 7 & padding", None),    # the most queries it takes
]


def _decode_mask(name: str, B: int, Sk: int):
    band = None if name.startswith("none") else M.causal() if name.startswith("causal") \
        else M.sliding_window(int(name.split()[1]))
    if "padding" not in name:
        return band
    pad = M.padding(torch.tensor([Sk, 0, Sk - 17][:B]))
    return pad if band is None else band & pad


def _band_of(q, k, v, mask):
    return mh.functional.backend.triton._band(
        mh.functional._call.make_call(q, k, v, mask=mask, scale=None, dropout_p=0.0,
                                      return_weights=False, return_lse=False))


def _check_decode(q, k, v, mask, splits=None):
    band = _band_of(q, k, v, mask)
    B = q.shape[0]
    lens = band.padding.lengths.expand(B).contiguous() if band.padding is not None else None
    out, lse = decode_forward(q, k, v, scale=q.shape[-1] ** -0.5, causal=band.causal,
                              window=band.window, offset=band.offset, kv_lengths=lens,
                              splits=splits)
    ref, ref_lse = mh.attention(q.double(), k.double(), v.double(), mask=mask,
                                backend="reference", return_lse=True)
    plain = mh.attention(q.float(), k.float(), v.float(), mask=mask, backend="reference")
    err = (out.double() - ref).abs().max()
    base = (plain.to(q.dtype).double() - ref).abs().max()
    assert err <= 2 * base + 2 * torch.finfo(q.dtype).eps, (err, base)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))          # empty rows: -inf
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin].double(), ref_lse[fin], atol=1e-4, rtol=1e-4)
    assert (out[~fin] == 0).all()                                       # ... and zeros


@pytest.mark.parametrize("case", DECODE, ids=[f"{c[6]}-{c[3]}x{c[4]}-H{c[1]}kv{c[2]}"
                                              for c in DECODE])
def test_split_k_decode_equals_the_fp64_oracle(case):
    B, H, Hkv, Sq, Sk, D, name, splits = case
    q, k, v = _inputs(B, H, Hkv, Sq, Sk, D, D, torch.float16)
    mask = _decode_mask(name, B, Sk)
    _check_decode(q, k, v, mask.to(DEV) if mask is not None else None, splits)


def test_split_k_decode_reads_a_kv_cache_in_place():
    """The kernel takes the cache's own strided buffers (max_len slots, lengths filled)."""
    cache = mh.KVCache(2, 256, 2, 32, dtype=torch.float16, device=DEV)
    g = torch.Generator().manual_seed(3)
    for n in (100, 1, 1):
        kv = [torch.randn(2, 2, n, 32, generator=g).to(DEV, torch.float16) for _ in range(2)]
        k, v, _ = cache.update(*kv)                   # views of the cache's buffers
    assert k.data_ptr() == cache.k.data_ptr() and not k.is_contiguous()
    q = torch.randn(2, 8, 1, 32, generator=g).to(DEV, torch.float16)
    _check_decode(q, k, v, M.causal())


def test_num_splits_fills_the_device_with_whole_key_blocks():
    assert num_splits(1, 8, 32768) == 33            # 264 programs over 8 K/V heads
    assert num_splits(8, 8, 32768) == 5
    assert num_splits(1, 8, 100) == 2               # never more splits than key blocks
    assert num_splits(64, 8, 4096) == 1


def test_decoding_calls_plan_the_split_k_kernel_and_auto_keeps_sdpa_until_measured():
    q = torch.empty(1, 32, 1, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 8, 32768, 128, dtype=torch.bfloat16, device="meta")
    e = mh.explain(q, k, k, mask=M.causal(), profile="h100", backend="triton")
    assert "split-K decode: 33 splits" in str(e) and "4 query head(s)" in str(e)
    assert mh.explain(q, k, k, mask=M.causal(), profile="h100").chosen == "sdpa"

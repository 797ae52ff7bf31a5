"""One GQA decode step on a KV cache: ours vs SDPA(enable_gqa) vs Hugging Face's repeat-K/V.

Run:  .venv/bin/python -m benchmarks.decode             (about 1 minute on a 2-core CPU)

B=1, H=32 query heads, Hkv=8 K/V heads, D=128, fp32, one new token (Sq=1) attending to a
cache of 4k and 32k tokens. Decoding reads the whole cache once per step, so its limit is
memory bandwidth: we report cache bytes read / step time as a fraction of the read
bandwidth measured in the same run (a large tensor reduction).
"""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F

import multihead as mh
from benchmarks import no_options
from benchmarks.core import machine, timeit
from multihead.bench.peers import hf_gqa_eager as hf_eager, repeat_kv

B, H, HKV, D = 1, 32, 8, 128


def read_bandwidth(gib: float = 1.0) -> float:
    """Bytes per second of a full read of a ``gib`` GiB fp32 tensor (median of repeats)."""
    x = torch.ones(int(gib * 2**30) // 4)
    t = timeit(lambda: x.sum(), reps=7, warmup=2)
    return x.nbytes / t


def hf_sdpa(q, k, v):
    """Hugging Face's sdpa path for GQA: repeat K/V, then the fused kernel."""
    g = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, repeat_kv(k, g), repeat_kv(v, g))


def main() -> None:
    bw = read_bandwidth()
    rows = []
    for S in (4096, 32768):
        cache = mh.KVCache(B, S, HKV, D)
        g = torch.Generator().manual_seed(0)
        cache.update(torch.randn(B, HKV, S, D, generator=g), torch.randn(B, HKV, S, D, generator=g))
        k, v = cache.k[:, :, :cache.seen], cache.v[:, :, :cache.seen]        # (B, Hkv, S, D)
        q = torch.randn(B, H, 1, D, generator=g)
        mask = mh.masks.causal()
        ref = hf_eager(q, k, v)
        for f in (lambda: mh.attention(q, k, v, mask=mask),
                  lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True),
                  lambda: hf_sdpa(q, k, v)):
            torch.testing.assert_close(f(), ref, atol=1e-5, rtol=1e-4)
        t = {"ours": timeit(lambda: mh.attention(q, k, v, mask=mask), reps=21, warmup=3),
             "sdpa_enable_gqa": timeit(lambda: F.scaled_dot_product_attention(
                 q, k, v, enable_gqa=True), reps=21, warmup=3),
             "hf_repeat_kv_eager": timeit(lambda: hf_eager(q, k, v), reps=11, warmup=2),
             "hf_repeat_kv_sdpa": timeit(lambda: hf_sdpa(q, k, v), reps=11, warmup=2)}
        read = k.nbytes + v.nbytes
        rows.append({
            "cache_len": S, "cache_MiB": read / 2**20,
            **{f"{n}_ms": s * 1e3 for n, s in t.items()},
            "vs_sdpa_enable_gqa": t["sdpa_enable_gqa"] / t["ours"],
            "vs_hf_repeat_kv_eager": t["hf_repeat_kv_eager"] / t["ours"],
            "vs_hf_repeat_kv_sdpa": t["hf_repeat_kv_sdpa"] / t["ours"],
            "achieved_GB_s": read / t["ours"] / 1e9,
            "fraction_of_bandwidth": read / t["ours"] / bw,
            "backend": mh.explain(q, k, v, mask=mask).chosen})
    print(json.dumps({"machine": machine(), "read_bandwidth_GB_s": bw / 1e9,
                      "targets": ">= 2.5x sdpa enable_gqa, >= 20x repeat-K/V", "rows": rows},
                     indent=2))


if __name__ == "__main__":
    no_options(__doc__)
    main()

"""Benchmarks of the core attention call (issue: core). Speed is measured here, never in tests.

Run:  .venv/bin/python -m benchmarks.core            (about 3 minutes on a 2-core CPU)
Every ratio compares peers measured in the same run on the same machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

import multihead as mh
from benchmarks import no_options
from multihead.bench.measure import describe, measure


def timeit(fn, reps: int = 5, warmup: int = 1) -> float:
    """Median wall time of fn() in seconds (multihead bench's measure, on the CPU)."""
    return measure(fn, torch.device("cpu"), reps=reps, warmup=warmup).median


def machine() -> str:
    return describe(torch.device("cpu"))


def dense_auto_vs_sdpa(results):
    for S in (1024, 2048):
        q, k, v = (torch.randn(2, 12, S, 64) for _ in range(3))
        t_sdpa = timeit(lambda: F.scaled_dot_product_attention(q, k, v))
        t_auto = timeit(lambda: mh.attention(q, k, v))
        results.append(dict(case=f"dense S={S} B=2 H=12 D=64", ours_ms=t_auto * 1e3,
                            peer="F.scaled_dot_product_attention", peer_ms=t_sdpa * 1e3,
                            throughput_vs_peer=t_sdpa / t_auto, target=">= 0.95x"))


def sliding_window(results, S=4096, H=12, D=64, W=256):
    q, k, v = (torch.randn(1, H, S, D) for _ in range(3))
    m = mh.masks.sliding_window(W)
    dense = m.materialize(S, S)
    t_sdpa = timeit(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=dense))
    t_bs = timeit(lambda: mh.attention(q, k, v, mask=m, backend="blocksparse"))
    results.append(dict(case=f"sliding window {W}, S={S} H={H} D={D}, forward", ours_ms=t_bs * 1e3,
                        peer="SDPA + dense bool mask", peer_ms=t_sdpa * 1e3,
                        throughput_vs_peer=t_sdpa / t_bs, target=">= 8x"))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    t_sdpa_b = timeit(lambda: F.scaled_dot_product_attention(qg, kg, vg, attn_mask=dense).sum().backward(), reps=3)
    t_bs_b = timeit(lambda: mh.attention(qg, kg, vg, mask=m, backend="blocksparse").sum().backward(), reps=3)
    results.append(dict(case=f"sliding window {W}, S={S} H={H} D={D}, forward+backward",
                        ours_ms=t_bs_b * 1e3, peer="SDPA + dense bool mask", peer_ms=t_sdpa_b * 1e3,
                        throughput_vs_peer=t_sdpa_b / t_bs_b, target=">= 4x"))
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        t0 = time.perf_counter()
        bm = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (qi - ki < W), None, None, S, S,
                               device="cpu")
        flex = torch.compile(flex_attention, dynamic=False)
        flex(q, k, v, block_mask=bm)
        compile_s = time.perf_counter() - t0
        t_flex = timeit(lambda: flex(q, k, v, block_mask=bm))
        out = flex(q, k, v, block_mask=bm)
        err = (out - mh.attention(q, k, v, mask=m)).abs().max().item()
        results.append(dict(case=f"sliding window {W}, S={S}, forward (steady state)", ours_ms=t_bs * 1e3,
                            peer=f"flex_attention compiled (compile {compile_s:.1f} s; ours: none)",
                            peer_ms=t_flex * 1e3, throughput_vs_peer=t_flex / t_bs, target=">= 1.0x",
                            max_abs_diff=err))
    except Exception as exc:  # flex is optional: say why it did not run
        results.append(dict(case=f"sliding window {W}, S={S}, forward", peer="flex_attention compiled",
                            note=f"not measured: {type(exc).__name__}: {str(exc)[:200]}"))


_MEM = r"""
import sys, torch, multihead as mh
S, H, D, backend, mask = 16384, 12, 64, sys.argv[1], sys.argv[2]
torch.manual_seed(0)
q, k, v = (torch.randn(1, H, S, D) for _ in range(3))
m = {"none": None, "causal": mh.masks.causal(), "window": mh.masks.sliding_window(256)}[mask]
mh.attention(q[:, :, :128], k[:, :, :128], v[:, :, :128], mask=m, backend=backend)  # warm up
def hwm():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmHWM")).split()[1]) * 1024
def rss():
    return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) * 1024
open("/proc/self/clear_refs", "w").write("5")  # reset the high-water mark
base = rss()
out = mh.attention(q, k, v, mask=m, backend=backend)
print((hwm() - base - out.numel() * out.element_size()) / 2**20)
"""


def peak_memory(results):
    for backend, mask in (("sdpa", "none"), ("sdpa", "causal"), ("blocksparse", "none"),
                          ("blocksparse", "causal"), ("blocksparse", "window")):
        r = subprocess.run([sys.executable, "-c", _MEM, backend, mask], capture_output=True, text=True)
        extra = float(r.stdout.strip()) if r.returncode == 0 else None
        naive = 12 * 16384 * 16384 * 4 / 2**20
        results.append(dict(case=f"peak memory, forward S=16384 H=12 D=64, {backend}, mask={mask}",
                            extra_MiB=extra, naive_scores_MiB=naive, target="< 100 MiB",
                            note=r.stderr[-200:] if r.returncode else ""))


def main():
    torch.manual_seed(0)
    results = []
    print(f"machine: {machine()}", flush=True)
    for fn in (dense_auto_vs_sdpa, sliding_window, peak_memory):
        fn(results)
        for r in results[-5:]:
            pass
    for r in results:
        print(json.dumps(r))
    return results


if __name__ == "__main__":
    no_options(__doc__)
    main()

"""One Llama attention layer's decoding step: our module on a KV cache vs Hugging Face's.

Run:  .venv/bin/python -m benchmarks.module_decode [--device cuda] [--dtype bf16] [--embed-dim E]

A layer of Llama-3.2-1B's shape (E=2048, H=32, Hkv=8, D=64, RoPE base 500000, no
biases; ``--embed-dim`` keeps D=64 and 4 query heads per K/V head): ours is :class:`multihead.MultiHeadAttention` on a :class:`multihead.KVCache`
and on a :class:`multihead.PagedKVCache` (pages of 16), the peer is Hugging Face's
``LlamaAttention`` with its rotary embedding and a ``DynamicCache``
(:class:`multihead.bench.peers.HFLlamaDecoder`, ``sdpa`` and ``eager``), holding the same
weights. After a prompt of 512 tokens, each decodes ``--steps`` tokens one at a time (the
cache grows every step, as in generation; the peer's rotary embedding, which a model computes
once per token for all its layers, is computed ahead, outside its timing); reported: the median time per step, and ours
against the peer measured in the same run. The outputs are checked equal first. On a GPU a
step this small is bound by host time (the Python and kernel launches of each call).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import time

import torch

import multihead as mh
from benchmarks.core import machine
from multihead.bench.peers import HFLlamaDecoder

BASE, PROMPT, D = 500000.0, 512, 64
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


#: the peer needs transformers (a GPU machine without it runs ours alone, and says so)
HAS_HF = importlib.util.find_spec("transformers") is not None


def _decode(layers: dict, xs, sync) -> dict:
    """Median seconds per step of each of ``layers`` over ``xs`` (one token each), the
    layers taking turns at every token (so the machine's drift reaches them alike)."""
    times = {name: [] for name in layers}
    for x in xs:
        for name, step in layers.items():
            sync()
            t = time.perf_counter()
            step(x)
            sync()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=sorted(DTYPES))
    p.add_argument("--steps", type=int, default=128)
    p.add_argument("--embed-dim", type=int, default=2048, help="E (a multiple of 256)")
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args(argv)
    dev, dtype = torch.device(a.device), DTYPES[a.dtype]
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    E = a.embed_dim
    H, HKV = E // D, max(1, E // D // 4)
    print(f"machine: {machine()}; {a.dtype} on {dev}; E={E} H={H} Hkv={HKV} D={D}", flush=True)
    if not HAS_HF:
        print("transformers is not installed: the Hugging Face peer is left out", flush=True)
    torch.manual_seed(0)
    m = mh.MultiHeadAttention(E, H, num_kv_heads=HKV, bias=False, device=dev, dtype=dtype,
                              rope=mh.RotaryEmbedding(D, base=BASE)).eval()
    causal, rows = mh.masks.causal(), []
    with torch.no_grad():
        for B in (1, 8):
            g = torch.Generator(device=dev).manual_seed(B)
            prompt = torch.randn(B, PROMPT, E, generator=g, device=dev, dtype=dtype)
            xs = [torch.randn(B, 1, E, generator=g, device=dev, dtype=dtype)
                  for _ in range(a.steps)]
            static = m.make_cache(B, PROMPT + a.steps)
            pool = mh.PagedKVCache(num_pages=B * (-(-(PROMPT + a.steps) // 16)), page_size=16,
                                   num_kv_heads=HKV, head_dim=D, dtype=dtype, device=dev)
            paged = pool.batch([pool.add_sequence() for _ in range(B)])
            peers = {name: HFLlamaDecoder(m, name) for name in ("sdpa", "eager")} \
                if HAS_HF else {}
            layers = {"ours, KVCache": lambda x, c=static: m(x, cache=c, mask=causal),
                      "ours, PagedKVCache": lambda x, c=paged: m(x, cache=c, mask=causal),
                      **{f"HF LlamaAttention ({n})": hf for n, hf in peers.items()}}
            first = {name: step(prompt) for name, step in layers.items()}
            # a model computes HF's rotary embedding once per token for all its layers (ours
            # reads a table in each layer): computed ahead, outside the peer's timing
            for n, hf in peers.items():
                rotary = iter([hf.rotary(x, PROMPT + i) for i, x in enumerate(xs)])
                layers[f"HF LlamaAttention ({n})"] = lambda x, hf=hf, r=rotary: hf(x, next(r))
            ref = first["HF LlamaAttention (sdpa)" if HAS_HF else "ours, KVCache"]
            tol = 2e-5 if dtype == torch.float32 else 5e-2
            for name, out in first.items():
                torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
            took = _decode(layers, xs, sync)
            best_peer = min((v for k, v in took.items() if k.startswith("HF")), default=None)
            for name, t in took.items():
                ratio = round(best_peer / t, 2) if best_peer else None
                rows.append(dict(E=E, B=B, layer=name, step_us=round(t * 1e6, 1),
                                 speedup_vs_best_hf=ratio))
                print(f"B={B} {name:<28} {t * 1e6:8.1f} us per step" + (
                    f" ({ratio:4.2f}x the faster HF layer)" if ratio else ""), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()

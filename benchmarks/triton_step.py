"""Where a step's time goes on a GPU: kernels, idle gaps, host calls (issue 12).

In the fifth session the window-256 training step (B=1 H=16 S=16384 D=128 bf16) took
1.20 ms back to back while its kernels took 0.76 ms; compiled FlexAttention's took 0.93 ms
for 0.79 ms of kernels. So our GPU waited about 0.4 ms per step. This splits each case:

- **step**: time per call, ``--steps`` calls back to back between two CUDA events;
- **issue**: the host's wall time to issue those calls (no sync inside). Close to *step*
  with the kernels far shorter means the host is the bound; close to *step* with a
  synchronizing call listed below means a sync;
- **kernels**: GPU time of each kernel per call (torch profiler), and their sum;
- **idle**: step - kernels, the GPU waiting;
- **CUDA calls**: the runtime and driver calls per step with their host time (launches,
  copies, allocations, synchronizations, events), from the profiler.

Run on a CUDA machine (``--device cpu --small --no-flex --backend blocksparse`` is a dry
run of the plumbing)::

    python -m benchmarks.triton_step [--case NAME] [--out step.json]

Notation: B batch, H query heads, Hkv K/V heads, S length, L cache length, D head dim.
Decoding runs B=1 with a cache of L (4096) and B=8 with 8L (32768).
"""

from __future__ import annotations

import argparse
import time

import torch

import multihead as mh

from benchmarks import save_json


def cases(device: str, small: bool, backend: str, flex: bool) -> dict:
    """``{name: call}`` (each call one step on fresh, fixed inputs)."""
    S, D, L = (256, 64, 512) if small else (16384, 128, 4096)
    dt = torch.bfloat16
    g = torch.Generator().manual_seed(0)
    new = lambda *shape, grad=False: (torch.randn(*shape, generator=g)          # noqa: E731
                                      .to(device, dt).requires_grad_(grad))
    q, k, v = (new(1, 16, S, D, grad=True) for _ in range(3))
    dout = new(1, 16, S, D)
    lengths, total = [], 0
    while total < S:                                          # documents of 64..2048 tokens
        lengths.append(min(int(torch.randint(64, 2049, (1,), generator=g)), S - total))
        total += lengths[-1]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])

    def train(fn):
        def step():
            torch.autograd.backward(fn(), dout)
            q.grad = k.grad = v.grad = None
        return step

    window = mh.masks.sliding_window(256)
    docs = mh.masks.document(cu_seqlens=cu).to(device)
    out = {
        "window 256, fwd+bwd": train(lambda: mh.attention(q, k, v, mask=window, backend=backend)),
        "documents, fwd+bwd": train(lambda: mh.attention(q, k, v, mask=docs, backend=backend)),
        "window 256, fwd": lambda: mh.attention(q.detach(), k.detach(), v.detach(), mask=window,
                                                backend=backend),
    }
    causal = mh.masks.causal()
    for B, n in ((1, L), (8, 8 * L)):                         # decoding: H=32 Hkv=8 D=128
        qd, kd, vd = new(B, 32, 1, 128), new(B, 8, n, 128), new(B, 8, n, 128)
        at = f"decode B={B} L={n}"
        out[f"{at}, ours"] = lambda qd=qd, kd=kd, vd=vd: mh.attention(qd, kd, vd, mask=causal,
                                                                       backend=backend)
        out[f"{at}, SDPA"] = lambda qd=qd, kd=kd, vd=vd: (
            torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True))
    if flex:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
        from multihead.bench.flex import mods
        compiled = torch.compile(flex_attention, dynamic=False)
        for name, kind, extra in (("window 256", "window", dict(window=256)),
                                  ("documents", "documents", dict(doc_lengths=lengths))):
            mask_mod = mods(kind, heads=16, device=device, **extra)[0]
            block = create_block_mask(mask_mod, None, None, S, S, device=device)
            out[f"{name}, fwd+bwd, flex"] = train(
                lambda block=block: compiled(q, k, v, block_mask=block))
    return out


def _device_us(e) -> float:
    return getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0))


def split(call, steps: int, device: str) -> dict:
    """The figures of the module docstring for ``call`` (microseconds per step)."""
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(3):                                        # compile, plan, warm caches
        call()
    sync()
    t0 = time.perf_counter()
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    for _ in range(steps):
        call()
    issue = time.perf_counter() - t0
    if cuda:
        end.record()
    sync()
    step = start.elapsed_time(end) * 1e3 / steps if cuda else issue * 1e6 / steps
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            call()
        sync()
    kernels, api = {}, {}
    for e in prof.key_averages():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.key] = (e.count / steps, _device_us(e) / steps)
        elif e.key.startswith(("cuda", "cu")) and not e.key.startswith("cudnn"):
            api[e.key] = (e.count / steps, e.self_cpu_time_total / steps)
    busy = sum(us for _, us in kernels.values())
    return {"step_us": step, "issue_us": issue * 1e6 / steps, "kernels_us": busy,
            "idle_us": step - busy if cuda else None,
            "kernels": dict(sorted(kernels.items(), key=lambda kv: -kv[1][1])),
            "cuda_calls": dict(sorted(api.items(), key=lambda kv: -kv[1][1]))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", help="a case by name (default: all)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--small", action="store_true", help="small shapes (a dry run)")
    ap.add_argument("--no-flex", action="store_true", help="leave out compiled FlexAttention")
    ap.add_argument("--backend", default="triton", help="our backend (default: triton)")
    ap.add_argument("--out", default=None, help="write the figures as JSON")
    a = ap.parse_args(argv)
    rows = {}
    for name, call in cases(a.device, a.small, a.backend, not a.no_flex).items():
        if a.case and name not in a.case:
            continue
        r = rows[name] = split(call, a.steps, a.device)
        idle = "" if r["idle_us"] is None else f", GPU idle {r['idle_us']:.1f}"
        print(f"{name}: step {r['step_us']:.1f} us, issued in {r['issue_us']:.1f} us, "
              f"kernels {r['kernels_us']:.1f} us{idle}", flush=True)
        for kname, (n, us) in list(r["kernels"].items())[:8]:
            print(f"    kernel {n:4.1f}x {us:9.1f} us  {kname[:90]}")
        for cname, (n, us) in list(r["cuda_calls"].items())[:8]:
            print(f"    call   {n:4.1f}x {us:9.1f} us  {cname}")
    save_json(a.out, rows)


if __name__ == "__main__":
    main()

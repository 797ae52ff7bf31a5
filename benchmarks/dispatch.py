"""How good are auto's choices on this machine? Every able backend, timed, per call.

Run:  .venv/bin/python -m benchmarks.dispatch [--quick] [--device cuda] [--dtype bf16]
                                               [--threads 1] [--wide]
      .venv/bin/python -m benchmarks.dispatch --overhead [--device cuda]

For a grid of calls (mask kinds, lengths, GQA, decoding, lse, gradients) every backend
that can run the call is timed; the row shows auto's choice, the fastest backend, and the
regret t(auto) / t(fastest) (1.00: auto picked the fastest). The cost model's estimates
are printed beside the measurements, so a profile can be checked against the machine.
"""

from __future__ import annotations

import argparse
import time

import torch

import multihead as mh
from multihead.functional import dispatch, profiles
from multihead.bench.measure import measure
from multihead.functional._call import make_call

from benchmarks import save_json

M = mh.masks


def _time(fn, device, reps=5) -> float:
    """Median seconds of fn() (multihead bench's timing: CUDA events in settled batches)."""
    return measure(fn, device, reps=reps).median


def _masks(S: int, B: int, device):
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(S // 4, S + 1, (B,), generator=g)
    docs = torch.arange(S) // max(S // 8, 1)
    yield "none", None
    yield "causal", M.causal()
    yield "window 64", M.sliding_window(64)
    yield f"window {S // 4}", M.sliding_window(max(S // 4, 1))
    yield "documents", M.document(docs).to(device)
    yield "interleaved docs", M.document(docs % 3).to(device)
    yield "padding", M.padding(lengths).to(device)
    yield "causal&padding", (M.causal() & M.padding(lengths)).to(device)
    yield "dense 50%", M.dense((torch.rand(S, S, generator=g) > 0.5).to(device))
    yield "alibi", M.alibi(8)
    yield "causal&alibi", M.causal() & M.alibi(8)


def _wide(device):
    """Batches and head counts beyond the grid's one sequence of 8 heads, with tensor masks
    (a float bias, a dense bool mask) and ALiBi, whose materialized forms grow with them."""
    for B, H, S in ((4, 8, 1024), (1, 16, 2048), (8, 8, 512), (1, 8, 1024)):
        g = torch.Generator().manual_seed(0)
        lengths = torch.randint(S // 4, S + 1, (B,), generator=g)
        pattern = torch.rand(S, S, generator=g) > 0.5
        pattern[:, 0] = True
        for name, mask in (("alibi", M.alibi(H)), ("causal&alibi", M.causal() & M.alibi(H)),
                           ("bias", M.bias(torch.randn(S, S, generator=g))),
                           ("padding", M.padding(lengths)),
                           ("causal&padding", M.causal() & M.padding(lengths)),
                           ("dense 50%", M.dense(pattern))):
            yield f"{name} B={B} H={H} S={S}", dict(shape=(B, H, H, S, S, 64),
                                                   mask=mask.to(device))


def _calls(quick: bool, device, dtype, wide: bool = False):
    if wide:
        yield from _wide(device)
        return
    sizes = (256, 1024) if quick else (128, 512, 2048)
    for S in sizes:
        for name, mask in _masks(S, 1, device):
            yield f"{name} S={S}", dict(shape=(1, 8, 8, S, S, 64), mask=mask)
    for S in sizes:
        yield f"lse S={S}", dict(shape=(1, 8, 8, S, S, 64), mask=None, lse=True)
        yield f"causal lse S={S}", dict(shape=(1, 8, 8, S, S, 64), mask=M.causal(), lse=True)
        yield f"causal grad S={S}", dict(shape=(1, 8, 8, S, S, 64), mask=M.causal(), grad=True)
        yield f"window 64 grad S={S}", dict(shape=(1, 8, 8, S, S, 64),
                                            mask=M.sliding_window(64), grad=True)
    for L in ((1024, 4096) if quick else (1024, 8192)):
        yield f"GQA decode L={L}", dict(shape=(1, 32, 8, 1, L, 128), mask=M.causal())
        yield f"GQA chunk of 16, L={L}", dict(shape=(1, 32, 8, 16, L, 128), mask=M.causal())


def run(quick: bool, device: str, dtype: str, wide: bool = False) -> list[dict]:
    dev, dt = torch.device(device), {"fp32": torch.float32, "bf16": torch.bfloat16,
                                     "fp16": torch.float16}[dtype]
    profile = profiles.profile_for(dev)
    rows = []
    for label, c in _calls(quick, dev, dt, wide):
        B, H, Hkv, Sq, Sk, D = c["shape"]
        grad = c.get("grad", False)
        q = torch.randn(B, H, Sq, D, device=dev, dtype=dt, requires_grad=grad)
        k, v = (torch.randn(B, Hkv, Sk, D, device=dev, dtype=dt, requires_grad=grad)
                for _ in range(2))
        kw = dict(mask=c["mask"], return_lse=c.get("lse", False))
        call = make_call(q, k, v, scale=None, dropout_p=0.0, return_weights=False, **kw)
        est, measured = {}, {}
        for r in dispatch._rows(call, profile, dev.type):
            if r.plan is None:
                continue
            est[r.name] = r.seconds

            def fn(name=r.name):
                res = mh.attention(q, k, v, backend=name, **kw)
                out = res[0] if isinstance(res, tuple) else res
                if grad:
                    out.float().sum().backward()
            if r.seconds > 2.0:                  # would take too long: estimate only
                continue
            measured[r.name] = _time(fn, dev, reps=3 if quick else 5)
        chosen = mh.explain(q, k, v, **kw).chosen
        best = min(measured, key=measured.get)
        regret = measured[chosen] / measured[best] if chosen in measured else float("nan")
        rows.append(dict(case=label, chosen=chosen, fastest=best, regret=regret,
                         measured_ms={n: t * 1e3 for n, t in measured.items()},
                         estimated_ms={n: t * 1e3 for n, t in est.items()}))
        times = "  ".join(f"{n} {measured[n] * 1e3:.2f}/{est[n] * 1e3:.2f}" for n in measured)
        print(f"{label:<28} auto {chosen:<11} fastest {best:<11} regret {regret:4.2f}   "
              f"(measured/estimated ms) {times}", flush=True)
    worst = max(r["regret"] for r in rows)
    mean = sum(r["regret"] for r in rows) / len(rows)
    print(f"{len(rows)} calls on {profile.name}: auto picked the fastest in "
          f"{sum(r['chosen'] == r['fastest'] for r in rows)}; mean regret {mean:.2f}, "
          f"worst {worst:.2f}")
    return rows


def overhead(device: str = "cpu", n: int = 20000) -> dict:
    """Per-call overhead of attention() over the SDPA call it wraps, for dense and causal
    calls small enough that the kernel is not the cost, and for a key padding mask: a bool
    tensor made afresh at each call (``tensor``: SDPA gets the same tensor) and a padding
    mask object used again (``padding``, as a forward's layers use it): best of 5 loops of
    ``n`` calls; without gradients, and (``dense+grad``) for a forward that records them
    (the second-order node of :mod:`multihead._second_order` is then on the call)."""
    dev = torch.device(device)
    q = torch.randn(1, 8, 16 if dev.type == "cpu" else 128, 64, device=dev)
    causal = M.causal()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    S = q.shape[2]
    keys, kept = torch.arange(S, device=dev), torch.tensor([S - 3], device=dev)
    fresh = lambda: (keys < kept[:, None])[:, None, None, :]           # (1, 1, 1, S) bool
    padding, allowed = M.padding(kept), fresh()
    pairs = {"dense": (lambda: sdpa(q, q, q), lambda: mh.attention(q, q, q)),
             "causal": (lambda: sdpa(q, q, q, is_causal=True),
                        lambda: mh.attention(q, q, q, mask=causal)),
             "tensor": (lambda: sdpa(q, q, q, attn_mask=fresh()),
                        lambda: mh.attention(q, q, q, mask=fresh())),
             "padding": (lambda: sdpa(q, q, q, attn_mask=allowed),
                         lambda: mh.attention(q, q, q, mask=padding))}

    def per_call(fn):
        for _ in range(200):
            fn()
        best = float("inf")
        for _ in range(5):
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            t = time.perf_counter()
            for _ in range(n):
                fn()
            if dev.type == "cuda":
                torch.cuda.synchronize(dev)
            best = min(best, (time.perf_counter() - t) / n)
        return best * 1e6
    out = {}

    def row(name, peer, ours):
        a, b = per_call(peer), per_call(ours)
        out[name] = dict(sdpa_us=a, ours_us=b, overhead_us=b - a)
        print(f"per-call {name:<10} S={q.shape[2]}: sdpa {a:6.1f} us, ours {b:6.1f} us, "
              f"overhead {b - a:5.1f} us", flush=True)
    with torch.no_grad():
        for name, (peer, ours) in pairs.items():
            row(name, peer, ours)
    t = q.clone().requires_grad_()
    row("dense+grad", lambda: sdpa(t, t, t), lambda: mh.attention(t, t, t))
    with torch.no_grad():
        out.update(growing(dev))
    return out


def growing(dev: torch.device, steps: int = 2000) -> dict:
    """Per-call time of a decoding step (H=8 Hkv=2 D=16, one query, causal) whose cache
    grows by one key per call, as a :class:`multihead.KVCache`'s views do, against the same
    step at a fixed length (the mean of the growing ones), through ``auto`` and through
    ``backend="sdpa"``; SDPA on the same views for scale. Best of 5 runs of ``steps``
    calls each way, timed back to back, each run over lengths not seen before (so no plan
    cached for an exact call serves them)."""
    L0 = 64
    q = torch.randn(1, 8, 1, 16, device=dev)
    k, v = (torch.randn(1, 2, L0 + 6 * steps, 16, device=dev) for _ in range(2))
    causal = M.causal()
    sdpa = torch.nn.functional.scaled_dot_product_attention
    calls = {"sdpa": lambda n: sdpa(q, k[:, :, :n], v[:, :, :n], enable_gqa=True),
             "auto": lambda n: mh.attention(q, k[:, :, :n], v[:, :, :n], mask=causal),
             "backend=sdpa": lambda n: mh.attention(q, k[:, :, :n], v[:, :, :n], mask=causal,
                                                    backend="sdpa")}
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)

    def timed(fn, lengths) -> float:
        sync()
        t = time.perf_counter()
        for n in lengths:
            fn(n)
        sync()
        return (time.perf_counter() - t) / steps * 1e6

    out = {}
    for name, fn in calls.items():
        fixed = grown = float("inf")
        for run in range(6):               # run 0 warms up; each run times both, back to back
            start = L0 + run * steps
            f = timed(fn, [start + steps // 2] * steps)
            g = timed(fn, range(start, start + steps))
            if run:
                fixed, grown = min(fixed, f), min(grown, g)
        out[f"growing cache, {name}"] = dict(fixed_us=fixed, growing_us=grown)
        print(f"decode step, cache growing by one key per call, {name:<12}: fixed length "
              f"{fixed:6.1f} us, growing {grown:6.1f} us (+{grown - fixed:5.1f} us)", flush=True)
    return out


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--overhead", action="store_true", help="only the per-call overhead")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's own)")
    p.add_argument("--wide", action="store_true",
                   help="other batches and head counts, with tensor masks and ALiBi")
    a = p.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    result = overhead(a.device) if a.overhead else run(a.quick, a.device, a.dtype, a.wide)
    save_json(a.json, result)

"""Host time of our Triton kernels' calls, measured on a machine without a GPU (issue 12).

A GPU step whose kernels finish faster than Python can launch them is bound by host time:
what our wrappers and Triton's launcher do per call, before the driver's launch. That part
runs the same on any CPU, so it can be measured here. Triton's driver is replaced by one
that targets an H100 (sm_90) and whose launcher returns at once: every kernel is compiled
for real (cold: seconds each, then from Triton's disk cache), Triton's per-call path runs
for real (argument binding, specialization key, cache lookup), and only the driver's C
launch (about 5 us per kernel on an H100 host) is left out. The tensors live on the CPU and
no kernel reads them.

Each case reports the median host time per call (microseconds) over ``--reps`` calls, with
the direct launches of :mod:`multihead.kernels._launch` and through Triton's own per-call
path (``_launch.DIRECT`` off), and with ``--profile`` the functions that took the former.

With ``--device cuda`` the same calls run for real on a GPU, and the host time is each
call's wall time without a sync (the queue is drained every :data:`DRAIN` calls, outside
the timing); decoding through ``auto`` (SDPA) and SDPA itself are added for scale. On an
H100 the eager decoding step's host time was 2.5-4x the stubbed figure here (about 150 us
against 40): ``--device cuda --profile`` shows where that goes.

Run (not under ``TRITON_INTERPRET=1``)::

    python -m benchmarks.triton_host [--case NAME] [--profile] [--device cuda]

Notation: B batch, H query heads, Hkv K/V heads, S length, L cache length, D head dim.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import dataclasses
import io
import itertools
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import torch

import multihead as mh

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))   # sm90_compile


@contextlib.contextmanager
def stub_launches(arch: int = 90):
    """Within the block, Triton compiles for ``arch`` and launches nothing; the triton
    backend takes CPU tensors (nothing reads them) and the CPU's scan of each output for
    NaN, which a GPU call skips, is off."""
    from sm90_compile import stub_launches as stub

    from multihead.functional import nonfinite
    from multihead.functional.backend.triton import TritonFlash

    caps, finite = TritonFlash.capabilities, nonfinite._finite
    TritonFlash.capabilities = dataclasses.replace(caps, devices=None)
    nonfinite._finite = lambda *args: True
    try:
        with stub(arch):
            yield
    finally:
        TritonFlash.capabilities, nonfinite._finite = caps, finite


#: with ``--device cuda``: calls between two drains of the GPU's queue (not timed)
DRAIN = 64


def cases(name: str | None = None, device: str = "cpu") -> dict:
    """``{name: call}``: the calls to time, each with fresh inputs (bf16, D=128) on
    ``device``; on a GPU, also decoding through ``auto`` and through SDPA."""
    from multihead.kernels import ops
    from multihead.kernels.decode import decode_forward

    bf = dict(dtype=torch.bfloat16, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    # a training step, B=1 H=16 S=512: short, since what a CPU does with the buffers a
    # call allocates (zero-filling, say) is real work here and a launch on a GPU
    q, k, v = (torch.randn(1, 16, 512, 128, generator=g, **bf).requires_grad_()
               for _ in range(3))
    dout = torch.randn(1, 16, 512, 128, generator=g, **bf)

    def step(window):
        def run():
            out, lse = ops.attention(q, k, v, 128 ** -0.5, True, window, 0, None)
            torch.autograd.grad(out, (q, k, v), dout)
        return run

    def layer(mask, q, k, v, grad):
        def run():
            out = mh.attention(q, k, v, mask=mask, backend="triton")
            if grad:
                torch.autograd.grad(out, (q, k, v), dout)
        return run

    # a decoding step: H=32 Hkv=8 L=4096, B=1
    qd = torch.randn(1, 32, 1, 128, generator=g, **bf)
    kd, vd = (torch.randn(1, 8, 4096, 128, generator=g, **bf) for _ in range(2))
    window = mh.masks.sliding_window(256)
    all_cases = {
        "window 256, fwd": lambda: ops.attention(q.detach(), k.detach(), v.detach(),
                                                 128 ** -0.5, True, 256, 0, None),
        "window 256, fwd+bwd": step(256),
        "causal, fwd+bwd": step(0),
        "decode L=4096": lambda: decode_forward(qd, kd, vd, scale=128 ** -0.5, causal=True,
                                                offset=4095),
        "mh.attention window 256, fwd": layer(window, q.detach(), k.detach(), v.detach(),
                                              False),
        "mh.attention window 256, fwd+bwd": layer(window, q, k, v, True),
        "mh.attention decode L=4096": layer(mh.masks.causal(), qd, kd, vd, False),
    }
    # a decoding step whose cache grows by one key per call (4,096 new lengths, then again)
    kg, vg = (torch.randn(1, 8, 8192, 128, generator=g, **bf) for _ in range(2))
    calls = itertools.count()

    def growing():
        n = 4096 + next(calls) % 4096
        mh.attention(qd, kg[:, :, :n], vg[:, :, :n], mask=mh.masks.causal(), backend="triton")
    all_cases["mh.attention decode, growing"] = growing
    if device != "cpu":
        causal = mh.masks.causal()
        all_cases["mh.attention decode L=4096, auto"] = lambda: mh.attention(
            qd, kd, vd, mask=causal)
        all_cases["sdpa decode L=4096"] = lambda: torch.nn.functional.scaled_dot_product_attention(
            qd, kd, vd, enable_gqa=True)
    return {n: c for n, c in all_cases.items() if name is None or n == name}


def measure(call, reps: int, drain=lambda: None) -> float:
    """Median seconds of ``reps`` calls after three warm-ups (the first compiles), with
    ``drain()`` (a GPU sync) between every :data:`DRAIN` calls, untimed."""
    for _ in range(3):
        call()
    drain()
    times = []
    for i in range(reps):
        t0 = time.perf_counter()
        call()
        times.append(time.perf_counter() - t0)
        if i % DRAIN == DRAIN - 1:
            drain()
    drain()
    return statistics.median(times)


def profile(call, reps: int, top: int = 25) -> str:
    """The ``top`` functions by own time over ``reps`` calls, as text."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(reps):
        call()
    prof.disable()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    return text.getvalue()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--case", help="one case by name (default: all)")
    parser.add_argument("--reps", type=int, default=300)
    parser.add_argument("--profile", action="store_true", help="also print a cProfile report")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="cpu: compiled for sm_90, launches stubbed; cuda: real launches")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        sys.exit("triton_host: unset TRITON_INTERPRET (the interpreter does not compile)")
    import triton
    real = args.device == "cuda"
    if real and not torch.cuda.is_available():
        sys.exit("triton_host: --device cuda needs a CUDA GPU")
    where = f"on {torch.cuda.get_device_name()}" if real else "launches stubbed"
    print(f"multihead {mh.__version__}, torch {torch.__version__}, triton {triton.__version__}; "
          f"host time per call, {where}", flush=True)
    from multihead.kernels import _launch
    print("case: direct launches (multihead.kernels._launch) | through Triton's path",
          flush=True)
    drain = torch.cuda.synchronize if real else (lambda: None)
    with contextlib.nullcontext() if real else stub_launches():
        for name, call in cases(args.case, args.device).items():
            _launch.DIRECT = False
            slow = measure(call, args.reps, drain)
            _launch.DIRECT = True
            fast = measure(call, args.reps, drain)
            print(f"{name}: {fast * 1e6:.1f} us | {slow * 1e6:.1f} us", flush=True)
            if args.profile:
                print(profile(call, args.reps), flush=True)
                drain()


if __name__ == "__main__":
    main()

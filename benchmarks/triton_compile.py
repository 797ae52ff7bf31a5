"""First-use cost of our Triton kernels: cold compile, warm start, and recompiles (issue 12).

Each case runs in a fresh Python process, so nothing from an earlier case is in memory:

- **cold**: an empty Triton cache (``TRITON_CACHE_DIR`` a new folder): the first
  forward + backward call compiles every kernel it launches;
- **warm**: a new process on the same cache folder: Triton loads the compiled binaries
  from disk (what a user pays on every later run of a program);
- **steady**: the same call again in the warm process, for scale;
- **new shapes**: in the warm process, calls with other lengths and windows of the same
  bucket, which must compile nothing (the time of the first such call is reported).

With ``--profile`` the warm process's first call runs under ``cProfile`` and the report
lists where its time went (the functions with the most cumulative time: Triton's cache
lookups and module loads, our dispatch, imports).

Torch's import and CUDA's context start are outside every figure: each process first runs a
plain matrix product on the GPU.

Run on a CUDA machine::

    python -m benchmarks.triton_compile --out compile.json

Without a GPU, ``--stub`` compiles for an H100 (sm_90) on the CPU and launches nothing
(:func:`benchmarks.triton_host.stub_launches`): the compiler's part of first use, which
runs on the host either way. ``--ahead 0`` turns off compiling the backward's kernels while
the forward's compile (``MULTIHEAD_COMPILE_AHEAD=0``), to compare.

Notation: B batch, H heads, S length, D head dim.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from benchmarks import save_json

#: (name, mask expression over M = mh.masks, S, other S values of the same bucket)
CASES = [
    ("window 256", "M.sliding_window(256)", 4096, "M.sliding_window(300)"),
    ("causal", "M.causal()", 4096, "M.causal()"),
    ("documents", "M.document(ids)", 4096, "M.document(ids)"),
    ("ALiBi & causal", "M.alibi(16) & M.causal()", 4096, "M.alibi(16) & M.causal()"),
]


def _child(name: str, expr: str, S: int, other: str, profile: bool = False,
           stub: bool = False) -> dict:
    """Time one case in this process (run as ``--child``); returns seconds per stage (and
    with ``profile``, the first call's profile as text)."""
    import contextlib

    import torch

    import multihead as mh
    if stub:
        from benchmarks.triton_host import stub_launches
        dev, where = torch.device("cpu"), stub_launches
        sync = lambda: None                                               # noqa: E731
    else:
        dev, where, sync = torch.device("cuda"), contextlib.nullcontext, torch.cuda.synchronize
        a = torch.randn(1024, 1024, device=dev)
        (a @ a).sum().item()                                              # CUDA context up

    def call(S: int, mask_expr: str) -> float:
        g = torch.Generator().manual_seed(S)
        B, H, D = 1, 16, 128
        q, k, v = (torch.randn(B, H, S, D, generator=g).to(dev, torch.bfloat16)
                   .requires_grad_() for _ in range(3))
        # document ids: runs of 64..1024 tokens, [B, S]
        cuts = torch.randint(64, 1025, (S // 64,), generator=g).cumsum(0)
        ids = torch.bucketize(torch.arange(S), cuts[cuts < S]).expand(B, S).to(dev)
        mask = eval(mask_expr, {"M": mh.masks, "ids": ids})              # noqa: S307
        sync()
        t = time.perf_counter()
        with where():
            out = mh.attention(q, k, v, mask=mask, backend="triton")
            out.float().sum().backward()
        sync()
        return time.perf_counter() - t

    t = time.perf_counter()
    import multihead.kernels.flash_bwd  # noqa: F401  (and Triton, imported by it)
    imports = time.perf_counter() - t
    report = {}
    if profile:
        import cProfile
        import io
        import pstats
        prof = cProfile.Profile()
        first = prof.runcall(call, S, expr)
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("cumulative").print_stats(40)
        report["profile"] = text.getvalue()
    else:
        first = call(S, expr)
    steady = call(S, expr)
    shapes = [call(S2, other) for S2 in (S - 64, S + 192, S // 2 + 64)]
    return {"case": name, "imports": imports, "first": first, "steady": steady,
            "new_shapes_first": shapes[0], "new_shapes_max": max(shapes), **report}


def run(case: tuple, cache: str, profile: bool = False, stub: bool = False,
        ahead: bool = True) -> dict:
    """Run ``case`` in a fresh process over the Triton cache folder ``cache``."""
    env = dict(os.environ, TRITON_CACHE_DIR=cache, MULTIHEAD_COMPILE_AHEAD=str(int(ahead)))
    cmd = [sys.executable, "-m", "benchmarks.triton_compile", "--child",
           json.dumps([*case, profile, stub])]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if p.returncode != 0:
        return {"case": case[0], "failed": p.stderr[-2000:]}
    return json.loads(p.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile", action="store_true",
                    help="profile the warm process's first call and print where it went")
    ap.add_argument("--stub", action="store_true",
                    help="no GPU: compile for sm_90 on the CPU, launch nothing")
    ap.add_argument("--ahead", type=int, default=1, choices=(0, 1),
                    help="compile the backward's kernels while the forward's compile")
    ap.add_argument("--size", type=int, default=None, help="S (default: each case's)")
    ap.add_argument("--case", default=None, help="one case by name (default: all)")
    a = ap.parse_args(argv)
    if a.child:
        print(json.dumps(_child(*json.loads(a.child))))
        return
    rows = []
    for case in CASES:
        if a.case is not None and case[0] != a.case:
            continue
        if a.size:
            case = (case[0], case[1], a.size, case[3])
        with tempfile.TemporaryDirectory() as cache:
            cold = run(case, cache, stub=a.stub, ahead=bool(a.ahead))
            warm = run(case, cache, a.profile, stub=a.stub, ahead=bool(a.ahead))
        rows.append({"case": case[0], "cold": cold, "warm": warm})
        if "failed" in cold or "failed" in warm:
            print(f"{case[0]}: failed\n{cold.get('failed', '')}{warm.get('failed', '')}")
            continue
        print(f"{case[0]:>11}: cold fwd+bwd {cold['first']:.2f} s, warm {warm['first']:.3f} s "
              f"(kernel modules' import before it: {warm['imports']:.2f} s), "
              f"steady {warm['steady'] * 1e3:.2f} ms, new shapes (warm) first "
              f"{warm['new_shapes_first'] * 1e3:.1f} ms, max {warm['new_shapes_max'] * 1e3:.1f} ms")
        if "profile" in warm:
            print(f"{case[0]}: the warm process's first call\n{warm['profile']}")
    save_json(a.out, rows)


if __name__ == "__main__":
    main()

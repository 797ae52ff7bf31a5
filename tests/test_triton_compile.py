"""Every Triton kernel launch compiles for an H100 (sm_90), without a GPU: the compiler runs
on the CPU (``tests/sm90_compile.py``), so CI catches what the interpreter forgives."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

KERNELS = {"_forward", "_dkdv", "_dq", "_partial", "_forward_sparse", "_dkdv_sparse",
           "_dq_sparse", "_weights", "_mean_weights"}


def test_every_kernel_compiles_to_an_sm90_cubin():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("sm90_compile.py")
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True,
                         timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    compiled = [line.split() for line in run.stdout.splitlines()]
    assert {name for name, _ in compiled} == KERNELS
    assert all(int(size) > 10_000 for _, size in compiled)       # real machine code


#: compiles the paged decode kernel (D=128, pages of 64) and prints, for its key loop, the
#: number of copy groups each wait leaves in flight
_PAGED_LOOP = """
import re, sys, torch
sys.path.insert(0, {tests!r})
from sm90_compile import compile_only
from multihead.kernels.decode import paged_decode_forward
B, L = 2, 1024
q = torch.zeros(B, 8, 1, 128, dtype=torch.bfloat16)
pool = torch.zeros(B * L, 2, 128, dtype=torch.bfloat16)
table = torch.arange(B * L // 64).view(B, -1)
with compile_only() as done:
    paged_decode_forward(q, pool, pool, table, torch.full((B,), L), max_len=L, page_size=64,
                         scale=0.1, causal=True)
ir = done[0][1].asm["ttgir"]
loop = ir[ir.index("scf.for"):]
loop = loop[:loop.index("scf.yield")]
print(len(re.findall("async_copy_global_to_local", loop)),
      *re.findall(r"async_wait[^{{]*[{{]num = (\\d+)", loop))
"""


def test_the_paged_decode_loop_keeps_a_kv_block_in_flight():
    """Over a paged pool a block's address comes from a page id loaded in the loop; the
    kernel's stages must leave Triton's pipeliner room to keep a K/V copy in flight during
    each step's math (a wait for every copy, ``num = 0``, serializes memory and math)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    code = _PAGED_LOOP.format(tests=str(Path(__file__).parent))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-4000:]
    copies, *waits = map(int, run.stdout.split())
    assert copies >= 2, f"the key loop issues no async K/V copies: {run.stdout}"
    assert waits and min(waits) > 0, f"the key loop waits for every copy: {run.stdout}"


#: the block-sparse forward (its table's stages need over 99 KB of shared memory on sm_90)
#: launched where a block may hold 99 KB (most GPUs but the A100 and H100), then 16 KB
_SMALL_GPU = """
import sys, torch
sys.path.insert(0, {tests!r})
from sm90_compile import stub_launches
import multihead as mh
from multihead.kernels import _band, _launch
from multihead.kernels.flash_sparse import _forward_sparse, sparse_forward
q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
with stub_launches(max_shared=101376):
    sparse_forward(q, q, q, mh.masks.alibi(2), scale=0.1)
    sparse_forward(q, q, q, mh.masks.alibi(2), scale=0.1)      # the cap learned: no retry
caps = [stages for key, stages in _launch._STAGE_CAP.items() if key[0] == id(_forward_sparse)]
print("cap", *caps)
print("table", _band.launch_config("fwd_sparse", 128, 128)[3])
for cache in _forward_sparse.device_caches.values():
    for kernel in cache[0].values():
        print("compiled", kernel.metadata.num_stages, kernel.metadata.shared)
with stub_launches(max_shared=16384):
    try:
        sparse_forward(q, q, q, mh.masks.alibi(2) & mh.masks.causal(), scale=0.1)
    except RuntimeError as e:
        print("error", str(e).replace(chr(10), " "))
"""


def test_a_gpu_with_less_shared_memory_runs_the_kernels_with_fewer_stages():
    """Launch tables are measured on an H100; where a GPU's shared memory cannot hold a
    kernel's stages, it runs with fewer (same tiles and results), and where not even one
    fits, the error names the kernel, the limit and the fix instead of Triton's."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c",
                          _SMALL_GPU.format(tests=str(Path(__file__).parent))],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    lines = run.stdout.splitlines()
    value = {line.split()[0]: int(line.split()[1]) for line in lines
             if line.split()[0] in ("cap", "table")}
    cap, table = value["cap"], value["table"]
    compiled = {int(a): int(b) for _, a, b in (line.split() for line in lines
                                              if line.startswith("compiled"))}
    assert 1 <= cap < table and compiled[cap] <= 101376 < compiled[cap + 1]
    assert set(compiled) == set(range(cap, table + 1))  # learned once: no stage tried twice
    error = next(line for line in lines if line.startswith("error"))
    assert "_forward_sparse" in error and "16384" in error
    assert "MULTIHEAD_TRITON_LAUNCH" in error and "backend='sdpa'" in error


#: on a GPU of 99 KB per block: a call with K/V off 16 bytes (no async copies: 3 stages
#: fit) is remembered, then an aligned call of the same kernel learns a cap of 2 stages;
#: prints the stages each launch of the misaligned call ran with
_CAP_AFTER_CLASS = """
import sys, torch
sys.path.insert(0, {tests!r})
import sm90_compile
from multihead.kernels.flash_fwd import flash_forward
stages = []
class Recording(sm90_compile._Launcher):
    def __init__(self, src, metadata):
        self.stages = metadata.num_stages
    def __call__(self, *args):
        stages.append(self.stages)
sm90_compile._Launcher = Recording
a = torch.zeros(1, 2, 256, 128, dtype=torch.float16)
off = torch.zeros(a.numel() + 1, dtype=torch.float16)[1:].view(a.shape)
kw = dict(scale=0.1, causal=True, config=(128, 64, 8, 3))
with sm90_compile.stub_launches(max_shared=101376):
    flash_forward(a, off, off, **kw)
    flash_forward(a, off, off, **kw)        # remembered: a direct launch
    flash_forward(a, a, a, **kw)            # 3 stages do not fit: the cap learned
    flash_forward(a, off, off, **kw)
print("stages", *stages)
"""


def test_a_stage_cap_applies_to_calls_remembered_before_it():
    """Direct launches run what Triton's path would: once a cap on a kernel's stages is
    learned, a call class remembered before it runs with the capped stages too."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c",
                          _CAP_AFTER_CLASS.format(tests=str(Path(__file__).parent))],
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    line = next(x for x in run.stdout.splitlines() if x.startswith("stages"))
    first, again, *aligned, last = map(int, line.split()[1:])
    assert first == again == 3 and aligned[-1] == 2, line
    assert last == 2, line


#: each call below runs twice through Triton's own launch path, then through launch()'s
#: direct one, with the stub driver's launcher recording what reaches it
_DIRECT_LAUNCH = """
import sys, torch, triton
import triton.language as tl
from triton import knobs
from triton.runtime.jit import JITFunction
sys.path.insert(0, {tests!r})
import sm90_compile
import multihead as mh
from multihead.kernels import _launch
from multihead.kernels.decode import decode_forward
from multihead.kernels.flash_bwd import flash_backward
from multihead.kernels.flash_fwd import flash_forward
from multihead.kernels.flash_sparse import sparse_forward

seen = []
class Recording(sm90_compile._Launcher):
    def __call__(self, *args):
        seen.append((self, args))
sm90_compile._Launcher = Recording
runs = [0]
triton_run = JITFunction.run
def counted(self, *args, **kwargs):
    runs[0] += 1
    return triton_run(self, *args, **kwargs)
JITFunction.run = counted

@triton.jit(do_not_specialize=["n"])
def _scaled(X, n, m, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(X + i, tl.load(X + i) * (n % 7 + m))

def view(args):
    # what a launch hands the driver, comparable across calls: the launcher (one per
    # compiled kernel), grid, stream, function, metadata, then each argument (a tensor by
    # dtype, shape, strides and alignment; outputs are new each call). The launch metadata
    # and the hooks (Triton passes empty hook chains, the direct launch None) are left out.
    launcher, (g0, g1, g2, stream, fn, meta, _, _, _, *rest) = args
    return (launcher, g0, g1, g2, stream, fn, meta, [
        (a.dtype, tuple(a.shape), a.stride(), a.data_ptr() % 16)
        if isinstance(a, torch.Tensor) else a for a in rest])

def record(call):
    seen.clear()
    call()
    return [view(s) for s in seen]

g = torch.Generator().manual_seed(0)
def rand(*shape, dtype=torch.float16):
    return torch.randn(*shape, generator=g).to(dtype)
bf = torch.bfloat16
q, kv = rand(1, 8, 1, 64, dtype=bf), rand(1, 2, 320, 64, dtype=bf)
q_odd = rand(8 * 64 + 1, dtype=bf)[1:].view(1, 8, 1, 64)     # 2 bytes off 16
x, y, z = rand(2, 4, 128, 64), rand(2, 2, 128, 64), rand(2, 4, 96, 64)
dy = rand(2, 4, 128, 64)
with sm90_compile.stub_launches():
    out, lse = flash_forward(x, y, y, scale=0.125, causal=True)   # (stand-ins: unread)
buf = torch.zeros(64)
cases = [
    ("decode", lambda: decode_forward(q, kv, kv, scale=0.125, causal=True, offset=319)),
    ("decode, shorter", lambda: decode_forward(q, kv[:, :, :300], kv[:, :, :300],
                                               scale=0.125, causal=True, offset=299)),
    ("decode, q off 16 bytes", lambda: decode_forward(q_odd, kv, kv, scale=0.125,
                                                      causal=True, offset=319)),
    ("decode, fp16", lambda: decode_forward(q.half(), kv.half(), kv.half(), scale=0.125,
                                            causal=True, offset=319)),
    ("forward, causal", lambda: flash_forward(x, y, y, scale=0.125, causal=True)),
    ("forward, window, Sq 96", lambda: flash_forward(z, y, y, scale=0.125, window=32,
                                                     offset=32)),
    ("backward", lambda: flash_backward(dy, x, y, y, out, lse, scale=0.125, causal=True)),
    ("sparse, ALiBi", lambda: sparse_forward(x, y, y, mh.masks.alibi(4), scale=0.125)),
    ("32-bit n, m 1", lambda: _launch.launch(_scaled, (1,), buf, 5, 1, BLOCK=64,
                                             num_stages=1)),
    ("64-bit n", lambda: _launch.launch(_scaled, (1,), buf, 2 ** 40, 1, BLOCK=64,
                                        num_stages=1)),
    ("m 16", lambda: _launch.launch(_scaled, (1,), buf, 5, 16, BLOCK=64, num_stages=1)),
    ("m 2", lambda: _launch.launch(_scaled, (1,), buf, 5, 2, BLOCK=64, num_stages=1)),
    ("m 2.0", lambda: _launch.launch(_scaled, (1,), buf, 5, 2.0, BLOCK=64, num_stages=1)),
]
with sm90_compile.stub_launches():
    for name, call in cases:
        _launch.DIRECT = False
        want = record(call)
        _launch.DIRECT = True
        first = record(call)
        before = runs[0]
        again = record(call)
        print(name, "|", want == first, want == again, runs[0] == before, len(want))
    comp = knobs.compilation                         # 3.9: the float sanitizer's casts
    if hasattr(comp, "fpsan_homomorphic_casts"):     # change what Triton compiles
        before = runs[0]
        comp.fpsan_homomorphic_casts = not comp.fpsan_homomorphic_casts
        cases[0][1]()
        comp.fpsan_homomorphic_casts = not comp.fpsan_homomorphic_casts
        print("fpsan |", runs[0] - before)
    hook = knobs.runtime.launch_enter_hook           # a profiler's hook sees every launch
    if hasattr(hook, "add"):
        hook.add(print)
    else:
        knobs.runtime.launch_enter_hook = hook = print
    before = runs[0]
    seen.clear()
    cases[0][1]()                                   # (the stub launcher calls no hook)
    print("hooked |", seen[0][1][7] is hook, runs[0] - before)
"""


def test_direct_launches_run_what_tritons_own_path_runs(tmp_path):
    """After a call of a class (see multihead.kernels._launch) ran once, later calls of it
    skip Triton's per-call path and launch the compiled kernel directly: the same kernel,
    grid and arguments Triton's path hands the driver. A tensor off 16 bytes, fp16 for
    bf16, a 64-bit length, an int that becomes 16, a float equal to an int get their own
    kernels (new classes), and a launch hook sends every launch through Triton."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = tmp_path / "direct_launch.py"            # (Triton jits only code in files)
    script.write_text(_DIRECT_LAUNCH.format(tests=str(Path(__file__).parent)))
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = dict(line.split(" | ") for line in run.stdout.splitlines() if " | " in line)
    assert len(rows) == 15 if "fpsan" in rows else 14, run.stdout
    for name, result in rows.items():
        if name == "hooked":
            assert result == "True 1", result    # Triton's path, handing the hook on
            continue
        if name == "fpsan":
            assert result == "1", result         # a new setting: Triton's path
            continue
        same_first, same_again, direct, launches = result.split()
        assert same_first == same_again == direct == "True", (name, result)
        assert int(launches) >= 1, name


#: under the stub sm_90 driver, calls through ``mh.attention(backend="triton")`` with
#: changing lengths, batches, windows and masks of one structure; prints the compiled
#: kernels after the first round and after the rest
_BUCKETS = """
import sys, torch
sys.path.insert(0, {root!r})
from benchmarks.triton_host import stub_launches
import multihead as mh
from multihead.kernels import decode, flash_bwd, flash_fwd, flash_sparse
M = mh.masks
KERNELS = (flash_fwd._forward, flash_bwd._dkdv, flash_bwd._dq, decode._partial,
           flash_sparse._forward_sparse, flash_sparse._dkdv_sparse, flash_sparse._dq_sparse)

def compiled():
    return sum(len(c) for kern in KERNELS for c in kern.device_caches.values() for c in c[:1])

g = torch.Generator().manual_seed(9)
def step(S, window, B):
    q = torch.randn(B, 8, S, 64, generator=g).to(torch.bfloat16).requires_grad_()
    kv = torch.randn(B, 2, S, 64, generator=g).to(torch.bfloat16)
    ids = (torch.arange(S) * 3 // S).expand(B, S)              # three documents
    for mask in (M.sliding_window(window), M.causal(), M.alibi(8) & M.causal(),
                 M.document(ids) & M.sliding_window(window)):
        mh.attention(q, kv, kv, mask=mask, backend="triton").sum().backward()
    with torch.no_grad():
        mh.attention(q[:, :, -1:], kv, kv, mask=M.sliding_window(window), backend="triton")
        mh.attention(q[:, :, -3:], kv, kv, mask=M.causal(), backend="triton")

with stub_launches():
    step(200, 64, 1)
    print("first", compiled())
    for S, window, B in [(201, 64, 1), (320, 37, 2), (512, 300, 3), (77, 1, 1)]:
        step(S, window, B)
    print("after", compiled())
print("fused", all(k.metadata.enable_fp_fusion for kern in KERNELS
                   for c in kern.device_caches.values() for k in c[0].values()))
"""


def test_new_lengths_batches_and_windows_compile_no_kernel(tmp_path):
    """Compiled for sm_90 on the CPU: after one call of each mask structure (window, causal,
    ALiBi, documents, and decoding steps), calls with other lengths, batches and windows
    reuse the compiled kernels (S, B and the window are plain arguments; block lists of
    any size are read through their strides). Every kernel is compiled with fused
    multiply-adds even where Triton's default turns them off (3.10's announced default)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "0"
    script = tmp_path / "buckets.py"
    script.write_text(_BUCKETS.format(root=str(Path(__file__).parents[1])))
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    counts = dict(line.split() for line in run.stdout.splitlines())
    assert int(counts["first"]) >= 7, run.stdout     # every kernel compiled at least once
    assert counts["after"] == counts["first"], run.stdout
    assert counts["fused"] == "True", run.stdout


#: a first training step per mask kind, compiled for sm_90 on the CPU: which thread asked
#: Triton to compile (or load from its disk cache) each kernel (the main thread, or one
#: compiling ahead)
_AHEAD = """
import sys, threading, torch
sys.path.insert(0, {root!r})
from benchmarks.triton_host import stub_launches
import triton.compiler
import multihead as mh
M = mh.masks
asked = []
compile = triton.compiler.compile
def logged(src, *args, **kwargs):
    asked.append((src.fn.__name__, threading.current_thread().name))
    return compile(src, *args, **kwargs)
triton.compiler.compile = logged
S = 200
ids = (torch.arange(S) * 3 // S)[None]                     # three documents
with stub_launches():
    for name, mask, Hkv in (("window", M.sliding_window(64), 8),
                            ("documents", M.document(ids), 2),
                            ("lengths", M.padding(torch.tensor([150])) & M.causal(), 8),
                            ("alibi", M.alibi(8) & M.causal(), 2),
                            ("dense", torch.rand(1, 1, S, S) > 0.3, 8)):
        q = torch.randn(1, 8, S, 64).to(torch.bfloat16).requires_grad_()
        kv = torch.randn(1, Hkv, S, 64).to(torch.bfloat16).requires_grad_()
        out = mh.attention(q, kv, kv, mask=mask, backend="triton")
        torch.autograd.backward(out, torch.randn_like(out))
        for kernel, thread in asked:
            print(name, kernel, "main" if thread == "MainThread" else "ahead")
        asked.clear()
"""


@pytest.mark.parametrize("ahead", [True, False])
def test_a_first_training_step_compiles_the_backward_while_the_forward_compiles(ahead):
    """Compiled for sm_90 on the CPU: a training call's first forward starts the compiles
    of its backward's kernels in other threads (on stand-ins of the tensors, launching
    nothing), so the backward finds them compiled; with ``MULTIHEAD_COMPILE_AHEAD=0`` the
    backward compiles them itself, one after another (the control)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["MULTIHEAD_COMPILE_AHEAD"] = "1" if ahead else "0"
    code = _AHEAD.format(root=str(Path(__file__).parents[1]))
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    rows = {tuple(line.split()) for line in run.stdout.splitlines()}
    for case, kind in (("window", ""), ("documents", ""), ("lengths", ""),
                       ("alibi", "_sparse"), ("dense", "_sparse")):
        assert (case, "_forward" + kind, "main") in rows, run.stdout
        for kernel in ("_dq" + kind, "_dkdv" + kind):
            assert ((case, kernel, "ahead") in rows) == ahead, run.stdout
            assert ((case, kernel, "main") in rows) != ahead, run.stdout


#: compiled for sm_90 on the CPU, with a CUDA graph capture simulated: where each kernel
#: module is loaded (inside or outside this thread's relaxed capture mode) and whether the
#: launch that follows ran
_CAPTURE = """
import contextlib, sys, torch
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
import sm90_compile
from benchmarks.triton_host import stub_launches
from multihead import _device
from multihead.kernels.flash_fwd import flash_forward
state = dict(relaxed=False, capturing={capturing})
events = []
@contextlib.contextmanager
def relaxed():
    state["relaxed"] = True
    try:
        yield
    finally:
        state["relaxed"] = False
load = sm90_compile._Utils.load_binary
def logged_load(*args):
    events.append("load relaxed" if state["relaxed"] else "load plain")
    return load(*args)
def logged_launch(self, *args):
    events.append("launch")
sm90_compile._Utils.load_binary = staticmethod(logged_load)
sm90_compile._Launcher.__call__ = logged_launch
_device.capturing = lambda: state["capturing"]
_device.relaxed_capture = relaxed
q = torch.zeros(1, 4, 96, 64, dtype=torch.bfloat16)
with stub_launches():
    for call in range(2):
        flash_forward(q, q, q, scale=0.125, causal=True, window=40)
        print(call, " ".join(events))
        events.clear()
"""


@pytest.mark.parametrize("capturing", [True, False])
def test_a_kernel_first_launched_while_a_graph_captures_is_loaded_in_relaxed_mode(capturing):
    """Compiled for sm_90 on the CPU: Triton loads a kernel's module on its first launch,
    a call a CUDA graph capture forbids. While a capture runs (simulated), the module is
    loaded first under this thread's relaxed capture mode, then the kernel launches; a
    later launch loads nothing. Without a capture (the control) the module is loaded the
    plain way."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    tests = Path(__file__).parent
    code = _CAPTURE.format(root=str(tests.parent), tests=str(tests), capturing=capturing)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, timeout=900)
    assert run.returncode == 0, run.stderr[-4000:]
    first, second = run.stdout.splitlines()
    assert first == f"0 load {'relaxed' if capturing else 'plain'} launch", run.stdout
    assert second == "1 launch", run.stdout

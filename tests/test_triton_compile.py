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
           "_dq_sparse"}


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
from multihead.kernels import _band
from multihead.kernels.flash_sparse import _forward_sparse, sparse_forward
q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
with stub_launches(max_shared=101376):
    sparse_forward(q, q, q, mh.masks.alibi(2), scale=0.1)
    sparse_forward(q, q, q, mh.masks.alibi(2), scale=0.1)      # the cap learned: no retry
caps = [stages for key, stages in _band._STAGE_CAP.items() if key[0] == id(_forward_sparse)]
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

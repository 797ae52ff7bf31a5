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

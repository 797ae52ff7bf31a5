"""Compile every kernel launch our Python wrappers make for an H100 (sm_90), on a machine
without a GPU: Triton's compiler (front end, MLIR passes, ptxas) runs on the CPU; only the
launch is skipped. The interpreter tests check what the kernels compute; this catches what
the interpreter forgives and the compiler refuses (types, layouts, constexpr misuse).

Run as a script (not under ``TRITON_INTERPRET=1``, which replaces ``triton.jit``); prints
one line per compiled kernel, ``name cubin-bytes``, and exits non-zero on the first failure.
``tests/test_triton_compile.py`` runs it.
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

from triton.backends.compiler import GPUTarget
from triton.runtime import driver
from triton.runtime.jit import JITFunction

import multihead as mh
from multihead.kernels._band import launch_config
from multihead.kernels.decode import decode_forward, paged_decode_forward
from multihead.kernels._dropout import Dropout
from multihead.kernels.flash_bwd import flash_backward
from multihead.kernels.flash_fwd import flash_forward
from multihead.kernels.flash_sparse import sparse_backward, sparse_forward
from multihead.kernels.weights import attention_weights


class _Target:
    """Stands in for Triton's CUDA driver: names the target, launches nothing."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_active_torch_device(self):
        return torch.device("cpu")

    def is_active(self):
        return True


class _Launcher:
    """Stands in for Triton's CUDA launcher: launches nothing."""

    def __init__(self, src, metadata):
        pass

    def __call__(self, *args):
        return None


class _Utils:
    """Stands in for Triton's CUDA utilities: a module that loads, ``max_shared`` bytes of
    shared memory per block (an H100's by default)."""

    def __init__(self, max_shared: int):
        self.max_shared = max_shared

    @staticmethod
    def load_binary(name, kernel, shared, device):
        return object(), object(), 0, 0, 1024      # module, function, regs, spills, threads

    def get_device_properties(self, device):
        return {"max_shared_mem": self.max_shared, "multiprocessor_count": 132}


@contextlib.contextmanager
def stub_launches(arch: int = 90, max_shared: int = 232448):
    """Within the block, Triton compiles for ``arch`` and runs its whole launch path (argument
    binding, cache lookup, the check of the kernel's shared memory against ``max_shared``)
    up to the driver's launch, which does nothing."""
    from triton.compiler import compiler

    # Triton 3.9 caches each device's limit: forget it on the way in and out
    forget = getattr(compiler.max_shared_mem, "cache_clear", lambda: None)
    target = _Target(arch)
    target.launcher_cls, target.utils = _Launcher, _Utils(max_shared)
    saved = driver._active
    driver.set_active(target)
    forget()
    try:
        yield
    finally:
        driver._active = saved
        forget()


@contextlib.contextmanager
def compile_only(arch: int = 90):
    """Within the block, launching a kernel compiles it for ``arch`` and runs nothing;
    yields the list of ``(kernel name, CompiledKernel)`` compiled."""
    compiled = []
    run = JITFunction.run

    def warmup(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        compiled.append((self.fn.__name__, kernel))
        return kernel

    saved = driver._active
    driver.set_active(_Target(arch))
    JITFunction.run = warmup
    try:
        yield compiled
    finally:
        JITFunction.run = run
        driver._active = saved


def launches():
    """Every kernel with each structure the backend uses (band, decode, mask programs)."""
    M = mh.masks
    bf = dict(dtype=torch.bfloat16)
    for D in (64, 128, 256):
        q = torch.zeros(2, 4, 256, D, **bf)
        k = torch.zeros(2, 2, 256, D, **bf)
        lens = torch.tensor([200, 256])
        kw = dict(scale=0.1, causal=True, window=64 if D == 128 else None, kv_lengths=lens)
        o, lse = flash_forward(q, k, k, **kw)
        flash_backward(o, q, k, k, o, lse, **kw)
        docs = torch.tensor([[0, 0, 100], [0, 100, 156], [1, 0, 256]])
        kw = dict(scale=0.1, causal=True, window=64 if D == 128 else None, documents=docs)
        o, lse = flash_forward(q, k, k, **kw)
        flash_backward(o, q, k, k, o, lse, **kw)
        decode_forward(q[:, :, :1], k, k, scale=0.1, causal=True, offset=255, kv_lengths=lens)
        if D == 128:                                    # one split: no merge, no tickets
            decode_forward(q[:, :, :1], k, k, scale=0.1, causal=True, offset=255, splits=1)
        pool = torch.zeros(8 * 64, 2, D, **bf)                    # a paged pool, slot-major
        paged_decode_forward(q[:, :, :1], pool, pool, torch.zeros(2, 4, dtype=torch.long), lens,
                             max_len=256, page_size=64, scale=0.1, causal=True)
    q = torch.zeros(2, 4, 256, 128, **bf)
    k = torch.zeros(2, 2, 256, 128, **bf)
    ids = torch.arange(256) // 50
    dense = torch.rand(2, 1, 256, 256) > 0.5
    pos = (torch.rand(2, 256) > 0.1).cumsum(-1) - 1               # a padded cache's positions
    for m in (M.at_positions(M.sliding_window(64) & M.alibi(4), pos, pos) & M.causal(),
              M.document(ids) & M.causal(),
              M.dense(dense) | M.sliding_window(16),
              ~M.dense(dense) & M.alibi(4),
              M.bias(torch.randn(1, 4, 256, 256)) & M.padding(torch.rand(2, 256) > 0.1),
              M.padding(torch.tensor([100, 256]), side="query")):
        o, lse = sparse_forward(q, k, k, m, scale=0.1)
        sparse_backward(o, q, k, k, o, lse, m, scale=0.1)
    # dK/dV blocks computed transposed (fewer queries per step than keys: keys_left)
    keys_left = ((32, 128, 8, 2), launch_config("bwd_q", 128, 128))
    o, lse = flash_forward(q, k, k, scale=0.1, causal=True, window=64)
    flash_backward(o, q, k, k, o, lse, scale=0.1, causal=True, window=64, config=keys_left)
    m = M.document(ids) & M.alibi(4)
    o, lse = sparse_forward(q, k, k, m, scale=0.1)
    sparse_backward(o, q, k, k, o, lse, m, scale=0.1, config=keys_left)
    # dropout drawn in the band kernels: a window with padding, packed documents, and the
    # dK/dV blocks transposed
    drop = Dropout(0.1, torch.zeros(1, dtype=torch.int64))
    lens = torch.tensor([200, 256])
    for kw in (dict(window=64, kv_lengths=lens), dict(documents=torch.tensor(
            [[0, 0, 100], [0, 100, 156], [1, 0, 256]]))):
        o, lse = flash_forward(q, k, k, scale=0.1, causal=True, dropout=drop, **kw)
        flash_backward(o, q, k, k, o, lse, scale=0.1, causal=True, dropout=drop, **kw)
    flash_backward(o, q, k, k, o, lse, scale=0.1, causal=True, window=64, dropout=drop,
                   config=keys_left)
    # ... and in the block-sparse kernels: a bias (its exact rows in dQ) with padding rows,
    # and documents & ALiBi with the dK/dV blocks transposed
    m = M.bias(torch.randn(1, 4, 256, 256)) & M.padding(torch.rand(2, 256) > 0.1)
    o, lse = sparse_forward(q, k, k, m, scale=0.1, dropout=drop)
    sparse_backward(o, q, k, k, o, lse, m, scale=0.1, dropout=drop)
    m = M.document(ids) & M.alibi(4)
    sparse_backward(o, q, k, k, o, lse, m, scale=0.1, config=keys_left, dropout=drop)
    # the weights, per head and their head mean: no mask, lists shared by the heads, lists
    # of each head's own (the mean evaluates the mask on every block)
    for D in (64, 128):
        q, k = torch.zeros(2, 4, 256, D, **bf), torch.zeros(2, 2, 256, D, **bf)
        for m in (None, M.causal() & M.alibi(4), M.dense(torch.rand(1, 4, 256, 256) > 0.5)):
            for average in (False, True):
                attention_weights(q, k, m, scale=0.1, average=average)
                if m is not None:                       # with the attention kernels' draws
                    attention_weights(q, k, m, scale=0.1, average=average, dropout=drop)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET"):
        sys.exit("sm90_compile.py: unset TRITON_INTERPRET (the interpreter does not compile)")
    with compile_only() as done:
        launches()
    for name, kernel in done:
        print(name, len(kernel.asm["cubin"]))

"""The machine code of our Triton kernels' inner loops, on a machine without a GPU (issue 12).

Compiles each kernel for an H100 (sm_90) on the CPU, as ``tests/sm90_compile.py`` does,
disassembles the cubin with the ``nvdisasm`` Triton ships, and counts the SASS instructions
of every loop body that holds the softmax (a basic block with at least 16 ``MUFU``, the
``exp2`` unit): one iteration is one (query block x key block) step. It also reports each
kernel's registers and spill traffic (``LDL``/``STL`` anywhere in it).

Instruction counts are not times, but on a kernel bound by its arithmetic pipes (the FA2
forward at D=128 on an H100 is) fewer instructions per step is the change a GPU timing
then confirms. Used to compare code changes when no GPU is at hand.

Run (not under ``TRITON_INTERPRET=1``)::

    python -m benchmarks.triton_sass                       # every case
    python -m benchmarks.triton_sass --case alibi --case "window 512"
    python -m benchmarks.triton_sass --case "weights, causal & alibi" --head-dim 64

Notation: B batch, H heads, S length, D head dim; kernels at B=1 H=16 S=1024 bf16, D=128
unless ``--head-dim`` says otherwise.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

#: case name -> mask expression over M = mh.masks (None: the band kernels, window 512); a
#: name ending in ", dropout" compiles the kernels that draw dropout
CASES = {"window 512": None, "window 512, dropout": None,
         "documents (ids)": "M.document(torch.arange(S) // 100)",
         "alibi": "M.alibi(H)", "causal & alibi": "M.causal() & M.alibi(H)",
         "causal & alibi, dropout": "M.causal() & M.alibi(H)",
         "bias tile": "M.bias(torch.randn(1, H, S, S))",
         # the weights kernels (per head and their head mean) instead of the attention's
         "weights, no mask": "None", "weights, causal & alibi": "M.causal() & M.alibi(H)",
         "weights, causal & alibi, dropout": "M.causal() & M.alibi(H)",
         "weights, dense per head": "M.dense(torch.rand(1, H, S, S) > 0.5)"}

#: the instruction classes shown beside each loop's total
SHOWN = ("MUFU", "HGMMA", "FFMA", "FMUL", "FADD", "FMNMX", "I2FP", "IABS", "ISETP", "FSEL",
         "LDL", "STL")


def _nvdisasm() -> str:
    import triton
    return os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "nvdisasm")


def loops(cubin: bytes) -> tuple[list[collections.Counter], int]:
    """The op counts of each softmax loop body in ``cubin``, and the kernel's spill
    instructions (``LDL`` + ``STL``)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        sass = subprocess.run([_nvdisasm(), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout
    blocks, current, spills = [], collections.Counter(), 0
    for line in sass.splitlines():
        if re.match(r"\s*\.L_x_\d+:", line):                   # a label starts a basic block
            blocks.append(current)
            current = collections.Counter()
            continue
        op = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if op:
            current[op.group(1)] += 1
            spills += op.group(1) in ("LDL", "STL")
    blocks.append(current)
    return [b for b in blocks if b["MUFU"] >= 16], spills


def compile_case(name: str, D: int = 128) -> list[tuple[str, object]]:
    """Compile the forward and backward kernels of one case (a weights case: the weights
    kernels, per head and their head mean) at head dim ``D``; ``(kernel name, compiled)``."""
    from sm90_compile import compile_only

    import multihead as mh
    from multihead.kernels._dropout import Dropout
    from multihead.kernels.flash_bwd import flash_backward
    from multihead.kernels.flash_fwd import flash_forward
    from multihead.kernels.flash_sparse import sparse_backward, sparse_forward
    from multihead.kernels.weights import attention_weights
    B, H, S = 1, 16, 1024
    q = torch.zeros(B, H, S, D, dtype=torch.bfloat16)
    # drawn in the kernels (the seed unread here)
    drop = Dropout(0.1, torch.zeros(1, dtype=torch.int64)) if name.endswith(", dropout") \
        else None
    with compile_only(90) as done:
        if CASES[name] is None:
            kw = dict(scale=0.1, causal=True, window=512, offset=0, kv_lengths=None,
                      dropout=drop)
            o, lse = flash_forward(q, q, q, **kw)
            flash_backward(o, q, q, q, o, lse, **kw)
            return done
        mask = eval(CASES[name], {"M": mh.masks, "torch": torch, "S": S, "H": H})  # noqa: S307
        if name.startswith("weights"):
            for average in (False, True):
                attention_weights(q, q, mask, scale=0.1, average=average, dropout=drop)
        else:
            o, lse = sparse_forward(q, q, q, mask, scale=0.1, dropout=drop)
            sparse_backward(o, q, q, q, o, lse, mask, scale=0.1, dropout=drop)
    return done


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--case", action="append", choices=list(CASES),
                    help="a case to compile (repeatable; default: all)")
    ap.add_argument("--head-dim", type=int, default=128, help="D (default 128)")
    a = ap.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET"):
        sys.exit("triton_sass: unset TRITON_INTERPRET (the interpreter does not compile)")
    import triton
    print(f"SASS per loop iteration, sm_90, Triton {triton.__version__} (kernels compiled on "
          f"the CPU; counts, not times)\n")
    print("| case | kernel | loop | SASS | " + " | ".join(SHOWN) + " |")
    print("|" + " --- |" * (4 + len(SHOWN)))
    for name in a.case or list(CASES):
        for kernel, compiled in compile_case(name, a.head_dim):
            found, spills = loops(compiled.asm["cubin"])
            for i, ops in enumerate(found):
                cells = " | ".join(str(ops[op]) for op in SHOWN)
                print(f"| {name} | {kernel} | {i + 1}/{len(found)} | {sum(ops.values())} | "
                      f"{cells} |")
            if spills:
                print(f"| {name} | {kernel} | spills | {spills} LDL/STL in the kernel |"
                      + " |" * len(SHOWN))
            print(f"| {name} | {kernel} | shared memory | {compiled.metadata.shared} bytes |"
                  + " |" * len(SHOWN))


if __name__ == "__main__":
    main()

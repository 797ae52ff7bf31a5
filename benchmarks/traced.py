"""Band masks traced by ``torch.compile`` and ``torch.export``, against the eager call.

Run:  .venv/bin/python -m benchmarks.traced [--device cuda] [--json PATH]

For each case (B=1, H=12, D=64, fp32 on the CPU; a sliding window, a window with key
padding, an MQA window) the same ``mh.attention`` call is timed eagerly, compiled
(``torch.compile(dynamic=True)``, inductor) and exported (``torch.export`` with a dynamic
length, run through ``.module()``), with the backend ``auto`` picks eagerly and whether the
traced graphs hold ``torch.ops.multihead.blocksparse`` (compiled at the first length, and
exported). Times: median of 9 single calls after two warm-ups. (That one compiled graph
serves every length is tested: ``tests/test_blocksparse_traced.py``.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch import nn

import multihead as mh
from benchmarks import save_json

M = mh.masks
try:                                  # (absent before the operator existed: compare with it)
    OP = torch.ops.multihead.blocksparse.default
except AttributeError:
    OP = None


def _median_ms(fn, device, reps: int = 9) -> float:
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    fn()
    times = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


class _Attend(nn.Module):
    def __init__(self, mask_of):
        super().__init__()
        self.mask_of = mask_of

    def forward(self, q, k, v):
        return mh.attention(q, k, v, mask=self.mask_of(q.shape[2]))


CASES = {   # name: (Hkv, lengths, mask for a length)
    "window 256": (12, (4096, 2048, 3000), lambda S: M.sliding_window(256)),
    "window 128 & key padding": (12, (2048, 1500), lambda S, keys=M.padding(torch.tensor([1400])):
                                 M.sliding_window(128) & keys),
    "MQA window 64": (1, (1024, 700), lambda S: M.sliding_window(64)),
}


def run(device: str = "cpu") -> list[dict]:
    rows = []
    for name, (hkv, lengths, mask_of) in CASES.items():
        torch._dynamo.reset()
        graphs = []

        def keeping(gm, example_inputs):                 # inductor, keeping the graph
            graphs.append(gm)
            from torch._inductor.compile_fx import compile_fx
            return compile_fx(gm, example_inputs)
        module = _Attend(mask_of)
        compiled = torch.compile(module, backend=keeping, dynamic=True)
        S0 = lengths[0]
        make = lambda S: (torch.randn(1, 12, S, 64, device=device),    # noqa: E731
                          torch.randn(1, hkv, S, 64, device=device),
                          torch.randn(1, hkv, S, 64, device=device))
        q, k, v = make(S0)
        dim = torch.export.Dim("S", min=min(lengths), max=8192)   # (padding's 1400 fit)
        program = torch.export.export(module, (q, k, v), dynamic_shapes=({2: dim},) * 3)
        exported = program.module()
        eager_ms = _median_ms(lambda: module(q, k, v), device)
        compiled_ms = _median_ms(lambda: compiled(q, k, v), device)
        exported_ms = _median_ms(lambda: exported(q, k, v), device)
        for S in lengths[1:]:                        # other lengths, exported and eager
            args = make(S)
            torch.testing.assert_close(exported(*args), module(*args))
        row = dict(case=name, S=S0, chosen=mh.explain(q, k, v, mask=mask_of(S0)).chosen,
                   eager_ms=eager_ms, compiled_ms=compiled_ms, exported_ms=exported_ms,
                   operator=any(OP in {n.target for n in g.graph.nodes} for g in graphs)
                   and OP in {n.target for n in program.graph_module.graph.nodes})
        rows.append(row)
        print(f"{name}, S={S0}: eager ({row['chosen']}) {eager_ms:.1f} ms | compiled "
              f"{compiled_ms:.1f} ms | exported {exported_ms:.1f} ms | blocksparse operator "
              f"traced: {row['operator']}", flush=True)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    print(f"multihead {mh.__version__}, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads", flush=True)
    rows = run(args.device)
    if args.json:
        save_json(args.json, rows)


if __name__ == "__main__":
    main()

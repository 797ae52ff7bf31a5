"""What planning costs at long lengths: ``auto`` over a window or packed documents.

Run:  .venv/bin/python -m benchmarks.long_masks [--lengths 131072 524288] [--json PATH]

Each case runs in a fresh process (one thread; B=1, H=1, D=16, fp32 on the CPU): the first
``mh.attention`` call (which builds the tile map that prices blocksparse and, where it runs,
its step plan), a second call with the same arguments (the plan kept), the growth of the
process's peak RSS over both beyond q, k and v, and the backend auto ran. The tile map of a
band or of packed documents is banded (linear in the length); before, it was dense,
``(S/64)^2`` tiles.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from benchmarks import save_json

CASES = {
    "window 128": "M.sliding_window(128)",
    "window 128 & key padding": "M.sliding_window(128) & M.padding(torch.tensor([S - 5]))",
    "documents of 256": "M.document(cu_seqlens=torch.arange(0, S + 1, 256))",
    "causal & documents of 256": "M.causal() & M.document(cu_seqlens=torch.arange(0, S + 1, 256))",
}

CHILD = """
import json, resource, sys, time, torch, multihead as mh
torch.set_num_threads(1)
M, S = mh.masks, int(sys.argv[1])
q, k, v = (torch.randn(1, 1, S, 16) for _ in range(3))
mask = eval(sys.argv[2])
rss = lambda: resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
r0 = rss()
t = time.perf_counter(); mh.attention(q, k, v, mask=mask); first = time.perf_counter() - t
t = time.perf_counter(); mh.attention(q, k, v, mask=mask); second = time.perf_counter() - t
print(json.dumps({"first_s": first, "second_s": second, "rss_mb": rss() - r0,
                  "backend": mh.explain(q, k, v, mask=mask).chosen}))
"""


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=int, nargs="+", default=[131072, 524288])
    p.add_argument("--json", default=None, help="also write the rows to this file")
    args = p.parse_args(argv)
    rows = []
    print(f"{'case':<28} {'S':>8} {'first':>8} {'second':>8} {'peak RSS':>9}  backend")
    for S in args.lengths:
        for name, build in CASES.items():
            run = subprocess.run([sys.executable, "-c", CHILD, str(S), build],
                                 capture_output=True, text=True, check=True)
            r = {"case": name, "S": S, **json.loads(run.stdout)}
            rows.append(r)
            print(f"{name:<28} {S:>8} {r['first_s']:>7.2f}s {r['second_s']:>7.2f}s "
                  f"{r['rss_mb']:>6.0f} MB  {r['backend']}")
    save_json(args.json, rows)


if __name__ == "__main__":
    main()

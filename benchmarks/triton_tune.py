"""Sweep the launch configurations of our Triton kernels on a GPU (issue 12).

Times each kernel directly (``triton.testing.do_bench``, median) over a list of
``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` for the forward and ``(BLOCK_N, num_warps,
num_stages, splits)`` for decoding, at the issue's shapes, beside compiled FlexAttention and
SDPA measured in the same run. Every config's output is checked against the first's (a
config that disagrees is reported, never timed). The winners go into
``multihead.kernels._band.LAUNCH`` (its "decode" entry for decoding), or with ``--write``
into a file for ``MULTIHEAD_TRITON_LAUNCH``.

Run on a CUDA machine::

    python -m benchmarks.triton_tune --out tune.json          # forward, backward and decode
    python -m benchmarks.triton_tune --only decode
    python -m benchmarks.triton_tune --only sparse --case alibi   # block-sparse forward

Notation: B batch, H heads, Hkv K/V heads, S length, D head dim.
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from benchmarks import save_json

FWD = [(128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 64, 4, 4), (128, 32, 4, 3),
       (64, 64, 4, 3), (64, 64, 4, 4), (64, 32, 4, 3), (128, 128, 8, 2), (128, 64, 8, 4)]
#: dK/dV: BLOCK_M queries per step against BLOCK_N keys held (fewer queries than keys: the
#: blocks run transposed, see flash_bwd.keys_left); dQ: the other way round
BWD_KV = [(64, 64, 4, 2), (32, 128, 4, 3), (32, 128, 8, 3), (64, 128, 8, 2), (16, 128, 4, 3),
          (32, 64, 4, 3), (64, 64, 4, 3), (32, 128, 4, 2), (64, 32, 4, 2), (64, 32, 4, 3),
          (32, 32, 4, 2), (64, 64, 8, 2), (128, 64, 8, 2), (64, 128, 8, 3), (32, 128, 8, 2),
          (32, 64, 4, 2)]
BWD_Q = [(64, 64, 4, 2), (128, 32, 4, 3), (128, 32, 8, 3), (128, 64, 8, 2), (64, 32, 4, 3),
         (128, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2), (32, 64, 4, 2), (64, 64, 8, 2),
         (32, 32, 4, 2), (128, 128, 8, 2)]
#: the block-sparse forward: its block lists put a list load before each K/V copy, so
#: Triton's pipeliner needs 5 stages to keep a copy in flight (sm_90 TTGIR); fewer stages
#: leave shared memory for a second program per SM instead
FWD_SPARSE = [(128, 64, 8, 5), (128, 64, 8, 3), (128, 64, 8, 4), (128, 64, 4, 5),
              (64, 64, 4, 5), (64, 64, 4, 3), (128, 128, 8, 3), (128, 32, 4, 5)]
#: the mask kinds each part measures (``--case`` picks some)
KINDS = {"fwd": ["window 256", "window 2048", "causal", "dense", "padding", "causal & padding"],
         "bwd": ["window 256", "window 2048", "causal"],
         "sparse": ["alibi", "documents", "bias"]}
DECODE = [(64, 4, 3, 1.0), (64, 4, 2, 1.0), (32, 4, 3, 1.0), (128, 4, 3, 1.0), (128, 8, 3, 1.0),
          (64, 2, 3, 1.0), (64, 4, 3, 2.0), (64, 4, 3, 0.5), (128, 4, 2, 2.0), (32, 2, 3, 2.0)]


def _bench(fn, graph: bool = False) -> float:
    import triton.testing as tt
    fn()
    torch.cuda.synchronize()
    if graph:
        return tt.do_bench_cudagraph(fn, rep=100, return_mode="median") * 1e3    # us
    return tt.do_bench(fn, warmup=25, rep=200, return_mode="median") * 1e3


#: a config row whose launches ran with fewer stages than it asks for
UNFIT = "its stages do not fit this GPU"


def _as_asked(run):
    """``run()``, or None when its launches ran with fewer stages than their config asked
    for (a GPU with less shared memory than the H100: see ``_launch.launch``); what the
    launches learned is forgotten before and after (a remembered call class would launch
    a kernel compiled with fewer stages without asking), so each config runs as written."""
    from multihead.kernels import _launch
    _launch.forget()
    result = run()
    fitted = not _launch._STAGE_CAP
    _launch.forget()
    return result if fitted else None


def _band_kwargs(kind: str, B: int, S: int, device):
    g = torch.Generator().manual_seed(1)
    lens = torch.randint(S // 4, S + 1, (B,), generator=g).to(device, torch.int32)
    return {"window 256": dict(causal=True, window=256), "window 2048": dict(causal=True, window=2048),
            "causal": dict(causal=True), "dense": dict(),
            "padding": dict(kv_lengths=lens), "causal & padding": dict(causal=True, kv_lengths=lens),
            }[kind], lens


def _flex(kind: str, q, k, v, lens):
    """Compiled flex_attention for the case, its mask from the bench's own definitions."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from multihead.bench.flex import mods
    S = q.shape[2]
    name = {"causal & padding": "causal&padding"}.get(kind, kind.split()[0])
    window = int(kind.split()[1]) if kind.startswith("window") else 0
    mask_mod, _, _ = mods(name, heads=q.shape[1], device=q.device, window=window,
                          key_lengths=lens)
    bm = (create_block_mask(mask_mod, q.shape[0], None, S, S, device=q.device)
          if mask_mod is not None else None)
    fx = torch.compile(flex_attention)
    return lambda: fx(q, k, v, block_mask=bm)


def forward(rows: list, *, S=16384, B=2, H=16, D=128, dtype=torch.bfloat16, kinds=None):
    from multihead.kernels.flash_fwd import flash_forward
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=g).to(dev, dtype) for _ in range(3))
    for kind in kinds or KINDS["fwd"]:
        kw, lens = _band_kwargs(kind, B, S, dev)
        first = None
        for cfg in FWD:
            try:
                got = _as_asked(lambda: flash_forward(q, k, v, scale=D ** -0.5, config=cfg,
                                                      **kw))
                if got is None:
                    rows.append(dict(part="fwd", case=kind, config=cfg, failed=UNFIT))
                    continue
                out = got[0]
                if first is None:
                    first = out
                err = (out.float() - first.float()).abs().max().item()
                if err > 2e-2:
                    rows.append(dict(part="fwd", case=kind, config=cfg, error=err))
                    continue
                us = _bench(lambda: flash_forward(q, k, v, scale=D ** -0.5, config=cfg, **kw))
                rows.append(dict(part="fwd", case=kind, D=D, config=cfg, us=us))
            except Exception as e:                               # noqa: BLE001 (a row, not a stop)
                rows.append(dict(part="fwd", case=kind, config=cfg, failed=repr(e)[:200]))
            print(rows[-1], flush=True)
        try:
            fx = _flex(kind, q, k, v, lens)
            rows.append(dict(part="fwd", case=kind, D=D, peer="flex", us=_bench(fx)))
        except Exception as e:                                   # noqa: BLE001
            rows.append(dict(part="fwd", case=kind, peer="flex", failed=repr(e)[:200]))
        if kind in ("dense", "causal"):
            rows.append(dict(part="fwd", case=kind, D=D, peer="sdpa", us=_bench(
                lambda: F.scaled_dot_product_attention(q, k, v, is_causal=kind == "causal"))))
        print(rows[-1], flush=True)


def _sparse_mask(kind: str, H: int, S: int, device):
    """The block-sparse case's mask, and its flex_attention form (None: not compared)."""
    import multihead as mh
    from multihead.bench.cases import _doc_lengths
    from multihead.bench.flex import mods
    if kind == "alibi":
        return mh.masks.alibi(H), mods("alibi", heads=H, device=device)
    if kind == "documents":                       # ids on the device: the block lists' path
        lengths = _doc_lengths(S, longest=2048)
        ids = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
        return (mh.masks.document(ids.to(device)),
                mods("documents", heads=H, device=device, doc_lengths=lengths))
    g = torch.Generator().manual_seed(2)
    return mh.masks.bias(torch.randn(1, H, S, S, generator=g).to(device, torch.bfloat16)), None


def sparse(rows: list, *, S=16384, B=1, H=16, D=128, dtype=torch.bfloat16, kinds=None):
    """The block-sparse forward's configs (FWD_SPARSE) against compiled flex_attention."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    from multihead.kernels.flash_sparse import sparse_forward
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, S, D, generator=g).to(dev, dtype) for _ in range(3))
    for kind in kinds or KINDS["sparse"]:
        n = S if kind != "bias" else 4096         # a dense (1, H, S, S) bias: S=4096
        mask, flex = _sparse_mask(kind, H, n, dev)
        qs, ks, vs = (t[:, :, :n] for t in (q, k, v))
        first = None
        for cfg in FWD_SPARSE:
            try:
                got = _as_asked(lambda: sparse_forward(qs, ks, vs, mask, scale=D ** -0.5,
                                                       config=cfg))
                if got is None:
                    rows.append(dict(part="sparse", case=kind, config=cfg, failed=UNFIT))
                    continue
                out = got[0]
                first = out if first is None else first
                err = (out.float() - first.float()).abs().max().item()
                if err > 2e-2:
                    rows.append(dict(part="sparse", case=kind, config=cfg, error=err))
                    continue
                us = _bench(lambda: sparse_forward(qs, ks, vs, mask, scale=D ** -0.5, config=cfg))
                rows.append(dict(part="sparse", case=kind, D=D, config=cfg, us=us))
            except Exception as e:                               # noqa: BLE001 (a row, not a stop)
                rows.append(dict(part="sparse", case=kind, config=cfg, failed=repr(e)[:200]))
            print(rows[-1], flush=True)
        if flex is not None:
            mask_mod, score_mod, _ = flex
            bm = (create_block_mask(mask_mod, B, None, n, n, device=dev)
                  if mask_mod is not None else None)
            fx = torch.compile(flex_attention)
            rows.append(dict(part="sparse", case=kind, D=D, peer="flex", us=_bench(
                lambda: fx(qs, ks, vs, block_mask=bm, score_mod=score_mod))))
            print(rows[-1], flush=True)


def backward(rows: list, *, S=16384, B=1, H=16, D=128, dtype=torch.bfloat16, kinds=None):
    """Each dK/dV config with the table's dQ config, then each dQ config likewise."""
    from multihead.kernels import flash_bwd
    from multihead.kernels._band import launch_config
    from multihead.kernels.flash_fwd import flash_forward
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, H, S, D, generator=g).to(dev, dtype) for _ in range(4))
    default = (launch_config("bwd_kv", D, D), launch_config("bwd_q", D, D))
    for kind in kinds or KINDS["bwd"]:
        kw, lens = _band_kwargs(kind, B, S, dev)
        out, lse = flash_forward(q, k, v, scale=D ** -0.5, **kw)
        first = None
        for part, configs in (("bwd_kv", BWD_KV), ("bwd_q", BWD_Q)):
            for cfg in configs:
                pair = (cfg, default[1]) if part == "bwd_kv" else (default[0], cfg)
                try:
                    run = lambda: flash_bwd.flash_backward(                 # noqa: E731
                        do, q, k, v, out, lse, scale=D ** -0.5, config=pair, **kw)
                    grads = _as_asked(run)
                    if grads is None:
                        rows.append(dict(part=part, case=kind, config=cfg, failed=UNFIT))
                        continue
                    if first is None:
                        first = grads
                    err = max((a.float() - b.float()).abs().max().item()
                              for a, b in zip(grads, first))
                    if err > 5e-2:
                        rows.append(dict(part=part, case=kind, config=cfg, error=err))
                        continue
                    rows.append(dict(part=part, case=kind, D=D, config=cfg, us=_bench(run)))
                except Exception as e:                           # noqa: BLE001
                    rows.append(dict(part=part, case=kind, config=cfg, failed=repr(e)[:200]))
                print(rows[-1], flush=True)


def decode(rows: list, *, H=32, Hkv=8, D=128, dtype=torch.bfloat16):
    from multihead.kernels.decode import decode_forward, num_splits
    dev = torch.device("cuda")
    for B, L in [(1, 4096), (1, 32768), (8, 32768)]:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(B, H, 1, D, generator=g).to(dev, dtype)
        k, v = (torch.randn(B, Hkv, L, D, generator=g).to(dev, dtype) for _ in range(2))
        nbytes = k.nbytes + v.nbytes
        ref = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
        for graph in (False, True):
            sd = _bench(lambda: F.scaled_dot_product_attention(q, k, v, enable_gqa=True), graph)
            rows.append(dict(part="decode", B=B, L=L, peer="sdpa enable_gqa", graph=graph, us=sd,
                             TBps=nbytes / sd / 1e6))
            print(rows[-1], flush=True)
        for bn, warps, stages, mult in DECODE:
            splits = max(1, int(num_splits(B, Hkv, L) * mult))
            cfg = dict(config=(bn, warps, stages, splits), mult=mult)
            try:
                run = lambda: decode_forward(q, k, v, scale=D ** -0.5, causal=True,  # noqa: E731
                                             offset=L - 1, splits=splits,
                                             config=(bn, warps, stages))
                err = (run()[0].float() - ref.float()).abs().max().item()
                if err > 2e-2:
                    rows.append(dict(part="decode", B=B, L=L, **cfg, error=err))
                    continue
                for graph in (False, True):
                    us = _bench(run, graph)
                    rows.append(dict(part="decode", B=B, L=L, **cfg, graph=graph, us=us,
                                     TBps=nbytes / us / 1e6))
            except Exception as e:                               # noqa: BLE001
                rows.append(dict(part="decode", B=B, L=L, **cfg, failed=repr(e)[:200]))
            print(rows[-1], flush=True)


def overhead(rows: list, *, B=1, H=32, Hkv=8, D=128, L=4096, dtype=torch.bfloat16):
    """A decoding step through ``mh.attention`` (auto, sdpa, triton) against the kernels
    called directly: what dispatch adds per call."""
    import multihead as mh
    from multihead.kernels import ops
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, 1, D, generator=g).to(dev, dtype)
    k, v = (torch.randn(B, Hkv, L, D, generator=g).to(dev, dtype) for _ in range(2))
    causal = mh.masks.causal()
    calls = {"mh auto": lambda: mh.attention(q, k, v, mask=causal),
             "mh sdpa": lambda: mh.attention(q, k, v, mask=causal, backend="sdpa"),
             "mh triton": lambda: mh.attention(q, k, v, mask=causal, backend="triton"),
             "F.sdpa enable_gqa": lambda: F.scaled_dot_product_attention(q, k, v,
                                                                          enable_gqa=True),
             "ops.flash_decode (custom_op)": lambda: ops.flash_decode(
                 q, k, v, D ** -0.5, True, 0, L - 1, None),
             "ops.decode": lambda: ops.decode(q, k, v, D ** -0.5, True, 0, L - 1, None)}
    print(mh.explain(q, k, v, mask=causal), flush=True)
    for name, fn in calls.items():
        rows.append(dict(part="overhead", case=f"decode B={B} L={L}", peer=name, us=_bench(fn)))
        print(rows[-1], flush=True)


def _best(rows: list) -> list[str]:
    lines = []
    keys = sorted({(r["part"], r.get("case"), r.get("B"), r.get("L"), r.get("graph"))
                   for r in rows})
    for key in keys:
        mine = [r for r in rows if (r["part"], r.get("case"), r.get("B"), r.get("L"),
                                    r.get("graph")) == key and "us" in r]
        ours = [r for r in mine if "config" in r]
        peers = [r for r in mine if "peer" in r]
        if not ours:
            continue
        best = min(ours, key=lambda r: r["us"])
        text = f"{key}: best {best['config']} {best['us']:.1f} us"
        for p in peers:
            text += f" | {p['peer']} {p['us']:.1f} us ({p['us'] / best['us']:.2f}x)"
        lines.append(text)
    return lines


def winners(rows: list, D: int = 128) -> dict:
    """The launch table entries these rows measured: per kernel, the config with the least
    total time over the cases where every config ran (``fwd_narrow``: the 256 window;
    ``decode``: ``(BLOCK_N, warps, stages)`` at the default number of splits, over each
    (B, L) eager and graphed).

    Example:
        >>> rows = [dict(part="decode", B=1, L=4096, graph=g, config=c, mult=1.0, us=us)
        ...         for g in (False, True) for c, us in (((64, 4, 3, 16), 9.0),
        ...                                             ((128, 4, 2, 16), 8.0))]
        >>> winners(rows)
        {'decode': {'128': [128, 4, 2]}}
    """
    import math
    table = {}
    for kernel, part, cases in (("fwd", "fwd", None), ("fwd_narrow", "fwd", {"window 256"}),
                                ("fwd_sparse", "sparse", None), ("bwd_kv", "bwd_kv", None),
                                ("bwd_q", "bwd_q", None), ("decode", "decode", None)):
        mine = [r for r in rows if r["part"] == part and "us" in r and "config" in r
                and (cases is None or r.get("case") in cases) and r.get("mult", 1.0) == 1.0]
        by = {}
        for r in mine:
            config = tuple(r["config"][:3] if part == "decode" else r["config"])
            case = (r["B"], r["L"], r["graph"]) if part == "decode" else r["case"]
            by.setdefault(config, {})[case] = r["us"]
        every = set.intersection(*(set(c) for c in by.values())) if by else set()
        if every:
            best = min(by, key=lambda c: sum(math.log(by[c][k]) for k in every))
            table[kernel] = {str(D): list(best)}
    return table


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["fwd", "bwd", "sparse", "decode", "overhead"],
                    action="append")
    ap.add_argument("--case", action="append", help="only these mask kinds (fwd and bwd), "
                    f"of {KINDS['fwd']}")
    ap.add_argument("--out", default=None)
    ap.add_argument("--merge", default=None, help="rows of an earlier run to count too")
    ap.add_argument("--write", default=None, help="write the winners as a launch table "
                    "(for MULTIHEAD_TRITON_LAUNCH)")
    a = ap.parse_args(argv)
    parts = a.only or ["fwd", "bwd", "sparse", "decode"]
    rows: list = []
    rows.extend(json.load(open(a.merge)) if a.merge else [])
    for name, fn in (("fwd", forward), ("bwd", backward), ("sparse", sparse),
                     ("decode", decode), ("overhead", overhead)):
        if name in parts:
            try:
                fn(rows, kinds=a.case) if name in ("fwd", "bwd", "sparse") else fn(rows)
            except Exception as e:                               # noqa: BLE001
                rows.append(dict(part=name, failed=repr(e)[:300]))
    save_json(a.out, rows)
    print("\n".join(_best(rows)))
    if a.write:
        table = winners(rows)
        with open(a.write, "w") as f:
            json.dump(table, f, indent=1)
        print(f"wrote {a.write}: {table}")


if __name__ == "__main__":
    main()

"""A padded KV cache's window and ALiBi on the GPU: our kernels vs SDPA, and what auto picks.

A padded cache (left-padded prompts, paused slots) counts a sliding window and ALiBi in
tokens, not slots: the mask is ``masks.at_positions`` over the cache's padding
(:func:`multihead.masks.positioned.distances_in_tokens`), new at every step. The kernels
run it from the positions; SDPA gets the dense mask. For each case this times one call of
``backend="triton"``, ``backend="sdpa"`` and ``auto`` back to back between CUDA events
(:func:`benchmarks.triton_step.split`: step, host issue time, kernel time), checks the two
outputs agree, and prints what ``auto`` chose and the estimates it chose by.

By default each call builds its mask (as a decoding loop does: the positions are new each
step), so Triton's block lists are built in every call. ``--reuse-mask`` passes one mask
object to every call: what is derived from it (block lists, plans) is then cached on it.

Run on a CUDA machine (``--device cpu --small --ours blocksparse`` is a dry run of the plumbing)::

    python -m benchmarks.padded_cache [--out padded.json]

Notation: B batch, H query heads (Hkv K/V heads), Sq queries, Sk cached slots, D=128, bf16.
Each sequence has 0..Sk/4 padded slots on the left.
"""

from __future__ import annotations

import argparse

import torch

import multihead as mh
from benchmarks import save_json
from benchmarks.triton_step import split
from multihead.masks.positioned import distances_in_tokens


def cases(small: bool) -> list:
    """``(name, B, H, Hkv, Sq, Sk, mask)`` with ``mask`` in slot terms (before positions)."""
    M = mh.masks
    if small:
        return [("window 32, step", 2, 4, 2, 1, 128, M.causal() & M.sliding_window(32)),
                ("alibi, prompt", 2, 4, 2, 64, 64, M.causal() & M.alibi(4))]
    out = []
    for what, m in (("window 1024", M.causal() & M.sliding_window(1024)),
                    ("alibi", M.causal() & M.alibi(32))):
        out += [(f"{what}, step 1 of 4k", 8, 32, 8, 1, 4096, m),
                (f"{what}, step 16 of 4k", 8, 32, 8, 16, 4096, m),
                (f"{what}, step 1 of 32k", 8, 32, 8, 1, 32768, m),
                (f"{what}, prompt 2048", 8, 32, 8, 2048, 2048, m)]
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--small", action="store_true", help="small shapes (a dry run)")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ours", default="triton", help="our backend (default: triton)")
    ap.add_argument("--reuse-mask", action="store_true",
                    help="one mask object for every call (default: a new one per call)")
    ap.add_argument("--out", default=None, help="write the figures as JSON")
    a = ap.parse_args(argv)
    dt = torch.bfloat16 if a.device == "cuda" else torch.float32
    g = torch.Generator().manual_seed(0)
    rows = {}
    for name, B, H, Hkv, sq, sk, slots in cases(a.small):
        q = torch.randn(B, H, sq, 128, generator=g).to(a.device, dt)
        k, v = (torch.randn(B, Hkv, sk, 128, generator=g).to(a.device, dt) for _ in range(2))
        pad = torch.randint(0, sk // 4 + 1, (B, 1), generator=g)               # (B, 1)
        valid = (torch.arange(sk)[None] >= pad).to(a.device)                  # (B, Sk)
        new_mask = lambda: distances_in_tokens(slots, valid, sq) & mh.masks.padding(valid)  # noqa: E731
        mask = new_mask()
        calls = {be: (lambda be=be: mh.attention(
            q, k, v, mask=mask if a.reuse_mask else new_mask(), backend=be))
            for be in (a.ours, "sdpa", "auto")}
        got, want = calls[a.ours]().float(), calls["sdpa"]().float()
        err = ((got - want).norm() / want.norm()).item()
        e = mh.explain(q, k, v, mask=mask)
        est = {r.name: r.seconds * 1e3 for r in e.rows if r.seconds is not None}
        row = rows[name] = {"auto_chose": e.chosen, "rel_err_vs_sdpa": err,
                            "estimates_ms": est}
        for be, call in calls.items():
            row[be] = split(call, a.steps, a.device)
        t, s = row[a.ours]["step_us"], row["sdpa"]["step_us"]
        print(f"{name}: {a.ours} {t:.1f} us (kernels {row[a.ours]['kernels_us']:.1f}), "
              f"sdpa {s:.1f} us (kernels {row['sdpa']['kernels_us']:.1f}), "
              f"sdpa/{a.ours} {s / t:.2f}x; auto chose {e.chosen} ({row['auto']['step_us']:.1f} "
              f"us; est. " + ", ".join(f"{b} {ms:.3f} ms" for b, ms in est.items())
              + f"); rel err {err:.1e}", flush=True)
    save_json(a.out, rows)


if __name__ == "__main__":
    main()

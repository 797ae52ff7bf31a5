"""Benchmarks of the MultiHeadAttention module against torch.nn.MultiheadAttention (same run).

Run:  .venv/bin/python -m benchmarks.module
"""

import json

import torch
from torch import nn

import multihead as mh
from benchmarks import no_options
from benchmarks.core import machine, timeit


def main():
    torch.manual_seed(0)
    print(f"machine: {machine()}")
    rows = []
    with torch.no_grad():
        B, S, E, H = 8, 512, 768, 12
        t = nn.MultiheadAttention(E, H, batch_first=True).eval()
        ours = mh.MultiHeadAttention.from_torch(t).eval()
        x = torch.randn(B, S, E)
        t_ours = timeit(lambda: ours(x))
        for nw in (True, False):
            t_t = timeit(lambda: t(x, x, x, need_weights=nw))
            rows.append(dict(case=f"B={B} S={S} E={E} H={H} forward", ours_ms=t_ours * 1e3,
                             peer=f"torch MHA need_weights={nw}", peer_ms=t_t * 1e3,
                             throughput_vs_peer=t_t / t_ours, target=">= 1.15x" if nw else ">= 1.0x"))
        S = 4096
        x = torch.randn(1, S, E)
        causal = nn.Transformer.generate_square_subsequent_mask(S)
        t_ours = timeit(lambda: ours(x, mask=mh.masks.causal()), reps=3)
        t_t = timeit(lambda: t(x, x, x, attn_mask=causal), reps=3)
        rows.append(dict(case=f"causal self-attention B=1 S={S} E={E}", ours_ms=t_ours * 1e3,
                         peer="torch MHA with the dense causal mask (default need_weights)",
                         peer_ms=t_t * 1e3, throughput_vs_peer=t_t / t_ours, target=">= 3x"))
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    no_options(__doc__)
    main()

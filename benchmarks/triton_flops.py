"""What torch's FLOP counters count for our Triton operators at the issue's sizes (issue 12),
against what they count for SDPA (every pair, whatever the mask).

The counts come from the operators' formulas (:mod:`multihead.kernels.flops`) on tensors
without storage, so no GPU is needed: B=1 H=16 S=16384 D=128, the launch table's tiles;
packed documents of 64-2048 tokens drawn from a fixed seed.

Run::

    python -m benchmarks.triton_flops
"""

from __future__ import annotations

import torch
from torch.utils.flop_counter import sdpa_backward_flop_count, sdpa_flop_count

from multihead.kernels import flops

B, H, S, D = 1, 16, 16384, 128


def documents(seed: int = 0) -> torch.Tensor:
    """The table ``(b, first, length)`` of documents of 64-2048 tokens filling S."""
    g = torch.Generator().manual_seed(seed)
    lengths, total = [], 0
    while total < S:
        n = min(int(torch.randint(64, 2049, (1,), generator=g)), S - total)
        lengths.append(n)
        total += n
    n = torch.tensor(lengths)
    return torch.stack([torch.zeros_like(n), n.cumsum(0) - n, n], 1)


def main() -> None:
    q = torch.empty(B, H, S, D, device="meta")
    fwd, bwd = sdpa_flop_count(q.shape, q.shape, q.shape), \
        sdpa_backward_flop_count(q.shape, q.shape, q.shape, q.shape)
    print(f"B={B} H={H} S={S} D={D}; SDPA's count: {fwd / 1e12:.3f} TFLOP forward, "
          f"{bwd / 1e12:.3f} backward\n")
    print("| call | forward | backward | SDPA's count / ours |\n| --- | --- | --- | --- |")
    for name, causal, window, docs in [("causal", True, 0, None),
                                       ("window 256", True, 256, None),
                                       ("window 2048", True, 2048, None),
                                       ("packed documents of 64-2048 tokens, causal", True, 0,
                                        documents())]:
        f = flops._flash_attention(q, q, q, D ** -0.5, causal, window, 0, None, docs)
        b = flops._flash_attention_backward(q, None, q, q, q, q, None, D ** -0.5, causal,
                                            window, 0, None, docs)
        print(f"| {name} | {f / 1e12:.3f} | {b / 1e12:.3f} | {fwd / f:.1f}x |")


if __name__ == "__main__":
    main()

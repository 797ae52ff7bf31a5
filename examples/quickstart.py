"""A first look at multihead: one call, any mask, and explain() says what ran."""

import torch

import multihead as mh

torch.manual_seed(0)
B, H, Hkv, S, D = 2, 8, 2, 1024, 64
q = torch.randn(B, H, S, D)
k, v = torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D)
lengths = torch.tensor([1024, 700])

for mask in [None, mh.masks.causal(), mh.masks.sliding_window(128) & mh.masks.padding(lengths)]:
    out = mh.attention(q, k, v, mask=mask)
    ref = mh.attention(q, k, v, mask=mask, backend="reference")
    print(mh.explain(q, k, v, mask=mask))
    print(f"max |out - reference| = {(out - ref).abs().max():.2e}\n")
print(repr(mh.masks.sliding_window(3) & mh.masks.padding(torch.tensor([6]))))

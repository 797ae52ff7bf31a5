"""Rotary position embedding (Su et al. 2021, RoFormer), the "rotate half" layout of GPT-NeoX/LLaMA.

Each pair of channels ``(x_i, x_{i + D/2})`` of a query or key at position ``m`` is rotated
by the angle ``m * base^(-2i/D)``. Rotations preserve norms, and the score between a
query at ``m`` and a key at ``n`` depends only on ``m - n``.
"""

from __future__ import annotations

import torch
from torch import nn

from .._device import to_device


class RotaryEmbedding(nn.Module):
    """Rotary embedding applied to ``(B, H, S, D)`` queries/keys at explicit positions.

    Args:
        head_dim: D, the per-head dimension (must be even).
        base: the frequency base (10000 in RoFormer and LLaMA).

    Example:
        >>> import torch, multihead as mh
        >>> rope = mh.RotaryEmbedding(8)
        >>> x = torch.randn(1, 2, 5, 8)
        >>> y = rope(x, torch.arange(5))
        >>> torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-6)
        True

    Shapes:
        x (B, H, S, D); positions (S,) or (B, S) integer.
    """

    def __init__(self, head_dim: int, base: float = 10000.0, *, device=None):
        super().__init__()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"RotaryEmbedding: head_dim must be a positive even int (channels rotate "
                             f"in pairs), got {head_dim!r}")
        if not base > 1:
            raise ValueError(f"RotaryEmbedding: base must be > 1, got {base!r}")
        self.head_dim, self.base = head_dim, float(base)
        inv = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float32, device=device) / head_dim)
        self.register_buffer("inv_freq", inv, persistent=False)      # (D/2,)

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base:g}"

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.head_dim:
            raise ValueError(f"RotaryEmbedding({self.head_dim}) got inputs with head_dim {x.shape[-1]}")
        pos = to_device(positions, x.device).to(torch.float32)        # host positions: no sync
        ang = pos.unsqueeze(-1) * to_device(self.inv_freq, x.device)  # (B|1, S, D/2) or (S, D/2)
        if ang.dim() == 2:
            ang = ang.unsqueeze(0)                                     # (1, S, D/2)
        ang = torch.cat([ang, ang], dim=-1).unsqueeze(1)               # (B|1, 1, S, D)
        cos, sin = ang.cos(), ang.sin()
        half = self.head_dim // 2
        x1, x2 = x[..., :half], x[..., half:]
        rotated = torch.cat([-x2, x1], dim=-1)                         # (B, H, S, D)
        return (x.float() * cos + rotated.float() * sin).to(x.dtype)

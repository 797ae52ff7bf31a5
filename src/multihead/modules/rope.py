"""Rotary position embedding (Su et al. 2021, RoFormer), the "rotate half" layout of GPT-NeoX/LLaMA.

Each pair of channels ``(x_i, x_{i + D/2})`` of a query or key at position ``m`` is rotated
by the angle ``m * base^(-2i/D)``. Rotations preserve norms, and the score between a
query at ``m`` and a key at ``n`` depends only on ``m - n``.

The cosines and sines of the angles are kept in a table of positions ``0..rows-1`` per
(head dim, base, device, precision), shared by every :class:`RotaryEmbedding` of that kind
and grown by doubling. Positions the host knows (an int start, a CPU tensor) read their rows
from it: consecutive ones as a slice (no device op), others with one gather. So a decoding
step on a GPU launches only the rotation's kernels, not a dozen to recompute angles. Positions
on the device, fractional ones, and calls under ``torch.compile`` or a CUDA graph capture
compute their angles instead (nothing is read back, no table is grown). Angles are computed
in fp32 (fp64 for fp64 inputs) and the rotation runs in that precision, whatever ``x``'s.
"""

from __future__ import annotations

import torch
from torch import nn

from .._device import capturing, to_device

#: rows of a table when first built (it doubles past them)
FIRST_ROWS = 2048

#: (head_dim, base, device, dtype) -> table (rows, 2, D): [:, 0] cos, [:, 1] sin with the
#: sign of the rotation folded in (the first half negated)
_TABLES: dict = {}


def _precision(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class RotaryEmbedding(nn.Module):
    """Rotary embedding applied to ``(B, H, S, D)`` queries/keys at explicit positions.

    Args:
        head_dim: D, the per-head dimension (must be even).
        base: the frequency base (10000 in RoFormer and LLaMA).
        device: build the table of the first :data:`FIRST_ROWS` positions there now (else
            at the first call on a device), e.g. before capturing a CUDA graph.

    Example:
        >>> import torch, multihead as mh
        >>> rope = mh.RotaryEmbedding(8)
        >>> x = torch.randn(1, 2, 5, 8)
        >>> y = rope(x, torch.arange(5))
        >>> torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-6)
        True
        >>> torch.equal(rope(x, 3), rope(x, torch.arange(3, 8)))   # an int: the first position
        True

    Shapes:
        x (B, H, S, D); positions (S,) or (B, S) (integer or float), or an int ``p``: the
        positions ``p .. p + S - 1`` of every sequence.
    """

    def __init__(self, head_dim: int, base: float = 10000.0, *, device=None):
        super().__init__()
        if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
            raise ValueError(f"RotaryEmbedding: head_dim must be a positive even int (channels rotate "
                             f"in pairs), got {head_dim!r}")
        if not base > 1:
            raise ValueError(f"RotaryEmbedding: base must be > 1, got {base!r}")
        self.head_dim, self.base = head_dim, float(base)
        if device is not None:
            self._table(torch.empty(0, device=device).device, torch.float32, FIRST_ROWS)

    @property
    def inv_freq(self) -> torch.Tensor:
        """The rotation frequencies ``base^(-2i/D)`` ``(D/2,)``, fp32 on the CPU."""
        return self._frequencies(torch.float32, torch.device("cpu"))

    def extra_repr(self) -> str:
        return f"head_dim={self.head_dim}, base={self.base:g}"

    def forward(self, x: torch.Tensor, positions) -> torch.Tensor:
        return self.rotate(x, positions=positions)[0]

    def rotate(self, *xs: torch.Tensor, positions) -> tuple[torch.Tensor, ...]:
        """Each of ``xs`` (queries and keys at the same positions) rotated, with one lookup
        of the angles for all.

        Example:
            >>> import torch, multihead as mh
            >>> q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
            >>> rq, rk = mh.RotaryEmbedding(8).rotate(q, k, positions=10)
            >>> rq.shape, rk.shape
            (torch.Size([1, 4, 3, 8]), torch.Size([1, 2, 3, 8]))
        """
        x = xs[0]
        for t in xs:
            if t.shape[-1] != self.head_dim:
                raise ValueError(f"RotaryEmbedding({self.head_dim}) got inputs with head_dim "
                                 f"{t.shape[-1]}")
        cos, sin = self._cos_sin(positions, x.shape[-2], x.device, _precision(x.dtype))
        half = self.head_dim // 2
        # x_i cos + x_{i+D/2} (-sin) and x_{i+D/2} cos + x_i sin: the sign lives in the table
        return tuple(torch.addcmul(t * cos, t.roll(half, -1), sin).to(t.dtype) for t in xs)

    # -- angles --------------------------------------------------------------------------
    def _cos_sin(self, positions, S: int, device: torch.device, dtype: torch.dtype):
        """``(cos, sin)`` broadcastable to ``(B, H, S, D)``: ``(S, D)`` or ``(B, 1, S, D)``."""
        if isinstance(positions, int) and not isinstance(positions, bool):
            table = self._table(device, dtype, positions + S) if positions >= 0 else None
            if table is not None:
                rows = table[positions:positions + S]                    # (S, 2, D): a view
                return rows[:, 0], rows[:, 1]                            # (S, D)
            positions = torch.arange(positions, positions + S, device=device)
        if not isinstance(positions, torch.Tensor):
            raise TypeError(f"RotaryEmbedding: positions must be an int or a tensor (S,) or "
                            f"(B, S), got {type(positions).__name__}")
        if positions.dim() not in (1, 2) or positions.shape[-1] != S:
            raise ValueError(f"RotaryEmbedding: positions must be (S,) or (B, S) with S={S}, "
                             f"got shape {tuple(positions.shape)}")
        if positions.device.type == "cpu" and positions.numel() and not (
                torch.compiler.is_compiling() or
                positions.is_floating_point() or positions.is_complex()):
            lo, hi = int(positions.min()), int(positions.max())      # a host tensor: no sync
            table = self._table(device, dtype, hi + 1) if lo >= 0 else None
            if table is not None:
                if positions.dim() == 1 and hi - lo == S - 1 and torch.equal(
                        positions, torch.arange(lo, hi + 1, dtype=positions.dtype)):
                    return self._split(table[lo:hi + 1])                 # (S, 2, D): a view
                return self._split(table[to_device(positions, device)])  # gathered rows
        return self._split(self._angles(to_device(positions, device).to(dtype)))

    @staticmethod
    def _split(rows: torch.Tensor):
        # rows (S, 2, D) or (B, S, 2, D) -> cos, sin (S, D) or (B, 1, S, D)
        if rows.dim() == 4:
            rows = rows.unsqueeze(1)                                     # (B, 1, S, 2, D)
        return rows[..., 0, :], rows[..., 1, :]

    def _frequencies(self, dtype: torch.dtype, device) -> torch.Tensor:
        return self.base ** (-torch.arange(0, self.head_dim, 2, dtype=dtype, device=device)
                             / self.head_dim)                            # (D/2,)

    def _angles(self, pos: torch.Tensor) -> torch.Tensor:
        """``pos`` (...) float -> ``(..., 2, D)``: cos, and sin with the rotation's sign."""
        ang = pos.unsqueeze(-1) * self._frequencies(pos.dtype, pos.device)   # (..., D/2)
        c, s = ang.cos(), ang.sin()
        return torch.stack([torch.cat([c, c], -1), torch.cat([-s, s], -1)], -2)  # (..., 2, D)

    def _table(self, device: torch.device, dtype: torch.dtype, rows: int):
        """The shared table of at least ``rows`` positions ``(rows', 2, D)`` on ``device``,
        grown if need be; None where it cannot be used: while ``torch.compile`` traces (the
        graph computes its angles), or where it would grow during a CUDA graph capture."""
        if torch.compiler.is_compiling():
            return None
        key = (self.head_dim, self.base, device, dtype)
        table = _TABLES.get(key)
        if table is None or table.shape[0] < rows:
            if capturing():
                return None
            n = max(FIRST_ROWS, 1 << (rows - 1).bit_length())
            with torch.inference_mode(False), torch.no_grad():   # a plain tensor, whatever
                table = self._angles(torch.arange(n, dtype=dtype, device=device))  # the mode
            if type(table) is torch.Tensor:               # not a fake or traced one
                _TABLES[key] = table
        return table

"""Dropout inside the attention kernels: which (query, key) pairs of a call survive.

Dropout on the attention weights multiplies each weight by ``keep / (1 - p)`` after the
softmax (its normalizer sees every weight). A fused kernel never holds the weights, so the
forward and both backward kernels must each draw the same ``keep`` for a pair, whatever
their tiles. Here ``keep`` is a pure function of the call's seed and the pair's
coordinates: one Philox-4x32-10 draw per (stream, row, group of 8 keys), whose four 32-bit
words give eight 16-bit numbers, one per key of the group; a pair survives where its number
is at least ``round(p * 65536)``. So:

- the dropout rate is ``p`` rounded to a multiple of ``2^-16`` (:func:`drop_threshold`),
  and the survivors are scaled by ``1 / (1 - that rate)``: the expected output is the
  undropped one exactly (FlashAttention-2 rounds to ``1/255``);
- one Philox draw serves eight pairs (a draw costs about a hundred integer operations,
  against a tensor core's few per pair);
- a block's keys must start at a multiple of 8 (every kernel's blocks start at a multiple
  of their width, at least 16);
- the stream is ``(b * H + h, first)``: the query head, and the first token of the packed
  document whose rows and keys are counted from it (the band kernels' per-document
  schedule); 0 elsewhere, the block-sparse kernels' included (documents from ids there are
  a mask: rows and keys keep their positions in the sequences).

The seed is a one-element int64 tensor on the device, drawn from torch's generator for the
device by :func:`draw`, so ``torch.manual_seed`` fixes the draws, nothing is read back to
the host, and a CUDA graph replays a fresh seed each time (torch's graph-safe Philox state).

Notation: B batch, H query heads, Sq/Sk lengths.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ._band import cdiv
from ._launch import launch

#: the resolution of the dropout rate: a pair's number has 16 bits
LEVELS = 1 << 16
#: the kernels' dropout arguments that must not cause a compile per rate (Triton would
#: otherwise specialize the threshold on its divisibility by 16)
DYNAMIC = ["drop_t"]


class Dropout(NamedTuple):
    """A call's dropout: rate ``p`` (0 < p <= 1) and the seed, ``(1,)`` int64 on the
    inputs' device (:func:`draw`).

    Example:
        >>> d = Dropout(0.1, torch.zeros(1, dtype=torch.int64))
        >>> d.threshold, round(d.keep_scale, 4), Dropout(1.0, d.seed).keep_scale
        (6554, 1.1111, 0.0)
    """
    p: float
    seed: torch.Tensor

    @property
    def threshold(self) -> int:
        """A pair survives where its 16-bit number is at least this."""
        return drop_threshold(self.p)

    @property
    def keep_scale(self) -> float:
        """The survivors' factor, ``1 / (1 - rate)`` for the rounded rate (0 where every
        pair is dropped, so that no ``0 * inf`` makes a NaN)."""
        t = self.threshold
        return LEVELS / (LEVELS - t) if t < LEVELS else 0.0


def drop_threshold(p: float) -> int:
    """``round(p * 65536)``: the dropout rate in 16-bit levels.

    Example:
        >>> drop_threshold(0.1), drop_threshold(0.5), drop_threshold(1.0)
        (6554, 32768, 65536)
    """
    return min(LEVELS, max(0, round(p * LEVELS)))


def draw(p: float, device: torch.device) -> Dropout:
    """A fresh seed for a call with dropout ``p``, from torch's generator for ``device``
    (on the device: no sync; graph-safe under CUDA graph capture).

    Example:
        >>> torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> a = draw(0.1, torch.device("cpu")); torch.manual_seed(0)  # doctest: +ELLIPSIS
        <torch._C.Generator object at ...>
        >>> bool(draw(0.1, torch.device("cpu")).seed == a.seed)
        True
    """
    seed = torch.randint(-(1 << 63), (1 << 63) - 1, (1,), device=device, dtype=torch.int64)
    return Dropout(float(p), seed)


def drop_args(dropout: Dropout | None, fn: str, q: torch.Tensor,
              unused: torch.Tensor) -> tuple[torch.Tensor, int, float]:
    """A kernel's dropout arguments ``(SEED, drop_t, keep_scale)``; without dropout,
    ``unused`` (a tensor of the call's, never read) and zeros. Raises a ValueError naming
    ``fn`` for a rate outside (0, 1] or a seed that is not one int64 on q's device.

    Example:
        >>> import torch
        >>> q = torch.zeros(1, 1, 4, 16, dtype=torch.float16)
        >>> seed, t, scale = drop_args(Dropout(0.5, torch.zeros(1, dtype=torch.int64)), "f", q, q)
        >>> t, scale
        (32768, 2.0)
        >>> drop_args(Dropout(0.5, torch.zeros(2)), "f", q, q)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: f: dropout.seed must be one int64 on cpu (multihead.kernels._dropout.draw...
    """
    if dropout is None:
        return unused, 0, 0.0
    p, seed = dropout
    if not (isinstance(p, float) and 0.0 < p <= 1.0):
        raise ValueError(f"{fn}: dropout.p must be a float in (0, 1], got {p!r} (no dropout: "
                         f"pass dropout=None)")
    if not (isinstance(seed, torch.Tensor) and seed.shape == (1,)
            and seed.dtype == torch.int64 and seed.device == q.device):
        got = (f"{tuple(seed.shape)} {seed.dtype} on {seed.device}"
               if isinstance(seed, torch.Tensor) else repr(seed))
        raise ValueError(f"{fn}: dropout.seed must be one int64 on {q.device} "
                         f"(multihead.kernels._dropout.draw makes one), got {got}")
    return seed, dropout.threshold, dropout.keep_scale


@triton.jit
def drop_state(SEED, b, H, first, drop_t, keep_scale, DROPOUT: tl.constexpr, key0=0):
    """What a kernel's blocks need to drop pairs, or None without DROPOUT: the tuple
    ``(seed, b * H, first, drop_t, keep_scale, key0)`` (:func:`kept` reads the first four:
    query head h's stream is ``b * H + h``; ``DROP[4]`` scales a kept pair's ``dP``;
    ``key0``, ``DROP[5]``, is the first key of a dK/dV program's block)."""
    state = None
    if DROPOUT:
        state = (tl.load(SEED), b * H, first, drop_t, keep_scale, key0)
    return state


@triton.jit
def keep_tile(seed, bh, first, rows, start, threshold, BLOCK_M: tl.constexpr,
              BLOCK_N: tl.constexpr):
    """``(BLOCK_M, BLOCK_N)`` bool: whether pair (``rows[i]``, ``start + j``) of stream
    (``bh``, ``first``) survives. ``rows`` are positions (int32), ``start`` a multiple of 8;
    the same pair gives the same answer in any block that holds it."""
    groups = start // 8 + tl.arange(0, BLOCK_N // 8)                        # (BLOCK_N / 8,)
    zero = tl.zeros((BLOCK_M, BLOCK_N // 8), tl.int32)
    # (Philox takes four counters of one width: each int32, whatever the kernel's index
    # types, int64 where a block's start or a document's first token is)
    c0 = (zero + groups[None, :]).to(tl.int32)                              # (BLOCK_M, N / 8)
    c1 = (zero + rows[:, None]).to(tl.int32)
    c2 = (zero + bh).to(tl.int32)
    c3 = (zero + first).to(tl.int32)
    r0, r1, r2, r3 = tl.philox(seed, c0, c1, c2, c3)                      # uint32 each
    # eight 16-bit numbers per draw, interleaved pairwise three times ((M, N/8) -> (M, N/4)
    # -> (M, N/2) -> (M, N)): key 8g + e takes word 2 * (e % 2) + (e // 2) % 2's half e // 4
    w0 = tl.interleave(r0 & 0xFFFF, r0 >> 16)
    w1 = tl.interleave(r1 & 0xFFFF, r1 >> 16)
    w2 = tl.interleave(r2 & 0xFFFF, r2 >> 16)
    w3 = tl.interleave(r3 & 0xFFFF, r3 >> 16)
    x = tl.interleave(tl.interleave(w0, w1), tl.interleave(w2, w3))        # (BLOCK_M, BLOCK_N)
    return x.to(tl.int32) >= threshold


@triton.jit
def kept(DROP, h, rows, start, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """:func:`keep_tile` of query head ``h`` for a kernel's ``DROP`` (:func:`drop_state`):
    ``(BLOCK_M, BLOCK_N)`` bool over ``rows`` and the keys from ``start``."""
    return keep_tile(DROP[0], DROP[1] + h, DROP[2], rows, start, DROP[3], BLOCK_M, BLOCK_N)


@triton.jit
def _keep_grid(SEED, OUT, H, Sq, Sk, first, threshold, BLOCK: tl.constexpr):
    # OUT (B, H, Sq, Sk) int8: keep_tile over the whole grid, one program per (row block,
    # key block, b * H + h)
    bh = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    start = tl.program_id(1) * BLOCK
    cols = start + tl.arange(0, BLOCK)
    keep = keep_tile(tl.load(SEED), bh, first, rows, start, threshold, BLOCK, BLOCK)
    at = (bh.to(tl.int64) * Sq + rows[:, None]) * Sk + cols[None, :]
    tl.store(OUT + at, keep.to(tl.int8), mask=(rows[:, None] < Sq) & (cols[None, :] < Sk))


def keep_mask(dropout: Dropout, B: int, H: int, Sq: int, Sk: int,
              first: int = 0) -> torch.Tensor:
    """``(B, H, Sq, Sk)`` bool: the pairs the kernels keep under ``dropout``, rows and keys
    counted from ``first`` (a packed document's first token; 0 without documents). For
    tests and inspection: the kernels never build it.

    Example:
        >>> import torch
        >>> d = draw(0.25, torch.device("cuda"))                          # doctest: +SKIP
        >>> keep_mask(d, 1, 2, 64, 64).float().mean()                      # doctest: +SKIP
        tensor(0.75...)
    """
    out = torch.empty(B, H, Sq, Sk, dtype=torch.int8, device=dropout.seed.device)
    block = 16
    if out.numel():
        launch(_keep_grid, (cdiv(Sq, block), cdiv(Sk, block), B * H),
               dropout.seed, out, H, Sq, Sk, first, dropout.threshold, BLOCK=block,
               num_warps=1, num_stages=1)
    return out.bool()

"""Rows whose log-sum-exp is too large for float32 to also hold their softmax's sum.

The forward keeps the online softmax's running maximum ``m`` and sum ``l`` in base 2 and
stores ``lse = (m + log2 l) · ln 2``; the backward rebuilds each probability as
``exp2(s - lse · log2 e)``. That is exact to float32's rounding while ``|m|`` is ordinary.
A row whose every visible score carries a huge finite bias (a padded query under an
additive mask of ``-1e30`` or ``finfo.min``, as Hugging Face models build them) has ``|m|``
so large that ``log2 l`` (at most ``log2 Sk``) falls below half a unit in the last place of
``m``: ``lse`` loses it, and the backward's probabilities of that row sum to ``l`` instead
of 1 (in a row of 32 equal scores each is 32 times too large), while the forward, which
divides by ``l`` itself, is right. Past ``|m|`` of about ``1e6`` part of ``log2 l`` is lost
(``-1e7``: up to 40% in each weight); at ``-1e4`` it is rounded to about ``2^-11``. In
practice only a bias makes such scores, so only the block-sparse kernels with a bias do
what follows; the band kernels (no bias) leave raw ``q·k`` scores of that size as they are.

The dQ kernel, which runs first, finds those rows (``|lse|`` of at least :data:`HUGE` in
base 2, finite), recomputes their ``m`` and ``l`` over the row's key blocks (a pass of
``QKᵀ`` alone, in the programs that hold such a row) and stores every row's pair
``(hi, lo)``: ``(m, log2 l)`` for those rows and ``(lse · log2 e, 0)`` for the others. Both
backward kernels then use ``P = exp2((s - hi) - lo)``: dQ by scaling its rows by
``exp2(-lo)`` at the end (``dS`` is linear in a row's ``P``), dK/dV per element.

Below :data:`HUGE` the old form's error in ``P`` is at most about ``1e-4`` (relative).
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import HUGE_LSE2
from ._band import load_tile, masked_scores
from .flash_fwd import softmax_step

#: :data:`multihead.kernels.HUGE_LSE2`, for the kernels
HUGE = tl.constexpr(HUGE_LSE2)


@triton.jit
def block_start(blocks, j, BLOCK_N: tl.constexpr, LISTS: tl.constexpr = True):
    """The first key of the ``j``-th block a program visits: its list's entry, or without
    LISTS (no mask: every block, in order) the ``j``-th block."""
    if LISTS:
        return tl.load(blocks + j) * BLOCK_N
    return j * BLOCK_N


@triton.jit
def row_stats(q, k_base, blocks, n_all, rows, row_ok, qk_scale, skn, skd, b, h, Sq, Sk, T, I,
              MASK_FN: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_BIAS: tl.constexpr = True,
              LISTS: tl.constexpr = True):
    """The forward's ``(m, l)`` of rows over their list's key blocks (``blocks[:n_all]``;
    without LISTS, the first ``n_all`` blocks), from the scores alone (with the mask's
    bias where HAS_BIAS): ``(BLOCK_M,)`` each, base 2."""
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    for j in tl.range(0, n_all, num_stages=1):
        cols = block_start(blocks, j, BLOCK_N, LISTS) + tl.arange(0, BLOCK_N)  # (BLOCK_N,)
        k = load_tile(k_base, cols, Sk, skn, skd, D, BLOCK_D, True)        # (BLOCK_N, BLOCK_D)
        s = tl.dot(q, tl.trans(k)) * qk_scale                              # (BLOCK_M, BLOCK_N)
        s, ok = masked_scores(s, b, h, rows[:, None], cols[None, :], row_ok[:, None], Sq, Sk,
                              0, 0, T, I, False, False, True, MASK_FN, HAS_BIAS)
        _, _, m_i, l_i = softmax_step(tl.where(ok, s, float("-inf")), m_i, l_i)
    return m_i, l_i


@triton.jit
def exact_rows(lse2, PAIRS, q, k_base, blocks, n_all, rows, row_ok, qk_scale, skn, skd, b, h,
               Sq, Sk, T, I, MASK_FN: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """``(hi, lo)`` of a dQ program's rows from their ``lse2`` (base 2), stored interleaved
    at ``PAIRS`` (this head's ``(Sq, 2)`` fp32) for the dK/dV kernel: ``(m, log2 l)``
    recomputed where ``lse2`` is too large to hold ``log2 l``, else ``(lse2, 0)``."""
    a = tl.abs(lse2)
    huge = (a >= HUGE) & (a < float("inf")) & row_ok
    lo = tl.zeros_like(lse2)
    if tl.max(huge.to(tl.int32), 0) > 0:               # rare: such a row is in this program
        m_i, l_i = row_stats(q, k_base, blocks, n_all, rows, row_ok, qk_scale, skn, skd, b,
                             h, Sq, Sk, T, I, MASK_FN, D, BLOCK_D, BLOCK_M, BLOCK_N)
        huge = huge & (l_i > 0.0)
        lse2 = tl.where(huge, m_i, lse2)
        lo = tl.where(huge, tl.math.log2(tl.where(huge, l_i, 1.0)), lo)
    tl.store(PAIRS + 2 * rows, lse2, mask=row_ok)
    tl.store(PAIRS + 2 * rows + 1, lo, mask=row_ok)
    return lse2, lo


@triton.jit
def load_pairs(PAIRS, rows, row_ok, BOUNDED: tl.constexpr):
    """``(hi, lo)`` of ``rows`` from the pairs :func:`exact_rows` stored at ``PAIRS`` (rows
    past ``row_ok`` read as 0 when BOUNDED)."""
    if BOUNDED:
        return (tl.load(PAIRS + 2 * rows, mask=row_ok, other=0.0),
                tl.load(PAIRS + 2 * rows + 1, mask=row_ok, other=0.0))
    return tl.load(PAIRS + 2 * rows), tl.load(PAIRS + 2 * rows + 1)

"""FlashAttention-2's backward in Triton, for the masks of :mod:`.flash_fwd`.

Given the forward's output ``O`` and log-sum-exp, with ``P = exp(S - lse)`` recomputed block
by block and ``delta = rowsum(dO * O)`` (minus the gradient of the lse, when it has one):

- ``_dkdv``: one program per (key block, batch, **K/V head**) holds its keys and values and
  walks the query blocks that see them (:func:`._band.query_range`, the forward's band
  transposed) for **every query head of its group** in turn, accumulating
  ``dV += Pᵀ dO`` and ``dK += scale · dSᵀ Q`` with ``dS = P ∘ (dO Vᵀ - delta)``. The GQA
  sum over the group happens in registers: no copies of K/V and no atomics. A step of
  fewer queries than the program's keys computes its block transposed (:func:`keys_left`:
  ``Sᵀ = K Qᵀ``, no transposes of P and dS through shared memory). The launch table's
  tiles decide: its measured entries are square today, so the transposed form runs for the
  tilings the tuner sweeps or a ``MULTIHEAD_TRITON_LAUNCH`` table names.
- ``_dq``: one program per (query block, batch, query head) walks the forward's key blocks
  (:func:`._band.key_range`): ``dQ += scale · dS K``. It runs first and also writes its rows'
  ``delta`` (it holds their ``dO``, and reads their ``O`` once), so ``_dkdv`` needs no
  separate pass over ``O`` and ``dO``.

No program adds into memory another program writes, so the gradients are deterministic
(bitwise the same from run to run) without a separate mode. Edge blocks evaluate the mask;
interior blocks run unmasked, as in the forward. Rows with nothing to attend to (lse
``-inf``) contribute nothing.

Notation: B batch, H query heads, Hkv K/V heads, G = H / Hkv, Sq/Sk lengths, D/Dv head dims.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._band import (LOG2E, check_inputs, check_pair, empty_like_all, finite_or_zero,
                    key_length, key_range, launch_config, load_tile, masked_scores, nonfinite,
                    pow2, program_block, query_range, schedule)
from . import _dropout
from ._dropout import Dropout, drop_args, drop_state, kept
from ._exact_rows import load_pairs
from ._launch import launch
from .flash_fwd import DYNAMIC


@triton.jit
def row_deltas(O, DO_TILE, DLSE, DELTA, at, rows, n, row_ok, som, sod, DV: tl.constexpr,
               BLOCK_DV: tl.constexpr, HAS_DLSE: tl.constexpr):
    # delta (rows,) = rowsum(dO * O) - dlse in fp32, of the rows a dQ program holds (their
    # dO tile given, O read once here), stored at DELTA + at for the dK/dV kernel to read.
    o = load_tile(O, rows, n, som, sod, DV, BLOCK_DV, True)               # (rows, BLOCK_DV)
    delta = tl.sum(o.to(tl.float32) * DO_TILE.to(tl.float32), 1)
    if HAS_DLSE:
        delta -= tl.load(DLSE + at + rows, mask=row_ok, other=0.0)
    tl.store(DELTA + at + rows, delta, mask=row_ok)
    return delta


@triton.jit
def _probs(s, ok, lse2, MASKED: tl.constexpr, lo=None):
    # P = exp2(s - lse2) of scores s (base 2, bias added; lse2 broadcast to s), exactly 0
    # where the mask rules a pair out (see _band.masked_scores); with lo (a row's pair
    # (hi, lo) of _exact_rows, broadcast as lse2), exp2((s - hi) - lo).
    if MASKED:
        x = tl.where(ok, s, 0.0) - lse2
    else:
        x = s - lse2
    if lo is not None:
        x = x - lo
    if MASKED:
        return tl.where(ok, tl.math.exp2(x), 0.0)
    return tl.math.exp2(x)


@triton.jit
def _dscores(p, ok, dp, delta, MASKED: tl.constexpr):
    # dS = P ∘ (dP - delta) (delta broadcast to p), exactly 0 on the pairs the mask hides
    # (where a hidden non-finite value made dP NaN, 0 * NaN would not be).
    ds = p * (dp - delta)
    if MASKED:
        ds = tl.where(ok, ds, 0.0)
    return ds


@triton.jit
def _dkdv_block(dk, dv, k, v, q_base, do_base, lse_base, dl_base, start, Sq, cols, klen,
                qk_scale, offset, window, sqm, sqd, sdm, sdd, b, h, T, I,
                D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
                BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr,
                WINDOWED: tl.constexpr, MASKED: tl.constexpr, MASK_FN: tl.constexpr,
                HAS_BIAS: tl.constexpr, KEYS_LEFT: tl.constexpr, CAREFUL: tl.constexpr,
                BOUNDED: tl.constexpr = True, DROPOUT: tl.constexpr = False, DROP=None):
    # The queries [start, start + BLOCK_M) of one head, against this program's keys
    # (CAREFUL: see _band.nonfinite; without BOUNDED, a masked block's queries are live and
    # the keys real: only the band is tested, and the rows load without bounds).
    # KEYS_LEFT computes the block transposed (Sᵀ = K Qᵀ, keys down): Pᵀ and dSᵀ then come
    # out of their products as the left operands of dV += Pᵀ dO and dK += dSᵀ Q, with no
    # transpose through shared memory, and the keys fill the 64-row left operand of a
    # Hopper warpgroup MMA when fewer queries would not (see keys_left). Else the block
    # is S = Q Kᵀ, as in the forward, and P, dS are transposed for those products.
    # DROPOUT (DROP: the kernel's _dropout.drop_state): a dropped pair adds nothing to dV
    # and its dP is 0, a kept one's is scaled by 1 / (1 - p) (dV's scale: at its store).
    rows = start + tl.arange(0, BLOCK_M)                                    # (BLOCK_M,)
    row_ok = rows < Sq
    q = load_tile(q_base, rows, Sq, sqm, sqd, D, BLOCK_D,
                  MASKED and BOUNDED)                                       # (BLOCK_M, BLOCK_D)
    do = load_tile(do_base, rows, Sq, sdm, sdd, DV, BLOCK_DV,
                   MASKED and BOUNDED)                                      # (BLOCK_M, BLOCK_DV)
    if HAS_BIAS:                # lse_base: the rows' (hi, lo) pairs (see _exact_rows)
        lse2, lo = load_pairs(lse_base, rows, row_ok, MASKED and BOUNDED)
    elif MASKED and BOUNDED:
        lse2 = tl.load(lse_base + rows, mask=row_ok, other=0.0) * 1.4426950408889634
    else:                                       # interior, or not BOUNDED: rows all live
        lse2 = tl.load(lse_base + rows) * 1.4426950408889634
    if MASKED and BOUNDED:
        delta = tl.load(dl_base + rows, mask=row_ok, other=0.0)
    else:
        delta = tl.load(dl_base + rows)
    if KEYS_LEFT:
        st = tl.dot(k, tl.trans(q)) * qk_scale                             # (BLOCK_N, BLOCK_M)
        st, ok = masked_scores(st, b, h, rows[None, :], cols[:, None], row_ok[None, :], Sq,
                               klen, offset, window, T, I, CAUSAL, WINDOWED, MASKED, MASK_FN,
                               HAS_BIAS, BOUNDED)
        if HAS_BIAS:
            pt = _probs(st, ok, lse2[None, :], MASKED, lo[None, :])
        else:
            pt = _probs(st, ok, lse2[None, :], MASKED)
        dpt = tl.dot(v, tl.trans(do))                                      # (BLOCK_N, BLOCK_M)
        pvt = pt
        if DROPOUT:
            keep = tl.trans(kept(DROP, h, rows, DROP[5], BLOCK_M,
                                 k.shape[0]))                               # (BLOCK_N, BLOCK_M)
            pvt = tl.where(keep, pt, 0.0)
            dpt = tl.where(keep, dpt * DROP[4], 0.0)
        dv += tl.dot(pvt.to(do.dtype), do)                                 # (BLOCK_N, BLOCK_DV)
        dst = _dscores(pt, ok, dpt, delta[None, :], MASKED).to(q.dtype)
    else:
        s = tl.dot(q, tl.trans(k)) * qk_scale                              # (BLOCK_M, BLOCK_N)
        s, ok = masked_scores(s, b, h, rows[:, None], cols[None, :], row_ok[:, None], Sq,
                              klen, offset, window, T, I, CAUSAL, WINDOWED, MASKED, MASK_FN,
                              HAS_BIAS, BOUNDED)
        if HAS_BIAS:
            p = _probs(s, ok, lse2[:, None], MASKED, lo[:, None])
        else:
            p = _probs(s, ok, lse2[:, None], MASKED)
        dp = tl.dot(do, tl.trans(v))                                       # (BLOCK_M, BLOCK_N)
        pv = p
        if DROPOUT:
            keep = kept(DROP, h, rows, DROP[5], BLOCK_M, k.shape[0])         # (BLOCK_M, BLOCK_N)
            pv = tl.where(keep, p, 0.0)
            dp = tl.where(keep, dp * DROP[4], 0.0)
        dv += tl.dot(tl.trans(pv.to(do.dtype)), do)                        # (BLOCK_N, BLOCK_DV)
        dst = tl.trans(_dscores(p, ok, dp, delta[:, None], MASKED).to(q.dtype))
    if MASKED and CAREFUL:  # a query hidden from some keys (band, padding) may hold anything
        q, _ = finite_or_zero(q)    # (a row that sees a non-finite value has ds NaN anyway)
    dk += tl.dot(dst, q)                                                    # (BLOCK_N, BLOCK_D)
    return dk, dv


def keys_left(block_m: int, block_n: int) -> bool:
    """Whether the dK/dV kernels compute their blocks transposed (keys as the left operand):
    when a step has fewer queries than the program has keys. A Hopper warpgroup MMA takes
    64 rows on its left, so a step of 16 or 32 queries fills it only with the keys there.

    Example:
        >>> keys_left(64, 64), keys_left(32, 128)
        (False, True)
    """
    return block_m < block_n


@triton.jit
def _kv_band(k, v, Q, DO, LSE, DELTA, b, hk, first, cols, n_q, klen, lo, w, a, c, hi, H, G,
             Sq, qk_scale, offset, window, sqb, sqh, sqm, sqd, sdb, sdh, sdm, sdd,
             D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
             WINDOWED: tl.constexpr, KEYS_LEFT: tl.constexpr, CAREFUL: tl.constexpr,
             DROPOUT: tl.constexpr = False, DROP=None):
    # dK, dV (fp32, unscaled) of this program's keys over the query blocks [lo, hi) of each
    # query head of the group (bounds of _band.query_range): [lo, w) tests the diagonal
    # alone, [w, a) the band, [a, c) nothing, [c, hi) the window's far edge and the
    # bounds (a separate loop for each: one loop for the last two, as in the forward,
    # made the compiler spill dK/dV's registers in the interior steps).
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), tl.float32)
    for g in range(G):                                 # the group's query heads, in registers
        h = hk * G + g
        q_base = Q + b * sqb + h * sqh + first * sqm
        do_base = DO + b * sdb + h * sdh + first * sdm
        lse_base = LSE + (b * H + h) * Sq + first
        dl_base = DELTA + (b * H + h) * Sq + first
        if CAREFUL:            # the rare second run (_band.nonfinite): every block masked
            for start in tl.range(lo, hi, BLOCK_M, num_stages=1):
                dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, lse_base, dl_base, start,
                                     n_q, cols, klen, qk_scale, offset, window, sqm, sqd, sdm,
                                     sdd, b, h, None, None, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M,
                                     CAUSAL, WINDOWED, True, None, False, KEYS_LEFT, True,
                                     DROPOUT=DROPOUT, DROP=DROP)
        else:
            if CAUSAL:
                for start in range(lo, w, BLOCK_M):   # the diagonal, nothing else
                    dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, lse_base, dl_base,
                                         start, n_q, cols, klen, qk_scale, offset, window, sqm,
                                         sqd, sdm, sdd, b, h, None, None, D, DV, BLOCK_D,
                                         BLOCK_DV, BLOCK_M, True, False, True, None, False,
                                         KEYS_LEFT, False, False, DROPOUT=DROPOUT, DROP=DROP)
            for start in range(w, a, BLOCK_M):        # both edges (narrow windows)
                dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, lse_base, dl_base, start,
                                     n_q, cols, klen, qk_scale, offset, window, sqm, sqd, sdm,
                                     sdd, b, h, None, None, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M,
                                     CAUSAL, WINDOWED, True, None, False, KEYS_LEFT, False,
                                     DROPOUT=DROPOUT, DROP=DROP)
            for start in range(a, c, BLOCK_M):
                dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, lse_base, dl_base, start,
                                     n_q, cols, klen, qk_scale, offset, window, sqm, sqd, sdm,
                                     sdd, b, h, None, None, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M,
                                     CAUSAL, WINDOWED, False, None, False, KEYS_LEFT, False,
                                     DROPOUT=DROPOUT, DROP=DROP)
            for start in range(c, hi, BLOCK_M):       # past every key's diagonal
                dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, lse_base, dl_base, start,
                                     n_q, cols, klen, qk_scale, offset, window, sqm, sqd, sdm,
                                     sdd, b, h, None, None, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M,
                                     False, WINDOWED, True, None, False, KEYS_LEFT, False,
                                     DROPOUT=DROPOUT, DROP=DROP)
    return dk, dv


@triton.jit(do_not_specialize=DYNAMIC + _dropout.DYNAMIC)
def _dkdv(Q, K, V, DO, LSE, DELTA, GK, GV, LENS, SEGS, SEED, scale, qk_scale,
          sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
          sdb, sdh, sdm, sdd, H, G, Sq, Sk, offset, window, drop_t, keep_scale,
          CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, HAS_LENS: tl.constexpr,
          VARLEN: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
          BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
          KEYS_LEFT: tl.constexpr, DROPOUT: tl.constexpr):
    Hkv = H // G
    b, hk, first, n_k, n0 = program_block(tl.program_id(0), Hkv, SEGS, Sk, VARLEN, BLOCK_N)
    DROP = drop_state(SEED, b, H, first, drop_t, keep_scale, DROPOUT, n0)
    n_q = n_k if VARLEN else Sq                        # a document attends within itself
    bk = b * Hkv + hk
    cols = n0 + tl.arange(0, BLOCK_N)                  # (BLOCK_N,) positions in the sequence
    dq_ = tl.arange(0, BLOCK_D)
    dv_ = tl.arange(0, BLOCK_DV)
    col_ok = cols < n_k
    k = load_tile(K + b * skb + hk * skh + first * skn, cols, n_k, skn, skd, D, BLOCK_D,
                  True)                                                     # (BLOCK_N, BLOCK_D)
    v = load_tile(V + b * svb + hk * svh + first * svn, cols, n_k, svn, svd, DV, BLOCK_DV,
                  True)                                                     # (BLOCK_N, BLOCK_DV)
    klen = key_length(LENS, b, n_k, HAS_LENS)
    lo, w, a, c, hi = query_range(n0, n_q, klen, offset, window, CAUSAL, WINDOWED,
                                  BLOCK_M, BLOCK_N)
    dk, dv = _kv_band(k, v, Q, DO, LSE, DELTA, b, hk, first, cols, n_q, klen, lo, w, a, c, hi,
                      H, G, Sq, qk_scale, offset, window, sqb, sqh, sqm, sqd, sdb, sdh, sdm,
                      sdd, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOWED,
                      KEYS_LEFT, False, DROPOUT, DROP)
    if nonfinite(dk):                                  # rare: run again, carefully
        dk, dv = _kv_band(k, v, Q, DO, LSE, DELTA, b, hk, first, cols, n_q, klen, lo, w, a,
                          c, hi, H, G, Sq, qk_scale, offset, window, sqb, sqh, sqm, sqd, sdb, sdh,
                          sdm, sdd, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL,
                          WINDOWED, KEYS_LEFT, True, DROPOUT, DROP)
    if DROPOUT:                                        # dV's 1 / (1 - p), once
        dv = dv * keep_scale
    # GK, GV (the gradients): contiguous (B, Hkv, Sk, D) and (B, Hkv, Sk, DV)
    at = bk * Sk + first + cols[:, None]                                    # (BLOCK_N, 1)
    tl.store(GK + at * D + dq_[None, :], (dk * scale).to(GK.dtype.element_ty),
             mask=col_ok[:, None] & (dq_[None, :] < D))
    tl.store(GV + at * DV + dv_[None, :], dv.to(GV.dtype.element_ty),
             mask=col_ok[:, None] & (dv_[None, :] < DV))


@triton.jit
def _dq_block(dq, q, do, lse2, delta, k_base, v_base, start, rows, row_ok, klen, qk_scale,
              offset, window, skn, skd, svn, svd, b, h, Sq, T, I, D: tl.constexpr,
              DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
              MASKED: tl.constexpr, MASK_FN: tl.constexpr, HAS_BIAS: tl.constexpr,
              CAREFUL: tl.constexpr, BOUNDED: tl.constexpr = True,
              DROPOUT: tl.constexpr = False, DROP=None):
    # The keys [start, start + BLOCK_N) against this program's queries (CAREFUL: see
    # _band.nonfinite; without BOUNDED, as in the forward's _attend_block: real keys,
    # only the band tested; DROPOUT: as in _dkdv_block).
    cols = start + tl.arange(0, BLOCK_N)                                    # (BLOCK_N,)
    k = load_tile(k_base, cols, klen, skn, skd, D, BLOCK_D,
                  MASKED and BOUNDED)                                       # (BLOCK_N, BLOCK_D)
    v = load_tile(v_base, cols, klen, svn, svd, DV, BLOCK_DV,
                  MASKED and BOUNDED)                                       # (BLOCK_N, BLOCK_DV)
    s = tl.dot(q, tl.trans(k)) * qk_scale                                   # (BLOCK_M, BLOCK_N)
    s, ok = masked_scores(s, b, h, rows[:, None], cols[None, :], row_ok[:, None], Sq, klen,
                          offset, window, T, I, CAUSAL, WINDOWED, MASKED, MASK_FN, HAS_BIAS,
                          BOUNDED)
    p = _probs(s, ok, lse2[:, None], MASKED)
    dp = tl.dot(do, tl.trans(v))                                            # (BLOCK_M, BLOCK_N)
    if DROPOUT:
        dp = tl.where(kept(DROP, h, rows, start, q.shape[0], BLOCK_N), dp * DROP[4], 0.0)
    ds = _dscores(p, ok, dp, delta[:, None], MASKED)
    if MASKED and CAREFUL:  # a key hidden from some rows (band, padding) may hold anything
        k, _ = finite_or_zero(k)    # (a row that sees a non-finite key has ds NaN anyway)
    return dq + tl.dot(ds.to(k.dtype), k)                                   # (BLOCK_M, BLOCK_D)


@triton.jit
def _q_band(q, do, lse2, delta, k_base, v_base, rows, row_ok, klen, lo, w, a, c, hi,
            qk_scale, offset, window, skn, skd, svn, svd, b, h, n_q, D: tl.constexpr,
            DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
            WINDOWED: tl.constexpr, CAREFUL: tl.constexpr, DROPOUT: tl.constexpr = False,
            DROP=None):
    # dQ (fp32, unscaled) of rows over the key blocks [lo, hi) (bounds of
    # _band.key_range): [lo, w) tests the window's edge alone, [a, c) nothing, the rest
    # the band (as in the forward's _band_blocks).
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    if CAREFUL:                # the rare second run (_band.nonfinite): every block masked
        for start in tl.range(lo, hi, BLOCK_N, num_stages=1):
            dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, start, rows, row_ok, klen,
                           qk_scale, offset, window, skn, skd, svn, svd, b, h, n_q, None, None,
                           D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, CAUSAL, WINDOWED, True, None,
                           False, True, DROPOUT=DROPOUT, DROP=DROP)
    else:
        if WINDOWED:
            for start in range(lo, w, BLOCK_N):       # the window's edge, nothing else
                dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, start, rows, row_ok,
                               klen, qk_scale, offset, window, skn, skd, svn, svd, b, h, n_q,
                               None, None, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, False, True,
                               True, None, False, False, False, DROPOUT=DROPOUT, DROP=DROP)
        for start in range(a, c, BLOCK_N):
            dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, start, rows, row_ok, klen,
                           qk_scale, offset, window, skn, skd, svn, svd, b, h, n_q, None, None,
                           D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, CAUSAL, WINDOWED, False, None,
                           False, False, DROPOUT=DROPOUT, DROP=DROP)
        for start in range(tl.where(w < a, w, c), hi, BLOCK_N):              # the rest
            dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, start, rows, row_ok, klen,
                           qk_scale, offset, window, skn, skd, svn, svd, b, h, n_q, None, None,
                           D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, CAUSAL, WINDOWED, True, None,
                           False, False, DROPOUT=DROPOUT, DROP=DROP)
    return dq


@triton.jit(do_not_specialize=DYNAMIC + _dropout.DYNAMIC)
def _dq(Q, K, V, DO, O, LSE, DLSE, DELTA, GQ, LENS, SEGS, SEED, scale, qk_scale,
        sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
        sdb, sdh, sdm, sdd, H, G, Sq, Sk, offset, window, drop_t, keep_scale,
        sob, soh, som, sod,
        CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, HAS_LENS: tl.constexpr,
        VARLEN: tl.constexpr, HAS_DLSE: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr):
    # Runs before _dkdv: each program also writes delta = rowsum(dO * O) - dlse of its own
    # rows (it holds dO already), which _dkdv then reads. (Under dropout O is the dropped
    # output, and delta = rowsum(dO * O) still equals the rows' sum of P * dP.)
    b, h, first, n_q, m0 = program_block(tl.program_id(0), H, SEGS, Sq, VARLEN, BLOCK_M)
    DROP = drop_state(SEED, b, H, first, drop_t, keep_scale, DROPOUT)
    n_k = n_q if VARLEN else Sk                        # a document attends within itself
    bh = b * H + h
    hk = h // G
    rows = m0 + tl.arange(0, BLOCK_M)                  # (BLOCK_M,) positions in the sequence
    dq_ = tl.arange(0, BLOCK_D)
    row_ok = rows < n_q
    q = load_tile(Q + b * sqb + h * sqh + first * sqm, rows, n_q, sqm, sqd, D, BLOCK_D,
                  True)                                                     # (BLOCK_M, BLOCK_D)
    do = load_tile(DO + b * sdb + h * sdh + first * sdm, rows, n_q, sdm, sdd, DV, BLOCK_DV,
                   True)                                                    # (BLOCK_M, BLOCK_DV)
    delta = row_deltas(O + b * sob + h * soh + first * som, do, DLSE, DELTA, bh * Sq + first,
                       rows, n_q, row_ok, som, sod, DV, BLOCK_DV, HAS_DLSE)  # (BLOCK_M,)
    lse2 = tl.load(LSE + bh * Sq + first + rows, mask=row_ok, other=0.0) * 1.4426950408889634
    klen = key_length(LENS, b, n_k, HAS_LENS)
    lo, w, a, c, hi = key_range(m0, klen, offset, window, CAUSAL, WINDOWED, BLOCK_M, BLOCK_N)
    k_base = K + b * skb + hk * skh + first * skn
    v_base = V + b * svb + hk * svh + first * svn
    dq = _q_band(q, do, lse2, delta, k_base, v_base, rows, row_ok, klen, lo, w, a, c, hi,
                 qk_scale, offset, window, skn, skd, svn, svd, b, h, n_q, D, DV, BLOCK_D,
                 BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOWED, False, DROPOUT, DROP)
    if nonfinite(dq):                                  # rare: run again, carefully
        dq = _q_band(q, do, lse2, delta, k_base, v_base, rows, row_ok, klen, lo, w, a, c, hi,
                     qk_scale, offset, window, skn, skd, svn, svd, b, h, n_q, D, DV, BLOCK_D,
                     BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOWED, True, DROPOUT, DROP)
    # GQ (the gradient): contiguous (B, H, Sq, D)
    tl.store(GQ + (bh * Sq + first + rows[:, None]) * D + dq_[None, :],
             (dq * scale).to(GQ.dtype.element_ty), mask=row_ok[:, None] & (dq_[None, :] < D))


def backward_setup(dout, q, k, v, out, lse, dlse, config):
    """What both backward wrappers start from: ``((dq, dk, dv) buffers, dout, delta, dlse,
    lse contiguous, (dkdv, dq) launch configs)``. ``delta (B, H, Sq)`` fp32 is unfilled: the
    dQ kernel, launched first, writes it; ``dlse`` is fp32 (``delta`` itself, unused, when
    there is none). For a call with nothing to compute the buffers are zeros and ``delta``
    is None.

    A ``dout`` broadcast along a dimension (stride 0, as ``out.sum().backward()`` gives) is
    copied out first: compiled for an H100 by Triton 3.6, the block-sparse dK kernel read
    such a tile wrongly (dQ and dV were right), so no kernel is handed one.

    Example:
        >>> import torch
        >>> q = torch.zeros(1, 4, 8, 16, dtype=torch.float16)      # (B, H, Sq, D)
        >>> kv = torch.zeros(1, 2, 8, 16, dtype=torch.float16)     # (B, Hkv, Sk, D)
        >>> dout = torch.ones(1, 1, 1, 1, dtype=torch.float16).expand(1, 4, 8, 16)
        >>> grads, dout, delta, dlse, lse, cfgs = backward_setup(
        ...     dout, q, kv, kv, q, torch.zeros(1, 4, 8), None, None)
        >>> [tuple(g.shape) for g in grads], dout.stride(), tuple(delta.shape), dlse is delta
        ([(1, 4, 8, 16), (1, 2, 8, 16), (1, 2, 8, 16)], (512, 128, 16, 1), (1, 4, 8), True)
    """
    grads = empty_like_all(q, k, v)
    if q.numel() == 0 or k.shape[2] == 0:
        return tuple(g.zero_() for g in grads), dout, None, dlse, lse, (None, None)
    if 0 in dout.stride():
        dout = dout.contiguous()
    D, Dv = q.shape[-1], v.shape[-1]
    delta = torch.empty(lse.shape, device=q.device, dtype=torch.float32)
    dlse = dlse.float().contiguous() if dlse is not None else delta
    return (grads, dout, delta, dlse, lse.contiguous(),
            config or (launch_config("bwd_kv", D, Dv), launch_config("bwd_q", D, Dv)))


def check_backward(fn: str, dout, q, v, out, lse, dlse=None) -> None:
    """Raise a ValueError naming ``fn``'s argument unless ``dout``, ``out``, ``lse`` (and
    ``dlse``) have the shapes, dtypes and device the forward of ``q (B, H, Sq, D)``,
    ``v (B, Hkv, Sk, Dv)`` gave.

    Example:
        >>> import torch
        >>> q = torch.zeros(1, 2, 4, 16, dtype=torch.float16)
        >>> lse = torch.zeros(1, 2, 4)
        >>> check_backward("flash_backward", q.float(), q, q, q, lse)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: flash_backward: dout is torch.float32 on cpu, must be torch.float16 on cpu...
    """
    B, H, Sq, _ = q.shape
    Dv = v.shape[-1]
    for name, t, shape, dtype in (("dout", dout, (B, H, Sq, Dv), q.dtype),
                                  ("out", out, (B, H, Sq, Dv), q.dtype),
                                  ("lse", lse, (B, H, Sq), torch.float32),
                                  ("dlse", dlse, (B, H, Sq), None)):    # any float
        if t is None:
            continue
        if tuple(t.shape) != shape:
            raise ValueError(f"{fn}: {name} must have shape {shape} (from q and v), "
                             f"got {tuple(t.shape)}: pass the forward's own output and lse")
        dtype = dtype or (t.dtype if t.is_floating_point() else torch.float32)
        if t.dtype != dtype or t.device != q.device:
            raise ValueError(f"{fn}: {name} is {t.dtype} on {t.device}, must be {dtype} on "
                             f"{q.device} (as the forward gave it): convert with "
                             f".to({q.device.type!r}, {dtype})")


def flash_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                   out: torch.Tensor, lse: torch.Tensor, *, scale: float, causal: bool = False,
                   window: int | None = None, offset: int = 0,
                   kv_lengths: torch.Tensor | None = None,
                   documents: torch.Tensor | None = None, dlse: torch.Tensor | None = None,
                   config: tuple | None = None, dropout: Dropout | None = None,
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`.flash_forward`'s call with these arguments.

    Args:
        dout: ``(B, H, Sq, Dv)``, the gradient of the output.
        out, lse: what the forward returned.
        scale, causal, window, offset, kv_lengths, documents: the forward's arguments
            (with documents, dK/dV programs too are scheduled per document).
        dlse: ``(B, H, Sq)`` gradient of the log-sum-exp, when it was used.
        config: ``(dkdv, dq)`` launch tuples ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``;
            default: the measured table (:func:`._band.launch_config`).
        dropout: the forward's own (the same seed: the same pairs dropped).

    Returns:
        ``dq (B, H, Sq, D)``, ``dk (B, Hkv, Sk, D)``, ``dv (B, Hkv, Sk, Dv)`` in the inputs'
        dtypes, each K/V gradient summed over its group of query heads.

    Example:
        >>> import torch
        >>> q = k = v = torch.randn(1, 2, 8, 16, device="cuda", dtype=torch.float16)  # doctest: +SKIP
        >>> out, lse = flash_forward(q, k, v, scale=0.25, causal=True)             # doctest: +SKIP
        >>> dq, dk, dv = flash_backward(torch.ones_like(out), q, k, v, out, lse,
        ...                             scale=0.25, causal=True)                   # doctest: +SKIP
    """
    scale, window, offset, _, _, causal = check_inputs(
        "flash_backward", q, k, v, kv_lengths, documents, offset, scale=scale, causal=causal,
        window=window)
    config = check_pair("flash_backward", config)
    check_backward("flash_backward", dout, q, v, out, lse, dlse)
    B, H, Sq, D = q.shape
    _, Hkv, Sk, Dv = v.shape
    has_dlse = dlse is not None
    seed, drop_t, keep_scale = drop_args(dropout, "flash_backward", q, lse)
    (dq, dk, dv), dout, delta, dlse, lse, (kv_cfg, q_cfg) = backward_setup(
        dout, q, k, v, out, lse, dlse, config)
    if delta is None:                                  # nothing to compute: zeros
        return dq, dk, dv
    lens = kv_lengths.contiguous() if kv_lengths is not None else delta  # unused: HAS_LENS off
    common = dict(CAUSAL=causal, WINDOWED=window is not None,
                  HAS_LENS=kv_lengths is not None, VARLEN=documents is not None, D=D, DV=Dv,
                  BLOCK_D=pow2(D), BLOCK_DV=pow2(Dv), DROPOUT=dropout is not None)
    args = (*q.stride(), *k.stride(), *v.stride(), *dout.stride(),
            H, H // Hkv, Sq, Sk, offset, window if window is not None else 0, drop_t,
            keep_scale)
    bm, bn, warps, stages = q_cfg                      # first: it writes delta for _dkdv
    segs, grid = schedule(documents, bm, B * H, Sq, H, delta)   # no documents: unread
    launch(_dq, grid, q, k, v, dout, out, lse, dlse, delta, dq, lens, segs, seed, scale,
           scale * LOG2E, *args, *out.stride(), **common, HAS_DLSE=has_dlse, BLOCK_M=bm,
           BLOCK_N=bn, num_warps=warps, num_stages=stages)
    bm, bn, warps, stages = kv_cfg
    segs, grid = schedule(documents, bn, B * Hkv, Sk, Hkv, delta)
    launch(_dkdv, grid, q, k, v, dout, lse, delta, dk, dv, lens, segs, seed, scale,
           scale * LOG2E, *args, **common, BLOCK_M=bm, BLOCK_N=bn,
           KEYS_LEFT=keys_left(bm, bn), num_warps=warps, num_stages=stages)
    return dq, dk, dv

"""FlashAttention-2's forward in Triton, for band masks (causal, sliding window) and key
padding, with GQA/MQA and ``Sq != Sk``.

One program computes ``BLOCK_M`` query rows of one (batch, head): it streams the key blocks
the mask can reach, keeping the running maximum and sum of the online softmax in fp32 (in
base 2: the scale folds ``log2(e)`` in, so each score costs one ``exp2``), and writes the
output rows and their log-sum-exp. The key-block range comes from the indices
(:func:`._band.key_range`):

- causal, aligned by ``offset`` (``Sk - Sq`` lower-right, 0 upper-left): query ``i`` sees
  keys ``j <= i + offset``, so the block stops after its last row's last key;
- a sliding window of ``window`` keys also starts at its first row's first key;
- key padding (``kv_lengths``, one per batch) stops every row at the sequence's length.

Only the blocks on the band's edges evaluate the mask; the blocks every row of the program
sees in full run without a comparison or a bounds check. No mask tensor exists. A program
whose accumulator ends non-finite runs its blocks again with the non-finite rule's care
(:func:`._band.nonfinite`); one that ends finite pays a single check. Query head
``h`` reads K/V head ``h // group`` in place (no copies). A row with nothing to attend to
gets zeros and a log-sum-exp of ``-inf``.

Notation: B batch, H query heads, Hkv K/V heads, Sq/Sk lengths, D/Dv head dims.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._band import (LOG2E, check_inputs, empty_outputs, finite_or_zero, key_length,
                    key_range, launch_config, load_tile, masked_scores, nonfinite, pow2,
                    program_block, schedule)
from . import _dropout
from ._dropout import Dropout, drop_args, drop_state, kept
from ._launch import launch

#: arguments whose value changes per call but must not cause a compile (Triton would
#: otherwise specialize on their divisibility by 16)
DYNAMIC = ["Sq", "Sk", "offset", "window"]


@triton.jit
def softmax_step(s, m_i, l_i):
    """One step of the online softmax (base 2) by the scores ``s (rows, N)`` (``-inf``
    where hidden): ``(p, alpha, m, l)``, the block's unnormalized probabilities, the factor
    that rescales what came before, and the new running maximum and sum (a row that has
    seen nothing keeps ``-inf`` and 0)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    shift = tl.where(m_new == float("-inf"), 0.0, m_new)                   # a row seeing nothing
    p = tl.math.exp2(s - shift[:, None])
    alpha = tl.math.exp2(m_i - shift)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _attend_block(q, acc, m_i, l_i, k_base, v_base, start, hi, qpos, row_ok, qk_scale, offset,
                  window, skn, skd, svn, svd, b, h, Sq, T, I, D: tl.constexpr, DV: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr,
                  CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, MASKED: tl.constexpr,
                  MASK_FN: tl.constexpr, HAS_BIAS: tl.constexpr, CAREFUL: tl.constexpr,
                  BOUNDED: tl.constexpr = True, DROPOUT: tl.constexpr = False, DROP=None):
    # One step of the online softmax (base 2) over the keys [start, start + BLOCK_N) for
    # rows at query positions qpos; MASKED evaluates the mask, hi and row_ok, else every
    # (row, key) of the block is known to be visible. The mask is the band, or MASK_FN(b, h,
    # ..., T, I) when given (a generated mask program; HAS_BIAS: it adds a bias to every
    # block). Without BOUNDED, a masked block's keys are known to be real (below hi) and
    # its dead rows go unstored: only the band is tested, and the tiles load unbounded.
    # CAREFUL (a second run, see _band.nonfinite) keeps a non-finite value a masked block
    # hides from the rows. DROPOUT: the pairs _dropout.keep_tile drops weigh nothing in the
    # product (DROP: the kernel's drop_state; the sum l counts them). Returns (acc, m, l).
    cols = start + tl.arange(0, BLOCK_N)                                    # (BLOCK_N,)
    k = load_tile(k_base, cols, hi, skn, skd, D, BLOCK_D,
                  MASKED and BOUNDED)                                       # (BLOCK_N, BLOCK_D)
    s = tl.dot(q, tl.trans(k)) * qk_scale                                  # (rows, BLOCK_N)
    s, ok = masked_scores(s, b, h, qpos[:, None], cols[None, :], row_ok[:, None], Sq, hi,
                          offset, window, T, I, CAUSAL, WINDOWED, MASKED, MASK_FN, HAS_BIAS,
                          BOUNDED)
    if MASKED:
        s = tl.where(ok, s, float("-inf"))
    p, alpha, m_new, l_i = softmax_step(s, m_i, l_i)
    v = load_tile(v_base, cols, hi, svn, svd, DV, BLOCK_DV,
                  MASKED and BOUNDED)                                       # (BLOCK_N, BLOCK_DV)
    if MASKED and CAREFUL:  # a key hidden from some rows (the band's, padding) may hold anything
        v, bad = finite_or_zero(v)                                          # bad (BLOCK_N,)
        seen = tl.max(tl.where(ok & bad[None, :], 1, 0), 1) > 0            # (rows,)
        l_i = tl.where(seen, float("nan"), l_i)     # a row that sees one: NaN out and lse
    if DROPOUT:
        p = tl.where(kept(DROP, h, qpos, start, p.shape[0], BLOCK_N), p, 0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)                  # (rows, BLOCK_DV)
    return acc, m_new, l_i


@triton.jit
def _finish(acc, m_i, l_i):
    # The normalized output rows and their natural log-sum-exp from base-2 statistics;
    # empty rows: zeros and -inf.
    empty = l_i == 0.0
    out = acc / tl.where(empty, 1.0, l_i)[:, None]
    lse = tl.where(empty, float("-inf"),
                   (m_i + tl.math.log2(tl.where(empty, 1.0, l_i))) * 0.6931471805599453)
    return out, lse


@triton.jit
def fresh_state(ROWS: tl.constexpr, BLOCK_DV: tl.constexpr):
    # The online softmax's start for ROWS rows: (acc 0, running max -inf, running sum 0).
    return (tl.zeros((ROWS, BLOCK_DV), tl.float32), tl.full((ROWS,), float("-inf"), tl.float32),
            tl.zeros((ROWS,), tl.float32))


@triton.jit
def _band_blocks(q, k_base, v_base, rows, row_ok, lo, w, full_lo, full_hi, hi, qk_scale,
                 offset, window, skn, skd, svn, svd, b, h, n_q, D: tl.constexpr,
                 DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
                 WINDOWED: tl.constexpr, CAREFUL: tl.constexpr, DROPOUT: tl.constexpr = False,
                 DROP=None):
    # The online softmax of rows over the key blocks [lo, hi) (bounds of _band.key_range):
    # [lo, w) tests the window's edge alone, [full_lo, full_hi) nothing, the rest the band
    # (the diagonal and the last keys, after the leading edge's [w, full_lo) where w is
    # short of it: then full_lo = full_hi, no block is full); CAREFUL (the rare second run,
    # see _band.nonfinite): every block masked and careful, in one loop without pipelining
    # (less to compile). DROPOUT, DROP: see _attend_block. Returns (acc (BLOCK_M,
    # BLOCK_DV), m, l) in fp32.
    acc, m_i, l_i = fresh_state(BLOCK_M, BLOCK_DV)
    if CAREFUL:
        for start in tl.range(lo, hi, BLOCK_N, num_stages=1):
            acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_base, v_base, start, hi, rows,
                                          row_ok, qk_scale, offset, window, skn, skd, svn, svd,
                                          b, h, n_q, None, None, D, DV, BLOCK_D, BLOCK_DV,
                                          BLOCK_N, CAUSAL, WINDOWED, True, None, False, True,
                                          DROPOUT=DROPOUT, DROP=DROP)
    else:
        if WINDOWED:
            for start in range(lo, w, BLOCK_N):        # the window's edge, nothing else
                acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_base, v_base, start, hi,
                                              rows, row_ok, qk_scale, offset, window, skn, skd,
                                              svn, svd, b, h, n_q, None, None, D, DV, BLOCK_D,
                                              BLOCK_DV, BLOCK_N, False, True, True, None,
                                              False, False, False, DROPOUT=DROPOUT,
                                              DROP=DROP)
        for start in range(full_lo, full_hi, BLOCK_N):     # blocks every row sees in full
            acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_base, v_base, start, hi, rows,
                                          row_ok, qk_scale, offset, window, skn, skd, svn, svd,
                                          b, h, n_q, None, None, D, DV, BLOCK_D, BLOCK_DV,
                                          BLOCK_N, CAUSAL, WINDOWED, False, None, False, False,
                                          DROPOUT=DROPOUT, DROP=DROP)
        for start in range(tl.where(w < full_lo, w, full_hi), hi, BLOCK_N):   # the rest
            acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_base, v_base, start, hi, rows,
                                          row_ok, qk_scale, offset, window, skn, skd, svn, svd,
                                          b, h, n_q, None, None, D, DV, BLOCK_D, BLOCK_DV,
                                          BLOCK_N, CAUSAL, WINDOWED, True, None, False, False,
                                          DROPOUT=DROPOUT, DROP=DROP)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=DYNAMIC + _dropout.DYNAMIC)
def _forward(Q, K, V, O, LSE, LENS, SEGS, SEED, qk_scale,
             sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
             sob, soh, som, sod,
             H, G, Sq, Sk, offset, window, drop_t, keep_scale,
             CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, HAS_LENS: tl.constexpr,
             VARLEN: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             DROPOUT: tl.constexpr):
    b, h, first, n_q, m0 = program_block(tl.program_id(0), H, SEGS, Sq, VARLEN, BLOCK_M)
    DROP = drop_state(SEED, b, H, first, drop_t, keep_scale, DROPOUT)
    n_k = n_q if VARLEN else Sk                        # a document attends within itself
    bh = b * H + h
    hk = h // G                                        # the K/V head of this query head
    rows = m0 + tl.arange(0, BLOCK_M)                  # (BLOCK_M,) positions in the sequence
    dv = tl.arange(0, BLOCK_DV)
    Q += b * sqb + h * sqh + first * sqm
    q = load_tile(Q, rows, n_q, sqm, sqd, D, BLOCK_D, True)                # (BLOCK_M, BLOCK_D)
    klen = key_length(LENS, b, n_k, HAS_LENS)
    lo, w, full_lo, full_hi, hi = key_range(m0, klen, offset, window, CAUSAL, WINDOWED,
                                            BLOCK_M, BLOCK_N)

    k_base = K + b * skb + hk * skh + first * skn
    v_base = V + b * svb + hk * svh + first * svn
    row_ok = rows < n_q
    acc, m_i, l_i = _band_blocks(q, k_base, v_base, rows, row_ok, lo, w, full_lo, full_hi,
                                 hi, qk_scale, offset, window, skn, skd, svn, svd, b, h, n_q,
                                 D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, CAUSAL, WINDOWED,
                                 False, DROPOUT, DROP)
    if nonfinite(acc):                                 # rare: run again, carefully
        acc, m_i, l_i = _band_blocks(q, k_base, v_base, rows, row_ok, lo, w, full_lo,
                                     full_hi, hi, qk_scale, offset, window, skn, skd, svn, svd,
                                     b, h, n_q, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N,
                                     CAUSAL, WINDOWED, True, DROPOUT, DROP)
    if DROPOUT:                                        # the survivors' 1 / (1 - p)
        acc = acc * keep_scale
    out, lse = _finish(acc, m_i, l_i)
    tl.store(O + b * sob + h * soh + (first + rows[:, None]) * som + dv[None, :] * sod,
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))
    tl.store(LSE + bh * Sq + first + rows, lse, mask=row_ok)


def flash_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                  causal: bool = False, window: int | None = None, offset: int = 0,
                  kv_lengths: torch.Tensor | None = None,
                  documents: torch.Tensor | None = None,
                  config: tuple[int, int, int, int] | None = None,
                  dropout: Dropout | None = None,
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q (B, H, Sq, D)`` over ``k (B, Hkv, Sk, D)``, ``v (B, Hkv, Sk, Dv)``.

    Args:
        scale: multiplier of the scores.
        causal: query ``i`` sees keys ``j <= i + offset``.
        window: with ``causal``, also ``j > i + offset - window`` (the query's own key and
            the ``window - 1`` before it).
        offset: the alignment of the band (``Sk - Sq``: lower-right; 0: upper-left).
        kv_lengths: ``(B,)`` int tensor on q's device; keys ``j >= kv_lengths[b]`` are
            padding.
        documents: packed documents (needs ``Sq == Sk`` and ``offset = 0``): a host
            ``(n, 3)`` int tensor of rows ``(b, first token, length)`` covering every
            sequence; each document attends within itself (and the band, counted from its
            own first token). Programs are scheduled per (document, query block)
            (:func:`._band.document_blocks`), so none visits another document's keys.
        config: ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``; default: the measured table
            of :func:`._band.launch_config` for this head dim.
        dropout: dropout on the weights (:class:`._dropout.Dropout`: its rate and seed);
            the backward must get the same.

    Returns:
        ``(out (B, H, Sq, Dv) in q's dtype, lse (B, H, Sq) fp32)``; rows with nothing to
        attend to give zeros and ``-inf``. The lse is the undropped softmax's.

    Example:
        >>> import torch
        >>> q = k = v = torch.randn(1, 2, 8, 16, device="cuda", dtype=torch.float16)  # doctest: +SKIP
        >>> out, lse = flash_forward(q, k, v, scale=0.25, causal=True)             # doctest: +SKIP
    """
    scale, window, offset, config, _, causal = check_inputs(
        "flash_forward", q, k, v, kv_lengths, documents, offset, scale=scale, causal=causal,
        window=window, config=config)
    B, H, Sq, D = q.shape
    _, Hkv, Sk, Dv = v.shape
    out, lse = empty_outputs(q, v)
    seed, drop_t, keep_scale = drop_args(dropout, "flash_forward", q, lse)
    if B * H * Sq == 0:
        return out, lse
    bm, bn, warps, stages = config or launch_config("fwd", D, Dv, window)
    lens = kv_lengths.contiguous() if kv_lengths is not None else lse  # unused: HAS_LENS off
    segs, grid = schedule(documents, bm, B * H, Sq, H, lse)   # no documents: lse, unread
    launch(
        _forward, grid, q, k, v, out, lse, lens, segs, seed, scale * LOG2E,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        H, H // Hkv, Sq, Sk, offset, window if window is not None else 0, drop_t, keep_scale,
        CAUSAL=causal, WINDOWED=window is not None, DROPOUT=dropout is not None,
        HAS_LENS=kv_lengths is not None, VARLEN=documents is not None, D=D, DV=Dv,
        BLOCK_D=pow2(D), BLOCK_DV=pow2(Dv), BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
        num_stages=stages)
    return out, lse

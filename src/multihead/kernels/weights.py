"""The attention weights ``softmax(q kᵀ · scale + bias)`` of any mask of our model, written
once in the inputs' dtype by Triton kernels (per head, or their mean over the heads); with
the attention kernels' dropout, those weights times the pairs they kept, scaled
(:mod:`._dropout`).

Where a caller asks for the weights (``return_weights=True``; ``torch.nn.MultiheadAttention``'s
default ``need_weights=True``) the reference path materializes the scores in float32 and
makes several passes over them (scale, mask, row maxima, softmax, a cast). This kernel
instead computes each row's softmax statistics from ``q kᵀ`` alone, then writes each block
of weights once: one program per (query block, batch and head) runs two passes over the
key blocks its mask's block lists name (:func:`.flash_sparse.block_lists`, kept on the
mask: with the block-sparse forward's tiles, a mask that forward ran has them already; a
mask the band kernels ran gets them on its first call):

1. the running maximum ``m`` and sum ``l`` of the online softmax (base 2), over the FULL
   and PARTIAL blocks, the mask program evaluated on each (:func:`._exact_rows.row_stats`);
2. ``exp2(s - m) / l`` for each of those blocks (the mask program evaluated on the PARTIAL
   ones, its bias added on every one), and zeros for the EMPTY ones.

Only ``q kᵀ`` is recomputed (no values are read), so on a GPU the kernel costs about the
writing of its output. The statistics come from the scores, not from a forward's
log-sum-exp: a row the forward made NaN through a NaN value it sees, or whose huge bias
(``-1e30``) left its lse without the log of its sum (:mod:`._exact_rows`), still gets the
softmax of its scores, as the reference's weights do. A row with nothing to attend to gets
zeros; a row that sees a NaN or ``+inf`` score is NaN at every key (as the reference's).
Without a mask every block is visited, the last one bounded where the keys end inside it.

The weights' head mean (``average=True``) is written without the weights per head, H
times less output: the first launch stores only each row's ``(m, l)`` per head (fp32);
a second launch, one program per (key block, query block, sequence), sums the H heads'
``exp2(s - m) / l`` of its tile in registers (each K/V tile loaded once for its G query
heads) and writes the mean once. Its key block is the one at that place in the query
block's list where the heads share one (FULL, PARTIAL or EMPTY by its place); where each
head has its own lists (a dense or bias tensor per head) every block is evaluated through
the mask program. Both launches compute ``q kᵀ`` for every head, so the mean costs about
the same arithmetic as the weights per head.

Notation: B batch, H query heads, Hkv K/V heads, G = H / Hkv, Sq/Sk lengths, D head dim.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..masks import base as MB
from ._band import LOG2E, cdiv, check_inputs, launch_config, load_tile, masked_scores, pow2, \
    program_block
from . import _dropout
from ._dropout import Dropout, drop_args, drop_state, kept
from ._exact_rows import block_start, row_stats
from ._launch import launch
from .flash_sparse import _entry, _list_strides, plan

#: per-call values that must not cause a compile (lengths, list sizes and strides)
DYNAMIC = ["Sq", "Sk", "NL", "slb", "slh", "sib", "sih"]
#: the same for the head mean's kernel
MEAN_DYNAMIC = ["Sq", "Sk", "NL", "n_unmasked", "slb", "sib"]


@triton.jit
def _probs(q, k, m_i, l_i, start, rows, row_ok, qk_scale, b, h, Sq, Sk, T, I,
           MASKED: tl.constexpr, MASK_FN: tl.constexpr, HAS_BIAS: tl.constexpr,
           BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr, DROP):
    # The weights of rows over the keys [start, start + BLOCK_N) of the tile k: exp2(s - m)
    # / l, 0 where MASKED finds the pair hidden or the row sees nothing (l = 0), NaN across
    # a row whose sum is NaN (it sees a NaN or +inf score: the reference's softmax of that
    # row is NaN at every key, hidden ones included); DROPOUT: times the attention kernels'
    # keep / (1 - p) (DROP: _dropout.drop_state; a NaN row stays NaN, as torch's dropout
    # leaves it). fp32 (rows, BLOCK_N).
    cols = start + tl.arange(0, BLOCK_N)                                    # (BLOCK_N,)
    s = tl.dot(q, tl.trans(k)) * qk_scale                                  # (rows, BLOCK_N)
    s, ok = masked_scores(s, b, h, rows[:, None], cols[None, :], row_ok[:, None], Sq, Sk,
                          0, 0, T, I, False, False, MASKED, MASK_FN, HAS_BIAS)
    live = l_i[:, None] != 0.0
    if MASKED:
        live = live & ok
    shift = tl.where(m_i == float("-inf"), 0.0, m_i)                      # (rows,)
    p = tl.math.exp2(s - shift[:, None]) / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    p = tl.where((l_i != l_i)[:, None], float("nan"), tl.where(live, p, 0.0))
    if DROPOUT:
        p = p * tl.where(kept(DROP, h, rows, start, p.shape[0], BLOCK_N), DROP[4], 0.0)
    return p


@triton.jit
def _empty_probs(l_i, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    # The weights of rows over an EMPTY block: 0, NaN across a row whose sum is NaN.
    nan_row = (l_i != l_i)[:, None]                                         # (rows, 1)
    return tl.where(nan_row, float("nan"), tl.zeros((BLOCK_M, BLOCK_N), tl.float32))


@triton.jit
def _write_block(w_base, q, k_base, m_i, l_i, start, rows, row_ok, qk_scale, skn, skd, swm,
                 swn, b, h, Sq, Sk, T, I, MASKED: tl.constexpr, ZERO: tl.constexpr,
                 MASK_FN: tl.constexpr, HAS_BIAS: tl.constexpr, D: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 DROPOUT: tl.constexpr, DROP):
    # One head's weights of rows over the keys [start, start + BLOCK_N), stored; ZERO: an
    # EMPTY block, without a product.
    cols = start + tl.arange(0, BLOCK_N)                                    # (BLOCK_N,)
    if ZERO:
        p = _empty_probs(l_i, BLOCK_M, BLOCK_N)
    else:
        k = load_tile(k_base, cols, Sk, skn, skd, D, BLOCK_D, MASKED)       # (BLOCK_N, BLOCK_D)
        p = _probs(q, k, m_i, l_i, start, rows, row_ok, qk_scale, b, h, Sq, Sk, T, I, MASKED,
                   MASK_FN, HAS_BIAS, BLOCK_N, DROPOUT, DROP)
    # (int64: one head's Sq * Sk weights may pass 2^31)
    tl.store(w_base + rows[:, None].to(tl.int64) * swm + cols[None, :] * swn,
             p.to(w_base.dtype.element_ty), mask=row_ok[:, None] & (cols[None, :] < Sk))


@triton.jit(do_not_specialize=DYNAMIC + _dropout.DYNAMIC)
def _weights(Q, K, W, SEED, NF, NP, IDX, qk_scale,
             sqb, sqh, sqm, sqd, skb, skh, skn, skd, swb, swh, swm, swn,
             slb, slh, sib, sih, NL, H, G, Sq, Sk, T, I, drop_t, keep_scale,
             LISTS: tl.constexpr, MASK_FN: tl.constexpr, HAS_BIAS: tl.constexpr,
             STATS: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr):
    # One head's weights of one query block (W: (B, H, Sq, Sk)); STATS: only the rows'
    # softmax statistics, into W: (B, H, 2, Sq) fp32, (m, l) in base 2. DROPOUT: the
    # weights dropped as the attention kernels dropped them (_dropout, from SEED).
    pid_m = tl.program_id(0)
    b, h, _, _, m0 = program_block(pid_m, H, IDX, Sq, False, BLOCK_M)     # b int64
    DROP = drop_state(SEED, b, H, 0, drop_t, keep_scale, DROPOUT)
    rows = m0 + tl.arange(0, BLOCK_M)                                       # (BLOCK_M,)
    row_ok = rows < Sq
    q = load_tile(Q + b * sqb + h * sqh, rows, Sq, sqm, sqd, D, BLOCK_D, True)  # (BLOCK_M, BLOCK_D)
    k_base = K + b * skb + (h // G) * skh
    if LISTS:
        n_full, n_all, blocks = _entry(NF, NP, IDX, b, h, pid_m, slb, slh, sib, sih, NL)
    else:                                              # no mask: every block, the last bounded
        n_full, n_all, blocks = Sk // BLOCK_N, NL, IDX
    m_i, l_i = row_stats(q, k_base, blocks, n_all, rows, row_ok, qk_scale, skn, skd, b, h,
                         Sq, Sk, T, I, MASK_FN, D, BLOCK_D, BLOCK_M, BLOCK_N, HAS_BIAS, LISTS)
    if STATS:
        at = W + (b * H + h) * 2 * Sq + rows                                # (BLOCK_M,)
        tl.store(at, m_i, mask=row_ok)
        tl.store(at + Sq, l_i, mask=row_ok)
    else:
        w_base = W + b * swb + h.to(tl.int64) * swh      # (H * Sq * Sk may pass 2^31)
        for j in range(0, n_full):                     # blocks every pair of which is allowed
            _write_block(w_base, q, k_base, m_i, l_i, block_start(blocks, j, BLOCK_N, LISTS),
                         rows, row_ok, qk_scale, skn, skd, swm, swn, b, h, Sq, Sk, T, I,
                         False, False, MASK_FN, HAS_BIAS, D, BLOCK_D, BLOCK_M, BLOCK_N,
                         DROPOUT, DROP)
        for j in range(n_full, n_all):                 # blocks the mask (or bounds) cut
            _write_block(w_base, q, k_base, m_i, l_i, block_start(blocks, j, BLOCK_N, LISTS),
                         rows, row_ok, qk_scale, skn, skd, swm, swn, b, h, Sq, Sk, T, I,
                         True, False, MASK_FN, HAS_BIAS, D, BLOCK_D, BLOCK_M, BLOCK_N,
                         DROPOUT, DROP)
        for j in range(n_all, NL):                     # EMPTY blocks: zeros
            _write_block(w_base, q, k_base, m_i, l_i, block_start(blocks, j, BLOCK_N, LISTS),
                         rows, row_ok, qk_scale, skn, skd, swm, swn, b, h, Sq, Sk, T, I,
                         False, True, MASK_FN, HAS_BIAS, D, BLOCK_D, BLOCK_M, BLOCK_N,
                         DROPOUT, DROP)


@triton.jit
def _head_sum(Q, K, STATS, rows, row_ok, start, qk_scale, sqb, sqh, sqm, sqd, skb, skh, skn,
              skd, b, H, G, Sq, Sk, T, I, MASKED: tl.constexpr, ZERO: tl.constexpr,
              MASK_FN: tl.constexpr, HAS_BIAS: tl.constexpr, D: tl.constexpr,
              BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              DROPOUT: tl.constexpr, DROP):
    # The sum over the H heads of their weights of rows over the keys [start, start +
    # BLOCK_N) (fp32 (BLOCK_M, BLOCK_N); DROPOUT: each head's dropped, as in _probs), each
    # K/V head's tile loaded once for the G query heads reading it.
    cols = start + tl.arange(0, BLOCK_N)                                    # (BLOCK_N,)
    acc = tl.zeros((BLOCK_M, BLOCK_N), tl.float32)
    for hk in range(0, H // G):
        if not ZERO:
            k = load_tile(K + b * skb + hk * skh, cols, Sk, skn, skd, D, BLOCK_D, MASKED)
        for g in range(0, G):
            h = hk * G + g
            at = STATS + (b * H + h) * 2 * Sq + rows                        # (BLOCK_M,)
            l_i = tl.load(at + Sq, mask=row_ok, other=0.0)
            if ZERO:
                acc += _empty_probs(l_i, BLOCK_M, BLOCK_N)
            else:
                m_i = tl.load(at, mask=row_ok, other=float("-inf"))
                q = load_tile(Q + b * sqb + h * sqh, rows, Sq, sqm, sqd, D, BLOCK_D, True)
                acc += _probs(q, k, m_i, l_i, start, rows, row_ok, qk_scale, b, h, Sq, Sk, T,
                              I, MASKED, MASK_FN, HAS_BIAS, BLOCK_N, DROPOUT, DROP)
    return acc


@triton.jit(do_not_specialize=MEAN_DYNAMIC + _dropout.DYNAMIC)
def _mean_weights(Q, K, W, STATS, SEED, NF, NP, IDX, qk_scale,
                  sqb, sqh, sqm, sqd, skb, skh, skn, skd, swb, swm, swn,
                  slb, sib, NL, n_unmasked, H, G, Sq, Sk, T, I, drop_t, keep_scale,
                  LISTS: tl.constexpr, MASK_FN: tl.constexpr, HAS_BIAS: tl.constexpr,
                  D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr):
    # The head mean of the weights over one (key block, query block) of sequence b, W:
    # (B, Sq, Sk), from the rows' statistics in STATS (B, H, 2, Sq). The key block is the
    # j-th of the query block's list (LISTS: one list for every head), else the j-th one,
    # unmasked below n_unmasked (no mask: the blocks the keys fill; a mask whose lists
    # differ by head: none, the mask program evaluated on every block). DROPOUT: the mean of
    # the weights dropped as in _weights.
    j = tl.program_id(0)
    pid_m = tl.program_id(1)
    b = tl.program_id(2).to(tl.int64)
    DROP = drop_state(SEED, b, H, 0, drop_t, keep_scale, DROPOUT)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)                          # (BLOCK_M,)
    row_ok = rows < Sq
    if LISTS:
        n_full, n_all, blocks = _entry(NF, NP, IDX, b, 0, pid_m, slb, 0, sib, 0, NL)
        start = tl.load(blocks + j) * BLOCK_N
    else:
        n_full, n_all, start = n_unmasked, NL, j * BLOCK_N
    cols = start + tl.arange(0, BLOCK_N)                                    # (BLOCK_N,)
    if j < n_full:                                     # every pair allowed, for every head
        acc = _head_sum(Q, K, STATS, rows, row_ok, start, qk_scale, sqb, sqh, sqm, sqd, skb,
                        skh, skn, skd, b, H, G, Sq, Sk, T, I, False, False, MASK_FN,
                        HAS_BIAS, D, BLOCK_D, BLOCK_M, BLOCK_N, DROPOUT, DROP)
    elif j < n_all:                                    # cut by the mask (or the bounds)
        acc = _head_sum(Q, K, STATS, rows, row_ok, start, qk_scale, sqb, sqh, sqm, sqd, skb,
                        skh, skn, skd, b, H, G, Sq, Sk, T, I, True, False, MASK_FN,
                        HAS_BIAS, D, BLOCK_D, BLOCK_M, BLOCK_N, DROPOUT, DROP)
    else:                                              # EMPTY for every head
        acc = _head_sum(Q, K, STATS, rows, row_ok, start, qk_scale, sqb, sqh, sqm, sqd, skb,
                        skh, skn, skd, b, H, G, Sq, Sk, T, I, False, True, MASK_FN,
                        HAS_BIAS, D, BLOCK_D, BLOCK_M, BLOCK_N, DROPOUT, DROP)
    tl.store(W + b * swb + rows[:, None].to(tl.int64) * swm + cols[None, :] * swn,
             (acc / H).to(W.dtype.element_ty), mask=row_ok[:, None] & (cols[None, :] < Sk))


def mean_launch(block_m: int, block_n: int, warps: int) -> dict:
    """The head mean kernel's warps and stages for the lists' tiles. A program holds two
    fp32 tiles of (BLOCK_M, BLOCK_N) at once (the sum and a head's weights), so at least a
    warp per 1024 of their elements: compiled for an H100, 128 x 64 tiles at D=64 spill
    registers with 4 warps (15 to 285 spilled loads and stores), none with 8. One stage:
    its loop runs over heads, not keys, and with two stages an MHA call's kernel (G=1)
    took 98 KB (D=64) to 196 KB (D=128) of shared memory, one program per SM; with one,
    33 to 49 KB (``python -m benchmarks.triton_sass --case "weights, no mask"``).

    Example:
        >>> mean_launch(128, 64, 4)
        {'num_warps': 8, 'num_stages': 1}
    """
    return {"num_warps": max(warps, block_m * block_n // 1024), "num_stages": 1}


def attention_weights(q: torch.Tensor, k: torch.Tensor, mask: MB.Mask | None, *,
                      scale: float, average: bool = False,
                      config: tuple[int, int, int, int] | None = None,
                      dropout: Dropout | None = None) -> torch.Tensor:
    """The weights of ``q (B, H, Sq, D)`` over ``k (B, Hkv, Sk, D)`` under ``mask``, per
    head or (``average``) their mean over the heads.

    Args:
        mask: a :class:`multihead.masks.Mask` whose tensors are on q's device (any mask the
            block-sparse kernels run: :func:`.mask_program.supported`), or None.
        scale: multiplier of the scores.
        average: return the mean over the H heads ``(B, Sq, Sk)``, summed in fp32 from the
            unrounded weights and written once: H times less memory than the weights per
            head (``torch.nn.MultiheadAttention``'s default ``average_attn_weights=True``).
        config: ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``; default: the block-sparse
            forward's tiles for head dim D (a caller whose values are wider passes the
            forward's own, so that one set of block lists serves both).
        dropout: the attention kernels' dropout (:class:`._dropout.Dropout`: the same rate
            and seed): the weights they multiplied the values by, each kept one scaled by
            ``1 / (1 - rate)`` (``p`` rounded to a multiple of 2^-16:
            :attr:`._dropout.Dropout.keep_scale`) and each dropped one 0, as
            ``torch.nn.MultiheadAttention`` returns them in training (``average``: their
            mean over the heads).

    Returns:
        ``(B, H, Sq, Sk)`` (``average``: ``(B, Sq, Sk)``) in q's dtype, contiguous: each
        row's softmax over the keys its mask allows (zeros elsewhere; with ``dropout``,
        dropped as described, so a row no longer sums to 1), a row with nothing to attend
        to all zeros.

    Raises:
        ValueError: naming the argument, for inputs the kernels do not take or a mask that
            does not fit them.

    Example:
        >>> import torch, multihead as mh
        >>> q = torch.randn(1, 2, 64, 16, device="cuda", dtype=torch.float16)      # doctest: +SKIP
        >>> w = attention_weights(q, q, mh.masks.causal(), scale=0.25)            # doctest: +SKIP
        >>> w.shape, bool(w[0, 0, 0, 1] == 0)                                       # doctest: +SKIP
        (torch.Size([1, 2, 64, 64]), True)
        >>> attention_weights(q, q, None, scale=0.25, average=True).shape          # doctest: +SKIP
        torch.Size([1, 64, 64])
    """
    args = check_inputs("attention_weights", q, k, k, scale=scale, config=config)
    if not isinstance(average, bool):
        raise TypeError(f"attention_weights: average must be True or False, got {average!r}")
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    w = q.new_empty((B, Sq, Sk) if average else (B, H, Sq, Sk))
    seed, *drop = drop_args(dropout, "attention_weights", q, w)
    if w.numel() == 0:
        return w
    if mask is not None:
        prog, (fwd,) = plan(mask, q, k, k, kernels=("fwd",), fn="attention_weights",
                            configs=None if args.config is None else (args.config,))
        cfg, lists = fwd.config, fwd.lists                # (n_full, n_part, index)
        fn, tensors, ints, has_bias = prog.fn, prog.tensors, prog.ints, prog.has_bias
        strides, n_blocks = _list_strides(lists[0], lists[2]), lists[2].shape[-1]
    else:
        cfg = args.config or launch_config("fwd_sparse", D, D, queries=Sq)
        lists, fn, tensors, ints, has_bias = (w, w, w), None, None, None, False  # unread
        strides, n_blocks = (0, 0, 0, 0), cdiv(Sk, cfg[1])
    bm, bn, warps, stages = cfg
    common = dict(MASK_FN=fn, HAS_BIAS=has_bias, D=D, BLOCK_D=pow2(D), BLOCK_M=bm,
                  BLOCK_N=bn, num_warps=warps, num_stages=stages)
    G = H // k.shape[1]
    # (the first launch's output: the weights, or the rows' statistics for the mean)
    first = q.new_empty(B, H, 2, Sq, dtype=torch.float32) if average else w
    launch(_weights, (cdiv(Sq, bm), B * H), q, k, first, seed, *lists, scale * LOG2E,
           *q.stride(), *k.stride(), *(0, 0, 0, 0) if average else w.stride(), *strides,
           n_blocks, H, G, Sq, Sk, tensors, ints, *drop, LISTS=mask is not None,
           STATS=average, DROPOUT=dropout is not None and not average, **common)
    if average:
        # one list serves every head where the mask's lists do not vary by head (stride 0)
        shared = mask is not None and strides[1] == strides[3] == 0
        unmasked = Sk // bn if mask is None else 0       # (lists: their own counts)
        # (key blocks on the grid's first axis, whose limit is 2^31 - 1, not 65535)
        launch(_mean_weights, (n_blocks, cdiv(Sq, bm), B), q, k, w, first, seed, *lists,
               scale * LOG2E, *q.stride(), *k.stride(), *w.stride(), strides[0], strides[2],
               n_blocks, unmasked, H, G, Sq, Sk, tensors, ints, *drop, LISTS=shared,
               DROPOUT=dropout is not None, **{**common, **mean_launch(bm, bn, warps)})
    return w

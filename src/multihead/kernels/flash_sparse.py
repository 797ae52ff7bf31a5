"""FlashAttention-2 over any mask of our model, visiting only the blocks it allows.

For masks that are not a band (documents from ids, dense bool, additive bias, ALiBi,
padding from a bool row, ``&``/``|``/``~`` compositions), each program reads its **block
list**: the key blocks its query block must visit, FULL ones first (every pair allowed: run
unmasked) then PARTIAL ones (the mask is evaluated in the kernel by the generated
:mod:`.mask_program`). EMPTY blocks are never visited. The lists are built on the device
from :meth:`multihead.masks.Mask.tiles` (as FlexAttention's ``BlockMask``), with no host
sync, and cached on the mask while its tensors are unmodified. The backward's dK/dV loop
reads the transposed lists (per key block, the query blocks that see it).

A block on the edge of the sequences (the last, short query or key block) is always
PARTIAL, so FULL blocks need no bounds checks. A mask with a bias (ALiBi, ``bias``) calls
the program on every block to add it; finite biases stay finite (``finfo.min`` averages,
as in the oracle), but a row whose every score is below about ``-2.3e38`` reports a
clamped log-sum-exp (near ``-2.1e38``) since base 2 cannot hold it in fp32. A row whose
every visible score carries a huge bias has an lse too large to hold its softmax's sum: the
backward recomputes that row's maximum and sum (:mod:`._exact_rows`). GQA/MQA,
empty rows (zeros, lse ``-inf``), dropout (:mod:`._dropout`: a pair's draw keyed by its
query and key positions in the sequences, the same in the three kernels) and the
deterministic backward are as in :mod:`.flash_fwd` and :mod:`.flash_bwd`, whose block steps
this file reuses.

Positions the mask hides may hold anything (padding): on a PARTIAL block a NaN or inf in a
hidden query, key or value never reaches a row or a gradient (the tiles are cleaned before
their products, where ``0 * NaN`` would be NaN), while a row that sees one is NaN, as in
:mod:`multihead.functional.nonfinite`.

Notation: B batch, H query heads, Hkv K/V heads, G = H / Hkv, Sq/Sk lengths, D/Dv head dims,
B'/H' the mask's own batch and head sizes (1 where it broadcasts), nQ/nK blocks.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from ..masks import base as MB
from ._band import (LOG2E, cdiv, check_arguments, check_inputs, check_pair, empty_outputs,
                    launch_config, load_tile, nonfinite, pow2, program_block)
from . import _dropout
from ._dropout import Dropout, drop_args, drop_state
from ._exact_rows import exact_rows
from ._launch import launch
from .flash_bwd import (_dkdv_block, _dq_block, backward_setup, check_backward, keys_left,
                        row_deltas)
from .flash_fwd import _attend_block, _finish, fresh_state
from .mask_program import MaskProgram, mask_program
from .._tracing import tracing

#: per-call values that must not cause a compile (lengths, list sizes and strides)
DYNAMIC = ["Sq", "Sk", "NL", "slb", "slh", "sib", "sih"]


def block_lists(mask: MB.Mask, sq: int, sk: int, block_m: int, block_n: int, device, *,
                by_key: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per query block (``by_key``: per key block) the blocks of the other axis to visit.

    Returns:
        ``(n_full (B', H', R), n_partial (B', H', R), index (B', H', R, C))`` int32 on
        ``device``: row ``r`` visits ``index[..., r, :n_full]`` unmasked, then
        ``index[..., r, n_full:n_full + n_partial]`` masked. R, C are the query and key
        block counts (swapped ``by_key``).

    Example:
        >>> import multihead as mh
        >>> nf, npart, idx = block_lists(mh.masks.causal(), 5, 5, 2, 2, "cpu")
        >>> nf[0, 0].tolist(), npart[0, 0].tolist(), idx[0, 0, 2].tolist()
        ([0, 1, 0], [1, 1, 3], [0, 1, 2])
    """
    device = torch.device(device)

    def build():
        state = mask._tile_map(sq, sk, tile_q=block_m, tile_k=block_n, device=device).state
        state = state.clone()                                       # (B', H', nQ, nK) int8
        # short last blocks: bounds. While tracing, always (a branch on a symbolic length
        # would compile the graph once per remainder class)
        traced = tracing()
        if traced or sq % block_m:
            state[..., -1, :] = state[..., -1, :].clamp(max=MB.PARTIAL)
        if traced or sk % block_n:
            state[..., -1] = state[..., -1].clamp(max=MB.PARTIAL)
        if by_key:
            state = state.transpose(-1, -2)                         # (B', H', nK, nQ)
        rank = MB.FULL - state                                      # FULL 0, PARTIAL 1, EMPTY 2
        index = torch.argsort(rank, dim=-1, stable=True).to(torch.int32).contiguous()
        n_full = (state == MB.FULL).sum(-1, dtype=torch.int32)      # (B', H', R)
        n_part = (state == MB.PARTIAL).sum(-1, dtype=torch.int32)
        return n_full, n_part, index

    return mask.cached("triton_lists", (sq, sk, block_m, block_n, str(device), by_key), build)


def list_shape(sq: int, sk: int, block_m: int, block_n: int, by_key: bool) -> tuple[int, int]:
    """``(R, C)`` of :func:`block_lists`' index for these lengths and blocks: a row per query
    block and a column per key block (swapped ``by_key``).

    Example:
        >>> list_shape(100, 300, 64, 128, False), list_shape(100, 300, 64, 128, True)
        ((2, 3), (3, 2))
    """
    rows, cols = cdiv(sq, block_m), cdiv(sk, block_n)
    return (cols, rows) if by_key else (rows, cols)


def program(mask: MB.Mask, sq: int, sk: int, device) -> MaskProgram:
    """The mask's :func:`.mask_program` for these lengths, cached on the mask."""
    return mask.cached("triton_program", (sq, sk, str(device)),
                       lambda: mask_program(mask, sq, sk, device))


def _list_strides(n_full: torch.Tensor, index: torch.Tensor) -> tuple[int, int, int, int]:
    # (batch, head) strides of the counts and the index, 0 where the mask broadcasts
    return tuple(0 if t.shape[d] == 1 else t.stride(d) for t in (n_full, index) for d in (0, 1))


@triton.jit
def _entry(NF, NP, IDX, b, h, r, slb, slh, sib, sih, NL):
    # Row r of the (batch b, head h) lists: (FULL count, FULL + PARTIAL count, its blocks).
    at = b * slb + h * slh + r
    n_full = tl.load(NF + at)
    return n_full, n_full + tl.load(NP + at), IDX + b * sib + h * sih + r * NL


@triton.jit
def _list_blocks(q, k_base, v_base, blocks, n_full, n_all, rows, row_ok, qk_scale, skn, skd,
                 svn, svd, b, h, Sq, Sk, T, I, MASK_FN: tl.constexpr, HAS_BIAS: tl.constexpr,
                 D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 CAREFUL: tl.constexpr, DROPOUT: tl.constexpr, DROP):
    # The online softmax of rows over their list's key blocks: the FULL ones (blocks[:n_full])
    # as they are, the PARTIAL ones (blocks[n_full:n_all]) through the mask program
    # (DROPOUT, DROP: as in _attend_block). Returns (acc (BLOCK_M, BLOCK_DV), m, l) in fp32.
    acc, m_i, l_i = fresh_state(BLOCK_M, BLOCK_DV)
    if CAREFUL:                # the rare second run (_band.nonfinite): every block masked
        for j in tl.range(0, n_all, num_stages=1):
            start = tl.load(blocks + j) * BLOCK_N
            acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_base, v_base, start, Sk, rows,
                                          row_ok, qk_scale, 0, 0, skn, skd, svn, svd, b, h, Sq,
                                          T, I, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, False, False,
                                          True, MASK_FN, HAS_BIAS, True, DROPOUT=DROPOUT,
                                          DROP=DROP)
    else:
        for j in range(0, n_full):                     # blocks every pair of which is allowed
            start = tl.load(blocks + j) * BLOCK_N
            acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_base, v_base, start, Sk, rows,
                                          row_ok, qk_scale, 0, 0, skn, skd, svn, svd, b, h, Sq,
                                          T, I, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, False, False,
                                          False, MASK_FN, HAS_BIAS, False, DROPOUT=DROPOUT,
                                          DROP=DROP)
        for j in range(n_full, n_all):                 # blocks the mask program evaluates
            start = tl.load(blocks + j) * BLOCK_N
            acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, k_base, v_base, start, Sk, rows,
                                          row_ok, qk_scale, 0, 0, skn, skd, svn, svd, b, h, Sq,
                                          T, I, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, False, False,
                                          True, MASK_FN, HAS_BIAS, False, DROPOUT=DROPOUT,
                                          DROP=DROP)
    return acc, m_i, l_i


@triton.jit(do_not_specialize=DYNAMIC + _dropout.DYNAMIC)
def _forward_sparse(Q, K, V, O, LSE, SEED, NF, NP, IDX, qk_scale,
                    sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                    sob, soh, som, sod, slb, slh, sib, sih, NL,
                    H, G, Sq, Sk, T, I, drop_t, keep_scale, MASK_FN: tl.constexpr,
                    HAS_BIAS: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, DROPOUT: tl.constexpr):
    pid_m = tl.program_id(0)
    b, h, _, _, m0 = program_block(pid_m, H, IDX, Sq, False, BLOCK_M)     # b int64
    DROP = drop_state(SEED, b, H, 0, drop_t, keep_scale, DROPOUT)          # absolute positions
    bh = b * H + h
    hk = h // G
    rows = m0 + tl.arange(0, BLOCK_M)                                       # (BLOCK_M,)
    dv = tl.arange(0, BLOCK_DV)
    row_ok = rows < Sq
    q = load_tile(Q + b * sqb + h * sqh, rows, Sq, sqm, sqd, D, BLOCK_D, True)  # (BLOCK_M, BLOCK_D)
    n_full, n_all, blocks = _entry(NF, NP, IDX, b, h, pid_m, slb, slh, sib, sih, NL)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    acc, m_i, l_i = _list_blocks(q, k_base, v_base, blocks, n_full, n_all, rows, row_ok,
                                 qk_scale, skn, skd, svn, svd, b, h, Sq, Sk, T, I, MASK_FN,
                                 HAS_BIAS, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, False,
                                 DROPOUT, DROP)
    if nonfinite(acc):                                 # rare: run again, carefully
        acc, m_i, l_i = _list_blocks(q, k_base, v_base, blocks, n_full, n_all, rows, row_ok,
                                     qk_scale, skn, skd, svn, svd, b, h, Sq, Sk, T, I,
                                     MASK_FN, HAS_BIAS, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M,
                                     BLOCK_N, True, DROPOUT, DROP)
    if DROPOUT:                                        # the survivors' 1 / (1 - p)
        acc = acc * keep_scale
    out, lse = _finish(acc, m_i, l_i)
    tl.store(O + b * sob + h * soh + rows[:, None] * som + dv[None, :] * sod,
             out.to(O.dtype.element_ty), mask=row_ok[:, None] & (dv[None, :] < DV))
    tl.store(LSE + bh * Sq + rows, lse, mask=row_ok)


@triton.jit
def _kv_lists(k, v, Q, DO, LSE, DELTA, NF, NP, IDX, pid_n, b, hk, cols, H, G, Sq, Sk, T, I,
              qk_scale, sqb, sqh, sqm, sqd, sdb, sdh, sdm, sdd, slb, slh, sib, sih, NL,
              MASK_FN: tl.constexpr, HAS_BIAS: tl.constexpr, D: tl.constexpr,
              DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KEYS_LEFT: tl.constexpr,
              CAREFUL: tl.constexpr, DROPOUT: tl.constexpr, DROP):
    # dK, dV (fp32, unscaled; DROPOUT: dV without its 1 / (1 - p)) of this program's keys
    # over the query blocks of their transposed lists, for each query head of the group.
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), tl.float32)
    for g in range(G):                                 # the group's query heads, in registers
        h = hk * G + g
        q_base = Q + b * sqb + h * sqh
        do_base = DO + b * sdb + h * sdh
        if HAS_BIAS:           # LSE: the rows' (hi, lo) pairs, (B, H, Sq, 2) (_exact_rows)
            lse_base = LSE + 2 * (b * H + h) * Sq
        else:
            lse_base = LSE + (b * H + h) * Sq
        dl_base = DELTA + (b * H + h) * Sq
        n_full, n_all, blocks = _entry(NF, NP, IDX, b, h, pid_n, slb, slh, sib, sih,
                                       NL)             # this key block's transposed lists
        if CAREFUL:            # the rare second run (_band.nonfinite): every block masked
            for j in tl.range(0, n_all, num_stages=1):
                start = tl.load(blocks + j) * BLOCK_M
                dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, lse_base, dl_base, start,
                                     Sq, cols, Sk, qk_scale, 0, 0, sqm, sqd, sdm, sdd, b, h, T,
                                     I, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, False, False, True,
                                     MASK_FN, HAS_BIAS, KEYS_LEFT, True, DROPOUT=DROPOUT,
                                     DROP=DROP)
        else:
            for j in range(0, n_full):
                start = tl.load(blocks + j) * BLOCK_M
                dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, lse_base, dl_base, start,
                                     Sq, cols, Sk, qk_scale, 0, 0, sqm, sqd, sdm, sdd, b, h, T,
                                     I, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, False, False, False,
                                     MASK_FN, HAS_BIAS, KEYS_LEFT, False, DROPOUT=DROPOUT,
                                     DROP=DROP)
            for j in range(n_full, n_all):
                start = tl.load(blocks + j) * BLOCK_M
                dk, dv = _dkdv_block(dk, dv, k, v, q_base, do_base, lse_base, dl_base, start,
                                     Sq, cols, Sk, qk_scale, 0, 0, sqm, sqd, sdm, sdd, b, h, T,
                                     I, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, False, False, True,
                                     MASK_FN, HAS_BIAS, KEYS_LEFT, False, DROPOUT=DROPOUT,
                                     DROP=DROP)
    return dk, dv


@triton.jit(do_not_specialize=DYNAMIC + _dropout.DYNAMIC)
def _dkdv_sparse(Q, K, V, DO, LSE, DELTA, GK, GV, SEED, NF, NP, IDX, scale, qk_scale,
                 sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
                 sdb, sdh, sdm, sdd, slb, slh, sib, sih, NL,
                 H, G, Sq, Sk, T, I, drop_t, keep_scale, MASK_FN: tl.constexpr,
                 HAS_BIAS: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                 BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, KEYS_LEFT: tl.constexpr, DROPOUT: tl.constexpr):
    pid_n = tl.program_id(0)
    Hkv = H // G
    b, hk, _, _, n0 = program_block(pid_n, Hkv, IDX, Sk, False, BLOCK_N)   # b int64
    DROP = drop_state(SEED, b, H, 0, drop_t, keep_scale, DROPOUT, n0)
    bk = b * Hkv + hk
    cols = n0 + tl.arange(0, BLOCK_N)                                       # (BLOCK_N,)
    dq_ = tl.arange(0, BLOCK_D)
    dv_ = tl.arange(0, BLOCK_DV)
    col_ok = cols < Sk
    k = load_tile(K + b * skb + hk * skh, cols, Sk, skn, skd, D, BLOCK_D, True)
    v = load_tile(V + b * svb + hk * svh, cols, Sk, svn, svd, DV, BLOCK_DV, True)
    dk, dv = _kv_lists(k, v, Q, DO, LSE, DELTA, NF, NP, IDX, pid_n, b, hk, cols, H, G, Sq, Sk,
                       T, I, qk_scale, sqb, sqh, sqm, sqd, sdb, sdh, sdm, sdd, slb, slh, sib,
                       sih, NL, MASK_FN, HAS_BIAS, D, DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N,
                       KEYS_LEFT, False, DROPOUT, DROP)
    if nonfinite(dk):                                  # rare: run again, carefully
        dk, dv = _kv_lists(k, v, Q, DO, LSE, DELTA, NF, NP, IDX, pid_n, b, hk, cols, H, G, Sq,
                           Sk, T, I, qk_scale, sqb, sqh, sqm, sqd, sdb, sdh, sdm, sdd, slb,
                           slh, sib, sih, NL, MASK_FN, HAS_BIAS, D, DV, BLOCK_D, BLOCK_DV,
                           BLOCK_M, BLOCK_N, KEYS_LEFT, True, DROPOUT, DROP)
    if DROPOUT:                                        # dV's 1 / (1 - p), once
        dv = dv * keep_scale
    # GK, GV (the gradients): contiguous (B, Hkv, Sk, D) and (B, Hkv, Sk, DV)
    tl.store(GK + (bk * Sk + cols[:, None]) * D + dq_[None, :],
             (dk * scale).to(GK.dtype.element_ty), mask=col_ok[:, None] & (dq_[None, :] < D))
    tl.store(GV + (bk * Sk + cols[:, None]) * DV + dv_[None, :], dv.to(GV.dtype.element_ty),
             mask=col_ok[:, None] & (dv_[None, :] < DV))


@triton.jit
def _q_lists(q, do, lse2, delta, k_base, v_base, blocks, n_full, n_all, rows, row_ok, qk_scale,
             skn, skd, svn, svd, b, h, Sq, Sk, T, I, MASK_FN: tl.constexpr,
             HAS_BIAS: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
             CAREFUL: tl.constexpr, DROPOUT: tl.constexpr, DROP):
    # dQ (fp32, unscaled) of rows over their list's key blocks (DROPOUT: as in _dq_block).
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    if CAREFUL:                # the rare second run (_band.nonfinite): every block masked
        for j in tl.range(0, n_all, num_stages=1):
            start = tl.load(blocks + j) * BLOCK_N
            dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, start, rows, row_ok, Sk,
                           qk_scale, 0, 0, skn, skd, svn, svd, b, h, Sq, T, I, D, DV, BLOCK_D,
                           BLOCK_DV, BLOCK_N, False, False, True, MASK_FN, HAS_BIAS, True,
                           DROPOUT=DROPOUT, DROP=DROP)
    else:
        for j in range(0, n_full):
            start = tl.load(blocks + j) * BLOCK_N
            dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, start, rows, row_ok, Sk,
                           qk_scale, 0, 0, skn, skd, svn, svd, b, h, Sq, T, I, D, DV, BLOCK_D,
                           BLOCK_DV, BLOCK_N, False, False, False, MASK_FN, HAS_BIAS, False,
                           DROPOUT=DROPOUT, DROP=DROP)
        for j in range(n_full, n_all):
            start = tl.load(blocks + j) * BLOCK_N
            dq = _dq_block(dq, q, do, lse2, delta, k_base, v_base, start, rows, row_ok, Sk,
                           qk_scale, 0, 0, skn, skd, svn, svd, b, h, Sq, T, I, D, DV, BLOCK_D,
                           BLOCK_DV, BLOCK_N, False, False, True, MASK_FN, HAS_BIAS, False,
                           DROPOUT=DROPOUT, DROP=DROP)
    return dq


@triton.jit(do_not_specialize=DYNAMIC + _dropout.DYNAMIC)
def _dq_sparse(Q, K, V, DO, O, LSE, DLSE, DELTA, PAIRS, GQ, SEED, NF, NP, IDX, scale,
               qk_scale, sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd,
               sdb, sdh, sdm, sdd, slb, slh, sib, sih, NL,
               H, G, Sq, Sk, T, I, sob, soh, som, sod, drop_t, keep_scale,
               HAS_DLSE: tl.constexpr, MASK_FN: tl.constexpr, HAS_BIAS: tl.constexpr,
               D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               DROPOUT: tl.constexpr):
    pid_m = tl.program_id(0)
    b, h, _, _, m0 = program_block(pid_m, H, IDX, Sq, False, BLOCK_M)     # b int64
    DROP = drop_state(SEED, b, H, 0, drop_t, keep_scale, DROPOUT)
    bh = b * H + h
    hk = h // G
    rows = m0 + tl.arange(0, BLOCK_M)                                       # (BLOCK_M,)
    dq_ = tl.arange(0, BLOCK_D)
    row_ok = rows < Sq
    q = load_tile(Q + b * sqb + h * sqh, rows, Sq, sqm, sqd, D, BLOCK_D, True)
    do = load_tile(DO + b * sdb + h * sdh, rows, Sq, sdm, sdd, DV, BLOCK_DV, True)
    # launched before _dkdv_sparse: it writes the delta of its rows, which that one reads
    delta = row_deltas(O + b * sob + h * soh, do, DLSE, DELTA, bh * Sq, rows, Sq, row_ok, som,
                       sod, DV, BLOCK_DV, HAS_DLSE)                          # (BLOCK_M,)
    lse2 = tl.load(LSE + bh * Sq + rows, mask=row_ok, other=0.0) * 1.4426950408889634
    n_full, n_all, blocks = _entry(NF, NP, IDX, b, h, pid_m, slb, slh, sib, sih, NL)
    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    if HAS_BIAS:               # rows too large for lse to hold their sum: _exact_rows
        lse2, lo = exact_rows(lse2, PAIRS + 2 * bh * Sq, q, k_base, blocks, n_all, rows,
                              row_ok, qk_scale, skn, skd, b, h, Sq, Sk, T, I, MASK_FN, D,
                              BLOCK_D, BLOCK_M, BLOCK_N)
    dq = _q_lists(q, do, lse2, delta, k_base, v_base, blocks, n_full, n_all, rows, row_ok,
                  qk_scale, skn, skd, svn, svd, b, h, Sq, Sk, T, I, MASK_FN, HAS_BIAS, D, DV,
                  BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, False, DROPOUT, DROP)
    if nonfinite(dq):                                  # rare: run again, carefully
        dq = _q_lists(q, do, lse2, delta, k_base, v_base, blocks, n_full, n_all, rows, row_ok,
                      qk_scale, skn, skd, svn, svd, b, h, Sq, Sk, T, I, MASK_FN, HAS_BIAS, D,
                      DV, BLOCK_D, BLOCK_DV, BLOCK_M, BLOCK_N, True, DROPOUT, DROP)
    if HAS_BIAS:
        dq = dq * tl.math.exp2(-lo)[:, None]           # P = exp2(s - hi) * exp2(-lo)
    # GQ (the gradient): contiguous (B, H, Sq, D)
    tl.store(GQ + (bh * Sq + rows[:, None]) * D + dq_[None, :],
             (dq * scale).to(GQ.dtype.element_ty), mask=row_ok[:, None] & (dq_[None, :] < D))


def _check_mask(fn: str, mask: MB.Mask, q, k) -> None:
    if not isinstance(mask, MB.Mask):
        raise TypeError(f"{fn}: mask must be a multihead.masks.Mask, got "
                        f"{type(mask).__name__}: without a mask, call "
                        f"multihead.kernels.flash_fwd.flash_forward")
    B, H, Sq, _ = q.shape
    try:
        mask.check(B, H, Sq, k.shape[2], q.device)
    except ValueError as e:
        raise ValueError(f"{fn}: {e}") from None


class Launch(NamedTuple):
    """One kernel's launch: ``config`` ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` and the
    block ``lists`` ``(n_full, n_part, index)`` for those blocks (:func:`block_lists`)."""

    config: tuple
    lists: tuple


#: the kernels of a call, each with whether its lists go by key: the forward, then the
#: backward's dK/dV (per key block, the query blocks that see it) and dQ
KERNELS = {"fwd": False, "bwd_kv": True, "bwd_q": False}


def plan(mask: MB.Mask, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
         kernels: tuple[str, ...], configs: tuple | None = None, fn: str = "plan",
         ) -> tuple[MaskProgram, tuple[Launch, ...]]:
    """The mask program and one :class:`Launch` per named kernel (of :data:`KERNELS`), for
    a call of these inputs. Plain Python and tensor operations (cached on the mask): while
    ``torch.compile`` traces, they are traced (nothing is compiled or cached).

    Args:
        mask: the call's mask (its tensors on q's device).
        q, k, v: ``(B, H, Sq, D)``, ``(B, Hkv, Sk, D)``, ``(B, Hkv, Sk, Dv)``.
        kernels: names from :data:`KERNELS`, in launch order.
        configs: one ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` per kernel (default:
            the measured table).
        fn: the name errors are reported under.

    Raises:
        ValueError: when the mask does not fit the call (batch, heads, lengths).

    Example:
        >>> import torch, multihead as mh
        >>> q = torch.zeros(1, 2, 100, 16, dtype=torch.float16)
        >>> prog, (fwd,) = plan(mh.masks.alibi(2), q, q, q, kernels=("fwd",))
        >>> fwd.config, fwd.lists[2].shape
        ((128, 64, 4, 5), torch.Size([1, 1, 1, 2]))
    """
    _check_mask(fn, mask, q, k)
    Sq, D, Sk, Dv = q.shape[2], q.shape[3], k.shape[2], v.shape[3]
    out = []
    for i, name in enumerate(kernels):
        cfg = tuple(configs[i]) if configs is not None else launch_config(
            "fwd_sparse" if name == "fwd" else name, D, Dv, queries=Sq)
        out.append(Launch(cfg, block_lists(mask, Sq, Sk, cfg[0], cfg[1], q.device,
                                           by_key=KERNELS[name])))
    return program(mask, Sq, Sk, q.device), tuple(out)


def flatten(prog: MaskProgram, launches: tuple[Launch, ...], sq: int, sk: int) -> tuple:
    """``(source, tensors, ints, lists, configs)``: a :func:`plan` for ``sq`` queries and
    ``sk`` keys as operator arguments (lists of tensors and of ints; ``configs`` starts
    with ``sq, sk``, then 4 ints per kernel). :func:`unflatten` checks and inverts it.

    Example:
        >>> import torch, multihead as mh
        >>> q = torch.zeros(1, 2, 100, 16, dtype=torch.float16)
        >>> source, tensors, ints, lists, configs = flatten(
        ...     *plan(mh.masks.alibi(2), q, q, q, kernels=("fwd",)), 100, 100)
        >>> len(lists), configs
        (3, [100, 100, 128, 64, 4, 5])
    """
    return (prog.source, list(prog.tensors), list(prog.ints),
            [t for launch in launches for t in launch.lists],
            [sq, sk] + [n for launch in launches for n in launch.config])


def unflatten(fn: str, q: torch.Tensor, k: torch.Tensor, source: str, tensors, ints, lists,
              configs) -> tuple[MaskProgram, tuple[Launch, ...]]:
    """The :func:`plan` that :func:`flatten` gave these operator arguments, checked against
    the call's ``q (B, H, Sq, D)`` and ``k (B, Hkv, Sk, D)``: a plan of other lengths,
    blocks or devices would read out of bounds, so it is refused by name (``fn``'s).

    Example:
        >>> import torch, multihead as mh
        >>> q = torch.zeros(1, 2, 100, 16, dtype=torch.float16)
        >>> args = flatten(*plan(mh.masks.alibi(2), q, q, q, kernels=("fwd",)), 100, 100)
        >>> unflatten("op", q, q, *args)[1][0].config
        (128, 64, 4, 5)
        >>> unflatten("op", q[:, :, :50], q, *args)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: op: the plan was built for 100 queries and 100 keys, the call has 50 and 100...
    """
    n = len(lists) // 3
    if len(lists) % 3 or n not in (1, 3) or len(configs) != 2 + 4 * n or not ints:
        raise ValueError(f"{fn}: lists, ints and configs must come from one plan of 1 or 3 "
                         f"kernels (3 tensors and 4 ints each, after sq and sk), got "
                         f"{len(lists)} tensors, {len(configs)} config ints and {len(ints)} "
                         f"ints: build them with flash_sparse.plan and flatten")
    B, H, Sq, _ = q.shape
    Sk = k.shape[2]
    if tuple(configs[:2]) != (Sq, Sk):
        raise ValueError(f"{fn}: the plan was built for {configs[0]} queries and {configs[1]} "
                         f"keys, the call has {Sq} and {Sk}: plan again for these lengths")
    launches = []
    for i, by_key in enumerate(list(KERNELS.values())[:n]):
        cfg = tuple(configs[2 + 4 * i:6 + 4 * i])
        check_arguments(f"{fn}: kernel {i}'s launch", config=cfg)
        bm, bn, _, _ = cfg
        rows, cols = list_shape(Sq, Sk, bm, bn, by_key)
        n_full, n_part, index = lists[3 * i:3 * i + 3]
        fits = (index.dim() == 4 and index.shape[0] in (1, B) and index.shape[1] in (1, H)
                and tuple(index.shape[2:]) == (rows, cols)
                and n_full.shape == n_part.shape == index.shape[:3])
        if not fits or any(t.dtype != torch.int32 for t in (n_full, n_part, index)):
            raise ValueError(f"{fn}: the block lists of kernel {i} must be int32 counts of "
                             f"shape (1 or {B}, 1 or {H}, {rows}) and an index of shape "
                             f"(..., {rows}, {cols}) for blocks {bm}x{bn}, got "
                             f"{[(tuple(t.shape), t.dtype) for t in (n_full, n_part, index)]}")
        launches.append(Launch(cfg, (n_full, n_part, index)))
    for t in (*tensors, *lists):
        if t.device != q.device:
            raise ValueError(f"{fn}: the plan's tensors must be on q's device {q.device}, "
                             f"one is on {t.device}: plan on q's device")
    if q.device.type == "cpu" and not tracing():
        for i, spec in enumerate(launches):       # host lists: reading them costs no sync
            _check_list_values(fn, i, *spec.lists)
    return MaskProgram(source, tuple(tensors), tuple(ints)), tuple(launches)


def _check_list_values(fn: str, i: int, n_full, n_part, index) -> None:
    # Counts and block ids a kernel would follow outside its lists or its tensors (a device
    # plan's lists are not read here, which would wait for the device: plan() makes them)
    cols = index.shape[-1]
    if ((n_full < 0).any() or (n_part < 0).any() or (n_full + n_part > cols).any()
            or (index < 0).any() or (index >= cols).any()):
        raise ValueError(f"{fn}: the block lists of kernel {i} hold a count or a block id "
                         f"outside [0, {cols}], which the kernel would follow out of bounds: "
                         f"build them with flash_sparse.plan and flatten")


def _launch(kernel, spec: Launch, by_key: bool, q, v, prog: MaskProgram, pointers: tuple,
            scales: tuple, strides: tuple, tail: tuple = (), **meta) -> None:
    """Launch one block-sparse kernel over its lists: one program per (query block, batch
    and query head), or per (key block, batch and K/V head) when the lists go ``by_key``.
    The arguments follow the kernels' common order: ``pointers``, the lists, ``scales``,
    the tensors' ``strides``, the lists' strides and sizes, the mask program's arguments,
    then the kernel's own ``tail`` and ``meta`` (constexprs)."""
    B, H, Sq, D = q.shape
    _, Hkv, Sk, Dv = v.shape
    bm, bn, warps, stages = spec.config
    n_full, n_part, index = spec.lists
    grid = (cdiv(Sk, bn), B * Hkv) if by_key else (cdiv(Sq, bm), B * H)
    launch(kernel, grid, *pointers, n_full, n_part, index, *scales, *strides,
           *_list_strides(n_full, index), index.shape[-1], H, H // Hkv, Sq, Sk, prog.tensors,
           prog.ints, *tail, MASK_FN=prog.fn, HAS_BIAS=prog.has_bias, D=D, DV=Dv,
           BLOCK_D=pow2(D), BLOCK_DV=pow2(Dv), BLOCK_M=bm, BLOCK_N=bn, num_warps=warps,
           num_stages=stages, **meta)


def run_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                prog: MaskProgram, fwd: Launch, dropout: Dropout | None = None,
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward kernel of a :func:`plan` (inputs checked by the caller): ``(out
    (B, H, Sq, Dv), lse (B, H, Sq) fp32)`` of ``q (B, H, Sq, D)`` over ``k``, ``v``;
    ``dropout`` on the weights, as :func:`.flash_fwd.flash_forward`'s (pairs drawn at their
    positions in the sequences).

    Example:
        >>> import torch, multihead as mh
        >>> q = torch.randn(1, 2, 64, 16, device="cuda", dtype=torch.float16)   # doctest: +SKIP
        >>> prog, (fwd,) = plan(mh.masks.alibi(2), q, q, q, kernels=("fwd",))    # doctest: +SKIP
        >>> out, lse = run_forward(q, q, q, 0.25, prog, fwd)                     # doctest: +SKIP
    """
    B, H, Sq, _ = q.shape
    Sk = k.shape[2]
    out, lse = empty_outputs(q, v)
    seed, *drop = drop_args(dropout, "sparse_forward", q, lse)
    if B * H * Sq == 0:
        return out, lse
    if Sk == 0:
        return out.zero_(), lse.fill_(float("-inf"))
    _launch(_forward_sparse, fwd, KERNELS["fwd"], q, v, prog, (q, k, v, out, lse, seed),
            (scale * LOG2E,), (*q.stride(), *k.stride(), *v.stride(), *out.stride()), drop,
            DROPOUT=dropout is not None)
    return out, lse


def run_backward(dout, q, k, v, out, lse, dlse, scale: float, prog: MaskProgram,
                 kv: Launch, dq_: Launch, dropout: Dropout | None = None,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The two backward kernels of a :func:`plan` (inputs checked by the caller):
    ``(dq, dk, dv)`` shaped as ``q``, ``k``, ``v``, from ``dout (B, H, Sq, Dv)``, the
    forward's ``out`` and ``lse`` and, when it was used, the lse's gradient ``dlse``;
    ``dropout``: the forward's own (the same seed: the same pairs dropped).

    Example:
        >>> import torch, multihead as mh
        >>> q = torch.randn(1, 2, 64, 16, device="cuda", dtype=torch.float16)   # doctest: +SKIP
        >>> prog, (fwd, kv, dq) = plan(mh.masks.alibi(2), q, q, q,
        ...                            kernels=tuple(KERNELS))                   # doctest: +SKIP
        >>> out, lse = run_forward(q, q, q, 0.25, prog, fwd)                     # doctest: +SKIP
        >>> grads = run_backward(torch.ones_like(out), q, q, q, out, lse, None, 0.25, prog,
        ...                      kv, dq)                                         # doctest: +SKIP
    """
    has_dlse = dlse is not None
    seed, *drop = drop_args(dropout, "sparse_backward", q, lse)
    (dq, dk, dv), dout, delta, dlse, lse, _ = backward_setup(dout, q, k, v, out, lse, dlse,
                                                             (kv.config, dq_.config))
    if delta is None:                                  # nothing to compute: zeros
        return dq, dk, dv
    strides = (*q.stride(), *k.stride(), *v.stride(), *dout.stride())
    scales = (scale, scale * LOG2E)
    # with a bias, dK/dV reads the rows' (hi, lo) pairs (._exact_rows) in place of lse
    # (B, H, Sq, 2), which dQ writes; without one, dQ's PAIRS is unused
    pairs = torch.empty((*lse.shape, 2), device=q.device,
                        dtype=torch.float32) if prog.has_bias else None
    # dQ first: it writes the delta of its rows (and their pairs), which dK/dV reads
    _launch(_dq_sparse, dq_, KERNELS["bwd_q"], q, v, prog,
            (q, k, v, dout, out, lse, dlse, delta, pairs if pairs is not None else delta, dq,
             seed), scales, strides, (*out.stride(), *drop), HAS_DLSE=has_dlse,
            DROPOUT=dropout is not None)
    _launch(_dkdv_sparse, kv, KERNELS["bwd_kv"], q, v, prog,
            (q, k, v, dout, pairs if pairs is not None else lse, delta, dk, dv, seed), scales,
            strides, drop, KEYS_LEFT=keys_left(*kv.config[:2]), DROPOUT=dropout is not None)
    return dq, dk, dv


def sparse_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: MB.Mask, *,
                   scale: float, config: tuple[int, int, int, int] | None = None,
                   dropout: Dropout | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of ``q (B, H, Sq, D)`` over ``k (B, Hkv, Sk, D)``, ``v (B, Hkv, Sk, Dv)``
    under any ``mask`` of our model (except a user's subclass), skipping EMPTY blocks.

    Args:
        mask: a :class:`multihead.masks.Mask` whose tensors are on q's device.
        scale: multiplier of the scores.
        config: ``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` (default: the measured table).
        dropout: dropout on the weights (:class:`._dropout.Dropout`: its rate and seed; a
            pair's draw is keyed by its query and key positions, counted from 0); the
            backward must get the same.

    Returns:
        ``(out (B, H, Sq, Dv) in q's dtype, lse (B, H, Sq) fp32)``; rows with nothing to
        attend to give zeros and ``-inf``. The lse is the undropped softmax's.

    Example:
        >>> import torch, multihead as mh
        >>> q = torch.randn(1, 2, 64, 16, device="cuda", dtype=torch.float16)   # doctest: +SKIP
        >>> ids = torch.arange(64, device="cuda") // 20                          # doctest: +SKIP
        >>> out, lse = sparse_forward(q, q, q, mh.masks.document(ids), scale=0.25)  # doctest: +SKIP
    """
    args = check_inputs("sparse_forward", q, k, v, scale=scale, config=config)
    scale, config = args.scale, args.config
    prog, (fwd,) = plan(mask, q, k, v, kernels=("fwd",),
                        configs=None if config is None else (config,), fn="sparse_forward")
    return run_forward(q, k, v, scale, prog, fwd, dropout)


def sparse_backward(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    out: torch.Tensor, lse: torch.Tensor, mask: MB.Mask, *, scale: float,
                    dlse: torch.Tensor | None = None, config: tuple | None = None,
                    dropout: Dropout | None = None,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients ``(dq, dk, dv)`` of :func:`sparse_forward`'s call (deterministic; the K/V
    gradients summed over each group of query heads in registers). No gradient reaches a
    bias tensor.

    Args:
        dout: ``(B, H, Sq, Dv)``; out, lse: what the forward returned; dlse: the gradient
            of the lse, when it was used; config: ``(dkdv, dq)`` launch tuples; dropout:
            the forward's own.

    Example:
        >>> import torch, multihead as mh
        >>> q = torch.randn(1, 2, 64, 16, device="cuda", dtype=torch.float16)   # doctest: +SKIP
        >>> m = mh.masks.document(torch.arange(64, device="cuda") // 20)         # doctest: +SKIP
        >>> out, lse = sparse_forward(q, q, q, m, scale=0.25)                    # doctest: +SKIP
        >>> dq, dk, dv = sparse_backward(torch.ones_like(out), q, q, q, out, lse, m,
        ...                              scale=0.25)                             # doctest: +SKIP
    """
    scale = check_inputs("sparse_backward", q, k, v, scale=scale).scale
    config = check_pair("sparse_backward", config)
    check_backward("sparse_backward", dout, q, v, out, lse, dlse)
    prog, (kv, dq) = plan(mask, q, k, v, kernels=("bwd_kv", "bwd_q"), configs=config,
                          fn="sparse_backward")
    return run_backward(dout, q, k, v, out, lse, dlse, scale, prog, kv, dq, dropout)

"""Split-K attention for a few queries (decoding, speculative verification) in Triton.

A decoding step has one query per head (a few when verifying drafts) over a long cache:
too few rows to fill a GPU with one program per query block. So the keys are split:

One launch, one program per (split of the keys, batch, K/V head):

1. each program streams its keys once for **all G query heads of the group and all Sq
   queries** (a tile of ``G * Sq`` rows: each K/V byte is read once, not G times) and
   writes its split's output and log-sum-exp of its scores, in fp32;
2. then it takes a ticket (an atomic counter per (batch, K/V head)); the program that takes
   the last one combines the splits of its rows and writes the output:
   ``lse = log Σ exp(lse_s)``, ``out = Σ exp(lse_s - lse) · out_s``.

Merging in the last program saves the second launch (host time and a kernel boundary,
which dominate a step over a short cache). With a single split the program writes the
output directly.

Masks are those of :mod:`.flash_fwd`, from indices: causal with an ``offset``, a sliding
``window``, and key padding from ``kv_lengths``; a split whose keys the mask rules out
for every row loads nothing. A row with nothing to attend to gets zeros and lse ``-inf``.

Notation: B batch, H query heads, Hkv K/V heads, G = H / Hkv, Sq queries, Sk keys.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._band import (LOG2E, cdiv, check_inputs, empty_outputs, integral, is_int, launch_config,
                    nonfinite, pow2)
from ._launch import launch
from .flash_fwd import DYNAMIC, _attend_block, _finish, fresh_state

#: the most queries per head the kernel takes (decoding and draft verification)
MAX_QUERIES = 16
#: keys per block inside a split, as :func:`num_splits` counts them (the launch table's
#: "decode" entry: :func:`._band.launch_config`)
BLOCK_N = 64
#: the most splits of the keys
MAX_SPLITS = 128
#: num_stages of the split kernel over a paged pool. A block's K/V address there comes
#: from a page id loaded in the loop, which Triton's pipeliner schedules one stage ahead of
#: the K/V copies: at 3 stages that left a single K/V buffer and a wait for every copy at
#: each step (no copy in flight during the step's math); at 5, the loop keeps one K/V block
#: in flight as the contiguous cache's loop does at 3, in the same shared memory (71.7 KB
#: at D=128, one query; sm_90 TTGIR, Triton 3.6 and 3.9)
PAGED_STAGES = 5
#: splits the merge combines per step (the usual counts, at most 16, in one step)
MERGE_SPLITS = 16
#: the most fp32 values a merge step holds: splits x rows x head-dim tile (64 per thread
#: of 4 warps)
MERGE_TILE = 8192


@triton.jit
def _split_blocks(q, k_base, v_base, TBL, lo, hi, i, live, qk_scale, offset, window, skn,
                  skd, svn, svd, b, h, Sq, stb, pages, D: tl.constexpr, DV: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_R: tl.constexpr,
                  BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
                  PAGED: tl.constexpr, PAGE: tl.constexpr, CAREFUL: tl.constexpr):
    # The online softmax of a split's rows over its keys [lo, hi), every block masked (the
    # paged pool's through the block table). Returns (acc, m, l, outside): outside counts
    # the page ids outside the pool that were met (their blocks read page 0 instead).
    acc, m_i, l_i = fresh_state(BLOCK_R, BLOCK_DV)
    outside = 0
    for start in range(lo, hi, BLOCK_N):
        kb = k_base
        vb = v_base
        if PAGED:                                      # the block lies in one page: rebase
            page = tl.load(TBL + b * stb + start // PAGE).to(tl.int64)
            inside = (page >= 0) & (page < pages)      # else: read page 0, and poison below
            outside += tl.where(inside, 0, 1)
            page = tl.where(inside, page, 0)
            rebase = page * PAGE - start // PAGE * PAGE     # slot of position start, minus start
            kb = k_base + rebase * skn
            vb = v_base + rebase * svn
        acc, m_i, l_i = _attend_block(q, acc, m_i, l_i, kb, vb, start, hi, i, live,
                                      qk_scale, offset, window, skn, skd, svn, svd, b, h, Sq,
                                      None, None, D, DV, BLOCK_D, BLOCK_DV, BLOCK_N, CAUSAL,
                                      WINDOWED, True, None, False, CAREFUL)
    return acc, m_i, l_i, outside


@triton.jit(do_not_specialize=DYNAMIC + ["B", "chunk", "stb", "pages", "splits"])
def _partial(Q, K, V, PO, PL, O, LSE, CNT, LENS, TBL, qk_scale,
             sqb, sqh, sqm, sqd, skb, skh, skn, skd, svb, svh, svn, svd, sob, soh, som, sod,
             B, Hkv, G, Sq, Sk, offset, window, chunk, stb, pages, splits,
             CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, HAS_LENS: tl.constexpr,
             PAGED: tl.constexpr, PAGE: tl.constexpr,
             D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
             BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
             MERGE_ROWS: tl.constexpr, BLOCK_S: tl.constexpr):
    split = tl.program_id(0)
    bk = tl.program_id(1)
    b = (bk // Hkv).to(tl.int64)                      # offsets past 2^31 elements stay exact
    hk = bk % Hkv
    r = tl.arange(0, BLOCK_R)                          # rows: (query head in group, query)
    g = r // Sq
    i = r % Sq                                         # the row's query index
    live = r < G * Sq
    h = hk * G + g                                     # the row's query head
    dq = tl.arange(0, BLOCK_D)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(Q + b * sqb + h[:, None] * sqh + i[:, None] * sqm + dq[None, :] * sqd,
                mask=live[:, None] & (dq[None, :] < D), other=0.0)    # (BLOCK_R, BLOCK_D)

    lo = split * chunk
    hi = tl.minimum(lo + chunk, Sk)
    if HAS_LENS:
        n = tl.load(LENS + b)
        hi = tl.minimum(hi, n)
        if PAGED:                                      # positions count from each sequence's
            offset = offset + n - Sk                   # first key: shift the band by its length
    if CAUSAL:
        hi = tl.minimum(hi, Sq + offset)               # the last query's last key, plus one
    if WINDOWED:
        lo = tl.maximum(lo, (offset - window + 1) // BLOCK_N * BLOCK_N)

    k_base = K + b * skb + hk * skh
    v_base = V + b * svb + hk * svh
    acc, m_i, l_i, outside = _split_blocks(q, k_base, v_base, TBL, lo, hi, i, live, qk_scale,
                                           offset, window, skn, skd, svn, svd, b, h, Sq,
                                           stb, pages, D, DV, BLOCK_D, BLOCK_DV, BLOCK_R,
                                           BLOCK_N, CAUSAL, WINDOWED, PAGED, PAGE, False)
    if nonfinite(acc):                                 # rare: run again, carefully
        acc, m_i, l_i, outside = _split_blocks(q, k_base, v_base, TBL, lo, hi, i, live,
                                               qk_scale, offset, window, skn, skd, svn, svd,
                                               b, h, Sq, stb, pages, D, DV, BLOCK_D,
                                               BLOCK_DV, BLOCK_R, BLOCK_N, CAUSAL, WINDOWED,
                                               PAGED, PAGE, True)
    out, lse = _finish(acc, m_i, l_i)
    if HAS_LENS:    # NaN rows: a length n past the keys (Sk, or max_len when paged) or
        # below 0, whose keys would be cut silently, or a table entry outside the pool
        bad = (n > Sk) | (n < 0)
        if PAGED:
            bad = bad | (outside > 0)
        out = tl.where(bad, float("nan"), out)
        lse = tl.where(bad, float("nan"), lse)
    if SPLIT:
        # scratch layout: PO (splits, B, H, Sq, DV), PL (splits, B, H, Sq), contiguous; the
        # rows of (b, hk) are the G * Sq consecutive (head, query) rows from hk * G * Sq
        HSq = Hkv * G * Sq
        first = (split * B + b) * HSq + hk * G * Sq                         # scalar
        tl.store(PO + (first + r)[:, None] * DV + dv[None, :], out,
                 mask=live[:, None] & (dv[None, :] < DV))
        tl.store(PL + first + r, lse, mask=live)
        # the last split of (b, hk) to finish merges them all: every thread's stores
        # precede the ticket (barrier), which releases them to, and acquires theirs from,
        # the other programs (GPU scope); the counter is left at 0 for the next launch
        tl.debug_barrier()
        ticket = tl.atomic_add(CNT + bk, 1, sem="acq_rel", scope="gpu")
        if ticket == splits - 1:
            _merge(PO, PL, O, LSE, b, hk, B, HSq, G, Sq, splits, sob, soh, som, sod,
                   DV, BLOCK_DV, MERGE_ROWS, BLOCK_S)
            tl.store(CNT + bk, 0)
    else:
        _write_rows(O, LSE, out, lse, b, hk, r, live, G, Sq, Hkv * G * Sq, sob, soh, som,
                    sod, DV, BLOCK_DV)


@triton.jit
def _write_rows(O, LSE, out, lse, b, hk, r, ok, G, Sq, HSq, sob, soh, som, sod,
                DV: tl.constexpr, BLOCK_DV: tl.constexpr):
    # Rows r (query head in the group x query) of (b, hk) where ok: out (rows, BLOCK_DV)
    # into O (B, H, Sq, DV) in its dtype, lse into LSE (B, H, Sq) contiguous.
    dv = tl.arange(0, BLOCK_DV)
    h = hk * G + r // Sq
    i = r % Sq
    tl.store(O + b * sob + h[:, None] * soh + i[:, None] * som + dv[None, :] * sod,
             out.to(O.dtype.element_ty), mask=ok[:, None] & (dv[None, :] < DV))
    tl.store(LSE + b * HSq + hk * G * Sq + r, lse, mask=ok)


@triton.jit
def _merge(PO, PL, O, LSE, b, hk, B, HSq, G, Sq, splits, sob, soh, som, sod,
           DV: tl.constexpr, BLOCK_DV: tl.constexpr, MERGE_ROWS: tl.constexpr,
           BLOCK_S: tl.constexpr):
    # The G * Sq rows of (b, hk) from every split's partial: lse = log sum exp(lse_s),
    # out = sum exp(lse_s - lse) out_s, over BLOCK_S splits and MERGE_ROWS rows at a time
    # (online: a running maximum rescales what is summed). Loads bypass L1 (.cg): the
    # partials were written by other SMs.
    dv = tl.arange(0, BLOCK_DV)
    base = hk * G * Sq
    for r0 in range(0, G * Sq, MERGE_ROWS):
        r = r0 + tl.arange(0, MERGE_ROWS)                                   # (R,)
        row_ok = r < G * Sq
        top = tl.full((MERGE_ROWS,), float("-inf"), tl.float32)
        total = tl.zeros((MERGE_ROWS,), tl.float32)
        acc = tl.zeros((MERGE_ROWS, BLOCK_DV), tl.float32)
        for s0 in range(0, splits, BLOCK_S):
            s = s0 + tl.arange(0, BLOCK_S)                                  # (S,)
            row = (s[:, None] * B + b) * HSq + base + r[None, :]            # (S, R)
            ok = (s[:, None] < splits) & row_ok[None, :]
            lse_s = tl.load(PL + row, mask=ok, other=float("-inf"), cache_modifier=".cg")
            new_top = tl.maximum(top, tl.max(lse_s, 0))                     # (R,)
            shift = tl.where(new_top == float("-inf"), 0.0, new_top)
            w = tl.exp(lse_s - shift[None, :])                              # (S, R): 0 if empty
            alpha = tl.exp(top - shift)                                     # (R,)
            total = total * alpha + tl.sum(w, 0)
            parts = tl.load(PO + row[:, :, None] * DV + dv[None, None, :],
                            mask=ok[:, :, None] & (dv[None, None, :] < DV), other=0.0,
                            cache_modifier=".cg")                           # (S, R, BLOCK_DV)
            acc = acc * alpha[:, None] + tl.sum(parts * w[:, :, None], 0)
            top = new_top
        empty = total == 0.0
        out = acc / tl.where(empty, 1.0, total)[:, None]
        lse = tl.where(empty, float("-inf"), top + tl.log(tl.where(empty, 1.0, total)))
        _write_rows(O, LSE, out, lse, b, hk, r, row_ok, G, Sq, HSq, sob, soh, som, sod, DV,
                    BLOCK_DV)


def _merge_rows(rows: int, block_dv: int) -> int:
    """Rows of (query head, query) the merge combines per step: all of them when they fit
    :data:`MERGE_TILE` with :data:`MERGE_SPLITS` splits, else the most that do (a power
    of two, so one compile serves every row count of a head dim).

    Example:
        >>> _merge_rows(4, 128), _merge_rows(64, 128), _merge_rows(3, 256)
        (4, 4, 2)
    """
    fit = max(1, MERGE_TILE // (MERGE_SPLITS * block_dv))
    return min(1 << (rows - 1).bit_length(), 1 << (fit.bit_length() - 1))


#: per (device, stream): the tickets of the splits (int32, all 0 between launches)
_TICKETS: dict = {}


def _tickets(device: torch.device, n: int) -> torch.Tensor:
    """``n`` int32 counters at 0 on ``device`` for one launch of :func:`_partial`, whose
    last split of each (batch, K/V head) sets its counter back to 0 after merging.

    On a GPU, one zeroed buffer serves every launch on a stream, in stream order (no
    memset per call); launches on other streams get their own. While a CUDA graph captures,
    and on the CPU (Triton's interpreter, where a failed launch could leave a ticket
    taken), each launch gets a zeroed buffer of its own.

    Example:
        >>> import torch
        >>> t = _tickets(torch.device("cpu"), 8)
        >>> t.dtype, t.numel() >= 8, int(t.abs().sum())
        (torch.int32, True, 0)
    """
    if device.type != "cuda" or torch._C._cuda_isCurrentStreamCapturing():
        return torch.zeros(n, device=device, dtype=torch.int32)    # (the CPU: the interpreter)
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, torch._C._cuda_getCurrentRawStream(index))
    buf = _TICKETS.get(key)
    if buf is None or buf.numel() < n:
        buf = _TICKETS[key] = torch.zeros(max(n, 256), device=device, dtype=torch.int32)
    return buf


def num_splits(B: int, Hkv: int, Sk: int, programs: int = 132) -> int:
    """Splits of the keys so that ``B * Hkv * splits`` programs fill the device (one per SM
    of an H100 by default: on one, B=1 with a 4k cache ran 12% faster with 16 splits than
    with 33, and B=8 with a 32k cache 5% faster with 2 than with 5), with at least one key
    block per split.

    Example:
        >>> num_splits(1, 8, 32768), num_splits(8, 8, 32768), num_splits(1, 8, 100)
        (16, 2, 2)
    """
    want = programs // max(1, B * Hkv)
    return max(1, min(want, cdiv(Sk, BLOCK_N), MAX_SPLITS))


def _check_paged(q, table, lengths, page_size, block_n, max_len, pages) -> None:
    B = q.shape[0]
    if pages is not None and not (is_int(pages) and pages >= 1):
        raise ValueError(f"decode_forward: pages must be the pool's number of pages, a "
                         f"positive integer, got {pages!r}")
    if lengths is None:
        raise ValueError("decode_forward: a block_table needs kv_lengths (each sequence's "
                         "number of keys)")
    if (table.dim() != 2 or table.shape[0] != B or not integral(table)
            or table.device != q.device):
        raise ValueError(f"decode_forward: block_table must be an integer tensor (B={B}, "
                         f"pages) on {q.device}, got {table.dtype} {tuple(table.shape)} on "
                         f"{table.device}")
    if not is_int(page_size) or page_size < block_n or page_size % block_n:
        raise ValueError(f"decode_forward: page_size {page_size!r} must be an integer "
                         f"multiple of the key block {block_n} (a block never crosses a page); "
                         f"paged_decode_forward takes any multiple of 16")
    if table.shape[1] * page_size < max_len:
        raise ValueError(f"decode_forward: block_table has {table.shape[1]} pages of "
                         f"{page_size} per sequence, fewer than the {max_len} keys of the "
                         f"longest: pass each sequence's full table (padded with any page)")


def _check_pool(q, k_pool, v_pool, page_size: int) -> None:
    fn = "paged_decode_forward"
    if q.dim() != 4:
        raise ValueError(f"{fn}: q must be 4-D (B, H, Sq, D), got shape {tuple(q.shape)}")
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if pool.dim() != 3:
            raise ValueError(f"{fn}: {name} must be 3-D (slots, Hkv, head_dim), as "
                             f"PagedKVCache holds it, got shape {tuple(pool.shape)}")
    if k_pool.shape[:2] != v_pool.shape[:2]:
        raise ValueError(f"{fn}: k_pool {tuple(k_pool.shape)} and v_pool "
                         f"{tuple(v_pool.shape)} must share slots and K/V heads")
    if not is_int(page_size) or page_size < 16 or page_size % 16:
        raise ValueError(f"{fn}: page_size must be an integer multiple of 16, got "
                         f"{page_size!r}")
    if k_pool.shape[0] % page_size:
        raise ValueError(f"{fn}: the pools' {k_pool.shape[0]} slots are not whole pages of "
                         f"{page_size} (a page past the end would be read): allocate "
                         f"pages * page_size slots")


def paged_decode_forward(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor,
                         block_table: torch.Tensor, lengths: torch.Tensor, *, max_len: int,
                         page_size: int, scale: float, causal: bool = False,
                         window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`decode_forward` over a paged KV pool, read through its block table (no
    gather): sequence ``b``'s key ``j`` is pool slot
    ``block_table[b, j // page_size] * page_size + j % page_size``. The band is aligned
    lower-right per sequence (its last query sees its last key).

    Args:
        q: ``(B, H, Sq <= 16, D)``.
        k_pool, v_pool: ``(slots, Hkv, D)`` and ``(slots, Hkv, Dv)``, slot-major (what
            :class:`multihead.PagedKVCache` holds).
        block_table: ``(B, pages)`` integer page ids of each sequence, on q's device,
            each in ``[0, slots // page_size)``. Checking that on the host would read the
            table (a sync), so the kernel checks each id it uses: a sequence whose used
            pages include one outside the pool gets NaN rows (and lse), and no memory
            outside the pool is read. :class:`multihead.PagedKVCache` keeps ids in range.
        lengths: ``(B,)`` keys of each sequence, on q's device.
        max_len: the longest sequence (a host int; sizes the splits, reads nothing). A
            sequence whose length is past it (or negative) gets NaN rows (and lse): its
            keys past ``max_len`` are never cut off silently.
        page_size: slots per page, a multiple of 16 (pages of a multiple of 64 run
            64-key blocks, others 16-key blocks: a block never crosses a page).

    Example:
        >>> import torch
        >>> pool = torch.randn(8 * 64, 2, 64, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> q = torch.randn(1, 8, 1, 64, device="cuda", dtype=torch.bfloat16)      # doctest: +SKIP
        >>> table = torch.tensor([[3, 5]], device="cuda")                          # doctest: +SKIP
        >>> n = torch.tensor([100], device="cuda")                                 # doctest: +SKIP
        >>> out, lse = paged_decode_forward(q, pool, pool, table, n, max_len=100,
        ...                                 page_size=64, scale=0.125, causal=True)  # doctest: +SKIP
    """
    _check_pool(q, k_pool, v_pool, page_size)
    B, H, Sq, _ = q.shape
    k = k_pool.permute(1, 0, 2).unsqueeze(0).expand(B, -1, -1, -1)   # (B, Hkv, slots, D) view
    v = v_pool.permute(1, 0, 2).unsqueeze(0).expand(B, -1, -1, -1)
    if not (is_int(max_len) and 0 <= max_len <= k.shape[2]):
        raise ValueError(f"paged_decode_forward: max_len must be the longest sequence's "
                         f"length, an integer of at most the pool's {k.shape[2]} slots, got "
                         f"{max_len!r}")
    k, v = k[:, :, :max_len], v[:, :, :max_len]        # views: Sk = the longest sequence
    block = 16 if page_size % 64 else 64
    return decode_forward(q, k, v, scale=scale, causal=causal, window=window,
                          offset=max_len - Sq, kv_lengths=lengths, block_table=block_table,
                          page_size=page_size, pages=k_pool.shape[0] // page_size,
                          config=(block, 4, PAGED_STAGES))


def decode_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, scale: float,
                   causal: bool = False, window: int | None = None, offset: int = 0,
                   kv_lengths: torch.Tensor | None = None, splits: int | None = None,
                   config: tuple[int, int, int] | None = None,
                   block_table: torch.Tensor | None = None, page_size: int = 0,
                   pages: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a few queries ``q (B, H, Sq <= 16, D)`` over ``k (B, Hkv, Sk, D)``,
    ``v (B, Hkv, Sk, Dv)`` (a KV cache's buffers, any strides), split over the keys.

    Args:
        scale: multiplier of the scores.
        causal: query ``i`` sees keys ``j <= i + offset``.
        window: with ``causal``, also ``j > i + offset - window``.
        offset: the band's alignment (``Sk - Sq``: lower-right).
        kv_lengths: ``(B,)`` int tensor on q's device; keys ``j >= kv_lengths[b]`` are unused
            (a cache's filled lengths). Checking them on the host would read them (a
            sync): a sequence whose length is past ``Sk`` or negative gets NaN rows (and
            lse), never keys cut off silently.
        splits: how many parts the keys are split into (default: :func:`num_splits`).
        config: ``(BLOCK_N, num_warps, num_stages)`` of the kernel (default: the launch
            table's "decode" entry, :func:`._band.launch_config`).
        block_table, page_size, pages: read k and v as a paged pool of ``pages`` pages
            (default: k's length / page_size) through ``block_table``; see
            :func:`paged_decode_forward`, which passes them.

    Returns:
        ``(out (B, H, Sq, Dv) in q's dtype, lse (B, H, Sq) fp32)``.

    Example:
        >>> import torch
        >>> q = torch.randn(2, 8, 1, 64, device="cuda", dtype=torch.bfloat16)   # doctest: +SKIP
        >>> kv = torch.randn(2, 2, 4096, 64, device="cuda", dtype=torch.bfloat16)  # doctest: +SKIP
        >>> out, lse = decode_forward(q, kv, kv, scale=0.125, causal=True, offset=4095)  # doctest: +SKIP
    """
    scale, window, offset, config, splits, causal = check_inputs(
        "decode_forward", q, k, v, kv_lengths, offset=offset, scale=scale, causal=causal,
        window=window, config=config, config_len=3, splits=splits)
    B, H, Sq, D = q.shape
    _, Hkv, Sk, Dv = v.shape
    config = config or launch_config("decode", D, Dv)
    if block_table is not None:
        _check_paged(q, block_table, kv_lengths, page_size, config[0], Sk, pages)
        pages = Sk // page_size if pages is None else int(pages)
    if Sq > MAX_QUERIES:
        raise ValueError(f"decode_forward: Sq = {Sq} queries, at most {MAX_QUERIES}: use "
                         f"multihead.kernels.flash_fwd.flash_forward for longer query blocks")
    G = H // Hkv
    out, lse = empty_outputs(q, v)
    if B * H * Sq == 0:
        return out, lse
    block_n, warps, stages = config
    n = min(splits or num_splits(B, Hkv, Sk), MAX_SPLITS)
    chunk = cdiv(max(Sk, 1), n)
    chunk = cdiv(chunk, block_n) * block_n                   # whole key blocks per split
    n = max(1, cdiv(max(Sk, 1), chunk))
    lens = kv_lengths.contiguous() if kv_lengths is not None else lse  # unused: HAS_LENS off
    table = lens if block_table is None else (
        block_table if block_table.stride(1) == 1 else block_table.contiguous())
    if n > 1:       # partials (fp32) and a ticket per (batch, K/V head) for the last split
        part_o = torch.empty(n, B, H, Sq, Dv, device=q.device, dtype=torch.float32)
        part_l = torch.empty(n, B, H, Sq, device=q.device, dtype=torch.float32)
        tickets = _tickets(q.device, B * Hkv)
    else:           # one split writes the output itself: no scratch (lse: unread)
        part_o = part_l = tickets = lse
    launch(
        _partial, (n, B * Hkv), q, k, v, part_o, part_l, out, lse, tickets, lens, table,
        scale * LOG2E,
        *q.stride(), *k.stride(), *v.stride(), *out.stride(),
        B, Hkv, G, Sq, Sk, offset, window if window is not None else 0, chunk,
        table.stride(0) if block_table is not None else 0,
        pages if block_table is not None else 0, n,
        CAUSAL=causal, WINDOWED=window is not None,
        HAS_LENS=kv_lengths is not None, PAGED=block_table is not None, PAGE=int(page_size),
        D=D, DV=Dv, BLOCK_D=pow2(D), BLOCK_DV=pow2(Dv),
        BLOCK_R=pow2(G * Sq), BLOCK_N=block_n, SPLIT=n > 1,
        MERGE_ROWS=_merge_rows(G * Sq, pow2(Dv)), BLOCK_S=MERGE_SPLITS,
        num_warps=warps, num_stages=stages)
    return out, lse

"""What the kernels share: the block ranges a band mask reaches, and the launch table.

A band mask (causal, a sliding window, either aligned by ``offset``) with key padding
(``klen`` keys are real) lets a program know, from indices alone, which blocks it must visit
and which of those every one of its rows sees in full. :func:`key_range` answers for a
block of queries (the forward and dQ loops), :func:`query_range` for a block of keys (the
dK/dV loop). Each returns block-aligned bounds ``lo <= a <= b <= hi`` (``hi`` need not
be aligned): ``[lo, a)`` and ``[b, hi)`` are edge blocks that evaluate the mask, ``[a, b)``
runs unmasked. Both also split the leading edge at ``w``: the blocks of ``[lo, w)`` are
cut by one edge alone (for a block of queries the window's lower edge, every key real and
at or below every row's diagonal; for a block of keys the diagonal, every query live and every
key inside its window), so they test that edge only and load without bounds. Where ``w <
a`` (a window narrower than a block, a short key length) the blocks ``[w, a)`` meet both
edges and no block is full (``a = b``). The trailing edge ``[b, hi)`` never needs the
leading edge's test. (On an H100, sm_90 SASS per leading-edge step of a 512-key window at
64x64 tiles: forward 1061 to 587 instructions, dQ 927 to 696, dK/dV 1257 to 846.)

Query ``i`` sees key ``j`` when ``j < klen``, and with the band
``i + offset - window < j <= i + offset``.
"""

from __future__ import annotations

import json
import math
import operator
import os
from typing import NamedTuple

import torch
import torch.utils.weak
import triton
import triton.language as tl

from .._cache import BoundedCache
from .._device import to_device
from .._fork import module_lock
from .mask_program import LOG2E  # noqa: F401  (the kernels' one constant, shared with programs)


#: (BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel and width of the head dim. The
#: 128 column was measured on an H100 (bf16, S=16384; ``benchmarks/triton_tune.py``,
#: docs/benchmarks.md); the 64 and 256 columns are estimates from it (fewer registers per
#: row at 64, half the tile at 256), not yet measured. "fwd_narrow" is the forward under a
#: window of at most :data:`NARROW` keys, where short loops favour smaller tiles.
#: "fwd_sparse" is the block-sparse forward: the "fwd" tiles at 5 stages, the fewest at which
#: Triton's pipeliner keeps a K/V copy in flight during a step's math despite the list load
#: before each copy (sm_90 TTGIR, Triton 3.6 and 3.9: at 3 stages each step waited for
#: every copy); at most 198 KB of shared memory on an H100, fewer stages where a GPU has
#: less (:func:`launch`). Not yet timed: ``triton_tune --only sparse`` measures it.
#: "fwd_sparse_short" is that forward for queries that fit one of its row tiles (a decoding
#: step over a mask the decode kernel does not run, a padded cache's window say): 16-row
#: tiles, the least a tensor-core product takes, so a step does not compute 128 rows for 1. Not
#: tuned: ``triton_tune`` does not measure it (a measured "fwd_sparse" row leaves it as is).
#: "decode" is the split-K decoding kernel's ``(BLOCK_N, num_warps, num_stages)`` (its rows
#: are the query heads of a group, not a tile): measured at D=128 on an H100
LAUNCH = {
    "fwd": {64: (128, 64, 4, 3), 128: (128, 64, 8, 3), 256: (64, 32, 4, 2)},
    "fwd_narrow": {64: (64, 64, 4, 3), 128: (64, 64, 4, 3), 256: (64, 32, 4, 2)},
    "fwd_sparse": {64: (128, 64, 4, 5), 128: (128, 64, 8, 5), 256: (64, 32, 4, 5)},
    "fwd_sparse_short": {64: (16, 64, 4, 3), 128: (16, 64, 4, 3), 256: (16, 32, 4, 2)},
    "bwd_kv": {64: (64, 64, 4, 2), 128: (64, 64, 4, 2), 256: (32, 32, 4, 1)},
    "bwd_q": {64: (64, 64, 4, 2), 128: (64, 64, 4, 2), 256: (32, 32, 4, 1)},
    "decode": {64: (64, 4, 3), 128: (64, 4, 3), 256: (64, 4, 3)},
}


#: a window of at most this many keys runs the "fwd_narrow" launch
NARROW = 512


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for host integers (``triton.cdiv`` is a constexpr function on Triton
    3.6 and later: 1.5 us per call from host code).

    Example:
        >>> cdiv(100, 64), cdiv(128, 64), cdiv(0, 64)
        (2, 2, 0)
    """
    return -(-a // b)


def pow2(n: int) -> int:
    """The tile width for a head dim: the next power of two, at least 16.

    Example:
        >>> pow2(8), pow2(64), pow2(80)
        (16, 64, 128)
    """
    return max(16, 1 << (n - 1).bit_length())


#: the largest head dim (D and Dv) the kernels take
MAX_HEAD_DIM = 256

#: the dtypes the kernels take (fp32 would run its dots in tf32, outside the error rule)
DTYPES = (torch.float16, torch.bfloat16)


def integral(t: torch.Tensor) -> bool:
    """Whether ``t`` holds integers (not floats, complex numbers or booleans, which a
    kernel would read as 0 and 1).

    Example:
        >>> import torch
        >>> integral(torch.tensor([3])), integral(torch.tensor([True])), integral(torch.ones(1))
        (True, False, False)
    """
    return not (t.is_floating_point() or t.is_complex() or t.dtype == torch.bool)


def check_inputs(fn: str, q, k, v, kv_lengths=None, documents=None, offset=0, *,
                 scale, causal=False, window=None, config=None, config_len=4,
                 splits=None) -> Arguments:
    """Raise a ValueError naming ``fn``'s bad argument unless ``q (B, H, Sq, D)``,
    ``k (B, Hkv, Sk, D)``, ``v (B, Hkv, Sk, Dv)`` and ``kv_lengths (B,)`` fit the kernels,
    ``scale`` is a finite number and ``causal`` a bool; returns the other arguments as
    :func:`check_arguments` does (``config`` of ``config_len`` ints), with the band's
    offset and window as :func:`band` makes them safe for the kernels' int32 arithmetic.

    Example:
        >>> import torch
        >>> q = torch.zeros(1, 3, 4, 16, dtype=torch.float16)
        >>> k = torch.zeros(1, 2, 4, 16, dtype=torch.float16)
        >>> check_inputs("flash_forward", q, k, k, scale=0.25)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: flash_forward: q has 3 heads, not a multiple of k's 2 K/V heads: ...
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{fn}: {name} must be 4-D (B, heads, length, head_dim), got "
                             f"shape {tuple(t.shape)}")
        if t.dtype not in DTYPES or t.dtype != q.dtype:
            raise ValueError(f"{fn}: {name} is {t.dtype}; the kernels take float16 or bfloat16, "
                             f"the same for q, k and v: cast with .to(torch.bfloat16)")
        if t.device != q.device:
            raise ValueError(f"{fn}: {name} is on {t.device}, q on {q.device}: move them to "
                             f"one device")
    B, H, _, D = q.shape
    if k.shape[:3] != v.shape[:3] or k.shape[0] != B or k.shape[-1] != D:
        raise ValueError(f"{fn}: q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} "
                         f"must share B, k and v their heads and length, q and k their head dim")
    if k.shape[1] == 0:
        raise ValueError(f"{fn}: k and v have 0 K/V heads (k {tuple(k.shape)}): attention "
                         f"needs at least one")
    if H % k.shape[1]:
        raise ValueError(f"{fn}: q has {H} heads, not a multiple of k's {k.shape[1]} K/V "
                         f"heads: repeat K/V or pass matching head counts")
    if max(D, v.shape[-1]) > MAX_HEAD_DIM:
        raise ValueError(f"{fn}: head dims up to {MAX_HEAD_DIM}, got D={D}, Dv={v.shape[-1]}")
    if kv_lengths is not None and (tuple(kv_lengths.shape) != (B,) or not integral(kv_lengths)
                                   or kv_lengths.device != q.device):
        raise ValueError(f"{fn}: kv_lengths must be an integer tensor of shape ({B},) on "
                         f"{q.device}, got {kv_lengths.dtype} {tuple(kv_lengths.shape)} on "
                         f"{kv_lengths.device}")
    if scale is None:
        raise ValueError(f"{fn}: scale must be a finite number, got None: pass "
                         f"head_dim ** -0.5 for the usual 1/sqrt(d_k)")
    if isinstance(causal, str) or causal not in (True, False):
        raise ValueError(f"{fn}: causal must be True or False, got {causal!r}")
    plain = check_arguments(fn, scale, window, offset, config, splits, config_len)
    if documents is not None:
        if kv_lengths is not None:
            raise ValueError(f"{fn}: pass documents or kv_lengths, not both (padding inside "
                             f"packed documents: give the padding its own document)")
        _check_documents(fn, documents, B, q.shape[2], k.shape[2], offset)
    causal, offset, window = kernel_band(causal, plain.window, plain.offset, q.shape[2],
                                         k.shape[2])
    return plain._replace(offset=offset, window=window, causal=causal)


def band(causal: bool, window: int | None, offset: int, sq: int, sk: int
         ) -> tuple[int, int | None]:
    """``(offset, window)`` of a band that selects, for every query ``i < sq``, exactly the
    keys ``j < sk`` that ``j <= i + offset`` (and ``j > i + offset - window``) selects, with
    every value within a few lengths of zero: the kernels add them to int32 positions,
    where an offset or window near 2**31 would wrap. Unchanged without a band.

    Example:
        >>> band(True, None, 2**40, 8, 8), band(True, 10**12, 3, 8, 8), band(True, 4, -99, 8, 8)
        ((16, None), (3, 11), (-8, 1))
    """
    if not causal:
        return offset, window
    if offset <= -sq:                                   # every key after every query: none
        return -sq, None if window is None else 1
    if window is not None and offset >= sk - 1 + window:    # every key before the window
        return sk, 1
    top = sk + sq                  # past it, "j <= i + offset" holds for every key
    if offset > top:
        window = None if window is None else window - (offset - top)   # same lower edge
        offset = top
    if window is not None:         # wider than offset + sq, its lower edge is below key 0
        window = min(window, offset + sq)
    return offset, window


def band_pairs(seqs, causal: bool, window: int | None, offset: int, block_m: int,
               block_n: int) -> int:
    """The (query, key) pairs the band kernels compute for one head, over ``seqs``: a
    ``(queries, keys)`` pair per sequence (a row of the batch and its real keys, or a packed
    document with its own, counted from its first token). Each block of ``block_m`` queries
    computes its real rows against the keys from the window's lower edge for its first row
    (rounded down to a block of ``block_n``: :func:`key_range`'s ``lo``) to the diagonal of its
    last row (``hi``). What the plans price (``explain()``'s share) and the FLOP counters count
    (:mod:`.flops`).

    Example:
        >>> band_pairs([(4, 4)], False, None, 0, 2, 2), band_pairs([(4, 4)], True, None, 0, 2, 2)
        (16, 12)
        >>> band_pairs([(4, 4), (4, 1)], True, 1, 0, 2, 2)     # a window of 1; 4 keys, then 1
        10
    """
    total = 0
    for sq, keys in seqs:
        for m0 in range(0, sq, block_m):
            top = min(keys, m0 + block_m + offset) if causal else keys
            lo = (max(0, m0 + offset - window + 1) // block_n * block_n
                  if window is not None else 0)
            total += max(0, top - lo) * min(block_m, sq - m0)
    return total


def kernel_band(causal: bool, window: int | None, offset: int, sq: int, sk: int
                ) -> tuple[bool, int, int | None]:
    """``(causal, offset, window)`` as the kernels run a band of ``sq`` queries over ``sk``
    keys: a window is causal, and :func:`band` bounds the offset and the window.

    Example:
        >>> kernel_band(False, 4, 0, 8, 8), kernel_band(True, 1000, 0, 8, 8)
        ((True, 0, 4), (True, 0, 8))
    """
    causal = bool(causal) or window is not None
    offset, window = band(causal, window, offset, sq, sk)
    return causal, offset, window


class Arguments(NamedTuple):
    """A kernel call's scalar arguments as Python ``float``/``int`` (what Triton takes: it
    cannot specialize a NumPy integer or a ``Fraction``), None where not given."""

    scale: float | None
    window: int | None
    offset: int
    config: tuple[int, ...] | None
    splits: int | None
    causal: bool = False


def check_arguments(fn: str, scale=None, window=None, offset=0, config=None,
                    splits=None, config_len=4) -> Arguments:
    """Raise a ValueError naming ``fn``'s bad argument unless ``scale`` is a finite number,
    ``window`` a positive number of keys (or None), ``offset`` an integer, ``config``
    ``(BLOCK_M, BLOCK_N, warps, stages)`` (``config_len`` 4; 3: ``(BLOCK_N, warps,
    stages)``) of positive integers with blocks powers of two from 16 to
    :data:`MAX_BLOCK`, and ``splits`` a positive integer (or None); returns them as Python
    numbers (:class:`Arguments`).

    Example:
        >>> import numpy as np
        >>> check_arguments("flash_forward", scale=np.float32(0.5), offset=np.int64(3))
        Arguments(scale=0.5, window=None, offset=3, config=None, splits=None, causal=False)
        >>> check_arguments("flash_forward", scale=0.125, window=0)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: flash_forward: window must be a positive number of keys ...
    """
    if scale is not None:
        try:
            ok = math.isfinite(float(scale)) and not isinstance(scale, bool)
        except (TypeError, ValueError):
            ok = False
        if not ok:
            raise ValueError(f"{fn}: scale must be a finite number, got {scale!r}")
    if window is not None and not (is_int(window) and window >= 1):
        raise ValueError(f"{fn}: window must be a positive number of keys (each query sees "
                         f"its own and the window - 1 before it), got {window!r}; pass "
                         f"window=None for no window")
    if not is_int(offset):
        raise ValueError(f"{fn}: offset must be an integer, got {offset!r}")
    if splits is not None and not (is_int(splits) and splits >= 1):
        raise ValueError(f"{fn}: splits must be a positive integer (None: as many as fill "
                         f"the GPU), got {splits!r}")
    if config is not None and not _tiles(config, config_len):
        shape = ("(BLOCK_M, BLOCK_N, num_warps, num_stages)" if config_len == 4
                 else "(BLOCK_N, num_warps, num_stages)")
        raise ValueError(f"{fn}: config must be {shape} of positive integers, blocks powers "
                         f"of two from 16 to {MAX_BLOCK} and warps a power of two up to 32, "
                         f"got {config!r}")
    return Arguments(None if scale is None else float(scale),
                     None if window is None else int(window), int(offset),
                     None if config is None else tuple(int(c) for c in config),
                     None if splits is None else int(splits))


def check_pair(fn: str, config) -> tuple | None:
    """Raise a ValueError naming ``fn``'s ``config`` unless it is None or a backward's pair
    ``(dkdv, dq)`` of launch tuples (each as :func:`check_arguments` takes it); returns it
    with Python ints.

    Example:
        >>> check_pair("flash_backward", (64, 64, 4, 2))  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        ValueError: flash_backward: config must be a pair (dkdv, dq) of launch tuples ...
    """
    if config is None:
        return None
    if not isinstance(config, (tuple, list)) or len(config) != 2:
        raise ValueError(f"{fn}: config must be a pair (dkdv, dq) of launch tuples (BLOCK_M, "
                         f"BLOCK_N, num_warps, num_stages), got {config!r}")
    return tuple(check_arguments(fn, config=tiles).config for tiles in config)


#: the largest block (BLOCK_M or BLOCK_N) a launch takes: a tile of 512 rows or more
#: passes Triton's limit on a tensor's elements at the wider head dims
MAX_BLOCK = 256


def _tiles(config, length: int) -> bool:
    # (BLOCK_M, BLOCK_N, warps, stages) (length 4) or (BLOCK_N, warps, stages) (3):
    # positive integers, blocks powers of two from 16 to MAX_BLOCK, warps a power of two
    # up to 32
    if not isinstance(config, (tuple, list)) or len(config) != length:
        return False
    *blocks, warps, stages = config
    if not all(is_int(c) and c >= 1 for c in config):
        return False
    return all(16 <= c <= MAX_BLOCK and not c & (c - 1) for c in blocks) and warps <= 32 \
        and not warps & (warps - 1)


def is_int(x) -> bool:
    """Whether ``x`` is an integer (a Python or NumPy int, not a bool or a float).

    Example:
        >>> is_int(3), is_int(True), is_int(3.0)
        (True, False, False)
    """
    try:
        operator.index(x)
    except TypeError:
        return False
    return not isinstance(x, bool)


def _check_documents(fn, docs, B, Sq, Sk, offset) -> None:
    if (docs.device.type != "cpu" or docs.dim() != 2 or docs.shape[1] != 3
            or not integral(docs)):
        raise ValueError(f"{fn}: documents must be a host (CPU) integer tensor of rows (b, "
                         f"first, length), got {docs.dtype} {tuple(docs.shape)} on {docs.device}")
    if Sq != Sk or offset:
        raise ValueError(f"{fn}: packed documents attend within themselves: Sq == Sk and "
                         f"offset 0, got Sq={Sq}, Sk={Sk}, offset={offset}")
    if _derived(docs, ("covers", B, Sq), lambda: _covers(docs, B, Sq)):
        return
    raise ValueError(f"{fn}: documents must cover each of the {B} sequences of {Sq} "
                     f"tokens exactly once with rows (b, first, length), got "
                     f"{docs.tolist()[:8]}")


def _covers(docs, B, Sq) -> bool:
    """Whether the rows (b, first, length) tile each of B sequences of Sq tokens once."""
    b, first, n = docs.long().unbind(1)
    covered = torch.zeros(B, Sq + 1, dtype=torch.long, device=docs.device)
    ok = bool(((b >= 0) & (b < B) & (first >= 0) & (n >= 0) & (first + n <= Sq)).all())
    if ok:
        covered.index_put_((b, first), torch.ones_like(b), accumulate=True)
        covered.index_put_((b, first + n), -torch.ones_like(b), accumulate=True)
        ok = bool((covered.cumsum(1)[:, :Sq] == 1).all())
    return ok


#: facts derived from a documents table (its check, its device schedules), per table object
#: while it lives and is unmodified: a caller passing the same table each step (the backend
#: caches it on the mask) pays for them once
_DERIVED = torch.utils.weak.WeakTensorKeyDictionary()


#: one memo per table, whichever thread comes first
_DERIVED_LOCK = module_lock(globals(), "_DERIVED_LOCK")


def _derived(docs: torch.Tensor, key, compute):
    with _DERIVED_LOCK:
        memo = _DERIVED.get(docs)
        if memo is None or memo[0] != docs._version:
            memo = _DERIVED[docs] = (docs._version, BoundedCache(16, 16 << 20))
    return memo[1].get_or_compute(key, compute)


def schedule(documents, block: int, programs: int, S: int, heads: int, unused: torch.Tensor):
    """``(table, grid)`` of a launch: plain (no ``documents``), ``unused`` (any tensor on
    the device, standing for a table the kernel never reads: no allocation per call) and
    the grid ``(cdiv(S, block), programs)``; packed documents, the :func:`document_blocks`
    table on ``unused``'s device (one non-blocking copy) and the grid ``(entries, heads)``.

    Example:
        >>> import torch
        >>> lse = torch.zeros(2, 4, 100)                       # (B, H, S): stands in
        >>> schedule(None, 64, 2 * 4, 100, 4, lse)[1]
        (2, 8)
        >>> docs = torch.tensor([[0, 0, 70], [0, 70, 30], [1, 0, 100]])   # (b, first, length)
        >>> table, grid = schedule(docs, 64, 2 * 4, 100, 4, lse)
        >>> table.shape, grid                                   # a row per (document, block)
        (torch.Size([5, 4]), (5, 4))
    """
    if documents is None:
        return unused, (cdiv(S, block), programs)
    device = unused.device
    table = _derived(documents, ("blocks", block, str(device)),
                     lambda: to_device(document_blocks(documents, block), device))
    return table, (len(table), heads)


def empty_outputs(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Uninitialized ``out (B, H, Sq, Dv)`` in q's dtype and ``lse (B, H, Sq)`` fp32, from
    ``q (B, H, Sq, D)`` and ``v (B, Hkv, Sk, Dv)``.

    Example:
        >>> import torch
        >>> out, lse = empty_outputs(torch.zeros(2, 4, 5, 16, dtype=torch.float16),
        ...                          torch.zeros(2, 1, 9, 32, dtype=torch.float16))
        >>> tuple(out.shape), out.dtype, tuple(lse.shape), lse.dtype
        ((2, 4, 5, 32), torch.float16, (2, 4, 5), torch.float32)
    """
    B, H, Sq, _ = q.shape
    return (q.new_empty(B, H, Sq, v.shape[-1]),
            torch.empty(B, H, Sq, device=q.device, dtype=torch.float32))


def empty_like_all(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Uninitialized contiguous tensors shaped as ``tensors`` (the gradients' buffers),
    with their dtypes and devices, whatever their strides.

    Example:
        >>> import torch
        >>> q = torch.zeros(2, 5, 4, 16).transpose(1, 2)      # (B, H, S, D), strided
        >>> (g,) = empty_like_all(q)
        >>> tuple(g.shape), g.is_contiguous()
        ((2, 4, 5, 16), True)
    """
    return tuple(torch.empty(t.shape, device=t.device, dtype=t.dtype) for t in tensors)


def launch_config(kernel: str, D: int, Dv: int, window: int | None = None,
                  queries: int | None = None) -> tuple[int, ...]:
    """``(BLOCK_M, BLOCK_N, num_warps, num_stages)`` of ``kernel`` (of "decode":
    ``(BLOCK_N, num_warps, num_stages)``) for these head dims, from
    :data:`LAUNCH` by the wider tile (one bucket per width: S, B, H and the window within
    its bucket never change it, so they never cause a compile). The forward under a window
    of at most :data:`NARROW` keys takes the "fwd_narrow" row, the block-sparse forward of
    ``queries`` that fit one "fwd_sparse_short" row tile that row.

    A GPU other than the H100 may prefer other tiles: ``python -m benchmarks.triton_tune
    --write FILE`` measures them on it, and ``MULTIHEAD_TRITON_LAUNCH=FILE`` makes them the
    table (its entries replace :data:`LAUNCH`'s, read once per process).

    Example:
        >>> launch_config("fwd", 128, 128), launch_config("fwd", 128, 128, window=256)
        ((128, 64, 8, 3), (64, 64, 4, 3))
        >>> launch_config("fwd_sparse", 128, 128, queries=1)
        (16, 64, 4, 3)
    """
    if kernel == "fwd" and window is not None and window <= NARROW:
        kernel = "fwd_narrow"
    width, table = max(pow2(D), pow2(Dv)), _table()
    if kernel == "fwd_sparse" and queries is not None:
        short = _row(table["fwd_sparse_short"], width)
        if queries <= short[0]:                                  # one tile of rows holds them
            return short
    return _row(table[kernel], width)


def _row(table: dict, width: int) -> tuple[int, ...]:
    """The entry of ``table`` (``{head-dim width: config}``) for heads ``width`` wide: the
    narrowest that fits, else the widest."""
    fits = [w for w in table if w >= width]
    return table[min(fits) if fits else max(table)]


_LOADED: dict = {}


def _table() -> dict:
    path = os.environ.get("MULTIHEAD_TRITON_LAUNCH")
    if not path:
        return LAUNCH
    if path not in _LOADED:
        _LOADED[path] = _load(path)
    return _LOADED[path]


def _load(path: str) -> dict:
    try:
        with open(path) as f:
            measured = json.load(f)
        merged = {k: dict(v) for k, v in LAUNCH.items()}
        for kernel, widths in measured.items():
            merged[kernel].update({int(w): tuple(c) for w, c in widths.items()})
            arity = 3 if kernel == "decode" else 4
            for c in merged[kernel].values():
                if not _tiles(c, arity):
                    raise ValueError(f"{kernel}: each entry is [{'BLOCK_M, ' * (arity == 4)}"
                                     f"BLOCK_N, warps, stages], blocks powers of two from "
                                     f"16 to {MAX_BLOCK}, got {list(c)}")
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"MULTIHEAD_TRITON_LAUNCH={path!r}: not a launch table ({e}); write "
                         f"one with python -m benchmarks.triton_tune --write FILE, or unset "
                         f"the variable") from e
    return merged


@triton.jit
def _order(lo, full_lo, full_hi, hi, BLOCK: tl.constexpr):
    # Clamp the four bounds into lo <= a <= b <= hi_up, all but hi multiples of BLOCK, and
    # split the leading edge at w: its blocks below full_hi are cut by the leading edge's
    # own test alone (see key_range and query_range). Returns (lo, w, a, b, hi).
    hi = tl.maximum(hi, 0)
    hi_up = (hi + BLOCK - 1) // BLOCK * BLOCK
    lo = tl.minimum(lo, hi_up)
    a = tl.minimum(tl.maximum(full_lo, lo), hi_up)
    b = tl.maximum(full_hi, a)
    w = tl.maximum(lo, tl.minimum(a, full_hi))
    return lo, w, a, b, hi


@triton.jit
def visible(R, C, row_ok, klen, offset, window, CAUSAL: tl.constexpr,
            WINDOWED: tl.constexpr, BOUNDED: tl.constexpr = True):
    """The (query, key) pairs the mask leaves: key below ``klen``, a live row, in the band.
    ``R``, ``C`` and ``row_ok`` are broadcast grids (see :func:`masked_scores`). Without
    BOUNDED, only the band (a block known to hold real keys, whose rows are live or, in the
    forward and dQ, unstored)."""
    ok = True
    if BOUNDED:
        ok = (C < klen) & row_ok
    if CAUSAL:
        ok = ok & (C <= R + offset)
    if WINDOWED:
        ok = ok & (C > R + offset - window)
    return ok


@triton.jit
def key_range(m0, klen, offset, window, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key bounds ``(lo, w, a, b, hi)`` for the queries ``[m0, m0 + BLOCK_M)``: the
    blocks of ``[lo, w)`` hold real keys that every row's diagonal allows (the window
    alone cuts them), ``[w, a)`` and ``[b, hi)`` the other edge blocks (``[b, hi)`` all
    inside every row's window), ``[a, b)`` blocks every row sees in full."""
    hi = klen
    full_hi = klen
    if CAUSAL:
        hi = tl.minimum(hi, m0 + BLOCK_M + offset)              # the last row's last key + 1
        full_hi = tl.minimum(full_hi, m0 + offset + 1)          # the first row's
    full_hi = tl.maximum(full_hi, 0) // BLOCK_N * BLOCK_N
    lo = 0
    full_lo = 0
    if WINDOWED:
        lo = tl.maximum(m0 + offset - window + 1, 0) // BLOCK_N * BLOCK_N
        full_lo = ((tl.maximum(m0 + BLOCK_M + offset - window, 0) + BLOCK_N - 1)
                   // BLOCK_N * BLOCK_N)                        # the last row's first key
    return _order(lo, full_lo, full_hi, hi, BLOCK_N)


@triton.jit
def query_range(n0, Sq, klen, offset, window, CAUSAL: tl.constexpr, WINDOWED: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query bounds ``(lo, w, a, b, hi)`` for the keys ``[n0, n0 + BLOCK_N)``: the blocks
    of ``[lo, w)`` hold live queries whose windows hold every key, all real (the diagonal
    alone cuts them), ``[w, a)`` and ``[b, hi)`` the other edge blocks (``[b, hi)`` all
    past every key's diagonal), ``[a, b)`` blocks that see every key in full."""
    lo = 0
    full_lo = 0
    if CAUSAL:
        lo = tl.maximum(n0 - offset, 0) // BLOCK_M * BLOCK_M   # the first key's first query
        full_lo = ((tl.maximum(n0 + BLOCK_N - 1 - offset, 0) + BLOCK_M - 1)
                   // BLOCK_M * BLOCK_M)                       # the last key's
    hi = Sq
    full_hi = Sq
    if WINDOWED:
        hi = tl.minimum(hi, n0 + BLOCK_N - 1 - offset + window)   # the last key's last query + 1
        full_hi = tl.minimum(full_hi, n0 - offset + window)       # the first key's
    hi = tl.where(n0 >= klen, 0, hi)                  # padding: no query sees these keys
    full_hi = tl.where(n0 + BLOCK_N > klen, 0, full_hi)    # partly padding: all edge blocks
    full_hi = tl.maximum(full_hi, 0) // BLOCK_M * BLOCK_M
    return _order(lo, full_lo, full_hi, hi, BLOCK_M)


@triton.jit
def masked_scores(s, b, h, R, C, row_ok, Sq, klen, offset, window, T, I,
                  CAUSAL: tl.constexpr, WINDOWED: tl.constexpr, MASKED: tl.constexpr,
                  MASK_FN: tl.constexpr, HAS_BIAS: tl.constexpr, BOUNDED: tl.constexpr = True):
    """Scores ``s`` (base 2) of a block with the mask's bias added, and where MASKED, which
    pairs the mask leaves: the band's (:func:`visible`), or a mask program's (``MASK_FN``,
    :mod:`.mask_program`, whose bias is in base 2, tiles clamped to ``±3e38``) within
    bounds. Returns ``(s, ok)``; ``ok`` is True where not MASKED.

    The block may lie either way round: ``R`` (query positions) and ``row_ok`` (live
    queries) are ``(M, 1)`` and ``C`` (key positions) ``(1, N)`` for ``s (M, N)``, or
    ``(1, M)`` and ``(N, 1)`` for the transposed ``s (N, M)`` of the dK/dV loop. Without
    BOUNDED, the band's test leaves out the bounds (:func:`visible`)."""
    ok = True
    if HAS_BIAS:
        allowed, bias = MASK_FN(b, h, R, C, Sq, klen, T, I)
        s = s + bias
        if MASKED:
            ok = allowed & (C < klen) & row_ok
    elif MASKED:
        if MASK_FN is not None:
            allowed, _ = MASK_FN(b, h, R, C, Sq, klen, T, I)
            ok = allowed & (C < klen) & row_ok
        else:
            ok = visible(R, C, row_ok, klen, offset, window, CAUSAL, WINDOWED, BOUNDED)
    return s, ok


@triton.jit
def key_length(LENS, b, n, HAS_LENS: tl.constexpr):
    """The keys the rows of sequence ``b`` may see: its ``n``, or fewer where ``LENS``
    (per-sequence key lengths) pads it."""
    if HAS_LENS:
        n = tl.minimum(n, tl.load(LENS + b))
    return n


@triton.jit
def program_block(pid, heads, SEGS, S, VARLEN: tl.constexpr, BLOCK: tl.constexpr):
    """``(b, head, first, n, start)`` of this program: its batch and head (one of ``heads``
    per batch), the first token of its sequence, the sequence's length and the first
    position of its block in it (``b`` and ``first`` int64, for pointer offsets).

    Plain: grid ``(blocks, B * heads)`` over sequences of length ``S``. VARLEN: grid
    ``(entries, heads)`` where entry ``pid`` of ``SEGS`` (int32 rows ``b, first, n,
    start``) is one block of one packed document."""
    if VARLEN:
        row = SEGS + pid * 4
        b = tl.load(row).to(tl.int64)
        first = tl.load(row + 1).to(tl.int64)
        n = tl.load(row + 2)
        start = tl.load(row + 3)
        head = tl.program_id(1)
    else:
        bh = tl.program_id(1)
        b = (bh // heads).to(tl.int64)                # offsets past 2^31 elements stay exact
        head = bh % heads
        first = 0
        n = S
        start = pid * BLOCK
    return b, head, first, n, start


def document_blocks(docs: torch.Tensor, block: int) -> torch.Tensor:
    """The VARLEN schedule of :func:`program_block`: for ``docs (n, 3)`` host rows
    ``(b, first, length)``, one int32 row ``(b, first, length, start)`` per block of
    ``block`` positions of each document (a document of length 0 has none).

    Example:
        >>> document_blocks(torch.tensor([[0, 0, 3], [0, 3, 5]]), 4).tolist()
        [[0, 0, 3, 0], [0, 3, 5, 0], [0, 3, 5, 4]]
    """
    docs = docs.to(torch.int64)
    count = (docs[:, 2] + block - 1) // block                            # (n,) blocks each
    rows = docs.repeat_interleave(count, dim=0)                          # (E, 3)
    before = torch.cumsum(count, 0) - count                              # (n,) first entry
    local = torch.arange(len(rows), device=docs.device) - before.repeat_interleave(count)  # (E,)
    return torch.cat([rows, (local * block)[:, None]], 1).to(torch.int32)


@triton.jit
def load_tile(base, idx, n, s_idx, s_col, C: tl.constexpr, BLOCK_C: tl.constexpr,
              BOUNDED: tl.constexpr):
    """The tile ``base[idx, :C]`` as ``(len(idx), BLOCK_C)``, zero past column ``C`` and,
    when BOUNDED, at positions ``idx >= n`` (rows of q/dO, or keys/values of K/V)."""
    cols = tl.arange(0, BLOCK_C)
    ok = cols[None, :] < C
    if BOUNDED:
        ok = ok & (idx[:, None] < n)
    return tl.load(base + idx[:, None] * s_idx + cols[None, :] * s_col, mask=ok, other=0.0)


@triton.jit
def finite_or_zero(x):
    """``x (n, C)`` with NaN and ±inf replaced by 0, and ``(n,)`` whether each row of ``x``
    held one: so that a value the mask hides (weighted by 0, and ``0 * NaN`` is NaN) never
    reaches a row, while a row that sees one is made NaN by the caller."""
    finite = tl.abs(x) < float("inf")                         # False for NaN and ±inf
    return tl.where(finite, x, 0.0), tl.max(tl.where(finite, 0, 1), 1) > 0


@triton.jit
def nonfinite(x):
    """Whether the 2-D tile ``x`` holds a NaN or an inf (a scalar).

    The kernels run their blocks first without :func:`finite_or_zero`, which costs a pass
    over every masked block's tile and its trip through registers: on an H100 (bf16, D=128)
    the 256-key window's forward kernel took 254-262 us with it on every edge block and
    213-215 us without, a decoding step (B=8, a 32k cache, every block masked) 676 us and
    353 us. A hidden non-finite value reaches the accumulators anyway as NaN (its weight is
    0, and ``0 * NaN`` and ``0 * inf`` are NaN), as does one a row sees; so a program whose
    accumulator ends finite saw none, and only one that ends non-finite runs its blocks
    again, carefully (every block masked, :func:`finite_or_zero` on the masked side).
    """
    return tl.max(tl.max(tl.where(tl.abs(x) < float("inf"), 0, 1), 1), 0) > 0

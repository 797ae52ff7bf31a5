"""The FLOPs of our operators, for torch's counters: ``torch.utils.flop_counter``'s
``FlopCounterMode`` and what reads its registry (``torch.compile``'s estimates of a graph's
compute time, which take an operator without a formula for free).

Each operator counts torch's own FLOPs for SDPA per (query, key) pair, as
``torch.utils.flop_counter.sdpa_flop_count`` and ``sdpa_backward_flop_count`` count them
(the forward's two products, ``2 (D + Dv)``; the backward's five, the scores recomputed,
``6 D + 4 Dv``), over the pairs the kernels compute rather than all ``B * H * Sq * Sk``:
torch counts every pair for SDPA whatever the mask, 64 times the work for a sliding window
of 256 over 16k tokens. The pairs are those the plans price (``explain()``'s share):

- the band kernels and the decode kernel: the keys each block of queries visits, per row of
  the batch (up to its key length) or per packed document (:func:`._band.band_pairs`);
- the block-sparse kernels: every pair of the FULL and PARTIAL blocks in their lists (a
  PARTIAL block is computed whole, its masked pairs too).

Key lengths, a documents table and block lists are read (on a GPU, a sync: only while a
counter runs); where they hold no values (fake tensors, as ``torch.compile``'s estimates see
them), every key of the band counts. The weights kernel is no operator yet, so its work goes
uncounted.

Eager calls reach the kernels without torch's dispatcher (:mod:`.ops`); while a dispatch
mode is on they go through the operators, so that the mode sees each kernel call.

Notation: B batch, H query heads, Sq/Sk lengths, D/Dv head dims.
"""

from __future__ import annotations

import torch

from . import ops as _ops  # noqa: F401  (defines the operators)
from ._band import band_pairs, kernel_band, launch_config


def forward_flops(pairs: int, D: int, Dv: int) -> int:
    """FLOPs of a forward over ``pairs``: ``q @ k^T`` and ``p @ v``.

    Example:
        >>> forward_flops(10, 64, 64)
        2560
    """
    return 2 * pairs * (D + Dv)


def backward_flops(pairs: int, D: int, Dv: int) -> int:
    """FLOPs of a backward over ``pairs``: the scores again, ``dP``, ``dV``, ``dQ``, ``dK``.

    Example:
        >>> backward_flops(10, 64, 64)
        6400
    """
    return pairs * (6 * D + 4 * Dv)


def _readable(t) -> bool:
    """Whether ``t`` holds values this process can read now (not fake, meta or functional;
    no CUDA graph capturing, which a read would break)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    return (isinstance(t, torch.Tensor) and t.device.type != "meta"
            and not isinstance(t, (FakeTensor, FunctionalTensor))
            and not (t.is_cuda and torch.cuda.is_current_stream_capturing()))


def _concrete(*sizes) -> bool:
    return all(isinstance(n, int) for n in sizes)


def _band(q, k, v, causal: bool, window: int, offset: int, kv_lengths, documents,
          kernel: str, per_pair) -> int:
    """FLOPs of a band kernel's call (``window`` 0: none) over the keys each block of
    queries visits, on the tiles of ``kernel`` (``"decode"``: one block of all queries),
    the band taken as the kernels take it (:func:`._band.kernel_band`)."""
    B, H, Sq, D = q.shape
    Sk, Dv = k.shape[2], v.shape[3]
    if not _concrete(B, Sq, Sk, D, Dv):            # symbolic sizes: every pair, no guard
        return per_pair(B * H * Sq * Sk, D, Dv)
    causal, offset, window = kernel_band(causal, window or None, offset, Sq, Sk)
    if kernel == "decode":
        block_m, block_n = max(1, Sq), launch_config("decode", D, Dv)[0]
    else:
        block_m, block_n = launch_config(kernel, D, Dv, window)[:2]
    if documents is not None and _readable(documents):
        seqs = [(n, n) for n in documents[:, 2].tolist()]        # (b, first, length) rows
    else:
        keys = [Sk] * B
        if kv_lengths is not None and _readable(kv_lengths):
            keys = [min(Sk, max(0, n)) for n in kv_lengths.tolist()]   # (B,)
        seqs = [(Sq, n) for n in keys]
    pairs = band_pairs(seqs, causal, window, offset, block_m, block_n)
    return per_pair(pairs * H, D, Dv)


def _listed(q, k, v, lists, configs, i: int, per_pair) -> int:
    """FLOPs of block-sparse kernel ``i`` of a flattened plan (one over query blocks) over
    every pair of the blocks in its lists."""
    B, H, Sq, D = q.shape
    Sk, Dv = k.shape[2], v.shape[3]
    n_full, n_part, index = lists[3 * i:3 * i + 3]        # (B', H', R), twice; (B', H', R, C)
    bm, bn = configs[2 + 4 * i:4 + 4 * i]
    if not (_concrete(B, H, Sq, Sk) and all(map(_readable, (n_full, n_part, index)))):
        return per_pair(B * H * Sq * Sk, D, Dv)
    Bm, Hm, R, C = index.shape
    listed = torch.arange(C, device=index.device) < (n_full + n_part)[..., None]
    rows = (Sq - torch.arange(R, device=index.device) * bm).clamp(0, bm)        # (R,)
    cols = (Sk - index.long() * bn).clamp(0, bn)                             # (B', H', R, C)
    per_mask = int(((cols * listed).sum(-1) * rows).sum())
    return per_pair(per_mask * (B // Bm) * (H // Hm), D, Dv)


def _flash_attention(q, k, v, scale, causal, window, offset, kv_lengths, documents=None,
                     *args, out_val=None, **kwargs) -> int:
    return _band(q, k, v, causal, window, offset, kv_lengths, documents, "fwd", forward_flops)


def _flash_attention_backward(dout, dlse, q, k, v, out, lse, scale, causal, window, offset,
                              kv_lengths, documents=None, *args, out_val=None,
                              **kwargs) -> int:
    # (the pairs of the dQ kernel's loop; the dK/dV kernel's visit the same band by key)
    return _band(q, k, v, causal, window, offset, kv_lengths, documents, "bwd_q",
                 backward_flops)


def _flash_decode(q, k, v, scale, causal, window, offset, kv_lengths, *args, out_val=None,
                  **kwargs) -> int:
    return _band(q, k, v, causal, window, offset, kv_lengths, None, "decode", forward_flops)


def _flash_sparse(q, k, v, scale, source, tensors, ints, lists, configs, *args,
                  out_val=None, **kwargs) -> int:
    return _listed(q, k, v, lists, configs, 0, forward_flops)


def _flash_sparse_backward(dout, dlse, q, k, v, out, lse, scale, source, tensors, ints, lists,
                           configs, *args, out_val=None, **kwargs) -> int:
    return _listed(q, k, v, lists, configs, 2, backward_flops)     # the dQ kernel's lists


def register() -> None:
    """Put the formulas into torch's registry, those missing from it (again after a reload
    of ``torch.utils.flop_counter``, which rebuilds it).

    Example:
        >>> from torch.utils.flop_counter import flop_registry
        >>> register(); torch.ops.multihead.flash_sparse in flop_registry
        True
    """
    from torch.utils import flop_counter
    ops = torch.ops.multihead
    for op, formula in [(ops.flash_attention, _flash_attention),
                        (ops.flash_attention_backward, _flash_attention_backward),
                        (ops.flash_decode, _flash_decode), (ops.flash_sparse, _flash_sparse),
                        (ops.flash_sparse_backward, _flash_sparse_backward)]:
        if op not in flop_counter.flop_registry:
            flop_counter.register_flop_formula(op, get_raw=True)(formula)


register()

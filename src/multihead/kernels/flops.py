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
from torch.utils.flop_counter import register_flop_formula

from ._band import band_pairs, launch_config


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
    """Whether ``t`` holds values this process can read (not fake, meta or functional)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor
    return (isinstance(t, torch.Tensor) and t.device.type != "meta"
            and not isinstance(t, (FakeTensor, FunctionalTensor)))


def _concrete(*sizes) -> bool:
    return all(isinstance(n, int) for n in sizes)


def _band(q, k, v, causal: bool, window: int, offset: int, kv_lengths, documents,
          block_m: int, block_n: int, per_pair) -> int:
    """FLOPs of a band kernel's call (``window`` 0: none) over the keys each block of
    ``block_m`` queries visits."""
    B, H, Sq, D = q.shape
    Sk, Dv = k.shape[2], v.shape[3]
    if not _concrete(B, Sq, Sk):                   # symbolic sizes: every pair, no guard
        return per_pair(B * H * Sq * Sk, D, Dv)
    if documents is not None and _readable(documents):
        seqs = [(n, n) for n in documents[:, 2].tolist()]        # (b, first, length) rows
    else:
        keys = [Sk] * B
        if kv_lengths is not None and _readable(kv_lengths):
            keys = [min(Sk, max(0, n)) for n in kv_lengths.tolist()]   # (B,)
        seqs = [(Sq, n) for n in keys]
    pairs = band_pairs(seqs, causal, window or None, offset, block_m, block_n)
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


ops = torch.ops.multihead


@register_flop_formula(ops.flash_attention, get_raw=True)
def _flash_attention(q, k, v, scale, causal, window, offset, kv_lengths, documents=None,
                     *args, out_val=None, **kwargs) -> int:
    bm, bn = launch_config("fwd", q.shape[3], v.shape[3], window or None)[:2]
    return _band(q, k, v, causal, window, offset, kv_lengths, documents, bm, bn, forward_flops)


@register_flop_formula(ops.flash_attention_backward, get_raw=True)
def _flash_attention_backward(dout, dlse, q, k, v, out, lse, scale, causal, window, offset,
                              kv_lengths, documents=None, *args, out_val=None,
                              **kwargs) -> int:
    bm, bn = launch_config("bwd_q", q.shape[3], v.shape[3])[:2]       # the dQ kernel's loop
    return _band(q, k, v, causal, window, offset, kv_lengths, documents, bm, bn,
                 backward_flops)


@register_flop_formula(ops.flash_decode, get_raw=True)
def _flash_decode(q, k, v, scale, causal, window, offset, kv_lengths, *args, out_val=None,
                  **kwargs) -> int:
    block_n = launch_config("decode", q.shape[3], v.shape[3])[0]      # one block of queries
    return _band(q, k, v, causal, window, offset, kv_lengths, None, max(1, q.shape[2]), block_n,
                 forward_flops)


@register_flop_formula(ops.flash_sparse, get_raw=True)
def _flash_sparse(q, k, v, scale, source, tensors, ints, lists, configs, *args,
                  out_val=None, **kwargs) -> int:
    return _listed(q, k, v, lists, configs, 0, forward_flops)


@register_flop_formula(ops.flash_sparse_backward, get_raw=True)
def _flash_sparse_backward(dout, dlse, q, k, v, out, lse, scale, source, tensors, ints, lists,
                           configs, *args, out_val=None, **kwargs) -> int:
    return _listed(q, k, v, lists, configs, 2, backward_flops)     # the dQ kernel's lists

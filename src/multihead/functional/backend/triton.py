"""The triton backend: our FlashAttention-2 kernels (``multihead.kernels``) on GPUs.

Band masks (causal, sliding windows, either alignment) and key padding from lengths, alone
or combined with ``&``, run the band kernels, which compute only the key blocks the band
reaches from indices; packed documents (contiguous runs known on the host), alone or with a
band, run them scheduled per (document, query block), so no program visits another
document's keys; every other mask of our model (documents, dense, bias, ALiBi, padding rows,
``at_positions`` of a band or ALiBi, ``&``/``|``/``~`` compositions) runs the block-sparse kernels
(:mod:`multihead.kernels.flash_sparse`), which visit the blocks in per-block lists built on
the device and evaluate the mask as generated Triton code on the blocks it cuts. GQA and
MQA read each K/V head in place, forward and backward (the K/V gradients are summed over
the group in registers; deterministic). A band call of at most 16 queries without
gradients (a decoding step, a draft to verify) runs the split-K decode kernel instead
(:mod:`multihead.kernels.decode`), which reads each K/V byte once for the whole group of
query heads. A call that asks for the weights gets them from the weights kernel
(:mod:`multihead.kernels.weights`: written once in the inputs' dtype, in eager calls).
Every path goes through ``torch.ops.multihead`` operators under ``torch.compile``
(:mod:`multihead.kernels.ops`), so ``fullgraph=True`` traces them, block lists included.
Registered only where Triton is installed.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from ..._args import counted
from ... import _second_order as second_order
from ... import kernels
from ... import masks as M
from ...masks.structured import _offset
from .._call import AttentionCall
from ..capabilities import Capabilities, shown
from ._common import BandParts, band_parts, mask_launches
from ._weights import kernel_weights
from ..cost import Work, share
from ..registry import Backend, Plan, register
from ..._tracing import tracing

#: its FLOP rate against the vendor's fused kernel on the same device (priced as slower,
#: so it is chosen for the work it skips, not for work both would do)
EFFICIENCY = 0.8
#: the backward kernels' FLOP rate against the vendor's fused backward (H100, bf16: causal
#: S=16384 fwd+bwd ran in 9.9 ms against SDPA's 6.4 ms), so that training prices
#: ``1 + 2.5 * EFFICIENCY / BACKWARD_EFFICIENCY`` forwards where SDPA prices 3.5
BACKWARD_EFFICIENCY = 0.6
#: the host time of an eager decoding call beyond SDPA's, in launches of the device profile
#: (our decode kernel reads the cache as fast as SDPA's: 353 against 351 us at B=8 over a
#: 32k cache on an H100, so its bytes are priced as SDPA's; the eager call costs more host
#: time in Triton's Python launcher: B=1 H=32 Hkv=8 with a 4k cache, 98 us per call through
#: ``mh.attention`` against SDPA's 44, for 17 and 9 us of kernels, ``benchmarks/triton_step``).
#: So auto keeps SDPA for decoding and ``backend="triton"`` opts in
DECODE_HOST_LAUNCHES = 9
#: a pair's dropout decision in the kernels, in tensor-core FLOPs: an eighth of a Philox
#: draw (ten rounds, about 100 integer operations) and a few more to unpack, compare and
#: select, about 18 integer operations, each worth 64 FLOPs on an H100 (an SM's 64 integer
#: multiplies per clock against its tensor cores' 4,096 bf16 FLOPs). Not measured: a
#: forward at D=128 (512 FLOPs a pair) is priced about 3x slower with dropout than without
DROPOUT_FLOPS = 18 * 64
#: torch ops that turn a mask's tile map into the block lists (clamps, sort, counts), on top
#: of the map's own (priced as materializing the mask: index grids, one op per leaf)
LIST_OPS = 8
#: the tile map's host cost against materializing the mask, in a decoding step's call: a
#: padded cache's window or ALiBi at positions took 57-90 torch ops to list its blocks
#: against 25-27 to build SDPA's additive mask (counted with a dispatch mode), and on an H100
#: such a step through our kernels took 1.5-2.6x SDPA's time per call (B=8 H=32 Hkv=8
#: D=128, 1 or 16 queries over 4k or 32k slots, ``benchmarks/padded_cache``: 1.5-2.7 ms
#: against 0.7-1.4 ms, for kernels of 0.13-1.0 ms against 0.11-0.55)
TILE_MAP_OPS = 3
#: the host time of one such op (Python, checks, the launch) in launches of the profile:
#: 15-30 us per op in those steps, against the profile's 6 us per launch
HOST_OP_LAUNCHES = 3


class Band(NamedTuple):
    causal: bool
    window: int | None
    offset: int
    padding: M.Padding | None
    documents: torch.Tensor | None = None     # host rows (b, first, length): packed documents


class Sparse(NamedTuple):
    mask: M.Mask
    why: str | None = None                    # why a band-shaped mask takes the lists


#: why packed documents known on the host take the block lists in a call with dropout and
#: weights (see :func:`_route`)
DOCUMENTS_AS_LISTS = ("packed documents through block lists (dropout with weights: the "
                      "weights kernel draws at positions in the sequences)")


def _band(call: AttentionCall) -> Band | Sparse | str:
    """The call's mask as a band and key padding, else as a mask for the block-sparse
    kernels, or why neither runs it (once per call)."""
    return call.memo("triton_band", lambda: _route(call))


def _route(call: AttentionCall) -> Band | Sparse | str:
    band = _find_band(call)
    # packed documents with dropout and weights: the weights kernel draws at positions in
    # the sequences, as the block-sparse kernels do, not from each document's first token
    per_document = isinstance(band, Band) and band.documents is not None
    if isinstance(band, Band) and not (per_document and call.dropout_p
                                       and call.return_weights):
        return band
    from ...kernels.mask_program import supported
    why = supported(call.effective_mask)
    if why is not None:
        return why
    return Sparse(call.effective_mask, DOCUMENTS_AS_LISTS if per_document else None)


def _find_band(call: AttentionCall) -> Band | str:
    parts = band_parts(call.effective_mask, documents=True)
    if not isinstance(parts, BandParts) or (parts.padding is not None
                                            and parts.padding.real is not None):
        return ("runs masks of the form band (causal or sliding window), key padding from "
                "lengths, or band & padding")
    window, padding, document = parts
    docs = None
    if document is not None:
        docs = _documents(call, document) if padding is None else None
        if docs is None:
            return ("runs documents as packed sequences (ids known on the host in contiguous "
                    "runs, self-attention, no padding)")
    if window is None:
        return Band(False, None, 0, padding, docs)
    offset = 0 if docs is not None else _offset(window.align, call.Sq, call.Sk)
    return Band(True, window.size, offset, padding, docs)


def _documents(call: AttentionCall, document: M.Document) -> torch.Tensor | None:
    """Rows ``(b, first, length)`` of the packed documents (host), or None unless the
    documents are contiguous runs known on the host of a self-attention call (never while
    ``torch.compile`` traces: the documents then go to the block lists, built in the
    graph). The same table object each call (the kernels then check and schedule it once)."""
    if document.kv_ids is not None or call.Sq != call.Sk or not document.runs_known:
        return None
    return document.segments(call.B)              # (documents, 3), cached on the mask


def _pairs(call: AttentionCall, band: Band, block_m: int, block_n: int) -> int:
    """(query, key) pairs of the key blocks the kernel visits, over all rows and heads
    (:func:`multihead.kernels._band.band_pairs`; while ``torch.compile`` traces, where sizes
    may be symbolic: a bound without a loop over blocks, so that no size is specialized)."""
    if tracing():
        keys = call.Sk if band.window is None else min(call.Sk, band.window + block_n)
        return call.B * call.H * call.Sq * keys
    from ...kernels._band import band_pairs
    if band.documents is not None:                # each document a sequence of its own
        seqs = [(n, n) for n in band.documents[:, 2].tolist()]
    else:
        hi_keys = [call.Sk] * call.B
        if band.padding is not None and band.padding._host_lengths is not None:
            host = [min(call.Sk, int(n)) for n in band.padding._host_lengths.tolist()]
            hi_keys = host * call.B if len(host) == 1 else host
        seqs = [(call.Sq, hi) for hi in hi_keys]
    return band_pairs(seqs, band.causal, band.window, band.offset, block_m, block_n) * call.H


def _decoding_step(call: AttentionCall) -> bool:
    """A call of a decoding step's size: at most the decode kernel's queries, no gradients."""
    from ...kernels.decode import MAX_QUERIES
    return call.Sq <= MAX_QUERIES and not call.requires_grad


def _share(pairs, total) -> str:
    """``"12.5% of the pairs"``; while tracing (sizes may be symbolic), no figure."""
    if tracing():
        return "the pairs (not counted while tracing)"
    return f"{share(pairs / max(1, total))} of the pairs"


def _draws(call: AttentionCall, pairs) -> float:
    """The FLOPs of drawing dropout for ``pairs`` once (none without dropout)."""
    return DROPOUT_FLOPS * pairs if call.dropout_p else 0.0


def _work(call: AttentionCall, pairs: int, block_m: int, launches: float = 1) -> Work:
    """The forward's (and with gradients, the backward's) work over ``pairs`` computed
    (with dropout, each pair's draw too: :func:`_draws`)."""
    flops = 2.0 * pairs * (call.D + call.Dv) / EFFICIENCY + _draws(call, pairs)
    work = Work(flops=flops, kernel="fused",
                dtype=call.q.dtype, bytes=call.io_bytes(kv_reads=call.group), launches=launches,
                parallel=call.B * call.H * -(-call.Sq // block_m))  # no split over keys (yet)
    if call.requires_grad:
        work = work.times(flops=1 + 2.5 * EFFICIENCY / BACKWARD_EFFICIENCY, bytes=3.0,
                          launches=4.0)
    return work


def _with_weights(call: AttentionCall, plan: Plan) -> Plan:
    """``plan`` with the weights kernel after it: two passes of ``q kᵀ`` (row statistics,
    then the weights; priced over every pair, an upper bound where the mask leaves EMPTY
    blocks) and the weights written once in the inputs' dtype (counted as memory too: they
    are the size of the scores; their head mean, a head's size, after a first launch that
    writes the rows' statistics). A mask the forward ran as a band gets block lists of its
    own, kept on the mask: priced as built in a decoding step (at their host time, as
    :meth:`TritonFlash._sparse_plan` prices a step's) and for a mask made for the call,
    else as kept. Their gradient (only where a loss uses the weights) is the reference's,
    recomputed: not priced."""
    work = plan.work
    launches = 1
    mask = call.effective_mask
    if mask is not None and plan.detail[1] != "sparse":      # lists the forward did not build
        ops = LIST_OPS + TILE_MAP_OPS * mask_launches(call)
        if plan.detail[1] == "decode":           # a step's host time, as _sparse_plan's
            launches += HOST_OP_LAUNCHES * ops
        elif mask.made_for_call():
            launches += ops                      # built in the call, for it alone
    written = call.B * call.H * call.Sq * call.Sk * call.q.dtype.itemsize
    if call.average_weights:     # the head mean, from the rows' statistics (m, l: fp32 each)
        written = written // call.H + 8 * call.B * call.H * call.Sq
        launches += 1
    flops = 4.0 * call.pairs * call.D / EFFICIENCY + _draws(call, call.pairs)  # (each weight's)
    work = dataclasses.replace(
        work, flops=work.flops + flops,
        bytes=work.bytes + written, launches=work.launches + launches,
        memory=work.memory + written)            # (an output, but one the size of the scores)
    what = "the weights' head mean" if call.average_weights else "weights"
    return Plan(work, f"{plan.note}; {what} written once in "
                      f"{str(call.q.dtype).removeprefix('torch.')} by the weights kernel",
                plan.detail)


class TritonFlash(Backend):
    name = "triton"
    summary = ("our FlashAttention-2 in Triton (forward, backward, split-K decode): bands and "
               "packed documents from indices, any other mask by block lists, GQA in place")
    capabilities = Capabilities(devices=frozenset({"cuda"}),
                                dtypes=frozenset({torch.float16, torch.bfloat16}),
                                max_head_dim=256, lse=True, weights=True, dropout=True,
                                masks=frozenset({"causal", "window", "padding", "document",
                                                 "dense", "bias", "alibi", "at_positions"}),
                                transforms=False, forward_ad=False, second_order=True)

    def check(self, call):
        band = _band(call)
        if isinstance(band, str):
            return band
        if call.dropout_p > 0:
            from ...kernels._dropout import LEVELS, drop_threshold
            levels = drop_threshold(call.dropout_p)
            if levels in (0, LEVELS):
                return (f"draws dropout at a resolution of 2^-16, where dropout_p = "
                        f"{call.dropout_p} rounds to {levels // LEVELS}")
        if call.return_weights and tracing():     # (every mask it runs has a Triton form)
            return ("returns attention weights in eager calls only (the weights kernel is "
                    "no torch operator yet)")
        return None

    def plan(self, call, profile):
        plan = self._plan(call)
        if call.dropout_p:
            plan = Plan(plan.work, f"{plan.note}; dropout drawn in the kernels (the rate "
                                   f"rounded to a multiple of 2^-16)", plan.detail)
        return _with_weights(call, plan) if call.return_weights else plan

    def _plan(self, call):
        from ...kernels._band import launch_config
        band = _band(call)
        if isinstance(band, Sparse):
            return self._sparse_plan(call, band,
                                     *launch_config("fwd_sparse", call.D, call.Dv,
                                                   queries=call.Sq)[:2])
        if _decoding_step(call) and band.documents is None and not call.dropout_p:
            return self._decode_plan(call, band)
        bm, bn, _, _ = launch_config("fwd", call.D, call.Dv, band.window)
        pairs = _pairs(call, band, bm, bn)
        kind = ("sliding window" if band.window is not None else "causal" if band.causal
                else "no band")
        if band.documents is not None:
            kind = (f"{len(band.documents)} packed documents, one program per (document, "
                    f"query block){'' if kind == 'no band' else ' & ' + kind}")
        note = f"{kind}{' & key padding' if band.padding is not None else ''}: " \
               f"{_share(pairs, call.pairs)} computed"
        return Plan(_work(call, pairs, bm), note, (band, "attention"))

    def _sparse_plan(self, call, sparse, bm, bn):
        mask = sparse.mask
        pairs = call.pairs                              # a bias only: every block is FULL
        if mask.has_predicate and (tracing() or not mask.on_host):
            why = ("not counted while tracing: the graph builds them" if tracing() else
                   "counting them would read the device")
            note = (f"block lists built on {call.q.device}, EMPTY blocks skipped; priced as if "
                    f"every block were visited ({why})")
        else:
            if mask.has_predicate:
                pairs = int(mask._tile_map(call.Sq, call.Sk, tile_q=bm, tile_k=bn, device="cpu",
                                           banded=True).density * call.pairs)
            note = f"block lists: {_share(pairs, call.pairs)} visited"
        if sparse.why is not None:
            note = f"{sparse.why}; {note}"
        launches, step = 1, _decoding_step(call)
        # lists built in the call cost host time: a decoding loop's mask is usually new each
        # step (a padded cache's positions are), so a step's lists are priced as built; so
        # are those of a mask made for the call from the caller's tensor (a GPU padding
        # tensor made for each batch), which keeps none for the next. A mask object the
        # caller passes again keeps its lists: priced as kept
        if step or mask.made_for_call():
            # a step's ops at their whole host time (and Triton's launcher costs a step more
            # than SDPA's, as for the decode kernel); a larger call's at a launch each, the
            # rest of their host time running while the device works (a padded cache's
            # window over a prompt of 2048: 1,918 us in all for 1,455 us of kernels)
            ops = LIST_OPS + TILE_MAP_OPS * mask_launches(call)
            launches += (DECODE_HOST_LAUNCHES + HOST_OP_LAUNCHES * ops) if step else ops
            note += "; lists built in the call, priced at their host time"
        return Plan(_work(call, pairs, bm, launches), note, (sparse, "sparse"))

    def _decode_plan(self, call, band):
        from ...kernels.decode import BLOCK_N, num_splits
        splits = num_splits(call.B, call.Hkv, call.Sk)
        pairs = _pairs(call, band, call.Sq, BLOCK_N)
        work = Work(flops=2.0 * pairs * (call.D + call.Dv), kernel="fused",
                    dtype=call.q.dtype, bytes=call.io_bytes(kv_reads=1),
                    launches=1 + DECODE_HOST_LAUNCHES, parallel=call.B * call.Hkv * splits)
        # (traced, a count may be symbolic: comparing it to 1 would specialize the graph)
        n = (lambda k, noun: f"{shown(k)} {noun}s") if tracing() else counted
        note = f"split-K decode: the keys in {n(splits, 'split')}, each K/V byte read once for " \
               f"the {n(call.group, 'query head')} of a group"
        return Plan(work, note, (band, "decode"))

    def length_free(self, plan):
        band, name = plan.detail                # no mask: the kernels size all else from Sk
        return name != "sparse" and band == Band(False, None, 0, None, None)

    def run(self, call, plan):
        from ...kernels import ops
        band, name = plan.detail                # ops.attention, ops.decode or ops.sparse
        # what a backward that builds a graph needs to give gradients that differentiate again
        again = second_order.spec(call.effective_mask, call.scale, self.name) \
            if second_order.wanted(call) else None
        dropout = seed = None
        if call.dropout_p:                      # a seed from torch's generator, per call
            from ...kernels._dropout import draw
            dropout = draw(call.dropout_p, call.q.device)
            seed = dropout.seed
        if name == "sparse":
            out, lse = ops.sparse(call.q, call.k, call.v, band.mask, call.scale, again,
                                  call.dropout_p, seed)
        else:
            lens = None
            if band.padding is not None:        # one length per row of the batch, on device
                lens = band.padding.lengths.expand(call.B).contiguous()
            args = (call.q, call.k, call.v, call.scale, band.causal, band.window or 0,
                    band.offset, lens)
            if name == "decode":
                out, lse = ops.decode(*args)
            else:
                out, lse = ops.attention(*args, band.documents, again, call.dropout_p, seed)
        weights = kernel_weights(call, dropout) if call.return_weights else None
        return out, weights, lse if call.return_lse else None


if kernels.available():
    register(TritonFlash())
    kernels.count_flops_with_torch()

"""The varlen backend: packed documents attended one length-group at a time.

For a pure :func:`multihead.masks.document` mask whose documents are contiguous runs of
tokens (what packing produces), attention is block-diagonal: each document attends to
itself only. This backend cuts the packed sequence into its documents, groups documents of
equal length, and runs the fused SDPA kernel once per group on a ``(n_docs, H, L, D)``
batch: exactly ``sum(L_i**2)`` pairs are computed, with no padding and no mask tensor
(what FlashAttention's ``flash_attn_varlen_func`` does with ``cu_seqlens``).

Limits: only a plain document mask (no composition, no ``kv_ids``), ``Sq == Sk``, document
ids that form contiguous runs; no weights, no log-sum-exp. It needs the document lengths
on the host, so it is not traceable by ``torch.compile``.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..._args import counted
from ..._cache import BoundedCache
from ..._device import to_device
from .._call import AttentionCall
from ..capabilities import Capabilities
from ..cost import Work
from ..registry import Backend, Plan, register
from ._common import FUSED_ROWS
from ._cudnn import mute_in_second_order

#: documents whose lengths are within this fraction of a group's longest share one call
PAD_TOLERANCE = 0.1
#: torch ops per group: views or gathers, the kernel, the write into the output
GROUP_OPS, GATHER_OPS = 5, 10


def _segments(call: AttentionCall):
    """(starts (N_docs,), lengths (N_docs,)) host tensors in flattened ``b * S + s`` token
    offsets, from the mask's document runs (which it knows on the host when built from host
    ids or cu_seqlens; else reading them is a sync), or a reason this backend cannot run."""
    return call.memo("varlen_segments", lambda: _find_segments(call))


def _find_segments(call: AttentionCall):
    seg = call.effective_mask.segments(call.B)                       # (documents, 3) host
    if seg is None:
        return "needs document ids in contiguous runs (an id occurs in two separate places)"
    b, first, length = seg.unbind(1)
    return b * call.Sk + first, length


class Bucket(NamedTuple):
    """Documents run together, padded to ``length`` (``exact``: all have that length).

    The index tensors live on the host; ``run`` copies them to the device without a sync.
    """

    length: int
    starts: torch.Tensor          # (n,) first token of each document (flattened offsets)
    lengths: torch.Tensor         # (n,)
    exact: bool                   # every document has ``length`` tokens
    contiguous: bool              # exact, and back to back from ``first``: views, no gather
    first: int                    # the first document's start
    gather: torch.Tensor          # (n, length) token of each padded slot (a start if padding)
    keep: torch.Tensor            # (n, length) True where the slot holds a real token
    tokens: torch.Tensor          # (real tokens,) their flattened offsets
    slots: torch.Tensor           # (real tokens,) their slots in the (n * length) block


def _bucket(length: int, starts: torch.Tensor, lengths: torch.Tensor) -> Bucket:
    n = len(starts)
    exact = bool((lengths == length).all())
    host = starts.device                                                    # the runs: host
    contiguous = exact and bool((starts == starts[0] + length * torch.arange(n, device=host)).all())
    ar = torch.arange(length, device=host)
    keep = ar[None, :] < lengths[:, None]                                  # (n, L)
    gather = torch.where(keep, starts[:, None] + ar[None, :], starts[:, None])
    slots = (torch.arange(n, device=host)[:, None] * length + ar[None, :])[keep]  # (real,)
    return Bucket(length, starts, lengths, exact, contiguous, int(starts[0]), gather, keep,
                  gather[keep], slots)


def _group(starts, lengths, tolerance: float) -> list[Bucket]:
    """Cut documents (sorted longest first) into buckets padded by at most ``tolerance``."""
    ln, out, i = lengths.tolist(), [], 0
    while i < len(ln):
        j = i + 1
        while j < len(ln) and ln[j] >= ln[i] * (1 - tolerance):
            j += 1
        out.append(_bucket(ln[i], starts[i:j], lengths[i:j]))
        i = j
    return out


class Groups:
    """A call's buckets, and their index tensors per device (copied once, then reused: a
    cache, so not kept while a CUDA graph captures, and safe to read on other streams)."""

    def __init__(self, buckets: list[Bucket]):
        self.buckets, self._on = buckets, BoundedCache(4096, 64 << 20)

    def indices(self, i: int, device) -> tuple:
        """(gather, keep, tokens, slots) of bucket ``i`` on ``device``."""
        b = self.buckets[i]
        return self._on.get_or_compute((i, str(device)), lambda: tuple(
            to_device(t, device) for t in (b.gather, b.keep, b.tokens, b.slots)))


def _buckets(call: AttentionCall) -> list[Bucket]:
    """The documents' groups: equal lengths when each group is one contiguous slice, else
    lengths within PAD_TOLERANCE of each other (fewer, larger calls; gathered and padded).

    Documents packed longest first (what :meth:`multihead.models.Pretrained.embed` does) make every group of
    equal lengths one contiguous slice: the kernel then reads views, with no gather.
    """
    def compute():
        starts, lengths = _segments(call)
        order = torch.argsort(lengths, descending=True, stable=True)
        starts, lengths = starts[order], lengths[order]
        out = _group(starts, lengths, 0.0)
        return out if all(b.contiguous for b in out) else _group(starts, lengths, PAD_TOLERANCE)
    return call.memo("_varlen_buckets", compute)


class VarLen(Backend):
    name = "varlen"
    zero_rows_for_nan_scores = True         # torch's fused kernel (see nonfinite)
    summary = "packed documents: one fused SDPA call per group of equal-length documents"
    capabilities = Capabilities(masks=frozenset({"document"}), compositions=False,
                                cross_attention=False, dropout=True, traceable=False,
                                forward_ad=False, empty_vmap=False)

    def check(self, call):
        m = call.effective_mask
        if m is None:
            return "applies document masks only"
        if m.kv_ids is not None:
            return "does not take kv_ids (cross-attention between documents)"
        if m.runs_known:
            seg = _segments(call)
            return seg if isinstance(seg, str) else None
        return None

    def plan(self, call, profile):
        m = call.effective_mask
        if not m.runs_known:           # on a device: counting the documents would sync
            work = Work(flops=2.0 * call.pairs * (call.D + call.Dv), dtype=call.q.dtype,
                        bytes=3 * call.io_bytes(), launches=GATHER_OPS + GROUP_OPS, syncs=1)
            return Plan(work, f"document ids on {m.ids.device}: finding the documents reads "
                              f"them back (1 sync); build the mask from host ids or cu_seqlens")
        buckets = _buckets(call)
        H, D, Dv = call.H, call.D, call.Dv
        pairs = sum(len(b.starts) * b.length ** 2 for b in buckets) * H
        gathered = sum(len(b.starts) * b.length for b in buckets if not b.contiguous)
        pieces = sum(len(b.starts) * H * -(-b.length // FUSED_ROWS) for b in buckets)
        work = Work(flops=2.0 * pairs * (D + Dv),
                    kernel="fused" if all(b.exact for b in buckets) else "fused_masked",
                    dtype=call.q.dtype,
                    bytes=call.io_bytes() * (1 + 2 * gathered / max(call.B * call.Sq, 1)),
                    launches=sum(GROUP_OPS + (0 if b.contiguous else GATHER_OPS)
                                 for b in buckets),
                    parallel=pieces / max(len(buckets), 1))
        if call.requires_grad:
            work = work.times(flops=3.5, bytes=3.0, launches=2.0)
        _, lengths = _segments(call)
        padded = sum(len(b.starts) * b.length for b in buckets)
        return Plan(work, f"{counted(len(lengths), 'document')} in "
                          f"{counted(len(buckets), 'length group')}, "
                          f"{1 - int(lengths.sum()) / max(padded, 1):.1%} padding", Groups(buckets))

    def run(self, call, plan):
        groups = plan.detail
        if groups is None:             # the ids were on a device: read them now (a sync)
            seg = _segments(call)
            if isinstance(seg, str):
                raise ValueError(f"backend='varlen' cannot run this call: it {seg}")
            groups = Groups(_buckets(call))
        q, k, v = call.q, call.k, call.v
        B, H, Hkv, S, D, Dv = call.B, call.H, call.Hkv, call.Sq, call.D, call.Dv
        dev = q.device
        qf = q.transpose(1, 2).reshape(B * S, H, D)                    # (B*S, H, D)
        kf = k.transpose(1, 2).reshape(B * S, Hkv, D)                  # (B*S, Hkv, D)
        vf = v.transpose(1, 2).reshape(B * S, Hkv, Dv)                 # (B*S, Hkv, Dv)
        out = q.new_empty(B * S, H, Dv)                                # (B*S, H, Dv)
        for i, bucket in enumerate(groups.buckets):
            n, L = len(bucket.starts), bucket.length
            s0 = bucket.first
            if bucket.contiguous:      # n back-to-back documents of length L: views, no copies
                qg, kg, vg = (t[s0:s0 + n * L].view(n, L, t.shape[1], t.shape[2])
                              for t in (qf, kf, vf))                   # (n, L, heads, dim)
                keys = None
            else:
                gather, keep, tokens, slots = groups.indices(i, dev)
                qg, kg, vg = (t.index_select(0, gather.flatten()).view(n, L, t.shape[1], t.shape[2])
                              for t in (qf, kf, vf))                   # (n, L, heads, dim)
                keys = None if bucket.exact else keep[:, None, None, :]  # (n, 1, 1, L)
            og = F.scaled_dot_product_attention(
                qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2), attn_mask=keys,
                dropout_p=call.dropout_p, scale=call.scale,
                enable_gqa=True if H != Hkv else False)    # a bool, also where H is symbolic
                                                           # og: (n, H, L, Dv)
            mute_in_second_order(call, og)
            og = og.transpose(1, 2).reshape(n * L, H, Dv)              # (n*L, H, Dv)
            if bucket.contiguous:
                out[s0:s0 + n * L] = og
            else:
                out.index_copy_(0, tokens, og.index_select(0, slots))
        return out.view(B, S, H, Dv).transpose(1, 2), None, None       # (B, H, S, Dv)


register(VarLen())

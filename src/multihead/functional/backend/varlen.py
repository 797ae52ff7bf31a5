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

from .. import masks as M
from ._call import AttentionCall
from .registry import Backend, register

#: cost of one extra kernel launch and gather, in dense multiply-add units (2-core Xeon)
GROUP_OVERHEAD = 1.5e6
#: documents whose lengths are within this fraction of a group's longest share one call
PAD_TOLERANCE = 0.1


def _segments(call: AttentionCall):
    """(starts (N_docs,), lengths (N_docs,)) in flattened ``b * S + s`` token offsets, or a reason."""
    return call.memo("_varlen_segments", lambda: _find_segments(call))


def _find_segments(call: AttentionCall):
    m = call.effective_mask
    if not isinstance(m, M.Document) or m.kv_ids is not None:
        return "only runs a plain document mask (no kv_ids, no composition)"
    if call.Sq != call.Sk or call.Sk == 0:
        return f"needs Sq == Sk > 0 (got Sq={call.Sq}, Sk={call.Sk})"
    ids = m.ids.cpu()                                                   # (B', S)
    S = ids.shape[1]
    change = torch.ones_like(ids, dtype=torch.bool)                     # (B', S): a run starts
    change[:, 1:] = ids[:, 1:] != ids[:, :-1]
    runs = change.sum(dim=1)
    distinct = torch.tensor([row.unique().numel() for row in ids])
    if bool((runs != distinct).any()):
        return "document ids are not contiguous runs (an id occurs in two separate places)"
    starts, lengths = [], []
    for b in range(call.B):                          # ids hold 1 row (shared) or B rows
        r = b if ids.shape[0] > 1 else 0
        st = change[r].nonzero().flatten()                              # (runs,)
        ln = torch.diff(st, append=torch.tensor([S]))
        starts.append(st + b * S)
        lengths.append(ln)
    return torch.cat(starts), torch.cat(lengths)


class Bucket(NamedTuple):
    """Documents run together, padded to ``length`` (``exact``: all have that length)."""

    length: int
    starts: torch.Tensor
    lengths: torch.Tensor
    exact: bool
    contiguous: bool


def _group(starts, lengths, tolerance: float) -> list[Bucket]:
    """Cut documents (sorted longest first) into buckets padded by at most ``tolerance``."""
    ln, out, i = lengths.tolist(), [], 0
    while i < len(ln):
        j = i + 1
        while j < len(ln) and ln[j] >= ln[i] * (1 - tolerance):
            j += 1
        st, exact = starts[i:j], ln[j - 1] == ln[i]
        back_to_back = exact and bool((st == st[0] + ln[i] * torch.arange(j - i)).all())
        out.append(Bucket(ln[i], st, lengths[i:j], exact, back_to_back))
        i = j
    return out


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
    summary = "packed documents: one fused SDPA call per group of equal-length documents"
    traceable = False

    def unsupported(self, call):
        if call.return_weights:
            return "does not return attention weights"
        if call.return_lse:
            return "does not return the log-sum-exp"
        seg = _segments(call)
        return seg if isinstance(seg, str) else None

    def cost(self, call):
        pairs = sum(len(b.starts) * b.length ** 2 for b in _buckets(call))
        return pairs * call.H * (call.D + call.Dv) + GROUP_OVERHEAD * len(_buckets(call))

    def cost_note(self, call):
        _, lengths = _segments(call)
        buckets = _buckets(call)
        padded = sum(len(b.starts) * b.length for b in buckets)
        return (f"{len(lengths)} documents in {len(buckets)} length groups, "
                f"{1 - int(lengths.sum()) / padded:.1%} padding")

    def run(self, call):
        q, k, v = call.q, call.k, call.v
        B, H, Hkv, S, D, Dv = call.B, call.H, call.Hkv, call.Sq, call.D, call.Dv
        dev = q.device
        qf = q.transpose(1, 2).reshape(B * S, H, D)                    # (B*S, H, D)
        kf = k.transpose(1, 2).reshape(B * S, Hkv, D)                  # (B*S, Hkv, D)
        vf = v.transpose(1, 2).reshape(B * S, Hkv, Dv)                 # (B*S, Hkv, Dv)
        out = q.new_empty(B * S, H, Dv)                                # (B*S, H, Dv)
        for bucket in _buckets(call):
            n, L = len(bucket.starts), bucket.length
            s0 = int(bucket.starts[0])
            if bucket.contiguous:      # n back-to-back documents of length L: views, no copies
                qg, kg, vg = (t[s0:s0 + n * L].view(n, L, t.shape[1], t.shape[2])
                              for t in (qf, kf, vf))                   # (n, L, heads, dim)
                keys, flat, valid = None, None, None
            else:
                st, ln = bucket.starts.to(dev), bucket.lengths.to(dev)
                ar = torch.arange(L, device=dev)
                valid = ar[None, :] < ln[:, None]                      # (n, L)
                idx = torch.where(valid, st[:, None] + ar[None, :], st[:, None])  # (n, L)
                qg, kg, vg = (t.index_select(0, idx.flatten()).view(n, L, t.shape[1], t.shape[2])
                              for t in (qf, kf, vf))                   # (n, L, heads, dim)
                keys = None if bucket.exact else valid[:, None, None, :]  # (n, 1, 1, L)
                flat = idx[valid]                                      # (sum of lengths,)
            og = F.scaled_dot_product_attention(
                qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2), attn_mask=keys,
                dropout_p=call.dropout_p, scale=call.scale, enable_gqa=H != Hkv)  # (n, H, L, Dv)
            og = og.transpose(1, 2)                                    # (n, L, H, Dv)
            if flat is None:
                out[s0:s0 + n * L] = og.reshape(n * L, H, Dv)
            else:
                out.index_copy_(0, flat, og[valid])
        return out.view(B, S, H, Dv).transpose(1, 2), None, None       # (B, H, S, Dv)


register(VarLen())

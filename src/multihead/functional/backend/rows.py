"""The rows backend: materialized scores one sequence at a time, cropped to its live keys.

The quick way to get the attention weights on a CPU. Like ``reference`` it materializes
scores and returns weights and lse, but for each batch row it computes only the span of
keys the mask leaves that row (a padded batch's real keys), runs GQA on the K/V heads in
place (the group's query heads share one matmul, no ``repeat_interleave``), and works in
place on one row's scores at a time (in the returned weights, where they are asked for in
the dtype it computes in), applying the mask only where it rules something out in that
row's span. Forward only: a call that needs gradients goes to ``reference``. A mask on
the host is evaluated one batch row at a time, on that row's span (its spans come from the
mask's tile bounds, one tile of all queries per key): a mask that varies by query
(query-side padding) is never held as ``(B, H', Sq, Sk)``. A mask on a device is
materialized once and read back to find the spans, so on a GPU it prices itself out.

Notation used for tensor shapes: B batch, H heads, Hkv K/V heads, G = H / Hkv, Sq queries,
Sk keys, L a row's live keys.
"""

from __future__ import annotations

import torch

from ...masks.base import Index, axis_range, bias_as
from ...masks.structured import true_span
from ..capabilities import Capabilities
from ..cost import Work, share
from ..registry import Backend, Plan, register
from . import _tiles
from ._common import mask_launches, mask_terms
from .reference import softmax_

#: fp32 passes over one row's scores (matmul out, scale, bias, mask, softmax, copy out)
SCORE_PASSES = 8
#: torch ops per batch row
ROW_OPS = 10


def _spans(allowed: torch.Tensor | None, B: int, Sk: int) -> list[tuple[int, int]]:
    """Each batch row's ``[first, last + 1)`` of keys any query may attend (one host read)."""
    if allowed is None:
        return [(0, Sk)] * B
    first, end = true_span(allowed.any(2).any(1).expand(B, Sk).cpu())           # (B,)
    return list(zip(first.tolist(), end.tolist()))


def _host_bounds(call) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each mask batch row's ``[first, end)`` of keys some query may attend ``(Bm,)``, and
    whether every query may attend every key in it (the predicate rules nothing out there),
    from the host tile map of one tile of all queries by one key (a mask on the host, Sq and
    Sk above 0)."""
    nonempty, full, _ = _tiles._classify(call, call.Sq, 1, 1, call.Sk, "cpu")  # (Bm, 1, Sk)
    first, end = true_span(nonempty[:, 0])                              # (Bm,) keys
    # keys outside the span are empty (not full), so the span is all full when the full
    # keys are as many as the span's
    whole = full[:, 0].sum(-1) == end - first                           # (Bm,)
    return first, end, whole


def _live_fraction(call) -> float:
    """Share of the keys the crop keeps, key by key (1.0 where unknown)."""
    if call.effective_mask is None or not _tiles.on_host(call) or call.Sk == 0 or call.Sq == 0:
        return 1.0
    first, end, _ = _host_bounds(call)
    return float((end - first).float().mean()) / call.Sk


def _row(x: torch.Tensor | None, b: int, lo: int, hi: int):
    """Batch row ``b`` of a broadcastable ``(B', H', Sq, Sk)`` mask term, keys ``lo:hi``."""
    return None if x is None else x[b if x.shape[0] > 1 else 0, :, :, lo:hi]


def _row_terms(call, device):
    """``(spans, terms)``: each batch row's ``[lo, hi)`` of live keys, and ``terms(b, lo,
    hi)``: that row's ``(allowed, bias)`` on those keys, ``(H', Sq, L)`` or None. A mask on
    the host is evaluated row by row (its spans from the tile bounds); one on a device once,
    whole (a host read finds the spans)."""
    m = call.effective_mask
    if m is None or not _tiles.on_host(call) or not m.has_predicate or not call.Sq * call.Sk:
        allowed, bias = mask_terms(call, device)
        return (_spans(allowed, call.B, call.Sk),
                lambda b, lo, hi: (_row(allowed, b, lo, hi), _row(bias, b, lo, hi)))
    first, end, whole = (t.expand(call.B) for t in _host_bounds(call))      # (B,)
    whole = whole.tolist()
    ix = m._index_grid(call.Sq, 1, device, call.compute_dtype)               # (B', H', Sq, 1)
    rows = ix.b.shape[0]

    def terms(b: int, lo: int, hi: int):
        row = b if rows > 1 else 0
        at = Index(axis_range(row, row + 1, 0, device), ix.h, ix.q,
                   axis_range(lo, hi, 3, device),                            # (1, 1, 1, L)
                   call.Sq, call.Sk, call.compute_dtype)
        # a row whose span the predicate leaves whole (padding, where it crops): bias only
        found = ((None, m._bias(at) if m.has_bias else None) if whole[b] else m.at(at))
        return tuple(t[0] if t is not None and t.dim() == 4 else t          # (H', Sq, L)
                     for t in found)
    return list(zip(first.tolist(), end.tolist())), terms


class Rows(Backend):
    name = "rows"
    summary = "materialized scores one sequence at a time, cropped to its live keys; weights"
    capabilities = Capabilities(weights=True, lse=True, backward=False, traceable=False,
                                transforms=False)

    def plan(self, call, profile):
        size = call.compute_dtype.itemsize
        frac = _live_fraction(call)
        pairs = call.pairs * frac
        # each sequence's scores and weights (H, Sq, L): new buffers (an average sequence's;
        # from 1 MiB on, where a host allocator may map them fresh), unless computed in the
        # returned weights (then nothing is copied out either)
        seq = size * pairs / max(call.B, 1)
        in_place = call.return_weights and call.q.dtype == call.compute_dtype
        copied = call.return_weights and not in_place
        work = Work(flops=2.0 * pairs * (call.D + call.Dv), kernel="matmul",
                    dtype=call.compute_dtype,
                    bytes=SCORE_PASSES * size * pairs + call.io_bytes()
                    + (size * call.pairs if copied else 0),                 # weights copied
                    launches=4 + ROW_OPS * call.B + mask_launches(call),
                    syncs=0 if call.effective_mask is None or profile.device_type == "cpu" else 1,
                    memory=3 * seq,
                    fresh=(seq,) * (2 * call.B) if seq >= 1 << 20 and not in_place else ())
        return Plan(work, f"computes {share(frac)} of the keys, one sequence at a time")

    def run(self, call, plan):
        B, H, Hkv, Sq, Sk, G = call.B, call.H, call.Hkv, call.Sq, call.Sk, call.group
        work = call.compute_dtype
        q, k, v = call.q.to(work), call.k.to(work), call.v.to(work)
        spans, terms = _row_terms(call, q.device)
        out = q.new_zeros(B, H, Sq, call.Dv)
        weights = (call.q.new_empty(B, H, Sq, Sk) if call.return_weights    # each byte once,
                   else None)                                            # in the inputs' dtype
        lse = q.new_full((B, H, Sq), float("-inf")) if call.return_lse else None
        # the scores are computed in the weights where the dtypes agree: no copy out, and no
        # fresh buffer per row (whose first touch faults on a CPU)
        in_place = weights is not None and weights.dtype == work
        for b, (lo, hi) in enumerate(spans):
            if weights is not None:                                    # zeros outside the span
                weights[b, :, :, :lo].zero_()
                weights[b, :, :, hi:].zero_()
            if hi == lo:
                continue                                               # a row sees nothing
            qb = q[b].reshape(Hkv, G * Sq, call.D)                     # (Hkv, G·Sq, D)
            kt = k[b, :, lo:hi].transpose(1, 2)                        # (Hkv, D, L)
            if in_place:
                s = weights[b, :, :, lo:hi]                            # (H, Sq, L), strided
                torch.bmm(qb, kt, out=s.view(Hkv, G * Sq, hi - lo))    # (Hkv, G·Sq, L)
            else:
                s = torch.bmm(qb, kt).view(H, Sq, hi - lo)             # (H, Sq, L)
            s.mul_(call.scale)
            ab, bb = terms(b, lo, hi)
            if bb is not None:
                s += bias_as(bb, work)
            if ab is not None:
                s.masked_fill_(~ab, float("-inf"))
            lse_b = softmax_(s)                        # s: the weights (H, Sq, L); a row
            if lse is not None:                        # that sees nothing: zeros, lse -inf
                lse[b] = lse_b
            ob = torch.bmm(s.view(Hkv, G * Sq, hi - lo), v[b, :, lo:hi])  # (Hkv, G·Sq, Dv)
            out[b] = ob.view(H, Sq, call.Dv)
            if weights is not None and not in_place:
                weights[b, :, :, lo:hi] = s
        return out.to(call.q.dtype), weights, lse


register(Rows())

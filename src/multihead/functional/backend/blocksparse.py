"""The blocksparse backend: tiled online softmax (FlashAttention's algorithm) in PyTorch ops.

Query tiles visit only the key tiles the mask does not rule out (see ``_tiles.py``); the
mask is evaluated only on partial tiles; the softmax is accumulated online (running max
``m``, running sum ``l``) so no ``(Sq, Sk)`` matrix ever exists. Many tiles are batched into
each matmul, so the Python loop runs a handful of steps per chunk of query tiles.

Backward recomputes the scores tile by tile from the saved log-sum-exp (a custom
autograd Function), so training memory stays O(S * tile), not O(S^2); one that builds a
graph (``create_graph=True``) gets the reference's gradients instead, which differentiate
again (:mod:`multihead._second_order`). A row whose every
visible score carries a huge finite bias has an lse too large to also hold ``log l`` (see
:mod:`multihead.kernels._exact_rows`): the forward saves such a row's ``(m, log l)`` for
the backward, which rebuilds its weights as ``exp(s - m) · exp(-log l)``.

Limits and caveats:
- no dropout (use ``sdpa`` or ``reference``); no gradient w.r.t. a ``bias`` tensor;
- half-precision inputs are computed in float32 and cast back (exact, not fast, on CPU);
- cost follows the mask's *tile* density: a pattern scattered over every tile gains nothing;
- on the CPU each thread keeps its scratch buffers between calls (up to
  :data:`KEEP_BYTES` per dtype), so that they are not mapped and page-faulted anew;
  ``mh.functional.dispatch.clear_cache()`` frees them.

Notation: B batch, H query heads, Hkv K/V heads, G = H // Hkv, nQc query tiles of a chunk,
tq/tk tile sizes, W key tiles in a step, L = W * tk keys in a step, R = nQc * G * tq rows.
"""

from __future__ import annotations

import contextlib
import threading
import weakref

import torch
import torch.nn.functional as F

from ..._cache import BoundedCache
from ..._dtypes import without_autocast
from ... import _second_order as second_order
from ...masks.base import Index, bias_as, versioned
from .._call import AttentionCall
from ..capabilities import Capabilities
from ..cost import Work, share
from ..registry import Backend, Plan, register
from . import _blocksparse_op, _tiles
from ._common import HUGE_LSE
from ._tiles import Step, make_plan
from ..._tracing import tracing

NEG_INF = float("-inf")


class _Geo:
    """Sizes of one call, shared by forward and backward (not the call: its q, k, v are
    the Function's saved tensors, freed after the backward while the output lives on)."""

    def __init__(self, call: AttentionCall, plan: _tiles.Plan):
        self.plan = plan
        self.B, self.H, self.Hkv, self.G = call.B, call.H, call.Hkv, call.group
        self.D, self.Dv, self.Sq, self.Sk = call.D, call.Dv, call.Sq, call.Sk
        self.tq, self.tk, self.nq, self.nk = plan.tq, plan.tk, plan.nq, plan.nk
        self.mask = call.effective_mask
        # the mask's tensors as the forward read them (the backward evaluates it again)
        self.versions = self.mask._versions() if self.mask is not None else None


class _Workspace:
    """Reusable scratch buffers: fresh large allocations page-fault on every step on CPU.
    Nothing returned to a caller lives in them (every result is a new tensor)."""

    def __init__(self, dtype: torch.dtype, device: torch.device):
        self.dtype, self.device, self.bufs = dtype, device, {}

    def get(self, name: str, shape) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        buf = self.bufs.get(name)
        if buf is None or buf.numel() < n:
            with versioned():                  # (a normal tensor: kept for calls outside
                buf = self.bufs[name] = torch.empty(n, dtype=self.dtype,   # inference mode)
                                                    device=self.device)
        return buf[:n].view(shape)

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.bufs.values())


#: the most scratch bytes a thread keeps between calls on the CPU, per dtype: a step's
#: buffers of a few MiB are mapped fresh by glibc on a call and page-fault as they are
#: written (0.25 ns a byte); a kept workspace is written in place. A GPU's caching
#: allocator keeps its memory already.
KEEP_BYTES = 64 << 20
_KEPT = threading.local()


class _Kept(dict):
    """A thread's kept workspaces by dtype (freed with the thread); one object, compared
    and hashed as itself (in :data:`_EVERY_KEPT`)."""

    __eq__, __hash__ = object.__eq__, object.__hash__


_EVERY_KEPT: "weakref.WeakSet[_Kept]" = weakref.WeakSet()


def release_workspaces() -> None:
    """Free the scratch every thread keeps between calls (a workspace in use is kept
    again when its call ends). :func:`multihead.functional.dispatch.clear_cache` calls it.

    Example:
        >>> release_workspaces()
    """
    for kept in list(_EVERY_KEPT):
        kept.clear()


@contextlib.contextmanager
def _workspace(like: torch.Tensor):
    """A workspace for one forward or backward: this thread's kept one for ``like``'s dtype
    on the CPU (taken while in use: a call made meanwhile, by a hook say, gets its own),
    else a new one."""
    if like.device.type != "cpu":
        yield _Workspace(like.dtype, like.device)
        return
    kept = getattr(_KEPT, "by_dtype", None)
    if kept is None:
        kept = _KEPT.by_dtype = _Kept()
        _EVERY_KEPT.add(kept)
    ws = kept.pop(like.dtype, None) or _Workspace(like.dtype, like.device)
    try:
        yield ws
    finally:
        if ws.nbytes <= KEEP_BYTES:
            kept[like.dtype] = ws


def _pad_seq(x: torch.Tensor, n: int) -> torch.Tensor:
    """Zero-pad dim 2 of (B, H, S, D) to length n; contiguous."""
    if x.shape[2] == n:
        return x.contiguous()
    return F.pad(x, (0, 0, 0, n - x.shape[2]))


def _heads6(t: torch.Tensor, g: _Geo) -> torch.Tensor:
    """(Bx, 1|H, nQc, tq|1, L) -> (Bx, 1|Hkv, nQc, 1|G, tq|1, L), matching folded scores."""
    if t.shape[1] == 1:
        return t.unsqueeze(3)
    return t.view(t.shape[0], g.Hkv, g.G, *t.shape[2:]).permute(0, 1, 3, 2, 4, 5)


def _mask_step(s: torch.Tensor, g: _Geo, i0: int, i1: int, step: Step):
    """Add the bias and the mask (as 0 / -inf) in place to scores s (B, Hkv, nQc, G*tq, L).

    Returns a broadcastable float 0/1 "keep" tensor for masked steps (None otherwise), so
    the caller zeroes masked weights exactly after the exponential. Both are small
    (nQc, tq, L) tensors broadcast over batch and heads: a broadcast add/mul is ~20x
    faster on CPU than masked_fill with a broadcast bool mask.
    """
    m = g.mask
    has_bias = m is not None and m.has_bias
    if not (step.masked or has_bias):
        return None
    dev, W = s.device, step.idx.shape[-1]
    nqc, L = i1 - i0, W * g.tk
    qpos = torch.arange(i0 * g.tq, i1 * g.tq, device=dev).view(1, 1, nqc, g.tq, 1)
    kpos = (step.idx.unsqueeze(-1) * g.tk + torch.arange(g.tk, device=dev))  # (Bm, nQc, W, tk)
    kpos = kpos.view(-1, 1, nqc, 1, L)                                        # (Bm, 1, nQc, 1, L)
    if m is not None:
        ix = Index(b=torch.arange(m.batch_size or 1, device=dev).view(-1, 1, 1, 1, 1),
                   h=torch.arange(m.num_heads or 1, device=dev).view(1, -1, 1, 1, 1),
                   q=qpos.clamp(max=g.Sq - 1), k=kpos.clamp(max=g.Sk - 1), sq=g.Sq, sk=g.Sk,
                   dtype=s.dtype)
    allowed = m._allowed(ix) if step.masked and m is not None and m.has_predicate else None
    bias = m._bias(ix) if has_bias else None        # a full step needs only the bias
    add = bias_as(bias, s.dtype) if bias is not None else None    # (Bx, 1|H, nQc, tq|1, L)
    keep = None
    if step.masked:
        ok = (kpos < g.Sk) & step.valid.repeat_interleave(g.tk, dim=-1).view(-1, 1, nqc, 1, L)
        if allowed is not None:
            ok = ok & allowed
        if add is None:
            add = torch.zeros(ok.shape, dtype=s.dtype, device=dev).masked_fill_(~ok, NEG_INF)
        else:     # (a hidden NaN or +inf of a bias written since it was built: -inf, not NaN)
            add = torch.where(ok, add, NEG_INF)
        keep = _heads6(ok.to(s.dtype), g)                     # (Bx, Hkv|1, nQc, G|1, tq|1, L)
    s.view(g.B, g.Hkv, nqc, g.G, g.tq, L).add_(_heads6(add, g))
    return keep


def _exp_(s: torch.Tensor, shift: torch.Tensor, keep, g: _Geo) -> torch.Tensor:
    """In place: exp(s - shift), exactly 0 where masked.

    The shifted scores are clamped at -80 first: exp of inputs that underflow (or are
    -inf) takes a slow path on x86 CPUs, ~100x slower; exp(-80) = 1.8e-35 is negligible
    next to the row maximum's 1, and masked entries are then zeroed exactly by ``keep``.
    """
    p = s.sub_(shift).clamp_(min=-80.0).exp_()
    if keep is not None:
        p.view(*p.shape[:3], g.G, g.tq, p.shape[-1]).mul_(keep)
    return p


def _gather(kp: torch.Tensor, step: Step, g: _Geo, ws: _Workspace, name: str):
    """Key (or value) tiles of a step.

    Returns (tiles, flat): shared steps give (B, Hkv, L, Dx), others (B, Hkv, nQc, L, Dx);
    ``flat`` are the row indices into kp viewed as (B*Hkv*nK, tk, Dx) (None for a slice).
    """
    W, dx = step.idx.shape[-1], kp.shape[-1]
    L = W * g.tk
    if step.first is not None:                                    # consecutive: a view
        a = step.first * g.tk
        return kp[:, :, a:a + L], None
    flat_kp = kp.view(g.B * g.Hkv * g.nk, g.tk, dx)
    base = (torch.arange(g.B * g.Hkv, device=kp.device) * g.nk).view(g.B, g.Hkv, 1, 1)
    if step.shared:
        flat = (base + step.idx[0, 0].view(1, 1, 1, W)).reshape(-1)          # (B*Hkv*W)
        shape = (g.B, g.Hkv, L, dx)
    else:
        flat = (base + step.idx.unsqueeze(1)).reshape(-1)                   # (B*Hkv*nQc*W)
        shape = (g.B, g.Hkv, step.idx.shape[1], L, dx)
    out = ws.get(name, (len(flat), g.tk, dx))
    torch.index_select(flat_kp, 0, flat, out=out)
    return out.view(shape), flat


def _mm(a: torch.Tensor, b: torch.Tensor, shared: bool, out: torch.Tensor | None = None):
    """a (B, Hkv, nQc, rows, x) @ b; for shared steps b is (B, Hkv, x, y) for every tile."""
    B, Hkv, nqc, rows, x = a.shape
    if not shared:
        return torch.matmul(a, b, out=out) if out is not None else a @ b
    a2 = a.reshape(B, Hkv, nqc * rows, x)
    res = torch.matmul(a2, b, out=out.view(B, Hkv, nqc * rows, b.shape[-1])) if out is not None else a2 @ b
    return res.view(B, Hkv, nqc, rows, b.shape[-1])


def _scores(qc, kg, step, g: _Geo, ws: _Workspace, i0: int, i1: int):
    """Masked, biased scores of a step in a workspace buffer: (B, Hkv, nQc, G*tq, L),
    and the step's keep tensor (see _mask_step)."""
    L = step.idx.shape[-1] * g.tk
    buf = ws.get("s", (g.B, g.Hkv, i1 - i0, g.G * g.tq, L))
    s = _mm(qc, kg.transpose(-1, -2), step.shared, out=buf)
    return s, _mask_step(s, g, i0, i1, step)


def _chunk_q(q6: torch.Tensor, g: _Geo, i0: int, i1: int, scale: float) -> torch.Tensor:
    """Scaled rows of a chunk of q (or dout), folded: (B, Hkv, nQc, G*tq, D|Dv)."""
    qc = q6[:, :, :, i0:i1] * scale                               # (B, Hkv, G, nQc, tq, D)
    return qc.permute(0, 1, 3, 2, 4, 5).reshape(g.B, g.Hkv, i1 - i0, g.G * g.tq, qc.shape[-1])


def _forward(g: _Geo, q, k, v, scale):
    B, Hkv, G, nq, tq = g.B, g.Hkv, g.G, g.nq, g.tq
    q6 = _pad_seq(q, nq * tq).view(B, Hkv, G, nq, tq, g.D)       # (B, Hkv, G, nQ, tq, D)
    kp, vp = _pad_seq(k, g.nk * g.tk), _pad_seq(v, g.nk * g.tk)  # (B, Hkv, nK*tk, D|Dv)
    out = q.new_zeros(B, g.H, nq * tq, g.Dv)
    # per row: the lse, and the (hi, lo) the backward shifts the scores by (see _split)
    rows = q.new_full((3, B, g.H, nq * tq), NEG_INF)
    rows[2].zero_()                       # lo: 0 also in rows no step reaches (c = 1)
    out6 = out.view(B, Hkv, G, nq, tq, g.Dv)                      # (B, Hkv, G, nQ, tq, Dv)
    rows6 = rows.view(3, B, Hkv, G, nq, tq)
    with _workspace(q) as ws:
        for chunk in g.plan.chunks:
            if not chunk.steps:
                continue
            i0, i1 = chunk.i0, chunk.i1
            qc = _chunk_q(q6, g, i0, i1, scale)                       # (B, Hkv, nQc, G*tq, D)
            m = l = acc = None
            for step in chunk.steps:
                kg, _ = _gather(kp, step, g, ws, "k")
                vg, _ = _gather(vp, step, g, ws, "v")
                s, keep = _scores(qc, kg, step, g, ws, i0, i1)        # (B, Hkv, nQc, G*tq, L)
                mx = s.amax(dim=-1, keepdim=True)
                m_new = mx if m is None else torch.maximum(m, mx)
                m_safe = m_new.masked_fill(m_new == NEG_INF, 0.0)     # empty rows: shift by 0
                p = _exp_(s, m_safe, keep, g)
                pv = _mm(p, vg, step.shared, out=ws.get("pv", (*p.shape[:4], g.Dv)))
                if m is None:                                         # pv: (B, Hkv, nQc, G*tq, Dv)
                    l, acc = p.sum(dim=-1, keepdim=True), pv.clone()
                else:
                    alpha = (m - m_safe).exp_()
                    l = l.mul_(alpha).add_(p.sum(dim=-1, keepdim=True))
                    acc = acc.mul_(alpha).add_(pv)
                m = m_new
            empty = m == NEG_INF            # no finite score: zeros and lse -inf (a score of
            m_safe = m.masked_fill(empty, 0.0)  # -inf from an infinite key has weight 0, though
            l = l.masked_fill(empty, 0.0)       # its exp was clamped at -80)
            res = acc.masked_fill_(empty, 0.0) / l.masked_fill(l == 0, 1.0)
            shape6 = (B, Hkv, i1 - i0, G, tq)
            out6[:, :, :, i0:i1] = res.view(*shape6, g.Dv).permute(0, 1, 3, 2, 4, 5)
            stats = torch.stack(_split(m_safe, l.log()))              # (3, B, Hkv, nQc, G*tq, 1)
            rows6[:, :, :, :, i0:i1] = stats.view(3, *shape6).permute(0, 1, 2, 4, 3, 5)
    return out[:, :, :g.Sq], rows[..., :g.Sq]


def _split(m: torch.Tensor, log_l: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``(lse, hi, lo)`` of rows from their maximum and log-sum: ``(lse, m, log l)`` where
    ``|lse|`` reaches :data:`HUGE_LSE` (``m + log l`` may have lost ``log l``), else
    ``(lse, lse, 0)``, which the backward uses as before."""
    lse = m + log_l
    huge = (lse.abs() >= HUGE_LSE) & lse.isfinite()
    return lse, torch.where(huge, m, lse), torch.where(huge, log_l, 0.0)


def _backward(g: _Geo, q, k, v, out, hi, lo, dout, dlse, scale):
    # The weights are exp(s - hi) * c with c = exp(-lo) per row (1 but where _split kept
    # log l apart): c scales the rows of dO and delta, so dV = exp(s - hi)ᵀ (c dO) and
    # dS = exp(s - hi) * (c dP - c delta), with no pass over the scores.
    B, Hkv, G, nq, tq, nk, tk = g.B, g.Hkv, g.G, g.nq, g.tq, g.nk, g.tk
    q6 = _pad_seq(q, nq * tq).view(B, Hkv, G, nq, tq, g.D)
    c = lo.neg().exp_().unsqueeze(-1)                              # (B, H, Sq, 1)
    delta = (dout * out).sum(-1, keepdim=True)                     # (B, H, Sq, 1)
    if dlse is not None:
        delta = delta - dlse.unsqueeze(-1)                        # d lse / d s = p
    delta = (delta * c).squeeze(-1)                               # (B, H, Sq)
    do6 = _pad_seq(dout * c, nq * tq).view(B, Hkv, G, nq, tq, g.Dv)
    lse_safe = hi.masked_fill(hi == NEG_INF, float("inf"))        # empty rows: p = 0
    pad_rows = nq * tq - g.Sq
    lse6 = F.pad(lse_safe, (0, pad_rows), value=float("inf")).view(B, Hkv, G, nq, tq)
    dl6 = F.pad(delta, (0, pad_rows)).view(B, Hkv, G, nq, tq)
    kp, vp = _pad_seq(k, nk * tk), _pad_seq(v, nk * tk)
    dq = torch.zeros_like(q6)                                     # (B, Hkv, G, nQ, tq, D)
    dk, dv = torch.zeros_like(kp), torch.zeros_like(vp)           # (B, Hkv, nK*tk, D|Dv)
    with _workspace(q) as ws:
        for chunk in g.plan.chunks:
            i0, i1 = chunk.i0, chunk.i1
            nqc = i1 - i0
            qc = _chunk_q(q6, g, i0, i1, scale)                       # (B, Hkv, nQc, G*tq, D)
            doc = _chunk_q(do6, g, i0, i1, 1.0)                       # (B, Hkv, nQc, G*tq, Dv)
            fold = lambda t: t[:, :, :, i0:i1].permute(0, 1, 3, 2, 4).reshape(
                B, Hkv, nqc, G * tq, 1)                           # (B, Hkv, nQc, G*tq, 1)
            lse_c, dl_c = fold(lse6), fold(dl6)
            dq_c = None
            for step in chunk.steps:
                kg, flat = _gather(kp, step, g, ws, "k")
                vg, _ = _gather(vp, step, g, ws, "v")
                s, keep = _scores(qc, kg, step, g, ws, i0, i1)        # (B, Hkv, nQc, G*tq, L)
                p = _exp_(s, lse_c, keep, g)                           # the forward's weights
                dp = _mm(doc, vg.transpose(-1, -2), step.shared, out=ws.get("dp", p.shape))
                ds = dp.sub_(dl_c).mul_(p)                            # (B, Hkv, nQc, G*tq, L)
                part = _mm(ds, kg, step.shared)                       # (B, Hkv, nQc, G*tq, D)
                dq_c = part if dq_c is None else dq_c.add_(part)
                _scatter(dv, _tmm(p, doc, step.shared), step, flat, g)
                _scatter(dk, _tmm(ds, qc, step.shared), step, flat, g)
            if dq_c is not None:
                dq[:, :, :, i0:i1] = dq_c.view(B, Hkv, nqc, G, tq, g.D).permute(0, 1, 3, 2, 4, 5)
    dq = dq.view(B, g.H, nq * tq, g.D)[:, :, :g.Sq] * scale
    return dq, dk[:, :, :g.Sk], dv[:, :, :g.Sk]


def _tmm(a: torch.Tensor, b: torch.Tensor, shared: bool) -> torch.Tensor:
    """aᵀ @ b per tile: (.., rows, L)ᵀ @ (.., rows, x); shared steps sum over the chunk's tiles."""
    if not shared:
        return a.transpose(-1, -2) @ b                            # (B, Hkv, nQc, L, x)
    B, Hkv, nqc, rows, L = a.shape
    a2 = a.reshape(B, Hkv, nqc * rows, L)
    return a2.transpose(-1, -2) @ b.reshape(B, Hkv, nqc * rows, b.shape[-1])  # (B, Hkv, L, x)


def _scatter(dst: torch.Tensor, part: torch.Tensor, step: Step, flat, g: _Geo) -> None:
    """Accumulate per-tile gradients into dst (B, Hkv, nK*tk, x)."""
    if step.first is not None:
        a = step.first * g.tk
        dst[:, :, a:a + part.shape[-2]] += part
        return
    x = dst.shape[-1]
    dst.view(-1, g.tk, x).index_add_(0, flat, part.reshape(-1, g.tk, x))


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, geo, scale):
        out, (lse, hi, lo) = _forward(geo, q, k, v, scale)
        out = out.contiguous()
        lse = lse.contiguous()
        ctx.geo, ctx.scale = geo, scale
        ctx.set_materialize_grads(False)      # None: an output nothing flows from
        ctx.save_for_backward(q, k, v, out, hi, lo)
        return out, lse

    @staticmethod
    @without_autocast
    def backward(ctx, dout, dlse):
        if dout is None and dlse is None:     # neither output used
            return None, None, None, None, None
        q, k, v, out, hi, lo = ctx.saved_tensors
        g = ctx.geo
        if torch.is_grad_enabled():           # create_graph=True: gradients that can be
            spec = second_order.spec(g.mask, ctx.scale, "blocksparse", g.versions)
            return (*second_order.reference_gradients(        # differentiated again
                spec, (q, k, v), (dout, dlse), ctx.needs_input_grad[:3]), None, None)
        if g.mask is not None:
            g.mask._check_unchanged(g.versions, "blocksparse backward")
        if dout is None:
            dout = torch.zeros_like(out)
        dq, dk, dv = _backward(g, q, k, v, out, hi, lo, dout.contiguous(), dlse, ctx.scale)
        return dq, dk, dv, None, None

    @staticmethod
    def jvp(ctx, *tangents):
        raise RuntimeError("the blocksparse backend gives no forward-mode derivatives (jvp, "
                           "jacfwd, dual tensors): pass backend='reference'")


#: per (query, key) pair the kernel computes: fp32 bytes of its elementwise passes over the
#: scores (scale, max, exp, sum, the weights' matmul), and more where the mask is evaluated
#: (measured per masked pair, in bytes' time at 20 GB/s: padding 3-5 more, a dense mask
#: 14-17, ALiBi 12-21; 2-core AMD EPYC, S = 512-2048)
PAIR_BYTES, MASKED_PAIR_BYTES = 8, 20
#: per mask entry a step gathers from a tensor mask (4-D advanced indexing on the step's
#: tile positions: 2.7 ns an entry on a 2-core AMD EPYC, 54 bytes' time at 20 GB/s): a
#: bias's on every step, and again for its -inf on masked steps; a dense mask's on masked
#: steps; as many entries as the mask has own batch and head dims (a shared one broadcasts)
GATHER_BYTES = 54
#: torch ops a step launches (gathers, matmuls, online softmax), more where it is masked,
#: and per chunk of query tiles (slicing, folding, the final division and writes)
STEP_OPS, MASKED_STEP_OPS, CHUNK_OPS = 22, 16, 12


def _tensor_reads(call: AttentionCall, est: _tiles.Estimate) -> float:
    """Bytes' time of the entries the steps gather from the mask's tensors."""
    m = call.effective_mask
    if m is None:
        return 0.0
    reads = sum(est.pairs + est.masked_pairs if leaf.kind == "bias" else
                est.masked_pairs if leaf.kind == "dense" else 0 for leaf in m.leaves())
    own = (m.batch_size or 1) * (m.num_heads or 1) / (call.B * call.H)
    return GATHER_BYTES * own * reads


def _work(call: AttentionCall, est: _tiles.Estimate) -> Work:
    """The kernel's work, from the counts of its plan."""
    D, Dv = call.D, call.Dv
    size = call.compute_dtype.itemsize
    m = call.effective_mask
    bias = m is not None and m.has_bias                  # the bias is evaluated on every step
    masked, evaluated = (est.pairs, est.steps) if bias else (est.masked_pairs, est.masked_steps)
    convert = call.io_bytes() * (2 if call.compute_dtype != call.q.dtype else 0)
    gathered = 2 * call.B * call.Hkv * est.gathered_tiles * _tiles.tile_sizes(call)[1] \
        * (D + Dv) * size
    work = Work(flops=2.0 * est.pairs * (D + Dv), kernel="tiles", dtype=call.compute_dtype,
                bytes=PAIR_BYTES * (est.pairs - masked) + MASKED_PAIR_BYTES * masked + gathered
                + _tensor_reads(call, est) + convert + call.io_bytes(),
                launches=10 + est.chunks * CHUNK_OPS + est.steps * STEP_OPS
                + evaluated * MASKED_STEP_OPS,
                syncs=0 if est.exact else 2,             # (make_plan: counts, steps)
                memory=4 * _tiles.BUDGET * size)
    if call.requires_grad:
        work = work.times(flops=2.5, bytes=2.5, launches=2.2)
    return work


class BlockSparse(Backend):
    name = "blocksparse"
    summary = "tiled online softmax that skips the tiles a mask rules out; returns lse"
    capabilities = Capabilities(lse=True, transforms=False, forward_ad=False, second_order=True)

    def check(self, call):
        if tracing():                               # traced: as one operator, for the
            band = _blocksparse_op.band_of(call)    # masks that travel as its arguments
            return band if isinstance(band, str) else None
        m = call.effective_mask
        if call.q.device.type == "meta" and m is not None and not m.on_host:
            return "plans its tiles from the mask's values, which meta tensors do not have"
        return None

    def plan(self, call, profile):
        if tracing():
            band = _blocksparse_op.band_of(call)
            est = _blocksparse_op.estimate(call, band)
            work = _work(call, est)
            note = ("traced as the operator multihead.blocksparse: its tiles are planned when "
                    "it runs, so one graph serves every length (priced from the band's reach "
                    "at the traced sizes; under Dynamo, a window takes it unpriced)")
            return Plan(work, note, band, traced_choice=torch.compiler.is_dynamo_compiling())
        est = _tiles.estimate(call)
        work = _work(call, est)
        if est.exact:
            note = f"computes {share(est.density)} of the tiles" + (
                f" ({share(est.allowed)} hold pairs the mask allows; every query tile of a "
                f"chunk visits as many key tiles as the chunk's busiest one)"
                if share(est.allowed) != share(est.density) else "")
        else:
            note = (f"the mask's tiles are on {call.q.device}: planning reads them back "
                    f"({work.syncs} syncs); estimated as if every tile were computed")
        # the step plan is built by the first run, then kept (a cache: not while a graph
        # captures, and safe to read on other streams)
        return Plan(work, note, BoundedCache(1, 256 << 20))

    def run(self, call, plan):
        work = call.compute_dtype                   # (half precision computed in fp32)
        q, k, v = (t.to(work) for t in (call.q, call.k, call.v))
        if tracing():
            out, lse = _blocksparse_op.run(q, k, v, call.scale, plan.detail)
        else:
            steps = plan.detail.get_or_compute("steps", lambda: make_plan(call))
            out, lse = _BlockSparseAttention.apply(q, k, v, _Geo(call, steps), call.scale)
        return out.to(call.q.dtype), None, lse if call.return_lse else None


register(BlockSparse())

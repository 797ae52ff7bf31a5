"""The reference backend: the seeds' formula, softmax(q kᵀ · scale + bias) v, in a few lines.

It materializes the ``(B, H, Sq, Sk)`` score matrix, accepts every mask, returns weights
and log-sum-exp, and is the oracle every other backend is tested against. Half-precision
inputs are computed in float32 (softmax statistics in fp32) and cast back.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..._dtypes import without_autocast
from ...masks.base import bias_as
from ...masks.tensor import read_free
from ..capabilities import Capabilities
from ..cost import Work
from ..registry import Backend, Plan, register
from ._common import mask_launches, mask_terms

#: fp32 passes over the score matrix (matmul out, scale, bias, mask, max, exp, sum, divide,
#: the weights' matmul, and their reads and temporaries): bytes per pair = 4 * this
SCORE_PASSES = 20


def _shift(scores: torch.Tensor, peak: torch.Tensor | None = None) -> torch.Tensor:
    """Each row's largest score ``(..., 1)`` (``peak``, if given), 0 where it is not finite
    (an all -inf row)."""
    m = scores.amax(dim=-1, keepdim=True) if peak is None else peak
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def _no_empty_row(peak: torch.Tensor) -> bool:
    """Whether surely no row is all ``-inf``, from the rows' largest scores ``peak``: read
    where that is free (the CPU, eager, tensors that hold values); False where it is not (a
    GPU, where a read stalls the queue; ``torch.compile``; ``vmap``; fake tensors). A row
    that is ``-inf`` everywhere may come from the inputs, not the mask (infinite keys, or
    scores that overflow), so the mask's facts cannot answer."""
    return not peak.numel() or read_free(peak, lambda: bool(peak.isneginf().any())) is False


def safe_softmax(scores: torch.Tensor, lse: bool = True
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Softmax over the last dim where an all ``-inf`` row gives zeros (not NaN).

    The weights are torch's fused softmax (its backward is one pass, 3-4x faster on a CPU
    than a formula's ops each differentiated); where a row may be all ``-inf``
    (:func:`_no_empty_row`), such rows are set to 0 before it (uniform weights, nothing to
    propagate) and their weights to 0 after it (two passes more, each its own backward).
    The lse is the formula's, shifted by the rows' largest score (a constant to autograd:
    logsumexp does not depend on the shift, so every derivative, of every order, is the
    same without its backward): ``torch.logsumexp``'s gradient, ``exp(s - lse)``, is ``Sk``
    times too large on a row whose scores carry a bias so large that adding the log of the
    sum rounds away (-1e30 in float64).

    Args:
        scores: ``(..., Sk)``.
        lse: also compute the log-sum-exp (else None is returned for it).

    Returns ``(weights, lse)``; ``lse`` is ``-inf`` for rows with nothing to attend to.
    Gradients through the weights stay finite (zero) for such rows.

    Example:
        >>> s = torch.tensor([[0.0, 0.0], [float("-inf")] * 2])
        >>> w, lse = safe_softmax(s)
        >>> w.tolist(), lse.tolist()
        ([[0.5, 0.5], [0.0, 0.0]], [0.6931471824645996, -inf])
    """
    peak = scores.detach().amax(dim=-1, keepdim=True)                 # (..., 1)
    if _no_empty_row(peak):
        weights = torch.softmax(scores, dim=-1)
    else:
        empty = peak == float("-inf")                                 # (..., 1); NaN: not
        weights = torch.softmax(scores.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    if not lse:
        return weights, None
    m = _shift(scores, peak)
    l = torch.exp(scores - m).sum(dim=-1, keepdim=True)
    return weights, (m + torch.log(l)).squeeze(-1)                    # log(0): -inf, no NaN


#: :func:`softmax_` clamps shifted scores at this and gives weight 0 at or below
#: ``FLUSH + 1``: exp of inputs that underflow to subnormals takes a slow path on x86 CPUs
#: (36x slower from about -88, 3x for -inf), and exp(-79) = 4.9e-35 is below any row
#: sum's resolution
FLUSH = -80.0


def softmax_(scores: torch.Tensor) -> torch.Tensor:
    """:func:`safe_softmax` in place, for a forward without gradients: ``scores`` become
    the weights (no allocation the size of the scores, which page-faults on a CPU), and a
    weight at most ``exp(FLUSH + 1)`` of its row's largest is 0. Returns the lse.

    Example:
        >>> s = torch.tensor([[0.0, 0.0, float("-inf"), -200.0], [float("-inf")] * 4])
        >>> lse = softmax_(s)
        >>> s.tolist(), [round(x, 4) for x in lse.tolist()]
        ([[0.5, 0.5, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]], [0.6931, -inf])
    """
    m = _shift(scores)
    p = scores.sub_(m).clamp_(min=FLUSH).exp_()
    F.threshold_(p, math.exp(FLUSH + 1), 0.0)                        # flushed: 0 (NaN stays)
    l = p.sum(dim=-1, keepdim=True)
    p.div_(torch.where(l == 0, torch.ones_like(l), l))
    return (m + torch.log(l)).squeeze(-1)                            # log(0) = -inf, no NaN


def _finite_product(x: torch.Tensor, y: torch.Tensor, clean: int) -> torch.Tensor:
    """``x @ y`` with the non-finite entries of ``(x, y)[clean]`` read as 0. Where that
    operand is larger than the product (the weights, in the gradient of the values), on the
    CPU the product is taken as it is first and kept if finite: IEEE arithmetic makes every
    row (or column) that meets a non-finite entry non-finite (``NaN * 0`` and ``inf * 0``
    are NaN), so a finite product saw none, and a pass that writes a cleaned copy of a
    score-sized operand is saved. Otherwise (a smaller operand; a read would stall a GPU;
    traced, batched or fake tensors cannot be read) the operand is cleaned first.

    Example:
        >>> x = torch.tensor([[1.0, float("nan")]])
        >>> _finite_product(x, torch.tensor([[2.0], [3.0]]), clean=0).tolist()
        [[2.0]]
    """
    operand = (x, y)[clean]
    product = x.numel() // max(x.shape[-1], 1) * y.shape[-1]       # (about: batch dims)
    if operand.numel() > product and x.device.type == "cpu":
        out = x @ y                                   # (traced, unused: the graph drops it)
        if read_free(out, lambda: bool(torch.isfinite(out).all())):
            return out
    cleaned = operand.nan_to_num(0.0, 0.0, 0.0)
    return cleaned @ y if clean == 0 else x @ cleaned


class _Product(torch.autograd.Function):
    """``a @ b`` (IEEE arithmetic, as written) whose gradients read the non-finite entries
    of ``a`` and ``b`` as 0: a NaN in a key or value the mask hides, weighted by 0 in the
    forward, would otherwise reach every gradient of its batch through ``0 * NaN`` (the
    rule of :mod:`multihead.functional.nonfinite`); a row that sees one is NaN in the
    forward and keeps NaN gradients through the scores."""

    generate_vmap_rule = True

    @staticmethod
    def forward(a, b):
        return a @ b

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    @staticmethod
    @without_autocast
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        need_a, need_b = ctx.needs_input_grad
        return (_finite_product(grad, b.transpose(-2, -1), clean=1) if need_a else None,
                _finite_product(a.transpose(-2, -1), grad, clean=0) if need_b else None)


class _TangentProduct(_Product):
    """:class:`_Product` with forward-mode AD (jvp, jacfwd, dual tensors), used only where a
    tangent is present: torch.compile cannot trace a Function that defines ``jvp``."""

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)
        ctx.save_for_forward(*inputs)

    @staticmethod
    def jvp(ctx, da, db):
        """``da @ b + a @ db``, non-finite entries read as 0 as in the backward."""
        a, b = (t.nan_to_num(0.0, 0.0, 0.0) for t in ctx.saved_tensors)
        out = None
        if da is not None:
            out = da @ b
        if db is not None:
            out = a @ db if out is None else out + a @ db
        return out


def masked_scores(call, q: torch.Tensor, k: torch.Tensor, product=torch.matmul) -> torch.Tensor:
    """The scores ``q kᵀ · scale + bias`` of ``q (B, H, Sq, D)`` over ``k (B, Hkv, Sk, D)``
    (the call's, or tensors shaped as them) in the call's compute dtype, ``-inf`` where the
    call's mask hides a pair: ``(B, H, Sq, Sk)``, whose softmax is the weights. ``product``
    multiplies (:class:`_Product` where gradients are taken).

    Example:
        >>> import multihead as mh
        >>> from multihead.functional._call import make_call
        >>> q = torch.ones(1, 1, 2, 4)
        >>> call = make_call(q, q, q, mask=mh.masks.causal(), scale=None, dropout_p=0.0,
        ...                  return_weights=False, return_lse=False)
        >>> masked_scores(call, q, q).tolist()
        [[[[2.0, -inf], [2.0, 2.0]]]]
    """
    work = call.compute_dtype
    q, k = q.to(work), k.to(work)
    if call.group > 1:
        k = k.repeat_interleave(call.group, dim=1)                    # (B, H, Sk, D)
    # q scaled, not the scores: a pass over (B, H, Sq, D) and its gradient, not over the
    # scores (the order torch's attention takes); a scale above 1 scales the scores, where
    # q times it could overflow and their product not
    if call.scale <= 1:
        scores = product(q * call.scale, k.transpose(-2, -1))         # (B, H, Sq, Sk)
    else:
        scores = product(q, k.transpose(-2, -1)) * call.scale
    allowed, bias = mask_terms(call, q.device)
    if bias is not None:
        scores = scores + bias_as(bias, work)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    return scores


class Reference(Backend):
    name = "reference"
    grad_reads_hidden_keys = False     # (its product's backward reads non-finite values as 0)
    summary = "the seeds' formula with a materialized score matrix; any mask, weights, lse"
    capabilities = Capabilities(weights=True, lse=True, dropout=True, bias_grad=True,
                                second_order=True)

    def plan(self, call, profile):
        size = call.compute_dtype.itemsize
        repeats = 0 if call.group == 1 else 2 * call.group       # K/V repeated for the heads
        work = Work(flops=2.0 * call.pairs * (call.D + call.Dv), kernel="matmul",
                    dtype=call.compute_dtype,
                    bytes=SCORE_PASSES * size * call.pairs + call.io_bytes(1 + repeats),
                    launches=14 + mask_launches(call),
                    memory=3 * size * call.pairs + call.io_bytes(repeats))
        if call.requires_grad:
            work = work.times(flops=2.5, bytes=2.0, launches=2.5)
        return Plan(work, "materializes the full score matrix")

    def run(self, call, plan):
        # (no derivative taken: the plain product, the same numbers without a Function's
        # per-call cost)
        product = (_TangentProduct.apply if call.forward_ad else _Product.apply
                   if call.requires_grad else torch.matmul)
        scores = masked_scores(call, call.q, call.k, product)         # (B, H, Sq, Sk)
        weights, lse = safe_softmax(scores, call.return_lse)
        if call.dropout_p > 0:
            weights = torch.nn.functional.dropout(weights, p=call.dropout_p)
        v = call.v.to(call.compute_dtype)
        if call.group > 1:
            v = v.repeat_interleave(call.group, dim=1)                # (B, H, Sk, Dv)
        out = product(weights, v)                                     # (B, H, Sq, Dv)
        dt = call.q.dtype
        return (out.to(dt), weights.to(dt) if call.return_weights else None,
                lse if call.return_lse else None)


register(Reference())

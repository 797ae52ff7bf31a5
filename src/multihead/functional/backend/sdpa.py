"""The sdpa backend: ``torch.nn.functional.scaled_dot_product_attention``.

PyTorch's fused kernels (flash and memory-efficient on GPUs, flash on CPUs) without
materializing weights:
- no mask (or a mask that allows everything, such as causal at Sq=1): the plain kernel;
- a pure causal mask where torch's alignment agrees with ours: ``is_causal=True``;
- anything else: the mask is materialized as a bool (or additive float) tensor.
GQA never copies K/V: ``enable_gqa=True`` where the device's kernels read each K/V head
once (profile feature ``sdpa_native_gqa``); elsewhere the query heads of a group are folded
into the query axis when the mask does not depend on the head.
Rows with nothing to attend to are opened before the kernel and zeroed after it, so they
return zeros with zero gradients on every torch version; whether a mask can have such rows
is decided on the host (:meth:`multihead.masks.Mask.may_have_empty_rows`), never by
reading the mask back.
torch's fused kernels rebuild the weights in their backward from the log-sum-exp, which
cannot also hold the log of a row's sum once a huge finite bias (``-1e30``, ``finfo.min``)
is on every score the row sees (:mod:`multihead.kernels._exact_rows`): those rows'
gradients come out up to ``Sk`` times too large, in fp32 and fp64 alike. On a CPU, where
reading the mask back costs no sync, a call that needs gradients and has a live row whose
bias maximum reaches :data:`._common.HUGE_LSE` runs torch's math operator instead (its
weights are differentiated as computed; it keeps the ``(Sq, Sk)`` weights of every head
for the backward, which the cost model does not charge); so does every such call while
``torch.compile`` traces or a ``torch.func`` transform runs, where nothing is read back.
On other devices that check would wait for the device, and is not made: there the defect
is torch's (``auto`` picks the Triton kernels, which are exact, for the half-precision
calls they can run; fp32 calls keep it).
Limits: no weights, no log-sum-exp.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch.fx.experimental.symbolic_shapes import statically_known_true

from ...masks.combine import And
from ...masks.tensor import read_free
from ...masks.structured import _offset
from .._call import AttentionCall, traced
from ..capabilities import Capabilities
from ..cost import Work
from ..registry import Backend, Plan, register
from ._cudnn import mute_in_second_order, run_without_cudnn, skips_cudnn
from ._common import FUSED_ROWS, HUGE_LSE, KEY_SPLIT, kept_mask, mask_launches
from ..._tracing import tracing

#: the most queries for which a masked GQA call folds its query heads (decoding, verifying)
FOLD_MASKED_MAX_SQ = 16
#: passes over the score matrix of torch's unfused math path (the product's write, the
#: mask's add, softmax's max, exp, sum and division, dropout, the second product's read)
MATH_SCORE_PASSES = 8


def _unfused(call: AttentionCall, profile, fold: bool) -> str | None:
    """Why torch's CPU dispatcher would run its unfused math path for this call (its flash
    kernel takes no dropout, a value head dim other than the query's, or a last dim whose
    stride is not 1: a q folded for GQA is reshaped into a copy that has it), or None
    where the flash kernel runs."""
    if profile.device_type != "cpu":
        return None
    if call.dropout_p > 0:
        return "dropout"
    if call.Dv != call.D:
        return f"Dv = {call.Dv} != D = {call.D}"
    if any(t.stride(-1) != 1 for t in ((call.k, call.v) if fold else (call.q, call.k, call.v))):
        return "a last dim with stride != 1"
    return None


class Detail(NamedTuple):
    mode: str        # "plain", "causal" (is_causal=True) or "masked"
    fold: bool       # fold the query heads of a K/V head into the query axis
    row_fix: bool    # open rows with nothing to attend to, zero them after
    upcast: bool     # run the kernel in fp32 (a half-precision one would round the bias)
    exact: bool      # a bias, gradients, a CPU: rows the bias makes huge run torch's math path


def _mode(call: AttentionCall) -> str:
    m = call.effective_mask
    if m is None:
        return "plain"
    # torch's is_causal is upper-left aligned: ours when Sq == Sk (while sizes are traced as
    # symbolic: where that is known without a guard, as for one length, else masked)
    if call.is_pure_causal and statically_known_true(_offset(m.align, call.Sq, call.Sk) == 0):
        return "causal"
    return "masked"


#: keys per block of torch's CPU flash kernel; its query blocks (32, 64 or 256 rows) divide it
CPU_KEY_BLOCK = 512


def _causal_pairs(sq: int, sk: int, cpu: bool = False) -> int:
    """Pairs an upper-left causal kernel computes: allowed ones plus half-empty diagonal
    tiles on a GPU. On a CPU, torch's kernel computes a block of :data:`CPU_KEY_BLOCK` keys
    for every query from the block's first key on: a 512 x 512 causal call computes all its
    pairs, a 2048 x 2048 one 62.5% (it took 63% of the unmasked call's time).

    Example:
        >>> _causal_pairs(512, 512, cpu=True) / 512**2, _causal_pairs(2048, 2048, cpu=True) / 2048**2
        (1.0, 0.625)
    """
    if cpu and not (traced(sq, sk) or tracing()):   # (no guards)
        return sum(max(0, sq - c) * min(CPU_KEY_BLOCK, sk - c)
                   for c in range(0, sk, CPU_KEY_BLOCK))
    n = min(sq, sk)
    allowed = n * (n + 1) // 2 + (sq - n) * sk
    return min(sq * sk, allowed + min(sq, sk) * FUSED_ROWS // 2)


def _rounds_a_tensor_bias(m, dtype: torch.dtype) -> bool:
    """Would a kernel adding the bias in ``dtype`` round a bias tensor given in a wider one?

    Structured biases (ALiBi) alone are exempt: their values are computed exactly, and the
    keys that carry weight are the near ones, whose small values round finely in any dtype
    (the cross-backend tests hold them to the error rule). A sum of several biases is not
    exact in the narrow dtype, whatever they are.
    """
    if torch.finfo(dtype).bits >= 32:     # fp32/fp64 kernels: nothing to gain by upcasting
        return False
    narrow = torch.finfo(dtype)
    if sum(1 for leaf in m.leaves() if leaf.has_bias) > 1:
        return True
    for leaf in m.leaves():
        raw = getattr(leaf, "raw", None) if leaf.has_bias else None
        if raw is not None:
            wide = torch.finfo(raw.dtype)
            if wide.eps < narrow.eps or wide.max > narrow.max:
                return True
    return False


def _dense_mask(call: AttentionCall, row_fix: bool, dtype: torch.dtype):
    """Return (attn_mask, row_ok or None) for SDPA: the mask ``(B', H', Sq|1, Sk)`` as bool,
    or as its additive float form where it has a bias (a tensor bias: a view of it, -inf
    and all, where nothing is joined to it); ``row_ok (B', H', Sq, 1)``: the rows to keep
    where ``row_fix`` opened rows that allow nothing (to zero after the kernel). A host
    mask's rows are read first: where every row allows a key, nothing is opened. Kept on
    the mask for its next call where it adds no bias (:func:`kept_mask`)."""
    return kept_mask(call, "sdpa mask", (call.q.device, row_fix),
                     lambda: _build_dense_mask(call, row_fix, dtype))


def _build_dense_mask(call: AttentionCall, row_fix: bool, dtype: torch.dtype):
    """:func:`_dense_mask`, built."""
    m = call.effective_mask
    ix = m._index_grid(call.Sq, call.Sk, call.q.device, call.compute_dtype)
    if m.has_bias:
        attn = m._additive_at(ix, dtype)
        if call.requires_grad and m._additive_view(dtype):
            # (the kernel keeps its mask for the backward: a copy, so that the tensor may be
            # written before the backward runs, as the other masks' may)
            attn = attn.clone()
    else:
        # (B', H', Sq|1, Sk): a mask the same for every query (key padding) stays one row,
        # which SDPA broadcasts (its CPU kernel ran 20% slower on the mask expanded)
        attn = m._allowed(ix)
        attn = attn.expand(*attn.shape[:3], call.Sk)
    if not row_fix:
        return attn, None
    live = attn.amax(dim=-1, keepdim=True) != float("-inf") if m.has_bias else \
        attn.any(dim=-1, keepdim=True)                          # (B', H', Sq, 1); NaN: live
    if read_free(live, lambda: bool(live.all())):       # (a host's rows: every one live)
        return attn, None
    opened = 0.0 if m.has_bias else True                   # (0: no bias; True: every key)
    return attn.masked_fill(~live, opened), live           # open empty rows; zero them after


def _additive_cost(m, dtype) -> tuple[int, int]:
    """``(bytes per grid entry, fresh full-grid buffers)`` of building ``m._additive_at``:
    a tensor bias's own tensor costs nothing; a predicate joined to a bias's form, a pass
    (the join: 8 bytes) and its buffer; else each leaf past the first joins in a pass (16)
    and a tensor bias's -inf are filled (40), into two buffers (the bias, and the predicate
    joined to it). Measured on a CPU, 8 x 1024 x 1024 fp32: a tensor bias & key padding 10
    bytes' time and its buffer's pages."""
    if m._additive_view(dtype):
        return 0, 0
    split = m._bias_and_predicate() if isinstance(m, And) else None
    if split is not None:
        per, buffers = _additive_cost(split[0], dtype)
        return per + 8, buffers + 1
    leaves = list(m.leaves())
    tensors = sum(1 for leaf in leaves if leaf.kind == "bias")
    return 8 + 16 * (len(leaves) - 1) + 40 * tensors, 1 + m.has_predicate


class SDPA(Backend):
    name = "sdpa"
    zero_rows_for_nan_scores = True         # torch's fused kernel (see nonfinite)
    summary = "torch's fused scaled_dot_product_attention (flash kernel); dense masks materialized"
    capabilities = Capabilities(dropout=True, bias_grad=True, forward_ad=False,
                                empty_vmap=False)

    def plan(self, call, profile):
        B, H, Hkv, G, Sq, Sk = call.B, call.H, call.Hkv, call.group, call.Sq, call.Sk
        mode, m = _mode(call), call.effective_mask
        # (sizes traced as symbolic: opened and zeroed, which is exact for every size)
        row_fix = mode == "masked" and (traced(Sq, Sk) or m.may_have_empty_rows(Sq, Sk))
        # every backend adds a bias tensor in fp32 at its own precision; the kernel adds it
        # in the inputs' dtype, so a bias tensor that would round there runs it in fp32
        upcast = mode == "masked" and m.has_bias and _rounds_a_tensor_bias(m, call.q.dtype)
        dtype = torch.float32 if upcast else call.q.dtype
        head_free = mode != "masked" or not m.num_heads or m.num_heads == 1
        native = "sdpa_native_gqa" in profile.features
        # folding a materialized mask copies it G times and runs slower than enable_gqa
        # (on a CPU: 0.14 s vs 0.09 s for a padded batch of 32 x 511); it pays for decoding
        # (a masked fold pays for decoding: not in a graph traced for symbolic lengths, which
        # serves long ones too, where copying the mask G times would cost more than it saves)
        fold = G > 1 and head_free and mode != "causal" and not native and \
            (mode != "masked" or not traced(Sq) and Sq <= FOLD_MASKED_MAX_SQ)
        kv_reads = G if G > 1 and not (fold or native) else 1
        pairs = B * H * _causal_pairs(Sq, Sk, profile.device_type == "cpu") \
            if mode == "causal" else call.pairs
        heads, rows = (B * Hkv, G * Sq) if fold else (B * H, Sq)
        mask_bytes, fresh, peak = 0.0, (), 0.0
        # a tensor bias with no row to open goes to the kernel as it is
        direct = mode == "masked" and m.has_bias and not row_fix and not fold and \
            m._additive_view(dtype)
        if mode == "masked":   # materialized on the index grid, converted to the dtype
            elems = (m.batch_size or 1) * (m.num_heads or 1) * Sq * Sk
            leaves = list(m.leaves())
            # peak bytes per entry kept on the safe side (ALiBi(8) at 16k: 11.5 GB)
            if direct:     # the kernel reads it (copied first where a backward keeps it)
                copy = call.requires_grad
                per, held = dtype.itemsize * (1 + 2 * copy), dtype.itemsize * copy
                fresh = (elems * dtype.itemsize,) * copy
            elif m.has_bias:
                per, buffers = _additive_cost(m, dtype)
                held = 4 * (4 + 2 * len(leaves))
                per += 4 * row_fix      # (rows read; opened where empty: on a device, or rare)
                fresh = (elems * call.compute_dtype.itemsize,) * buffers
            else:          # bool; torch turns it into floats (its logical_not, its where)
                per = call.q.element_size() * (3 + len(leaves)) + 1 + dtype.itemsize
                opened = row_fix and profile.device_type != "cpu"   # (a host's rows: read)
                held = per / 2
                fresh = (elems,) * (1 + opened) + (elems, elems * dtype.itemsize)
            mask_bytes, peak = elems * per, elems * held
        io = call.io_bytes(kv_reads) * (1 if not upcast else 2 * 4 / call.q.element_size())
        unfused = _unfused(call, profile, fold)
        scores = 0 if unfused is None else dtype.itemsize * call.pairs   # (every pair)
        work = Work(flops=2.0 * (call.pairs if unfused else pairs) * (call.D + call.Dv),
                    kernel="matmul" if unfused else
                    "fused_masked" if mode == "masked" else "fused", dtype=dtype,
                    bytes=io + mask_bytes + MATH_SCORE_PASSES * scores,
                    launches=1 + (mask_launches(call) + 4 * row_fix if mode == "masked" else 0),
                    memory=peak + 3 * scores, fresh=fresh,
                    parallel=heads * -(-rows // FUSED_ROWS)
                    * (1 if mode == "masked" else -(-Sk // KEY_SPLIT)))
        if call.requires_grad:
            work = work.times(flops=3.5, bytes=3.0, launches=2.0)
        masked = "mask materialized densely" if not direct else \
            "bias tensor passed as it is" + (" (a copy: the backward keeps it)"
                                             if call.requires_grad else "")
        note = {"plain": "no mask: plain fused kernel",
                "causal": "is_causal=True: the fused kernel skips the upper triangle",
                "masked": f"{masked}, every pair computed"}[mode]
        if unfused:
            note = (f"torch runs its unfused math path ({unfused}): every score materialized"
                    + {"plain": "", "causal": ", is_causal=True", "masked": f", {masked}"}[mode])
        if G > 1:
            note += ("; query heads folded into the query axis" if fold else
                     "; enable_gqa" + ("" if native else " (K/V read once per query head)"))
        if upcast:
            note += f"; computed in float32 (a {call.q.dtype} kernel would round the bias)"
        if skips_cudnn(profile.device_type, Sq):
            note += ("; cuDNN's kernel switched off (it builds a graph for each new length, "
                     "which a decoding loop makes every step)")
        exact = (mode == "masked" and m.has_bias and call.requires_grad
                 and profile.device_type == "cpu")
        if exact:
            note += ("; a call with a row whose bias is >= 710 in magnitude on every key it "
                     "sees runs torch's math operator (the fused backward loses such a row's "
                     "sum)")
        return Plan(work, note, Detail(mode, fold, row_fix, upcast, exact))

    def length_free(self, plan):
        return plan.detail.mode == "plain"      # no mask: the fold, the flags and SDPA's call

    def run(self, call, plan):
        mode, fold, row_fix, upcast, exact = plan.detail
        q, k, v = _apart(call.q), call.k, call.v
        if upcast:
            q, k, v = q.float(), k.float(), v.float()
        attn_mask, row_ok = _dense_mask(call, row_fix, q.dtype) if mode == "masked" \
            else (None, None)
        kw = dict(dropout_p=call.dropout_p, scale=call.scale, is_causal=mode == "causal")
        math = exact and _needs_math(attn_mask, row_ok)
        sdpa = _math if math else F.scaled_dot_product_attention
        # a decoding step: no cuDNN graph per new length
        if not math and skips_cudnn(q.device.type, call.Sq):
            out = run_without_cudnn(_kernel, call, q, k, v, attn_mask, fold, kw, sdpa)
        else:
            out = _kernel(call, q, k, v, attn_mask, fold, kw, sdpa)
        if row_ok is not None:
            out = out * row_ok.to(out.dtype)
        if out.dtype != call.q.dtype:                   # (a no-op .to still costs a dispatch)
            out = out.to(call.q.dtype)
        return out, None, None


def _apart(t: torch.Tensor) -> torch.Tensor:
    """``t``, or a contiguous copy where two of its elements share memory (a view made by
    ``as_strided`` with overlapping strides): torch's fused CPU kernel gives garbage for
    such a query (broadcast dims, of stride 0, it handles).

    Example:
        >>> t = torch.arange(8.).as_strided((2, 4), (1, 1))     # rows overlap
        >>> s = torch.zeros(4, 2).t()                            # strided, apart
        >>> _apart(t).is_contiguous(), _apart(s) is s
        (True, True)
    """
    if tracing() or t.is_contiguous():
        return t                                # (traced, the layouts are torch's to keep)
    if torch._C._are_functorch_transforms_active():
        return t.contiguous()                   # (vmap's tensors have no overlap test)
    if _OVERLAP is not None and _OVERLAP(t) == 0:   # (0: torch knows none; 0.3 us)
        return t
    ends = 0                # the furthest element reached by the dims of smaller stride
    for stride, size in sorted(zip(t.stride(), t.shape)):
        if size == 1 or not stride:
            continue                            # (a broadcast dim reads one element)
        if stride <= ends:
            return t.contiguous()
        ends += (size - 1) * stride
    return t


#: torch's own overlap test (0: none; 1: some, stride 0 included; 2: too hard to tell)
_OVERLAP = getattr(torch, "_debug_has_internal_overlap", None)


def _needs_math(attn_mask: torch.Tensor, row_ok: torch.Tensor | None) -> bool:
    """Whether a live row (``row_ok (B', H', Sq, 1)``; None: all) of the additive
    ``attn_mask (B', H', Sq, Sk)`` has a finite maximum of magnitude :data:`HUGE_LSE` or
    more: a host read (made on a CPU only). While ``torch.compile`` traces or a
    ``torch.func`` transform runs, where nothing can be read back: always."""
    if tracing() or torch._C._are_functorch_transforms_active():
        return True
    top = attn_mask.amax(dim=-1)                                          # (B', H', Sq)
    if row_ok is not None:                                # rows opened only to be zeroed
        top = top.masked_fill(~row_ok.squeeze(-1), 0.0)
    return bool(((top.abs() >= HUGE_LSE) & top.isfinite()).any())


def _math(q, k, v, **kw) -> torch.Tensor:
    """torch's math operator for SDPA, whose weights autograd differentiates as computed
    (called directly: torch's ``sdpa_kernel`` switch is process-wide)."""
    return torch.ops.aten._scaled_dot_product_attention_math(q, k, v, **kw)[0]


def _kernel(call: AttentionCall, q, k, v, attn_mask, fold: bool, kw: dict,
            sdpa=F.scaled_dot_product_attention) -> torch.Tensor:
    """``sdpa`` (torch's SDPA or :func:`_math`) on the call's inputs: ``(B, H, Sq, Dv)``,
    the query heads of a group folded into the query axis when ``fold``."""
    B, Hkv, G, Sq = call.B, call.Hkv, call.group, call.Sq
    if fold:
        # (contiguous first: folding a strided q, as RoPE's split leaves it, makes Inductor's
        # backward assert the strides of the length it compiled for at the next length)
        qf = q.contiguous().view(B, Hkv, G * Sq, call.D)                 # (B, Hkv, G*Sq, D)
        if attn_mask is not None and attn_mask.shape[2] > 1:   # (one row: it broadcasts)
            attn_mask = attn_mask.repeat(1, 1, G, 1)     # once per query head: (B', 1, G*Sq, Sk')
        out = sdpa(qf, k, v, attn_mask=attn_mask, **kw)
        mute_in_second_order(call, out)
        # not view: some kernels (CUDA's fp32 ones) return a transposed layout; and not
        # reshape, whose view check on a symbolic length adds a guard torch.export refuses
        return out.unflatten(2, (G, Sq)).flatten(1, 2)                    # (B, H, Sq, Dv)
    out = sdpa(q, k, v, attn_mask=attn_mask, enable_gqa=True if G > 1 else False,  # a bool,
               **kw)                                           # also where G is symbolic
    mute_in_second_order(call, out)
    return out


register(SDPA())

"""NaN and inf in the inputs: one rule for every backend.

The rule:

- a key or value the mask hides from a query row never changes that row, however it is
  non-finite (fused kernels compute masked pairs and then weight them by 0, and
  ``0 * NaN`` is NaN: left alone, a NaN in a padded key would poison every row);
- a query row that has something to attend to is all NaN when its query, or a key or value
  it may attend to, holds a NaN or an inf (torch's CPU kernel would return zeros for a NaN
  query, the reference NaN in some columns only: neither is what the caller's data says);
- a row with nothing to attend to stays zeros.

On the CPU, where reading a result back is free, it costs one reduction over q and one
over the output (and one over k in half precision, where torch's fused kernel turns a
``+inf`` score into finite values, and, after torch's fused kernel, where an output row is
exactly zero, which it returns for a row whose every score is NaN): a non-finite input a
row may see, or a hidden one that leaked through a kernel, leaves a non-finite output;
only then are the inputs scanned, the call run again on cleaned inputs and the rows that
see non-finite values set to NaN. An infinite key component that only ever meets the query
with the opposite sign makes its scores ``-inf``, which IEEE arithmetic turns into weight
0 with a finite output: on every backend such a key is dropped from its rows unless the
call takes the careful path for another reason (then its rows are NaN, as the rule says).
A call whose q requires gradients, with a finite output, reads k too on backends whose
backward multiplies every key (q's gradient sums ``0 * inf`` over the keys: one hidden
infinite key made every row's gradient NaN), and one whose q or k requires them reads v
(their gradients multiply every value through ``dO · vᵀ``: a non-finite value of a
sequence that sees nothing leaves its rows zeros, and made their gradients NaN): where k
or v is not finite, the call runs again with the keys and values no row may attend to
zeroed (same output; a visible infinite key stays, in both runs, so the output is the one
a call without gradients gives).
On devices where a read-back stalls the queue (GPUs) nothing is inspected, and the fused
kernels' own NaN handling applies. Our Triton kernels keep the first part of the rule
themselves where hidden positions may hold anything: a program whose accumulators end non-
finite (a hidden NaN or inf makes them NaN: its weight is 0, and ``0 * NaN`` is NaN) runs
its blocks again, zeroing the non-finite values on the blocks it masks (the block-sparse
kernels' partial blocks, the band and decode kernels' edge blocks, where the band shows a
key to some rows of a block and hides it from others) and making NaN (output and lse) the
rows that see one; a program whose accumulators end finite saw none and pays one check.
The band kernels never read the keys past a padding length. A visible non-finite *key*
follows IEEE arithmetic there: a NaN makes its rows NaN, an infinite score may instead
drop the key (``-inf``) from a row.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from ._call import AttentionCall
from .._tracing import tracing


#: dtypes whose check sums k with q and the output (a +inf score absorbed by the kernel)
HALF = (torch.float16, torch.bfloat16)


def _finite(q: torch.Tensor, out: torch.Tensor, k: torch.Tensor,
            zero_rows: bool = False, finite_k=None) -> bool:
    """True when q and the output (and k, in half precision, or with ``zero_rows`` where an
    output row is all zeros: a kernel that returns zeros for a row of NaN scores) are
    finite (host reads, free on a CPU; a sum that overflows only takes the careful path).
    ``finite_k``: the caller's (remembered) read of whether k is finite, so that k is
    read once per call. Inputs it cannot read (``torch.func`` transforms) count as finite:
    the kernels' own handling applies, as on GPUs."""
    half = k.dtype in HALF
    finite_k = finite_k or (lambda: _sums_finite(k))
    try:
        if (q.shape == out.shape and q.dtype in (torch.float32, torch.float64)
                and q.is_contiguous() and out.is_contiguous()):
            # one BLAS call: a NaN or inf on either side makes q . out non-finite
            ok = math.isfinite(torch.dot(q.view(-1), out.view(-1)).item())
        else:
            total = q.sum(dtype=torch.float32) + out.sum(dtype=torch.float32)
            if half:                                        # an absorbed +inf score
                total = total + k.sum(dtype=torch.float32)
            ok = math.isfinite(total.item())
        if ok and zero_rows and not half and out.numel():
            # a row of zeros (its largest |value| 0) with a non-finite key: the careful
            # path; the cheaper of the two reads first
            no_zero_row = lambda: bool(out.abs().amax(-1).amin())
            ok = (finite_k() or no_zero_row() if k.numel() <= 4 * out.numel()
                  else no_zero_row() or finite_k())
        return ok
    except RuntimeError:                  # vmap and friends refuse .item()
        return True


def _sums_finite(t: torch.Tensor) -> bool:
    """Whether ``t``'s sum is finite (a host read; a sum that overflows only costs the
    careful path); True where it cannot be read (vmap and friends, as in :func:`_finite`)."""
    try:
        return math.isfinite(t.sum().item())
    except RuntimeError:
        return True


def _replaced(call: AttentionCall, q, k, v) -> AttentionCall:
    """The same call on other tensors of the same shapes."""
    return AttentionCall(q, k, v, call.mask, call.scale, call.dropout_p, call.return_weights,
                         call.return_lse, average_weights=call.average_weights)


#: booleans of one chunk of (B, H, rows, Sk) in the careful path
_CHUNK_ELEMS = 1 << 24


def _without_hidden_keys(backend, call: AttentionCall, plan, rng, result):
    """A finite output that needs gradients, with a non-finite key or value: run again with
    the keys and values no row may attend to zeroed, where the first run's ``result`` would
    give q (or k) the gradient ``0 * inf`` (a hidden key whose scores are ``-inf``, or a
    value of a row that sees nothing, has weight 0 in the forward, but the backward's
    products over the keys read it). The output is the same; a visible infinite key is left
    as it is, in both runs (its rows drop it, as without gradients, and their gradients are
    NaN)."""
    hidden = _hidden_keys(call)[..., None]                                 # (B, Hkv, Sk, 1)
    bad_k, bad_v = (~torch.isfinite(t) & hidden for t in (call.k, call.v))  # (B, Hkv, Sk, D)
    if not bool(bad_k.any() or bad_v.any()):
        return result
    if rng is not None:                   # the same dropout draws as the first run
        torch.random.set_rng_state(rng)
    out, w, lse = backend.run(_replaced(call, call.q, call.k.masked_fill(bad_k, 0.0),
                                        call.v.masked_fill(bad_v, 0.0)), plan)
    return out, w, lse


def _hidden_keys(call: AttentionCall) -> torch.Tensor:
    """``(B, Hkv, Sk)``: keys that no query row of any head reading them may attend to,
    evaluated in chunks of query rows as :func:`poisoned_rows` is."""
    m = call.effective_mask
    if m is None:
        return torch.zeros(call.B, call.Hkv, call.Sk, dtype=torch.bool, device=call.q.device)
    seen = torch.zeros(1, 1, call.Sk, dtype=torch.bool, device=call.q.device)
    for allowed in _allowed_chunks(call, m):                                 # (B', H', rows, Sk)
        seen = seen | allowed.any(-2)                                        # (B', H', Sk)
    seen = seen.expand(call.B, call.H, call.Sk).reshape(call.B, call.Hkv, call.group, call.Sk)
    return ~seen.any(2)                                                      # (B, Hkv, Sk)


def _allowed_chunks(call: AttentionCall, m):
    """The mask's ``allowed`` over chunks of query rows ``(B', H', rows, Sk)``, memory bounded
    by :data:`_CHUNK_ELEMS` whatever Sq and Sk."""
    ix = m._index_grid(call.Sq, call.Sk, call.q.device)
    step = max(1, _CHUNK_ELEMS // max(1, call.B * call.H * call.Sk))
    for i in range(0, call.Sq, step):
        part = dataclasses.replace(ix, q=ix.q[:, :, i:i + step])
        allowed, _ = m.at(part)                               # (B', H', rows, Sk) or None
        if allowed is None:
            allowed = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=call.q.device)
        yield allowed.expand(*allowed.shape[:2], ix.q[:, :, i:i + step].shape[2], call.Sk)


def poisoned_rows(call: AttentionCall) -> torch.Tensor:
    """``(B, H, Sq)``: rows that may attend to something and whose query, or a key or value
    they may attend to, is not finite. Evaluated in chunks of query rows (memory bounded
    by :data:`_CHUNK_ELEMS`, whatever Sq and Sk)."""
    bad_q = ~torch.isfinite(call.q).all(-1)                                       # (B, H, Sq)
    bad_kv = ~(torch.isfinite(call.k).all(-1) & torch.isfinite(call.v).all(-1))   # (B, Hkv, Sk)
    bad_kv = bad_kv.repeat_interleave(call.group, dim=1)[:, :, None, :]            # (B, H, 1, Sk)
    m = call.effective_mask
    if m is None:
        return bad_q | bad_kv.any(-1)
    rows, i = [], 0
    for allowed in _allowed_chunks(call, m):                                # (B', H', rows, Sk)
        n = allowed.shape[2]
        sees_bad = (allowed & bad_kv).any(-1)                                      # (B, H, rows)
        rows.append(sees_bad | (bad_q[:, :, i:i + n] & allowed.any(-1)))
        i += n
    return torch.cat(rows, dim=2)


def run(backend, call: AttentionCall, plan):
    """``backend.run(call, plan)`` under the rule of this module; returns
    ``(out (B, H, Sq, Dv), weights (B, H, Sq, Sk) or their head mean (B, Sq, Sk) or None,
    lse (B, H, Sq) or None)``.

    Example:
        >>> import torch, multihead as mh
        >>> q = torch.randn(1, 1, 3, 4); k = q.clone(); k[0, 0, 2] = float("nan")
        >>> out = mh.attention(q, k, q, mask=mh.masks.causal())     # runs through here
        >>> out[0, 0].isnan().all(-1).tolist()         # only the row that sees key 2
        [False, False, True]
    """
    on_host = call.q.device.type == "cpu" and not tracing()
    rng = torch.random.get_rng_state() if on_host and call.dropout_p > 0 else None
    out, w, lse = backend.run(call, plan)
    if not on_host:
        return out, w, lse
    read = []

    def finite_k() -> bool:                       # read once, when first asked (a closure:
        if not read:                              # functools.cache cost ~3 us per call)
            read.append(_sums_finite(call.k))
        return read[0]
    if _finite(call.q, out, call.k, backend.zero_rows_for_nan_scores, finite_k):
        m = call.effective_mask
        if torch.is_grad_enabled() and backend.grad_reads_hidden_keys and (
                # q's gradient multiplies every key (in half precision a finite result
                # already summed k); q's and k's multiply every value through dO · vᵀ,
                # and a hidden non-finite value leaves the output finite only where its
                # rows see nothing (zeros)
                call.q.requires_grad and call.k.dtype not in HALF and not finite_k()
                or (call.q.requires_grad or call.k.requires_grad) and m is not None
                and m.may_have_empty_rows(call.Sq, call.Sk) and not _sums_finite(call.v)):
            return _without_hidden_keys(backend, call, plan, rng, (out, w, lse))
        return out, w, lse
    if rng is not None:                   # the same dropout draws as the first run
        torch.random.set_rng_state(rng)
    clean = [t.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0) for t in (call.q, call.k, call.v)]
    out, w, lse = backend.run(_replaced(call, *clean), plan)
    rows = poisoned_rows(call)                                                     # (B, H, Sq)
    nan = float("nan")
    out = out.masked_fill(rows[..., None], nan)
    if w is not None:         # (a row NaN in any head is NaN in the heads' mean)
        w = w.masked_fill((rows.any(1) if w.dim() == 3 else rows)[..., None], nan)
    lse = lse.masked_fill(rows, nan) if lse is not None else None
    return out, w, lse

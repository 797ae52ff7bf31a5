"""``attention()`` and ``explain()``: one call, the cheapest exact backend, and why."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import registry
from ._call import AttentionCall, make_call

AUTO = "auto"


@dataclass(frozen=True)
class Explanation:
    """Which backend runs a call and why each other one does not.

    Attributes:
        chosen: the backend that runs.
        requested: what the caller asked for (``"auto"`` or a name).
        rows: ``(name, reason_or_None, cost_or_None, note)`` for every backend;
            ``reason`` is why it cannot run the call, ``cost`` its estimate (dense
            multiply-add units).
        call: a one-line summary of the call.
    """

    chosen: str
    requested: str
    rows: tuple
    call: str

    def __str__(self) -> str:
        lines = [f"attention {self.call}", f"backend: {self.chosen}"
                 + (" (chosen by auto: cheapest exact backend)" if self.requested == AUTO
                    else " (requested)")]
        costs = [c for _, r, c, _ in self.rows if r is None]
        best = min(costs) if costs else None
        for name, reason, cost, note in self.rows:
            mark = "*" if name == self.chosen else " "
            if reason is not None:
                lines.append(f" {mark} {name:<12} cannot run: {reason}")
            else:
                rel = f"{cost / best:.2f}x" if best else "-"
                lines.append(f" {mark} {name:<12} est. cost {cost:.3g} ({rel} the cheapest)"
                             + (f": {note}" if note else ""))
        return "\n".join(lines)

    __repr__ = __str__


def _describe(call: AttentionCall) -> str:
    kind = "MHA" if call.group == 1 else "MQA" if call.Hkv == 1 else f"GQA (group {call.group})"
    mask = call.effective_mask
    parts = [f"q (B={call.B}, H={call.H}, Sq={call.Sq}, D={call.D}), k/v (Hkv={call.Hkv}, "
             f"Sk={call.Sk}, Dv={call.Dv}), {str(call.q.dtype).replace('torch.', '')}, "
             f"{call.q.device}, {kind}",
             f"mask {mask.describe() if mask is not None else 'none'}"
             + (" (allows every pair: dropped)" if call.mask is not None and mask is None else "")]
    wants = [w for w, on in (("weights", call.return_weights), ("lse", call.return_lse),
                             (f"dropout {call.dropout_p}", call.dropout_p > 0),
                             ("gradients", call.requires_grad)) if on]
    if wants:
        parts.append("needs " + ", ".join(wants))
    return "; ".join(parts)


def _decide(call: AttentionCall, backend: str, notes: bool = True) -> Explanation:
    """The decision; ``notes=False`` (what attention() uses) skips the text only explain() shows."""
    rows = []
    compiling = torch.compiler.is_compiling()
    for name, b in registry.all_backends().items():
        reason = b.unsupported(call)
        if reason is None and compiling and not b.traceable:
            reason = "is not traceable by torch.compile (data-dependent tile loop)"
        cost = b.cost(call) if reason is None else None
        rows.append((name, reason, cost, b.cost_note(call) if notes and reason is None else ""))
    if backend == AUTO:
        able = [(c, n) for n, r, c, _ in rows if r is None]
        chosen = min(able)[1]  # reference supports everything, so never empty
    else:
        registry.get(backend)  # raises on unknown names
        reason = next(r for n, r, _, _ in rows if n == backend)
        if reason is not None:
            able = [n for n, r, _, _ in rows if r is None]
            raise ValueError(f"backend={backend!r} cannot run this call: it {reason}; use "
                             f"backend='auto' or one of {able}")
        chosen = backend
    return Explanation(chosen, backend, tuple(rows), _describe(call) if notes else "")


def _check_backend(backend) -> str:
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    if backend != AUTO:
        registry.get(backend)
    return backend


def attention(q, k, v, *, mask=None, scale=None, dropout_p=0.0, backend="auto",
              return_weights=False, return_lse=False):
    """Multi-head scaled dot-product attention: ``softmax(q kᵀ · scale + bias) v``.

    Works for MHA (``Hkv == H``), GQA (``H % Hkv == 0``) and MQA (``Hkv == 1``), self- and
    cross-attention (``Sq != Sk``). A query row with nothing to attend to returns zeros.
    ``backend="auto"`` runs the cheapest backend that is exact for the call; see
    :func:`explain` for the decision.

    Args:
        q: queries ``(B, H, Sq, D)``.
        k: keys ``(B, Hkv, Sk, D)``.
        v: values ``(B, Hkv, Sk, Dv)``.
        mask: a :mod:`multihead.masks` object (True = may attend), a bool tensor
            (dense), a float tensor (additive bias), or None.
        scale: multiplier of the scores; default ``1 / sqrt(D)``.
        dropout_p: dropout on the attention weights (pass 0.0 at evaluation).
        backend: ``"auto"``, ``"reference"``, ``"sdpa"`` or ``"blocksparse"``.
        return_weights: also return the weights ``(B, H, Sq, Sk)``.
        return_lse: also return the log-sum-exp of each score row ``(B, H, Sq)``
            (``-inf`` for rows with nothing to attend to).

    Returns:
        ``out`` ``(B, H, Sq, Dv)``, or a tuple ``(out, weights?, lse?)`` in that order
        when either extra is requested.

    Example:
        >>> import torch, multihead as mh
        >>> q, k, v = torch.randn(2, 8, 5, 16), torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
        >>> out, w = mh.attention(q, k, v, mask=mh.masks.causal(), return_weights=True)
        >>> out.shape, w.shape
        (torch.Size([2, 8, 5, 16]), torch.Size([2, 8, 5, 7]))

    Shapes:
        B batch, H query heads, Hkv key/value heads, Sq queries, Sk keys,
        D query/key head dim, Dv value head dim.
    """
    backend = _check_backend(backend)
    call = make_call(q, k, v, mask=mask, scale=scale, dropout_p=dropout_p,
                     return_weights=return_weights, return_lse=return_lse)
    if call.Sk == 0 or call.Sq == 0:
        out, w, lse = _empty(call)
    else:
        chosen = _decide(call, backend, notes=False).chosen
        out, w, lse = registry.get(chosen).run(call)
    extra = tuple(x for x, on in ((w, call.return_weights), (lse, call.return_lse)) if on)
    return (out, *extra) if extra else out


def _empty(call: AttentionCall):
    """Sq == 0 or Sk == 0: zeros, still connected to the autograd graph."""
    qg = call.q.reshape(call.B, call.Hkv, call.group * call.Sq, call.D)
    w = qg @ call.k.transpose(-1, -2)                     # (B, Hkv, G*Sq, Sk): zeros or empty
    out = (w @ call.v).view(call.B, call.H, call.Sq, call.Dv)
    lse = call.q.new_full((call.B, call.H, call.Sq), float("-inf"), dtype=torch.float32)
    return out, w.view(call.B, call.H, call.Sq, call.Sk), lse


def explain(q, k, v, *, mask=None, scale=None, dropout_p=0.0, backend="auto",
            return_weights=False, return_lse=False) -> Explanation:
    """Say which backend :func:`attention` runs for these arguments, and why.

    Takes exactly the arguments of :func:`attention` and validates them the same way;
    computes nothing but the decision.

    Example:
        >>> import torch, multihead as mh
        >>> q = torch.randn(1, 4, 128, 32)
        >>> print(mh.explain(q, q, q, mask=mh.masks.causal()))  # doctest: +ELLIPSIS
        attention q (B=1, H=4, Sq=128, D=32), ...
        backend: sdpa (chosen by auto: cheapest exact backend)
        ...
    """
    backend = _check_backend(backend)
    call = make_call(q, k, v, mask=mask, scale=scale, dropout_p=dropout_p,
                     return_weights=return_weights, return_lse=return_lse)
    return _decide(call, backend)

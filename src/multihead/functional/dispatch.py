"""``attention()`` and ``explain()``: one call, the cheapest exact backend, and why.

Every backend that can run a call (its declared capabilities) plans it as device-neutral
work, which the device's profile prices in seconds; ``auto`` runs the cheapest. On a device
where a host sync stalls the queue (a GPU), a plan that syncs runs only if none avoids it.

Two caches, keyed by what fully determines what they hold:

- plans, by the exact call: shapes, dtypes, devices, arguments, grad mode, the profile and
  the mask's :meth:`~multihead.masks.Mask.cache_key` (masks made of ints: causal, windows,
  ALiBi), kept from the call's second time (a decoding loop's calls, each with a new key
  length, are never met twice); a mask holding tensors keeps its plans on itself, from the
  first call, valid while its tensors are unmodified. A call found here validates, plans
  and analyses nothing: it goes straight to its backend, without reading anything back
  from the device.
- auto's choice, by the call's structure: the same, with batch and sequence lengths rounded
  up to a power of two (and Sq = 1, Sq = Sk, Sq < Sk kept apart) and the mask's
  :meth:`~multihead.masks.Mask.structure` instead of its contents. A decoding loop, whose
  key length grows every step, plans only the chosen backend for each new length (as a
  call naming its backend always does).

A user's own mask class is in neither cache unless it says what determines it.
``explain()`` names the backend these caches make ``attention()`` run, with auto's choice
for the call alone beside it where the two differ; ``clear_cache()`` empties both and
retires the plans kept on masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.autograd.forward_ad as fwAD

from .. import masks as M
from .._cache import BoundedCache
from .._dtypes import AUTOCAST_CASTS, autocast_dtype
from .._tracing import refuse_jit_trace, tracing
from ..analysis.params import human_bytes
from .. import _second_order as second_order
from . import nonfinite, profiles, registry
from ._call import (AttentionCall, default_scale, has_tangent, in_effect, make_call,
                    shared_mask, weights_mean)
from .cost import DeviceProfile
from .registry import Backend, Plan

AUTO = "auto"
#: exact call -> (backend, plan), kept from the call's second time: a decoding loop whose
#: cache grows (a new Sk every step) neither pays to keep decisions never reused nor
#: pushes out those that are
_DECISIONS = BoundedCache(1024, 64 << 20, keep_on_repeat=True)
_CHOICES = BoundedCache(1024, 1 << 20)        # structure of a call -> the backend auto chose
_EMPTY = "empty"
#: how many times :func:`clear_cache` ran: part of every plan's key, so that plans kept on
#: mask objects (which it cannot reach) are forgotten with the rest
_cleared = 0


@dataclass(frozen=True)
class Row:
    """One backend's answer for a call: why it cannot run it, or its plan and price."""

    name: str
    reasons: tuple
    plan: Plan | None = None
    seconds: float | None = None


@dataclass(frozen=True)
class Explanation:
    """Which backend runs a call, on which device profile, and why each other one does not.

    Attributes:
        chosen: the backend that runs.
        requested: what the caller asked for (``"auto"`` or a name).
        rows: a :class:`Row` per registered backend.
        call: a one-line summary of the call.
        profile: the :class:`~multihead.functional.cost.DeviceProfile` that priced it.
        fresh: auto's choice for this call alone, when ``attention()`` runs another: a
            choice made earlier, for calls of this structure or for this very call, that
            it keeps (see the module's docstring); else None.
    """

    chosen: str
    requested: str
    rows: tuple
    call: str
    profile: DeviceProfile
    fresh: str | None = None

    @property
    def reused(self) -> str | None:
        """The backend that runs when it is an earlier choice that differs from
        :attr:`fresh` (then :attr:`chosen`), else None."""
        return self.chosen if self.fresh is not None else None

    @property
    def plan(self) -> Plan | None:
        """The chosen backend's plan (None for an empty call)."""
        return next((r.plan for r in self.rows if r.name == self.chosen), None)

    def __str__(self) -> str:
        how = (" (requested)" if self.requested != AUTO else
               " (chosen by auto: cheapest exact backend)" if self.fresh is None else
               f" (auto's earlier choice, kept; chosen afresh: {self.fresh})")
        lines = [f"attention {self.call}", f"device profile: {self.profile.describe()}",
                 f"backend: {self.chosen}{how}"]
        best = min((r.seconds for r in self.rows if r.plan is not None), default=None)
        for r in self.rows:
            mark = "*" if r.name == self.chosen else " "
            if r.plan is None:
                lines.append(f" {mark} {r.name:<12} cannot run: {'; '.join(r.reasons)}")
                continue
            parts = self.profile.breakdown(r.plan.work)
            cause = ", ".join(f"{k} {v * 1e3:.3g}" for k, v in parts.items() if v > 0)
            rel = f"{r.seconds / best:.2f}x" if best else "-"
            lines.append(f" {mark} {r.name:<12} est. {r.seconds * 1e3:.3g} ms ({rel} the "
                         f"cheapest; ms: {cause})" + (f": {r.plan.note}" if r.plan.note else ""))
        if self.chosen == _EMPTY:
            lines[2:] = ["backend: none (B, Sq or Sk is 0: the output is empty or zeros, the "
                         "lse -inf)"]
            return "\n".join(lines)
        elif self.plan.work.syncs:
            lines.append(f"note: the chosen plan reads the device back "
                         f"({self.plan.work.syncs} host syncs)")
        if self.fresh is not None:
            lines.append(f"note: attention() runs {self.chosen}, a choice auto kept from an "
                         f"earlier call (of these arguments, or of calls of this structure), "
                         f"not {self.fresh}, its choice for this call alone "
                         f"(mh.functional.dispatch.clear_cache() forgets kept choices)")
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
    weights = "weights (head mean)" if call.average_weights else "weights"
    wants = [w for w, on in ((weights, call.return_weights), ("lse", call.return_lse),
                             (f"dropout {call.dropout_p}", call.dropout_p > 0),
                             ("gradients", call.requires_grad),
                             ("forward-mode derivatives", call.forward_ad),
                             ("second-order gradients", call.second_order)) if on]
    if wants:
        parts.append("needs " + ", ".join(wants))
    return "; ".join(parts)


def _rows(call: AttentionCall, profile: DeviceProfile, device_type: str) -> list[Row]:
    return [_row(b, call, profile, device_type) for b in registry.all_backends().values()]


def _row(b: Backend, call: AttentionCall, profile: DeviceProfile, device_type: str,
         price: bool = True) -> Row:
    """``b``'s row for ``call``: why it cannot run, or its plan (and, with ``price``, the
    plan's estimated seconds on ``profile``; without, None: the choice is made)."""
    reasons = b.unsupported(call, device_type)
    if reasons:
        return Row(b.name, tuple(reasons))
    plan = b.plan(call, profile)
    if not profile.fits(plan.work):
        return Row(b.name, (f"needs {human_bytes(plan.work.memory)} of scratch memory; "
                            f"{profile.name} has {human_bytes(profile.memory)}",))
    return Row(b.name, (), plan, profile.seconds(plan.work) if price else None)


def _cannot_run(backend: str, reasons, able: list[str]) -> ValueError:
    """The error of a requested backend that cannot run a call: why, and what can."""
    return ValueError(f"backend={backend!r} cannot run this call: it {'; it '.join(reasons)}; "
                      f"use backend='auto' or one of {able}")


def _choose(rows: list[Row], backend: str, profile: DeviceProfile) -> Row:
    able = [r for r in rows if r.plan is not None]
    if backend != AUTO:
        row = next(r for r in rows if r.name == backend)
        if row.plan is None:
            raise _cannot_run(backend, row.reasons, [r.name for r in able])
        return row
    if not able:
        why = "; ".join(f"{r.name} {' and '.join(r.reasons)}" for r in rows)
        raise ValueError(f"no backend can run this call: {why}")
    if profile.avoids_syncs:
        free = [r for r in able if r.plan.work.syncs == 0]
        able = free or able
    if torch.compiler.is_dynamo_compiling():   # (comparing would guard on the sizes)
        taken = [r for r in able if r.plan.traced_choice]
        if taken:
            return taken[0]
    best = able[0]
    for r in able[1:]:                  # a plain loop: torch.compile traces it
        if _hint(r.seconds) < _hint(best.seconds):
            best = r
    return best


def _hint(seconds):
    """An estimate to compare: a traced estimate (a symbolic float of symbolic sizes) at the
    sizes being traced, so that the choice adds no guard on them (every backend is exact:
    the choice is for speed, and ``torch.export`` refuses a guard on a dynamic size). So a
    graph traced with dynamic sizes keeps the backend chosen at the sizes it was traced at,
    for every size it later runs (whether a backend *can* run a size still guards)."""
    if isinstance(seconds, torch.SymFloat):
        hint = seconds.node.hint
        if hint is not None:
            return float(hint)
    return seconds


def _uncached() -> bool:
    """True while ``torch.compile`` traces or a ``torch.func`` transform (grad, vmap) runs:
    decisions are then made afresh, not shared with plain calls (backends differ in what
    they run under a transform)."""
    return tracing() or torch._C._are_functorch_transforms_active()


def _autocast(q, k, v):
    """``(q, k, v, on)``: whether ``torch.autocast`` is on for the inputs' device, and the
    inputs in its dtype where they are in another 16- or 32-bit one (torch's rule for
    attention: every backend then computes alike, and runs with autocast off, in the
    compute dtype it picks)."""
    dtype = autocast_dtype(q.device) if isinstance(q, torch.Tensor) else None
    if dtype is None:
        return q, k, v, False
    cast = lambda t: t.to(dtype) if isinstance(t, torch.Tensor) and t.dtype in AUTOCAST_CASTS \
        else t                                                     # float64 stays, as torch's
    return (*(cast(t) for t in (q, k, v)), True)


def _bucket(n: int) -> int:
    return n if n <= 8 else 1 << (n - 1).bit_length()


def _structure(call: AttentionCall):
    """What auto's choice depends on besides sizes within a factor of 2; None: not shared."""
    m = call.effective_mask
    shape = None if m is None else m.structure()
    if m is not None and shape is None:
        return None
    q, Sq, Sk = call.q, call.Sq, call.Sk
    return (_bucket(call.B), call.H, call.Hkv, call.D, call.Dv, _bucket(Sq), _bucket(Sk),
            Sq == 1, Sq == Sk, Sq < Sk, q.dtype, q.device, call.dropout_p > 0,
            call.return_weights, call.average_weights, call.return_lse, call.requires_grad,
            call.forward_ad, shape,
            m is not None and m.made_for_call(), profiles.generation, registry.generation,
            torch.get_num_threads())
    # (the thread count: the CPU's profile follows it, seen only where a decision is made)


def _decide(call: AttentionCall, backend: str, profile: DeviceProfile,
            device_type: str | None = None):
    """(backend, plan) for a validated call on ``device_type`` (default: the inputs');
    (None, "empty") when B, Sq or Sk is 0."""
    device_type = device_type or call.q.device.type
    if call.B == 0 or call.Sq == 0 or call.Sk == 0:     # nothing to plan; still: could it run?
        reasons = [] if backend == AUTO else registry.get(backend).unsupported(call, device_type)
        if reasons:
            able = [n for n, b in registry.all_backends().items()
                    if not b.unsupported(call, device_type)]
            raise _cannot_run(backend, reasons, able)
        return None, _EMPTY
    if backend != AUTO:     # plan the named backend only (a decoding step whose cache
        named = registry.get(backend)                  # grows plans every call)
        row = _row(named, call, profile, device_type, price=False)
        if row.plan is None:
            raise _cannot_run(backend, row.reasons, [
                r.name for r in _rows(call, profile, device_type) if r.plan is not None])
        return named, row.plan
    structure = None if _uncached() else _structure(call)
    chosen = _CHOICES.get(structure) if structure is not None else None
    if chosen is not None:
        b = registry.all_backends().get(chosen)
        row = _row(b, call, profile, device_type, price=False) if b is not None else None
        if row is not None and row.plan is not None:
            return b, row.plan
    row = _choose(_rows(call, profile, device_type), backend, profile)
    if structure is not None and chosen is None:    # (a choice this call's content cannot
        _CHOICES.put(structure, row.name)           # use, varlen's for documents that are
    return registry.get(row.name), row.plan         # not runs, stays for the calls that can)


def _length_free_key(key: tuple, shapes: tuple, mask):
    """The plan-cache key a decision shares with the calls that differ from this one in
    their key length only, within one power-of-two range and on the same side of the
    query length (as auto's choices are shared, see :func:`_structure`), or None. Only
    calls with no mask in effect (:func:`._call.in_effect`) have one: no mask, or a causal
    one that hides nothing at their lengths (a decoding step's). The calls that share it
    need no validation beyond what the key holds, and k and v agreeing on a non-zero
    length; the decision is kept only where its backend's plan is
    :meth:`~multihead.functional.registry.Backend.length_free`.

    Example:
        >>> import torch, multihead as mh
        >>> q, k = torch.randn(1, 8, 1, 16), torch.randn(1, 2, 100, 16)
        >>> key = ((q.shape, k.shape, k.shape), "the rest")
        >>> _length_free_key(key, key[0], mh.masks.causal())[1:3]    # shapes but Sk, bucket
        ((torch.Size([1, 8, 1, 16]), (1, 2, 16), (1, 2, 16)), 128)
        >>> _length_free_key(key, key[0], mh.masks.sliding_window(8)) is None
        True
    """
    qs, ks, vs = shapes
    if len(qs) != 4 or len(ks) != 4 or len(vs) != 4 or ks[2] != vs[2] or ks[2] == 0:
        return None
    if mask is not None and in_effect(mask, qs[2], ks[2]) is not None:
        return None
    return ("any key length", (qs, (*ks[:2], ks[3]), (*vs[:2], vs[3])), _bucket(ks[2]),
            qs[2] == ks[2], qs[2] < ks[2], key[1:], mask is None)


def check_backend(backend) -> str:
    """``backend`` when it is ``"auto"`` or a registered backend's name; else a TypeError
    (not a str) or a ValueError listing the names.

    Example:
        >>> check_backend("sdpa")
        'sdpa'
    """
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string, got {type(backend).__name__}")
    if backend != AUTO:
        registry.get(backend)
    return backend


def _shared_decision(full_key, args):
    """``(call or None, decision)`` from the plan cache, deciding (and offering the
    decision to the cache, which keeps it from the call's second time) on a miss."""
    decision = _DECISIONS.get(full_key)
    if decision is not None:
        return None, decision
    call, decision = _new_decision(*args)
    _DECISIONS.put(full_key, decision)
    return call, decision


def _new_decision(q, k, v, mask, scale, dropout_p, backend, return_weights, return_lse):
    """Validate the call and decide: ``(call, (backend, plan))``."""
    check_backend(backend)
    call = make_call(q, k, v, mask=mask, scale=scale, dropout_p=dropout_p,
                     return_weights=return_weights, return_lse=return_lse)
    return call, _decide(call, backend, profiles.profile_for(q.device))


def clear_cache() -> None:
    """Forget every cached plan and choice: the next call of each kind decides afresh
    (plans kept on mask objects are not used again, and go with their masks); and free the
    scratch memory blocksparse keeps between calls on the CPU.

    Example:
        >>> clear_cache()
    """
    global _cleared
    from .backend.blocksparse import release_workspaces
    _cleared += 1
    _DECISIONS.clear()
    _CHOICES.clear()
    release_workspaces()


def _plan_keys(q, k, v, mask, scale, dropout_p, backend, return_weights, return_lse,
               lookup=BoundedCache.get):
    """``(key, free, decision)``: the plan cache's key for a call, besides its mask (None
    where its decision is not kept: while compiling, under a ``torch.func`` transform,
    for a tensor scale or arguments that cannot key it); its length-free key
    (:func:`_length_free_key`, or None); and the decision kept under that (found with
    ``lookup``), or None. Only a miss hashes the key (a hit hashed its parts already)."""
    if _uncached() or isinstance(scale, torch.Tensor):
        return None, None, None
    try:         # what determines the plan besides the mask (a miss validates all of it)
        if q.is_nested or k.is_nested or v.is_nested:         # (no sizes to key on)
            raise TypeError
        shapes = (q.shape, k.shape, v.shape)
        key = (shapes, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device, q.layout,
               k.layout, v.layout, scale,
               scale.__class__, dropout_p, dropout_p.__class__, backend, return_weights,
               return_weights.__class__, return_lse, return_lse.__class__,
               torch.is_grad_enabled(), q.requires_grad, k.requires_grad, v.requires_grad,
               fwAD._current_level >= 0 and has_tangent(q, k, v, mask),
               profiles.generation, registry.generation, torch.get_num_threads(), _cleared)
        free = _length_free_key(key, shapes, mask)
        decision = lookup(_DECISIONS, free) if free is not None else None
        if decision is None:
            hash(key)
    except (AttributeError, TypeError):             # the miss path says what is wrong
        return None, None, None
    return key, free, decision


def _slot(key: tuple, mask):
    """Where the decision of a call with plan key ``key`` is kept: ``("shared", its key in
    the plan cache)`` (no mask, or one made of ints: shared by equal masks), ``("mask",
    the mask's cache arguments)`` (a mask holding tensors keeps it), or ``(None, None)``
    (raw tensors, user masks that say nothing: not kept)."""
    if mask is None:
        return "shared", (key, None)
    if isinstance(mask, M.Mask) and mask.memoizable:
        mask_key = mask.cache_key()
        if mask_key is not None:
            return "shared", (key, mask_key)
        return "mask", (key, mask.requires_grad)
    return None, None


def _kept_decision(args: tuple):
    """The decision ``attention(*args)`` takes from a cache, or None where it decides
    (then auto may still take its choice for the call's structure); looks only."""
    key, _, decision = _plan_keys(*args, lookup=BoundedCache.peek)
    if decision is not None or key is None:
        return decision
    where, slot = _slot(key, args[3])
    return _DECISIONS.peek(slot) if where == "shared" else \
        args[3].kept("plan", slot) if where == "mask" else None


def attention(q, k, v, *, mask=None, scale=None, dropout_p=0.0, backend="auto",
              return_weights=False, return_lse=False):
    """Multi-head scaled dot-product attention: ``softmax(q kᵀ · scale + bias) v``.

    Works for MHA (``Hkv == H``), GQA (``H % Hkv == 0``) and MQA (``Hkv == 1``), self- and
    cross-attention (``Sq != Sk``). A query row with nothing to attend to returns zeros.
    ``backend="auto"`` runs the cheapest backend that is exact for the call on the inputs'
    device; see :func:`explain` for the decision. It never synchronizes with a GPU for masks
    made of ints (causal, windows, ALiBi) or built from host data; only a plan that must read
    a device tensor back does (``explain()`` says so), and auto avoids those on GPUs.

    Args:
        q: queries ``(B, H, Sq, D)``.
        k: keys ``(B, Hkv, Sk, D)``.
        v: values ``(B, Hkv, Sk, Dv)``.
        mask: a :mod:`multihead.masks` object (True = may attend), a bool tensor
            (dense), a float tensor (additive bias), or None.
        scale: multiplier of the scores; default ``1 / sqrt(D)``.
        dropout_p: dropout on the attention weights (pass 0.0 at evaluation).
        backend: ``"auto"`` or the name of a backend (:func:`multihead.backends`).
        return_weights: also return the weights ``(B, H, Sq, Sk)``; ``"mean"``: their mean
            over the heads ``(B, Sq, Sk)`` (``torch.nn.MultiheadAttention``'s
            ``average_attn_weights=True``), which the Triton backend writes without the
            weights per head (H times less memory).
        return_lse: also return the log-sum-exp of each score row ``(B, H, Sq)``
            (``-inf`` for rows with nothing to attend to).

    Under ``torch.autocast``, q, k and v (float32 or another half dtype; float64 stays) are
    computed in the autocast dtype on every backend, as ``F.scaled_dot_product_attention``
    is (and the results are in it).

    Returns:
        ``out`` ``(B, H, Sq, Dv)``, or a tuple ``(out, weights?, lse?)`` in that order
        when either extra is requested. ``out`` may be laid out as ``(B, Sq, H, Dv)`` in
        memory (as SDPA's CUDA kernels and ``varlen`` return it, which the heads' merge
        reads without a copy): use ``.reshape`` or ``.contiguous()``, not ``.view``, to
        flatten it.

    Example:
        >>> import torch, multihead as mh
        >>> q, k, v = torch.randn(2, 8, 5, 16), torch.randn(2, 2, 7, 16), torch.randn(2, 2, 7, 16)
        >>> out, w = mh.attention(q, k, v, mask=mh.masks.causal(), return_weights=True)
        >>> out.shape, w.shape
        (torch.Size([2, 8, 5, 16]), torch.Size([2, 8, 5, 7]))
        >>> mh.attention(q, k, v, return_weights="mean")[1].shape      # averaged over heads
        torch.Size([2, 5, 7])

    Shapes:
        B batch, H query heads, Hkv key/value heads, Sq queries, Sk keys,
        D query/key head dim, Dv value head dim.
    """
    refuse_jit_trace("multihead.attention")
    q, k, v, amp = _autocast(q, k, v)
    mask = shared_mask(mask)                    # (a tensor's: decided once for its contents)
    args = (q, k, v, mask, scale, dropout_p, backend, return_weights, return_lse)
    key, free, decision = _plan_keys(*args)
    if decision is not None:
        free = None                                 # found: nothing to offer the cache
    call = None
    where, slot = _slot(key, mask) if key is not None and decision is None else (None, None)
    if where == "shared":
        call, decision = _shared_decision(slot, args)
    elif where == "mask":
        made = []

        def new():
            made.append(_new_decision(*args))
            return made[0][1]
        decision = mask.cached("plan", slot, new)
        call = made[0][0] if made else None
    if decision is None:                            # raw tensors, user masks, compiling
        call, decision = _new_decision(*args)
    if free is not None and decision[0] is not None and decision[0].length_free(decision[1]):
        _DECISIONS.put(free, decision)
    if call is None:                                # validated when the decision was made
        call = AttentionCall(q, k, v, mask, default_scale(q.shape[-1]) if scale is None
                             else float(scale), float(dropout_p), bool(return_weights),
                             return_lse, key[0],     # (the key's first part: the shapes)
                             average_weights=weights_mean(return_weights))
    backend_obj, plan = decision
    if plan is _EMPTY:
        out, w, lse = _empty(call)
    elif amp:               # the inputs are in autocast's dtype; each backend picks its own
        with torch.autocast(q.device.type, enabled=False):      # compute dtype from there
            out, w, lse = nonfinite.run(backend_obj, call, plan)
    else:
        out, w, lse = nonfinite.run(backend_obj, call, plan)
    if plan is not _EMPTY and not backend_obj.capabilities_on(
            call.q.device.type).second_order and second_order.wanted(call):
        out, w, lse = second_order.differentiable_again(call, backend_obj.name, (out, w, lse))
    if call.average_weights and w.dim() == 4:       # (a backend that returns them per head)
        w = w.mean(dim=1)                           # (B, Sq, Sk)
    if not (call.return_weights or call.return_lse):
        return out
    return (out, *(x for x, on in ((w, call.return_weights), (lse, call.return_lse)) if on))


def _empty(call: AttentionCall):
    """B, Sq or Sk is 0: zeros (or empty), still connected to the autograd graph."""
    qg = call.q.reshape(call.B, call.Hkv, call.group * call.Sq, call.D)
    w = qg @ call.k.transpose(-1, -2)                     # (B, Hkv, G*Sq, Sk): zeros or empty
    out = (w @ call.v).view(call.B, call.H, call.Sq, call.Dv)
    lse = call.q.new_full((call.B, call.H, call.Sq), float("-inf"), dtype=call.compute_dtype)
    return out, w.view(call.B, call.H, call.Sq, call.Sk), lse


def explain(q, k, v, *, mask=None, scale=None, dropout_p=0.0, backend="auto",
            return_weights=False, return_lse=False, profile=None) -> Explanation:
    """Say which backend :func:`attention` runs for these arguments, and why.

    Takes the arguments of :func:`attention` and validates them the same way; computes
    nothing but the decision. ``profile`` (a built-in name such as ``"h100"``, or a
    :class:`~multihead.functional.cost.DeviceProfile`) asks what auto would choose on
    another device, e.g. on an H100 from a laptop.

    Example:
        >>> import torch, multihead as mh
        >>> q = torch.randn(1, 4, 128, 32)
        >>> print(mh.explain(q, q, q, mask=mh.masks.causal()))  # doctest: +ELLIPSIS
        attention q (B=1, H=4, Sq=128, D=32), ...
        device profile: cpu ...
        backend: sdpa (chosen by auto: cheapest exact backend)
        ...

    Shapes:
        as :func:`attention`: q (B, H, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, Dv).
    """
    check_backend(backend)
    q, k, v, _ = _autocast(q, k, v)
    mask = shared_mask(mask)
    call = make_call(q, k, v, mask=mask, scale=scale, dropout_p=dropout_p,
                     return_weights=return_weights, return_lse=return_lse)
    if profile is None:
        profile = profiles.profile_for(q.device)
    elif isinstance(profile, str):
        named, own = profiles.get_profile(profile), profiles.profile_for(q.device)
        profile = own if named == own else named      # ("cpu" on the CPU: auto's own)
    elif not isinstance(profile, DeviceProfile):
        raise TypeError(f"profile must be a name ({', '.join(profiles.BUILTIN)}) or a "
                        f"DeviceProfile, got {type(profile).__name__}")
    device_type = profile.device_type
    if call.B == 0 or call.Sq == 0 or call.Sk == 0:     # nothing to plan
        _decide(call, backend, profile, device_type)    # raises if the backend cannot run
        rows = [Row(n, tuple(b.unsupported(call, device_type)))
                for n, b in registry.all_backends().items()]
        return Explanation(_EMPTY, backend, tuple(rows), _describe(call), profile)
    rows = _rows(call, profile, device_type)
    fresh = _choose(rows, backend, profile).name
    runs = None
    if backend == AUTO and device_type == call.q.device.type \
            and profile is profiles.profile_for(call.q.device):         # auto's own figures
        kept = _kept_decision((q, k, v, mask, scale, dropout_p, backend, return_weights,
                               return_lse))
        structure = _structure(call) if kept is None and not _uncached() else None
        runs = kept[0].name if kept is not None else \
            _CHOICES.peek(structure) if structure is not None else None
        if not any(r.name == runs and r.plan is not None for r in rows):   # (a choice this
            runs = None                                        # call's content cannot use)
    return Explanation(runs or fresh, backend, tuple(rows), _describe(call), profile,
                       fresh if runs is not None and runs != fresh else None)


__all__ = ["attention", "explain", "Explanation", "Row", "Backend", "clear_cache"]

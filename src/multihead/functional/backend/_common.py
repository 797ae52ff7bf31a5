"""What several backends share: the mask materialized densely, and facts of fused kernels.

Notation: B' and H' are the mask's batch and head sizes (1 where it does not depend on them).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ... import masks as M
from ...masks.base import versioned
from ...kernels import HUGE_LSE2
from ..._tracing import tracing
from .._call import AttentionCall, traced

#: query rows of one tile of the fused (flash) kernels, and the keys per split when the
#: kernel splits long key ranges across units (flash-decoding): for their parallelism
FUSED_ROWS, KEY_SPLIT = 128, 1024
#: :data:`multihead.kernels.HUGE_LSE2` in natural units (710): |lse| from which the log of a
#: row's sum may be lost from its log-sum-exp (fp32 and fp64 alike; in practice only a huge
#: bias gets a row there). Below it, the weights a backward rebuilds as exp(s - lse) are
#: within about 1e-4 (relative) of the forward's
HUGE_LSE = HUGE_LSE2 * math.log(2)


#: the most tensor bytes of a mask's dense form kept on the mask for its next call
KEPT_MASK_BYTES = 1 << 20


def kept_mask(call: AttentionCall, what: str, args: tuple, build):
    """``build()``: tensors made from the call's mask alone (its dense form for a kernel),
    kept on the mask (:meth:`~multihead.masks.Mask.cached`) for its next calls of the same
    lengths and ``args``: a mask given to every layer of a forward, or to every step of a
    loop, is then built for its first two calls only (a small call's mask took as long as
    its kernel, and on a GPU it is several launches). A mask holding tensors keeps it from
    its second call (a mask made for one call costs no store); one made of ints (causal,
    a window) from its first, shared by equal masks. Kept where they hold at most
    :data:`KEPT_MASK_BYTES`, made outside inference mode (a later call may record
    gradients); only read, never written.

    Built at every call: a mask with a bias (it may be a view of the caller's tensor, or
    need its gradient); one that holds a tensor as the caller gave it
    (:func:`~multihead.masks.dense`, positions, a GPU bool padding: a write through
    ``.data`` or numpy would go unseen; a small host tensor passed to a call as a mask is
    copied, and kept: see :mod:`multihead.masks._content`); and while ``torch.compile``,
    a fake-tensor or tracing mode, or a trace of symbolic lengths runs.

    Example:
        >>> import torch, multihead as mh
        >>> from multihead.functional._call import AttentionCall
        >>> q = torch.zeros(1, 1, 2, 4)
        >>> call = AttentionCall(q, q, q, mh.masks.padding([1]), 0.5, 0.0, False, False)
        >>> build = lambda: call.effective_mask.materialize(2, 2)
        >>> first = kept_mask(call, "doc", (), build)          # a padding mask's first call
        >>> kept_mask(call, "doc", (), build) is kept_mask(call, "doc", (), build)
        True
    """
    m = call.effective_mask
    if (m.has_bias or tracing() or traced(call.Sq, call.Sk)
            or not all(leaf._own_tensors for leaf in m.leaves())):
        return build()
    if m.cache_key() is None and not m.__dict__.get("_dense_again"):
        value = build()
        m.__dict__["_dense_again"] = True           # (its next call keeps what it builds)
        return value

    def made():
        with versioned():
            return build()
    return m.cached(what, (call.Sq, call.Sk) + args, made, limit=KEPT_MASK_BYTES)


def mask_terms(call: AttentionCall, device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The mask's ``(allowed, bias)`` as dense tensors ``(B', H', Sq, Sk)`` (None: none);
    ``allowed`` of a mask without a bias is kept (:func:`kept_mask`)."""
    m = call.effective_mask
    if m is None:
        return None, None
    return kept_mask(call, "dense terms", (device,), lambda: m.at(
        m._index_grid(call.Sq, call.Sk, device, call.compute_dtype)))


def mask_launches(call: AttentionCall) -> int:
    """Ops that materialize the mask (index grids, one predicate or bias per leaf)."""
    m = call.effective_mask
    return 0 if m is None else 6 + 4 * sum(1 for _ in m.leaves())


class BandParts(NamedTuple):
    """The leaves of a mask of the form band & key padding (& documents), None where absent."""

    window: M.Window | None
    padding: M.Padding | None
    document: M.Document | None


def band_parts(mask, *, documents: bool = False):
    """``mask`` as :class:`BandParts` where it is a band (causal, sliding window), key-side
    padding and, with ``documents``, a document mask, at most one of each, alone or joined
    by one ``&``; else the first leaf that does not fit (to name in a reason).

    Example:
        >>> import multihead as mh
        >>> band_parts(mh.masks.causal() & mh.masks.padding([3])).window.describe()
        "causal(align='lower_right')"
        >>> band_parts(mh.masks.sliding_window(4) & mh.masks.alibi(2)).describe()
        "alibi(2, align='lower_right')"
    """
    leaves = [mask] if mask is None or mask.kind != "and" else [mask.a, mask.b]
    found = dict(window=None, padding=None, document=None)
    for leaf in leaves:
        if leaf is None:
            continue
        slot = ("window" if type(leaf) is M.Window else
                "padding" if type(leaf) is M.Padding and leaf.side == "key" else
                "document" if documents and type(leaf) is M.Document else None)
        if slot is None or found[slot] is not None:
            return leaf
        found[slot] = leaf
    return BandParts(**found)

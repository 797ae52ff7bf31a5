"""What several backends share: the mask materialized densely, and facts of fused kernels.

Notation: B' and H' are the mask's batch and head sizes (1 where it does not depend on them).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ... import masks as M
from ...kernels import HUGE_LSE2
from .._call import AttentionCall

#: query rows of one tile of the fused (flash) kernels, and the keys per split when the
#: kernel splits long key ranges across units (flash-decoding): for their parallelism
FUSED_ROWS, KEY_SPLIT = 128, 1024
#: :data:`multihead.kernels.HUGE_LSE2` in natural units (710): |lse| from which the log of a
#: row's sum may be lost from its log-sum-exp (fp32 and fp64 alike; in practice only a huge
#: bias gets a row there). Below it, the weights a backward rebuilds as exp(s - lse) are
#: within about 1e-4 (relative) of the forward's
HUGE_LSE = HUGE_LSE2 * math.log(2)


def mask_terms(call: AttentionCall, device) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The mask's ``(allowed, bias)`` as dense tensors ``(B', H', Sq, Sk)`` (None: none)."""
    m = call.effective_mask
    if m is None:
        return None, None
    return m.at(m._index_grid(call.Sq, call.Sk, device, call.compute_dtype))


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

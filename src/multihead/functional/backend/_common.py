"""What several backends share: the mask materialized densely, and facts of fused kernels.

Notation: B' and H' are the mask's batch and head sizes (1 where it does not depend on them).
"""

from __future__ import annotations

import math

import torch

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
    return m.at(m.index(call.Sq, call.Sk, device, call.compute_dtype))


def mask_launches(call: AttentionCall) -> int:
    """Ops that materialize the mask (index grids, one predicate or bias per leaf)."""
    m = call.effective_mask
    return 0 if m is None else 6 + 4 * sum(1 for _ in m.leaves())

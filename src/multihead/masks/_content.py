"""One mask object for the small host tensors of equal contents that callers pass again.

A torch-style caller (the drop-in ``multihead.nn.MultiheadAttention``, a model's own 4-D
mask) hands every layer of a forward, and every batch of the same padding, a tensor from
which a mask object is built. A new object is a new decision: its rows read, its backend
planned and its plan kept on it (on a 2-core CPU, 0.1 ms of a 0.3 ms call at B=16, S=16).
Keyed by the tensors' contents (not their identity or version counters, which a write
through ``.data`` or a shared numpy array does not change), equal tensors get the object
built for the first, whose decision is made already; a result can never differ from
building it afresh.

Only host tensors of at most :data:`MAX_BYTES` bytes are keyed (reading a device tensor's
contents would synchronize; hashing a large one costs what it saves), and none that
requires a gradient or carries a forward-mode tangent (the mask must hold that very tensor
for its derivative to reach it or be read).
"""

from __future__ import annotations

import torch
import torch.autograd.forward_ad as fwAD

from .._cache import BoundedCache
from .._device import capturing
from .base import Mask, versioned
from .._tracing import tracing

#: the largest tensor (in bytes) whose contents key a mask
MAX_BYTES = 16 << 10

#: (bytes counted: the drop-in's sum of two float masks is as large as their broadcast)
_BUILT = BoundedCache(max_entries=32, max_bytes=8 << 20)


def _content(t: torch.Tensor | None):
    """A hashable stand-in for ``t``'s dtype, shape and values; None where ``t`` cannot key
    one (see the module's rules); ``()`` for no tensor."""
    if t is None:
        return ()
    if (t.device.type != "cpu" or t.requires_grad or t.layout != torch.strided
            or t.is_nested or t.nbytes > MAX_BYTES or type(t) is not torch.Tensor):
        return None
    try:
        values = t.numpy().tobytes()          # (C order, whatever the strides)
    except (RuntimeError, TypeError):         # bfloat16 (numpy lacks it), a negated view
        try:
            values = t.resolve_neg().contiguous().view(torch.uint8).numpy().tobytes()
        except (RuntimeError, TypeError):
            return None
    return t.dtype, tuple(t.shape), values


def by_content(what: str, build, tensors: tuple, extra: tuple = (), *, unkeyed: bool = True):
    """``build(*tensors)``, or the object it returned for earlier tensors of the same
    contents (for the same ``what`` and ``extra``: whatever else ``build`` reads).

    A kept object is built from copies (it shares no memory with a caller's tensor, which
    may be written later), outside inference mode (its tensors may be saved for a backward
    later). It is built afresh, and not kept, while ``torch.compile`` traces, a
    ``torch.func`` transform, a ``TorchDispatchMode`` (fake tensors, say) or a CUDA graph
    capture runs, inside a forward-mode ``dual_level``, and where a tensor cannot key it
    (without ``unkeyed``: not built, None; with it, outside those modes, the mask is marked
    :meth:`~multihead.masks.Mask.made_for_call`). An error ``build`` raises is raised each
    time (nothing is kept).

    Args:
        what: the caller's name for what ``build`` makes (callers that read the same
            tensors differently never share an object).
        build: makes the mask from ``tensors`` (and ``extra``).
        tensors: the tensors ``build`` reads (None for one not given).
        extra: hashable values ``build`` also depends on.
        unkeyed: build a mask that cannot be kept (else return None for it).

    Shapes:
        ``tensors`` any shapes; each of at most :data:`MAX_BYTES` bytes to key an object.

    Example:
        >>> import torch, multihead as mh
        >>> invert = lambda t: mh.masks.dense(~t)
        >>> a = by_content("inverted", invert, (torch.tensor([[False, True]]),))
        >>> a is by_content("inverted", invert, (torch.tensor([[False, True]]),))
        True
        >>> a is by_content("inverted", invert, (torch.tensor([[True, True]]),))
        False
    """
    key = None
    if not (tracing() or torch._C._are_functorch_transforms_active()
            or torch._C._len_torch_dispatch_stack() or capturing()
            or fwAD._current_level >= 0):
        key = tuple(_content(t) for t in tensors)
    if key is None or None in key:
        if not unkeyed:
            return None
        built = build(*tensors)
        if key is not None and isinstance(built, Mask):   # (a tensor no content keys: a
            built._mark_per_call()                         # new object at each eager call)
        return built

    def kept():
        with versioned():                        # (a copy fit for a later backward)
            built = build(*(None if t is None else t.clone() for t in tensors))
        for leaf in built.leaves() if isinstance(built, Mask) else ():
            if not leaf._own_tensors:            # (on copies no caller holds: what is
                leaf.__dict__["_own_tensors"] = True    # derived from them may be kept)
        return built
    return _BUILT.get_or_compute((what, key, extra), kept)

"""Moving small host data (index lists, slopes, lengths) to a device without a host sync.

A plain ``cpu_tensor.to("cuda")`` copies from pageable memory and waits for the copy: a
host-device synchronization that drains the GPU's queue. Copying from pinned memory with
``non_blocking=True`` queues the copy on the current stream instead; torch's pinned-memory
allocator keeps the source alive until the copy has run.

While a CUDA graph captures, a copy is recorded, not run: each replay copies again from the
same pinned buffer, so that buffer is kept (:func:`hold`), and so is every cached device
tensor a captured kernel reads (see :class:`multihead._cache.BoundedCache`).
"""

from __future__ import annotations

import torch

#: what captured CUDA graphs read (cached device tensors, pinned sources of their copies),
#: by id: kept for the life of the process, since a graph reads their memory on every replay
_HELD: dict[int, object] = {}


def capturing() -> bool:
    """True while the current CUDA stream captures a graph (``torch.cuda.graph``): work is
    then recorded to run at each replay, not run. (False while ``torch.compile`` traces:
    traced code caches nothing.)

    Example:
        >>> capturing()
        False
    """
    return (not torch.compiler.is_compiling() and torch.cuda.is_initialized()
            and torch.cuda.is_current_stream_capturing())


def hold(value):
    """Keep ``value`` alive for the rest of the process (a captured graph reads its memory);
    returns it.

    Example:
        >>> import torch
        >>> t = torch.zeros(2)
        >>> hold(t) is t
        True
    """
    _HELD.setdefault(id(value), value)
    return value


def to_device(t: torch.Tensor, device) -> torch.Tensor:
    """``t`` on ``device``; a host tensor is copied without synchronizing the device.

    Example:
        >>> import torch
        >>> to_device(torch.arange(3), "cpu").tolist()
        [0, 1, 2]
    """
    device = torch.device(device)
    if t.device == device or (device.index is None and t.device.type == device.type):
        return t
    if t.device.type != "cpu" or torch.compiler.is_compiling():   # traced: the graph's copy
        return t.to(device)
    if device.type == "cuda":
        # a private pinned copy: the copy runs later, so the caller may reuse its buffer
        t = t.clone().pin_memory() if t.is_pinned() else t.pin_memory()
        if capturing():           # the graph copies from this buffer again at each replay
            hold(t)
    return t.to(device, non_blocking=True)

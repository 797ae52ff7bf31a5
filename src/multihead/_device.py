"""Moving small host data (index lists, slopes, lengths) to a device without a host sync.

A plain ``cpu_tensor.to("cuda")`` copies from pageable memory and waits for the copy: a
host-device synchronization that drains the GPU's queue. Copying from pinned memory with
``non_blocking=True`` queues the copy on the current stream instead; torch's pinned-memory
allocator keeps the source alive until the copy has run.
"""

from __future__ import annotations

import torch


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
    return t.to(device, non_blocking=True)

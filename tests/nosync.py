"""Detecting host-device synchronizations without a GPU.

:class:`NoReadBack` is a dispatch mode that fails on every operation that makes the host
wait for a device: reading a device tensor's value (``item``, ``bool``, ``int``,
``tolist``), data-dependent output shapes (``nonzero``, boolean indexing, ``unique``,
``repeat_interleave`` without ``output_size``), device-to-host copies, and blocking
host-to-device copies. Reading host (CPU) tensors is allowed: those are host facts.

Run under it with tensors on the ``meta`` device, which stands in for an accelerator: a
call that completes never read device data back. On a real GPU the tests also use
``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_DATA_DEPENDENT = {"nonzero", "masked_select", "_unique2", "unique_dim", "unique_consecutive",
                   "unique", "bincount", "histc", "equal", "is_nonzero", "_local_scalar_dense"}


def _on_device(x) -> bool:
    return isinstance(x, torch.Tensor) and x.device.type != "cpu"


class NoReadBack(TorchDispatchMode):
    """Raise ``AssertionError`` naming the op that would synchronize host and device."""

    def __init__(self):
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        flat = list(args) + list(kwargs.values())
        tensors = [a for a in flat if isinstance(a, torch.Tensor)]
        tensors += [t for a in flat if isinstance(a, (list, tuple)) for t in a
                    if isinstance(t, torch.Tensor)]
        self.ops.append(name)
        if name in _DATA_DEPENDENT and any(_on_device(t) for t in tensors):
            raise AssertionError(f"host-device sync: aten.{name} on a device tensor")
        if name == "repeat_interleave" and kwargs.get("output_size") is None and any(
                _on_device(t) for t in tensors):
            raise AssertionError("host-device sync: repeat_interleave without output_size")
        if name in ("index", "index_put", "index_put_") and any(
                t.dtype == torch.bool and _on_device(t) for t in tensors[1:]):
            raise AssertionError(f"host-device sync: aten.{name} with a boolean index")
        if name in ("_to_copy", "copy_", "to"):
            src = args[1] if name == "copy_" else args[0]
            dst_dev = (args[0].device if name == "copy_" else
                       torch.device(kwargs.get("device") or src.device))
            if src.device.type != "cpu" and dst_dev.type == "cpu":
                raise AssertionError(f"host-device sync: aten.{name} from {src.device} to the host")
            if src.device.type == "cpu" and dst_dev.type != "cpu" and not kwargs.get(
                    "non_blocking", len(args) > 2 and args[2] is True):
                raise AssertionError(f"host-device sync: blocking aten.{name} from the host to "
                                     f"{dst_dev}")
        return func(*args, **kwargs)


@contextlib.contextmanager
def cuda_sync_is_an_error():
    """On a GPU: any synchronizing CUDA call inside raises (torch's sync debug mode)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode(0)

"""The cost model: a plan's work in device-neutral units, priced by a device's profile.

A backend states what a call costs it as :class:`Work`: the FLOPs and the kind of kernel
that does them, the bytes it moves through memory, the kernels it launches, the host-device
synchronizations it needs, its scratch memory, and how many independent pieces its main
kernel splits into. A :class:`DeviceProfile` knows what one device does with each unit and
turns work into seconds. So a Python loop of a thousand small ops prices itself out on a
GPU, where a launch costs more than its arithmetic, and stays the cheap plan on a CPU,
without a single ``if device == "cuda"`` in a backend.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

#: the kinds of kernel whose speed a profile knows, in FLOP/s per dtype
KERNELS = {
    "fused": "a fused attention kernel (scores stay on chip), e.g. SDPA's flash kernel",
    "fused_masked": "a fused kernel that also reads a mask or bias per score",
    "matmul": "large matmuls through torch ops (scores materialized)",
    "tiles": "batched matmuls of small tiles through torch ops",
}


def share(fraction: float) -> str:
    """A fraction as a percentage a plan's note can state: one decimal, or two significant
    digits below 0.1% (a window over a long sequence computes a small share, not none).

    Example:
        >>> share(0.125), share(0.00049), share(5e-9), share(0.0)
        ('12.5%', '0.049%', '0.00000050%', '0.0%')
    """
    if 0 < fraction < 1e-3:
        return f"{fraction * 100:.{1 - math.floor(math.log10(fraction * 100))}f}%"
    return f"{fraction:.1%}"


@dataclass(frozen=True)
class Work:
    """What one call costs a plan, in units that mean the same on every device.

    Attributes:
        flops: floating-point operations of its matmuls (2 per multiply-add).
        kernel: which kind of kernel does them (a key of :data:`KERNELS`).
        dtype: the dtype the matmuls run in.
        bytes: bytes read and written in device memory beyond what the FLOPs imply.
        launches: kernel launches (torch ops) issued from the host.
        syncs: host-device synchronizations (reading a device value back).
        memory: peak scratch bytes beyond the inputs and the output.
        parallel: independent work items of the main kernel (tiles x heads x batch).
        fresh: the bytes of each large buffer a call allocates anew (a materialized mask):
            a host allocator maps the largest fresh from the system, page by page.

    Example:
        >>> w = Work(flops=2e9, bytes=1e6, launches=3)
        >>> w.times(flops=3.5).flops
        7000000000.0
    """

    flops: float = 0.0
    kernel: str = "fused"
    dtype: torch.dtype = torch.float32
    bytes: float = 0.0
    launches: float = 0.0
    syncs: int = 0
    memory: float = 0.0
    parallel: float = math.inf
    fresh: tuple = ()

    #: numbers only: a cache's walk for tensors does not enter it (see multihead._cache)
    _cache_no_tensors = True

    def times(self, *, flops: float = 1.0, bytes: float = 1.0, launches: float = 1.0) -> "Work":
        """This work with its FLOPs, bytes and launches scaled (e.g. to add a backward pass)."""
        return dataclasses.replace(self, flops=self.flops * flops, bytes=self.bytes * bytes,
                                   launches=self.launches * launches)


@dataclass(frozen=True)
class DeviceProfile:
    """What one device does with each unit of :class:`Work`.

    Attributes:
        name: a label shown by ``explain()``.
        device_type: ``"cpu"`` or ``"cuda"``; capabilities are checked against it.
        flops: FLOP/s each kind of kernel (a key of :data:`KERNELS`) reaches, per dtype.
        bandwidth: bytes/s of device memory.
        launch_s: host seconds one launched op costs (Python, dispatcher, driver).
        sync_s: seconds one host-device synchronization costs (0 on a CPU). Where it is
            above 0, ``auto`` runs a plan that syncs only if no plan avoids it.
        units: parallel execution units (streaming multiprocessors, CPU threads).
        memory: device memory in bytes; a plan whose scratch does not fit is refused.
        features: facts about the device's kernels that backends read, e.g.
            ``"sdpa_native_gqa"``: SDPA's ``enable_gqa`` reads each K/V head once and keeps
            every query head in parallel.
        mapped_from: buffers of at least this many bytes are mapped fresh from the system
            on every call (glibc's malloc: from 32 MiB), not reused; None: none is.
        fault_s: seconds per byte such a buffer costs on its first write (page faults).
    """

    name: str
    device_type: str
    flops: dict
    bandwidth: float
    launch_s: float
    sync_s: float
    units: int
    memory: float
    features: frozenset = frozenset()
    mapped_from: float | None = None
    fault_s: float = 0.0

    def rate(self, kernel: str, dtype: torch.dtype) -> float:
        """FLOP/s of ``kernel`` in ``dtype`` (its slowest dtype when this one is unknown)."""
        by_dtype = self.flops.get(kernel) or self.flops["matmul"]
        return by_dtype.get(dtype) or min(by_dtype.values())

    @property
    def avoids_syncs(self) -> bool:
        """True where a sync stalls a device's queue: auto then prefers sync-free plans."""
        return self.sync_s > 0

    def breakdown(self, w: Work) -> dict:
        """Seconds by cause: ``compute``, ``memory``, ``launches``, ``syncs``, ``faults``.

        Compute and memory time are stretched when the main kernel has fewer independent
        pieces (``w.parallel``) than the device has units. Faults are the pages of the
        fresh buffers the host allocator maps anew (``w.fresh`` from ``mapped_from`` on).

        Example:
            >>> from multihead.functional.profiles import get_profile
            >>> parts = get_profile("h100").breakdown(Work(launches=1000, syncs=1))
            >>> round(parts["launches"] * 1e3, 1), round(parts["syncs"] * 1e6)    # ms, us
            (6.0, 50)
        """
        rate = self.rate(w.kernel, w.dtype)
        p = w.parallel
        if isinstance(p, (torch.SymInt, torch.SymFloat)):   # traced sizes: min and max as
            stretch = 1.0 / torch.sym_min(1.0, torch.sym_max(p, 1.0) / self.units)  # symbols,
        else:                                       # not a guard that torch.export refuses
            stretch = 1.0 / min(1.0, max(p, 1.0) / self.units)
        mapped = 0.0 if self.mapped_from is None else sum(
            b for b in w.fresh               # (sizes traced as symbols: not priced, no guard)
            if not isinstance(b, (torch.SymInt, torch.SymFloat)) and b >= self.mapped_from)
        return {"compute": w.flops / rate * stretch, "memory": w.bytes / self.bandwidth * stretch,
                "launches": w.launches * self.launch_s, "syncs": w.syncs * self.sync_s,
                "faults": mapped * self.fault_s}

    def seconds(self, w: Work) -> float:
        """The estimated time of ``w`` on this device.

        Example:
            >>> from multihead.functional.profiles import get_profile
            >>> p = get_profile("h100")
            >>> round(p.seconds(Work(flops=1e12, dtype=torch.bfloat16)) * 1e3, 2)   # ms
            1.65
        """
        return sum(self.breakdown(w).values())

    def fits(self, w: Work) -> bool:
        """Whether the plan's scratch memory fits in the device's memory."""
        return w.memory <= 0.9 * self.memory

    def describe(self) -> str:
        """One line: the name and the figures that matter most."""
        bf16, fp32 = self.rate("fused", torch.bfloat16), self.rate("fused", torch.float32)
        return (f"{self.name}: fused attention {_rate(bf16)} bf16 / {_rate(fp32)} fp32, memory "
                f"{self.bandwidth / 1e9:.0f} GB/s, {self.launch_s * 1e6:.1f} us per launch, "
                + (f"{self.sync_s * 1e6:.0f} us per sync (avoided)" if self.avoids_syncs
                   else "syncs free") + f", {self.units} units")


def _rate(flops: float) -> str:
    return f"{flops / 1e12:.0f} TFLOP/s" if flops >= 1e12 else f"{flops / 1e9:.0f} GFLOP/s"

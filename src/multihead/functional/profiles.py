"""Device profiles: what each device does with a unit of work, and where they come from.

``auto`` prices every plan with the profile of the inputs' device (:func:`profile_for`):

- a CPU gets the figures measured on the project's 2-core Xeon (AVX-512), scaled by the
  number of torch threads;
- a CUDA GPU gets a built-in profile chosen by its name (H100, H200, A100; measured on
  those chips), or, for another GPU, the H100's figures scaled by its number of SMs;
- :func:`calibrate` measures this machine's own figures (a few seconds), and
  :func:`set_profile` installs them (or any profile) for a device.

Example:
    >>> import multihead as mh
    >>> mh.profiles.get_profile("h100").units
    132
"""

from __future__ import annotations

import dataclasses
import time

import torch

from .. import _host_memory as host_memory
from .._args import counted
from .cost import DeviceProfile

F16, BF16, F32, F64 = torch.float16, torch.bfloat16, torch.float32, torch.float64


def _scaled(flops: dict, factor: float) -> dict:
    return {kernel: {dt: r * factor for dt, r in by.items()} for kernel, by in flops.items()}


#: measured on the 2-core Xeon (AVX-512, AMX) of the CI and development machines, per torch
#: thread: SDPA's CPU flash kernel with and without a mask, batched score matmuls, and the
#: small-tile matmuls of blocksparse (which computes in fp32 whatever the inputs)
_CPU_PER_THREAD = {
    "fused": {F32: 125e9, BF16: 140e9, F16: 54e9, F64: 40e9},
    "fused_masked": {F32: 85e9, BF16: 90e9, F16: 33e9, F64: 30e9},
    "matmul": {F32: 55e9, BF16: 200e9, F16: 40e9, F64: 30e9},
    "tiles": {F32: 80e9, F64: 40e9},
}
#: glibc's malloc maps a buffer of 32 MiB or more fresh from the system on every call (its
#: largest mmap threshold), and each page faults on its first write: 0.25 ns per byte
#: (64 MiB: 16.8 ms where filling a kept buffer takes 1.7 ms; 2-core AMD EPYC)
_CPU = DeviceProfile(
    name="cpu (2-core Xeon figures)", device_type="cpu", flops=_scaled(_CPU_PER_THREAD, 2),
    bandwidth=20e9, launch_s=4e-6, sync_s=0.0, units=2, memory=24 * 2**30,
    mapped_from=32 * 2**20, fault_s=0.25e-9)

#: measured on an H100 80GB HBM3 (torch 2.11, CUDA 13): bf16 GEMM 712 TFLOP/s, 2.8 TB/s read;
#: SDPA's flash kernel ~605 TFLOP/s, its kernel with a dense mask ~280 TFLOP/s
_H100 = DeviceProfile(
    name="H100", device_type="cuda",
    flops={"fused": {BF16: 605e12, F16: 605e12, F32: 40e12, F64: 10e12},
           "fused_masked": {BF16: 278e12, F16: 278e12, F32: 25e12, F64: 8e12},
           "matmul": {BF16: 600e12, F16: 600e12, F32: 50e12, F64: 50e12},
           "tiles": {BF16: 250e12, F16: 250e12, F32: 20e12, F64: 15e12}},
    bandwidth=2.8e12, launch_s=6e-6, sync_s=50e-6, units=132, memory=80 * 2**30,
    features=frozenset({"sdpa_native_gqa"}))

BUILTIN = {
    "cpu": _CPU,
    "h100": _H100,
    "h200": dataclasses.replace(_H100, name="H200", bandwidth=4.0e12, memory=141 * 2**30),
    "a100": dataclasses.replace(_H100, name="A100", units=108, bandwidth=1.7e12,
                                flops=_scaled(_H100.flops, 0.4), memory=80 * 2**30),
}

_OVERRIDES: dict[str, DeviceProfile] = {}
_RESOLVED: dict[str, DeviceProfile] = {}
#: bumped whenever a profile changes, so cached dispatch decisions are dropped
generation = 0


def get_profile(name: str) -> DeviceProfile:
    """A built-in profile by name: ``"cpu"``, ``"h100"``, ``"h200"`` or ``"a100"``.

    Example:
        >>> get_profile("h200").bandwidth / 1e12    # TB/s
        4.0
    """
    if not isinstance(name, str) or name not in BUILTIN:
        raise ValueError(f"unknown profile {name!r}: choose one of {', '.join(BUILTIN)}, or "
                         f"measure this machine with multihead.profiles.calibrate(device)")
    if name == "cpu":
        return _cpu_profile()
    return BUILTIN[name]


def _cpu_profile() -> DeviceProfile:
    threads = max(1, torch.get_num_threads())
    return dataclasses.replace(_CPU, flops=_scaled(_CPU_PER_THREAD, threads), units=threads,
                               memory=_host_capacity(),
                               name=f"cpu (2-core Xeon figures, {counted(threads, 'thread')})")


def _cuda_profile(device: torch.device) -> DeviceProfile:
    props = torch.cuda.get_device_properties(device)
    name = props.name.upper()
    for key in ("H200", "H100", "A100"):
        if key in name:
            return dataclasses.replace(BUILTIN[key.lower()], name=props.name,
                                       memory=float(props.total_memory))
    return dataclasses.replace(
        _H100, name=f"{props.name} (H100 figures scaled by SMs)",
        flops=_scaled(_H100.flops, props.multi_processor_count / _H100.units),
        units=props.multi_processor_count, memory=float(props.total_memory))


def _device_key(device) -> str:
    """``"cpu"`` (CPU tensors carry no index), ``"cuda"``, ``"cuda:1"``...; a clear error."""
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError, ValueError):
        raise ValueError(f"device must name a device such as 'cpu', 'cuda' or 'cuda:1', got "
                         f"{device!r}") from None
    return "cpu" if device.type == "cpu" else str(device)


def profile_for(device) -> DeviceProfile:
    """The profile ``auto`` uses for ``device`` (an installed one first, then the default).
    The CPU's follows ``torch.set_num_threads`` (seen at the next decision made). While
    ``torch.compile`` or ``torch.export`` traces, a device without an installed profile is
    priced with the built-in figures (the CPU's, or the H100's for CUDA), not the ones
    resolved for it eagerly: a graph does not depend on which calls ran before it (a
    traced and an eager call may then choose differently on a GPU other than an H100, or
    with another thread count).

    Example:
        >>> profile_for("cpu").device_type
        'cpu'
    """
    global generation
    key = _device_key(device)
    device = torch.device(key)
    found = _OVERRIDES.get(key) or _OVERRIDES.get(device.type)
    if found is None and torch.compiler.is_compiling():
        # tracing: the built-in figures, not those an eager call resolved (a guard on what
        # _RESOLVED holds would recompile the graph once an eager call fills it; and no
        # thread-count or device query in a graph)
        return _H100 if device.type == "cuda" else dataclasses.replace(
            _CPU, **_as_device(device.type))
    found = found or _RESOLVED.get(key)
    if (found is not None and found is _RESOLVED.get(key) and device.type != "cuda"
            and found.units != max(1, torch.get_num_threads())):
        found = None                  # torch.set_num_threads since: priced again, and the
        generation += 1               # decisions made with the old count are dropped
    if found is None:
        if device.type == "cuda":
            found = _cuda_profile(device)
        else:       # the CPU, and devices without figures of their own (priced as the CPU)
            found = dataclasses.replace(_cpu_profile(), **_as_device(device.type))
        _RESOLVED[key] = found
    return found


def _as_device(device_type: str) -> dict:
    """The CPU's figures for another device without its own: its type, and no host
    allocator's fresh mappings (its memory is not glibc's)."""
    return dict(device_type=device_type,
                mapped_from=_CPU.mapped_from if device_type == "cpu" else None)


def set_profile(device, profile: DeviceProfile | str | None) -> None:
    """Use ``profile`` for ``device`` (a type such as ``"cuda"``, or ``"cuda:1"``); None
    restores the default. Decisions cached under the old profile are dropped.

    Example:
        >>> set_profile("cuda", "h200")      # price CUDA calls with the H200's figures
        >>> set_profile("cuda", None)        # back to the default
    """
    global generation
    key = _device_key(device)
    if isinstance(profile, str):
        profile = get_profile(profile)
    elif profile is not None and not isinstance(profile, DeviceProfile):
        raise TypeError(f"profile must be a DeviceProfile, a built-in name "
                        f"({', '.join(BUILTIN)}) or None, got {type(profile).__name__}")
    if profile is None:
        _OVERRIDES.pop(key, None)
    else:
        _OVERRIDES[key] = profile
    _RESOLVED.clear()
    generation += 1


def _best(fn, device: torch.device, reps: int = 5) -> float:
    """Fastest of ``reps`` timed calls of ``fn`` after one warm-up, in seconds."""
    fn()
    best = float("inf")
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t)
    return best


def calibrate(device="cpu") -> DeviceProfile:
    """Measure this machine's profile for ``device`` (about ten seconds; install it with
    :func:`set_profile`).

    Times, per dtype, SDPA's fused kernel with and without a dense mask, a batch of score
    matmuls and of small-tile matmuls; a read of a large tensor; tiny ops back to back (the
    host cost of a launch); and a device round trip (a sync).

    Example:
        >>> p = calibrate("cpu")                                  # doctest: +SKIP
        >>> set_profile("cpu", p)                                 # doctest: +SKIP
    """
    device = torch.device(_device_key(device))
    cuda = device.type == "cuda"
    if cuda and not torch.cuda.is_available():
        raise ValueError(f"calibrate: device {str(device)!r} is not available here (no CUDA "
                         f"GPU): calibrate 'cpu'")
    base = profile_for(device)
    S, D, H = (4096, 128, 16) if cuda else (1024, 64, 8)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    mask = torch.rand(S, S, device=device) > 0.5
    flops = {kernel: dict(by) for kernel, by in base.flops.items()}
    for dt in ((BF16, F16, F32) if cuda else (F32, BF16)):
        q = torch.randn(1, H, S, D, device=device, dtype=dt)
        tiles = torch.randn(H * 64, 64, D, device=device, dtype=dt)
        keys = torch.randn(H * 64, D, 512, device=device, dtype=dt)
        attn = 4 * H * S * S * D
        flops["fused"][dt] = attn / _best(lambda: sdpa(q, q, q), device)
        flops["fused_masked"][dt] = attn / _best(lambda: sdpa(q, q, q, attn_mask=mask), device)
        flops["matmul"][dt] = 2 * H * S * S * D / _best(lambda: q @ q.transpose(-1, -2), device)
        flops["tiles"][dt] = 2 * H * 64 * 64 * D * 512 / _best(lambda: tiles @ keys, device)
    x = torch.ones((256 if cuda else 64) * 2**20, device=device)
    bandwidth = x.nbytes / _best(lambda: x.sum(), device)
    fault_s = base.fault_s
    if device.type == "cpu" and base.mapped_from is not None:   # a mapped buffer's first
        n = min(int(2 * base.mapped_from) // 4, x.numel())         # write, less a kept one's
        fault_s = max(0.0, _best(lambda: torch.empty(n).fill_(1.0), device)
                      - _best(lambda: x[:n].fill_(1.0), device)) / (4 * n)
    tiny = torch.zeros(1, device=device)
    t = time.perf_counter()
    for _ in range(200):
        tiny.add_(1)
    launch = (time.perf_counter() - t) / 200
    sync = _best(lambda: tiny.sum().item(), device) if cuda else 0.0
    return dataclasses.replace(
        base, name=f"{base.name.split(' (')[0]} (calibrated {time.strftime('%Y-%m-%d')})",
        flops=flops, bandwidth=bandwidth, launch_s=launch, sync_s=sync, fault_s=fault_s,
        memory=float(torch.cuda.get_device_properties(device).total_memory) if cuda
        else _host_capacity())


def _host_capacity() -> float:
    """What the process may hold: the machine's RAM within its cgroup and rlimit."""
    n = host_memory.capacity()
    return float(_CPU.memory if n is None else n)

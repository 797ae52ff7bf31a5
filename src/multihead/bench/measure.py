"""Peak memory and the machine's own limits, on the CPU or a CUDA GPU (times: ``timing``).

Peak memory is the allocator's high-water mark above the memory in use before the call
(CUDA), or the peak of the profiler's CPU allocation events (CPU).
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from dataclasses import dataclass

import torch

from .timing import Stats, measure  # noqa: F401 (re-exported: benchmarks/ time with it)

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
#: torch's names (float32, bfloat16, float16), accepted as the short ones, as ``multihead
#: params --dtype`` accepts them
DTYPE_ALIASES = {str(dt).removeprefix("torch."): short for short, dt in DTYPES.items()}


def peak_memory(fn, device: torch.device) -> int:
    """Bytes allocated at the peak of ``fn()`` beyond what was allocated before it."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - base
    from torch.profiler import ProfilerActivity, profile
    global _primed
    with _native_stderr_silenced():
        if not _primed:       # torch warns once, in C++, when memory allocated before a
            _primed = True    # profile is freed inside it: met here, where it is silenced
            early = [torch.empty(1)]
            warm = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            warm.start()
            early.clear()
            warm.stop()
        prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        prof.start()
    try:
        fn()
    finally:
        with _native_stderr_silenced():
            prof.stop()
    return _cpu_peak(prof)


_primed = False               # the profiler's one warning met (see peak_memory)


def _cpu_peak(prof) -> int:
    """The highest running total of the profiler's CPU allocation records (each allocation
    +bytes, each release -bytes, in time order): one count per allocation, scratch freed
    inside an op included. An op event's ``cpu_memory_usage`` would not do: it counts its
    children's allocations again at every level of nesting."""
    cpu = torch.autograd.DeviceType.CPU
    try:                                 # (the records are kineto's: a torch without them
        events = prof.profiler.kineto_results.events()       # gets each op's own allocations)
        steps = sorted((e.start_ns(), e.nbytes()) for e in events
                       if e.name() == "[memory]" and e.device_type() == cpu)
    except AttributeError:
        steps = sorted((e.time_range.start, e.self_cpu_memory_usage) for e in prof.events())
    cur = peak = 0
    for _, n in steps:
        cur += n
        peak = max(peak, cur)
    return peak


@contextlib.contextmanager
def _native_stderr_silenced():
    """File descriptor 2 to /dev/null for the block: the profiler's C++ side prints
    "profiler_start"/"profiler_stop" lines there on every start and stop, which no
    setting turns off (only its start and stop are inside; the measured call is not).
    The descriptor is the process's: for that moment another thread's stderr (a progress
    bar's refresh) goes nowhere too."""
    with contextlib.suppress(AttributeError, ValueError, OSError):
        sys.stderr.flush()
    try:
        saved = os.dup(2)
    except OSError:                         # (no fd 2 at all: nothing to silence)
        yield
        return
    try:
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, 2)
        finally:
            os.close(null)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


@dataclass
class Limits:
    """This machine's ceilings, measured in the same run as the cases."""

    gemm_flops: float     # FLOP/s of a large GEMM in the benchmark dtype
    read_bw: float        # bytes/s of a full read of a large tensor


def machine_limits(device: torch.device, dtype: torch.dtype, quick: bool = False) -> Limits:
    """Measure this machine's matmul FLOP/s and memory read bandwidth, now (the best of
    several repetitions: a limit is what the machine can reach)."""
    n = 1024 if quick else 4096
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    t = measure(lambda: a @ b, device, reps=5, warmup=2).low
    x = torch.ones((128 if quick else 512) * 2**20 // 4, device=device)
    bw = measure(lambda: x.sum(), device, reps=7, warmup=2).low
    return Limits(2 * n ** 3 / t, x.nbytes / bw)


def describe(device: torch.device) -> str:
    """CPU model and cores (or GPU name), torch and Python versions."""
    if device.type == "cuda":
        hw = torch.cuda.get_device_name(device)
    else:
        hw = platform.processor() or "unknown CPU"
        try:
            with open("/proc/cpuinfo") as f:
                hw = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), hw)
        except OSError:
            pass
        hw += f", {torch.get_num_threads()} threads"
    return f"{hw}; torch {torch.__version__}; Python {platform.python_version()}"

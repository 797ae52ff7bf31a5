"""How long one call takes: wall clock on the CPU, CUDA events on a GPU.

- CPU: ``reps`` single calls after warm-up, each timed by ``time.perf_counter``; the median,
  and the fastest and slowest call as the spread.
- CUDA, warm caches (the default): ``n`` back-to-back calls between two CUDA events make a
  *batch*. ``n`` doubles from 1 until one batch lasts at least :data:`MIN_BATCH_S`, so that
  launch gaps and the events' resolution (about a microsecond) do not dominate small
  kernels. Each batch follows one untimed call issued just before its first event, so the
  device is busy when the timing starts and the host's lead into the first call (its
  Python before the first launch, 50-150 us for a training step) is not counted: without
  it, a 0.86 ms forward + backward timed as batches of one call read 1.05-1.3 ms on an
  H100. A call whose host time exceeds its device time is still timed at the host's pace
  (the device waits between calls, as it would in a loop). Batches repeat until the
  spread of their per-call times is at most :data:`TARGET_SPREAD` (after at least
  ``reps`` batches) or the time budget is spent; a measurement that did not get there is
  reported as not settled, with the spread it had.
- CUDA, cold L2 (``cold_l2=True``): before every call a buffer twice the size of the L2
  cache is written, so every call starts with a cold cache; events surround the call alone,
  and calls are timed singly (the flush cannot sit inside a batch).

The batching and settling logic takes a :class:`Clock` (an event factory and a sync), so it
runs on the CPU too with :class:`WallEvent` standing in for ``torch.cuda.Event``.
"""

from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass
from typing import Callable

import torch

#: a CUDA batch lasts at least this long (launch gaps and event resolution become noise)
MIN_BATCH_S = 1e-3
#: batches repeat until (slowest - fastest) / median is at most this, or the budget is spent
TARGET_SPREAD = 0.05
#: CPU: single calls whose (slowest - fastest) / median exceeds this are reported as not
#: settled (a loaded machine: the ratios of such a row may flip)
CPU_SPREAD = 0.5
#: the machine is busy when, as a run begins, at least this many other threads per core
#: the run may use are running or waiting to run (the run takes every core)
BUSY_LOAD = 0.5
#: CUDA: the fewest batches (or cold calls) behind a median
MIN_GPU_REPS = 5
#: the most back-to-back calls in one batch
MAX_CALLS = 1 << 14


@dataclass
class Stats:
    """Seconds per call: the median, the fastest and slowest repetition, and how many ran.

    A repetition is one call (CPU, cold L2) or one batch of ``calls`` back-to-back calls
    (CUDA), whose per-call time is the batch's time / ``calls``.
    """

    median: float       # seconds per call
    low: float
    high: float
    reps: int
    calls: int = 1              # back-to-back calls per repetition
    settled: bool = True        # the spread reached TARGET_SPREAD before the budget ran out

    @property
    def spread(self) -> float:
        """(max - min) / median."""
        return (self.high - self.low) / self.median if self.median else 0.0


def spread(times: list[float]) -> float:
    """(max - min) / median of ``times``.

    Example:
        >>> round(spread([1.0, 1.02, 0.99]), 6)
        0.03
    """
    s = sorted(times)
    mid = s[len(s) // 2]
    return (s[-1] - s[0]) / mid if mid else 0.0


def _stats(times: list[float], calls: int = 1, settled: bool = True) -> Stats:
    s = sorted(times)
    return Stats(s[len(s) // 2], s[0], s[-1], len(s), calls, settled)


class WallEvent:
    """The host clock behind ``torch.cuda.Event``'s timing API (``record``, ``elapsed_time``
    in ms), for running the CUDA timing logic on the CPU; ``now`` may be a fake clock."""

    def __init__(self, now: Callable[[], float] = time.perf_counter):
        self.now, self.t = now, None

    def record(self) -> None:
        self.t = self.now()

    def elapsed_time(self, end: "WallEvent") -> float:
        return (end.t - self.t) * 1e3


@dataclass
class Clock:
    """Where times come from: ``event()`` makes an event, ``sync()`` waits for the device."""

    event: Callable[[], object]
    sync: Callable[[], None]

    @classmethod
    def cuda(cls, device: torch.device) -> "Clock":
        return cls(lambda: torch.cuda.Event(enable_timing=True),
                   lambda: torch.cuda.synchronize(device))

    @classmethod
    def wall(cls, now: Callable[[], float] = time.perf_counter) -> "Clock":
        return cls(lambda: WallEvent(now), lambda: None)


def time_batch(fn, n: int, clock: Clock) -> float:
    """Seconds that ``n`` back-to-back calls of ``fn`` take between two events, the first
    event issued after one more call (untimed: the device is busy when timing starts)."""
    start, end = clock.event(), clock.event()
    fn()
    start.record()
    for _ in range(n):
        fn()
    end.record()
    clock.sync()
    return start.elapsed_time(end) / 1e3


def batch_size(fn, clock: Clock, min_batch_s: float = MIN_BATCH_S,
               max_calls: int = MAX_CALLS) -> int:
    """The first power of two ``n`` for which ``n`` calls last at least ``min_batch_s``.

    Each size is timed twice and the faster time counts: a first batch that pays a
    one-off cost (a lazily built plan, a cold allocator) does not stop the doubling early.

    Example:
        >>> fake = [0.0]
        >>> def call(): fake[0] += 3e-4                        # a 0.3 ms call
        >>> batch_size(call, Clock.wall(now=lambda: fake[0]))   # 4 calls = 1.2 ms
        4
    """
    n = 1
    while n < max_calls and min(time_batch(fn, n, clock) for _ in range(2)) < min_batch_s:
        n *= 2
    return n


def time_cold(fn, flush: Callable[[], None], k: int, clock: Clock) -> list[float]:
    """Seconds of each of ``k`` single calls, each after ``flush()``; the events surround
    the call only, and the device is synchronized once at the end."""
    pairs = []
    for _ in range(k):
        flush()
        start, end = clock.event(), clock.event()
        start.record()
        fn()
        end.record()
        pairs.append((start, end))
    clock.sync()
    return [a.elapsed_time(b) / 1e3 for a, b in pairs]


def settle(draw: Callable[[], list[float]], *, min_reps: int, budget_s: float,
           target: float = TARGET_SPREAD, max_reps: int = 200,
           now: Callable[[], float] = time.perf_counter) -> tuple[list[float], bool]:
    """Call ``draw()`` (a few per-call times) until the last ``min_reps`` times have a spread
    of at most ``target`` (then those are returned: an early outlier, a clock ramping up, is
    left behind as warm-up), or until ``budget_s`` or ``max_reps`` is reached (then every
    time is returned, outliers included); returns the times and whether they settled.

    Example:
        >>> times, ok = settle(lambda: [1.0], min_reps=5, budget_s=1.0)
        >>> len(times), ok
        (5, True)
    """
    times, start = [], now()
    while True:
        times += draw()
        if len(times) < min_reps:
            continue
        if spread(times[-min_reps:]) <= target:
            return times[-min_reps:], True
        if now() - start > budget_s or len(times) >= max_reps:
            return times, False


def measure_batched(fn, clock: Clock, *, reps: int = MIN_GPU_REPS, budget_s: float = 3.0,
                    min_batch_s: float = MIN_BATCH_S, target: float = TARGET_SPREAD,
                    now: Callable[[], float] = time.perf_counter) -> Stats:
    """Per-call time from batches of back-to-back calls (see the module docstring).

    Example:
        >>> s = measure_batched(lambda: sum(range(100)), Clock.wall(), budget_s=0.5)
        >>> s.calls > 1 and s.reps >= 5 and s.low <= s.median <= s.high
        True
    """
    n = batch_size(fn, clock, min_batch_s)
    time_batch(fn, n, clock)                        # one more warm batch at full length, unused
    times, ok = settle(lambda: [time_batch(fn, n, clock) / n], min_reps=reps,
                       budget_s=budget_s, target=target, now=now)
    return _stats(times, n, ok)


def measure_cold(fn, clock: Clock, flush: Callable[[], None], *, reps: int = MIN_GPU_REPS,
                 budget_s: float = 3.0, target: float = TARGET_SPREAD,
                 now: Callable[[], float] = time.perf_counter) -> Stats:
    """Per-call time of single calls, each after ``flush()`` (cold L2), in rounds of ``reps``.

    Example:
        >>> flushes = []
        >>> s = measure_cold(lambda: None, Clock.wall(), lambda: flushes.append(1), budget_s=0.1)
        >>> len(flushes) >= s.reps >= 5, s.calls         # one flush before every call
        (True, 1)
    """
    times, ok = settle(lambda: time_cold(fn, flush, reps, clock), min_reps=reps,
                       budget_s=budget_s, target=target, now=now)
    return _stats(times, 1, ok)


def flush_bytes(l2_bytes: int | None) -> int:
    """Bytes to write to evict the L2 cache: twice its size, or 256 MiB when it is unknown.

    Example:
        >>> flush_bytes(50 * 2**20) // 2**20, flush_bytes(0) // 2**20
        (100, 256)
    """
    return 2 * l2_bytes if l2_bytes else 256 * 2**20


def _l2_flush_bytes(device: torch.device) -> int:
    return flush_bytes(getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0))


@functools.lru_cache(maxsize=None)
def l2_flusher(device: torch.device) -> Callable[[], None]:
    """A function that writes a buffer larger than ``device``'s L2 cache (kept for the
    process: one allocation per device)."""
    return torch.empty(_l2_flush_bytes(device), dtype=torch.uint8, device=device).zero_


def measure(fn, device: torch.device, *, reps: int = 5, warmup: int = 1,
            budget_s: float | None = None, cold_l2: bool = False) -> Stats:
    """Median time of ``fn()`` on ``device`` (wall clock on the CPU, CUDA events on a GPU).

    On the CPU, ``reps`` calls, stopping early (at least 3) once ``budget_s`` is spent. On
    CUDA, at least ``max(reps, MIN_GPU_REPS)`` batches (or cold calls with ``cold_l2``)
    until their spread settles or ``budget_s`` (default 3 s) is spent.

    Example:
        >>> s = measure(lambda: sum(range(1000)), torch.device("cpu"), reps=5)
        >>> s.reps, s.low <= s.median <= s.high
        (5, True)
    """
    if device.type != "cuda":
        if cold_l2:
            raise ValueError(f"cold_l2=True needs a CUDA device (it flushes the GPU's L2 cache "
                             f"before each call), got device {device.type!r}")
        return _measure_wall(fn, reps, warmup, budget_s)
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize(device)
    clock, budget = Clock.cuda(device), 3.0 if budget_s is None else budget_s
    reps = max(reps, MIN_GPU_REPS)
    if cold_l2:
        return measure_cold(fn, clock, l2_flusher(device), reps=reps, budget_s=budget)
    return measure_batched(fn, clock, reps=reps, budget_s=budget)


def _measure_wall(fn, reps: int, warmup: int, budget_s: float | None) -> Stats:
    """The CPU's timing: single calls, wall clock."""
    for _ in range(warmup):
        fn()
    times, start = [], time.perf_counter()
    for i in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
        if budget_s is not None and i >= 2 and time.perf_counter() - start > budget_s:
            break
    return _stats(times, settled=spread(times) <= CPU_SPREAD)


def others_running() -> float | None:
    """Threads of other programs running or waiting to run now: the median of a few looks
    at Linux's count (``/proc/loadavg``), less this one; elsewhere the 1-minute load
    average less this one (the average also remembers the last minute: a run just
    finished, this process's start). None where neither can be read.

    Example:
        >>> n = others_running()
        >>> n is None or n >= 0
        True
    """
    try:
        looks = []
        for _ in range(5):
            with open("/proc/loadavg") as f:
                looks.append(int(f.read().split()[3].split("/")[0]) - 1)   # (ourselves)
            time.sleep(0.02)
        return float(sorted(looks)[2])
    except (OSError, ValueError, IndexError):
        try:
            return max(0.0, os.getloadavg()[0] - 1)
        except (AttributeError, OSError):
            return None


def usable_cores() -> int:
    """The cores this process may run on (its affinity, where the system has one).

    Example:
        >>> usable_cores() >= 1
        True
    """
    return (len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
            else os.cpu_count()) or 1


def busy_note(others: float | None, cores: int) -> str:
    """A sentence when other work runs as a run begins (``others`` threads running or
    waiting, past :data:`BUSY_LOAD` per core): its times, and the ratios between them, may
    not hold (calls stall for whole time slices, and a row can look settled at a stall's
    length). Empty where the load is low, or unknown (None).

    Example:
        >>> busy_note(0.0, 2), busy_note(None, 2)
        ('', '')
        >>> busy_note(1.0, 2)
        'The machine was busy as the run began (1 other thread running on 2 cores): times, and the ratios between them, may not hold; run again on an idle machine.'
    """
    if others is None or others < BUSY_LOAD * cores:
        return ""
    threads = f"{others:.3g} other thread{'' if others == 1 else 's'}"
    return (f"The machine was busy as the run began ({threads} running on {cores} "
            f"core{'s' if cores > 1 else ''}): times, and the ratios between them, may not "
            f"hold; run again on an idle machine.")


def describe_timing(device: torch.device, cold_l2: bool = False) -> str:
    """One sentence: how the times of a run on ``device`` were taken."""
    if device.type != "cuda":
        return (f"Times: wall clock, median of single calls after a warm-up; a row whose "
                f"slowest and fastest calls differ by more than {CPU_SPREAD:.0%} of it is "
                f"marked unsettled.")
    if cold_l2:
        return (f"Times: CUDA events around single calls, L2 cache flushed before each (a "
                f"{_l2_flush_bytes(device) // 2**20} MiB write); medians of at least "
                f"{MIN_GPU_REPS} calls, repeated until their spread is at most "
                f"{TARGET_SPREAD:.0%}.")
    return (f"Times: CUDA events around batches of back-to-back calls lasting at least "
            f"{MIN_BATCH_S * 1e3:g} ms (per call = batch / calls), each batch after one "
            f"untimed call so the device is already busy; medians of at least "
            f"{MIN_GPU_REPS} batches, repeated until their spread is at most {TARGET_SPREAD:.0%}.")

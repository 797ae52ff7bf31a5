"""Device facts: host data moved without a sync, CUDA graph capture, cross-stream use.

Small host data (index lists, slopes, lengths) moves to a device without a host sync. A
plain ``cpu_tensor.to("cuda")`` copies from pageable memory and waits for the copy: a
host-device synchronization that drains the GPU's queue. Copying from pinned memory with
``non_blocking=True`` queues the copy on the current stream instead; torch's pinned-memory
allocator keeps the source alive until the copy has run.

While a CUDA graph captures, a copy is recorded, not run: each replay copies again from the
same pinned buffer, so that buffer is kept (:func:`hold`), and so is every cached device
tensor a captured kernel reads (see :class:`multihead._cache.BoundedCache`).

A cached device tensor made on one CUDA stream and read on another is ordered after its
making and kept from reuse until the reading stream is done with it (:class:`StreamUse`).

Loading a kernel's module is a call a capture forbids; :func:`relaxed_capture` lets this
thread make it while a graph captures (CUDA's relaxed capture mode).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import sys

import torch

from . import _host_memory

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


#: ``CU_STREAM_CAPTURE_MODE_RELAXED``: the thread may make potentially unsafe calls
_RELAXED = 2


@functools.lru_cache(maxsize=None)
def _capture_mode_swap():
    """The driver's ``cuThreadExchangeStreamCaptureMode``, or None without a CUDA driver."""
    try:
        lib = ctypes.CDLL("nvcuda.dll" if sys.platform == "win32" else "libcuda.so.1")
        swap = lib.cuThreadExchangeStreamCaptureMode
    except (OSError, AttributeError):
        return None
    swap.argtypes, swap.restype = [ctypes.POINTER(ctypes.c_int)], ctypes.c_int
    return swap


@contextlib.contextmanager
def relaxed_capture():
    """Within the block, this thread may make calls that a CUDA graph capture in the
    default (global) mode forbids, such as loading a kernel's module: CUDA's relaxed
    capture mode for this thread, the previous mode restored on the way out. (PyTorch's
    allocator does the same around its own such calls.) Without a CUDA driver, nothing
    changes.

    Raises:
        RuntimeError: when the driver refuses the mode (its error code is shown).

    Example:
        >>> with relaxed_capture():
        ...     pass
    """
    swap = _capture_mode_swap()
    if swap is None:
        yield
        return
    mode = ctypes.c_int(_RELAXED)
    status = swap(ctypes.byref(mode))
    if status != 0:
        raise RuntimeError(f"multihead: cuThreadExchangeStreamCaptureMode failed (CUresult "
                           f"{status}) while making this thread's capture mode relaxed")
    try:
        yield
    finally:
        swap(ctypes.byref(mode))                  # mode now holds the previous one


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


def usable_device(name: str, device) -> torch.device:
    """``device`` as the concrete device tensors made on it report (``"cuda"`` ->
    ``cuda:0``; None: torch's default device), or a ValueError naming the argument: not a
    device, or not one this machine has (a CPU-only torch asserts on ``"cuda"``; that is a
    ValueError here too).

    Example:
        >>> usable_device("device", "cpu")
        device(type='cpu')
    """
    try:
        device = None if device is None else torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"{name} must be a torch.device or a name such as 'cpu' or 'cuda:0', "
                         f"got {device!r:.60}") from None
    try:
        return torch.empty(0, device=device).device
    except (RuntimeError, AssertionError) as e:
        why = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"{name} {str(device)!r} cannot be used here ({why}): pass "
                         f"{name}='cpu', or a device this machine has") from None


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


class _Cuda:
    """The CUDA stream calls of :class:`StreamUse` (one seam, which the CPU tests replace)."""

    @staticmethod
    def index(t: torch.Tensor) -> int | None:
        """The CUDA device index of ``t``, or None for a tensor of another device."""
        return t.device.index if t.is_cuda else None

    _raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)    # CUDA builds only

    @classmethod
    def current_id(cls, index: int) -> int:
        """The current stream of device ``index``, as its raw handle (cheap to compare)."""
        if cls._raw is not None:
            return cls._raw(index)
        return torch.cuda.current_stream(index).cuda_stream

    @staticmethod
    def current(index: int):
        return torch.cuda.current_stream(index)

    @staticmethod
    def event_on(stream):
        """An event recorded on ``stream`` now."""
        event = torch.cuda.Event()
        event.record(stream)
        return event

    @staticmethod
    def keep_for(t: torch.Tensor, stream) -> None:
        t.record_stream(stream)


class StreamUse:
    """Where the CUDA tensors of a cached value were made: the stream, per device. A later
    use on another stream first waits for what the making stream has queued by then (which
    includes their making: they may still be being computed), and records that stream on
    the tensors, so that their memory is not handed out again while its kernels may read
    them (the cache may let them go at any time). Each stream pays this once; a value used
    on the stream that made it pays nothing (no event is made when it is stored).

    Streams are told apart by their raw handles: an external stream destroyed while a value
    it made is still cached, whose handle CUDA then gives to a new stream, passes for it.

    Example:
        >>> import torch
        >>> StreamUse.of([torch.zeros(2)]) is None              # no CUDA tensor: nothing to do
        True
    """

    __slots__ = ("made", "seen")

    def __init__(self, made: dict):
        self.made = made                 # device index -> (stream, [tensors])
        self.seen: set = set()           # (device index, stream handle) already ordered

    @classmethod
    def of(cls, tensors) -> StreamUse | None:
        """The record for ``tensors`` made on the current streams (None: no CUDA tensor)."""
        by_device: dict[int, list] = {}
        for t in tensors:
            index = _CUDA.index(t)
            if index is not None:
                by_device.setdefault(index, []).append(t)
        if not by_device:
            return None
        return cls({index: (_CUDA.current(index), ts) for index, ts in by_device.items()})

    def order_here(self) -> None:
        """Make the current streams safe users of the tensors (see the class)."""
        for index, (made_on, tensors) in self.made.items():
            here = _CUDA.current_id(index)
            if here == made_on.cuda_stream or (index, here) in self.seen:
                continue
            stream = _CUDA.current(index)
            stream.wait_event(_CUDA.event_on(made_on))
            for t in tensors:
                _CUDA.keep_for(t, stream)
            self.seen.add((index, here))


_CUDA = _Cuda


def free_memory(device: torch.device) -> int | None:
    """Bytes an allocation on ``device`` can still take, or None where that is not known
    (no /proc/meminfo, an MPS or meta device): CUDA's free memory plus what torch's caching
    allocator holds unused (it is reused first), or the host's (``MemAvailable``, or less
    where the process's cgroup or ``ulimit -v`` leaves less: see :mod:`multihead._host_memory`).

    Example:
        >>> free_memory(torch.device("meta")) is None
        True
    """
    if device.type == "cuda":
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + unused
    return _host_memory.free() if device.type == "cpu" else None


def check_fits(need: int, device: torch.device, what: str, fix: str) -> None:
    """Raise a ValueError (``"{what} {need}, but {device} has {free} free: {fix}"``) when
    ``need`` bytes exceed the free memory of ``device``: a buffer too large refused by the
    arguments that sized it, not by the allocator. Only a need over 1 GiB is checked (a
    small one asks nothing: no file read, no device query), and where free memory is not
    known nothing is refused.

    Example:
        >>> check_fits(2**20, torch.device("cpu"), "a small buffer takes", "")   # not asked
        >>> check_fits(2**80, torch.device("cpu"), "ids would take", "is it the total?")
        Traceback (most recent call last):
        ...
        ValueError: ids would take 1.0 YiB, but cpu has ... free: is it the total?
    """
    if need <= 2**30:
        return
    free = free_memory(device)
    if free is not None and need > free:
        from .analysis.params import human_bytes
        raise ValueError(f"{what} {human_bytes(need)}, but {device} has {human_bytes(free)} "
                         f"free: {fix}")


def available_memory(device: torch.device) -> int:
    """:func:`free_memory`, or 8 GiB where it is not known.

    Example:
        >>> available_memory(torch.device("cpu")) > 0
        True
    """
    free = free_memory(device)
    return 8 * 2**30 if free is None else free

"""Compiling the backward's kernels while the forward's compile (first use, issue 12).

A process's first training step compiles each kernel it launches, one after another: the
forward, then at ``backward()`` the dQ and the dK/dV kernels, over a second each (Triton's
front end, MLIR passes and ptxas, which let other threads run meanwhile). So when a forward
that will need gradients runs for the first time, :func:`compile_ahead` starts a thread
that runs the backward's wrapper on stand-in tensors of the ``meta`` device (their shapes,
strides and dtypes, no memory) with every launch turned into Triton's warm-up: the kernels
are compiled (each in its own worker where Triton can compile asynchronously) and kept in
Triton's caches, and nothing runs on the device. The backward then waits for that thread
(:func:`wait`) and finds its kernels compiled. A process about to exit waits for compiles
in flight (Triton's workers are not daemons).

A stand-in's data pointer is 0, which Triton specializes as 16-byte aligned, as it does
the buffers torch allocates; a backward whose real tensors differ (a gradient of other
strides, say) compiles its own kernels, as it would have without this. Nothing the thread
does can fail the user's call: an error there is dropped, and the real launch reports it.

Under Triton's interpreter (nothing to compile) nothing runs ahead.
"""

from __future__ import annotations

import contextlib
import os
import threading

import torch

from .. import _device

#: keys of the compiles started (each starts once per process)
_STARTED: set = set()
#: threads compiling now
_RUNNING: list = []
_LOCAL = threading.local()
#: compile workers per thread ahead (Triton >= 3.5 compiles a kernel in a worker)
WORKERS = 4


def active() -> bool:
    """True in a thread compiling ahead: a launch is Triton's warm-up, not a run."""
    return getattr(_LOCAL, "ahead", False)


def enabled() -> bool:
    """False under Triton's interpreter, or with ``MULTIHEAD_COMPILE_AHEAD=0``."""
    if os.environ.get("MULTIHEAD_COMPILE_AHEAD", "1") == "0":
        return False
    try:
        from triton import knobs
        return not knobs.runtime.interpret
    except (ImportError, AttributeError):                     # pragma: no cover - old Triton
        return os.environ.get("TRITON_INTERPRET", "0") in ("", "0")


def stand_in(t: torch.Tensor | None) -> torch.Tensor | None:
    """A ``meta`` tensor of ``t``'s shape, strides and dtype (None stays None).

    Example:
        >>> s = stand_in(torch.zeros(2, 3).t())
        >>> s.device.type, s.shape, s.stride()
        ('meta', torch.Size([3, 2]), (1, 3))
    """
    if t is None:
        return None
    return torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta")


def compile_ahead(key, device: torch.device, prepare) -> None:
    """Once per ``key``: call ``prepare()`` here, in the caller's thread (what must read
    the caller's state: plans, caches), and run the function it returns (a kernel wrapper's
    call on stand-ins) in a background thread whose launches only compile; :func:`wait`
    joins it. ``prepare`` may return None (nothing to compile); an error in it is dropped.

    Nothing starts while a CUDA graph captures (the key stays unused): what ``prepare``
    computes on the device (a plan's block lists, say) would be captured into every replay.

    Example:
        >>> compile_ahead(("doc", 1), torch.device("cpu"), lambda: lambda: None); wait()
    """
    if key in _STARTED or _device.capturing():
        return
    _STARTED.add(key)
    if not enabled():
        return
    try:
        fn = prepare()
    except Exception:             # noqa: BLE001 - the real call reports it
        return
    if fn is None:
        return

    def work():
        _LOCAL.ahead = True
        try:
            where = (torch.cuda.device(device) if device.type == "cuda"
                     else contextlib.nullcontext())
            with where, _workers():
                fn()
        except Exception:         # noqa: BLE001 - the real launch compiles and reports it
            pass

    thread = threading.Thread(target=work, name="multihead-compile-ahead", daemon=True)
    try:
        thread.start()
    except RuntimeError:          # no thread to be had: the backward compiles, as before
        return
    _RUNNING.append(thread)


def wait() -> None:
    """Wait for the compiles running ahead (a backward's launches then find them; two
    backwards at once both wait).

    Example:
        >>> wait()
    """
    for thread in list(_RUNNING):
        thread.join()
        with contextlib.suppress(ValueError):     # another waiter removed it
            _RUNNING.remove(thread)


@contextlib.contextmanager
def _workers():
    """Triton's asynchronous compile mode over a few threads, where it has one: each
    warm-up hands its compile to a worker, and leaving waits for them all."""
    try:
        from concurrent.futures import ThreadPoolExecutor

        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:                                       # pragma: no cover - old Triton
        yield
        return
    with ThreadPoolExecutor(WORKERS, thread_name_prefix="multihead-compile") as pool, \
            AsyncCompileMode(pool):
        yield

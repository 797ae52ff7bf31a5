"""Launching our Triton kernels: on their tensors' device, with fewer pipeline stages where
shared memory is short, and past Triton's per-call path once a kernel is compiled.

``kernel[grid](*args)`` costs about 19 us of host time per call on the CI's 2-core Xeon
(Triton 3.6 and 3.9, a 37-argument kernel): binding the arguments, computing their
specialization, the cache lookup, option parsing and hooks, before the driver's launch.
A decoding step over a short cache takes less than that on an H100, so the host sets the
pace. :func:`launch` remembers the compiled kernel of each call *class* and launches it
directly (about 7 us), where the class is finer than Triton's specialization of the
arguments:

- tensors: their dtypes and which are 16-byte aligned (what Triton specializes on);
- integers: their exact values, except the parameters a kernel declares
  ``do_not_specialize``, which Triton types only (32 or 64 bits): a decoding step's length
  and offset change every call and hit the same entry;
- floats, booleans, ``None`` and tuples of these or of tensors: exact values (tensors in a
  tuple by dtype and alignment);
- the type of every argument after the tensors (an int 2 and a float 2.0 are equal values
  that Triton types i32 and fp32);
- the constexprs, the stages asked, the device, and Triton's debug, instrumentation and
  float-sanitizer settings.

Two calls of one class get the same kernel from Triton's own path, so the direct launch
runs what Triton would have run, with the same arguments (``tests/test_triton_compile.py``
checks it against Triton's launch path). Triton's path still runs the first call of a
class, calls under the interpreter, calls with launch or compiler-stage hooks set
(profilers, compiler tools), and Triton older than 3.4 (whose launch conventions differ).

While a CUDA graph captures, a kernel that this process has not launched yet is compiled
and its module loaded before the launch, under CUDA's relaxed capture mode for this thread
(:func:`multihead._device.relaxed_capture`): Triton loads a module on a kernel's first
launch, and a capture forbids that call ("operation not permitted when stream is
capturing"). A capture may well meet a kernel its eager warm-up did not run: a device
mask's contents may change between replays, so while capturing a call does not use facts
read from them earlier and may take another route.
"""

from __future__ import annotations

import functools
import operator
import os

import torch
from triton.runtime import driver
from triton.runtime.errors import OutOfResources

from .. import _device
from . import _ahead, _triton_key

try:                                                # Triton >= 3.4
    from triton import knobs as _knobs
except ImportError:                                 # pragma: no cover - older Triton
    _knobs = None


def _settings() -> tuple:
    """Triton's settings that change what it compiles per call: debug (and, from 3.5,
    the instrumentation mode; from 3.9, the float sanitizer's casts)."""
    return (_knobs.runtime.debug,
            getattr(_knobs.compilation, "instrumentation_mode", None),
            getattr(_knobs.compilation, "fpsan_homomorphic_casts", None))

#: per launch (kernel, device, stages asked, constexprs): the most pipeline stages whose
#: buffers fit the device's shared memory, learned when a launch with more ran out of it
#: (empty on GPUs where the tables fit, so a launch there pays one truth test)
_STAGE_CAP: dict = {}

#: whether launches may skip Triton's per-call path (``MULTIHEAD_TRITON_DIRECT=0`` turns
#: it off, for a check that Triton's own path gives the same)
DIRECT = os.environ.get("MULTIHEAD_TRITON_DIRECT", "1") != "0"
#: call class (see the module docstring) -> (compiled kernel, the constexpr values that
#: follow the positional arguments, in parameter order)
_CLASSES: dict = {}
#: the most call classes remembered (a program with endlessly new shapes starts over)
DIRECT_MAX = 4096
#: per kernel: (leading tensor arguments, positions among the rest that are not
#: specialized, positions that hold tuples), from its first launch
_LAYOUT: dict = {}

#: compile option of every launch: the kernels fold the score scale and the running maximum
#: into one fused multiply-add per score. Triton 3.9 fuses by default but warns that 3.10
#: will not, so the launches ask for it (``TRITON_FORCE_DISABLE_FP_FUSION`` still wins)
FP_FUSION = True

_I32 = (-(1 << 31), (1 << 31) - 1)
_ptr = torch.Tensor.data_ptr
_dtype = operator.attrgetter("dtype")


def launch(kernel, grid, *args, num_stages: int, **kwargs) -> None:
    """``kernel[grid](*args, num_stages=num_stages, **kwargs)`` on the device of
    ``args[0]``, with fewer stages where the device's shared memory cannot hold that many
    (the tables are measured on an H100, 227 KB per SM; an A100 has 163 KB, most other GPUs
    99 KB). Stages only change how far ahead tiles are copied: the tiles, the grid and the
    results stay. The stages that fit are remembered per kernel, device and constexprs, so
    a later launch does not fail first. A call whose class (module docstring) ran before
    launches its compiled kernel directly. In a thread compiling ahead
    (:mod:`._ahead`), the launch only compiles.

    Raises:
        RuntimeError: when even one stage does not fit (the tiles are too large for this
            GPU: a launch table with smaller ones fixes it), or the GPU lacks another
            resource the launch needs (threads: fewer warps).

    Example:
        >>> import torch
        >>> from multihead.kernels.flash_fwd import _forward
        >>> launch(_forward, grid, q, k, v, ..., BLOCK_M=128, num_stages=3)  # doctest: +SKIP
    """
    if _ahead.active():                              # compiling ahead: nothing runs
        here = torch.cuda.current_device() if torch.cuda.is_initialized() else -1
        _warmup(kernel, grid, args, _capped(kernel, here, num_stages, kwargs), kwargs)
        return
    device = args[0].get_device()
    if device >= 0 and device != torch.cuda.current_device():
        with torch.cuda.device(device):              # Triton launches on the current device
            return launch(kernel, grid, *args, num_stages=num_stages, **kwargs)
    key = _call_class(kernel, device, num_stages, args, kwargs)
    hit = _CLASSES.get(key) if key is not None else None
    if hit is not None and _plain(kernel):
        compiled, tail = hit
        g0, g1, g2 = (*grid, 1, 1)[:3]
        stream = driver.active.get_current_stream(driver.active.get_current_device())
        compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata, None,
                     None, None, *args, *tail)
        return
    compiled = _triton_launch(kernel, grid, device, args, num_stages, kwargs)
    if key is not None and _compiled(compiled) and _plain(kernel):
        if len(_CLASSES) >= DIRECT_MAX:
            _CLASSES.clear()
        if _hashable_values(key[-1]):
            _CLASSES[key] = (compiled, tuple(
                kwargs[p.name] if p.name in kwargs else p.default
                for p in kernel.params[len(args):]))


def forget() -> None:
    """Forget the stages learned to fit and the compiled kernels of every call class: the
    next launch of each goes through Triton's own path (``benchmarks/triton_tune.py`` runs
    each config as written this way).

    Example:
        >>> forget(); len(_CLASSES), len(_STAGE_CAP)
        (0, 0)
    """
    _STAGE_CAP.clear()
    _CLASSES.clear()


def _triton_launch(kernel, grid, device: int, args: tuple, num_stages: int, kwargs: dict):
    """Triton's own launch, with fewer stages where shared memory is short; returns what
    Triton returns (the compiled kernel; None under the interpreter)."""
    _triton_key.install()
    stages = _capped(kernel, device, num_stages, kwargs)
    while True:
        try:
            if _device.capturing():
                _load_for_capture(kernel, grid, args, stages, kwargs)
            return kernel[grid](*args, num_stages=stages, enable_fp_fusion=FP_FUSION,
                                **kwargs)
        except OutOfResources as e:
            if e.name != "shared memory" or stages <= 1:
                fix = ("fewer warps" if e.name == "threads" else "smaller tiles")
                raise RuntimeError(
                    f"multihead's Triton kernel {kernel.fn.__name__} needs more {e.name} than "
                    f"this GPU has ({e.required} > {e.limit}) with tiles {_tiles(kwargs)}: "
                    f"write a launch table with {fix} for it (python -m "
                    f"benchmarks.triton_tune --write FILE, then MULTIHEAD_TRITON_LAUNCH=FILE) "
                    f"or run backend='sdpa'") from e
            stages -= 1
            _STAGE_CAP[_cap_key(kernel, device, num_stages, kwargs)] = stages
            _CLASSES.clear()     # classes remembered before the cap: Triton's path now
                                 # takes fewer stages for them too (rare: once per cap)


def _capped(kernel, device: int, num_stages: int, kwargs: dict) -> int:
    """The stages to ask for: ``num_stages``, or fewer where this device was found to fit
    fewer (one truth test where it fits them all)."""
    if not _STAGE_CAP:
        return num_stages
    return _STAGE_CAP.get(_cap_key(kernel, device, num_stages, kwargs), num_stages)


def _warmup(kernel, grid, args: tuple, num_stages: int, kwargs: dict):
    """Compile (or find in Triton's caches) the kernel this launch would run, running
    nothing; returns it, not yet loaded."""
    _triton_key.install()
    return kernel.warmup(*args, grid=grid, num_stages=num_stages, enable_fp_fusion=FP_FUSION,
                         **kwargs)


def _load_for_capture(kernel, grid, args: tuple, num_stages: int, kwargs: dict) -> None:
    """While a CUDA graph captures: compile (or find) the kernel this launch runs and load
    its module now, in CUDA's relaxed capture mode, so that the launch itself makes no call
    the capture forbids (see the module docstring). Raises what loading raises
    (``OutOfResources`` where the kernel needs more shared memory than the device has)."""
    compiled = _warmup(kernel, grid, args, num_stages, kwargs)
    load = getattr(compiled, "_init_handles", None)
    if load is None or getattr(compiled, "module", None) is not None:   # loaded already
        return
    with _device.relaxed_capture():
        load()


def _call_class(kernel, device: int, num_stages: int, args: tuple, kwargs: dict):
    """The call's class (module docstring) as a hashable key, or None where the direct
    launch does not apply (no Triton knobs, the direct launch turned off, an argument
    in a place its kernel's first launch had another kind of value)."""
    if _knobs is None or not DIRECT:
        return None
    layout = _LAYOUT.get(id(kernel))                 # (a kernel's own hash is slow Python)
    if layout is None:
        layout = _LAYOUT[id(kernel)] = _layout(kernel, args)
    if not layout:                                   # the interpreter's kernels
        return None
    n_tensors, dynamic, tuples = layout
    try:
        tensors = args[:n_tensors]
        ptrs = tuple(map(_ptr, tensors))
        aligned = (not functools.reduce(operator.or_, ptrs) & 15
                   or tuple(p & 15 == 0 for p in ptrs))      # Triton's: per tensor
        rest = list(args[n_tensors:])
        kinds = tuple(map(type, rest))               # 2 and 2.0 (i32 and fp32) hash alike
        for i in dynamic:                            # Triton: 32 or 64 bits, not the value
            if _I32[0] <= rest[i] <= _I32[1]:
                rest[i] = True
        for i in tuples:
            rest[i] = _tuple_class(rest[i])
    except (TypeError, AttributeError):              # not the first launch's kinds
        return None
    return (id(kernel), device, num_stages, _settings(), tuple(map(_dtype, tensors)),
            aligned, tuple(kwargs.items()), kinds, tuple(rest))


def _layout(kernel, args: tuple) -> tuple:
    """``(leading tensors, unspecialized positions, tuple positions)`` among ``args``, the
    latter two counted from the first non-tensor; ``()`` for a kernel Triton does not
    compile (the interpreter's)."""
    if not hasattr(kernel, "params"):
        return ()
    n = 0
    while n < len(args) and isinstance(args[n], torch.Tensor):
        n += 1
    params = kernel.params[n:len(args)]
    return (n, tuple(i for i, p in enumerate(params) if p.do_not_specialize),
            tuple(i for i, a in enumerate(args[n:]) if isinstance(a, tuple)))


def _tuple_class(t: tuple) -> tuple:
    # tensors in a tuple by dtype and alignment, the rest by value
    return tuple((x.dtype, _ptr(x) & 15 == 0) if isinstance(x, torch.Tensor) else x
                 for x in t)


def _hashable_values(rest: tuple) -> bool:
    """Whether a class's plain values are plain scalars (no tensor, which would hash by
    identity and be kept alive by the table)."""
    plain = (int, float, bool, type(None), torch.dtype)
    return all(isinstance(x, plain) or (isinstance(x, tuple) and _hashable_values(x))
               for x in rest)


def _plain(kernel) -> bool:
    """No launch hooks (a profiler's), no pre-run hooks and no compiler-stage inspection
    hook (3.9: it adds to each call's specialization): Triton's path does nothing the
    direct launch skips."""
    rt = _knobs.runtime                  # hooks: a callable or None; from 3.6 a chain
    return (not getattr(rt.launch_enter_hook, "calls", rt.launch_enter_hook)
            and not getattr(rt.launch_exit_hook, "calls", rt.launch_exit_hook)
            and not kernel.pre_run_hooks
            and getattr(rt, "add_stages_inspection_hook", None) is None)


def _compiled(obj) -> bool:
    # a kernel Triton compiled and loaded (the interpreter returns None, a warm-up an
    # unloaded kernel)
    return (getattr(obj, "function", None) is not None
            and hasattr(obj, "run") and hasattr(obj, "packed_metadata"))


def _cap_key(kernel, device: int, num_stages: int, kwargs: dict) -> tuple:
    """What decides a launch's shared memory: the kernel, the device, the stages asked and
    the constexprs (a mask program by identity: its hash is Python, and slow)."""
    return (id(kernel), device, num_stages, tuple(
        (k, v if v is None or isinstance(v, (bool, int, float, str)) else id(v))
        for k, v in kwargs.items()))


def _tiles(kwargs: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in kwargs.items() if k.startswith("BLOCK"))

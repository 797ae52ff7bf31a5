"""Tracers and multihead: ``torch.jit.trace`` refused, with what to use instead, and code
that ``torch.compile`` must run eagerly.

A trace records the tensor ops of one call and replays them for every later input. Our
calls choose a backend, a tile plan and RoPE's table rows from the sizes and the mask they
are given, in Python, so a replay with another mask or length would run the first call's
plan: silently wrong. ``torch.compile`` and ``torch.export.export`` trace those choices
exactly (with guards), so the refusal points there. The drop-in for
``torch.nn.MultiheadAttention`` is the exception: its trace runs torch's own forward.
"""

from __future__ import annotations

import functools

import torch


#: torch's own dispatch modes whose tensors hold no values of their own: fake tensors, a
#: ``make_fx`` trace's proxies, functionalization (``torch.export``)
_VALUELESS = tuple(getattr(torch._C._TorchDispatchModeKey, name, None)
                   for name in ("FAKE", "PROXY", "FUNCTIONAL"))


_compiling, _modes = torch.compiler.is_compiling, torch._C._len_torch_dispatch_stack
#: the dispatch key ``make_fx(pre_dispatch=True)`` turns on for its proxy mode, which it keeps
#: on a stack of its own (torch.export's pre-dispatch trace)
_PRE_DISPATCH = torch._C.DispatchKey.PreDispatch
_pre_dispatch = torch._C._dispatch_tls_is_dispatch_key_included
#: that stack's two slots (torch._ops' list, changed in place; 0.03 us to compare where the
#: key's test takes 0.2, and no thread but the tracing one has the key): a list that never
#: compares equal where this torch has none
_PRE_SLOTS = getattr(getattr(torch._ops, "_mode_stack_state_for_pre_dispatch", None),
                     "_ModeStackStateForPreDispatch__infra_modes", None)
_PRE_SLOTS, _NO_PRE = (_PRE_SLOTS, [None] * len(_PRE_SLOTS)) \
    if isinstance(_PRE_SLOTS, list) else (["unknown"], None)


def valueless() -> bool:
    """True while a fake-tensor mode, a ``make_fx`` trace (before or after dispatch) or
    functionalization is on: what is made then holds no values (or a graph's), and no
    cache may keep it for later calls. Other dispatch modes (``FlopCounterMode``, a logging
    mode) compute real tensors.

    Example:
        >>> import torch
        >>> from torch._subclasses.fake_tensor import FakeTensorMode
        >>> with FakeTensorMode():
        ...     inside = valueless()
        >>> inside, valueless()
        (True, False)
    """
    if _modes() and any(key is not None and torch._C._get_dispatch_mode(key) is not None
                        for key in _VALUELESS):
        return True
    return _PRE_SLOTS != _NO_PRE and _pre_dispatch(_PRE_DISPATCH) and any(
        key is not None and torch._ops._get_dispatch_mode_pre_dispatch(key) is not None
        for key in _VALUELESS[1:])                    # (its stack holds these two kinds)


def check_when_run(t: torch.Tensor, ok, message: str) -> None:
    """Values a traced graph cannot read (``torch.compile``, ``torch.export``): the graph
    raises ``RuntimeError(message)`` each time it runs with ``ok()`` false, for ``t`` on the
    host. On a GPU that check would be a device-side assert, which ends the CUDA context:
    there ``ok`` is not built and nothing is checked.

    Example:
        >>> import torch
        >>> n = torch.tensor([3, 9])
        >>> check_when_run(n, lambda: (n <= 8).all(), "a length past S = 8")
        Traceback (most recent call last):
        ...
        RuntimeError: a length past S = 8
    """
    if t.device.type == "cpu":
        torch._assert_async(ok(), message)


def refuse_jit_trace(what: str) -> None:
    """Raise a RuntimeError naming ``what`` while ``torch.jit.trace`` records.

    Example:
        >>> refuse_jit_trace("multihead.attention")      # not tracing: nothing happens
    """
    if torch.jit.is_tracing():
        raise RuntimeError(
            f"{what} cannot be recorded by torch.jit.trace: a trace keeps the plan of the "
            f"one call it saw (its backend, the tiles its mask rules out, RoPE's table), so "
            f"other masks or lengths would run it wrongly; use torch.export.export or "
            f"torch.compile, which trace it exactly (or, for a drop-in for "
            f"torch.nn.MultiheadAttention, multihead.nn.MultiheadAttention: its trace runs "
            f"torch's implementation)")


def concrete(x):
    """``x`` for an error message: a number ``torch.compile`` traces as symbolic (dynamic
    shapes, a float argument) as the value it has in this call, which a message can format
    (Dynamo cannot format a symbolic number, and ``fullgraph=True`` then reports that in
    place of our message). Call it only on the way to raising, or where a text is asked
    for (a mask's ``describe()``): it specializes the trace on ``x`` (a guard). Not
    :func:`multihead.functional.capabilities.shown`, which never specializes.

    Args:
        x: anything; numbers (symbolic or not) come back as Python numbers, the rest as is.

    Returns:
        ``x``'s value in this call.

    Example:
        >>> concrete(3), concrete(0.5), concrete("k")
        (3, 0.5, 'k')
    """
    if isinstance(x, (int, float, torch.SymInt, torch.SymFloat, torch.SymBool)):
        from torch.fx.experimental.symbolic_shapes import guard_scalar
        return guard_scalar(x)
    return x


def shape_text(t) -> str:
    """``t``'s shape for an error message, ``(2, 4, 64, 16)``, with traced sizes as this
    call's (so only on the way to raising, or where a text is asked for: see
    :func:`concrete`).

    Args:
        t: a tensor, anything else with a ``shape``, or not (shown as ``()``); None.

    Returns:
        The shape as a tuple's text; ``"None"`` for None.

    Example:
        >>> shape_text(torch.zeros(2, 3)), shape_text(None), shape_text([1, 2])
        ('(2, 3)', 'None', '()')
    """
    return "None" if t is None else str(tuple(concrete(s) for s in getattr(t, "shape", ())))


def _levels(t):
    """``t`` and the tensors ``torch.func`` wrapped it around, outermost first (just ``t``
    outside any transform)."""
    yield t
    if torch._C._are_functorch_transforms_active():
        from torch._C._functorch import get_unwrapped, maybe_get_level
        while maybe_get_level(t) != -1:
            t = get_unwrapped(t)
            yield t


def vmapped(t) -> bool:
    """Whether ``t`` is batched by a running ``torch.func.vmap`` (at any level): each
    sample's values differ, so none can be read on the host for all.

    Example:
        >>> from torch.func import vmap
        >>> seen = []
        >>> _ = vmap(lambda x: seen.append(vmapped(x)) or x)(torch.zeros(3, 2))
        >>> seen, vmapped(torch.zeros(3))
        ([True], False)
    """
    from torch._C._functorch import is_batchedtensor
    return isinstance(t, torch.Tensor) and any(is_batchedtensor(x) for x in _levels(t))


def vmapped_empty(*tensors) -> bool:
    """Whether a tensor among ``tensors`` is batched by ``torch.func.vmap`` over a
    dimension of size 0 (its storage is empty, whatever its per-sample shape), which
    torch's fused attention kernels have no batching rule for."""
    from torch._C._functorch import get_unwrapped, is_batchedtensor
    return torch._C._are_functorch_transforms_active() and any(
        is_batchedtensor(x) and get_unwrapped(x).numel() == 0
        for t in tensors if isinstance(t, torch.Tensor) for x in _levels(t))


def eager_under_compile(reason: str):
    """Decorator: ``fn`` runs as written; under ``torch.compile`` it is a graph break
    (``torch.compiler.disable`` with ``reason``, which ``fullgraph=True`` reports), the
    wrapper built on the first call made while a compile is active on the thread, so
    importing multihead does not import ``torch._dynamo`` (a second, at a decorator's
    definition).

    Example:
        >>> @eager_under_compile("keeps a count in Python")
        ... def step(x):
        ...     return x + 1
        >>> step(1)
        2
    """
    def wrap(fn):
        disabled = None

        @functools.wraps(fn)
        def call(*args, **kwargs):
            nonlocal disabled
            if not torch.compiler.is_compiling() and _callback() is None:   # no compile on
                return fn(*args, **kwargs)                                  # this thread
            if disabled is None:
                disabled = torch.compiler.disable(fn, reason=reason)
            return disabled(*args, **kwargs)
        # what torch.compiler.disable marks, set without importing Dynamo: a trace does not
        # enter `call` (built inside one, the wrapper was refused as "marked as skipped",
        # which fullgraph=True reported in place of the reason)
        call._torchdynamo_disable, call._torchdynamo_disable_msg = True, reason
        return call
    return wrap


def _callback():
    """The frame-evaluation callback ``torch.compile`` installs on this thread, or None."""
    return torch._C._dynamo.eval_frame.get_eval_frame_callback()


def tracing() -> bool:
    """True where tensors' values cannot be read on the host: while ``torch.compile`` or
    ``torch.export`` traces, or a fake-tensor mode, a ``make_fx`` trace or
    functionalization is on (:func:`valueless`). Code that reads a mask's values to plan
    takes then the path a traced graph takes: it computes in the graph what it would have
    read, and keeps nothing.

    Example:
        >>> import torch
        >>> from torch.fx.experimental.proxy_tensor import make_fx
        >>> seen = []
        >>> graph = make_fx(lambda x: seen.append(tracing()) or x + 1)(torch.zeros(2))
        >>> seen, tracing()
        ([True], False)
    """
    return _compiling() or valueless()

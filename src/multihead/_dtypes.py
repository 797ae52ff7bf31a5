"""The dtypes multihead computes attention in, one check of a ``dtype`` argument, and one
of a tensor's layout (sparse tensors have no views, reshapes or expands: refused where
passed, not deep inside a kernel).

A module, a cache, an additive mask or a loaded model made in another dtype would fail
later, deep inside torch (float8 has no matmul or sum on most devices; an integer weight
cannot require gradients), so each refuses it where it is passed, naming the argument.
"""

from __future__ import annotations

import functools

import torch

#: the dtypes every backend computes in (float8 is a storage format: no softmax, no sum)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
#: the same, for messages
SUPPORTED_NAMES = ", ".join(map(str, SUPPORTED_DTYPES[:-1])) + f" or {SUPPORTED_DTYPES[-1]}"
#: names a str may give a supported dtype by (torch's own and the usual short ones)
_BY_NAME = {**{str(d).removeprefix("torch."): d for d in SUPPORTED_DTYPES},
            "fp16": torch.float16, "half": torch.float16, "bf16": torch.bfloat16,
            "fp32": torch.float32, "float": torch.float32, "fp64": torch.float64,
            "double": torch.float64}


def check_dtype(name: str, dtype, *, optional: bool = False) -> torch.dtype | None:
    """``dtype``, after checking it is one of :data:`SUPPORTED_DTYPES` (or None when
    ``optional``: torch's default dtype then applies).

    Raises:
        TypeError: another dtype (float8, an integer or complex one), or not a dtype at all
            (a string such as ``"float32"``, for which the dtype it names is suggested);
            the message names ``name``.

    Example:
        >>> check_dtype("dtype", torch.bfloat16)
        torch.bfloat16
        >>> check_dtype("dtype", "bf16")
        Traceback (most recent call last):
        ...
        TypeError: dtype must be torch.float16, torch.bfloat16, torch.float32 or torch.float64, got 'bf16' (a str): pass torch.bfloat16
    """
    if dtype is None and optional:
        return None
    if isinstance(dtype, torch.dtype) and dtype in SUPPORTED_DTYPES:
        return dtype
    if isinstance(dtype, str):
        named = _BY_NAME.get(dtype.lower().removeprefix("torch."))
        hint = f" (a str): pass {named}" if named else " (a str): pass a torch.dtype"
    elif isinstance(dtype, torch.dtype) and dtype.is_floating_point:
        hint = (f": {str(dtype).removeprefix('torch.')} is a storage format attention cannot "
                f"compute in (no softmax, no matmul); use torch.bfloat16 or torch.float16")
    else:
        hint = ": attention computes in a floating-point dtype"
    raise TypeError(f"{name} must be {SUPPORTED_NAMES}, got {dtype!r}{hint}")


#: the dtypes ``torch.autocast`` casts to its own (float64 stays, as torch's rule has it)
AUTOCAST_CASTS = (torch.float16, torch.bfloat16, torch.float32)


def autocast_dtype(device: torch.device | str) -> torch.dtype | None:
    """The dtype ``torch.autocast`` computes in on ``device``'s kind, None where it is off.

    Example:
        >>> autocast_dtype("cpu") is None
        True
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     autocast_dtype("cpu")
        torch.bfloat16
    """
    if not torch._C._is_any_autocast_enabled():              # (the usual case: 0.1 us)
        return None
    kind = torch.device(device).type
    if not (torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)):
        return None
    return torch.get_autocast_dtype(kind)


def without_autocast(backward):
    """Decorator for an autograd Function's ``backward`` (or a custom operator's gradient
    function): it runs with ``torch.autocast`` off on its gradients' device, as the forward
    did (:func:`multihead.attention` turns autocast off around every backend), so gradients
    are the same whether ``.backward()`` is called inside an autocast region or after it
    (inside, autocast would otherwise recast the backward's own matmuls and mix dtypes).
    Under ``torch.compile`` the backward is traced while the forward's autocast is off but
    run under the caller's, so there the region is always written into the graph.

    First-order only: the graph a backward builds with ``create_graph=True`` is made of
    torch's ops, which a second ``.backward()`` inside the region recasts, as it does any
    model's.

    Example:
        >>> class Square(torch.autograd.Function):
        ...     @staticmethod
        ...     def forward(ctx, x):
        ...         ctx.save_for_backward(x)
        ...         return x @ x
        ...     @staticmethod
        ...     @without_autocast
        ...     def backward(ctx, g):
        ...         x, = ctx.saved_tensors
        ...         return g @ x.T + x.T @ g
        >>> x = torch.full((2, 2), 1 + 2 ** -10, requires_grad=True)
        >>> loss = Square.apply(x).sum()                  # the forward in float32
        >>> with torch.autocast("cpu", dtype=torch.bfloat16):
        ...     loss.backward()            # and the backward (bfloat16 would give 4.0)
        >>> x.grad.dtype, x.grad[0, 0].item()
        (torch.float32, 4.00390625)
    """
    @functools.wraps(backward)
    def run(ctx, *grads, **kwargs):
        compiling = torch.compiler.is_compiling()
        if compiling or torch._C._is_any_autocast_enabled():       # (the usual case: no)
            found = next((g for g in grads if isinstance(g, torch.Tensor)), None)
            if found is not None and (compiling or autocast_dtype(found.device) is not None):
                with torch.autocast(found.device.type, enabled=False):
                    return backward(ctx, *grads, **kwargs)
        return backward(ctx, *grads, **kwargs)
    return run


def check_weights(dtype: torch.dtype) -> None:
    """Refuse a module whose weights were converted to a dtype attention cannot compute in
    (``module.to(torch.float8_e4m3fn)``), before its forward projects anything.

    Example:
        >>> check_weights(torch.float8_e5m2)
        Traceback (most recent call last):
        ...
        TypeError: the module's weights are torch.float8_e5m2, which attention cannot compute in: convert the module with module.to(torch.bfloat16) (or another of torch.float16, torch.bfloat16, torch.float32 or torch.float64)
    """
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"the module's weights are {dtype}, which attention cannot compute in: "
                        f"convert the module with module.to(torch.bfloat16) (or another of "
                        f"{SUPPORTED_NAMES})")


def check_strided(name: str, t: torch.Tensor) -> None:
    """Refuse a sparse (or other non-strided) tensor with a TypeError naming ``name``.

    Example:
        >>> check_strided("q", torch.zeros(2, 2).to_sparse())
        Traceback (most recent call last):
        ...
        TypeError: q is a torch.sparse_coo tensor; attention takes dense (strided) tensors: convert it with .to_dense()
    """
    if t.layout != torch.strided or t.is_nested:
        fix = ("pad it (torch.nested.to_padded_tensor(t, 0.0)) and mask the padding "
               "(multihead.masks.padding(lengths))" if t.is_nested else
               "convert it with .to_dense()")
        raise TypeError(f"{name} is a {'nested' if t.is_nested else t.layout} tensor; "
                        f"attention takes dense (strided) tensors: {fix}")


def host_tensor(name: str, x, expected: str, fix: str) -> torch.Tensor:
    """``x`` as it is when a tensor, else as a host tensor (a list: lengths, ids).

    Raises:
        ValueError: a ragged list, or a value past int64: torch's reason, then ``fix``.
        TypeError: not numbers at all (a str, a None inside); ``expected`` says what to pass.

    Example:
        >>> host_tensor("ids", [[0, 1], [2]], "integers", "one id per token, in rows of one length")
        Traceback (most recent call last):
        ...
        ValueError: ids [[0, 1], [2]] cannot be a tensor (expected sequence of length 2 at dim 1 (got 1)): pass one id per token, in rows of one length, each below 2**63
    """
    if isinstance(x, torch.Tensor):
        return x
    try:
        t = torch.as_tensor(x, device="cpu")
        # an empty list has no element to give a dtype (torch's default is float): no lengths
        # or ids are integers
        return t.long() if t.numel() == 0 and isinstance(x, (list, tuple)) else t
    except (ValueError, OverflowError) as e:             # ragged, or past int64
        raise ValueError(f"{name} {x!r:.60} cannot be a tensor ({e}): pass {fix}, each below "
                         f"2**63") from None
    except (TypeError, RuntimeError):                    # a str, a None inside
        raise TypeError(f"{name} must be {expected}, got {x!r:.60} ({type(x).__name__})") from None


def integer_tensor(name: str, x) -> torch.Tensor:
    """``x`` (an integer tensor, or a list of ints: kept on the host) as an int64 tensor, or
    an error naming ``name`` that shows what was passed: a TypeError for what is not
    integers, a ValueError for a ragged list or one past int64.

    Example:
        >>> integer_tensor("cu_seqlens", [0, 3, 5])
        tensor([0, 3, 5])
        >>> integer_tensor("cu_seqlens", "abc")
        Traceback (most recent call last):
        ...
        TypeError: cu_seqlens must be integers (a list or an integer tensor), got 'abc' (str)
    """
    t = host_tensor(name, x, "integers (a list or an integer tensor)",
                    "a list of ints (or rows of one length)")
    check_strided(name, t)
    if t.dtype == torch.bool or t.is_floating_point() or t.is_complex():
        shown = (" [" + ", ".join(f"{x:g}" for x in t.reshape(-1)[:8].tolist()) + "]"
                 if t.device.type == "cpu" and not t.is_complex() else "")
        raise TypeError(f"{name} must be an integer tensor, got dtype {t.dtype}{shown}: pass "
                        f"a list of ints or an integer tensor")
    return t.long()

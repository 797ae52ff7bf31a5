"""Our kernels as PyTorch operators: ``torch.ops.multihead.flash_attention`` (band masks
and packed documents) and ``flash_sparse`` (any other mask, by block lists), each with its
backward, and ``flash_decode`` (forward only).

Each is a ``torch.library.custom_op`` with a fake implementation (output shapes from input
shapes, no data read), so ``torch.compile(fullgraph=True)`` traces a call as one opaque node
instead of breaking the graph on Triton's Python launcher; the forward's autograd formula is
the backward kernels of :mod:`.flash_bwd`. The grids depend on shapes only and nothing reads
a device value back to the host, so CUDA graphs can capture a call.

A mask is not an operator argument: ``flash_sparse`` takes what :func:`.flash_sparse.plan`
derives from it (the mask program's source, its tensors and ints; the block lists and
launch configs), so under ``torch.compile`` the plan is traced into the graph, and a new
mask of the same structure reuses the compiled graph and kernels.

Eager calls skip the operator wrappers: :func:`attention`, :func:`sparse` and :func:`decode`
call the kernels directly (through a ``torch.autograd.Function`` for gradients) unless
``torch.compile`` is tracing, because a ``custom_op``'s eager dispatch cost about 100 us of
host time per call on an H100 machine, five times a decoding step's kernels. While a dispatch
mode is on (``FlopCounterMode``, a logging mode) they call the operators, so that the mode
sees each kernel call (:mod:`.flops` counts their FLOPs).

A window of ``0`` means none (the schema has no room for ``None`` and an int in one place
that would not also recompile per value).

Notation: B batch, H query heads, Hkv K/V heads, Sq/Sk lengths, D/Dv head dims.
"""

from __future__ import annotations

import inspect

import torch
from torch._functorch.utils import unwrap_dead_wrappers

from .. import _second_order as second_order
from .._dtypes import without_autocast
from .._second_order import refuse_second_order
from . import _ahead
from ._band import check_inputs, empty_like_all, empty_outputs, launch_config
from ._dropout import Dropout
from .decode import decode_forward
from .flash_bwd import check_backward, flash_backward
from .flash_fwd import flash_forward
from .flash_sparse import (KERNELS, Launch, flatten, list_shape, plan, program,
                           run_backward, run_forward, sparse_backward, sparse_forward,
                           unflatten)
from .mask_program import MaskProgram
from .._tracing import tracing


def _dropout(dropout_p: float, seed: torch.Tensor | None) -> Dropout | None:
    """An operator's ``dropout_p`` and ``seed`` as the kernels take them (None: no dropout),
    a rate outside [0, 1] refused by the operator's argument names."""
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"multihead operators: dropout_p must be in [0, 1] (0: no dropout), "
                         f"got {dropout_p!r}")
    return Dropout(dropout_p, seed) if dropout_p else None


def _kw(scale, causal, window, offset, kv_lengths, documents=None, dropout_p=0.0,
        seed=None) -> dict:
    kw = dict(scale=scale, causal=causal, window=None if window == 0 else window,
              offset=offset, kv_lengths=kv_lengths)
    if documents is not None:             # the decode kernel takes no documents
        kw["documents"] = documents
    if dropout_p:                         # (nor dropout)
        kw["dropout"] = _dropout(dropout_p, seed)
    return kw


def _seen() -> bool:
    """Whether a dispatch mode is on (``FlopCounterMode``, a logging mode, ``DebugMode``):
    eager calls then reach the kernels through the operators, so that the mode sees each
    kernel call (and counts its FLOPs: :mod:`.flops`)."""
    return torch._C._len_torch_dispatch_stack() > 0


@torch.library.custom_op("multihead::flash_attention", mutates_args=())
def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                    causal: bool, window: int, offset: int, kv_lengths: torch.Tensor | None,
                    documents: torch.Tensor | None = None, dropout_p: float = 0.0,
                    seed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of :func:`.flash_forward` (``window=0``: no window; ``documents``: the
    host table of packed documents; ``dropout_p > 0``: dropout drawn from ``seed``, see
    :mod:`._dropout`).

    Example:
        >>> import torch
        >>> q = torch.randn(1, 2, 32, 16, device="cuda", dtype=torch.float16)   # doctest: +SKIP
        >>> out, lse = torch.ops.multihead.flash_attention(q, q, q, 0.25, True, 0, 0, None)  # doctest: +SKIP
    """
    return flash_forward(q, k, v, **_kw(scale, causal, window, offset, kv_lengths, documents,
                                        dropout_p, seed))


@flash_attention.register_fake
def _(q, k, v, scale, causal, window, offset, kv_lengths, documents=None, dropout_p=0.0,
      seed=None):
    return empty_outputs(q, v)


@torch.library.custom_op("multihead::flash_attention_backward", mutates_args=())
def flash_attention_backward(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor,
                             k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                             lse: torch.Tensor, scale: float, causal: bool, window: int,
                             offset: int, kv_lengths: torch.Tensor | None,
                             documents: torch.Tensor | None = None, dropout_p: float = 0.0,
                             seed: torch.Tensor | None = None,
                             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of :func:`.flash_backward`."""
    return _backward(dout, dlse, q, k, v, out, lse, scale, causal, window, offset, kv_lengths,
                     documents, dropout_p, seed)


def _backward(dout, dlse, q, k, v, out, lse, scale, causal, window, offset, kv_lengths,
              documents=None, dropout_p=0.0, seed=None):
    return flash_backward(dout, q, k, v, out, lse, dlse=dlse,
                          **_kw(scale, causal, window, offset, kv_lengths, documents,
                                dropout_p, seed))


@flash_attention_backward.register_fake
def _(dout, dlse, q, k, v, out, lse, scale, causal, window, offset, kv_lengths, documents=None,
      dropout_p=0.0, seed=None):
    return empty_like_all(q, k, v)                 # contiguous, as the kernels' gradients


def _setup(ctx, inputs, output):
    q, k, v, scale, causal, window, offset, kv_lengths, documents, dropout_p, seed = inputs
    ctx.save_for_backward(q, k, v, *output, kv_lengths, seed)
    ctx.args = (scale, causal, window, offset)
    ctx.documents = documents                  # a host table: kept, not saved for autograd
    ctx.dropout_p = dropout_p


class _FirstOrderOnly(torch.autograd.Function):
    """The gradients a backward with ``create_graph=True`` gets under dropout, as torch's
    fused kernels give theirs (the reference cannot replay the kernels' draws): kept, and
    refusing, with the second-order error, to be differentiated again (a gradient penalty
    would otherwise lose attention's part silently). Its inputs are the backward's own
    (q, k, v, dout, dlse or None: the gradients depend on each that requires grad), then
    the gradients."""

    @staticmethod
    def forward(ctx, q, k, v, dout, dlse, *grads):
        return tuple(g.view_as(g) for g in grads)

    @staticmethod
    def backward(ctx, *_):
        raise RuntimeError(second_order.second_order_message(
            "triton", "differentiating its gradients under dropout"))


def _first_order(dropout_p: float, inputs: tuple, gradients) -> tuple:
    """``gradients()``, the kernels' ``(dq, dk, dv)`` of ``inputs`` ``(q, k, v, dout, dlse)``, in
    a backward that may build a graph: without dropout such a backward is refused (the eager
    paths gave the reference's gradients earlier, where the call asked for them); under
    dropout it gets them marked first-order only (:class:`_FirstOrderOnly`), whichever of
    the inputs requires grad."""
    if not dropout_p:
        refuse_second_order("triton")
    grads = gradients()
    if torch.is_grad_enabled():       # (only with dropout: refused above otherwise)
        grads = _FirstOrderOnly.apply(*inputs, *grads)
    return grads


def _gradients(ctx, dout, dlse, backward=flash_attention_backward):
    q, k, v, out, lse, kv_lengths, seed = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout      # the kernels take any strides
    dq, dk, dv = _first_order(ctx.dropout_p, (q, k, v, dout, dlse), lambda: backward(
        dout, dlse, q, k, v, out, lse, *ctx.args, kv_lengths, ctx.documents, ctx.dropout_p,
        seed))
    return dq, dk, dv, *(None,) * 8


# (without_autocast here, not on _gradients: _Flash.backward, which calls it, has its own)
flash_attention.register_autograd(without_autocast(_gradients), setup_context=_setup)


def _refuse_transforms(*grads) -> None:
    """Raise a RuntimeError under a ``torch.func`` transform (see :class:`_Direct`): in a
    forward, or in a backward whose output ``grads`` come batched after a plain forward
    (``autograd.grad(..., is_grads_batched=True)``, ``jacobian(..., vectorize=True)``: torch
    batches them with its legacy vmap, which no transform flag reports)."""
    legacy = torch._C._functorch.is_legacy_batchedtensor
    if torch._C._are_functorch_transforms_active() or any(
            g is not None and legacy(g) for g in grads):
        raise RuntimeError(
            "multihead's Triton kernels do not run under torch.func transforms (grad, vmap, "
            "jacrev, batched gradients such as autograd.grad(is_grads_batched=True), ...): "
            "they read device memory, which functorch's wrapped tensors do not expose. Call "
            "multihead.attention with backend='auto' inside the transform (it picks a backend "
            "that runs there), or backend='sdpa' for a call whose gradients run batched")


class _Direct(torch.autograd.Function):
    """An autograd Function whose ``apply`` skips torch's per-call argument binding when
    every argument is passed positionally (binding then returns them unchanged; it rebuilt
    the forward's signature each call: about 40 of a 100 us eager call on a 2-core Xeon).
    For any other call torch's own ``apply`` runs. Its callers refuse ``torch.func``
    transforms first (:func:`_refuse_transforms`, before any work ahead of the call): the
    kernels cannot read functorch's wrapped tensors (the backward would fail deep inside
    Triton's launcher)."""

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        signature = inspect.signature(cls.forward)
        cls.forward.__signature__ = signature           # for torch's path, too
        cls._arity = len(signature.parameters)

    @classmethod
    def apply(cls, *args, **kwargs):
        if kwargs or len(args) != cls._arity:
            return super().apply(*args, **kwargs)
        # as torch's apply does: tensors left over from a finished torch.func transform
        return super(torch.autograd.Function, cls).apply(*unwrap_dead_wrappers(args))


def _early(ctx, dout, dlse, n_inputs: int):
    """What an eager Function's backward returns before its kernels run, else None: no
    gradients where neither output was used; where the backward builds a graph and the
    call gave a :func:`multihead._second_order.spec` (``ctx.again``), the reference's
    gradients for q, k, v, which differentiate again. Refuses ``torch.func`` first."""
    if dout is None and dlse is None:
        return (None,) * n_inputs
    _refuse_transforms(dout, dlse)
    if ctx.again is None or not torch.is_grad_enabled():
        return None
    q, k, v = ctx.saved_tensors[:3]
    return (*second_order.reference_gradients(ctx.again, (q, k, v), (dout, dlse),
                                              ctx.needs_input_grad[:3]),
            *(None,) * (n_inputs - 3))


class _Flash(_Direct):
    """The eager path of :func:`attention`: the same kernels without the operator's
    dispatch (through the operators while a dispatch mode is on)."""

    @staticmethod
    def forward(q, k, v, scale, causal, window, offset, kv_lengths, documents, dropout_p, seed,
                again):
        if _seen():
            return flash_attention(q, k, v, scale, causal, window, offset, kv_lengths,
                                   documents, dropout_p, seed)
        return flash_forward(q, k, v, **_kw(scale, causal, window, offset, kv_lengths,
                                            documents, dropout_p, seed))

    @staticmethod
    def setup_context(ctx, inputs, output):
        ctx.set_materialize_grads(False)
        _setup(ctx, inputs[:-1], output)
        ctx.again = inputs[-1]

    @staticmethod
    @without_autocast
    def backward(ctx, dout, dlse):
        early = _early(ctx, dout, dlse, 12)
        if early is not None:
            return early
        _ahead.wait()                          # its kernels, if compiling ahead
        return (*_gradients(ctx, dout, dlse,
                            backward=flash_attention_backward if _seen() else _backward), None)


def _backward_ahead(q, k, v, scale, causal, window, offset, kv_lengths, documents,
                    dropout_p, seed) -> None:
    """Compile the backward's kernels of a call of this kind while its forward's compile,
    on a first call (:mod:`._ahead`): on stand-ins of the tensors the backward will get
    (``out`` and ``dout`` as the forward allocates ``out``, ``lse`` fp32)."""
    key = ("band", q.device, q.dtype, k.dtype, v.dtype, q.shape[-1], v.shape[-1], causal,
           window == 0, kv_lengths is None, documents is None, dropout_p > 0)

    def prepare():                 # stand-ins made here: the thread holds no real tensor
        s = _ahead.stand_in
        qs, ks, vs, lens, seeds = s(q), s(k), s(v), s(kv_lengths), s(seed)

        def backward():
            out, lse = empty_outputs(qs, vs)
            flash_backward(out, qs, ks, vs, out, lse,
                           **_kw(scale, causal, window, offset, lens, documents, dropout_p,
                                 seeds))
        return backward

    _ahead.compile_ahead(key, q.device, prepare)


def attention(q, k, v, scale: float, causal: bool, window: int, offset: int,
              kv_lengths: torch.Tensor | None, documents: torch.Tensor | None = None,
              again=None, dropout_p: float = 0.0,
              seed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` with gradients: :func:`flash_attention` while ``torch.compile``
    traces, the kernels directly otherwise (through :class:`_Flash`). With ``again`` (a
    :func:`multihead._second_order.spec` of the call's mask), a backward that builds a graph
    gets gradients that differentiate again; without, it is refused. ``dropout_p > 0``:
    dropout on the weights, drawn from ``seed`` (:func:`._dropout.draw`), the same in the
    backward.

    Example:
        >>> import torch
        >>> q = torch.randn(1, 2, 32, 16, device="cuda", dtype=torch.float16)   # doctest: +SKIP
        >>> out, lse = attention(q, q, q, 0.25, True, 0, 0, None)              # doctest: +SKIP
    """
    if tracing():
        return flash_attention(q, k, v, scale, causal, window, offset, kv_lengths, documents,
                               dropout_p, seed)
    _refuse_transforms()                # (before the backward ahead builds anything)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        _backward_ahead(q, k, v, scale, causal, window, offset, kv_lengths, documents,
                        dropout_p, seed)
    return _Flash.apply(q, k, v, scale, causal, window, offset, kv_lengths, documents,
                        dropout_p, seed, again)


@torch.library.custom_op("multihead::flash_sparse", mutates_args=())
def flash_sparse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, source: str,
                 tensors: list[torch.Tensor], ints: list[int], lists: list[torch.Tensor],
                 configs: list[int], dropout_p: float = 0.0,
                 seed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of the block-sparse forward: the arguments from ``source`` to
    ``configs`` are a :func:`.flash_sparse.plan` flattened by :func:`.flash_sparse.flatten`
    (the mask program's source and arguments; the lengths, and per kernel its block lists
    and launch config). The lists of the backward kernels ride along when gradients are
    wanted. ``dropout_p > 0``: dropout drawn from ``seed``, as for :func:`flash_attention`.
    ``q (B, H, Sq, D)``, ``k (B, Hkv, Sk, D)``, ``v (B, Hkv, Sk, Dv)``; returns ``out (B, H,
    Sq, Dv)`` and ``lse (B, H, Sq)`` fp32.

    Example:
        >>> import torch, multihead as mh
        >>> from multihead.kernels.flash_sparse import flatten, plan
        >>> q = torch.randn(1, 2, 32, 16, device="cuda", dtype=torch.float16)   # doctest: +SKIP
        >>> args = flatten(*plan(mh.masks.alibi(2), q, q, q, kernels=("fwd",)), 32, 32)  # doctest: +SKIP
        >>> out, lse = torch.ops.multihead.flash_sparse(q, q, q, 0.25, *args)   # doctest: +SKIP
    """
    check_inputs("flash_sparse", q, k, v, scale=scale)
    prog, launches = unflatten("flash_sparse", q, k, source, tensors, ints, lists, configs)
    return run_forward(q, k, v, scale, prog, launches[0], _dropout(dropout_p, seed))


@flash_sparse.register_fake
def _(q, k, v, scale, source, tensors, ints, lists, configs, dropout_p=0.0, seed=None):
    check_inputs("flash_sparse", q, k, v, scale=scale)
    return empty_outputs(q, v)


@torch.library.custom_op("multihead::flash_sparse_backward", mutates_args=())
def flash_sparse_backward(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor,
                          k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, scale: float, source: str,
                          tensors: list[torch.Tensor], ints: list[int],
                          lists: list[torch.Tensor], configs: list[int],
                          dropout_p: float = 0.0, seed: torch.Tensor | None = None,
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)``, shaped as ``q``, ``k``, ``v``, of :func:`flash_sparse`'s call,
    whose plan must hold all three kernels (``kernels=tuple(KERNELS)``); ``dout (B, H, Sq,
    Dv)``, ``dlse (B, H, Sq)`` or None."""
    fn = "flash_sparse_backward"
    check_inputs(fn, q, k, v, scale=scale)
    check_backward(fn, dout, q, v, out, lse, dlse)
    prog, launches = unflatten(fn, q, k, source, tensors, ints, lists, configs)
    if len(launches) != 3:
        raise ValueError(f"{fn}: the plan must hold the forward's and both backward kernels' "
                         f"lists (3 kernels), got {len(launches)}: plan with "
                         f"kernels=('fwd', 'bwd_kv', 'bwd_q')")
    return run_backward(dout, q, k, v, out, lse, dlse, scale, prog, *launches[1:],
                        _dropout(dropout_p, seed))


@flash_sparse_backward.register_fake
def _(dout, dlse, q, k, v, out, lse, scale, source, tensors, ints, lists, configs,
      dropout_p=0.0, seed=None):
    return empty_like_all(q, k, v)                 # contiguous, as the kernels' gradients


def _sparse_setup(ctx, inputs, output):
    q, k, v, scale, source, tensors, ints, lists, configs, dropout_p, seed = inputs
    ctx.save_for_backward(q, k, v, *output, seed, *tensors, *lists)
    ctx.args = (scale, source, len(tensors), ints, configs, len(lists))
    ctx.dropout_p = dropout_p


@without_autocast
def _sparse_gradients(ctx, dout, dlse):
    q, k, v, out, lse, seed, *rest = ctx.saved_tensors
    scale, source, n, ints, configs, n_lists = ctx.args
    dout = torch.zeros_like(out) if dout is None else dout
    dq, dk, dv = _first_order(ctx.dropout_p, (q, k, v, dout, dlse), lambda: flash_sparse_backward(
        dout, dlse, q, k, v, out, lse, scale, source, rest[:n], ints, rest[n:], configs,
        ctx.dropout_p, seed))
    # no gradient for the rest (a list of tensors gets a list of Nones), for the inputs the
    # call passed (the dispatcher drops trailing arguments equal to their defaults)
    grads = (dq, dk, dv, None, None, [None] * n, None, [None] * n_lists, None, None, None)
    return grads[:len(ctx.needs_input_grad)]


flash_sparse.register_autograd(_sparse_gradients, setup_context=_sparse_setup)


class _Sparse(_Direct):
    """The eager path of :func:`sparse`: the kernels with their plans cached on the mask
    (the backward's lists are built only when a backward runs)."""

    @staticmethod
    def forward(q, k, v, mask, scale, dropout_p, seed, again):
        if _seen():
            return flash_sparse(q, k, v, scale, *_flat_plan(mask, q, k, v, ("fwd",)),
                                dropout_p, seed)
        return sparse_forward(q, k, v, mask, scale=scale, dropout=_dropout(dropout_p, seed))

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, mask, scale, ctx.dropout_p, seed, ctx.again = inputs
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q, k, v, *output, seed)
        ctx.mask, ctx.scale = mask, scale
        # as the forward read the mask's tensors (a spec of this mask read them already)
        same = ctx.again is not None and ctx.again.mask is mask
        ctx.versions = ctx.again.versions if same else mask._versions()

    @staticmethod
    @without_autocast
    def backward(ctx, dout, dlse):
        early = _early(ctx, dout, dlse, 8)
        if early is not None:
            return early
        _ahead.wait()                          # its kernels, if compiling ahead
        ctx.mask._check_unchanged(ctx.versions, "triton backward")
        q, k, v, out, lse, seed = ctx.saved_tensors
        dout = torch.zeros_like(out) if dout is None else dout

        def gradients():
            if _seen():                        # through the operator, seen by the mode
                return flash_sparse_backward(dout, dlse, q, k, v, out, lse, ctx.scale,
                                             *_flat_plan(ctx.mask, q, k, v, tuple(KERNELS)),
                                             ctx.dropout_p, seed)
            return sparse_backward(dout, q, k, v, out, lse, ctx.mask, scale=ctx.scale,
                                   dlse=dlse, dropout=_dropout(ctx.dropout_p, seed))
        dq, dk, dv = _first_order(ctx.dropout_p, (q, k, v, dout, dlse), gradients)
        return dq, dk, dv, *(None,) * 5


def _flat_plan(mask, q, k, v, kernels: tuple[str, ...]) -> tuple:
    """The mask's :func:`.flash_sparse.plan` for ``kernels``, as :func:`flash_sparse` and its
    backward take it (:func:`.flash_sparse.flatten`)."""
    return flatten(*plan(mask, q, k, v, kernels=kernels), q.shape[2], k.shape[2])


def sparse(q, k, v, mask, scale: float, again=None, dropout_p: float = 0.0,
           seed: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` under any supported mask, with gradients: :func:`flash_sparse` while
    ``torch.compile`` traces (the mask's plan is traced with it, so its tensors are graph
    inputs), the kernels directly otherwise. ``again``, ``dropout_p`` and ``seed``: as for
    :func:`attention`.

    Example:
        >>> import torch, multihead as mh
        >>> q = torch.randn(1, 2, 32, 16, device="cuda", dtype=torch.float16)   # doctest: +SKIP
        >>> out, lse = sparse(q, q, q, mh.masks.alibi(2), 0.25)                  # doctest: +SKIP
    """
    if tracing():
        grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
        return flash_sparse(q, k, v, scale,
                            *_flat_plan(mask, q, k, v, tuple(KERNELS) if grad else ("fwd",)),
                            dropout_p, seed)
    _refuse_transforms()                # (before the mask's program is built and kept)
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        _sparse_backward_ahead(q, k, v, mask, scale, dropout_p, seed)
    return _Sparse.apply(q, k, v, mask, scale, dropout_p, seed, again)


def _sparse_backward_ahead(q, k, v, mask, scale: float, dropout_p: float = 0.0,
                           seed: torch.Tensor | None = None) -> None:
    """:func:`_backward_ahead` for the block-sparse kernels, once per mask program: the
    program's tensors and the backward's block lists are stand-ins too, the lists shaped
    as :func:`.flash_sparse.block_lists` builds them for the backward's blocks (the mask's
    batch and head sizes taken from the forward's lists, which the forward builds anyway).
    A mask that does not fit the call compiles nothing here: the forward reports it."""
    Sq, D, Sk, Dv = q.shape[2], q.shape[3], k.shape[2], v.shape[3]
    try:
        prog = program(mask, Sq, Sk, q.device)
    except Exception:             # noqa: BLE001 - the forward reports it
        return
    key = ("sparse", q.device, q.dtype, k.dtype, v.dtype, D, Dv, prog.source,
           tuple(t.dtype for t in prog.tensors), dropout_p > 0)

    def lists(name: str, Bm: int, Hm: int) -> Launch:
        config = launch_config(name, D, Dv)
        rows, cols = list_shape(Sq, Sk, config[0], config[1], KERNELS[name])
        count = torch.empty(Bm, Hm, rows, dtype=torch.int32, device="meta")
        index = torch.empty(Bm, Hm, rows, cols, dtype=torch.int32, device="meta")
        return Launch(config, (count, count, index))

    def prepare():
        _, (fwd,) = plan(mask, q, k, v, kernels=("fwd",), fn="sparse_forward")
        Bm, Hm = fwd.lists[0].shape[:2]                    # the mask's B', H' (1: broadcast)
        s = _ahead.stand_in
        qs, ks, vs, seeds = s(q), s(k), s(v), s(seed)
        stand_ins = MaskProgram(prog.source, tuple(map(s, prog.tensors)), prog.ints)
        kv, dq = lists("bwd_kv", Bm, Hm), lists("bwd_q", Bm, Hm)

        def backward():
            out, lse = empty_outputs(qs, vs)
            run_backward(out, qs, ks, vs, out, lse, None, scale, stand_ins, kv, dq,
                         _dropout(dropout_p, seeds))
        return backward

    _ahead.compile_ahead(key, q.device, prepare)


@torch.library.custom_op("multihead::flash_decode", mutates_args=())
def flash_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                 window: int, offset: int,
                 kv_lengths: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of :func:`.decode_forward` (forward only; ``window=0``: no window)."""
    return decode_forward(q, k, v, **_kw(scale, causal, window, offset, kv_lengths))


@flash_decode.register_fake
def _(q, k, v, scale, causal, window, offset, kv_lengths):
    return empty_outputs(q, v)


def decode(q, k, v, scale: float, causal: bool, window: int, offset: int,
           kv_lengths: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a few queries, no gradients: :func:`flash_decode` while
    ``torch.compile`` traces or a dispatch mode is on, :func:`.decode_forward` directly
    otherwise."""
    if tracing():
        return flash_decode(q, k, v, scale, causal, window, offset, kv_lengths)
    _refuse_transforms()
    if _seen():
        return flash_decode(q, k, v, scale, causal, window, offset, kv_lengths)
    return decode_forward(q, k, v, **_kw(scale, causal, window, offset, kv_lengths))

"""The blocksparse backend under ``torch.compile`` and ``torch.export``: one operator.

The tiled kernel plans its steps in Python from the mask's tiles (a loop whose length
depends on the sizes and on the mask's values), which a tracer cannot follow: traced as it
is, every length would be a new graph, and exported programs would keep one length's plan.
So a traced call runs it as ``torch.ops.multihead.blocksparse`` (and its backward as
``torch.ops.multihead.blocksparse_backward``), an operator opaque to the tracer: its fake
implementation gives the outputs' shapes from the (symbolic) sizes, and the real one plans
and runs the tiles at run time, from the real sizes and mask. One graph then serves every
length, and a compiled or exported sliding window skips the tiles the window rules out, as
an eager call does, instead of computing every pair of a dense mask.

Masks that travel as operator arguments: causal and sliding windows (either alignment),
key padding (lengths ``(B,)`` or a ``(B, Sk)`` bool tensor), and ``&`` of a band and a
padding, on the CPU. Under Dynamo (``torch.compile``, ``torch.export(strict=True)``) only
sliding windows (with or without key padding) take it, and ``auto`` takes it for them
without comparing estimates: Dynamo turns a comparison of traced estimates into a guard
on the length, which recompiles where it flips (and fails a strict export's program at
other lengths); a causal band or padding alone runs as well through SDPA's fused kernels.
On a GPU, planning inside the graph would read the device (the triton backend traces its
own operators there). Other calls are not traced here
(:func:`band_of` says why): ``auto`` picks another backend for them, and
``backend="blocksparse"`` raises with the reason.

Pricing while tracing cannot read the mask's tiles (that would be tensor work in the graph,
and a read of its values), so :func:`estimate` counts a band's tiles in closed form from the
sizes, with key padding priced as absent.

Notation: B batch, H query heads, Hkv K/V heads, Sq/Sk lengths, D/Dv head dims.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ... import masks as M
from ..._cache import BoundedCache
from ..._dtypes import without_autocast
from .._call import make_call
from . import _tiles
from ._common import BandParts, band_parts


class TracedBand(NamedTuple):
    """A mask as the operator's arguments: a band (``causal``, a ``window`` of keys or None,
    its ``align``) and key padding (lengths or a bool tensor), each optional."""

    causal: bool
    window: int | None
    align: str
    padding: torch.Tensor | None


def band_of(call) -> TracedBand | str:
    """The call's mask as :class:`TracedBand`, or why it is not traced here."""
    if call.q.device.type != "cpu":
        return ("runs traced on the CPU only (on a GPU, planning its tiles inside the graph "
                "would read the device)")
    parts = band_parts(call.effective_mask)
    if not isinstance(parts, BandParts):            # (the leaf's kind: describing its
        what = (f"a mask composed with {parts.kind!r}" if parts.kind in ("and", "or", "not")
                else f"this {parts.kind} mask")             # sizes
        return (f"runs traced (torch.compile, torch.export, make_fx, fake tensors) only a "
                f"band (causal, sliding window), key padding, or band & key padding, not "
                f"{what}")
    band, padding = parts.window, parts.padding     # would format traced ints)
    if torch.compiler.is_dynamo_compiling() and (band is None or band.size is None):
        return ("runs under torch.compile (Dynamo) sliding windows only: a causal band or "
                "key padding alone runs as well through SDPA's fused kernels, and choosing "
                "between them by traced estimates would guard on the length")
    return TracedBand(band is not None, None if band is None else band.size,
                      "lower_right" if band is None else band.align,
                      None if padding is None else padding._tensors()[0])


def _mask(causal: bool, window: int, align: str, padding: torch.Tensor | None):
    """The mask object of the operator's arguments (``window`` 0: none)."""
    if window and not causal:                     # (a window is a causal band's width)
        raise ValueError(f"multihead::blocksparse: window={window} needs causal=True (a "
                         f"sliding window is a causal band {window} keys wide); pass "
                         f"causal=True, or window=0 for no band")
    band = M.Window(window or None, align) if causal else None
    keys = None if padding is None else M.padding(padding)
    return keys if band is None else band if keys is None else band & keys


def estimate(call, band: TracedBand) -> _tiles.Estimate:
    """What the tiled kernel would compute for ``call`` under ``band``, in closed form from
    the sizes (``torch.sym_min``/``sym_max``, which add no guard on a traced size), priced
    as the kernel computes: each chunk of query tiles visits, for every tile, as many key
    tiles as its busiest tile needs (a window's width plus a tile; a causal band's reach at
    the chunk's last tile, averaged over the chunks), every visited tile masked, key
    padding as absent (so never less than the kernel computes for a window).

    Example:
        >>> import torch, multihead as mh
        >>> from multihead.functional._call import make_call
        >>> q = torch.zeros(1, 1, 1024, 8)
        >>> call = make_call(q, q, q, mask=mh.masks.sliding_window(64), scale=None,
        ...                  dropout_p=0.0, return_weights=False, return_lse=False)
        >>> e = estimate(call, band_of(call))
        >>> e.pairs // 1024, round(e.density, 3)           # 3 key tiles of 64 per query tile
        (192, 0.188)
    """
    lo, hi = torch.sym_min, torch.sym_max
    Sq, Sk = call.Sq, call.Sk
    tq, tk = _tiles.tile_sizes(call)
    nq, nk = (Sq + tq - 1) // tq, (Sk + tk - 1) // tk
    offset = Sk - Sq if band.align == "lower_right" else 0

    def reach(t):                  # key tiles up to query tile t's last row (causal band)
        return hi(0, lo(nk, (lo(Sq, (t + 1) * tq) - 1 + offset) // tk + 1))
    if not band.causal:
        busiest = nk
    elif band.window is not None:
        busiest = lo(reach(nq - 1), (tq + band.window - 2) // tk + 2)
    else:
        busiest = reach(nq - 1)
    rows = call.B * call.H * tq * tk
    width = hi(1, lo(lo(_tiles.MAX_STEP_TILES, busiest), _tiles.BUDGET // rows))
    per_chunk = hi(1, _tiles.BUDGET // (rows * width))
    chunks = (nq + per_chunk - 1) // per_chunk
    visits = busiest                # per query tile: the chunks' busiest, averaged
    if band.causal and band.window is None:
        visits = (reach(lo(per_chunk, nq) - 1) + busiest + 1) // 2
    steps = chunks * ((visits + width - 1) // width)
    pairs = nq * visits * rows
    density = visits / hi(1, nk)
    return _tiles.Estimate(pairs, pairs, steps, steps, chunks, nq * visits, density, density,
                           True)


#: tile plans of band masks without padding, by sizes (a traced call has no plan to keep)
_PLANS = BoundedCache(64, 64 << 20)


def _geometry(q, k, v, scale, causal, window, align, padding):
    """The kernel's sizes and plan for the operator's arguments (the plan from
    :data:`_PLANS` where the mask is a band alone)."""
    from .blocksparse import _Geo
    call = make_call(q, k, v, mask=_mask(causal, window, align, padding), scale=scale,
                     dropout_p=0.0, return_weights=False, return_lse=True)
    if padding is not None:
        return _Geo(call, _tiles.make_plan(call))
    key = (tuple(q.shape), tuple(k.shape), q.device, causal, window, align)
    return _Geo(call, _PLANS.get_or_compute(key, lambda: _tiles.make_plan(call)))


@torch.library.custom_op("multihead::blocksparse", mutates_args=())
def blocksparse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, causal: bool,
                window: int, align: str, padding: torch.Tensor | None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out (B, H, Sq, Dv), stats (3, B, H, Sq))`` of the tiled kernel on ``q (B, H, Sq,
    D)``, ``k (B, Hkv, Sk, D)``, ``v (B, Hkv, Sk, Dv)``: ``stats`` holds each row's lse and
    the ``(hi, lo)`` its backward shifts the scores by. ``causal``: a band aligned by
    ``align`` (``"lower_right"`` or ``"upper_left"``), ``window`` keys wide (0: no window);
    ``padding``: key lengths ``(B,)`` or a ``(B, Sk)`` bool tensor. Bad arguments raise the
    ValueError ``multihead.attention`` gives.

    Example:
        >>> import torch
        >>> q = torch.randn(1, 2, 100, 8)
        >>> out, stats = torch.ops.multihead.blocksparse(q, q, q, 0.35, True, 16,
        ...                                              "lower_right", None)
        >>> out.shape, stats.shape
        (torch.Size([1, 2, 100, 8]), torch.Size([3, 1, 2, 100]))
    """
    from .blocksparse import _forward
    g = _geometry(q, k, v, scale, causal, window, align, padding)
    out, stats = _forward(g, q, k, v, scale)
    return out.contiguous(), stats.contiguous()


@blocksparse.register_fake
def _(q, k, v, scale, causal, window, align, padding):
    B, H, Sq, _ = q.shape
    return q.new_empty(B, H, Sq, v.shape[-1]), q.new_empty(3, B, H, Sq)


@torch.library.custom_op("multihead::blocksparse_backward", mutates_args=())
def blocksparse_backward(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor,
                         k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                         stats: torch.Tensor, scale: float, causal: bool, window: int,
                         align: str, padding: torch.Tensor | None
                         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq (B, H, Sq, D), dk (B, Hkv, Sk, D), dv (B, Hkv, Sk, Dv))`` of
    :func:`blocksparse`'s call on the same arguments, from its outputs ``out`` and ``stats``
    and their gradients ``dout (B, H, Sq, Dv)`` and ``dlse (B, H, Sq)`` (None: unused).

    Example:
        >>> import torch
        >>> q = torch.randn(1, 2, 40, 8)
        >>> args = (0.35, True, 8, "lower_right", None)
        >>> out, stats = torch.ops.multihead.blocksparse(q, q, q, *args)
        >>> grads = torch.ops.multihead.blocksparse_backward(torch.ones_like(out), None, q, q,
        ...                                                  q, out, stats, *args)
        >>> [tuple(g.shape) for g in grads]
        [(1, 2, 40, 8), (1, 2, 40, 8), (1, 2, 40, 8)]
    """
    from .blocksparse import _backward
    g = _geometry(q, k, v, scale, causal, window, align, padding)
    grads = _backward(g, q, k, v, out, stats[1], stats[2], dout.contiguous(), dlse, scale)
    return tuple(t.contiguous() for t in grads)          # (as the fake gives them)


@blocksparse_backward.register_fake
def _(dout, dlse, q, k, v, out, stats, scale, causal, window, align, padding):
    return tuple(t.new_empty(t.shape) for t in (q, k, v))   # contiguous, as the real ones


def _setup(ctx, inputs, output):
    q, k, v, *args = inputs
    ctx.save_for_backward(q, k, v, output[0], output[1], args[-1])
    ctx.args = tuple(args[:-1])                        # scale, causal, window, align


@without_autocast
def _gradients(ctx, dout, dstats):                   # (torch gives zeros for unused ones)
    q, k, v, out, stats, padding = ctx.saved_tensors
    dq, dk, dv = blocksparse_backward(dout, dstats[0], q, k, v, out, stats, *ctx.args,
                                      padding)
    return dq, dk, dv, None, None, None, None, None


blocksparse.register_autograd(_gradients, setup_context=_setup)


def run(q, k, v, scale: float, band: TracedBand) -> tuple[torch.Tensor, torch.Tensor]:
    """``(out, lse)`` of a traced call through the operator (q, k, v in the kernel's
    compute dtype)."""
    out, stats = blocksparse(q, k, v, scale, band.causal, band.window or 0, band.align,
                             band.padding)
    return out, stats[0]

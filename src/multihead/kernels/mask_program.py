"""A mask as Triton code: the predicate (and bias) of a :class:`multihead.masks.Mask`,
compiled into a ``@triton.jit`` function the kernels call on the blocks they must mask.

:func:`mask_program` walks the mask's tree once and writes a small function

.. code-block:: python

    @triton.jit
    def mask_fn(b, h, R, C, Sq, Sk, T, I):   # -> (allowed bool, bias fp32), shaped R ⊕ C

where ``b`` is the batch, ``h`` the query head, ``R`` and ``C`` the query and key positions
of a block as broadcast grids (``(M, 1)`` and ``(1, N)``, or ``(1, M)`` and ``(N, 1)`` for
the transposed block of the dK/dV loop: the code never assumes which), ``T`` a tuple of the
mask's tensors and ``I`` a tuple of ints (offsets, window sizes, strides). Each leaf reads
only what it needs:

- ``causal``/``sliding_window``: the distance ``R + offset - C``, from indices;
- ``padding``: per-sequence lengths, or a ``(B, S)`` bool row;
- ``document``: the ids of the block's queries and keys, compared;
- ``dense``: the block's bool tile; ``bias``: its float tile (``-inf`` masks), added;
- ``alibi``: ``-slope[h] * |R + offset - C|`` from the per-head slopes, the distance
  taken in fp32 (exact below 2**24 positions; converted per row and per column, not per
  score);
- ``at_positions`` of a band or ALiBi: the block's rows' and columns' token positions
  loaded (per sequence), and the band or ALiBi measured between them in place of ``R`` and
  ``C`` (a padded KV cache's window and ALiBi count tokens that way);
- ``&``, ``|``, ``~`` of these (biases add under ``&``).

The bias comes back in the kernels' base 2 (times ``log2(e)``, folded into ALiBi's slope),
so ALiBi costs a subtraction and a multiply-add per score. A bias tile's values are clamped
to ``±3e38`` (``finfo.min * log2(e)`` would overflow to ``-inf`` and mask the pair; a float64
tile is saturated at float32's range first, as every backend does), and so
is the sum of a program's biases when it adds two tiles or more (``finfo.max`` and
``finfo.min`` tiles would overflow to a NaN sum; ALiBi's bias is far from overflowing).
A NaN or ``+inf`` bias entry (a device bias is never scanned for them) is NaN through the
clamps, so its row is NaN, as on every other backend, never a silently finite row.

Only the *structure* is in the code (which leaves, how composed, which dims broadcast);
sizes, offsets and pointers are arguments. The source is registered with ``linecache`` (no
file is written) so Triton can read it, and is the cache key of the compiled kernel. Triton
specializes the int arguments on being 1 or a multiple of 16, so a structure compiles at
most once per such class of its sizes (windows of 15 and 17 share a kernel, 16 has its own).

Positions outside ``[0, Sq) x [0, Sk)`` are never read (loads are bounded); the kernels mask
them separately. Only our own mask classes compile (exactly: a user's class, or a subclass
of ours that may redefine its predicate, has no Triton form).
"""

from __future__ import annotations

import hashlib
import linecache
from typing import NamedTuple

import torch

from .._device import to_device
from ..masks import base as MB
from ..masks import positioned as MP
from ..masks import structured as MS
from ..masks import tensor as MT

#: log2(e): scores scaled by ``scale * LOG2E`` run the kernels' softmax in base 2
#: (``exp2``), and programs return their bias in that unit (defined here, where no Triton
#: is imported, and shared by every kernel through ``_band``)
LOG2E = 1.4426950408889634

#: the leaf kinds a program can express (compositions "and", "or", "not" of them)
KINDS = frozenset({"causal", "window", "padding", "document", "dense", "bias", "alibi"})


class MaskProgram(NamedTuple):
    """A mask as Triton code: its ``source`` and the arguments ``tensors`` and ``ints`` it
    indexes. ``fn`` is the compiled function; ``has_bias`` whether it adds a bias (the
    kernels then call it on every block, not only on the blocks they must mask).

    Building one is plain Python over the mask's tree, so ``torch.compile`` traces it (the
    source is a string argument of the operator, the tensors tensor arguments); only
    ``fn`` runs ``exec``, inside the operator."""

    source: str
    tensors: tuple
    ints: tuple

    @property
    def has_bias(self) -> bool:
        """True when the function returns a bias (its last line returns one: see _build)."""
        return not self.source.rstrip().endswith(f", {_NO_BIAS}")

    @property
    def fn(self):
        """The ``@triton.jit`` function ``mask_fn`` (compiled once per distinct source)."""
        return _compile(self.source)


def supported(mask: MB.Mask | None) -> str | None:
    """Why ``mask`` has no Triton form, or None when it has one.

    Example:
        >>> import multihead as mh
        >>> supported(mh.masks.causal() & mh.masks.alibi(4)) is None
        True
    """
    if mask is None:
        return None
    foreign = sorted({type(m).__name__ for m in _nodes(mask) if type(m) not in _OURS})
    if foreign:
        return (f"has no Triton form for {', '.join(foreign)} (a user's mask class, or a "
                f"subclass of ours: its own predicate is not ours to compile)")
    placed = sorted({m.describe() for m in _nodes(mask)
                     if type(m) is MP.Positioned and type(m.m) not in _PLACED})
    if placed:
        return (f"has no Triton form for {', '.join(placed)} (at token positions it runs "
                f"causal, sliding_window and alibi)")
    return None


#: the classes a program compiles: exactly these (a subclass may override what they mean)
_OURS = (MS.Window, MS.Padding, MS.Document, MT.Dense, MT.Bias, MT.ALiBi, MB.And, MB.Or,
         MB.Not, MP.Positioned)
#: what a program places at token positions: the leaves that measure distance from indices
_PLACED = (MS.Window, MT.ALiBi)


def _nodes(m: MB.Mask):
    """Every node of a mask's tree, compositions included."""
    yield m
    if type(m) in (MB.And, MB.Or):
        yield from _nodes(m.a)
        yield from _nodes(m.b)
    elif type(m) in (MB.Not, MP.Positioned):
        yield from _nodes(m.m)


class _Writer:
    """Collects the generated lines and the arguments they index."""

    def __init__(self, device):
        self.lines: list[str] = []
        self.tensors: list[torch.Tensor] = []
        self.ints: list[int] = []
        self.device = device
        self.n = 0
        self.tiles = 0              # bias tiles: two or more may overflow fp32 in sum
        self.loaded: list = []      # per-slot loads written: (tensor, at, other, var)

    def tensor(self, t: torch.Tensor) -> str:
        self.tensors.append(t)
        return f"T[{len(self.tensors) - 1}]"

    def int(self, v: int) -> str:
        self.ints.append(int(v))
        return f"I[{len(self.ints) - 1}]"

    def var(self, expr: str) -> str:
        self.n += 1
        name = f"x{self.n}"
        self.lines.append(f"    {name} = {expr}")
        return name

    def strides(self, t: torch.Tensor) -> list[str]:
        """An int argument per dim: the stride, 0 where the dim broadcasts (size 1)."""
        return [self.int(0 if n == 1 else s) for n, s in zip(t.shape, t.stride())]


_ROW = "R.to(tl.int64)"
_COL = "C.to(tl.int64)"
_IN = "(R < Sq) & (C < Sk)"


def _distance(w: _Writer, align: str, sq: int, sk: int, row: str, col: str) -> str:
    off = w.int(MS._offset(align, sq, sk))
    return w.var(f"{row} + {off} - {col}")


def _per_slot(w: _Writer, t: torch.Tensor, at: str, other: int = 0) -> str:
    """A value per slot, ``t`` ``(B', S)`` (padding rows, document ids, token positions), for
    the block's slots ``at`` (``"R"``, queries, or ``"C"``, keys): a grid shaped as ``at``,
    ``other`` past the call's slots (those pairs are masked by the kernels). Loaded once per
    program (a padded cache's window and ALiBi share their positions)."""
    for held, at_, other_, name in w.loaded:     # by identity (traceable, unlike id())
        if held is t and at_ == at and other_ == other:
            return name
    d = t.to(w.device)                                                          # (B', S)
    sb, ss = w.strides(d)
    bound = "R < Sq" if at == "R" else "C < Sk"
    name = w.var(f"tl.load({w.tensor(d)} + b.to(tl.int64) * {sb} + "
                 f"{at}.to(tl.int64) * {ss}, mask={bound}, other={other})")
    w.loaded.append((t, at, other, name))
    return name


def _leaf(w: _Writer, m: MB.Mask, sq: int, sk: int, row: str = "R",
          col: str = "C") -> tuple[str | None, str | None]:
    """(allowed, bias) variable names of one leaf (None: nothing of that kind). ``row`` and
    ``col`` are the query and key indices a band or ALiBi measures (positions, placed)."""
    if type(m) is MP.Positioned:        # the slots' positions, lengths equal (no alignment)
        return _leaf(w, m.m, sk, sk, _per_slot(w, m.q_positions, "R"),
                     _per_slot(w, m.k_positions, "C"))
    if m.kind in ("causal", "window"):
        d = _distance(w, m.align, sq, sk, row, col)
        ok = f"{d} >= 0" if m.size is None else f"({d} >= 0) & ({d} < {w.int(m.size)})"
        return w.var(ok), None
    if m.kind == "padding":
        at = "C" if m.side == "key" else "R"
        if m.real is None:
            lens = m.lengths.to(w.device)                                       # (B',)
            (sb,) = w.strides(lens)
            n = f"tl.load({w.tensor(lens)} + b.to(tl.int64) * {sb})"
            return w.var(f"{at}.to(tl.int64) < {n}"), None
        real = _per_slot(w, m.real.view(torch.uint8), at)                      # as R or C
        return w.var(f"{real} != 0"), None
    if m.kind == "document":
        qid, kid = m._q_k_ids(sq, sk, w.device)                    # (B', Sq), (B', Sk)
        qi, ki = _per_slot(w, qid, "R", other=-1), _per_slot(w, kid, "C", other=-2)
        return w.var(f"{qi} == {ki}"), None
    if m.kind in ("dense", "bias"):
        t = m.t.view(torch.uint8) if m.kind == "dense" else m.raw               # (B', H', Sq', Sk')
        t = t.to(w.device)
        sb, sh, sm, sn = w.strides(t)
        tile = w.var(f"tl.load({w.tensor(t)} + b.to(tl.int64) * {sb} + h.to(tl.int64) * {sh} "
                     f"+ {_ROW} * {sm} + {_COL} * {sn}, mask={_IN}, other=0)")  # the block
        if m.kind == "dense":
            return w.var(f"{tile} != 0"), None
        ok = w.var(f"{tile} != float('-inf')")
        bad = w.var(f"({tile} != {tile}) | ({tile} == float('inf'))")   # NaN, +inf: NaN rows
        if t.dtype == torch.float64:    # saturate past fp32's range: a finite bias never masks
            tile = w.var(f"tl.minimum(tl.maximum({tile}, -3.4e38), 3.4e38)")
        x = w.var(f"{tile}.to(tl.float32)")
        w.tiles += 1
        x2 = w.var(f"tl.minimum(tl.maximum({x} * {LOG2E!r}, -3.0e38), 3.0e38)")
        x2 = w.var(f"tl.where({bad}, float('nan'), {x2})")          # the clamps drop NaN
        return ok, w.var(f"tl.where({ok}, {x2}, 0.0)")
    if m.kind == "alibi":
        slopes = m.cached("slopes", (str(w.device),),
                          lambda: to_device(m.slopes, w.device))          # (H',), no wait
        (sh,) = w.strides(slopes)
        off = w.int(MS._offset(m.align, sq, sk))
        d = w.var(f"({row} + {off}).to(tl.float32) - {col}.to(tl.float32)")    # the block
        s = w.var(f"tl.load({w.tensor(slopes)} + h.to(tl.int64) * {sh}) * {-LOG2E!r}")
        return None, w.var(f"tl.abs({d}) * {s}")
    raise ValueError(f"mask_program: no Triton form for {m.describe()}")


def _emit(w: _Writer, m: MB.Mask, sq: int, sk: int) -> tuple[str | None, str | None]:
    if m.kind == "not":
        ok, _ = _emit(w, m.m, sq, sk)
        return w.var(f"~{ok}"), None
    if m.kind in ("and", "or"):
        oka, ba = _emit(w, m.a, sq, sk)
        okb, bb = _emit(w, m.b, sq, sk)
        op = "&" if m.kind == "and" else "|"
        ok = oka if okb is None else okb if oka is None else w.var(f"{oka} {op} {okb}")
        bias = ba if bb is None else bb if ba is None else w.var(f"{ba} + {bb}")
        return ok, bias
    return _leaf(w, m, sq, sk)


#: what the function returns in place of a bias when the mask has none
_NO_BIAS = "0.0"

_COMPILED: dict[str, object] = {}


def _compile(source: str):
    """The Triton function defined by ``source`` (one per distinct source, per process)."""
    if source not in _COMPILED:
        import triton
        import triton.language as tl
        name = f"<multihead-mask-{hashlib.sha1(source.encode()).hexdigest()[:16]}>"
        linecache.cache[name] = (len(source), None, source.splitlines(True), name)
        scope = {"triton": triton, "tl": tl}
        exec(compile(source, name, "exec"), scope)
        _COMPILED[source] = scope["mask_fn"]
    return _COMPILED[source]


def source_of(mask: MB.Mask, sq: int, sk: int, device=None) -> str:
    """The Triton source of ``mask``'s :func:`mask_program` (to read it).

    Example:
        >>> import multihead as mh
        >>> print(source_of(mh.masks.sliding_window(4), 8, 8).splitlines()[-1])
            return x2, 0.0
    """
    return mask_program(mask, sq, sk, device).source


def _build(mask, sq, sk, device):
    w = _Writer(torch.device(device) if device is not None else mask._device())
    ok, bias = _emit(w, mask, sq, sk)
    if ok is None:                      # a pure bias: every pair allowed
        ok = w.var("(R >= 0) & (C >= 0)")
    if w.tiles > 1 and bias is not None:        # a sum of clamped tiles may overflow again
        bias = w.var(f"tl.clamp({bias}, -3.0e38, 3.0e38, propagate_nan=tl.PropagateNan.ALL)")
    body = "\n".join(w.lines)
    source = (f"@triton.jit\ndef mask_fn(b, h, R, C, Sq, Sk, T, I):\n{body}\n"
              f"    return {ok}, {bias if bias is not None else _NO_BIAS}\n")
    return source, w


def mask_program(mask: MB.Mask, sq: int, sk: int, device=None) -> MaskProgram:
    """``mask`` as Triton code for calls of ``sq`` queries and ``sk`` keys on ``device``
    (default: the mask's).

    Raises:
        ValueError: for a mask :func:`supported` refuses.

    Example:
        >>> import torch, multihead as mh
        >>> p = mask_program(mh.masks.causal() & mh.masks.padding(torch.tensor([5, 7])), 8, 8, "cpu")
        >>> len(p.tensors), p.ints, p.has_bias
        (1, (0, 1), False)
    """
    why = supported(mask)
    if why is not None:
        raise ValueError(f"mask_program: {mask.describe()} {why}")
    source, w = _build(mask, sq, sk, device)
    return MaskProgram(source, tuple(w.tensors), tuple(w.ints) or (0,))



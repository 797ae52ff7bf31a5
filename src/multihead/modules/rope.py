"""Rotary position embedding (Su et al. 2021, RoFormer), the "rotate half" layout of GPT-NeoX/LLaMA.

Each pair of channels ``(x_i, x_{i + R/2})`` of a query or key at position ``m`` is rotated
by the angle ``m * base^(-2i/R)``, over the first ``R = rotary_dim`` channels of each head
(all ``D`` of them by default; the rest pass unchanged). Rotations preserve norms, and the score between a
query at ``m`` and a key at ``n`` depends only on ``m - n``.

The cosines and sines of the angles are kept in a table of positions ``0..rows-1`` per
(rotary dim, base, device, precision), shared by every :class:`RotaryEmbedding` of that kind
and grown by doubling up to :data:`TABLE_BYTES`. Positions the host knows (an int start, a
CPU tensor) read their rows from it: consecutive ones as a slice (no device op), others with
one gather. So a decoding step on a GPU launches only the rotation's kernels, not a dozen to
recompute angles. Angles are computed instead for positions on the device, fractional or
negative ones, ones past the table's largest size, a module whose ``inv_freq`` was changed,
and under ``torch.compile``, ``torch.func`` transforms or tensor subclasses (fake tensors):
nothing is read back. The tables are kept in a :class:`multihead._cache.BoundedCache`, as the
library's other derived tensors: one made on a CUDA stream is waited for by another stream's
first use, one a CUDA graph capture reads is kept for as long as the process lives, and none
is grown during a capture (the angles of that call are computed in the graph). Angles are in
fp32 (fp64 where an input is fp64), and the rotation runs in that precision whatever ``x``'s.
"""

from __future__ import annotations

import math
import numbers

import torch
from torch import nn

from .._cache import BoundedCache
from .._device import to_device, usable_device
from .._dtypes import check_strided
from .._fork import module_lock
from .._tracing import concrete, refuse_jit_trace, shape_text, tracing

#: rows of a table when first built (it doubles past them)
FIRST_ROWS = 2048
#: the most bytes one table may hold: 64 MiB is 65,536 positions at head dim 128 in fp32
#: (longer positions compute their angles)
TABLE_BYTES = 64 << 20

#: (rotary_dim, base, device, dtype) -> table (rows, 2, R): [:, 0] cos, [:, 1] sin with the
#: sign of the rotation folded in (the first half negated)
_TABLES = BoundedCache(max_entries=64, max_bytes=4 * TABLE_BYTES)
_GROWING = module_lock(globals(), "_GROWING")


def _frequencies(head_dim: int, base: float, dtype: torch.dtype, device) -> torch.Tensor:
    """``base^(-2i/D)`` ``(D/2,)`` computed in ``dtype``."""
    return base ** (-torch.arange(0, head_dim, 2, dtype=dtype, device=device) / head_dim)


def _precision(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _angles(pos: torch.Tensor, freq: torch.Tensor) -> torch.Tensor:
    """``pos`` (...) float, ``freq`` (D/2,) -> ``(..., 2, D)``: cos, and sin with the
    rotation's sign."""
    ang = pos.unsqueeze(-1) * freq                                       # (..., D/2)
    c, s = ang.cos(), ang.sin()
    return torch.stack([torch.cat([c, c], -1), torch.cat([-s, s], -1)], -2)  # (..., 2, D)


#: positions past this are not exact in float64 (nor in int64 arithmetic's reach of fp64)
EXACT = 2 ** 53


#: :meth:`RotaryEmbedding._frequency_problem`'s word for frequencies that are not finite
NONFINITE = "holds NaN or inf"
#: the largest integer up to which each half-precision float holds every integer
HALF_EXACT = {torch.float16: 2048, torch.bfloat16: 256}


def _check_values(positions: torch.Tensor) -> tuple[int, int] | None:
    """Refuse positions of a dtype that is not a position (bool, complex), and, where
    the host holds them, non-finite float ones (they would make the rows NaN) and integer
    ones past 2**53 (as an int start is), and half-precision ones past the integers they
    hold exactly. Positions on a device are not read back: a NaN there gives NaN rows.
    Returns the (least, largest) of integer positions it read (the table's rows: read
    once), else None."""
    check_strided("positions", positions)
    if positions.dtype == torch.bool or positions.is_complex():
        raise TypeError(f"RotaryEmbedding: positions must be an integer or float tensor, got "
                        f"{positions.dtype}: pass integer positions (torch.arange(S) + start)")
    if not (positions.device.type == "cpu" and type(positions) is torch.Tensor and positions.numel()
            and not tracing()
            and not torch._C._are_functorch_transforms_active()):
        return None
    if not positions.is_floating_point():
        lo, hi = int(positions.min()), int(positions.max())
        if max(-lo, hi) >= EXACT:                                 # (as an int start's bound)
            raise ValueError(f"RotaryEmbedding: positions reach {lo if -lo > hi else hi}, "
                             f"past ±2**53, where "
                             f"positions stop being exact even in float64: pass positions "
                             f"within it")
        return lo, hi
    exact = HALF_EXACT.get(positions.dtype)
    if exact is not None and bool((positions.abs() > exact).any()):
        raise ValueError(f"RotaryEmbedding: positions in {positions.dtype} reach "
                         f"{positions.abs().max().item():g}, past {exact}, where "
                         f"{positions.dtype} no longer holds every integer ({exact + 1} is "
                         f"stored as {exact}): pass them as int64, or as float32/float64 for "
                         f"fractional positions")
    bad = ~positions.isfinite()
    if bad.any():
        raise ValueError(f"RotaryEmbedding: positions must be finite, got "
                         f"{positions[bad][:4].tolist()} at index "
                         f"{[tuple(i) for i in bad.nonzero()[:4].tolist()]}: a position "
                         f"that is not finite rotates its row into NaN")
    return None


def _even_width(name: str, n, limit: str) -> int:
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n <= 0 or n % 2:
        raise ValueError(f"RotaryEmbedding: {name} must be a positive even int {limit}, got "
                         f"{n!r}")
    return int(n)


def _check_base(base) -> float:
    if isinstance(base, bool) or not isinstance(base, numbers.Real) or not math.isfinite(base) \
            or not base > 1:
        raise ValueError(f"RotaryEmbedding: base must be a finite number > 1 (10000.0 in most "
                         f"models), got {base!r}")
    return float(base)


class RotaryEmbedding(nn.Module):
    """Rotary embedding applied to ``(B, H, S, D)`` queries/keys at explicit positions.

    Args:
        head_dim: D, the per-head dimension (must be even).
        base: the frequency base (10000 in RoFormer and LLaMA).
        rotary_dim: the channels rotated, the first ``rotary_dim`` of each head (even, at
            most ``head_dim``; default: all). Fewer is partial rotary (GPT-NeoX's
            ``rotary_pct``, Phi's ``partial_rotary_factor``): the frequencies are those of
            a ``rotary_dim``-wide rotation, and the other channels pass unchanged.
        attention_factor: the rotated channels are also multiplied by it (YaRN's and
            LongRoPE's attention factor, Hugging Face's ``attention_scaling``: every score
            between rotated channels scales by its square). Default 1.
        device: where ``inv_freq`` lives, and where the table of the first
            :data:`FIRST_ROWS` positions is built now (else at the first call on a device).

    ``inv_freq`` (a buffer, fp32 whatever the module is cast to) holds the frequencies;
    writing other ones into it (scaled RoPE, say: in place, or assigning a new tensor) is
    honoured: this module then computes its angles from them on every call instead of
    reading the shared table, casts of the module move them without rounding them, and
    ``state_dict`` saves them (as ``inv_freq``; the built ones are not saved, as in
    Hugging Face's models). A checkpoint's ``inv_freq`` is loaded where present (strict
    loads accept it, from ours or an older export, checked before anything is copied); the
    built frequencies in any precision or formula (an fp16 export, Hugging Face's
    ``1 / base^(2i/D)``) keep the table, and loading into written frequencies copies into
    them. Learned frequencies (``inv_freq.requires_grad_()``, or an ``nn.Parameter``) get
    gradients from every kind of position; a load copies into them whatever it holds (an
    optimizer holding them goes on; with ``assign=True`` they are replaced, and still
    learn), casts keep them in fp32, and setting ``base`` is refused (write into them
    instead). ``repr`` says when the frequencies are not
    ``base``'s (``inv_freq=written`` or ``learned``).

    Example:
        >>> import torch, multihead as mh
        >>> rope = mh.RotaryEmbedding(8)
        >>> x = torch.randn(1, 2, 5, 8)
        >>> y = rope(x, torch.arange(5))
        >>> torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-6)
        True
        >>> torch.equal(rope(x, 3), rope(x, torch.arange(3, 8)))   # an int: the first position
        True

    Shapes:
        x (B, H, S, D); positions (S,) or (B, S) (integer or float), or an int ``p``: the
        positions ``p .. p + S - 1`` of every sequence.
    """

    def __init__(self, head_dim: int, base: float = 10000.0, *, rotary_dim: int | None = None,
                 attention_factor: float = 1.0, device=None):
        super().__init__()
        head_dim = _even_width("head_dim", head_dim, "(channels rotate in pairs)")
        rotary_dim = head_dim if rotary_dim is None else _even_width(
            "rotary_dim", rotary_dim, f"at most head_dim {head_dim} (the channels rotated)")
        if rotary_dim > head_dim:
            raise ValueError(f"RotaryEmbedding: rotary_dim {rotary_dim} is more than head_dim "
                             f"{head_dim}: rotate at most every channel (rotary_dim={head_dim}, "
                             f"the default)")
        if isinstance(attention_factor, bool) or not isinstance(attention_factor, numbers.Real) \
                or not math.isfinite(attention_factor) or not attention_factor > 0:
            raise ValueError(f"RotaryEmbedding: attention_factor must be a finite number > 0 (1 "
                             f"unless the scaled RoPE has one, as YaRN's), got {attention_factor!r}")
        self._head_dim, self._base = head_dim, _check_base(base)
        self._rotary_dim, self._factor = rotary_dim, float(attention_factor)
        device = None if device is None else usable_device("device", device)
        self._set_canonical(torch.get_default_device() if device is None else device)
        if device is not None:
            self._table(self.inv_freq.device, torch.float32, FIRST_ROWS)

    @property
    def head_dim(self) -> int:
        """D, the width of the heads it takes. Read-only: the module's heads are this wide."""
        return self._head_dim

    @property
    def rotary_dim(self) -> int:
        """The channels rotated (in pairs), the first of each head. Read-only.

        Example:
            >>> x = torch.randn(1, 2, 3, 8)                      # (B, H, S, D)
            >>> y = RotaryEmbedding(8, rotary_dim=4)(x, 5)
            >>> torch.equal(y[..., 4:], x[..., 4:])              # the rest pass unchanged
            True
        """
        return self._rotary_dim

    @property
    def attention_factor(self) -> float:
        """The factor the rotated channels are multiplied by. Read-only."""
        return self._factor

    @property
    def base(self) -> float:
        """The frequencies' base. Setting it recomputes ``inv_freq`` (on its device), so
        every position, given as an int or a tensor, rotates by the new frequencies.

        Example:
            >>> rope = RotaryEmbedding(8)
            >>> rope.base = 500000.0
            >>> x = torch.randn(1, 1, 4, 8)
            >>> torch.allclose(rope(x, 0), rope(x, torch.arange(4)), atol=1e-6)
            True
        """
        return self._base

    @base.setter
    def base(self, value) -> None:
        if "inv_freq" in self._parameters or self.inv_freq.requires_grad:
            kind = "nn.Parameter" if "inv_freq" in self._parameters else \
                "buffer (it requires grad)"
            raise ValueError(f"RotaryEmbedding: inv_freq is a learned {kind} here; setting base "
                             f"would replace it with new frequencies that do not learn: write "
                             f"new frequencies into it instead (with torch.no_grad(): "
                             f"rope.inv_freq.copy_(...))")
        self._base = _check_base(value)
        self._set_canonical(self.inv_freq.device)

    def _set_canonical(self, device) -> None:
        """``inv_freq`` := the frequencies of rotary_dim and base, fp32 on ``device`` (a plain
        tensor, also under ``torch.inference_mode``); noted as unchanged (the shared table
        holds its angles)."""
        with torch.inference_mode(False):
            freq = _frequencies(self.rotary_dim, self.base, torch.float32, device)  # (R/2,)
        self.register_buffer("inv_freq", freq, persistent=False)
        self._note_canonical(freq)

    def _note_canonical(self, freq: torch.Tensor) -> None:
        """Note ``freq`` (``inv_freq``, holding the built frequencies) as unchanged (a fake
        tensor's, built under ``FakeTensorMode``, never: it has no memory to note)."""
        from torch._subclasses.fake_tensor import is_fake
        if is_fake(freq):
            self._canonical = (None, -1, -1, None)
            return
        values = freq.clone() if freq.device.type == "cpu" else None
        self._canonical = (freq, freq._version, freq.data_ptr(), values)

    def _unchanged(self) -> bool:
        """``inv_freq`` is still the frequencies it was built with: nobody replaced it,
        wrote into it in place (its version), or swapped its memory (``.data = ...``); on
        the CPU its values are also compared, which sees writes through ``.data`` and NumPy
        views. (On a GPU that would read the device: a write through ``.data`` there is not
        seen; write in place or assign a new tensor.)"""
        ref, version, ptr, values = self._canonical
        return (self.inv_freq is ref and ref._version == version and ref.data_ptr() == ptr
                and not ref.requires_grad and (values is None or torch.equal(ref, values)))

    # -- copies and checkpoints ----------------------------------------------------------
    #: a key a checkpoint may hold or not (see :func:`multihead.modules.loading.load_problems`)
    _optional_keys = ("inv_freq",)

    def __getstate__(self):
        # pickle, deepcopy, torch.save: the memory address noted in _canonical is not
        # copied, so the copy is told only whether the frequencies are still the built ones
        state = super().__getstate__()
        state["_canonical"] = self._unchanged()
        return state

    def __setstate__(self, state):
        state.setdefault("_rotary_dim", state.get("_head_dim"))     # (pickled before these:
        state.setdefault("_factor", 1.0)                            # every channel, factor 1)
        super().__setstate__(state)
        if self.__dict__["_canonical"] is True:       # (the tensor it has: a shallow copy
            self._note_canonical(self.inv_freq)       # shares it with the original)
        else:                                         # written frequencies, kept
            self._canonical = (None, -1, -1, None)

    def _save_to_state_dict(self, destination, prefix, keep_vars):
        super()._save_to_state_dict(destination, prefix, keep_vars)
        if not self._unchanged():                     # written frequencies are saved
            freq = self.inv_freq
            destination[prefix + "inv_freq"] = freq if keep_vars else freq.detach()

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs):
        key = prefix + "inv_freq"
        problem = self._optional_problem("inv_freq", state_dict[key]) if key in state_dict \
            else None
        if problem:                  # (before torch's loading copies into an nn.Parameter)
            error_msgs.append(f"{prefix}{problem}")
            state_dict = {k: v for k, v in state_dict.items() if k != key}
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict,
                                      missing_keys, unexpected_keys, error_msgs)
        if problem and key in missing_keys:
            missing_keys.remove(key)
        if key not in state_dict:
            return
        if key in unexpected_keys:
            unexpected_keys.remove(key)
        freq = state_dict[key]
        if "inv_freq" in self._parameters:            # an nn.Parameter: torch's loading
            return                                    # copied into it (or assigned it)
        mine, assign = self.inv_freq, local_metadata.get("assign_to_params_buffers", False)
        device = freq.device if assign else mine.device     # where it ends up, as torch's
        learned = mine.requires_grad
        if device.type == "meta":                     # shapes only: nothing to compare
            self._buffers["inv_freq"] = torch.empty_like(freq, device="meta")
            self._canonical = (None, -1, -1, None)
        elif not learned and self._built(freq):       # the table serves them
            self._set_canonical(device)
        elif assign:                                  # replaced (learned: still learned, as
            self._buffers["inv_freq"] = freq.detach().requires_grad_() if learned else freq
            self._canonical = (None, -1, -1, None)    # torch's Parameters are)
        elif learned or not self._unchanged():        # learned or written: copied into, so
            with torch.no_grad():                     # an optimizer holding it goes on
                mine.copy_(freq)
        else:
            with torch.no_grad():
                wide = torch.float64 if freq.dtype == torch.float64 else torch.float32
                self._buffers["inv_freq"] = freq.detach().to(mine.device, wide).clone()

    def _optional_problem(self, key: str, value) -> str | None:
        """Why a checkpoint's ``value`` for ``key`` (``inv_freq``) cannot be loaded, or None
        (asked by :func:`~multihead.modules.loading.load_problems` before anything is
        copied)."""
        problem = self._frequency_problem(value, read=not getattr(value, "is_meta", True))
        if problem == NONFINITE:
            return (f"{key} {NONFINITE} in the checkpoint (every rotated query and key would "
                    f"be NaN): save the frequencies again, or drop the key to keep these")
        if problem is not None:
            return f"{key}: the frequencies {problem}"
        if value.is_meta and not self.inv_freq.is_meta:
            return f"{key} is on the meta device in the checkpoint (it holds no values)"
        return None

    def _frequency_problem(self, freq, read: bool) -> str | None:
        """What keeps ``freq`` from serving as the frequencies: another shape or dtype, or
        (where ``read``: its values may be read) :data:`NONFINITE`; None when nothing."""
        want = (self.rotary_dim // 2,)
        if not (isinstance(freq, torch.Tensor) and freq.shape == want
                and freq.is_floating_point()):
            return (f"must be a float tensor of shape {want} (rotary_dim {self.rotary_dim} / "
                    f"2), got {getattr(freq, 'dtype', type(freq).__name__)} "
                    f"{tuple(getattr(freq, 'shape', ()))}")
        return NONFINITE if read and not bool(torch.isfinite(freq).all()) else None

    def _built(self, freq: torch.Tensor) -> bool:
        """Whether ``freq`` holds the built frequencies in its own precision: rounded to it
        (fp16/bf16 exports), or within a few ulps in fp32/fp64 (Hugging Face computes
        ``1 / base^(2i/D)``, one rounding apart from ``base^(-2i/D)``)."""
        built = _frequencies(self.rotary_dim, self.base, torch.float64, freq.device)
        if freq.dtype in (torch.float32, torch.float64):
            return torch.allclose(freq.double(), built, rtol=1e-6, atol=0)
        return torch.equal(freq, built.to(freq.dtype))

    def _apply(self, fn, *args, **kwargs):
        # .to(), .cuda(), .half(): inv_freq moves, but its frequencies keep their precision
        # (a Parameter's data is replaced in place: its values are kept aside first)
        unchanged, before = self._unchanged(), self.inv_freq
        if unchanged and before.is_meta:              # (built on meta: the built ones, so
            self._set_canonical(torch.device("cpu"))  # that .to(device) can move them)
            before = self.inv_freq
        parameter = "inv_freq" in self._parameters   # (never unchanged: the table's is a buffer)
        values = before.detach().clone() if parameter else before
        out = super()._apply(fn, *args, **kwargs)
        after = self.inv_freq
        if unchanged:                                 # exact, fp32, on the new device
            self._set_canonical(after.device)
        elif after.dtype == values.dtype:
            pass
        elif parameter:                               # the same Parameter, its values kept
            with torch.no_grad():
                after.data = values.to(after.device)
            if after.grad is not None:
                after.grad = after.grad.to(values.dtype)
        else:                                         # written ones: moved, not rounded
            self._buffers["inv_freq"] = before.to(after.device)
        return out

    def extra_repr(self) -> str:
        extra = (f", rotary_dim={self.rotary_dim}" if self.rotary_dim != self.head_dim else "") + (
            f", attention_factor={self.attention_factor:g}" if self.attention_factor != 1 else "")
        if not self._unchanged():                     # (base no longer says what they are)
            extra += ", inv_freq=" + ("learned" if self.inv_freq.requires_grad else "written")
        return f"head_dim={self.head_dim}, base={self.base!r}{extra}"

    def forward(self, x: torch.Tensor, positions) -> torch.Tensor:
        return self.rotate(x, positions=positions)[0]

    def rotate(self, *xs: torch.Tensor, positions) -> tuple[torch.Tensor, ...]:
        """Each of ``xs`` (queries and keys at the same positions, ``(B, H, S, D)`` with
        their own H) rotated, with one lookup of the angles for all.

        Example:
            >>> import torch, multihead as mh
            >>> q, k = torch.randn(1, 4, 3, 8), torch.randn(1, 2, 3, 8)
            >>> rq, rk = mh.RotaryEmbedding(8).rotate(q, k, positions=10)
            >>> rq.shape, rk.shape
            (torch.Size([1, 4, 3, 8]), torch.Size([1, 2, 3, 8]))
        """
        refuse_jit_trace("RotaryEmbedding")
        if not xs:
            raise TypeError("RotaryEmbedding.rotate: pass the tensors to rotate, e.g. "
                            "rotate(q, k, positions=p)")
        x = xs[0]
        for t in xs:
            if not isinstance(t, torch.Tensor) or t.dim() < 2 or t.shape[-1] != self.head_dim \
                    or t.shape[-2] != x.shape[-2]:
                raise ValueError(f"RotaryEmbedding({self.head_dim}): inputs must be (..., S, "
                                 f"{self.head_dim}) with one S, got "
                                 f"[{', '.join(shape_text(a) for a in xs)}]")
            if not t.is_floating_point():
                raise TypeError(f"RotaryEmbedding: the inputs to rotate must be floating "
                                f"point (queries and keys), got {t.dtype}: pass them as "
                                f"float32, bfloat16, float16 or float64")
        wide = any(t.dtype == torch.float64 for t in xs)    # fp64 anywhere: fp64 angles
        cos, sin = self._cos_sin(positions, xs, torch.float64 if wide else _precision(x.dtype))
        rows = positions.shape[0] if isinstance(positions, torch.Tensor) \
            and positions.dim() == 2 else 1
        if rows != 1 and any(t.dim() != 4 or t.shape[0] not in (1, rows) for t in xs):
            raise ValueError(f"RotaryEmbedding: positions of shape {shape_text(positions)} "
                             f"hold one row per sequence, but the inputs are "
                             f"[{', '.join(shape_text(a) for a in xs)}]: rotate tensors "
                             f"(B, H, S, D) of batch B = {concrete(rows)} (or 1) together")
        if len(xs) > 1 and all(t.dim() == 4 and t.shape[0] == x.shape[0] and t.dtype == x.dtype
                               and t.device == x.device for t in xs):
            both = self._turn(torch.cat(xs, 1), cos, sin)          # (B, H1 + H2 + ..., S, D)
            return both.split([t.shape[1] for t in xs], 1)         # one set of ops for all
        return tuple(self._turn(t, cos, sin) for t in xs)

    def _turn(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        # x_i cos + x_{i+R/2} (-sin) and x_{i+R/2} cos + x_i sin: the sign lives in the table
        R = self.rotary_dim
        part = t if R == self.head_dim else t[..., :R]                     # (..., S, R)
        out = torch.addcmul(part * cos, part.roll(R // 2, -1), sin)
        if self.attention_factor != 1:
            out = out * self.attention_factor
        out = out if out.dtype == t.dtype else out.to(t.dtype)
        return out if R == self.head_dim else torch.cat([out, t[..., R:]], -1)  # (..., S, D)

    # -- angles --------------------------------------------------------------------------
    def _cos_sin(self, positions, xs: tuple, dtype: torch.dtype):
        """``(cos, sin)`` in ``dtype`` broadcastable to each of ``xs`` ``(B, H, S, D)`` (of
        one device; a batch of 1 broadcasts): ``(S, D)`` or ``(B, 1, S, D)``; for inputs of
        other ranks, ``(S, D)``."""
        x = xs[0]
        S, device = x.shape[-2], x.device
        tables = self._tables_serve(x)
        if type(positions) is int or (isinstance(positions, numbers.Integral)
                                      and not isinstance(positions, bool)):
            start = int(positions)
            if abs(start) + S > EXACT:
                raise ValueError(f"RotaryEmbedding: positions {start} .. {start + S - 1} are "
                                 f"past 2**53, where positions stop being exact even in "
                                 f"float64: pass positions below it")
            table = self._table(device, dtype, start + S) if tables and start >= 0 else None
            if table is not None:
                return self._split(table[start:start + S])               # (S, 2, D): a view
            positions = torch.arange(start, start + S, device=device)
        if not isinstance(positions, torch.Tensor):
            raise TypeError(f"RotaryEmbedding: positions must be an int (the first of S "
                            f"consecutive positions) or an integer or float tensor (S,) or "
                            f"(B, S), got {type(positions).__name__}")
        span = _check_values(positions)                      # (lo, hi) of host integer ones
        if positions.device.type == "meta" and device.type != "meta":
            raise ValueError(f"RotaryEmbedding: positions are on the meta device (they hold no "
                             f"values) and the inputs on {device}: pass positions on "
                             f"{device}" + ("" if device.type == "cpu" else " or the CPU"))
        # (positions per sequence: the batch of any input; inputs that disagree are named
        # by rotate)
        batches = [t.shape[0] for t in xs if t.dim() == 4 and t.shape[0] != 1]
        B = batches[0] if batches else 1
        if positions.dim() == 2 and any(positions.shape[0] == b for b in batches):
            B = positions.shape[0]                   # (symbolic sizes: no `in`)
        if positions.dim() not in (1, 2) or positions.shape[-1] != S or (
                positions.dim() == 2 and positions.shape[0] != 1 and positions.shape[0] != B):
            B, S = concrete(B), concrete(S)
            shapes = ", ".join(shape_text(t) for t in xs)
            raise ValueError(f"RotaryEmbedding: positions must be (S,) or (B, S) = ({S},) or "
                             f"({B}, {S}) for inputs of shape {shapes}, got shape "
                             f"{shape_text(positions)}")
        if positions.dim() == 2 and x.dim() != 4:
            positions = positions.reshape(S)                 # (1, S) -> (S,): x has no batch
        if tables and span is not None:
            lo, hi = span                                            # a host tensor: no sync
            table = self._table(device, dtype, hi + 1) if lo >= 0 else None
            if table is not None:
                if positions.dim() == 1 and hi - lo == S - 1 and torch.equal(
                        positions, torch.arange(lo, hi + 1, dtype=positions.dtype, device="cpu")):
                    return self._split(table[lo:hi + 1])                 # (S, 2, D): a view
                idx = to_device(positions.long(), device)                # (S,) or (B, S)
                return self._split(table[idx])                           # gathered rows
        return self._split(_angles(to_device(positions, device).to(dtype),
                                   self._inv_freq_in(device, dtype)))

    def _inv_freq_in(self, device, dtype: torch.dtype) -> torch.Tensor:
        """``inv_freq`` ``(D/2,)`` in ``dtype`` on ``device``; in fp64, each frequency that
        still holds its built fp32 value is the exact fp64 one (no host check, so also
        while traced)."""
        self._check_written()
        if self.inv_freq.is_meta and device.type != "meta":
            if not self._unchanged():
                raise ValueError(f"RotaryEmbedding: inv_freq is on the meta device (written "
                                 f"frequencies that hold no values) and the inputs on "
                                 f"{device}: load them (a checkpoint's inv_freq), or set "
                                 f".base to rebuild them")
            # (built on meta, its parameters loaded with assign=True: the built ones)
            return _frequencies(self.rotary_dim, self.base, _precision(dtype), device).to(dtype)
        freq = self.inv_freq.to(device, dtype)
        if dtype != torch.float64 or self.inv_freq.dtype != torch.float32:
            return freq
        built = _frequencies(self.rotary_dim, self.base, torch.float32, device)
        exact = _frequencies(self.rotary_dim, self.base, torch.float64, device)
        return torch.where(freq == built, exact, freq)

    def _check_written(self) -> None:
        """Refuse an ``inv_freq`` assigned or written that cannot serve: its shape and dtype
        always, NaN/inf where the host holds it (a device's is not read back: NaN rows)."""
        freq = self.inv_freq
        read = (type(freq) in (torch.Tensor, nn.Parameter) and freq.device.type == "cpu"
                and not tracing()
                and not torch._C._are_functorch_transforms_active())
        problem = self._frequency_problem(freq, read)
        if problem == NONFINITE:
            raise ValueError(f"RotaryEmbedding: inv_freq {NONFINITE} (every rotated query and "
                             f"key would be NaN): assign finite frequencies, or set .base to "
                             f"rebuild them")
        if problem is not None:
            raise ValueError(f"RotaryEmbedding: inv_freq {problem}: assign frequencies of that "
                             f"shape, or set .base to rebuild them")

    def _tables_serve(self, x: torch.Tensor) -> bool:
        """Whether this call may read the shared table (see the module docstring)."""
        return (not tracing() and type(x) in (torch.Tensor, nn.Parameter)
                and not torch._C._are_functorch_transforms_active() and self._unchanged())

    @staticmethod
    def _split(rows: torch.Tensor):
        # rows (S, 2, D) or (B, S, 2, D) -> cos, sin (S, D) or (B, 1, S, D)
        if rows.dim() == 4:
            rows = rows.unsqueeze(1)                                     # (B, 1, S, 2, D)
        return rows.unbind(-2)

    def _table(self, device: torch.device, dtype: torch.dtype, rows: int):
        """The shared table of at least ``rows`` positions ``(rows', 2, D)`` on ``device``,
        grown if need be (kept unless a CUDA graph captures or a fake-tensor or tracing
        mode is on); None past :data:`TABLE_BYTES`."""
        key = (self.rotary_dim, self.base, device, dtype)
        table = _TABLES.get(key)
        if table is None or table.shape[0] < rows:
            most = TABLE_BYTES // (2 * self.rotary_dim * torch.finfo(dtype).bits // 8)
            if rows > most:
                return None
            with _GROWING:
                table = _TABLES.get(key)
                if table is None or table.shape[0] < rows:
                    n = min(most, max(FIRST_ROWS, 1 << (rows - 1).bit_length()))
                    with torch.inference_mode(False), torch.no_grad():   # a plain tensor
                        table = _angles(torch.arange(n, dtype=dtype, device=device),
                                        _frequencies(self.rotary_dim, self.base, dtype, device))
                    _TABLES.put(key, table)
        return table

"""A mask measured at token positions instead of slot indices.

A mask's predicate sees slot indices: the query's row and the key's column in the call.
Distance masks (``sliding_window``, ``alibi``) then count slots. When some slots are not
tokens (padding between a prompt and the tokens generated after it, a paused sequence in a
batched cache), slots and positions part, and a window counted in slots is too narrow.
:func:`at_positions` evaluates a mask at the positions the caller gives instead.
"""

from __future__ import annotations

import torch

from .._tracing import concrete
from .base import Index, Mask, TileIndex, one_batch
from .combine import And, Not, Or


def _as_positions(t, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor) or t.dtype.is_floating_point or t.dtype.is_complex \
            or t.dtype == torch.bool or t.dim() not in (1, 2):
        shown = (f"a {t.dim()}-D {t.dtype} tensor" if isinstance(t, torch.Tensor)
                 else type(t).__name__)
        raise ValueError(f"at_positions: {name} must be an integer tensor (S,) or (B, S) of "
                         f"token positions, got {shown}: pass e.g. torch.arange(S)")
    t = t.long()
    return t if t.dim() == 2 else t[None]                                # (B or 1, S)


class Positioned(Mask):
    """``mask`` with query slot ``i`` of sequence ``b`` at position ``q_positions[b, i]`` and
    key slot ``j`` at ``k_positions[b, j]``. Built by :func:`at_positions`.

    A leaf of kind ``"custom"``: backends that compile the masks they know by kind (the
    Triton kernels) must not see the slot-indexed mask inside, so they refuse it, and the
    backends that evaluate any predicate run it."""

    kind = "custom"
    _banded = True                      # (its bounds read a key tile's positions per column)
    #: what a backend's refusal calls it (its kind is a user's mask's)
    kind_label = "at_positions"
    _own_tensors = False                  # (the caller's positions, not copies)

    def __init__(self, mask: Mask, q_positions: torch.Tensor, k_positions: torch.Tensor):
        if not isinstance(mask, Mask):
            raise TypeError(f"at_positions: mask must be a multihead mask, got "
                            f"{type(mask).__name__}")
        self._m = mask
        self.q_positions = _as_positions(q_positions, "q_positions")      # (Bq, Sq)
        self.k_positions = _as_positions(k_positions, "k_positions")      # (Bk, Sk)
        if self.q_positions.device != self.k_positions.device:
            raise ValueError(f"at_positions: q_positions is on {self.q_positions.device} but "
                             f"k_positions on {self.k_positions.device}: put both on one device")
        self.batch_size                                    # (raises if the rows disagree)
        self.has_bias, self.has_predicate = mask.has_bias, mask.has_predicate

    @property
    def batch_size(self) -> int | None:
        # of the positions as they are (ones assigned in place of the mask's are followed)
        return one_batch("at_positions", {"q_positions": self.q_positions.shape[0],
                                          "k_positions": self.k_positions.shape[0],
                                          "mask": self.m.batch_size})

    @property
    def num_heads(self) -> int | None:
        return self.m.num_heads

    @property
    def m(self) -> Mask:
        """The mask evaluated at the positions. Read-only."""
        return self._m

    def describe(self) -> str:
        return f"at_positions({self.m.describe()})"

    @property
    def memoizable(self) -> bool:
        return type(self) is Positioned and self.m.memoizable

    def structure(self):
        inner = self.m.structure()
        if inner is None or not self.memoizable:
            return None
        # rows only: the lengths are the call's (a padded cache's steps share auto's choice)
        return ("at_positions", inner, self.q_positions.shape[0], self.k_positions.shape[0])

    def _lengths(self):
        return self.q_positions.shape[1], self.k_positions.shape[1]

    def _least(self):               # (its leaves that hold a value per slot keep naming slots)
        return self.m._least()

    _preview_size = _lengths        # one position per slot: drawn at those lengths

    def _tensors(self):
        return [self.q_positions, self.k_positions, *self.m._tensors()]

    def _to(self, device) -> "Positioned":
        new = self._moved(device, "q_positions", "k_positions")
        new._m = self.m.to(device)
        return new

    def _check(self, batch, heads, sq, sk):
        super()._check(batch, heads, sq, sk)
        for name, t, n in (("q_positions", self.q_positions, sq),
                           ("k_positions", self.k_positions, sk)):
            if t.shape[1] != n:
                raise ValueError(f"at_positions: {name} has {concrete(t.shape[1])} positions but "
                                 f"the call has {concrete(n)} {name[0]} slots: give one position "
                                 f"per slot")
        self.m._check(batch, heads, sq, sk)

    def _at(self, ix: Index) -> Index:
        """``ix`` with slots replaced by positions; the lengths made equal, so an alignment
        adds nothing (the positions place queries and keys)."""
        bq = ix.b if len(self.q_positions) > 1 else ix.b * 0
        bk = ix.b if len(self.k_positions) > 1 else ix.b * 0
        q = self.q_positions[bq, ix.q]                                     # (B', 1, Sq, 1)
        k = self.k_positions[bk, ix.k]                                     # (B', 1, 1, Sk)
        return Index(ix.b, ix.h, q, k, ix.sk, ix.sk, ix.dtype)

    def _allowed(self, ix: Index) -> torch.Tensor:
        return self.m._allowed(self._at(ix))

    def _bias(self, ix: Index):
        return self.m._bias(self._at(ix))

    def _tile_bounds(self, tx: TileIndex):
        from .structured import Window, _tile_minmax
        dev = tx.q0.device
        if type(self.m) is not Window:      # a user's bounds may assume slots: every tile
            return (torch.ones(1, 1, 1, 1, dtype=torch.bool, device=dev),      # may be partly
                    torch.zeros(1, 1, 1, 1, dtype=torch.bool, device=dev))     # allowed (sound)
        # positions need not grow with slots: a tile's positions lie between their least and
        # greatest, and a window's bounds hold for every pair of that rectangle (on device)
        qlo, qhi = _tile_minmax(self.q_positions.to(dev), tx.tile_q)          # (Bq, nQ)
        klo, khi = _tile_minmax(self.k_positions.to(dev), tx.tile_k)          # (Bk, nK)
        placed = TileIndex(tx.b, tx.h, qlo[:, None, :, None], qhi[:, None, :, None],
                           tx.cols(klo[:, None, None, :]), tx.cols(khi[:, None, None, :]),
                           tx.sk, tx.sk, tx.tile_q, tx.tile_k)   # lengths equal: no alignment
        return self.m._tile_bounds(placed)


def at_positions(mask: Mask, q_positions: torch.Tensor, k_positions: torch.Tensor) -> Mask:
    """``mask`` evaluated at token positions instead of slot indices.

    A distance mask counts the slots between a query and a key. Where slots are not tokens
    (padding after a prompt, then generated tokens), give each slot's position: the window
    or ALiBi distance is then ``q_positions[b, i] - k_positions[b, j]``. The leaves that
    measure order or distance (``causal``, ``sliding_window``, ``alibi``, a custom
    predicate) see the positions, and their alignment no longer applies (the positions
    place queries and keys); the leaves that hold one value per slot (``padding``,
    ``document``, ``dense``, ``bias``) keep indexing slots. Tiles a repositioned window
    rules out are skipped (from each tile's least and greatest position; positions need not
    grow with the slots); a custom predicate's tiles are not. Positions within ``±2**62``
    (a tile's distances are taken in int64). Positions may be negative
    (``cumsum - 1`` of a left-padded row starts at -1).

    Args:
        mask: the mask to evaluate.
        q_positions: ``(Sq,)`` or ``(B, Sq)`` integer positions of the query slots.
        k_positions: ``(Sk,)`` or ``(B, Sk)`` integer positions of the key slots.

    Returns:
        A mask that may be combined as any other; calls must have ``Sq`` and ``Sk`` slots.

    Raises:
        ValueError: ``mask`` has no leaf that measures order or distance (positions would
            change nothing), or the positions are not integer tensors of one batch size.

    Example:
        >>> import torch, multihead as mh
        >>> k = torch.tensor([0, 1, 1, 2])           # slot 2 is padding (the position repeats)
        >>> m = mh.masks.at_positions(mh.masks.sliding_window(2), k[3:], k)
        >>> m.materialize(1, 4)[0, 0].int().tolist()  # the last token sees 2 tokens back
        [[0, 1, 1, 1]]
    """
    if not isinstance(mask, Mask):
        raise TypeError(f"at_positions: mask must be a multihead mask, got "
                        f"{type(mask).__name__}")
    if any(isinstance(leaf, Positioned) for leaf in mask.leaves()):
        raise ValueError(f"at_positions: {mask.describe()} is already placed at positions: "
                         f"give the positions once, in one at_positions of the whole mask")
    if not any(_measures_positions(leaf) for leaf in mask.leaves()):
        raise ValueError(f"at_positions: {mask.describe()} has no leaf that measures order or "
                         f"distance (causal, sliding_window, alibi, a custom predicate): its "
                         f"leaves index slots, so positions would change nothing; use the mask "
                         f"as it is")
    return _reposition(mask, q_positions, k_positions, _measures_positions)


def _measures_positions(m: Mask) -> bool:
    """A leaf whose predicate compares query and key indices (not one holding a value per
    slot, nor one already placed at positions)."""
    return m.kind in ("causal", "window", "alibi", "custom") and not isinstance(m, Positioned)


def _is_distance(m: Mask) -> bool:
    from .structured import Window
    from .tensor import ALiBi
    return (isinstance(m, Window) and m.size is not None) or isinstance(m, ALiBi)


def distances_in_tokens(mask: Mask | None, key_valid: torch.Tensor, n: int):
    """``mask`` for a cached call whose keys ``key_valid`` ``(B, Sk)`` mark real tokens and
    whose ``n`` queries are the last ``n`` slots: its distance leaves (``sliding_window``,
    ``alibi``) count tokens (:func:`at_positions`, position = real tokens before the slot);
    the rest (causal order, padding, documents, tensors) keep counting slots. A mask with
    no distance leaf is returned as it is, with no device op.

    Example:
        >>> import torch, multihead as mh
        >>> key_valid = torch.tensor([[True, True, False, True]])     # slot 2 is padding
        >>> m = distances_in_tokens(mh.masks.causal() & mh.masks.sliding_window(2), key_valid, 1)
        >>> [leaf.describe() for leaf in m.leaves()]
        ["causal(align='lower_right')", "at_positions(sliding_window(2, align='lower_right'))"]
        >>> m.materialize(1, 4)[0, 0].int().tolist()                  # 2 tokens: slots 1 and 3
        [[0, 1, 1, 1]]
    """
    if mask is None or not any(_is_distance(leaf) for leaf in mask.leaves()):
        return mask
    k_pos = key_valid.cumsum(-1) - 1                                           # (B, Sk)
    return _reposition(mask, k_pos[:, k_pos.shape[1] - n:], k_pos,            # q: (B, n)
                       _is_distance)


def _reposition(mask: Mask, q_positions: torch.Tensor, k_positions: torch.Tensor,
                moves) -> Mask:
    """``mask`` with each leaf ``moves`` picks wrapped in :class:`Positioned`."""
    if isinstance(mask, (And, Or)):
        a, b = (_reposition(x, q_positions, k_positions, moves) for x in (mask.a, mask.b))
        return type(mask)(a, b)
    if isinstance(mask, Not):
        return Not(_reposition(mask.m, q_positions, k_positions, moves))
    return Positioned(mask, q_positions, k_positions) if moves(mask) else mask

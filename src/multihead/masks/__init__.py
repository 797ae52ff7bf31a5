"""Masks: one convention everywhere, ``True`` means *may attend*.

Build masks with the factory functions and compose them with ``&``, ``|`` and ``~``::

    m = causal() & padding(lengths)          # decoder with right-padded batch
    m = causal() & document(doc_ids)         # packed sequences
    m = sliding_window(256) & alibi(12)      # additive biases are masks too
    m = at_positions(sliding_window(4), q_pos, k_pos)   # distances in tokens, not slots

Every mask can be materialized (:meth:`Mask.materialize`), turned into an additive float
tensor (:meth:`Mask.additive`), and classified per tile (:meth:`Mask.tiles`) so that
kernels skip the work it rules out.
"""

from .base import EMPTY, FULL, PARTIAL, Mask, TileMap
from .combine import And, Not, Or
from .positioned import Positioned, at_positions
from .structured import Document, Padding, Window, causal, document, padding, sliding_window
from .tensor import ALiBi, Bias, Dense, alibi, alibi_slopes, bias, dense

__all__ = [
    "Mask", "TileMap", "EMPTY", "PARTIAL", "FULL", "And", "Or", "Not",
    "causal", "sliding_window", "padding", "document", "dense", "bias", "alibi", "alibi_slopes",
    "at_positions", "Window", "Padding", "Document", "Dense", "Bias", "ALiBi", "Positioned",
]

"""Modules: :class:`MultiHeadAttention` and :class:`RotaryEmbedding`."""

from .attention import MultiHeadAttention, Projection
from .rope import RotaryEmbedding

__all__ = ["MultiHeadAttention", "Projection", "RotaryEmbedding"]

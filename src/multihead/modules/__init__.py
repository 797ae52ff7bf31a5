"""Modules: :class:`MultiHeadAttention`, :class:`RotaryEmbedding` and the KV caches."""

from .attention import MultiHeadAttention, Projection
from .kv_cache import KVCache
from .paged_cache import PagedBatch, PagedKVCache
from .rope import RotaryEmbedding

__all__ = ["MultiHeadAttention", "Projection", "RotaryEmbedding", "KVCache", "PagedKVCache",
           "PagedBatch"]

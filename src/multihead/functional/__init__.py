"""Functional core: :func:`attention`, :func:`explain` and the backend registry.

Backends register themselves on import; ``reference`` is the oracle of the others.
"""

from . import blocksparse, reference, sdpa, varlen  # noqa: F401  (register the backends)
from .dispatch import Explanation, attention, explain
from .registry import Backend, backends, register

__all__ = ["attention", "explain", "Explanation", "backends", "Backend", "register"]

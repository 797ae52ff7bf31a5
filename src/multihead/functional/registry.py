"""The backend registry: each backend declares what it can do and what it costs.

Adding a backend is one file: subclass :class:`Backend`, implement ``unsupported``,
``cost`` and ``run``, and call :func:`register` at import time (see ``reference.py``).
The dispatcher picks the cheapest backend whose ``unsupported`` returns ``None``.
"""

from __future__ import annotations

from ._call import AttentionCall

Result = tuple  # (out (B, H, Sq, Dv), weights (B, H, Sq, Sk) | None, lse (B, H, Sq) | None)


class Backend:
    """One way to compute attention.

    Attributes:
        name: the name users pass as ``backend=``.
        summary: one line for :func:`multihead.backends` and ``explain()``.
    """

    name: str = "?"
    summary: str = ""
    #: can run inside torch.compile(fullgraph=True) without graph breaks
    traceable: bool = True

    def unsupported(self, call: AttentionCall) -> str | None:
        """Why this backend cannot run ``call`` (a short reason), or None if it can."""
        return None

    def cost(self, call: AttentionCall) -> float:
        """Estimated cost in units of dense multiply-adds (lower is better)."""
        raise NotImplementedError(f"backend {self.name!r} must implement cost()")

    def cost_note(self, call: AttentionCall) -> str:
        """A few words on where the cost estimate comes from (shown by explain())."""
        return ""

    def run(self, call: AttentionCall) -> Result:
        """Compute ``(out, weights or None, lse or None)``; weights/lse only when asked."""
        raise NotImplementedError(f"backend {self.name!r} must implement run()")


_REGISTRY: dict[str, Backend] = {}


def register(backend: Backend) -> Backend:
    """Add a backend to the registry (by its ``name``) and return it."""
    _REGISTRY[backend.name] = backend
    return backend


def get(name: str) -> Backend:
    if not isinstance(name, str) or name not in _REGISTRY:
        known = ", ".join(["auto", *_REGISTRY])
        raise ValueError(f"unknown backend {name!r}: choose one of {known}")
    return _REGISTRY[name]


def all_backends() -> dict[str, Backend]:
    return dict(_REGISTRY)


def backends() -> dict[str, str]:
    """The registered backends and what each one is.

    Example:
        >>> import multihead as mh
        >>> sorted(mh.backends())
        ['blocksparse', 'reference', 'sdpa', 'varlen']
    """
    return {name: b.summary for name, b in _REGISTRY.items()}

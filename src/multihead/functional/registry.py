"""The backend registry: each backend declares what it supports and what a call costs it.

Adding a backend is one file in ``multihead/functional/backend/`` (found and imported when
``multihead`` is): subclass :class:`Backend`, declare its :class:`Capabilities`, implement
``plan`` (the :class:`Work` a call costs it, in device-neutral units) and ``run``, and call
:func:`register`. The dispatcher prices every plan with the device's profile and runs the
cheapest; the generic tests pick up every registered backend.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any

from ._call import AttentionCall
from .capabilities import Capabilities
from .cost import DeviceProfile, Work

Result = tuple  # (out (B, H, Sq, Dv), weights (B, H, Sq, Sk) | None, lse (B, H, Sq) | None)


@dataclass(frozen=True)
class Plan:
    """How a backend would run a call: its work, a few words for ``explain()``, and the
    host-side details ``run`` needs (no tensors derived from a mask's contents, unless the
    plan is only cached with that mask).

    Attributes:
        work: the call's cost in device-neutral units.
        note: where the estimate comes from, for ``explain()``.
        detail: backend-specific choices made while planning, handed back to ``run``.
        traced_choice: under Dynamo (``torch.compile``, ``torch.export(strict=True)``),
            ``auto`` takes this plan without comparing estimates: a comparison of traced
            estimates guards on the sizes (a recompile where it flips; a strict export's
            program that fails at other lengths).
    """

    work: Work
    note: str = ""
    detail: Any = None
    traced_choice: bool = False


class Backend:
    """One way to compute attention.

    Attributes:
        name: the name users pass as ``backend=``.
        summary: one line for :func:`multihead.backends` and ``explain()``.
        capabilities: what it supports, as data (per device type: override
            :meth:`capabilities_on`).
    """

    name: str = "?"
    summary: str = ""
    capabilities: Capabilities = Capabilities()
    #: its kernel returns a row of zeros, not NaN, where every score of the row is NaN
    #: (torch's fused CPU kernel): :mod:`.nonfinite` then reads the keys of a zero row
    zero_rows_for_nan_scores: bool = False
    #: its backward multiplies every key it computed with, hidden ones included, so an
    #: infinite hidden key makes q's gradient NaN (``0 * inf``): :mod:`.nonfinite` then
    #: reads k of a call whose q needs gradients and zeroes the hidden non-finite keys
    grad_reads_hidden_keys: bool = True
    #: a decision refers to its (registered, shared) backend but does not own what the
    #: backend holds: caches do not count it (:func:`multihead._cache.nbytes`)
    _cache_opaque = True

    def capabilities_on(self, device_type: str) -> Capabilities:
        """The capabilities on one device type (the same everywhere unless overridden)."""
        return self.capabilities

    def unsupported(self, call: AttentionCall, device_type: str) -> list[str]:
        """Every reason this backend cannot run ``call`` on ``device_type`` (empty when it
        can): the declared capabilities first, then :meth:`check` for what data cannot say."""
        reasons = self.capabilities_on(device_type).reasons(call, device_type)
        if not reasons:
            extra = self.check(call)
            if extra:
                reasons.append(extra)
        return reasons

    def check(self, call: AttentionCall) -> str | None:
        """A reason the declared capabilities cannot express, or None."""
        return None

    def plan(self, call: AttentionCall, profile: DeviceProfile) -> Plan:
        """The :class:`Plan` for ``call``: its :class:`Work` and the details ``run`` needs."""
        raise NotImplementedError(f"backend {self.name!r} must implement plan()")

    def length_free(self, plan: Plan) -> bool:
        """Whether ``plan``, made for a call with no mask in effect, runs that call at any
        other key length as well (what :meth:`run` reads of it does not depend on Sk): a
        decoding loop whose cache grows then plans once per doubling of its length, not at
        every step. A backend that says so must also not depend on Sk in what it can run
        (:meth:`unsupported` is not asked again for the other lengths). False unless a
        backend says so.

        Example:
            >>> import torch, multihead as mh
            >>> q, kv = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 50, 8)
            >>> e = mh.explain(q, kv, kv, mask=mh.masks.causal(), backend="sdpa")
            >>> get("sdpa").length_free(e.plan), get("reference").length_free(e.plan)
            (True, False)
        """
        return False

    def run(self, call: AttentionCall, plan: Plan) -> Result:
        """Compute ``(out, weights or None, lse or None)``; weights/lse only when asked."""
        raise NotImplementedError(f"backend {self.name!r} must implement run()")


_REGISTRY: dict[str, Backend] = {}
#: bumped whenever the set of backends changes, so cached dispatch decisions are dropped
generation = 0


def register(backend: Backend) -> Backend:
    """Add a backend to the registry (by its ``name``) and return it."""
    global generation
    if not isinstance(backend, Backend) or not isinstance(backend.name, str):
        raise TypeError(f"register takes a Backend instance with a name, got {backend!r}")
    _REGISTRY[backend.name] = backend
    generation += 1
    return backend


def unregister(name: str) -> None:
    """Remove a registered backend (cached decisions that chose it are dropped)."""
    global generation
    get(name)
    del _REGISTRY[name]
    generation += 1


def discover() -> None:
    """Import every module of ``multihead.functional.backend`` (each registers itself);
    ``import multihead`` does it. Files starting with ``_`` are helpers, not backends.

    Example:
        >>> discover(); {"blocksparse", "reference", "sdpa", "varlen"} <= set(backends())
        True
    """
    package = importlib.import_module(f"{__package__}.backend")
    for name in sorted(info.name for info in pkgutil.iter_modules(package.__path__)):
        if not name.startswith("_"):
            importlib.import_module(f"{package.__name__}.{name}")


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
        >>> {"blocksparse", "reference", "sdpa", "varlen"} <= set(mh.backends())  # + "triton"
        True
    """
    return {name: b.summary for name, b in _REGISTRY.items()}

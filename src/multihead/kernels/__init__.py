"""Our own GPU kernels, in Triton; imported only when Triton is installed.

Tests run them on the CPU through Triton's interpreter (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

#: |lse| in base 2 from which a backward recomputes a row's softmax statistics instead of
#: reading them from its lse, which may have lost the log of the row's sum (see
#: :mod:`._exact_rows`; natural 710, in practice reached only through a bias). The Triton
#: kernels and the torch backends share it
HUGE_LSE2 = 1024.0


def available() -> bool:
    """True when Triton can be imported (the kernels' one dependency beyond torch).

    Example:
        >>> import multihead as mh
        >>> available() == ("triton" in mh.backends())     # the backend registers with it
        True
    """
    return importlib.util.find_spec("triton") is not None


#: the module whose import makes our operators' FLOP formulas join torch's registry
FLOP_COUNTER = "torch.utils.flop_counter"


class _Then(importlib.abc.Loader):
    """A module's own loader, then ``then()`` once the module has run (again on a reload)."""

    def __init__(self, loader, then):
        self.loader, self.then = loader, then

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        self.then()

    def __getattr__(self, name):                   # get_source, get_filename, ...
        if name == "loader":                       # (not set yet: no recursion)
            raise AttributeError(name)
        return getattr(self.loader, name)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs ``then()`` right after module ``name`` is first imported (whoever imports it),
    through a loader of its spec's own; it finds nothing itself."""

    def __init__(self, name: str, then):
        self.name, self.then = name, then

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name or self not in sys.meta_path:
            return None
        sys.meta_path.remove(self)                 # once; and the lookup below skips it
        spec = importlib.util.find_spec(fullname)
        if spec is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _Then(spec.loader, self.then)
        return spec


def _register_flops() -> None:
    try:
        from . import flops       # (it registers the formulas on import; again after a
        flops.register()          # reload of torch's counter, which empties its registry)
    except Exception as e:                         # noqa: BLE001 - never break torch's import
        try:
            warnings.warn(f"multihead could not register its Triton operators' FLOP formulas "
                          f"with {FLOP_COUNTER} ({type(e).__name__}: {e}); FlopCounterMode "
                          f"counts no FLOPs for them", RuntimeWarning, stacklevel=2)
        except Exception:                          # noqa: BLE001 - warnings made errors
            pass


def count_flops_with_torch() -> None:
    """Make our operators' FLOP formulas (:mod:`.flops`) join ``torch.utils.flop_counter``'s
    registry when that module is imported (now, if it is already): a ``FlopCounterMode``
    copies the registry when it is made, so registering at the kernels' first call would
    come too late for a counter already running, and importing the counter with multihead
    would cost every process Triton's import (a quarter of a second).

    Example:
        >>> import torch
        >>> count_flops_with_torch()               # (multihead did so on import)
        >>> from torch.utils.flop_counter import flop_registry
        >>> torch.ops.multihead.flash_attention in flop_registry
        True
    """
    if FLOP_COUNTER in sys.modules:
        _register_flops()
    elif not any(isinstance(f, _AfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImport(FLOP_COUNTER, _register_flops))

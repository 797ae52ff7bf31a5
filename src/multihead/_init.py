"""Build modules without spending time on random initialization."""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def skip_init():
    """Make ``torch.nn.init`` a no-op while modules whose weights will be loaded are built.

    (Building on the meta device would also skip the work, but its first use costs seconds
    of one-time setup on the CPU, which ``multihead inspect`` cannot afford.)
    """
    names = ("uniform_", "normal_", "kaiming_uniform_", "xavier_uniform_", "zeros_", "ones_")
    saved = {n: getattr(torch.nn.init, n) for n in names}
    try:
        for n in names:
            setattr(torch.nn.init, n, lambda tensor, *a, **k: tensor)
        yield
    finally:
        for n, f in saved.items():
            setattr(torch.nn.init, n, f)

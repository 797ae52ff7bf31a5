"""A corpus of real English texts, rebuilt offline from the Python standard library.

Paragraphs of the standard library's module docstrings, sampled with a fixed seed and kept
between ``lo`` and ``hi`` tokens: real sentences of mixed length that anyone can rebuild.
"""

from __future__ import annotations

import importlib
import pkgutil
import random
import re
import warnings


def corpus(model, n: int = 256, lo: int = 8, hi: int = 128, seed: int = 0) -> list[str]:
    """``n`` docstring paragraphs of ``lo``..``hi`` tokens, seeded sample."""
    paragraphs = set()
    for mod in sorted(m.name for m in pkgutil.iter_modules() if not m.name.startswith("_")):
        if mod in ("antigravity", "this", "idlelib", "turtledemo", "tkinter", "test"):
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                doc = importlib.import_module(mod).__doc__ or ""
        except Exception:  # noqa: BLE001 (optional stdlib parts may be missing)
            continue
        for p in re.split(r"\n\s*\n", doc):
            text = " ".join(p.split())
            if re.search(r"[a-z]{3,} [a-z]{3,} [a-z]{3,}", text) and not text.startswith(">>>"):
                paragraphs.add(text)
    sized = [p for p in sorted(paragraphs) if lo <= len(model.tokenize(p).ids) <= hi]
    random.Random(seed).shuffle(sized)
    if len(sized) < n:
        raise RuntimeError(f"only {len(sized)} paragraphs of {lo}..{hi} tokens found")
    return sized[:n]

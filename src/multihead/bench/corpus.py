"""A corpus of real English texts, rebuilt offline from the Python standard library.

Paragraphs of the standard library's module docstrings, sampled with a fixed seed and kept
between ``lo`` and ``hi`` tokens: real sentences of mixed length that anyone can rebuild.
Only the standard library's own modules are read (``sys.stdlib_module_names``, from the
standard library's folder, or built in), and none is imported to read it: the texts do not
change with the packages installed, and a file of the same name in the current folder
(first on the path under ``python -m``) is never run.
"""

from __future__ import annotations

import ast
import importlib
import random
import re
import sys
import sysconfig
from pathlib import Path

#: modules left out (test suites and demos)
_SKIP = ("antigravity", "this", "idlelib", "turtledemo", "tkinter", "test")


def _docstrings() -> list[str]:
    """The docstrings of the standard library's public top-level modules, by name."""
    root = Path(sysconfig.get_paths()["stdlib"])
    docs = []
    for name in sorted(sys.stdlib_module_names):
        if name.startswith("_") or name in _SKIP:
            continue
        if name in sys.builtin_module_names:       # (compiled into the interpreter: no file
            docs.append(importlib.import_module(name).__doc__ or "")   # can shadow it)
            continue
        for path in (root / f"{name}.py", root / name / "__init__.py"):
            if path.is_file():
                try:
                    docs.append(ast.get_docstring(ast.parse(path.read_bytes())) or "")
                except (SyntaxError, ValueError):  # (not this Python's syntax: skipped)
                    pass
                break
    return docs


def corpus(model, n: int = 256, lo: int = 8, hi: int = 128, seed: int = 0) -> list[str]:
    """``n`` docstring paragraphs of ``lo``..``hi`` tokens, seeded sample."""
    paragraphs = set()
    for doc in _docstrings():
        for p in re.split(r"\n\s*\n", doc):
            text = " ".join(p.split())
            if re.search(r"[a-z]{3,} [a-z]{3,} [a-z]{3,}", text) and not text.startswith(">>>"):
                paragraphs.add(text)
    sized = [p for p in sorted(paragraphs) if lo <= len(model.tokenize(p).ids) <= hi]
    random.Random(seed).shuffle(sized)
    if len(sized) < n:
        raise RuntimeError(f"only {len(sized)} paragraphs of {lo}..{hi} tokens found")
    return sized[:n]

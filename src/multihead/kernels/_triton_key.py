"""Triton's installation key, remembered across processes (first use, issue 12).

Every kernel Triton compiles or finds in its disk cache is keyed by
``triton.runtime.cache.triton_key()``: SHA-256 digests of Triton's own Python sources and
of its ``libtriton`` library (415-500 MB). A process computes it once, at its first
compile: 0.33 s of the 0.48 s that a warm start's first call (every kernel already in the
disk cache) took on the CI's 2-core machine, ``python -m benchmarks.triton_compile --stub
--profile``.

:func:`install` keeps the key in a small file in Triton's cache folder, with a fingerprint
of every file it is computed from (path, size, modification and change times, inode:
``os.stat``, 2 ms for Triton's 300 files). A later process whose fingerprint matches hands
Triton the kept key instead of hashing again, the way Triton's own pre-loading workers
hand theirs one (``triton.runtime.cache.triton_key`` replaced by a function returning
it). Reinstalling or editing Triton changes the fingerprint, and the key is computed
afresh. The fingerprint covers more files than the key (everything under Triton's
``compiler``, ``backends`` and ``language`` folders, symbolic links followed as Triton's
own walk follows them, which an editable install of Triton has), never fewer. It applies
only to a ``triton_key`` whose source is one read here (:data:`KNOWN`: Triton 3.6 to 3.9):
a Triton that adds another input to its key (an environment variable, say) keeps
computing it, until its function is read and added.

Nothing here can fail a call: an unreadable or unwritable folder, a file from another
version, a Triton without this function, all leave Triton computing its key as before.
``MULTIHEAD_TRITON_KEY_CACHE=0`` turns it off. A new ``TRITON_CACHE_DIR`` (a cold start)
has no kept key, so a cold start still pays for it.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import os
import sysconfig
from pathlib import Path

from .._files import atomic_write
from .._fork import module_lock

#: the file, in Triton's cache folder, that keeps the key and its fingerprint
FILE = "multihead-triton-key.json"
#: the folders of Triton's package whose files the key is computed from
_FOLDERS = ("compiler", "backends", "language")
#: SHA-256 of the source of the ``triton_key`` functions whose inputs are only the files
#: fingerprinted here (Triton 3.6.0 and 3.9.0 have the same one)
KNOWN = frozenset({"7d2c8021b5b5b005dc2a4457bc365b3d78ac10d2613df98d5bb216e343fe1140"})

_LOCK = module_lock(globals(), "_LOCK")
_DONE = False


def enabled() -> bool:
    """False with ``MULTIHEAD_TRITON_KEY_CACHE=0``."""
    return os.environ.get("MULTIHEAD_TRITON_KEY_CACHE", "1") != "0"


def fingerprint(root: str) -> list:
    """``[path, size, mtime_ns, ctime_ns, inode]`` of every file ``triton_key()`` reads
    under Triton's package folder ``root`` (and of the other files in its folders),
    sorted by path; Python's compiled caches left out.

    Example:
        >>> import triton, os
        >>> rows = fingerprint(os.path.dirname(triton.__file__))
        >>> any(r[0].startswith("_C" + os.sep + "libtriton") for r in rows)
        True
    """
    ext = sysconfig.get_config_var("EXT_SUFFIX").split(".")[-1]
    paths = [os.path.join("runtime", "cache.py"), os.path.join("_C", f"libtriton.{ext}")]
    for folder in _FOLDERS:
        for here, dirs, files in os.walk(os.path.join(root, folder), followlinks=True):
            dirs[:] = sorted(d for d in dirs if d != "__pycache__")
            paths += [os.path.relpath(os.path.join(here, f), root) for f in files]
    rows = []
    for path in sorted(paths):
        st = os.stat(os.path.join(root, path))
        rows.append([path, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino])
    return rows


def known(compute) -> bool:
    """Whether ``compute`` (Triton's ``triton_key``, memoized) is one whose inputs are the
    fingerprinted files only: its source is in :data:`KNOWN`.

    Example:
        >>> known(functools.lru_cache()(lambda: "a key hashed from something else"))
        False
    """
    try:
        source = inspect.getsource(compute.__wrapped__)
    except (AttributeError, OSError, TypeError):
        return False
    return hashlib.sha256(source.encode()).hexdigest() in KNOWN


def install() -> None:
    """Before a process's first compile: hand Triton its installation key from the kept
    file when Triton's files are unchanged, else let Triton compute it (once, under a lock,
    so that threads compiling at once do not each hash) and keep it. Later calls return at
    once.

    Example:
        >>> install()          # the first compile of this process then skips the hashing
    """
    global _DONE
    if _DONE:
        return
    with _LOCK:
        if _DONE:
            return
        try:
            _install()
        except (OSError, ValueError, TypeError, KeyError, AttributeError, ImportError):
            pass                                     # Triton computes its key, as before
        _DONE = True


def _install() -> None:
    import triton
    from triton.runtime import cache

    from triton import knobs

    compute = cache.triton_key
    if not enabled() or knobs.runtime.interpret or not hasattr(compute, "cache_info"):
        return                   # off, nothing compiles (no key needed), or not a memo
    if compute.cache_info().currsize or not known(compute):
        return                   # computed in this process already, or not a known function
    folder = knobs.cache.dir
    root = os.path.dirname(os.path.abspath(triton.__file__))
    kept = _read(os.path.join(folder, FILE))
    head = {"triton": triton.__version__, "root": root}
    rows = fingerprint(root)
    if kept is not None and kept.get("head") == head and kept.get("files") == rows \
            and isinstance(kept.get("key"), str):
        key = kept["key"]
        cache.triton_key = functools.lru_cache()(lambda: key)
        return
    key = compute()                                  # Triton's own hashing, kept in-process
    os.makedirs(folder, exist_ok=True)
    atomic_write(Path(folder) / FILE, json.dumps({"head": head, "files": rows, "key": key}))


def _read(path: str) -> dict | None:
    try:
        with open(path, encoding="utf-8") as f:
            kept = json.load(f)
    except (OSError, ValueError):
        return None
    return kept if isinstance(kept, dict) else None


"""Locks a forked child can take.

A lock another thread holds when the process forks stays held in the child, where that
thread does not exist: the child's first call that takes it would wait forever (a
DataLoader worker or a ``multiprocessing`` pool forked while a serving thread was inside
``attention()``). Every lock of the library is made here; after a fork, the child gives
each one that was held a fresh lock, and an object caught mid-update by it (a cache) is
put back in order (see :func:`renew_after_fork`).
"""

from __future__ import annotations

import os
import threading
import weakref

_MODULE_LOCKS: list[tuple[dict, str]] = []      # (a module's globals, the lock's name)
_OBJECTS: "weakref.WeakSet" = weakref.WeakSet()  # objects with _renew_after_fork()


def module_lock(namespace: dict, name: str) -> threading.Lock:
    """A new lock, to be stored as ``namespace[name]`` (a module's ``globals()``) and used
    from there: a child forked while it was held finds a free one there.

    Example:
        >>> _LOCK = module_lock(globals(), "_LOCK")
        >>> with _LOCK:
        ...     pass
    """
    _MODULE_LOCKS.append((namespace, name))
    return threading.Lock()


def renew_after_fork(obj) -> None:
    """Call ``obj._renew_after_fork()`` in every child forked while ``obj`` lives (held
    weakly): it replaces its locks that are held, and mends what they guard."""
    _OBJECTS.add(obj)


def _in_child() -> None:
    for namespace, name in _MODULE_LOCKS:
        lock = namespace.get(name)
        if lock is not None and lock.locked():
            namespace[name] = threading.Lock()
    for obj in list(_OBJECTS):
        obj._renew_after_fork()


if hasattr(os, "register_at_fork"):                 # (not on Windows, which cannot fork)
    os.register_at_fork(after_in_child=_in_child)

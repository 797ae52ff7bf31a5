"""How much host memory this process may use: the machine's, within its limits.

A container sees the whole machine in ``/proc/meminfo`` and in the count of physical
pages, though its memory cgroup kills it well before that; ``ulimit -v`` (an address-space
rlimit) makes an allocation past it fail. Both bound what a plan's scratch buffers and a
cache may take, so the capacity ``auto`` prices with and the free memory that refuses an
oversized buffer are the tightest of the three (Linux; elsewhere the machine's figures).

cgroup v2 keeps ``memory.max`` and ``memory.current`` in the process's own directory under
``/sys/fs/cgroup``; v1 keeps ``memory.limit_in_bytes`` and ``memory.usage_in_bytes`` under
``/sys/fs/cgroup/memory``. A limit may be set on any ancestor, so every one is read. The page
cache's inactive part counts as used there but is given back on demand: it counts as free.
"""

from __future__ import annotations

import os
from typing import NamedTuple

try:
    import resource
except ImportError:              # (Windows)
    resource = None

#: v2 and v1: (the hierarchy's directory under the cgroup mount, the limit's and the
#: usage's file, the line of ``memory.stat`` that counts reclaimable page cache)
_LAYOUTS = {"v2": ("", "memory.max", "memory.current", "inactive_file"),
            "v1": ("memory", "memory.limit_in_bytes", "memory.usage_in_bytes",
                   "total_inactive_file")}


class Limit(NamedTuple):
    """A bound on the process's memory: its size, and how much of it is free now."""

    total: int
    free: int


def _read_int(path: str) -> int | None:
    """The number a cgroup file holds, or None (no file, or ``max``: no limit)."""
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _stat(path: str, key: str) -> int | None:
    """The first number on the line of ``path`` that ``key`` starts (``"inactive_file 4096"``,
    ``"MemAvailable:   2048 kB"``), or None."""
    try:
        with open(path) as f:
            for line in f:
                words = line.split()
                if len(words) > 1 and words[0] == key:
                    return int(words[1])
    except (OSError, ValueError):
        pass
    return None


def _cgroup_dirs(proc: str, root: str) -> list[tuple[str, str]]:
    """``(layout, directory)`` of the process's memory cgroup and of each ancestor, from
    ``proc`` (``/proc/self/cgroup``): ``"0::/path"`` is v2, ``"N:...memory...:/path"`` v1."""
    try:
        with open(proc) as f:
            lines = f.read().splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        layout = "v2" if controllers == "" else "v1" if "memory" in controllers.split(",") else None
        if layout is None:
            continue
        base = os.path.join(root, _LAYOUTS[layout][0])
        parts = [p for p in path.split("/") if p]
        # the leaf first, then each ancestor up to the mount's root (a container's cgroup
        # namespace shows its own cgroup as that root, so its path may be missing: skipped)
        found += [(layout, os.path.join(base, *parts[:n])) for n in range(len(parts), -1, -1)]
    return found


def cgroup_limit(proc: str = "/proc/self/cgroup", root: str = "/sys/fs/cgroup") -> Limit | None:
    """The tightest memory limit of the process's cgroups (v2 or v1) and what it leaves free,
    or None where no limit is set (or cgroups are not readable).

    Example:
        >>> cgroup_limit(proc="/nonexistent") is None
        True
    """
    best = None
    for layout, d in _cgroup_dirs(proc, root):
        _, limit_file, usage_file, cache_key = _LAYOUTS[layout]
        limit, usage = _read_int(os.path.join(d, limit_file)), _read_int(os.path.join(d, usage_file))
        if limit is None or usage is None or limit >= 1 << 60:     # unlimited (v1: ~2**63)
            continue
        cache = _stat(os.path.join(d, "memory.stat"), cache_key) or 0
        here = Limit(limit, max(0, limit - max(0, usage - cache)))
        if best is None or here.free < best.free:
            best = here
    return best


def _address_space() -> Limit | None:
    """``ulimit -v``: the address-space rlimit and what the process's mappings leave of it."""
    if resource is None:
        return None
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft == resource.RLIM_INFINITY:
        return None
    used = (_stat("/proc/self/status", "VmSize:") or 0) * 1024     # (kB; 0 where unknown)
    return Limit(soft, max(0, soft - used))


def free() -> int | None:
    """Bytes the process can still allocate: the machine's ``MemAvailable``, or less where a
    cgroup or an rlimit leaves less; None where none of them is known.

    Example:
        >>> free() is None or free() > 0
        True
    """
    available = _stat("/proc/meminfo", "MemAvailable:")           # (kB)
    known = [] if available is None else [available * 1024]
    known += [x.free for x in (cgroup_limit(), _address_space()) if x is not None]
    return min(known) if known else None


def capacity() -> int | None:
    """The most memory the process may hold: the machine's RAM, a cgroup's limit, or what the
    address-space rlimit leaves beside the mappings it has now, the least of them; None
    where none is known.

    Example:
        >>> capacity() is None or capacity() > 0
        True
    """
    try:
        known = [os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")]
    except (ValueError, OSError, AttributeError):
        known = []
    cgroup, rlimit = cgroup_limit(), _address_space()
    known += [cgroup.total] if cgroup is not None else []
    known += [rlimit.free] if rlimit is not None else []
    return min(known) if known else None

"""Files written safely (bench results, demo figures, inspect reports): whole or not at
all, and never through a symlink.

A file is first written to a fresh temporary file in the same directory (created
with ``O_EXCL``, so it cannot be a symlink planted there), then renamed over the target
with :func:`os.replace`. A reader sees the old file or the new one, never half of one; a
symlink at the target is replaced by the file, its target is left alone; an interrupted
write (Ctrl-C, a full disk) leaves the old file and no temporary behind.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import warnings
from pathlib import Path


def atomic_write(path: Path, data: str | bytes) -> Path:
    """Write ``data`` (text is UTF-8) to ``path`` atomically; returns ``path``.

    Args:
        path: the file to create or replace; its directory must exist.
        data: the whole content.

    Returns:
        ``path``.

    Raises:
        IsADirectoryError: ``path`` is a directory.
        OSError: the directory is not writable, the disk is full, ...

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> atomic_write(d / "a.txt", "hello").read_text()
        'hello'
    """
    return atomic_write_all({Path(path): data})[0]


def atomic_write_all(files: dict[Path, str | bytes]) -> list[Path]:
    """Write several files so that an error leaves every one of them as it was: each is
    staged in a temporary file first; when all are, each target's old file is kept aside
    as a hard link (it stays in place), and only then are they renamed over their targets;
    a rename that fails puts back the old files of those already renamed. A target that
    cannot be linked (a filesystem without hard links; another user's file under
    ``fs.protected_hardlinks``) is moved aside just before its own rename.

    Missing directories are made for the files, and removed again if the write fails.

    Raises:
        IsADirectoryError: a target is a directory (checked before anything is replaced).
        OSError: a file could not be staged, kept aside or renamed; the error's
            ``filename`` names its target.

    Example:
        >>> import tempfile
        >>> d = Path(tempfile.mkdtemp())
        >>> [p.name for p in atomic_write_all({d / "a.txt": "1", d / "b.txt": b"2"})]
        ['a.txt', 'b.txt']
    """
    staged, made = [], []                      # made: directories created here, outermost first
    linked, aside, placed = {}, {}, []         # aside: target -> its old file, beside it
    try:
        for path, data in files.items():
            path = Path(path)
            made += _make_dirs(path.parent)
            if path.is_dir() and not path.is_symlink():   # (a link is replaced, not followed)
                raise IsADirectoryError(21, "Is a directory", str(path))
            with _named(path):
                staged.append((_stage(path, data), path))
        for _, path in staged:
            linked[path] = _link_aside(path)
        for tmp, path in staged:
            with _named(path):
                old = linked[path]
                if old is _UNLINKABLE:
                    old = _beside(path, "old")
                    os.replace(path, old)
                if old is not None:
                    aside[path] = old
                os.replace(tmp, path)
            placed.append(path)
    except BaseException:          # (Ctrl-C included: the old files stay, the temporaries go)
        _put_back(linked, aside, placed)
        for tmp, _ in staged:
            _quietly(os.unlink, tmp)
        for d in reversed(made):
            _quietly(os.rmdir, d)                  # (not empty: something else wrote there)
        raise
    for old in aside.values():
        _quietly(os.unlink, old)
    return [path for _, path in staged]


#: :func:`_link_aside`'s answer for a file that cannot be linked: moved aside at its turn
_UNLINKABLE = object()


def _beside(path: Path, kind: str) -> Path:
    """A fresh hidden name beside ``path``: ``.name.<random>.kind``."""
    return path.with_name(f".{path.name}.{secrets.token_hex(6)}.{kind}")


def _link_aside(path: Path):
    """A hard link to ``path``'s file (a symlink as itself) under a fresh name beside it;
    None when there is none, :data:`_UNLINKABLE` when it cannot be linked."""
    if not os.path.lexists(path):
        return None
    old = _beside(path, "old")
    try:
        os.link(path, old, follow_symlinks=False)
    except OSError:
        return _UNLINKABLE
    return old


def _put_back(linked: dict, aside: dict, placed: list) -> None:
    """After a failed write: the new files out, each old file back under its name (a link
    not needed removed); where one cannot be, a warning says where it is kept."""
    for path in placed:
        if path not in aside:                      # (nothing was there before)
            _quietly(os.unlink, path)
    for path, old in aside.items():
        if path not in placed and linked[path] is old:   # still in place: the link goes
            _quietly(os.unlink, old)                     # (a rename onto it does nothing)
            continue
        try:
            os.replace(old, path)
        except OSError as e:
            warnings.warn(f"{path} could not be put back ({e.strerror or e}): its old content "
                          f"is kept in {old}", stacklevel=3)
    for path, old in linked.items():
        if isinstance(old, Path) and path not in aside:
            _quietly(os.unlink, old)


@contextlib.contextmanager
def _named(path: Path):
    """An ``OSError`` inside names ``path``, the target, not a temporary file beside it."""
    try:
        yield
    except OSError as e:
        e.filename, e.filename2 = str(path), None
        raise


def _quietly(fn, *args) -> None:
    with contextlib.suppress(OSError):
        fn(*args)


def missing_dirs(d: Path) -> list[Path]:
    """``d`` and its ancestors that do not exist, outermost first (``[]`` when ``d``
    exists); the parent of the first is the nearest existing ancestor.

    Example:
        >>> import tempfile
        >>> root = Path(tempfile.mkdtemp())
        >>> [p.relative_to(root).as_posix() for p in missing_dirs(root / "a" / "b")]
        ['a', 'a/b']
    """
    missing = []
    while not d.exists() and not d.is_symlink() and d != d.parent:
        missing.append(d)
        d = d.parent
    return missing[::-1]


def _make_dirs(d: Path) -> list[Path]:
    """Create ``d`` and its missing ancestors; returns those created, outermost first."""
    made = missing_dirs(d)
    for m in made:
        m.mkdir(exist_ok=True)
    return made


def _stage(path: Path, data: str | bytes) -> Path:
    # data, synced, in a fresh temporary file beside path; removed again on any error
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = _beside(path, "tmp")
    # O_EXCL: a fresh file, never an existing one or a symlink; mode 0o666 minus the umask
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return tmp


def probe_writable(directory: Path) -> None:
    """Create and remove a fresh file in ``directory``: raises ``OSError`` if it cannot.

    The probe is a new file (``O_EXCL``), so a symlink planted under a fixed name cannot
    make it truncate some other file.

    Example:
        >>> import tempfile
        >>> probe_writable(Path(tempfile.mkdtemp()))
    """
    tmp = Path(directory) / f".multihead-write-test.{secrets.token_hex(6)}"
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    os.unlink(tmp)

"""Writing report files safely: never through a symlink, never half-written.

Every file is written to a new temporary file in the target directory (created with
``O_CREAT | O_EXCL``, so an existing name, a planted symlink included, is never opened) and
then renamed over the target with :func:`os.replace`, which replaces a symlink itself
rather than the file it points to. A reader sees the old file or the complete new one.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def _file_mode() -> int:
    """The mode a plain ``open(path, "w")`` would give a new file (0o666 less the umask)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


def check_writable(out: Path) -> None:
    """Create the directory ``out`` and prove that files can be created in it.

    The probe is a fresh temporary file (never an existing name, never a symlink), removed
    at once. Call it before any long work, so that a bad ``--out`` fails in one line.

    Raises:
        ValueError: naming ``--out`` and the reason, when it cannot be created or written.

    Example:
        >>> import tempfile, pathlib
        >>> d = pathlib.Path(tempfile.mkdtemp()) / "report"
        >>> check_writable(d); sorted(d.iterdir())
        []
    """
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out, prefix=".multihead-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ValueError(f"--out {str(out)!r} is not writable ({e.strerror or e}): "
                         f"choose another directory") from None


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same directory.

    A symlink at ``path`` is replaced, not followed; on any error the temporary file is
    removed and ``path`` is left as it was.

    Example:
        >>> import tempfile, pathlib
        >>> p = pathlib.Path(tempfile.mkdtemp()) / "a.txt"
        >>> write_atomic(p, b"hello"); p.read_bytes()
        b'hello'
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            os.fchmod(f.fileno(), _file_mode())
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_all(out: Path, files: dict[str, bytes]) -> list[Path]:
    """Write every ``{name: content}`` into the directory ``out``; returns the paths written.

    Raises:
        ValueError: naming the file that could not be written, and why.
    """
    paths = []
    for name, data in files.items():
        p = out / name
        try:
            write_atomic(p, data)
        except OSError as e:
            raise ValueError(f"--out: cannot write {str(p)!r} ({e.strerror or e}): remove what "
                             f"is in the way or choose another directory") from None
        paths.append(p)
    return paths

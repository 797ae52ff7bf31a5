"""Writing report files safely (see :mod:`multihead._files`): the ``--out`` directory
checked before any work, every file whole or not at all, never through a symlink."""

from __future__ import annotations

from pathlib import Path

from .._files import atomic_write, probe_writable


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
        probe_writable(out)
    except OSError as e:
        raise ValueError(f"--out {str(out)!r} is not writable ({e.strerror or e}): "
                         f"choose another directory") from None


def write_all(out: Path, files: dict[str, bytes]) -> list[Path]:
    """Write every ``{name: content}`` into the directory ``out``; returns the paths written.

    Raises:
        ValueError: naming the file that could not be written, and why.
    """
    paths = []
    for name, data in files.items():
        p = out / name
        try:
            atomic_write(p, data)
        except OSError as e:
            raise ValueError(f"--out: cannot write {str(p)!r} ({e.strerror or e}): remove what "
                             f"is in the way or choose another directory") from None
        paths.append(p)
    return paths

"""Writing report files safely (see :mod:`multihead._files`): every file whole or not at
all, never through a symlink; a file that cannot be written is one clear error."""

from __future__ import annotations

from pathlib import Path

from .._files import atomic_write_all


def write_all(out: Path, files: dict[str, bytes]) -> list[Path]:
    """Write every ``{name: content}`` into the directory ``out``, all or none (an error
    leaves every earlier file as it was); returns the paths written.

    Raises:
        ValueError: naming the file that could not be written, and why.

    Example:
        >>> import tempfile
        >>> out = Path(tempfile.mkdtemp())
        >>> [p.name for p in write_all(out, {"a.json": b"{}", "b.html": b"<p>"})]
        ['a.json', 'b.html']
    """
    try:
        return atomic_write_all({out / name: data for name, data in files.items()})
    except OSError as e:
        raise ValueError(f"--out: cannot write {e.filename!r} ({e.strerror or e}): remove what "
                         f"is in the way or choose another directory") from None

"""Writing report files safely (see :mod:`multihead._files`): every file whole or not at
all, never through a symlink; a file that cannot be written is one clear error."""

from __future__ import annotations

from pathlib import Path

from .._files import atomic_write


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

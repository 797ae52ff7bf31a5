"""What every subcommand shares: the output console and the ``--out`` directory check."""

from __future__ import annotations

import sys
from pathlib import Path


def console(width: int = 120, markup: bool = True):
    """A rich console on stdout: the terminal's width, or ``width`` columns when piped."""
    from rich.console import Console
    return Console(width=None if sys.stdout.isatty() else width, markup=markup)


def prepare_out(out: Path | None) -> None:
    """Create ``--out`` and prove it is writable, before any long work (one clear error)."""
    if out is None:
        return
    try:
        out.mkdir(parents=True, exist_ok=True)
        probe = out / ".multihead-write-test"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"--out {str(out)!r} is not writable ({e.strerror or e}): "
                         f"choose another directory") from None

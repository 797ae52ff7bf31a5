"""What every subcommand shares: the output console, bounded integer options and the
``--out`` directory check."""

from __future__ import annotations

import argparse
import errno
import os
import re
import sys
import textwrap
from pathlib import Path

from .._args import plain
from .._files import missing_dirs, probe_writable


def console(width: int = 120, markup: bool = True, *, stderr: bool = False):
    """A rich console on stdout: the terminal's width, or ``width`` columns when piped
    (``stderr``: rich's own console on stderr, for progress, warnings and file names).

    When its reader leaves (``| head -1``) it raises ``BrokenPipeError``, which the command
    line turns into a quiet exit, as for ``print`` (rich would exit with status 1).
    """
    from rich.console import Console
    con = (Console(stderr=True) if stderr else
           Console(width=None if sys.stdout.isatty() else width, markup=markup))
    con.on_broken_pipe = _broken_pipe
    return con


def table(title: str, columns, left=(), **kw):
    """A rich table titled ``title`` with ``columns``: those in ``left`` justified left (text),
    the rest right (numbers). The layout is rich's own unless it would cut or split a
    number ('2.3e-…' loses its size): then a column of numbers (right-justified, no spaces
    in its cells) keeps its widest one whole, its header wrapped to that width, and the
    text wraps instead; where even that does not fit, every cell folds onto more lines
    (nothing is cut with '…').

    Example:
        >>> t = table("sizes", ["name", "bytes"], left=["name"])
        >>> t.add_row("KV per token", "1,048,576")
        >>> console(width=30).print(t)
        sizes
        ┏━━━━━━━━━━━━━━┳━━━━━━━━━━━┓
        ┃ name         ┃     bytes ┃
        ┡━━━━━━━━━━━━━━╇━━━━━━━━━━━┩
        │ KV per token │ 1,048,576 │
        └──────────────┴───────────┘
        >>> console(width=22).print(t)
        sizes
        ┏━━━━━━━━┳━━━━━━━━━━━┓
        ┃ name   ┃     bytes ┃
        ┡━━━━━━━━╇━━━━━━━━━━━┩
        │ KV per │ 1,048,576 │
        │ token  │           │
        └────────┴───────────┘
        >>> console(width=18).print(t)
        sizes
        ┏━━━━━━━┳━━━━━━━━┓
        ┃ name  ┃  bytes ┃
        ┡━━━━━━━╇━━━━━━━━┩
        │ KV    │ 1,048, │
        │ per   │    576 │
        │ token │        │
        └───────┴────────┘
    """
    from rich.cells import cell_len
    from rich.table import Table

    class _Table(Table):
        def add_row(self, *cells, **kw):
            for i, cell in enumerate(cells):
                if i in self.numbers and isinstance(cell, str):
                    if len(cell.split()) > 1:             # (a note beside it: text)
                        del self.numbers[i]
                    else:
                        self.numbers[i] = max(self.numbers[i], cell_len(cell))
            super().add_row(*cells, **kw)

        def __rich_console__(self, console, options):
            for i, col in enumerate(self.columns):         # rich's own layout first
                col.min_width, col.no_wrap, col.header = None, False, self.headers[i]
            try:       # (as rich lays it out: borders taken off; widths include padding)
                inner = options.update_width(options.max_width - self._extra_width)
                natural = self._calculate_column_widths(console, inner)
                cut = any(natural[i] - self._get_padding_width(i) < w
                          for i, w in self.numbers.items())
            except AttributeError:        # (rich's internals moved: judge by the width)
                cut = self.__rich_measure__(console, options).maximum > options.max_width
            # where a number would be cut: each number column its widest number (6 at least
            # where a header word is that long, if that fits), each text column 4, plus 3
            # for padding and border; else rich folds every cell
            word = lambda i: max(map(cell_len, self.headers[i].split()), default=0)  # noqa: E731
            for floor in (6, 0) if cut else ():
                width = {i: max(w, min(floor, word(i))) for i, w in self.numbers.items()}
                if 1 + sum(3 + width.get(i, 4) for i in range(len(self.columns))) \
                        <= options.max_width:
                    for i, w in width.items():
                        col = self.columns[i]
                        col.min_width, col.no_wrap = w, True
                        col.header = textwrap.fill(" ".join(self.headers[i].split()), w)
                    break
            yield from super().__rich_console__(console, options)

    t = _Table(title=title, title_justify="left", **kw)
    t.headers = list(columns)                          # (as given: the layout rewraps them)
    t.numbers = {i: 0 for i, col in enumerate(columns) if col not in left}   # widest cell
    for col in columns:
        t.add_column(col, justify="left" if col in left else "right", overflow="fold")
    return t


def _broken_pipe():
    raise BrokenPipeError(32, "Broken pipe: stdout's reader left")


def wrote(con, *paths) -> None:
    """Say on ``con`` (a rich console) which files were written, as plain text: a path is
    never read as markup or highlighted, and a long one is not broken across lines.

    Example:
        >>> wrote(console(), Path("out/[b]report[/b].html"))
        wrote out/[b]report[/b].html
    """
    con.print(f"wrote {' and '.join(plain(str(p)) for p in paths)}", style="dim", markup=False,
              highlight=False, soft_wrap=True)


def summary(doc: str) -> str:
    """A subcommand's ``--help`` description: its module docstring's first line, without
    reST's double backticks.

    Example:
        >>> summary("``multihead params``: parameters.\\n\\nMore.")
        'multihead params: parameters.'
    """
    return (doc or "").split("\n", 1)[0].replace("``", "")     # (None under python -OO)


def path(text: str) -> Path:
    """An argparse ``type`` for a path option: an empty one (an unset shell variable in
    ``--out "$DIR"``) is an error, not the current directory.

    Example:
        >>> path("out")
        PosixPath('out')
        >>> path("")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: the path is empty (an unset shell variable?): give a path
    """
    if not text:
        raise argparse.ArgumentTypeError("the path is empty (an unset shell variable?): give a path")
    return Path(text)


def int_in(lo: int | None, hi: int | None):
    """An argparse ``type``: a whole number from ``lo`` to ``hi``, else a one-line error.

    argparse puts the option's name in front of the message, so the user reads e.g.
    ``argument --d-model: '1e18' is not a whole number: give an integer from 1 to 1048576``.

    Args:
        lo: the smallest value accepted (None with ``hi`` None: any integer; a command
            that knows the range only later checks it then, as ``inspect --layer`` does).
        hi: the largest value accepted.

    Returns:
        A function from the option's text (ASCII digits, an optional sign) to its int value.

    Example:
        >>> int_in(1, 8)("3")
        3
        >>> int_in(1, 8)("9")
        Traceback (most recent call last):
        ...
        argparse.ArgumentTypeError: 9 is out of range: give an integer from 1 to 8
    """
    accepted = "give an integer" + ("" if lo is None else f" from {lo} to {hi}")

    def parse(text: str) -> int:
        shown = text if len(text) <= 40 else text[:37] + "..."
        if not re.fullmatch(r"\s*[+-]?[0-9]+\s*", text):   # (int() also takes 5_12 and ٨)
            raise argparse.ArgumentTypeError(f"{shown!r} is not a whole number: {accepted}")
        try:
            value = int(text)
        except ValueError:                                  # digits beyond int()'s limit
            raise argparse.ArgumentTypeError(f"{shown} is out of range: {accepted}") from None
        if lo is not None and not lo <= value <= hi:
            raise argparse.ArgumentTypeError(f"{shown.strip()} is out of range: {accepted}")
        return value

    parse.__name__ = "int"
    return parse


def _broken_link(link: Path) -> str:
    """What is wrong with a symlink that leads to no directory: a loop, or nothing there
    (a relative target is shown from the link's directory)."""
    try:
        os.stat(link)
    except OSError as e:
        if e.errno == errno.ELOOP:
            return f"is a symlink loop (through {str(link.readlink())!r})"
    return f"is a symlink to {str(link.parent / link.readlink())!r}, which does not exist"


def prepare_out(out: Path | None, names: tuple[str, ...] = ()) -> None:
    """Prove ``--out`` can be written, before any long work (one clear error), without
    creating it: a command that fails later leaves no empty directory behind.

    An existing directory is probed with a fresh file; a missing one is probed in its
    nearest existing ancestor, where it will be created when the files are written.

    Args:
        out: the directory, or ``None`` (nothing to check).
        names: the files the command will write there; none may be a directory.

    Raises:
        ValueError: ``out`` (or an ancestor) is a file, cannot be created or written, or
            one of ``names`` is a directory in it.

    Example:
        >>> import tempfile
        >>> new = Path(tempfile.mkdtemp()) / "a" / "b"
        >>> prepare_out(new); new.exists()
        False
    """
    if out is None:
        return
    try:
        missing = missing_dirs(out)
        there = missing[0].parent if missing else out     # (the ancestor it will be made in)
        if not there.is_dir():
            what = "it" if there == out else repr(str(there))
            kind = ("is a file, not a directory" if there.is_file() else
                    _broken_link(there) if there.is_symlink() else "is not a directory")
            raise ValueError(f"--out {str(out)!r} is not writable: {what} {kind}: choose a "
                             f"directory")
        probe_writable(there)
        taken = [n for n in names if (out / n).is_dir() and not (out / n).is_symlink()]
    except OSError as e:
        raise ValueError(f"--out {str(out)!r} is not writable ({e.strerror or e}): "
                         f"choose another directory") from None
    if taken:
        raise ValueError(f"--out {str(out)!r}: {taken[0]} there is a directory, so it cannot be "
                         f"written: remove it or choose another directory")

"""``multihead``: the command-line entry point; each subcommand lives in its own module.

A subcommand module has ``add_parser(subparsers)`` and ``run(args) -> int``. User mistakes
raise :class:`CLIError` (or a ``ValueError`` subclass from the library) and are printed as
one line on stderr with exit status 2, never as a traceback (``MULTIHEAD_DEBUG=1`` re-raises).
Two things are handled here for every command: command-line text that is not UTF-8 is
refused before any command sees it, and output the terminal's encoding cannot show is
escaped (``\\u2248``) instead of failing.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import shlex
import sys

from . import bench_cmd, demo_cmd, inspect_cmd, params_cmd
from ._common import plain

SUBCOMMANDS = {"inspect": inspect_cmd, "params": params_cmd, "demo": demo_cmd,
               "bench": bench_cmd}


class CLIError(Exception):
    """A user error the command reports in one line."""


class UsageError(CLIError):
    """A command line argparse (or the UTF-8 check) refuses; its text is the whole line."""


class _Parser(argparse.ArgumentParser):
    """argparse whose mistakes are one line (raised, so :func:`main` returns 2)."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")

    def _print_message(self, message: str, file=None):
        """argparse's, but a failed write (``--help > /dev/full``) raises, as every other
        command's output does (argparse drops the error, and the status stays 0)."""
        if message:
            (file or sys.stderr).write(message)

    def parse_args(self, args=None, namespace=None):
        """argparse's, but an option no parser knows is reported by the subcommand's parser
        (``multihead params: error: ...``), whose help lists the options it takes."""
        args, extra = self.parse_known_args(args, namespace)
        if extra:
            subcommands = getattr(self, "subcommands", None)
            owner = subcommands.choices.get(getattr(args, "command", None)) if subcommands \
                else None
            texts = owner is not None and any(not a.option_strings for a in owner._actions)
            untold = texts and getattr(args, "text", None) is None      # (no text given yet)
            dashed = [x for x in extra if x.startswith("-") and (         # (not --an-option)
                not x.startswith("--") or not x[2:].replace("-", "").isalnum())] if untold else []
            hint = (f" (a text that starts with '-' goes after --: {owner.prog} -- "
                    f"{shlex.quote(dashed[0])})" if dashed else "")
            (owner or self).error(f"unrecognized arguments: {' '.join(extra)}{hint}")
        return args


def build_parser() -> argparse.ArgumentParser:
    from .. import __version__
    p = _Parser(prog="multihead", description="Multi-head attention: see what the heads of a "
                "real model do, and check the seeds' claims.")
    p.add_argument("--version", action="version", version=f"multihead {__version__}")
    sub = p.subcommands = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in SUBCOMMANDS.values():
        mod.add_parser(sub)
    return p


def check_utf8(argv: list[str]) -> None:
    """Refuse command-line text that was not UTF-8 (Python decodes it to lone surrogates).

    Raises:
        UsageError: naming the option (or the argument's position) and showing its bytes.

    Example:
        >>> check_utf8(["params", "--preset", "gpt2-small"])
    """
    for i, arg in enumerate(argv):
        try:
            arg.encode("utf-8")
            continue
        except UnicodeEncodeError:
            pass
        try:
            shown = repr(arg.encode("utf-8", "surrogateescape"))
        except UnicodeEncodeError:
            shown = ascii(arg)
        if arg.startswith("-") and "=" in arg:
            where = f"argument {arg.split('=', 1)[0]}"
        elif i > 0 and argv[i - 1].startswith("-") and not arg.startswith("-"):
            where = f"argument {argv[i - 1]}"
        else:
            where = f"command-line argument {i + 1}"
        raise UsageError(f"{_prog(argv)}: error: {where}: {shown} is not valid UTF-8 text: pass it as "
                         f"UTF-8 (set the terminal to UTF-8, or rename the file)")


@contextlib.contextmanager
def _lenient_output():
    """Escape what stdout/stderr's encoding cannot show (``PYTHONIOENCODING=ascii``, a
    Latin-1 terminal) instead of raising ``UnicodeEncodeError``; restored afterwards."""
    changed = []
    for stream in (sys.stdout, sys.stderr):
        errors = getattr(stream, "errors", None)
        if hasattr(stream, "reconfigure") and errors in ("strict", "surrogateescape"):
            try:
                stream.reconfigure(errors="backslashreplace")
                changed.append((stream, errors))
            except (ValueError, OSError):       # (a closed or detached stream: leave it)
                pass
    try:
        yield
    finally:
        for stream, errors in changed:
            with contextlib.suppress(ValueError, OSError):
                stream.reconfigure(errors=errors)


def main(argv: list[str] | None = None) -> int:
    """Run ``multihead COMMAND ...``; returns the exit status (0, 2 for a user error or
    output that could not be written, 130 when interrupted, 141 when stdout's reader left,
    as after SIGPIPE)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    with _lenient_output():
        try:
            check_utf8(argv)
            args = build_parser().parse_args(argv)
        except UsageError as e:
            print(str(e), file=sys.stderr)
            return 2
        except SystemExit as e:     # --help or --version, printed
            return _flushed(_prog(argv), e.code)
        except OSError as e:        # ... but not written
            return _unwritten(_prog(argv), e)
        if sys.stdout is None:      # (``>&-``: print() would drop every line, silently)
            print(f"multihead {args.command}: error: stdout is closed; redirect it (> FILE, "
                  f"or > /dev/null to drop the output)", file=sys.stderr)
            return 2
        status = _run(args)
        if _stdout_gone():          # (a reader that left during the last lines: seen here)
            return _reader_gone() if status == 0 else status
        return _flushed(f"multihead {args.command}", status)


def _prog(argv: list[str]) -> str:
    """The name argparse gives the parser of ``argv``'s command: ``multihead params``."""
    return f"multihead {argv[0]}" if argv and argv[0] in SUBCOMMANDS else "multihead"


def _flushed(prog: str, status: int) -> int:
    """``status`` once what is buffered for stdout is written; output that cannot be (a full
    disk, ``> /dev/full``) is an error with status 2, not a silent 0 (its bytes are dropped,
    so that Python's own flush at exit does not fail again)."""
    try:
        if sys.stdout is not None:      # (closed: argparse wrote --help to stderr)
            sys.stdout.flush()
    except OSError as e:
        return _unwritten(prog, e)
    return status


def _unwritten(prog: str, e: OSError) -> int:
    """Output that could not be written: to a reader that left (``| head -c 5``), quietly
    as :func:`_reader_gone`; else status 2 and one line. Its bytes are dropped."""
    if isinstance(e, BrokenPipeError):
        return _reader_gone()
    print(f"{prog}: error: the output could not be written ({e})", file=sys.stderr)
    _reader_gone()
    return 2


class _Output:
    """``sys.stdout`` while a command runs, keeping the error a write or flush of it raised,
    so that an ``OSError`` the command lets out is known to be its output's (a full disk),
    not a file's it read or wrote; anything else is the stream's own."""

    def __init__(self, stream):
        self.stream, self.error = stream, None

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as e:
            self.error = e
            raise

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def _run(args) -> int:
    real = sys.stdout
    out = sys.stdout = _Output(real)
    try:
        return _command(args, out)
    finally:
        sys.stdout = real


def _command(args, out: _Output) -> int:
    try:
        return SUBCOMMANDS[args.command].run(args)
    except BrokenPipeError as e:    # the reader left (``multihead params --table | head -1``)?
        if _stdout_gone():
            return _reader_gone()
        return _failed(args, e)     # (another pipe: a worker process, say)
    except KeyboardInterrupt:
        print(f"multihead {args.command}: interrupted", file=sys.stderr)
        return 130
    except OSError as e:
        if e is out.error:                  # the output's, not a file's
            return _unwritten(f"multihead {args.command}", e)
        return _failed(args, e)
    except (CLIError, ValueError, TypeError) as e:
        return _failed(args, e)
    except (MemoryError, RuntimeError) as e:   # past what the up-front check saw (a ulimit,
        #                                        a container's cap): Python's or torch's
        said = " ".join(str(e).split())
        if not isinstance(e, MemoryError) and not ("can't allocate memory" in said
                                                   or "out of memory" in said):
            raise
        return _failed(args, CLIError(f"out of memory{': ' + said[:200] if said else ''}; give "
                                      f"a shorter text, or run where more memory is free"))


def _failed(args, e: Exception) -> int:
    """One line on stderr, status 2 (``MULTIHEAD_DEBUG=1``: the traceback instead)."""
    if os.environ.get("MULTIHEAD_DEBUG"):
        raise e
    msg = plain(" ".join(str(e).split()) or type(e).__name__)     # (a text's control chars)
    print(f"multihead {args.command}: error: {msg}", file=sys.stderr)
    return 2


def _stdout_gone() -> bool:
    """Whether stdout is a pipe whose reader has left (its write end polls as an error; a
    broken pipe elsewhere, to a worker process, leaves stdout as it was). False where it
    cannot be told (no ``poll``, or a stdout without a file descriptor)."""
    try:
        poll = select.poll()
        poll.register(sys.stdout.fileno(), select.POLLOUT)
        return any(ev & select.POLLERR for _, ev in poll.poll(0))
    except (AttributeError, OSError, ValueError):
        return False


def _reader_gone() -> int:
    """Stop quietly, as a Unix tool killed by SIGPIPE does (status 128 + 13): stdout's file
    descriptor goes to /dev/null, so what is still buffered for it does not fail again
    when Python exits (nor a failed write's, in :func:`_flushed`)."""
    with contextlib.suppress(OSError, ValueError):
        fd = sys.stdout.fileno()
        null = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(null, fd)
        finally:
            os.close(null)
    return 141


if __name__ == "__main__":
    sys.exit(main())

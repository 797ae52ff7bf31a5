"""``multihead``: the command-line entry point; each subcommand lives in its own module.

A subcommand module has ``add_parser(subparsers)`` and ``run(args) -> int``. User mistakes
raise :class:`CLIError` (or a ``ValueError`` subclass from the library) and are printed as
one line on stderr with exit status 2, never as a traceback (``MULTIHEAD_DEBUG=1`` re-raises).
"""

from __future__ import annotations

import argparse
import os
import sys

from . import bench_cmd, demo_cmd, inspect_cmd, params_cmd

SUBCOMMANDS = {"inspect": inspect_cmd, "params": params_cmd, "demo": demo_cmd,
               "bench": bench_cmd}


class CLIError(Exception):
    """A user error the command reports in one line."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="multihead", description="Multi-head attention: see what "
                                "the heads of a real model do, and check the seeds' claims.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for mod in SUBCOMMANDS.values():
        mod.add_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return SUBCOMMANDS[args.command].run(args)
    except KeyboardInterrupt:
        print(f"multihead {args.command}: interrupted", file=sys.stderr)
        return 130
    except (CLIError, ValueError, TypeError, OSError) as e:
        if os.environ.get("MULTIHEAD_DEBUG"):
            raise
        msg = " ".join(str(e).split()) or type(e).__name__
        print(f"multihead {args.command}: error: {msg}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

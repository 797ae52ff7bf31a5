"""Benchmarks and measurement scripts (run as ``python -m benchmarks.NAME``)."""

from __future__ import annotations

import argparse
import json


def no_options(doc: str, argv: list[str] | None = None) -> None:
    """The command line of a script that takes no options (``argv``, default
    ``sys.argv[1:]``): ``--help`` prints ``doc`` and exits; anything else is refused (exit
    2) instead of starting a long run.

    Example:
        >>> no_options("Times the core call.", [])               # no options: go on
        >>> no_options("Times the core call.", ["--fast"])
        Traceback (most recent call last):
        ...
        SystemExit: 2
    """
    argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter
                            ).parse_args(argv)


def save_json(path: str | None, data) -> None:
    """Write ``data`` as indented JSON to ``path`` (nothing when ``path`` is None).

    Example:
        >>> save_json(None, {"a": 1})
    """
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)

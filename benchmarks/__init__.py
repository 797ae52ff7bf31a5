"""Benchmarks and measurement scripts (run as ``python -m benchmarks.NAME``)."""

from __future__ import annotations

import json


def save_json(path: str | None, data) -> None:
    """Write ``data`` as indented JSON to ``path`` (nothing when ``path`` is None).

    Example:
        >>> save_json(None, {"a": 1})
    """
    if path:
        with open(path, "w") as f:
            json.dump(data, f, indent=1)

"""What the inspection tests share: the browser the README's test command installs."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest


def chromium() -> str:
    """The path of the Chromium the README's test command installs; a missing one fails
    the test (the HTML report would otherwise go unchecked without a word)."""
    path = shutil.which("chromium") or "/usr/bin/chromium"
    if not Path(path).exists():
        pytest.fail("chromium is not installed (apt-get install chromium): the README's test "
                    "command installs it", pytrace=False)
    return path

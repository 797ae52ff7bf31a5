"""The README's set-up commands are the ones CI runs, and its example code runs."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _setup_commands():
    text = (ROOT / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    return [line for line in block.splitlines() if line.strip()]


def test_readme_starts_with_two_setup_commands():
    cmds = _setup_commands()
    assert len(cmds) == 2
    assert all("pip install torch==2.13.0" in c for c in cmds)


def test_readme_first_command_is_the_main_job():
    assert _setup_commands()[0].endswith("multihead inspect")


def test_ci_runs_the_readme_test_command_verbatim():
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert _setup_commands()[1] in ci


def test_readme_python_examples_run():
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert len(blocks) >= 3
    namespace = {}
    for code in blocks:          # later blocks use names (torch, mh, x) from earlier ones
        exec(compile(code, "README.md", "exec"), namespace)

"""Hostile command lines get one clear line and exit status 2, never a traceback: absurd,
negative, non-integer or huge numbers for every numeric option of ``params`` and ``demo``;
command-line text that is not UTF-8, for every command; and a stdout whose encoding cannot
show the tables' characters (``PYTHONIOENCODING=ascii``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from unittest import mock

import pytest

from multihead.cli.main import main

HUGE = "9" * 5000                       # more digits than int() accepts

PARAMS = ["params", "--d-model", "512", "--heads", "8"]
# (command line, option named, value shown, accepted range)
BAD_NUMBERS = [
    (["params", "--d-model", "1e18", "--heads", "8"], "--d-model", "'1e18'", "1 to 1048576"),
    (["params", "--d-model", "1000000000000000000", "--heads", "8"], "--d-model",
     "1000000000000000000", "1 to 1048576"),
    (["params", "--d-model", "-512", "--heads", "8"], "--d-model", "-512", "1 to 1048576"),
    (["params", "--d-model", "512.0", "--heads", "8"], "--d-model", "'512.0'", "1 to 1048576"),
    (["params", "--d-model", HUGE, "--heads", "8"], "--d-model", "9999", "1 to 1048576"),
    (["params", "--d-model", "512", "--heads", "0"], "--heads", "0", "1 to 65536"),
    (["params", "--d-model", "512", "--heads", "nan"], "--heads", "'nan'", "1 to 65536"),
    ([*PARAMS, "--kv-heads", "-1"], "--kv-heads", "-1", "1 to 65536"),
    ([*PARAMS, "--kv-heads", "99999999999"], "--kv-heads", "99999999999", "1 to 65536"),
    ([*PARAMS, "--head-dim", "2.5"], "--head-dim", "'2.5'", "1 to 65536"),
    ([*PARAMS, "--head-dim", "1e9"], "--head-dim", "'1e9'", "1 to 65536"),
    ([*PARAMS, "--layers", "inf"], "--layers", "'inf'", "1 to 100000"),
    ([*PARAMS, "--layers", "10000000000"], "--layers", "10000000000", "1 to 100000"),
    ([*PARAMS, "--seq", "100000000000000000000"], "--seq", "100000000000000000000",
     "1 to 1073741824"),
    ([*PARAMS, "--seq", "-1"], "--seq", "-1", "1 to 1073741824"),
    ([*PARAMS, "--batch", "99999999999999999999999"], "--batch", "99999999999999999999999",
     "1 to 1048576"),
    ([*PARAMS, "--batch", "one"], "--batch", "'one'", "1 to 1048576"),
    (["demo", "scaling", "--draws", "1e9"], "--draws", "'1e9'", "2 to 5000"),
    (["demo", "scaling", "--draws", "100000000000"], "--draws", "100000000000", "2 to 5000"),
    (["demo", "scaling", "--seed", "-1"], "--seed", "-1", "0 to 4294967295"),
    (["demo", "scaling", "--seed", "99999999999999999999999"], "--seed",
     "99999999999999999999999", "0 to 4294967295"),
    (["demo", "heads", "--steps", "999999999999"], "--steps", "999999999999", "1 to 100000"),
    (["demo", "heads", "--steps", "-5"], "--steps", "-5", "1 to 100000"),
    ([*PARAMS, "--layers", "1_0"], "--layers", "'1_0'", "1 to 100000"),        # int() takes it
    ([*PARAMS, "--layers", "\u0668"], "--layers", "'\u0668'", "1 to 100000"),  # an Arabic-Indic 8
]


def _one_line(err: str) -> bool:
    return err.count("\n") == 1 and "Traceback" not in err


@pytest.mark.parametrize("argv,option,shown,accepted", BAD_NUMBERS,
                         ids=[" ".join(a)[:60] for a, *_ in BAD_NUMBERS])
def test_absurd_numbers_are_one_line_errors_naming_the_option(argv, option, shown, accepted,
                                                              capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert _one_line(err), err
    assert f"argument {option}: {shown}" in err
    assert f"give an integer from {accepted}" in err
    assert len(err) < 300                                 # a huge value is shown cut short


def _cli(*args, env=None, timeout=120):
    """Run the real entry point (the same code as the ``multihead`` script) in a fresh
    interpreter; ``args`` may be bytes, as a shell passes them."""
    env = {**os.environ, **(env or {})}
    env.pop("MULTIHEAD_DEBUG", None)
    return subprocess.run([sys.executable, "-m", "multihead.cli.main", *args],
                          capture_output=True, env=env, timeout=timeout)


def test_the_entry_point_exits_2_with_one_line_for_an_absurd_number():
    r = _cli("params", "--d-model", "1e18", "--heads", "8")
    err = r.stderr.decode()
    assert r.returncode == 2 and _one_line(err), err
    assert "argument --d-model: '1e18' is not a whole number: give an integer from 1 to" in err


def test_the_largest_accepted_values_run_without_overflow(capsys):
    assert main(["params", "--d-model", "1048576", "--heads", "65536", "--kv-heads", "65536",
                 "--head-dim", "65536", "--layers", "100000", "--seq", "1073741824",
                 "--batch", "1048576", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["params_match_module"] and d["config"]["head_dim"] == 65536


# -- command-line text that is not UTF-8 ----------------------------------------------------

BAD = "caf\udce9"           # what Python makes of the bytes b"caf\xe9" (Latin-1) in argv
NOT_UTF8 = [
    (["params", "--preset", BAD], "multihead params: error: argument --preset: b'caf\\xe9'"),
    (["params", f"--dtype={BAD}", "--preset", "gpt2-small"],
     "multihead params: error: argument --dtype: b'--dtype=caf\\xe9'"),
    (["bench", "--out", f"/tmp/{BAD}"], "multihead bench: error: argument --out: b'/tmp/caf\\xe9'"),
    (["demo", "heads", "--quick", "--out", BAD], "multihead demo: error: argument --out"),
    (["inspect", f"{BAD} au lait"], "multihead inspect: error: command-line argument 2: "
                                    "b'caf\\xe9 au lait'"),
    ([BAD], "multihead: error: command-line argument 1: b'caf\\xe9'"),
]


@pytest.mark.parametrize("argv,message", NOT_UTF8, ids=[a[0][:8] for a, _ in NOT_UTF8])
def test_non_utf8_arguments_are_one_line_errors_for_every_command(argv, message, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert _one_line(err), err
    assert message in err and "is not valid UTF-8 text" in err


@pytest.mark.parametrize("args", [
    [b"inspect", b"caf\xe9 au lait"],
    [b"params", b"--preset", b"gpt2-\xff"],
], ids=["inspect", "params"])
def test_non_utf8_bytes_from_the_shell(args):
    r = _cli(*args, env={"PYTHONIOENCODING": "utf-8"})
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2 and _one_line(err), err
    assert "is not valid UTF-8 text" in err and r.stdout == b""


@pytest.mark.parametrize("args,shown", [
    (["params", "--preset", "gpt2-small"], b"4d\\xb2"),          # 4d² in the table
    (["demo", "scaling", "--draws", "10"], b"\\u2248"),            # ≈ in the table
], ids=["params", "demo"])
def test_an_ascii_stdout_gets_escapes_not_a_crash(args, shown):
    r = _cli(*args, env={"PYTHONIOENCODING": "ascii"})
    assert r.returncode == 0 and r.stderr == b"", r.stderr.decode()
    assert shown in r.stdout


@pytest.mark.parametrize("argv", [["params", "--table"],                     # rich tables
                                  ["params", "--preset", "gpt2-small", "--json"]])   # print
def test_a_reader_that_left_ends_the_command_quietly_as_sigpipe_does(argv, stdout_reader_gone,
                                                                     capsys):
    with stdout_reader_gone():
        assert main(argv) == 141
    assert capsys.readouterr().err == ""


def test_a_broken_pipe_that_is_not_stdout_is_an_error(monkeypatch, capsys):
    """A worker process's pipe (say) breaking is a failure to report, not a reader leaving."""
    from multihead.cli import params_cmd
    monkeypatch.setattr(params_cmd, "run", mock.Mock(side_effect=BrokenPipeError(32, "Broken pipe")))
    assert main(["params", "--table"]) == 2
    assert "multihead params: error: [Errno 32] Broken pipe" in capsys.readouterr().err


@pytest.mark.parametrize("errno_", [5, 28], ids=["EIO", "ENOSPC"])
def test_an_error_reading_or_writing_a_file_is_not_called_the_output(errno_, monkeypatch,
                                                                     capsys):
    """Only what writing stdout raised is "the output could not be written": an I/O error
    reading a model file (no file name on a read's error) was called that, by its errno."""
    from multihead.cli import params_cmd
    e = OSError(errno_, os.strerror(errno_))
    monkeypatch.setattr(params_cmd, "run", mock.Mock(side_effect=e))
    assert main(["params", "--table"]) == 2
    assert capsys.readouterr().err == f"multihead params: error: {e}\n"


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="needs /dev/full (Linux)")
@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["params", "--help"],
                                  ["params", "--preset", "gpt2-small", "--json"],
                                  ["params", "--table"]])
def test_output_that_cannot_be_written_is_an_error(argv):
    """A full disk (/dev/full) fails every write: argparse's --help and --version dropped the
    error and exited 0, as if the text had been written; a command's own output said
    "[Errno 28] ..." without naming what could not be written."""
    env = {**os.environ, "PYTHONIOENCODING": "utf-8"}
    env.pop("MULTIHEAD_DEBUG", None)
    with open("/dev/full", "w") as full:
        r = subprocess.run([sys.executable, "-m", "multihead", *argv], stdout=full,
                           stderr=subprocess.PIPE, env=env, text=True, timeout=120)
    assert r.returncode == 2 and _one_line(r.stderr), r.stderr
    prog = "multihead params" if argv[0] == "params" else "multihead"
    assert r.stderr.startswith(f"{prog}: error: the output could not be written ("), r.stderr
    assert "No space left on device" in r.stderr


@pytest.mark.parametrize("argv", [["params", "--preset", "gpt2-small"], ["params", "--table"]])
def test_a_closed_stdout_is_an_error_not_silence(argv):
    """With stdout closed (``>&-``) Python's print() drops every line: the command said
    nothing and then failed inside its final flush, with a traceback."""
    env = {k: v for k, v in os.environ.items() if k != "MULTIHEAD_DEBUG"}
    r = subprocess.run([sys.executable, "-m", "multihead", *argv], stdout=subprocess.DEVNULL,
                       stderr=subprocess.PIPE, env=env, text=True, timeout=120,
                       preexec_fn=lambda: os.close(1))
    assert r.returncode == 2 and _one_line(r.stderr), r.stderr
    assert r.stderr.startswith("multihead params: error: stdout is closed;"), r.stderr


@pytest.mark.parametrize("argv", [["--version"], ["params", "--help"]])
def test_help_to_a_reader_that_left_ends_quietly_as_sigpipe_does(argv):
    """argparse's own output to a pipe whose reader is gone: status 141 and nothing on
    stderr, as every command's output (not "could not be written", status 2)."""
    read, write = os.pipe()
    os.close(read)
    try:
        env = {k: v for k, v in os.environ.items() if k != "MULTIHEAD_DEBUG"}
        r = subprocess.run([sys.executable, "-m", "multihead", *argv], stdout=write,
                           stderr=subprocess.PIPE, env=env, text=True, timeout=120)
    finally:
        os.close(write)
    assert (r.returncode, r.stderr) == (141, "")


def test_version_and_python_dash_m(capsys):
    from multihead import __version__
    assert main(["--version"]) == 0 and capsys.readouterr().out == f"multihead {__version__}\n"
    run = subprocess.run([sys.executable, "-m", "multihead", "params", "--preset", "gpt2-small",
                          "--json"], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and json.loads(run.stdout)["params_match_module"]


@pytest.mark.parametrize("command", ["params", "inspect", "bench"])
def test_an_unknown_option_is_reported_by_its_subcommand(command, capsys):
    """Its help, not the top level's, lists the options the subcommand takes."""
    assert main([command, "--bogus"]) == 2
    assert capsys.readouterr().err == (f"multihead {command}: error: unrecognized arguments: "
                                       f"--bogus (see multihead {command} --help)\n")


@pytest.mark.parametrize("argv,option", [
    (["demo", "heads", "--quick", "--out", ""], "--out"),
    (["bench", "--out", ""], "--out"),
    (["inspect", "--out", ""], "--out"),
    (["inspect", "--model", ""], "--model"),
    (["inspect", "--file", ""], "--file")])
def test_an_empty_path_is_an_error_not_the_current_directory(argv, option, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"argument {option}: the path is empty (an unset shell variable?)" in err
    assert _one_line(err)


def test_help_descriptions_are_plain_text(capsys):
    for command in ("params", "demo", "bench", "inspect"):
        assert main([command, "--help"]) == 0
        out = capsys.readouterr().out
        assert "``" not in out and f"multihead {command}:" in out

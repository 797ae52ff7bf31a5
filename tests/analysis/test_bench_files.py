"""`multihead bench` keeps its results honest when interrupted and writes them safely:
Ctrl-C while writing leaves files that say ``interrupted: true`` with every case measured;
Ctrl-C before the first case finishes replaces nothing; each file is written atomically and
a symlink in ``--out`` is replaced, never written through; hostile ``--out`` paths are one
clear line before any measuring. KeyboardInterrupt is injected where a Ctrl-C would land."""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest

from multihead.bench import report as R
from multihead.bench import suite as S
from multihead.bench.cases import attention_case
from multihead.cli.main import main

LIMITS = S.Limits(1e11, 1e10)
EARLIER = {"results.json": '{"earlier": true}', "results.md": "# earlier\n",
           "results.png": "earlier png"}


@pytest.fixture
def tiny_suite():
    """Two small cases instead of the quick suite, and no limits measurement (fast)."""
    cases = [attention_case("dense", 64, H=2, D=16), attention_case("causal", 64, H=2, D=16)]
    with mock.patch.object(S, "suite_cases", return_value=cases), \
            mock.patch("multihead.bench.catalog.suite_cases", return_value=cases), \
            mock.patch.object(S, "machine_limits", return_value=LIMITS):
        yield [c.name for c in cases]


def _earlier_results(out):
    out.mkdir(exist_ok=True)
    for name, text in EARLIER.items():
        (out / name).write_text(text)


def _results(out) -> dict:
    return json.loads((out / "results.json").read_text())


def _interrupt_once(real):
    """``real``, except that its first call raises KeyboardInterrupt (a Ctrl-C)."""
    calls = []

    def fn(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        return real(*args, **kwargs)
    return fn


# -- Ctrl-C while the results are written --------------------------------------------------

def test_ctrl_c_while_plotting_leaves_whole_results_of_a_complete_run(tmp_path, tiny_suite, capsys):
    """Every case was measured: the files are written again without the plot, whole and not
    marked partial (they said INTERRUPTED of a complete run); the status is Ctrl-C's."""
    with mock.patch.object(R, "_plot", side_effect=KeyboardInterrupt):
        assert main(["bench", "--out", str(tmp_path)]) == 130
    d = _results(tmp_path)
    assert d["interrupted"] is False
    assert [r["case"] for r in d["rows"]] == tiny_suite           # every case measured is kept
    assert "INTERRUPTED" not in (tmp_path / "results.md").read_text()
    said = " ".join(capsys.readouterr().err.split())
    assert "interrupted while writing: all 2 cases were measured" in said
    assert f"results.png in {tmp_path} was not written" in said         # (there was none)
    _earlier_results(tmp_path)
    with mock.patch.object(R, "_plot", side_effect=KeyboardInterrupt):
        assert main(["bench", "--out", str(tmp_path)]) == 130
    assert (tmp_path / "results.png").read_text() == EARLIER["results.png"]
    assert f"results.png in {tmp_path} was not updated" in " ".join(capsys.readouterr().err.split())


def test_ctrl_c_while_writing_the_json_leaves_whole_results(tmp_path, tiny_suite):
    _earlier_results(tmp_path)
    dumps = _interrupt_once(json.dumps)
    with mock.patch("multihead.bench.report.json.dumps", side_effect=dumps):
        assert main(["bench", "--out", str(tmp_path)]) == 130
    d = _results(tmp_path)
    assert d["interrupted"] is False and [r["case"] for r in d["rows"]] == tiny_suite
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_ctrl_c_while_printing_the_table_finds_the_results_written(tmp_path, tiny_suite, capsys):
    """The files are written before the table: every case was measured, so they are whole."""
    with mock.patch("multihead.cli.bench_cmd._show", side_effect=KeyboardInterrupt):
        assert main(["bench", "--out", str(tmp_path)]) == 130
    d = _results(tmp_path)
    assert d["interrupted"] is False and [r["case"] for r in d["rows"]] == tiny_suite
    said = " ".join(capsys.readouterr().err.split())                  # (rich wraps lines)
    assert f"interrupted while printing the table; the results measured are saved in {tmp_path}" in said


def test_a_reader_that_leaves_early_still_gets_the_files(tmp_path, tiny_suite, stdout_reader_gone):
    """``multihead bench --out D | head -1`` used to lose every measured result."""
    with stdout_reader_gone():
        assert main(["bench", "--out", str(tmp_path)]) == 141
    assert [r["case"] for r in _results(tmp_path)["rows"]] == tiny_suite


def test_ctrl_c_during_a_later_case_keeps_the_cases_before_it(tmp_path, tiny_suite):
    real = S.run_case
    with mock.patch.object(S, "run_case", side_effect=lambda case, *a, **k: (
            (_ for _ in ()).throw(KeyboardInterrupt) if case.name == tiny_suite[1]
            else real(case, *a, **k))):
        assert main(["bench", "--out", str(tmp_path)]) == 130
    d = _results(tmp_path)
    assert d["interrupted"] is True and [r["case"] for r in d["rows"]] == tiny_suite[:1]


def test_the_plot_of_an_interrupted_run_says_so(tmp_path, tiny_suite):
    """Its title used to be cut before the word (results.json and .md had it)."""
    from matplotlib.figure import Figure
    titles, real = [], Figure.suptitle
    real_case = S.run_case

    def suptitle(fig, text, **kw):
        titles.append(text)
        return real(fig, text, **kw)
    with mock.patch.object(Figure, "suptitle", suptitle), \
            mock.patch.object(S, "run_case", side_effect=lambda case, *a, **k: (
                (_ for _ in ()).throw(KeyboardInterrupt) if case.name == tiny_suite[1]
                else real_case(case, *a, **k))):
        assert main(["bench", "--out", str(tmp_path)]) == 130
    assert titles and "INTERRUPTED: partial results." in " ".join(titles[-1].split())


# -- Ctrl-C before any case finished: nothing is replaced -----------------------------------

@pytest.mark.parametrize("where", ["first case", "machine limits"])
def test_ctrl_c_before_any_case_finished_keeps_earlier_results(where, tmp_path, tiny_suite,
                                                              capsys):
    _earlier_results(tmp_path)
    target = "run_case" if where == "first case" else "machine_limits"
    with mock.patch.object(S, target, side_effect=KeyboardInterrupt):
        assert main(["bench", "--out", str(tmp_path)]) == 130
    assert {p.name: p.read_text() for p in tmp_path.iterdir()} == EARLIER
    err = capsys.readouterr().err
    assert "interrupted before any case finished" in err
    assert "left as they were" in err and "Traceback" not in err


def test_ctrl_c_before_any_case_finished_writes_nothing_into_an_empty_out(tmp_path, tiny_suite,
                                                                        capsys):
    out = tmp_path / "new"
    with mock.patch.object(S, "run_case", side_effect=KeyboardInterrupt):
        assert main(["bench", "--out", str(out)]) == 130
    assert not out.exists()                      # (not even an empty directory)
    assert f"nothing written to {out}" in capsys.readouterr().err


# -- atomic writes, never through a symlink -------------------------------------------------

def test_results_replace_a_symlink_instead_of_writing_through_it(tmp_path, tiny_suite):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    for name in ("results.json", "results.md"):
        (out / name).symlink_to(victim)
    (tmp_path / "somedir").mkdir()
    (out / "results.png").symlink_to(tmp_path / "somedir")       # (to a directory: replaced too)
    (out / ".multihead-write-test").symlink_to(victim)      # the old fixed probe name
    assert main(["bench", "--out", str(out)]) == 0
    assert victim.read_text() == "precious" and not list((tmp_path / "somedir").iterdir())
    assert not (out / "results.json").is_symlink() and _results(out)["rows"]
    assert (out / "results.png").read_bytes()[:4] == b"\x89PNG"


def test_an_interrupted_write_leaves_the_old_file_and_no_temporary(tmp_path):
    from multihead import _files as F
    target = tmp_path / "results.json"
    target.write_text("old")
    with mock.patch.object(F.os, "replace", side_effect=KeyboardInterrupt), \
            pytest.raises(KeyboardInterrupt):
        F.atomic_write(target, "new")
    assert target.read_text() == "old" and os.listdir(tmp_path) == ["results.json"]
    F.atomic_write(target, b"new")
    assert target.read_text() == "new" and os.listdir(tmp_path) == ["results.json"]


def test_a_failed_write_removes_the_directories_it_made_and_only_those(tmp_path):
    from multihead import _files as F
    (tmp_path / "kept").mkdir()
    files = {tmp_path / "kept" / "new" / "deeper" / "a.json": "{}",
             tmp_path / "kept" / "b.json": "{}"}
    with mock.patch.object(F.os, "replace", side_effect=KeyboardInterrupt), \
            pytest.raises(KeyboardInterrupt):
        F.atomic_write_all(files)
    assert os.listdir(tmp_path) == ["kept"] and os.listdir(tmp_path / "kept") == []
    assert [p.name for p in F.atomic_write_all(files)] == ["a.json", "b.json"]


@pytest.mark.parametrize("links", [True, False], ids=["hard links", "no hard links"])
@pytest.mark.parametrize("fails", ["keeping aside", "renaming"])
def test_a_rename_failing_midway_puts_every_old_file_back(fails, links, tmp_path):
    """Files are renamed over their targets one by one: a failure at the second target
    (an immutable file, another user's in a sticky directory) left the first one new and
    named the temporary file beside the target, not the target."""
    from multihead import _files as F
    (tmp_path / "a.json").write_text("old a")
    (tmp_path / "b.png").write_text("old b")
    files = {tmp_path / n: f"new {n[0]}" for n in ("a.json", "b.png", "c.svg")}
    real_replace, real_link = os.replace, os.link

    def replace(src, dst):
        if (str(src).endswith(".tmp") and str(dst).endswith("b.png") if fails == "renaming"
                else str(src).endswith("b.png")):       # (b.png moved aside)
            raise PermissionError(1, "Operation not permitted", str(src))
        return real_replace(src, dst)

    def link(src, dst, **kw):
        if not links or (fails == "keeping aside" and str(src).endswith("b.png")):
            raise OSError(1, "Operation not permitted", str(src), None, str(dst))
        return real_link(src, dst, **kw)
    seen = []                          # the targets a reader finds at each rename

    def watched(src, dst):
        seen.append(sorted(n for n in ("a.json", "b.png") if os.path.lexists(tmp_path / n)))
        return replace(src, dst)
    with mock.patch.object(F.os, "replace", side_effect=watched), \
            mock.patch.object(F.os, "link", side_effect=link), \
            pytest.raises(PermissionError) as e:
        F.atomic_write_all(files)
    # an old file is away only between its own two renames (aside, then the new one in)
    assert all(len(names) >= 1 for names in seen) and seen[0] == ["a.json", "b.png"], seen
    assert e.value.filename == str(tmp_path / "b.png") and e.value.filename2 is None
    assert sorted(os.listdir(tmp_path)) == ["a.json", "b.png"]     # no temporary, no copy
    assert [(tmp_path / n).read_text() for n in ("a.json", "b.png")] == ["old a", "old b"]
    with mock.patch.object(F.os, "link", side_effect=link if not links else real_link):
        F.atomic_write_all(files)
    assert sorted(os.listdir(tmp_path)) == ["a.json", "b.png", "c.svg"]
    assert [(tmp_path / n).read_text() for n in sorted(os.listdir(tmp_path))] == [
        "new a", "new b", "new c"]


def test_written_files_get_the_usual_permissions(tmp_path):
    from multihead import _files as F
    old = os.umask(0o022)
    try:
        F.atomic_write(tmp_path / "a.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "a.json").stat().st_mode & 0o777 == 0o644


# -- hostile --out paths: one line, before any measuring ------------------------------------

def _bad_out(tmp_path):
    a_file = tmp_path / "a-file"
    a_file.write_text("x")
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "with-dir" / "results.json").mkdir(parents=True)
    return {
        "a file": (a_file, "is a file, not a directory"),
        "under a file": (a_file / "sub", "is not writable: " + repr(str(a_file)) + " is a file"),
        "symlink loop": (tmp_path / "loop", "is not writable: it is a symlink loop"),
        "dangling symlink": (tmp_path / "dangling" / "b", f"'{tmp_path / 'dangling'}' is a "
                             f"symlink to '{tmp_path / 'nowhere'}', which does not exist"),
        "results.json is a directory": (tmp_path / "with-dir",
                                        "results.json there is a directory"),
        "unwritable": ("/sys/multihead-bench-out", "is not writable"),
        "name too long": (tmp_path / ("x" * 300), "is not writable (File name too long)"),
    }


@pytest.mark.parametrize("case", ["a file", "under a file", "symlink loop", "dangling symlink",
                                  "results.json is a directory", "unwritable", "name too long"])
def test_bad_out_is_one_line_before_measuring(case, tmp_path, capsys):
    out, message = _bad_out(tmp_path)[case]
    with mock.patch.object(S, "machine_limits", side_effect=AssertionError("measured")):
        assert main(["bench", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err


def test_demo_heads_refuses_a_bad_out_before_training(tmp_path, capsys):
    (tmp_path / "heads.json").mkdir()
    with mock.patch("multihead.analysis.heads_experiment.train",
                    side_effect=AssertionError("trained")):
        assert main(["demo", "heads", "--quick", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "heads.json there is a directory" in err and err.count("\n") == 1


def test_a_failed_write_of_the_results_leaves_no_directory_it_made(tmp_path, tiny_suite, capsys):
    """The disk fills while results.png is staged: no empty --out is left behind."""
    from multihead import _files as F
    real = F._stage

    def full_at_png(path, data):
        if path.name == "results.png":
            raise OSError(28, "No space left on device")
        return real(path, data)
    with mock.patch.object(F, "_stage", side_effect=full_at_png):
        assert main(["bench", "--out", str(tmp_path / "new" / "b")]) == 2
    out, err = capsys.readouterr()
    assert "No space left on device" in err
    assert os.listdir(tmp_path) == []
    assert all(name in out for name in tiny_suite)        # the measured table is still shown


def test_the_results_say_which_families_were_run(tmp_path, tiny_suite, capsys):
    assert main(["bench", "--family", "dense", "--family", "causal", "--out", str(tmp_path)]) == 0
    assert _results(tmp_path)["families"] == ["dense", "causal"]
    md = (tmp_path / "results.md").read_text()
    assert "multihead bench --suite quick --family dense --family causal --device cpu" in md
    assert main(["bench", "--out", str(tmp_path)]) == 0
    assert _results(tmp_path)["families"] is None

"""`multihead inspect` on hostile input: a corrupt model (NaN weights, run-time overflow), an
output directory with planted symlinks, and text that is not UTF-8. Each ends in one clear
line and a non-zero exit, or in a correct report, never in a traceback or a damaged file."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from multihead.cli import inspect_cmd
from multihead.cli.main import build_parser, main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny import tiny_checkpoint  # noqa: E402

REPORT = ["head_L3H1.png", "head_L3H1.svg", "heads.png", "heads.svg", "inspect.json",
          "report.html"]


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


def _loading(monkeypatch, corrupt):
    """Make ``multihead inspect`` load the default model, then ``corrupt(encoder)`` it (as
    weights that go wrong after any load-time check)."""
    import multihead.models as models
    real = models.load

    def load(*args, **kwargs):
        model = real(*args, **kwargs)
        with torch.no_grad():
            corrupt(model.encoder)
        return model
    monkeypatch.setattr(models, "load", load)


# A. non-finite weights and outputs

def test_nan_in_one_head_names_layer_and_head(tmp_path, monkeypatch, capsys):
    def nan_in_l1h3_query(enc):                    # in_proj rows: Q of heads 0..11, then K, V
        enc.layers[1].attention.in_proj_weight[3 * 32, 0] = float("nan")
    _loading(monkeypatch, nan_in_l1h3_query)
    out = tmp_path / "o"
    assert main(["inspect", "--out", str(out)]) == 2
    err = _one_line_error(capsys)
    assert "layer 1 produced non-finite attention weights (NaN or inf) in head 3 (L1H3" in err
    assert "probably corrupt" in err
    assert not out.exists()                        # no report, not even a directory


def test_runtime_overflow_is_an_error_not_a_blank_report(tmp_path, monkeypatch, capsys):
    def huge(enc):                                 # finite weights whose scores overflow float32
        enc.layers[2].attention.in_proj_weight.mul_(1e30)
    _loading(monkeypatch, huge)
    out = tmp_path / "o"
    assert main(["inspect", "--out", str(out)]) == 2
    err = _one_line_error(capsys)
    assert "layer 2 produced non-finite attention weights (NaN or inf) in 12 heads (0-11)" in err
    assert not out.exists()


def test_non_finite_output_with_finite_weights(tmp_path, monkeypatch, capsys):
    def nan_in_last_ffn(enc):
        enc.layers[5].output.bias[0] = float("inf")
    _loading(monkeypatch, nan_in_last_ffn)
    assert main(["inspect", "--out", str(tmp_path), "--format", "json"]) == 2
    assert "the encoder's output (after layer 5) holds non-finite values" in _one_line_error(capsys)
    assert list(tmp_path.iterdir()) == []


def test_nan_in_checkpoint_file(tmp_path, capsys):
    d = tiny_checkpoint(tmp_path / "tiny")
    from safetensors.torch import load_file, save_file
    tensors = load_file(str(d / "model.safetensors"))
    name = next(n for n in tensors if "layer.1.attention.self.query.weight" in n)
    tensors[name][0, 0] = float("nan")
    save_file(tensors, str(d / "model.safetensors"))
    out = tmp_path / "o"
    assert main(["inspect", "it rains", "--model", str(d), "--out", str(out)]) == 2
    err = _one_line_error(capsys)       # caught when loading, or else when running: either way
    assert "NaN" in err or "non-finite" in err
    assert not out.exists()


def test_strict_json_and_metrics_refuse_nan():
    from multihead.inspect.metrics import HeadMetrics
    from multihead.inspect.report import _json
    with pytest.raises(ValueError):
        _json({"x": float("nan")})
    w = torch.full((1, 1, 2, 2), 0.5)
    w[0, 0, 1, 1] = float("inf")
    with pytest.raises(ValueError, match="NaN or inf"):
        HeadMetrics.of(w, ["[CLS]", "[SEP]"])


def test_figures_fall_back_to_installed_fonts_and_say_once_what_none_draws(tmp_path, capsys):
    """A token DejaVu Sans lacks is drawn with an installed font that has it (matplotlib's
    STIX has 'の'); a character no font draws is one warning line, not one per glyph."""
    import warnings

    from multihead.inspect.plots import fonts_for
    assert fonts_for(["the animal", "L3H1"]) == ([], "")
    families, missing = fonts_for(["の"])
    assert families and missing == "" and not any(f.startswith("Last Resort") for f in families)
    unfontable = fonts_for(["一"])[1]                  # "" where a CJK font is installed
    d = tiny_checkpoint(tmp_path / "tiny")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["inspect", "の 一 it rains", "--model", str(d), "--out", str(tmp_path / "o"),
                     "--format", "png,svg"]) == 0
    assert not [w for w in caught if "Glyph" in str(w.message)]
    err = " ".join(capsys.readouterr().err.split())
    said = "warning: no installed font draws '一': the PNG/SVG figures show boxes for it"
    assert (said in err) == (unfontable == "一") and err.count("no installed font") <= 1
    assert "'の" not in err


def test_a_combining_mark_no_font_draws_is_not_blamed_on_another_character(tmp_path, capsys):
    """The embedded model splits "हिन्दी" into pieces such as "##ि": matplotlib, lacking the
    vowel sign, warned "Glyph 35 (#) missing", twice, besides our own one line."""
    import warnings
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert main(["inspect", "हिन्दी it", "--out", str(tmp_path), "--format", "png"]) == 0
    assert not [str(w.message) for w in caught if "Glyph" in str(w.message)]
    assert capsys.readouterr().err.count("no installed font") <= 1


# C. symlinks planted in --out

def test_out_never_writes_through_symlinks(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    absent = tmp_path / "created-through-a-dangling-link"
    out = tmp_path / "o"
    out.mkdir()
    for name in (".multihead-write-test", "report.html", "inspect.json", "heads.png"):
        (out / name).symlink_to(victim)
    (out / "heads.svg").symlink_to(absent)
    assert main(["inspect", "--out", str(out)]) == 0
    assert victim.read_text() == "precious" and not absent.exists()
    for name in REPORT:
        p = out / name
        assert not p.is_symlink() and p.is_file() and p.stat().st_size > 0, name
        umask = os.umask(0)
        os.umask(umask)
        assert stat.S_IMODE(p.stat().st_mode) == 0o666 & ~umask, name
    # the planted probe link is left alone; no temporary file is left behind
    assert sorted(p.name for p in out.iterdir()) == sorted(REPORT + [".multihead-write-test"])
    json.loads((out / "inspect.json").read_text())


def test_unwritable_name_is_one_line_and_leaves_no_temporary(tmp_path, capsys):
    (tmp_path / "inspect.json").mkdir()                         # a directory in the way
    assert main(["inspect", "--out", str(tmp_path), "--format", "json"]) == 2
    err = _one_line_error(capsys)                               # (before the model runs)
    assert "inspect.json there is a directory, so it cannot be written" in err
    (tmp_path / "inspect.json").rmdir()
    (tmp_path / "head_L3H1.png").mkdir()             # a name known only once a head is chosen
    assert main(["inspect", "--out", str(tmp_path), "--format", "json,png"]) == 2
    err = _one_line_error(capsys)                    # (the default text's: L3H1, it → animal)
    assert "cannot write" in err and "head_L3H1.png" in err
    assert [p.name for p in tmp_path.iterdir()] == ["head_L3H1.png"]


# D. text that is not UTF-8

def test_non_utf8_file_is_one_clear_line(tmp_path, capsys):
    f = tmp_path / "latin1.txt"
    f.write_bytes("it rains\nthe café is closed\n".encode("latin-1"))
    assert main(["inspect", "--file", str(f)]) == 2
    err = _one_line_error(capsys)
    assert f"--file '{f}' is not UTF-8 text (line 2, byte 0xe9" in err and "iconv" in err


def test_utf8_file_with_byte_order_mark(tmp_path, capsys):
    f = tmp_path / "bom.txt"
    f.write_bytes("\ufeffthe café is closed because it rains\n".encode("utf-8"))
    out = tmp_path / "o"
    assert main(["inspect", "--file", str(f), "--out", str(out), "--format", "json"]) == 0
    assert json.loads((out / "inspect.json").read_text())["text"].startswith("the café")


@pytest.mark.parametrize("argv,what", [
    (["caf\udce9 it rains"], "TEXT (the command-line text) is not valid UTF-8 (character 4 is "
                             "the undecodable byte 0xe9)"),
    (["it rains", "--query-token", "r\udcffin"], "--query-token is not valid UTF-8 (character 2 "
                                                 "is the undecodable byte 0xff)"),
])
def test_non_utf8_arguments_are_refused_by_inspect(argv, what):
    # argv as Python decodes it (surrogateescape), straight to inspect: whatever main() does
    args = build_parser().parse_args(["inspect", *argv])
    with pytest.raises(ValueError) as e:
        inspect_cmd.run(args)
    assert what in str(e.value) and "pass UTF-8 text" in str(e.value)


def test_non_utf8_argv_end_to_end():
    code = "import sys; from multihead.cli.main import main; sys.exit(main(sys.argv[1:]))"
    r = subprocess.run([sys.executable, "-c", code, "inspect", b"caf\xe9 it rains"],
                       capture_output=True, timeout=300)
    err = r.stderr.decode("utf-8", "replace")
    assert r.returncode == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert "UTF-8" in err


def test_weights_that_would_not_fit_are_refused_before_the_model_runs(monkeypatch, capsys):
    import multihead.inspect.capture as capture_mod
    from multihead.models import load
    model = load()
    monkeypatch.setattr(capture_mod, "available_memory", lambda device: 2**16)     # 64 KiB
    monkeypatch.setattr(type(model), "attention_weights",
                        lambda *a: pytest.fail("the model ran"))
    text = "The animal didn't cross the street because it was too tired."    # 16 tokens
    with pytest.raises(capture_mod.InspectError, match=r"the text's 16 tokens need 72\.0 KiB .*"
                       r"\(6 layers x 12 heads x 16² x 4 bytes\), more than the 64\.0 KiB"):
        capture_mod.capture(model, text)
    monkeypatch.undo()
    monkeypatch.setattr(capture_mod, "available_memory", lambda device: 2**16)
    assert main(["inspect", text]) == 2
    err = _one_line_error(capsys)
    assert "need" in err and "shorten the text" in err
    monkeypatch.undo()
    c = capture_mod.capture(model, text)                   # fits: the weights as the model gave
    ids = model.tokenize(text).ids[None]
    torch.testing.assert_close(c.weights, torch.stack([w[0] for w in
                                                       model.attention_weights(ids).weights]))

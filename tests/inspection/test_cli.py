"""`multihead inspect` end to end: output, exit codes, files written, JSON content, bad input
as one-line errors, and no network connection (sockets blocked)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from multihead.cli.main import main

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny import tiny_checkpoint  # noqa: E402

NO_NET = """
import socket, sys
def refuse(*a, **k):
    raise RuntimeError("network access attempted")
socket.socket.connect = refuse
socket.socket.connect_ex = refuse
socket.create_connection = refuse
socket.getaddrinfo = refuse
from multihead.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def _run(*argv):
    return subprocess.run([sys.executable, "-c", NO_NET, *argv], capture_output=True, text=True,
                          env={**os.environ, "HF_HUB_OFFLINE": "0"}, timeout=300)


def test_default_run_offline_writes_every_format(tmp_path):
    r = _run("inspect", "--out", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "network access attempted" not in r.stdout + r.stderr
    assert "L3H1" in r.stdout and "it → animal" in r.stdout
    assert "Traceback" not in r.stderr
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == ["head_L3H1.png", "head_L3H1.svg", "heads.png", "heads.svg", "inspect.json",
                     "report.html"]
    assert (tmp_path / "heads.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (tmp_path / "heads.svg").read_text().lstrip().startswith("<?xml")
    d = json.loads((tmp_path / "inspect.json").read_text())
    assert d["model"] == "all-MiniLM-L6-v2" and (d["layers"], d["heads"]) == (6, 12)
    S = len(d["tokens"])
    assert d["tokens"][:3] == ["[CLS]", "the", "animal"] and S == 16
    from multihead.inspect.packing import unpack_weights
    w = unpack_weights(d["weights"])                     # packed: one byte per weight
    assert tuple(w.shape) == (6, 12, S, S) and d["weights"]["shape"] == [6, 12, S, S]
    assert torch.allclose(w.sum(-1), torch.ones(6, 12, S), atol=0.01)
    q = d["query"]
    assert q["token"] == "it" and q["position"] == 10
    animal = [h for h in q["heads"] if h["target_token"] == "animal"]
    assert animal and max(h["weight"] for h in animal) >= 0.5
    for h in q["heads"]:            # cut down, as the label's: L0H2's 0.999993 was 1.0 there
        assert int(h["weight"] * 100 + 1e-9) / 100 == float(h["label"].split()[-1]), h
    assert d["selected"] == {"layer": 3, "head": 1}
    assert set(d["metrics"]) == {"cls", "sep", "punct", "prev", "next", "self", "entropy",
                                 "confidence"}
    assert d["roles"][0][2][0] == "previous token"


def test_options(tmp_path, capsys):
    f = tmp_path / "texts.txt"
    f.write_text("The dog chased the cat because it was hungry.\n\nShe said he left.\n")
    out = tmp_path / "o"
    assert main(["inspect", "--file", str(f), "--query-token", "cat", "--layer", "0", "--head",
                 "2", "--out", str(out), "--format", "json", "--metrics"]) == 0
    text = capsys.readouterr().out
    assert "averaged over 2 texts" in text and "confidence" in text
    d = json.loads((out / "inspect.json").read_text())
    assert d["texts_averaged"] == 2 and d["query"]["token"] == "cat"
    assert d["selected"] == {"layer": 0, "head": 2} and sorted(p.name for p in out.iterdir()) == [
        "inspect.json"]


def test_long_text_truncates_with_warning_or_refuses(capsys):
    long = "word " * 600
    assert main(["inspect", long]) == 0
    assert "keeping the first 512" in capsys.readouterr().err
    assert main(["inspect", long, "--no-truncate"]) == 2
    err = capsys.readouterr().err
    assert "602 tokens but the model has 512 positions" in err and err.count("\n") == 1


@pytest.mark.parametrize("argv,message", [
    (["   "], "the text is empty"),
    (["\u200b\x07"], "has no token but the model's markers ([CLS] [SEP]): it holds nothing"),
    (["--query-token", "zebra"], "--query-token 'zebra' (tokens ['zebra']) is not in the text"),
    (["--query-token", "🐱", "a 🚀 flew"], "--query-token '🐱' (tokens ['[UNK]']) is not in the"),
    (["--query-token", "the dog", "The dog barked"], "--query-token 'the dog' is 2 words: pass "
                                                      "one word of the text"),
    # the [SEP] the tokenizer adds is no word of the text; a piece of a word names the word
    (["--query-token", "[SEP]", "it is"], "--query-token '[SEP]' (tokens ['[SEP]']) is not in"),
    (["--query-token", "zero", "a zero\u200bwidth"], "--query-token 'zero' is only part of "
                                                     "'zero\\u200bwidth' in the text"),
    (["-it"], "unrecognized arguments: -it (a text that starts with '-' goes after --: "
              "multihead inspect -- -it)"),
    (["the cat", "-z"], "unrecognized arguments: -z (see multihead inspect --help)"),  # (a text)
    (["--layer", "6"], "--layer 6 is out of range: the model has 6 layers (0..5)"),
    (["--head", "-1"], "--head -1 is out of range: the model has 12 heads per layer (0..11)"),
    (["--layer", "\u0661"], "argument --layer: '\u0661' is not a whole number: give an integer"),
    (["--head", "1_0"], "argument --head: '1_0' is not a whole number: give an integer"),
    (["--format", "pdf"], "--format 'pdf': unknown ['pdf']"),
    (["--file", "/nonexistent/texts.txt"], "cannot be read"),
])
def test_bad_input_is_one_line(argv, message, capsys):
    assert main(["inspect", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1 and "Traceback" not in err
    assert "the text was cut" not in err


def test_a_marker_written_in_the_text_is_the_query_not_the_one_added(tmp_path, capsys):
    import json
    assert main(["inspect", "[CLS] it is", "--query-token", "[CLS]", "--out", str(tmp_path),
                 "--format", "json"]) == 0
    d = json.loads((tmp_path / "inspect.json").read_text())
    assert d["tokens"][:2] == ["[CLS]", "[CLS]"] and d["query"]["position"] == 1


def test_a_query_word_cut_off_by_truncation_is_said_to_be_cut_off(capsys):
    """It was reported as not in the text, which it is."""
    assert main(["inspect", "--query-token", "zebra", "word " * 600 + "zebra"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("warning: the text has 603 tokens; keeping the first 512")
    assert err[-1].startswith("multihead inspect: error: --query-token 'zebra' (tokens ['zebra']) "
                              "is not in the text") and "Traceback" not in "".join(err)
    assert err[-1].endswith("(the text was cut to the model's 512 positions: 512 of its 603 "
                            "tokens are read, and a word after them cannot be the query: pick "
                            "one from the start)")


def test_a_look_at_the_next_token_is_not_called_long_range(capsys):
    """In "hello world" no word is more than one token from another."""
    assert main(["inspect", "hello world"]) == 0
    out = capsys.readouterr().out
    assert "strongest head from the query token: " in out and "long-range" not in out
    assert main(["inspect"]) == 0                          # the default text: "it → animal"
    assert "strongest long-range head from the query token: " in capsys.readouterr().out


def test_the_headline_shows_the_weight_its_table_row_shows(capsys):
    """Both cut to two decimals (the default text's L3H1 weighs 0.6768: 0.67 in both)."""
    import re
    assert main(["inspect"]) == 0
    out = capsys.readouterr().out
    found = re.search(r"query token: (L\d+H\d+): it →\s+animal\s+(\d\.\d\d)", out)
    head, weight = found.groups()                            # (the console wraps at 80)
    row = next(ln for ln in out.splitlines() if ln.startswith(f"│ {head} "))
    assert [c.strip() for c in row.split("│")[1:-1]][2] == weight


def test_a_text_with_no_other_word_says_so(capsys):
    assert main(["inspect", "hi"]) == 0
    out = capsys.readouterr().out
    assert "Heads attending most from 'hi' (token 1): none to show" in out
    assert "from → to" not in out                            # no empty table


def test_format_without_out_is_refused(capsys):
    assert main(["inspect", "--format", "png"]) == 2
    err = capsys.readouterr().err
    assert "--format 'png' says what --out gets, and no --out was given" in err
    assert err.count("\n") == 1


def test_a_directory_where_a_report_file_goes_is_refused_before_the_model_runs(tmp_path, capsys):
    (tmp_path / "report.html").mkdir()
    assert main(["inspect", "--out", str(tmp_path), "--format", "html"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "report.html there is a directory" in err


def test_unwritable_out(tmp_path, capsys):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["inspect", "--out", str(blocker / "sub")]) == 2
    assert "is not writable" in capsys.readouterr().err


def test_a_refused_text_leaves_no_out_directory(tmp_path, capsys):
    d = tiny_checkpoint(tmp_path / "tiny")
    out = tmp_path / "report" / "nested"
    assert main(["inspect", "[CLS] [SEP]", "--model", str(d), "--out", str(out)]) == 2
    assert "it is only marker tokens" in capsys.readouterr().err
    assert not (tmp_path / "report").exists()             # checked, but not created early
    assert main(["inspect", "it rains", "--model", str(d), "--out", str(out),
                 "--format", "json"]) == 0
    assert [p.name for p in out.iterdir()] == ["inspect.json"]


def test_a_reader_that_leaves_early_still_gets_the_files(tmp_path, stdout_reader_gone, capsys):
    """``multihead inspect --out D | head -1``: the files are written before the table."""
    d = tiny_checkpoint(tmp_path / "tiny")
    with stdout_reader_gone():
        assert main(["inspect", "it rains", "--model", str(d), "--out", str(tmp_path / "o"),
                     "--format", "json"]) == 141
    assert [p.name for p in (tmp_path / "o").iterdir()] == ["inspect.json"]
    assert "inspect.json" in capsys.readouterr().err


def test_model_dirs(tmp_path, capsys):
    d = tiny_checkpoint(tmp_path / "tiny")
    assert main(["inspect", "it rains", "--model", str(d), "--out", str(tmp_path / "o"),
                 "--format", "json"]) == 0
    data = json.loads((tmp_path / "o" / "inspect.json").read_text())
    assert (data["model"], data["layers"], data["heads"]) == ("tiny", 2, 4)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "t5"}))
    capsys.readouterr()
    assert main(["inspect", "--model", str(d)]) == 2
    err = capsys.readouterr().err
    assert "model_type is 't5'" in err and err.count("\n") == 1


def _png_size(data: bytes) -> tuple[int, int]:
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def test_long_text_report_is_small(tmp_path, long_text, capsys):
    # 512 tokens (truncated): the weights alone are 6 x 12 x 512 x 512 = 19M numbers; the
    # report once wrote 270 MB and drew a 29000-pixel heatmap. All files: under 32 MB.
    data = tmp_path / "data"
    assert main(["inspect", long_text, "--out", str(data), "--format", "html,json"]) == 0
    sizes = {p.name: p.stat().st_size for p in data.iterdir()}
    assert sizes["report.html"] < 16e6 and sizes["inspect.json"] < 16e6, sizes   # (one packing)
    d = json.loads((data / "inspect.json").read_text())
    assert len(d["tokens"]) == 512 and d["truncated"]
    from multihead.inspect.packing import unpack_weights
    w = unpack_weights(d["weights"])                                     # (6, 12, 512, 512)
    assert tuple(w.shape) == (6, 12, 512, 512)
    assert torch.allclose(w.sum(-1), torch.ones(6, 12, 512), atol=0.02)  # small weights kept

    figures = tmp_path / "figures"
    assert main(["inspect", long_text, "--out", str(figures), "--format", "png,svg"]) == 0
    sizes.update({p.name: p.stat().st_size for p in figures.iterdir()})
    assert len(sizes) == 6 and sum(sizes.values()) < 32e6, sizes
    for p in figures.glob("*.png"):
        assert max(_png_size(p.read_bytes())) <= 2400, p.name
    assert "every 7th token labelled" in next(figures.glob("head_*.svg")).read_text()


def test_file_texts_are_counted_as_lines(tmp_path, capsys):
    """Repeated one-letter lines are texts of their own (Python shares one object for equal
    short strings); a form feed or U+2028 inside a line does not split it."""
    f = tmp_path / "t.txt"
    f.write_text("I\nI\nI\nwe go\r\nthe cat\u2028sat\x0cdown\n", encoding="utf-8")
    assert main(["inspect", "--file", str(f)]) == 0
    assert "averaged over 5 text(s)" in capsys.readouterr().out
    assert main(["inspect", "I", "--file", str(f)]) == 0
    assert "averaged over 6 text(s)" in capsys.readouterr().out


def test_long_file_text_warns_or_is_refused_naming_its_line(tmp_path, capsys):
    f = tmp_path / "t.txt"
    f.write_text("a short text\n\n" + "word " * 600 + "\n", encoding="utf-8")
    assert main(["inspect", "--file", str(f)]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "1 line(s) of --file are longer than the model's 512 positions (line 3: 602 tokens)" in err
    assert main(["inspect", "--file", str(f), "--no-truncate"]) == 2
    err = capsys.readouterr().err
    assert f"--file '{f}' line 3: the text has 602 tokens but the model has 512" in err
    assert err.count("\n") == 1


def test_the_first_line_of_a_file_is_named_and_counted_as_the_others(tmp_path, capsys):
    f = tmp_path / "t.txt"
    f.write_text("\n" + "word " * 600 + "\n" + "more " * 600 + "\n", encoding="utf-8")
    assert main(["inspect", "--file", str(f)]) == 0
    err = " ".join(capsys.readouterr().err.split())
    assert "2 line(s) of --file are longer than the model's 512 positions (line 2: 602 tokens, " \
           "and 1 more)" in err and "the text has" not in err
    assert main(["inspect", "--file", str(f), "--no-truncate"]) == 2
    err = capsys.readouterr().err
    assert f"--file '{f}' line 2: the text has 602 tokens" in err and err.count("\n") == 1
    assert main(["inspect", "word " * 600]) == 0                  # TEXT: no line to name
    assert "warning: the text has 602 tokens" in capsys.readouterr().err


def test_a_head_named_in_full_is_checked_before_the_model_runs(tmp_path, capsys):
    (tmp_path / "head_L3H1.png").mkdir()
    assert main(["inspect", "--layer", "3", "--head", "1", "--out", str(tmp_path)]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "head_L3H1.png there is a directory" in err


@pytest.mark.parametrize("option,value", [("--layer", 4), ("--head", 7)])
def test_one_of_layer_and_head_shows_its_strongest_look(option, value, tmp_path, capsys):
    """None of the default text's top 8 looks is in layer 4 or by head 7: the head shown is
    the one whose weight from "it" to an earlier word, beyond its neighbour, is largest."""
    from multihead.inspect.packing import unpack_weights
    assert main(["inspect", option, str(value), "--out", str(tmp_path), "--format", "json"]) == 0
    d = json.loads((tmp_path / "inspect.json").read_text())
    fixed, q = option[2:], d["query"]["position"]
    assert all(h[fixed] != value for h in d["query"]["heads"])
    w = unpack_weights(d["weights"])[:, :, q, 1:q - 1]      # (L, H, earlier words but the next)
    w = w[value] if fixed == "layer" else w[:, value]                     # (H or L, keys)
    best = int(w.amax(-1).argmax())
    assert d["selected"] == ({"layer": value, "head": best} if fixed == "layer"
                             else {"layer": best, "head": value})


@pytest.mark.parametrize("top", [1, 3])
def test_the_number_of_heads_listed_does_not_change_the_head_shown(top, tmp_path, capsys):
    """--top lists fewer heads; the headline and the head shown large were chosen among those
    listed only (--top 3: "it → tired", a later word, though "it" is a pronoun)."""
    from multihead.inspect.packing import unpack_weights
    assert main(["inspect", "--top", str(top), "--out", str(tmp_path), "--format", "json"]) == 0
    d = json.loads((tmp_path / "inspect.json").read_text())
    assert len(d["query"]["heads"]) == top
    q = d["query"]["position"]
    w = unpack_weights(d["weights"])[:, :, q, 1:q - 1]   # (L, H, earlier words but the next)
    layer, head = divmod(int(w.amax(-1).flatten().argmax()), w.shape[1])
    assert d["selected"] == {"layer": layer, "head": head} == {"layer": 3, "head": 1}
    assert d["summary"].endswith("L3H1: it → animal 0.67")


POSITIONAL = {"previous token": "prev", "next token": "next", "self": "self", "[CLS]": "cls",
              "[SEP]": "sep", "punctuation": "punct"}


@pytest.mark.parametrize("text", ["hello world", "She said he left.", "The cat sat on the mat."])
def test_the_numbers_shown_give_the_roles_shown(text, capsys):
    """Every role follows from the rounded numbers beside it, by the printed rules (each a
    'metric >= threshold': 0.4996 must not show as a 0.50 that would have made a role)."""
    assert main(["inspect", text, "--metrics"]) == 0
    rows = [[c.strip() for c in ln.split("│")[1:-1]] for ln in capsys.readouterr().out.splitlines()
            if ln.startswith("│ L") and ln.count("│") == 12]
    assert len(rows) == 72
    for head, role, score, *values in rows:
        m = dict(zip(("cls", "sep", "punct", "prev", "next", "self", "entropy", "confidence"),
                     map(float, values)))
        reached = {r: m[k] for r, k in POSITIONAL.items() if m[k] >= 0.5}
        if role in POSITIONAL:
            assert reached[role] == max(reached.values()) == float(score), head
        else:
            assert not reached, (head, reached)
            want = ("broad" if m["entropy"] >= 0.8 else
                    "focused" if m["confidence"] >= 0.5 else "mixed")
            assert role == want, (head, role, m)


def test_terminal_control_characters_in_the_text_are_shown_not_obeyed(tmp_path, capsys):
    f = tmp_path / "t.txt"
    f.write_text("it\x1b[2J was \x1b]0;owned\x07 \u202edone\n", encoding="utf-8")
    assert main(["inspect", "--file", str(f)]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\u202e" not in out and "\x07" not in out
    assert "text: it\\x1b[2J was \\x1b]0;owned\\x07 \\u202edone" in out


def test_out_paths_are_printed_as_they_are(tmp_path, capsys):
    out = tmp_path / "[bold]x" / "c[/]d"
    assert main(["inspect", "hi", "--out", str(out), "--format", "json"]) == 0
    assert f"wrote {out / 'inspect.json'}" in capsys.readouterr().err


def test_dollar_signs_are_drawn_as_text(tmp_path):
    """'$x^$' in a label is not TeX (it failed to parse, and nothing was written), whatever
    the matplotlibrc says."""
    import matplotlib
    d = tiny_checkpoint(tmp_path / "model $x^$")
    out = tmp_path / "o"
    with matplotlib.rc_context({"text.usetex": True}):
        assert main(["inspect", "it costs $$ or $x^$", "--model", str(d), "--out", str(out),
                     "--format", "png,svg"]) == 0
    svg = (out / "heads.svg").read_text()
    assert "model $x^$" in svg or "model $x^$".replace(" ", "") in svg.replace(" ", "")


@pytest.mark.parametrize("error", [MemoryError(), RuntimeError(
    "[enforce fail at alloc_cpu.cpp:121] data. DefaultCPUAllocator: can't allocate memory: you "
    "tried to allocate 2789107344 bytes. Error code 12 (Cannot allocate memory)")])
def test_running_out_of_memory_is_one_line(error, monkeypatch, capsys):
    """Past what the up-front check sees (a ulimit, a container's cap, a layer's scores), a
    MemoryError or torch's allocator error was a traceback with status 1."""
    from multihead.cli import main as cli_main

    def run(args):
        raise error

    monkeypatch.setattr(cli_main.SUBCOMMANDS["inspect"], "run", run)
    assert main(["inspect", "text"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("multihead inspect: error: out of memory") and err.count("\n") == 1


def test_other_runtime_errors_are_not_called_out_of_memory(monkeypatch):
    from multihead.cli import main as cli_main

    def run(args):
        raise RuntimeError("a defect of ours")

    monkeypatch.setattr(cli_main.SUBCOMMANDS["inspect"], "run", run)
    with pytest.raises(RuntimeError, match="a defect of ours"):
        main(["inspect", "text"])

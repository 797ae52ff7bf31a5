"""`multihead inspect --model DIR` on decoders: a tiny GPT-2 and a tiny Llama with GQA, built
here at random (no download) with a tokenizer trained here. The weights are transformers'
eager weights, nothing lies above the diagonal, the headline look points backwards, the
terminal and the reports say the model is causal, and what is meaningless for a decoder is
n/a. A tiny BART (an encoder-decoder) shows its encoder's bidirectional self-attention, and
says so. Directories with only a pickle, an unknown model type, or no transformers are
refused."""

from __future__ import annotations

import json
import re
import shutil
import socket
import sys
from pathlib import Path

import pytest
import torch

from multihead.cli.main import main
from multihead.inspect.capture import (InspectError, capture, find_query, headline,
                                       strongest_looks)
from multihead.inspect.metrics import HeadMetrics
from multihead.inspect.packing import unpack_weights
from multihead.models import ModelLoadError, load

transformers = pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from tiny import tiny_checkpoint  # noqa: E402
from hf_tiny import TEXT, hf_checkpoint, refused_cheaply, rewrite_weights  # noqa: E402

from headless import chromium  # noqa: E402

NOTE = "decoder (causal): each token attends only to itself and earlier tokens"
BART_NOTE = ("encoder-decoder (BART): showing the encoder's self-attention (bidirectional: each "
             "token attends to every token)")
@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("decoders")
    return {kind: hf_checkpoint(root / kind, kind) for kind in ("gpt2", "llama", "mistral", "bart")}


def _copy(dirs, kind: str, tmp_path: Path) -> Path:
    return Path(shutil.copytree(dirs[kind], tmp_path / kind))


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err, err
    return err


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_inspect_decoder_end_to_end(dirs, kind, tmp_path, capsys, monkeypatch):
    def refuse(*a, **k):
        raise RuntimeError("network access attempted")
    monkeypatch.setattr(socket.socket, "connect", refuse)
    out = tmp_path / "o"
    assert main(["inspect", TEXT, "--model", str(dirs[kind]), "--out", str(out),
                 "--format", "json,html", "--metrics"]) == 0
    text = " ".join(capsys.readouterr().out.split())      # rich wraps lines
    assert NOTE in text and "to earlier tokens only" in text
    assert "n/a (not measured, not 0):" in text and "| n/a |" not in text
    assert "next: a decoder's tokens never see the next token" in text
    assert "next token if" not in text                   # no next-token role rule for a decoder

    d = json.loads((out / "inspect.json").read_text())
    assert d["causal"] is True and d["attention"] == NOTE and d["model"] == kind
    toks = d["tokens"]
    assert "animal" in toks and "street" in toks and not any("Ġ" in t or "▁" in t for t in toks)
    assert (toks[0] == "<s>") == (kind == "llama")       # Llama's tokenizer adds a BOS token
    L, H, S = d["layers"], d["heads"], len(toks)
    assert (L, H) == (2, 4)                               # Llama: 4 query heads on 2 K/V heads
    w = unpack_weights(d["weights"])                      # (L, H, S, S)
    assert not bool(torch.triu(w, diagonal=1).any())      # nothing above the diagonal
    assert torch.allclose(w.sum(-1), torch.ones(L, H, S), atol=0.02)

    na = d["not_applicable"]
    assert d["metrics"]["next"] is None and "next" in na
    assert ("cls" in na) == (kind == "gpt2") and "sep" in na   # GPT-2 adds no [CLS]/<s>
    assert all(d["metrics"][m] is not None for m in ("prev", "self", "entropy", "confidence"))
    assert all(role != "next token" for row in d["roles"] for role, _ in row)
    assert "next token" not in d["thresholds"]

    q = d["query"]
    assert q["token"] == "it" and toks[q["position"]] == "it"
    assert q["heads"] and all(h["target"] < q["position"] for h in q["heads"])   # backwards
    assert "looking back" in d["summary"]

    html = (out / "report.html").read_text()
    assert 'id="attention"' in html and '"causal": true' in html and NOTE in html


@pytest.fixture
def our_calls(monkeypatch):
    """One entry per call of our attention in a model loaded after this: whether that call
    gave the weights."""
    from multihead.interop import hf
    calls = []
    real = hf.attention_forward

    def spy(*a, **k):
        out = real(*a, **k)
        calls.append(out[1] is not None)                      # our call gave the weights
        return out
    monkeypatch.setattr(hf, "attention_forward", spy)     # load() registers it
    return calls


@pytest.mark.parametrize("kind", ["gpt2", "llama", "mistral"])
def test_weights_are_transformers_eager_weights_from_our_attention(dirs, kind, our_calls):
    model = load(dirs[kind])
    cap = capture(model, TEXT)
    assert our_calls == [True, True]                      # every layer ran our attention
    eager = transformers.AutoModel.from_pretrained(str(dirs[kind]), attn_implementation="eager",
                                                   use_safetensors=True)
    with torch.inference_mode():
        ref = eager(model.tokenize(TEXT).ids[None], output_attentions=True).attentions
    ref = torch.stack([a[0] for a in ref])                # (L, H, S, S)
    assert cap.causal and cap.weights.shape == ref.shape
    torch.testing.assert_close(cap.weights, ref, atol=1e-5, rtol=0)
    assert bool((torch.triu(cap.weights, diagonal=1) == 0).all())
    if kind == "mistral":                                 # nothing beyond the window either
        assert bool((torch.tril(cap.weights, diagonal=-4) == 0).all())
        assert model.attention_note == NOTE + " (sliding window in every layer: only the last 4 tokens)"


def test_inspect_bart_shows_the_encoder_end_to_end(dirs, tmp_path, capsys):
    out = tmp_path / "o"
    assert main(["inspect", TEXT, "--model", str(dirs["bart"]), "--out", str(out),
                 "--format", "json,html", "--metrics"]) == 0
    text = " ".join(capsys.readouterr().out.split())      # rich wraps lines
    assert BART_NOTE in text and "earlier tokens only" not in text and "n/a" not in text

    d = json.loads((out / "inspect.json").read_text())
    assert d["causal"] is False and d["attention"] == BART_NOTE and d["model"] == "bart"
    toks = d["tokens"]
    assert toks[0] == "<s>" and toks[-1] == "</s>" and "animal" in toks
    assert not any("Ġ" in t for t in toks)
    w = unpack_weights(d["weights"])                      # (L, H, S, S): the encoder's
    assert (d["layers"], d["heads"]) == (2, 4)            # not the decoder's 1 layer of 2 heads
    assert bool((torch.triu(w, diagonal=1) > 0).any())    # tokens see later tokens too
    assert d["not_applicable"] == {}                      # <s>/</s> count as [CLS]/[SEP]
    assert all(d["metrics"][m] is not None for m in ("cls", "sep", "next", "prev"))
    assert "looking back" not in d["summary"]
    html = (out / "report.html").read_text()
    assert '"causal": false' in html and BART_NOTE in html


def test_bart_weights_are_eager_encoder_weights_from_our_attention(dirs, our_calls):
    model = load(dirs["bart"])
    cap = capture(model, TEXT)
    assert our_calls == [True, True]          # both encoder layers (the decoder is not run)
    assert not cap.causal and model.attention_note == BART_NOTE
    eager = transformers.AutoModel.from_pretrained(str(dirs["bart"]), attn_implementation="eager",
                                                   use_safetensors=True)
    with torch.inference_mode():   # BartModel makes decoder_input_ids by shifting input_ids
        ref = eager(input_ids=model.tokenize(TEXT).ids[None],
                    output_attentions=True).encoder_attentions
    ref = torch.stack([a[0] for a in ref])                # (L, H, S, S)
    torch.testing.assert_close(cap.weights, ref, atol=1e-5, rtol=0)
    assert bool((torch.triu(cap.weights, diagonal=1) > 0).any())   # bidirectional


def test_headline_looks_back(dirs):
    model = load(dirs["gpt2"])
    cap = capture(model, TEXT)
    toks = cap.tokens
    query = find_query(model, toks, None)
    assert toks[query] == "it"
    looks = strongest_looks(cap.weights, toks, query, top=100, causal=True)
    assert len(looks) == 8 and all(k.target < query for k in looks)   # every head, backwards
    assert headline(looks, query, toks).target < query
    assert toks[find_query(model, toks, "animal")] == "animal"
    # a pronoun with nothing before it is skipped; with no such pronoun, the last word
    first = model.tokenize("He left because it rained.").tokens
    assert first[find_query(model, first, None)] == "it"
    assert find_query(model, ["The", "dog", "."], None) == 2
    # a library caller's error names the word as the caller says (the CLI: its option)
    with pytest.raises(InspectError, match=r"^word 'zebra' \(tokens"):
        find_query(model, toks, "zebra")
    with pytest.raises(InspectError, match=r"^--query-token 'zebra' \(tokens"):
        find_query(model, toks, "zebra", name="--query-token")


def test_a_one_token_text_has_nothing_to_measure(dirs, capsys):
    assert main(["inspect", "it", "--model", str(dirs["gpt2"])]) == 2
    err = " ".join(_one_line_error(capsys).split())
    assert "no head has a role: no query row could be measured" in err


def test_window_layers_normalize_entropy_by_their_window(dirs):
    model = load(dirs["mistral"])
    c = capture(model, TEXT * 2)
    assert c.windows == {0: 4, 1: 4} and capture(load(dirs["llama"]), TEXT).windows == {}
    S = len(c.tokens)
    assert S > 8 and int((c.weights > 0).sum(-1).max()) == 4            # 4 keys at most
    # the same heads as if each row's keys were the whole text: the windowed entropy is the
    # row entropy over log(min(i + 1, 4))
    w = c.weights.double()
    ent = -(w * w.clamp_min(1e-30).log()).sum(-1)[..., 1:]                # (L, H, S - 1)
    seen = torch.arange(2, S + 1).clamp(max=4).double().log()
    m = HeadMetrics.of(c.weights, c.tokens, causal=True, windows=c.windows)
    assert torch.allclose(m.value("entropy"), (ent / seen).mean(-1), atol=1e-6)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_query_words_are_whole_words(dirs, kind, capsys):
    """The shown pieces of "bandit" end with "it" here (b|an|d|it): neither the default
    pronoun nor --query-token it may pick that piece."""
    model = load(dirs[kind])
    text = "The bandit ran because it was late."
    c = capture(model, text)
    inner = c.tokens.index("it")                                    # bandit's last piece
    assert c.tokens[inner - 1] != "␣" and c.words[inner] == c.words[inner - 1]
    real = c.tokens.index("because") + 1
    assert c.tokens[real] == "it" and real > inner
    assert find_query(model, c.tokens, None, c.words) == real
    assert find_query(model, c.tokens, "it", c.words) == real
    ran = find_query(model, c.tokens, "ran", c.words)               # a word of two pieces
    assert "".join(t for t, w in zip(c.tokens, c.words) if w == c.words[ran]) in ("ran", "␣ran")
    assert main(["inspect", text, "--model", str(dirs[kind]), "--top", "3"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert f"Heads attending most from 'it' (token {real}," in out


def test_an_unknown_word_after_letters_is_found_by_its_text(dirs):
    """SentencePiece-style spans start at the word's space: "dog😀" is dog|<unk>."""
    model = load(dirs["llama"])
    c = capture(model, "The dog😀 ran, a cat😀 sat.")
    at = dict(text=c.text, spans=c.spans)
    assert c.tokens[2:4] == ["dog", "<unk>"]
    assert find_query(model, c.tokens, "dog😀", c.words, **at) == 2
    assert c.tokens[find_query(model, c.tokens, "cat😀", c.words, **at)] == "cat"


def test_an_error_shows_a_texts_control_characters_escaped(dirs, capsys):
    """A byte-level tokenizer keeps ESC in its tokens; the error lists them."""
    assert main(["inspect", "The cat \x1b[31mred", "--model", str(dirs["gpt2"]),
                 "--query-token", "zebra"]) == 2
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\\x1b" in err and "is not in the text" in err


def test_first_token_query_says_why_it_looks_nowhere(dirs, capsys):
    assert main(["inspect", "It was tired.", "--model", str(dirs["gpt2"]),
                 "--query-token", "It"]) == 0
    assert "has no word before it" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("kind", ["gpt2", "bart"])
def test_pickled_weights_are_refused_without_unpickling(dirs, kind, tmp_path, monkeypatch, capsys):
    d = _copy(dirs, kind, tmp_path)
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04 not even a real pickle")

    def no_unpickling(*a, **k):
        raise AssertionError("something tried to unpickle")
    monkeypatch.setattr(torch, "load", no_unpickling)
    with pytest.raises(ModelLoadError, match="never loaded"):
        load(d)
    assert main(["inspect", "--model", str(d)]) == 2
    err = _one_line_error(capsys)
    assert "has no model.safetensors or model.safetensors.index.json" in err


def test_unsupported_model_type_names_file_field_and_types(dirs, tmp_path, capsys):
    d = _copy(dirs, "llama", tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "t5"}))
    assert main(["inspect", "--model", str(d)]) == 2
    err = _one_line_error(capsys)
    assert str(d / "config.json") in err and "model_type is 't5'" in err
    assert "'bert'" in err and "'gpt2', 'llama', 'mistral', 'qwen2'" in err
    assert "encoder-decoder 'bart'" in err


def test_missing_transformers_says_how_to_install(dirs, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "transformers", None)     # `import transformers` fails
    with pytest.raises(ModelLoadError, match=r"pip install 'multihead\[hf\]'"):
        load(dirs["llama"])
    assert main(["inspect", "--model", str(dirs["gpt2"])]) == 2
    assert "pip install 'multihead[hf]'" in _one_line_error(capsys)


def test_checkpoint_of_another_model_is_refused(tmp_path):
    d = tiny_checkpoint(tmp_path / "bert")                     # BERT tensors, called GPT-2
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match=r"config\.json describes a gpt2 network of .*"
                                             r"is model_type right"):
        load(d)


def test_a_renamed_tensor_is_named_as_missing(dirs, tmp_path):
    d = _copy(dirs, "llama", tmp_path)
    rewrite_weights(d, lambda w: w.update({"model.nrm.weight": w.pop("model.norm.weight")}))
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: 1 missing tensor\(s\) .*"
                                             r"'norm\.weight'.*is model_type right"):
        load(d)


@pytest.mark.parametrize("kind,field", [("gpt2", "n_layer"), ("llama", "num_hidden_layers")])
def test_fewer_layers_than_the_checkpoint_are_refused(dirs, kind, field, tmp_path):
    d = _copy(dirs, kind, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, field: 1}))       # the file holds 2
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: \d+ tensor\(s\) of layers "
                       r"that config\.json's .* has not, e\.g\. .*1\..*layer count right"):
        load(d)


@pytest.mark.parametrize("kind,field,value,tensor,held,want", [
    ("gpt2", "n_positions", 32, "wpe.weight", (64, 32), (32, 32)),
    ("gpt2", "n_positions", 128, "wpe.weight", (64, 32), (128, 32)),     # a larger network
    ("llama", "head_dim", 4, "layers.0.self_attn.q_proj.weight", (32, 32), (16, 32)),
    ("llama", "num_key_value_heads", 4, "layers.0.self_attn.k_proj.weight", (16, 32), (32, 32)),
    ("bart", "encoder_ffn_dim", 32, "encoder.layers.0.fc1.weight", (64, 32), (32, 32))])
def test_a_size_config_json_disagrees_on_is_named_with_the_tensor_and_both_shapes(
        dirs, tmp_path, kind, field, value, tensor, held, want):
    """transformers' own message points at a load report that is not shown; ours names the
    tensor (as the file names it), the checkpoint's shape and the shape config.json makes."""
    d = _copy(dirs, kind, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, field: value}))
    shapes = (re.escape(f" is {held} there, but ") + ".*"
              + re.escape(f"config.json's sizes make it {want}: config.json"))
    with pytest.raises(ModelLoadError, match=rf"model\.safetensors: tensor '(\w+\.)?{tensor}'"
                       + shapes + " does not describe this checkpoint"):
        load(d)


@pytest.mark.parametrize("kind,wrong", [("gpt2", "llama"), ("bart", "gpt2")])
def test_a_config_describing_a_larger_network_is_refused_before_building_it(
        dirs, kind, wrong, tmp_path):
    """GPT-2's config.json read as a Llama's takes Llama's defaults: 32 layers and 6.5 billion
    parameters, which transformers would build (and fill at random) before finding the
    tensors missing. The layer count, read from the checkpoint's header, refuses it first."""
    d = _copy(dirs, kind, tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "model_type": wrong}))
    refused_cheaply(lambda: load(d), r"config\.json: (num_hidden_layers|n_layer) is (32|12), "
                    r"but .*model\.safetensors holds the tensors of 2 layer\(s\): .*is "
                    r"model_type right", 64 * 2**20)


def test_a_sharded_checkpoint_is_counted_over_its_shards(dirs, tmp_path):
    from safetensors.torch import load_file, save_file
    d = _copy(dirs, "llama", tmp_path)
    w = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    names = sorted(w)
    half = {"a.safetensors": names[:len(names) // 2], "b.safetensors": names[len(names) // 2:]}
    for f, part in half.items():
        save_file({n: w[n] for n in part}, str(d / f), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, part in half.items() for n in part}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    ours = load(d).attention_weights(torch.tensor([[1, 5, 9]])).weights
    assert len(ours) == 2
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 3}))
    assert not any(".layers.1." in n for n in half["a.safetensors"])    # (layer 1: b's only)
    with pytest.raises(ModelLoadError, match=r"index\.json holds the tensors of 2 layer\(s\)"):
        load(d)                                  # (layers 0 and 1 are in different shards)
    (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 128}))
    with pytest.raises(ModelLoadError, match=r"[ab]\.safetensors: tensor 'model\.layers\.0\."
                                             r"mlp\.\w+_proj\.weight' is \((64, 32|32, 64)\) "
                                             r"there"):
        load(d)                                  # shapes are read from every shard, named


def test_nan_weights_are_refused(dirs, tmp_path):
    d = _copy(dirs, "llama", tmp_path)
    rewrite_weights(d, lambda w: w["model.layers.1.self_attn.k_proj.weight"].__setitem__(
        (0, 0), float("nan")))
    with pytest.raises(ModelLoadError, match=r"layers\.1\.self_attn\.k_proj\.weight holds 1 non-finite "
                       r"value\(s\), e\.g\. nan at index \(0, 0\)"):
        load(d)


def test_report_in_a_browser_says_causal_and_na(dirs, tmp_path):
    playwright = pytest.importorskip("playwright.sync_api")
    browser_path = chromium()
    assert main(["inspect", TEXT, "--model", str(dirs["gpt2"]), "--out", str(tmp_path),
                 "--format", "html"]) == 0
    with playwright.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=browser_path, args=["--no-sandbox"])
        try:
            page = browser.new_page()
            errors = []
            page.on("pageerror", lambda e: errors.append(str(e)))
            page.goto((tmp_path / "report.html").as_uri())
            page.wait_for_selector(".cell")
            assert page.inner_text("#attention") == NOTE
            rows = dict(zip(page.locator("#head-metrics th").all_inner_texts(),
                            page.locator("#head-metrics td").all_inner_texts()))
            assert rows["next"] == "n/a" and rows["cls"] == "n/a" and rows["prev"] != "n/a"
            assert errors == []
        finally:
            browser.close()


@pytest.mark.parametrize("kind", ["gpt2", "llama", "bart"])
def test_attention_weights_refuse_ids_the_network_would_fail_on(dirs, kind):
    """Out of the vocabulary, negative, past the positions, empty (GPT-2 tokenizes "" to no
    token) or 1-D: a ValueError naming input_ids, never an IndexError or reshape error from
    inside transformers, nor hidden states of the wrong shape."""
    m = load(dirs[kind])
    vocab, positions = m.config.vocab_size, m.config.max_position_embeddings
    for ids, message in [(torch.tensor([[1, vocab]]), rf"input_ids must lie in \[0, {vocab}\)"),
                         (torch.tensor([[-1, 2]]), r"got values in \[-1, 2\]"),
                         (torch.ones(1, positions + 1, dtype=torch.long),
                          f"has {positions + 1} tokens but the model has {positions} positions"),
                         (torch.ones(1, 0, dtype=torch.long), r"input_ids has no tokens \(shape \(1, 0\)\)"),
                         (torch.ones(3, dtype=torch.long), r"input_ids must be \(1, S\), got shape \(3,\)"),
                         (torch.ones(1, 3), "input_ids must be an integer tensor")]:
        with pytest.raises((ValueError, TypeError), match=message):
            m.attention_weights(ids)


@pytest.mark.parametrize("kind", ["gpt2", "bart"])
def test_attention_weights_are_evaluated_in_eval_mode_whatever_the_network_is_in(dirs, kind):
    m = load(dirs[kind])
    ids = m.tokenize(TEXT).ids[None]
    want = m.attention_weights(ids)
    m.network.train()
    for _ in range(2):                       # dropout would differ from call to call
        got = m.attention_weights(ids)
        torch.testing.assert_close(got.hidden, want.hidden, rtol=0, atol=0)
        assert all(torch.equal(a, b) for a, b in zip(got.weights, want.weights))
    assert m.network.training                # the caller's mode is left as it was


def test_byte_pieces_are_named_by_their_characters(dirs, tmp_path, capsys):
    """A byte-level tokenizer cuts a character its vocabulary lacks into byte pieces, which
    decode alone to U+FFFD: every such token showed as '\ufffd' (all alike, in the terminal,
    the page and the figures) and a CJK query word was never found. Each is named by its
    character, numbered where several share it; the query word is found by those names;
    inside a longer word, the error says which."""
    model = load(dirs["gpt2"])
    toks = model.tokenize("我 爱 北京 and it").tokens
    assert toks[:3] == ["我(1/3)", "我(2/3)", "我(3/3)"] and toks[4] == "爱(1/3)"
    assert not any("\ufffd" in t for t in toks)
    assert main(["inspect", "我 爱 北京 and it", "--model", str(dirs["gpt2"]), "--query-token",
                 "北京", "--out", str(tmp_path), "--format", "json"]) == 0
    d = json.loads((tmp_path / "inspect.json").read_text())
    assert d["query"]["token"] == "北(1/3)" and d["tokens"][d["query"]["position"] + 3] == "京(1/3)"
    capsys.readouterr()
    assert main(["inspect", "我爱北京 and it", "--model", str(dirs["gpt2"]),
                 "--query-token", "北京"]) == 2
    assert "'北京' is only part of '我爱北京' in the text" in _one_line_error(capsys)


def test_control_characters_of_tokens_are_drawn_escaped(dirs, tmp_path, capsys):
    """A byte-level tokenizer keeps control characters as tokens: the SVG held them raw (not
    XML: browsers refused to draw it) and matplotlib's warning about their glyphs printed
    them raw to the terminal. The figures draw them as the terminal shows them (``\\x01``)."""
    import warnings
    import xml.etree.ElementTree as ET
    with warnings.catch_warnings():
        warnings.simplefilter("error")                 # (no glyph warning either)
        assert main(["inspect", "it a\x01b\x0bc\x0cd", "--model", str(dirs["gpt2"]),
                     "--out", str(tmp_path), "--format", "svg"]) == 0
    head = next(tmp_path.glob("head_*.svg"))
    for svg in (tmp_path / "heads.svg", head):
        ET.parse(svg)                                  # well-formed XML
        assert "\x01" not in svg.read_text(encoding="utf-8")
    assert "\\x01" in head.read_text(encoding="utf-8")      # (the label's text, in a comment)
    assert "\x01" not in capsys.readouterr().err

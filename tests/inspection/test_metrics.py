"""Head metrics on hand-built attention matrices with known answers."""

from __future__ import annotations

import math
import re

import pytest
import torch

from multihead.inspect.capture import capture, find_query, headline, strongest_looks, Look
from multihead.inspect.metrics import HeadMetrics, is_punct

TOKS = ["[CLS]", "the", "cat", ",", "it", "sat", ".", "[SEP]"]
S = len(TOKS)


def _heads(*rows_fns):
    """(1, len(fns), S, S) weights; each fn maps a query i to a distribution over keys."""
    w = torch.zeros(1, len(rows_fns), S, S)
    for h, fn in enumerate(rows_fns):
        for i in range(S):
            w[0, h, i] = torch.as_tensor(fn(i), dtype=torch.float32)
    return w


def onehot(j):
    v = torch.zeros(S)
    v[j] = 1
    return v


def test_known_answers():
    w = _heads(lambda i: onehot(max(i - 1, 0)),          # previous token
               lambda i: onehot(min(i + 1, S - 1)),      # next token
               lambda i: onehot(i),                      # self
               lambda i: onehot(0),                      # [CLS]
               lambda i: onehot(S - 1),                  # [SEP]
               lambda i: (onehot(3) + onehot(6)) / 2,    # punctuation
               lambda i: torch.full((S,), 1 / S))        # uniform
    m = HeadMetrics.of(w, TOKS)
    t = m.table()
    assert t["prev"][0].tolist()[0] == 1.0 and t["next"][0].tolist()[1] == 1.0
    assert t["self"][0, 2] == 1.0 and t["cls"][0, 3] == 1.0 and t["sep"][0, 4] == 1.0
    assert t["punct"][0, 5] == 1.0
    assert t["entropy"][0, 6] == pytest.approx(1.0) and t["confidence"][0, 6] == pytest.approx(1 / S)
    assert t["entropy"][0, 0] == pytest.approx(0.0, abs=1e-9)
    assert t["entropy"][0, 5] == pytest.approx(math.log(2) / math.log(S))
    assert t["prev"][0, 6] == pytest.approx(1 / S)       # uniform: 1/S on every neighbour
    roles = [r for r, _ in m.roles()[0]]
    assert roles == ["previous token", "next token", "self", "[CLS]", "[SEP]", "punctuation", "broad"]


def test_averaging_over_texts_weights_rows():
    a = _heads(lambda i: onehot(max(i - 1, 0)))          # prev = 1 on 7 rows
    b = _heads(lambda i: onehot(i))                      # prev = 0 on 7 rows
    m = HeadMetrics()
    m.add(a, TOKS)
    m.add(b, TOKS)
    assert m.texts == 2 and m.value("prev")[0, 0] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="unknown metric"):
        m.value("nope")
    with pytest.raises(ValueError, match=r"\(L, H, S, S\)"):
        m.add(torch.zeros(2, S, S), TOKS)


def test_punctuation_and_looks():
    assert [is_punct(t) for t in TOKS] == [False, False, False, True, False, False, True, False]
    w = _heads(lambda i: onehot(max(i - 1, 0)), lambda i: onehot(2) * 0.6 + onehot(0) * 0.4)
    looks = strongest_looks(w, TOKS, 4)                   # from "it"
    assert [(k.head, TOKS[k.target], round(k.weight, 2)) for k in looks] == [
        (0, ",", 1.0), (1, "cat", 0.6)]
    assert headline(looks, 4, TOKS).head == 1             # a pronoun looks back beyond neighbours
    assert headline([Look(0, 0, 5, 0.9)], 4, TOKS).target == 5


def test_find_query(minilm_tokens):
    model, toks = minilm_tokens
    assert toks[find_query(model, toks, None)] == "it"
    assert find_query(model, toks, "street") == toks.index("street")
    with pytest.raises(ValueError, match="not in the text; its tokens are: the animal"):
        find_query(model, toks, "zebra")
    words = model.tokenize("The animal didn't cross the street because it was too tired.").words
    assert words[3:6] == [2, 3, 4]                  # (didn|'|t: the tokenizer's three words)
    assert find_query(model, toks, "didn't", words) == 3
    assert find_query(model, toks, "t", words) == 5         # (without the text: a word id)
    with pytest.raises(TypeError, match="word must be a str .*got int 5"):
        find_query(model, toks, 5)
    with pytest.raises(TypeError, match=re.escape("text must be a str, got bytes b'It rains.': "
                                                  "decode it first")):
        capture(model, b"It rains.")
    with pytest.raises(ValueError, match=re.escape("'didn' (tokens ['didn']) is not in the text")):
        find_query(model, ["didn", "t"], "didn", [0, 0])          # (a piece of a longer word)


def _query_start(model, text: str, word) -> int:
    """Where in ``text`` the query ``word`` (None: the default) starts."""
    c = capture(model, text)
    return c.spans[find_query(model, c.tokens, word, c.words, text=c.text, spans=c.spans)][0]


@pytest.mark.parametrize("word,part_of", [("t", "can't"), ("s", "it's"), ("ll", "we’ll")])
def test_an_english_ending_after_an_apostrophe_is_not_a_query(word, part_of, capsys):
    """MiniLM splits "can't" into three words (can|'|t); its ending "t" is not the query
    "t" (the README's promise), while the same letters standing alone are."""
    from multihead.cli.main import main
    from multihead.models import load
    model = load()
    text = "I can't say it's so, we’ll see"
    with pytest.raises(ValueError, match=re.escape(f"{word!r} is only part of {part_of!r}")):
        _query_start(model, text, word)
    assert _query_start(model, f"{text}, {word} alone", word) == len(text) + 2
    assert _query_start(model, text, part_of) == text.index(part_of)
    assert main(["inspect", text, "--query-token", word]) == 2
    assert f"is only part of {part_of!r} in the text: pass the whole word" in \
        " ".join(capsys.readouterr().err.split())
    long = f"{text} " + "more words " * 300                       # cut to 512 positions
    assert main(["inspect", long, "--query-token", word]) == 2
    said = " ".join(capsys.readouterr().err.split()).split("error:")[-1]
    assert said.endswith("pass the whole word") and "cut" not in said    # (not a cut's fault)


def test_the_word_before_an_apostrophe_and_an_elided_word_are_queries():
    """"it" of "it's" is the pronoun (the default query), "dog" of "dog's" a word, and in
    an elision the word is after the apostrophe ("école" of "l'école")."""
    from multihead.models import load
    model = load()
    text = "The dog's owner said it's l'école"
    assert _query_start(model, text, None) == text.index("it's")
    assert _query_start(model, text, "dog") == text.index("dog")
    assert _query_start(model, text, "école") == text.index("école")


def test_a_word_the_vocabulary_lacks_matches_only_its_own_text():
    """🚀 and 😀 are both [UNK] to MiniLM: the query finds the one the text has there."""
    from multihead.models import load
    model = load()
    c = capture(model, "🚀 launched and then 😀 smiled")
    assert c.tokens.count("[UNK]") == 2
    at = dict(text=c.text, spans=c.spans)
    assert find_query(model, c.tokens, "😀", c.words, **at) == 5
    assert find_query(model, c.tokens, "🚀", c.words, **at) == 1
    with pytest.raises(ValueError, match=re.escape("'🐱' (tokens ['[UNK]']) is not in the text")):
        find_query(model, c.tokens, "🐱", c.words, **at)
    with pytest.raises(ValueError, match="is not in the text"):          # (no text to tell by)
        find_query(model, c.tokens, "😀", c.words)


def test_a_word_inside_an_unknown_token_says_what_the_token_stands_for():
    """😀🚀 written together are one [UNK]: asking for 😀 said it "is not in the text"."""
    from multihead.models import load
    model = load()
    c = capture(model, "I like it 😀🚀 so much.")
    at = dict(text=c.text, spans=c.spans)
    with pytest.raises(ValueError, match=re.escape("word '😀' is only part of '😀🚀', which the "
                                                   "tokenizer reads as one unknown token ([UNK]): "
                                                   "pass '😀🚀', or put spaces around '😀'")):
        find_query(model, c.tokens, "😀", c.words, **at)
    assert find_query(model, c.tokens, "😀🚀", c.words, **at) == c.tokens.index("[UNK]")
    spaced = capture(model, "I like it 😀 🚀 so much.")                   # what it advises
    assert find_query(model, spaced.tokens, "😀", spaced.words, text=spaced.text,
                      spans=spaced.spans) == 4


@pytest.fixture(scope="module")
def minilm_tokens():
    from multihead.models import load
    model = load()
    return model, model.tokenize("The animal didn't cross the street because it was too tired.").tokens


def test_causal_known_answers():
    """A decoder's rows see keys 0..i: uniform over them is entropy 1; row 0 (itself only) is
    not counted; `next` is n/a rather than 0, and so is `cls`/`sep` without such tokens."""
    toks = ["The", "cat", ",", "it", "sat", "."]
    n = len(toks)
    causal = torch.tril(torch.ones(n, n))
    prev = torch.zeros(n, n)
    prev[0, 0] = 1                                                  # row 0 can only see itself
    prev[torch.arange(1, n), torch.arange(n - 1)] = 1
    w = torch.stack([causal / causal.sum(-1, keepdim=True),          # uniform over the past
                     prev, torch.eye(n)])[None]                     # (1, 3, n, n)
    assert torch.allclose(w.sum(-1), torch.ones(1, 3, n))
    m = HeadMetrics.of(w, toks, causal=True)
    t = m.table()
    assert t["entropy"][0, 0] == pytest.approx(1.0)                 # not log(i + 1) / log(n)
    assert t["confidence"][0, 2] == 1.0 and t["self"][0, 2] == 1.0
    assert t["prev"][0, 1] == 1.0 and t["self"][0, 1] == 0.0        # row 0 is not counted
    assert set(m.not_applicable()) == {"next", "cls", "sep"}
    assert [r for r, _ in m.roles()[0]] == ["broad", "previous token", "self"]
    looks = strongest_looks(w, toks, 3, causal=True)                # from "it": earlier only
    assert all(k.target < 3 for k in looks)
    assert strongest_looks(w, toks, 0, causal=True) == []           # the first token: nothing
    enc = HeadMetrics.of(w, ["[CLS]", *toks[1:-1], "[SEP]"])
    assert enc.not_applicable() == {}                               # an encoder's: all measured


def test_sliding_window_rows_are_normalized_by_the_keys_they_see():
    """Uniform over the last W tokens is entropy 1 in a layer with a window of W (as over
    every earlier token without one); layers without a window keep log(i + 1)."""
    n, W = 10, 3
    band = torch.tril(torch.ones(n, n)) - torch.tril(torch.ones(n, n), -W)      # last W keys
    uniform = (band / band.sum(-1, keepdim=True))[None, None].expand(2, 1, n, n)  # (2, 1, n, n)
    toks = [f"t{i}" for i in range(n)]
    m = HeadMetrics.of(uniform, toks, causal=True, windows={1: W})
    assert m.value("entropy")[1, 0].item() == pytest.approx(1.0)
    expected = sum(math.log(min(i + 1, W)) / math.log(i + 1) for i in range(1, n)) / (n - 1)
    assert m.value("entropy")[0, 0].item() == pytest.approx(expected)         # no window there
    assert m.roles()[1][0][0] == "broad"
    with pytest.raises(ValueError, match="windows: a sliding window is a decoder's"):
        HeadMetrics.of(uniform, toks, windows={1: W})


def test_unicode_punctuation_counts():
    assert [is_punct(t) for t in ["“", "”", "—", "…", "「", "」", "。", "¿", "¡", "«", "ok", "€"]] == [
        True] * 10 + [False, False]


def test_no_row_to_measure_has_no_roles():
    m = HeadMetrics.of(torch.ones(2, 3, 1, 1), ["it"], causal=True)   # a decoder's one token
    with pytest.raises(ValueError, match="no head has a role: no query row could be measured"):
        m.roles()


def test_every_threshold_shows_as_reached_exactly_when_it_is():
    """float32 metrics: a threshold's own float32 value shows as the threshold, and the
    largest float32 below it shows below it (FLOAT32_SLACK fits between the two)."""
    import numpy as np
    from multihead.inspect.metrics import BROAD, FOCUSED, ROLE_RULES, round_down
    for t in {BROAD, FOCUSED, *(rule[2] for rule in ROLE_RULES)}:
        at = np.float32(t)
        below = np.nextafter(at, np.float32(0))
        assert round_down(float(at)) == t and round_down(float(below)) < t
        pair = torch.tensor([at, below])
        assert round_down(pair).tolist() == [t, round_down(float(below))]


def test_a_float64_mean_a_hair_below_a_threshold_takes_the_role_it_shows():
    """Metrics are float64 means of float32 weights: rows putting 0.5, 0.5 and 0.49999997
    on the previous token average to 0.49999999, shown as 0.50 (within FLOAT32_SLACK), but
    the role rule compared the raw mean and called the head broad. Roles now compare the
    value as shown, so what a head shows and the role it gets agree."""
    from multihead.inspect.metrics import round_down
    w = torch.zeros(1, 1, 4, 4)
    w[0, 0, 0] = 0.25
    for i, p in zip((1, 2, 3), (0.5, 0.5, 0.49999997)):
        w[0, 0, i] = (1 - p) / 2
        w[0, 0, i, i], w[0, 0, i, i - 1] = 0.0, p
    m = HeadMetrics.of(w, ["a", "b", "c", "d"])
    prev = float(m.value("prev")[0, 0])
    assert 0.5 - 3e-8 < prev < 0.5 and round_down(prev) == 0.5
    assert m.roles()[0][0][0] == "previous token"
    w[0, 0, 3, 2] = 0.4999                                 # shown 0.49: still no role
    w[0, 0, 3, 0] += 0.0001
    assert round_down(float(HeadMetrics.of(w, ["a", "b", "c", "d"]).value("prev")[0, 0])) == 0.49
    assert HeadMetrics.of(w, ["a", "b", "c", "d"]).roles()[0][0][0] != "previous token"

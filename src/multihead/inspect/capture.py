"""Capture every head's attention weights for a text, and find where a query token looks.

Any model that answers :class:`Inspectable` can be inspected: a BERT-family encoder
(:class:`multihead.models.Pretrained`), a causal decoder (:class:`multihead.models.Decoder`)
or an encoder-decoder (:class:`multihead.models.EncoderDecoder`: its encoder's attention,
bidirectional). A decoder looks only backwards: its query token's looks are to earlier
tokens only.

Notation used for tensor shapes: L layers, H heads, S tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from .._device import available_memory
from ..analysis.params import human_bytes
from .metrics import all_finite, is_special, shown

#: the tokens tokenizers write for text their vocabulary lacks (any such text); a model's
#: tokenizer may name its own
UNKNOWN = {"[UNK]", "<unk>", "<|unk|>"}
PRONOUNS = ("it", "he", "she", "they", "him", "her", "them", "its", "his", "their", "this",
            "that", "who", "which", "we", "you", "i")


class InspectError(ValueError):
    """A user's input the inspector cannot use; the message says why and what to do."""


class PartOfWordError(InspectError):
    """A query that the text holds only as the ending of a longer word ("t" of "can't")."""


class NonFiniteError(InspectError):
    """The model produced NaN or infinite values: its weights are probably corrupt."""


class Inspectable(Protocol):
    """What :func:`capture` and :func:`find_query` ask of a model.

    Attributes:
        name, directory: where it came from (named in errors).
        config: has ``max_position_embeddings``.
        causal: True for a decoder (each token sees only itself and earlier tokens).
        attention_note: one line saying so, for reports.
    """

    name: str
    causal: bool
    attention_note: str

    def tokenize(self, text: str):
        """A :class:`multihead.models.Tokens`: ids (S,), shown tokens, truncated, original_length."""

    def query_pieces(self, word: str) -> list[list[str]]:
        """The ways ``word`` appears among the shown tokens."""

    def attention_weights(self, ids: torch.Tensor):
        """``.hidden`` (1, S, E) and ``.weights``: one (1, H, S, S) per layer, for ids (1, S)."""


@dataclass
class Capture:
    """A text's tokens and all attention weights ``(L, H, S, S)`` (float32, rows sum to 1);
    ``causal``: a decoder's (every weight above the diagonal is 0)."""

    text: str
    tokens: list[str]
    weights: torch.Tensor
    truncated: bool
    original_length: int
    causal: bool = False
    #: a decoder's layers with a sliding window, ``{layer: W}``: a token sees its last W
    windows: dict = field(default_factory=dict)
    #: each token's word (pieces of one word share it; None: a special token), if known
    words: list | None = None
    #: each token's characters in ``text``, ``(start, end)`` (a special token's: (0, 0)), if known
    spans: list | None = None


@torch.inference_mode()
def capture(model: Inspectable, text: str, *, truncate: bool = True) -> Capture:
    """Run ``model`` (an encoder or a decoder: :class:`Inspectable`) on ``text`` and keep the
    weights.

    Example:
        >>> from multihead.models import load
        >>> c = capture(load(), "It rains.")
        >>> c.tokens, tuple(c.weights.shape)
        (['[CLS]', 'it', 'rains', '.', '[SEP]'], (6, 12, 5, 5))
    """
    if not isinstance(text, str):
        fix = ("decode it first: text.decode('utf-8')" if isinstance(text, (bytes, bytearray))
               else "pass the text to inspect")
        raise TypeError(f"text must be a str, got {type(text).__name__} {text!r:.60}: {fix}")
    if not text.strip():
        raise InspectError("the text is empty: give some words to inspect")
    check_utf8(text, "the text")
    limit = model.config.max_position_embeddings
    tok = model.tokenize(text)
    if tok.truncated and not truncate:
        raise InspectError(f"the text has {tok.original_length} tokens but the model has {limit} "
                           f"positions: shorten it, or drop --no-truncate to keep the first {limit}")
    if all(is_special(t) for t in tok.tokens):
        added = len(tok.tokens) - len(model.tokenize("x").tokens) + 1   # (markers it wrote)
        why = ("it is only marker tokens, which the tokenizer reads as markers" if added > 0
               else "it holds nothing the tokenizer keeps (invisible or control characters?)")
        raise InspectError(f"the text {text[:40]!r} has no token but the model's markers "
                           f"({' '.join(tok.tokens) or 'none'}): {why}; give some words")
    _check_memory(model, len(tok.ids))
    out = model.attention_weights(tok.ids[None])
    w = _gather(out.weights)                                                  # (L, H, S, S)
    check_finite(w, out.hidden, tok.tokens, getattr(model, "directory", None))
    return Capture(text, tok.tokens, w, tok.truncated, tok.original_length,
                   bool(getattr(model, "causal", False)), dict(getattr(model, "windows", {})),
                   getattr(tok, "words", None), getattr(tok, "spans", None))


def _check_memory(model: Inspectable, S: int) -> None:
    """Refuse a text whose attention weights would not fit: every layer's ``(H, S, S)``,
    kept in float32 on the CPU (and first on the model's device, in its dtype)."""
    c = model.config
    need = c.num_hidden_layers * c.num_attention_heads * S * S * 4
    device = getattr(model, "device", None)
    where = [torch.device("cpu")] + ([device] if getattr(device, "type", None) == "cuda" else [])
    for d in where:
        free = available_memory(d)
        if need > free:
            raise InspectError(
                f"the text's {S} tokens need {human_bytes(need)} for every head's attention "
                f"weights ({c.num_hidden_layers} layers x {c.num_attention_heads} heads x "
                f"{S}² x 4 bytes), more than the {human_bytes(free)} free on {d}: shorten the "
                f"text (the weights grow with its length squared)")


def _gather(weights: list) -> torch.Tensor:
    """Every layer's ``(1, H, S, S)`` weights as one float32 CPU tensor ``(L, H, S, S)``,
    each layer's own tensor let go once copied (peak: about one copy, not two)."""
    first = weights[0]
    out = torch.empty((len(weights), *first.shape[1:]), dtype=torch.float32)   # (L, H, S, S)
    for l in range(len(weights)):
        out[l] = weights[l][0]
        weights[l] = None
    return out


def check_utf8(text: str, what: str) -> None:
    """Refuse text that cannot be UTF-8: lone surrogates, which is how Python keeps the
    undecodable bytes of a command-line argument (``surrogateescape``).

    Example:
        >>> check_utf8("caf\\udce9", "TEXT")
        Traceback (most recent call last):
        ...
        multihead.inspect.capture.InspectError: TEXT is not valid UTF-8 (character 4 is the undecodable byte 0xe9): pass UTF-8 text, e.g. convert the terminal or file with iconv -f latin1 -t utf-8
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = text[e.start]
        what_is = (f"the undecodable byte 0x{ord(ch) - 0xDC00:02x}" if 0xDC80 <= ord(ch) <= 0xDCFF
                   else f"the lone surrogate U+{ord(ch):04X}")
        raise InspectError(f"{what} is not valid UTF-8 (character {e.start + 1} is {what_is}): "
                           f"pass UTF-8 text, e.g. convert the terminal or file with "
                           f"iconv -f latin1 -t utf-8") from None


def check_finite(weights: torch.Tensor, hidden: torch.Tensor | None, tokens: list[str],
                 source=None) -> None:
    """Raise :class:`NonFiniteError` if the attention weights ``(L, H, S, S)`` or the
    encoder's output hold NaN or infinity, naming the first layer, its heads and a query token.

    Example:
        >>> w = torch.full((2, 3, 2, 2), 0.5); w[1, 2, 0, 1] = float("nan")
        >>> check_finite(w, None, ["[CLS]", "[SEP]"])
        Traceback (most recent call last):
        ...
        multihead.inspect.capture.NonFiniteError: layer 1 produced non-finite attention weights (NaN or inf) in head 2 (L1H2, first at query token 0 '[CLS]'): the model's weights are probably corrupt (NaN/inf in a tensor of layer 1 or before) or overflow in this dtype; check or re-export the checkpoint
    """
    where = f" in {source}" if source is not None else ""
    advice = f"check or re-export the checkpoint{where}"
    if not all_finite(weights):
        bad = ~torch.isfinite(weights)                                          # (L, H, S, S)
        per_head = bad.flatten(2).any(-1)                                       # (L, H)
        layer = int(per_head.any(-1).nonzero()[0])
        heads = per_head[layer].nonzero().flatten().tolist()
        row = int(bad[layer, heads[0]].any(-1).nonzero()[0])
        named = f"head {heads[0]}" if len(heads) == 1 else f"{len(heads)} heads ({_ranges(heads)})"
        raise NonFiniteError(
            f"layer {layer} produced non-finite attention weights (NaN or inf) in {named} "
            f"(L{layer}H{heads[0]}, first at query token {row} {tokens[row]!r}): the model's "
            f"weights are probably corrupt (NaN/inf in a tensor of layer {layer} or before) or "
            f"overflow in this dtype; {advice}")
    if hidden is not None and not all_finite(hidden):
        last = weights.shape[0] - 1
        raise NonFiniteError(
            f"the encoder's output (after layer {last}) holds non-finite values (NaN or inf) "
            f"although every attention weight is finite: the model's weights are probably corrupt "
            f"(NaN/inf in layer {last}'s value, output or feed-forward tensors) or overflow in "
            f"this dtype; {advice}")


def _ranges(xs: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    out, start = [], xs[0]
    for a, b in zip(xs, xs[1:] + [None]):
        if b != a + 1:
            out.append(f"{start}" if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)


def find_query(model: Inspectable, tokens: list[str], word: str | None,
               words: list | None = None, *, text: str | None = None,
               spans: list | None = None, name: str = "word") -> int:
    """Position of ``word``'s first word piece in ``tokens`` (default: the first pronoun).

    For a decoder the default is the first pronoun with a word before it (a decoder's token
    sees only earlier tokens), else the last word, which sees the whole text. With the
    tokens' ``words`` (the tokenizer's word ids), only whole words match: "it" is not the
    last piece of "bandit" (b|an|d|it), which a byte-level tokenizer's shown pieces cannot
    tell apart; a word the tokenizer splits at its punctuation ("didn't": didn|'|t) is
    still one, and with the ``text`` and the tokens' ``spans`` (their characters in it) the
    English ending after its apostrophe is not a word of its own: "t" is not in "didn't",
    nor "s" in "it's" (while "it" is, and "dog" in "dog's", and "école" in "l'école"). A
    word the vocabulary lacks becomes an unknown token ([UNK]), which stands for
    any such word: it matches only where the ``text`` under the token's ``spans`` is the
    word itself (without them, nowhere). An error names the word as ``name`` (the command
    line passes its option, ``"--query-token"``).

    Example:
        >>> from multihead.models import load
        >>> model = load()
        >>> toks = model.tokenize("The dog barked because it was hungry.").tokens
        >>> toks[find_query(model, toks, None)], find_query(model, toks, "dog")
        ('it', 2)
        >>> find_query(model, ["b", "it", "it"], "it", words=[0, 0, 1])    # a whole word
        2
        >>> c = capture(model, "I can't say it")
        >>> find_query(model, c.tokens, "t", c.words, text=c.text, spans=c.spans)
        Traceback (most recent call last):
        ...
        multihead.inspect.capture.PartOfWordError: word 't' is only part of "can't" in the text: pass the whole word
        >>> c = capture(model, "A 🚀 and a 😀.")
        >>> find_query(model, c.tokens, "😀", c.words, text=c.text, spans=c.spans)
        5
    """
    if word is not None and not isinstance(word, str):
        raise TypeError(f"{name} must be a str (or None: the first pronoun), got "
                        f"{type(word).__name__} {word!r}")
    if word is not None and len(word.split()) > 1:      # (its first token's row was used)
        raise InspectError(f"{name} {word!r} is {len(word.split())} words: pass one "
                           f"word of the text; the query is one token's row")
    joined = _joined_pieces(text, spans, len(tokens))
    by_words = _whole_words(tokens, words)

    def whole(i: int, n: int) -> bool:
        return by_words(i, n) and joined(i, n) is None

    content = [(i, t) for i, t in enumerate(tokens) if not is_special(t)]
    causal = bool(getattr(model, "causal", False))
    if word is None:
        for n, (i, t) in enumerate(content):
            if t.lower() in PRONOUNS and (n > 0 or not causal) and whole(i, 1):
                return i
        if not content:
            return 0
        return content[-1][0] if causal else content[0][0]
    found = model.query_pieces(word)
    if not found or not any(found):
        raise InspectError(f"{name} {word!r} has no tokens: pass a word from the text")
    unknown = UNKNOWN | {_unknown_token(model)}

    def under(i: int, n: int) -> str | None:           # the text an unknown token stands for
        if text is None or spans is None or len(spans) != len(tokens):
            return None                                # (a span may start at its space)
        return text[spans[i][0]:spans[i + n - 1][1]].strip()

    wanted = word.strip().casefold()
    part_of = unknown_of = inside = None
    for i in range(len(tokens)):
        for pieces in found:
            n = len(pieces)
            if tokens[i:i + n] != pieces or _added(tokens, spans, i, n):
                continue
            if not by_words(i, n):                     # ("it" of "bandit")
                inside = inside or _word_at(text, spans, words, i)
                continue
            if any(p in unknown for p in pieces):      # (it stands for any word it lacks)
                seen = under(i, n)
                if seen is None or seen.casefold() != wanted:
                    if seen and wanted in seen.casefold():
                        unknown_of = unknown_of or seen
                    continue
            part_of = joined(i, n)
            if part_of is None:
                return i
    if part_of is None and unknown_of is None:
        part_of = inside                               # (a piece of a word, named last)
    if part_of is not None:
        raise PartOfWordError(f"{name} {word!r} is only part of {part_of!r} in the "
                              f"text: pass the whole word")
    if unknown_of is not None:
        raise PartOfWordError(f"{name} {word!r} is only part of {unknown_of!r}, which the "
                              f"tokenizer reads as one unknown token ({' '.join(found[0])}): pass "
                              f"{unknown_of!r}, or put spaces around {word!r} in the text")
    shown = " ".join(t for _, t in content[:60]) + (" ..." if len(content) > 60 else "")
    raise InspectError(f"{name} {word!r} (tokens {found[0]}) is not in the text; its tokens "
                       f"are: {shown}")


def _added(tokens: list[str], spans: list | None, i: int, n: int) -> bool:
    """Whether ``tokens[i:i + n]`` hold a marker the tokenizer added (a special token with
    no characters in the text: the [SEP] at the end, not one the text writes)."""
    return spans is not None and len(spans) == len(tokens) and any(
        is_special(tokens[j]) and spans[j][0] == spans[j][1] for j in range(i, i + n))


def _word_at(text: str | None, spans: list | None, words: list | None, i: int) -> str | None:
    """The text of the word that token ``i`` is a piece of, or None where it cannot tell.

    Example:
        >>> _word_at("a cafés", [(0, 1), (2, 6), (6, 7)], [0, 1, 1], 1)
        'cafés'
    """
    if text is None or spans is None or words is None or words[i] is None:
        return None
    mine = [spans[j] for j in range(len(words)) if words[j] == words[i]]
    return text[min(s for s, _ in mine):max(e for _, e in mine)].strip() or None


def _unknown_token(model) -> str | None:
    """The token ``model``'s tokenizer writes for text its vocabulary lacks, if it says."""
    tokenizer = getattr(getattr(model, "tokenizer", None), "model", None)
    return getattr(tokenizer, "unk_token", None)


#: characters that join a word to its ending ("can't", "it's", "can’t")
APOSTROPHES = "'’"
#: the English endings after an apostrophe, which are not words of their own
ENDINGS = {"t", "s", "re", "ve", "ll", "d", "m"}


def _joined_pieces(text: str | None, spans: list | None, count: int):
    """``joined(i, n)``: the word of ``text`` whose English ending after an apostrophe
    tokens ``i .. i + n - 1`` are ("t" or "'t" of "can't", "s" of "it's"), or None where
    they are a word (or the ``spans`` cannot tell). What comes before the apostrophe is a
    word ("it" of "it's", "dog" of "dog's"), and so is a word after another ending's
    ("école" of "l'école", "Brien" of "O'Brien").

    Example:
        >>> joined = _joined_pieces("I can't", [(0, 1), (2, 5), (5, 6), (6, 7)], 4)
        >>> joined(3, 1), joined(2, 2), joined(1, 1), joined(1, 3)
        ("can't", "can't", None, None)
    """
    if text is None or spans is None or len(spans) != count:
        return lambda i, n: None

    def joined(i: int, n: int) -> str | None:
        start, end = spans[i][0], spans[i + n - 1][1]
        while start < end and text[start].isspace():                 # (a span may start at
            start += 1                                                #  its space)
        piece = text[start:end]
        if piece[:1] in APOSTROPHES:                                 # "'t": its apostrophe
            piece, start = piece[1:], start + 1
        glued = start >= 2 and text[start - 1] in APOSTROPHES and text[start - 2].isalnum()
        if not glued or piece.casefold() not in ENDINGS:
            return None
        begin = start - 1
        while begin > 0 and (text[begin - 1].isalnum() or text[begin - 1] in APOSTROPHES):
            begin -= 1
        return text[begin:end]
    return joined


def _whole_words(tokens: list[str], words: list | None):
    """``whole(i, n)``: whether ``tokens[i:i + n]`` start and end where words do (a word's
    leading space marker "␣" aside): neither the piece before nor the one after belongs to
    a word they hold; without ``words``, every span does.

    Example:
        >>> whole = _whole_words(["b", "an", "it", "didn", "'", "t"], [0, 0, 0, 1, 2, 3])
        >>> whole(2, 1), whole(0, 3), whole(3, 3)           # "it" in "banit"; "didn't"
        (False, True, True)
    """
    if words is None or len(words) != len(tokens):
        return lambda i, n: True

    def whole(i: int, n: int) -> bool:
        first, last = words[i], words[i + n - 1]
        before = words[i - 1] if i > 0 and tokens[i - 1] != "␣" else None
        after = words[i + n] if i + n < len(words) else None
        return first is None or (before != first and after != last)
    return whole


@dataclass
class Look:
    """One head's strongest attention from the query token to another content token."""

    layer: int
    head: int
    target: int
    weight: float

    def distance(self, query: int) -> int:
        """How many tokens separate the target from the query."""
        return abs(self.target - query)

    def long_range(self, query: int) -> bool:
        """Beyond the neighbouring tokens (previous/next-token looks are positional).

        Example:
            >>> Look(0, 0, 4, 0.5).long_range(3), Look(0, 0, 1, 0.5).long_range(3)
            (False, True)
        """
        return self.distance(query) > 1

    def label(self, tokens: list[str], query: int) -> str:
        """``"L3H1: it → animal 0.67"`` (the weight cut to two decimals, as every shown score).

        Example:
            >>> Look(3, 1, 1, 0.6768).label(["it", "animal"], 0)
            'L3H1: it → animal 0.67'
        """
        target = tokens[self.target]
        return f"L{self.layer}H{self.head}: {tokens[query]} → {target} {shown(self.weight)}"


def headline(looks: list[Look], query: int, tokens: list[str] | None = None) -> Look | None:
    """The look worth showing first: the strongest one beyond the neighbouring tokens
    (previous/next-token heads are common and positional), and for a pronoun the strongest
    one back to an earlier word (where its antecedent is: "it → animal"); else the strongest.

    Example:
        >>> toks = ["[CLS]", "dog", "ran", "it", "fell"]
        >>> looks = [Look(0, 0, 2, 0.9), Look(1, 3, 4, 0.8), Look(2, 5, 1, 0.7)]
        >>> headline(looks, 3, toks).label(toks, 3)
        'L2H5: it → dog 0.70'
    """
    far = [k for k in looks if k.long_range(query)]
    if tokens is not None and tokens[query].lower() in PRONOUNS:
        far = [k for k in far if k.target < query] or far
    return far[0] if far else (looks[0] if looks else None)


def strongest_looks(weights: torch.Tensor, tokens: list[str], query: int, top: int = 8, *,
                    causal: bool = False) -> list[Look]:
    """The heads whose largest weight from ``query`` to another content token (not itself,
    not [CLS]/[SEP]; for a decoder, ``causal``, an earlier one) is highest, best first.

    Example:
        >>> import torch
        >>> w = torch.zeros(1, 2, 3, 3); w[..., 0] = 1.0
        >>> w[0, 1, 2] = torch.tensor([0.1, 0.7, 0.2])
        >>> strongest_looks(w, ["[CLS]", "dog", "it"], 2, top=1)[0].label(["[CLS]", "dog", "it"], 2)
        'L0H1: it → dog 0.70'
    """
    keep = torch.tensor([not is_special(t) and (j < query if causal else j != query)
                         for j, t in enumerate(tokens)])
    if not bool(keep.any()):
        return []
    row = weights[:, :, query, :].masked_fill(~keep, -1.0)                 # (L, H, S)
    best, target = row.max(dim=-1)                                          # (L, H)
    H = best.shape[1]
    order = torch.argsort(best.flatten(), descending=True)[:top].tolist()
    return [Look(i // H, i % H, int(target.flatten()[i]), float(best.flatten()[i])) for i in order]

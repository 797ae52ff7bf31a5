"""``tokenizer.json``: loaded with the ``tokenizers`` library and checked, and its tokens shown
readably.

Only ``tokenizer.json`` is read (never ``vocab.txt``, ``vocab.json``/``merges.txt`` or a
SentencePiece ``tokenizer.model``): it is plain JSON that ``tokenizers`` parses, and it holds
the whole pipeline (normalizer, pre-tokenizer, model, post-processor, decoder).

Byte-level BPE (GPT-2, Llama 3, Qwen2) and SentencePiece-style (Llama 2, Mistral) tokens
carry their word boundary inside the token: ``"Ġanimal"``, ``"▁animal"``. :func:`display`
turns them into the words a reader expects (``"animal"``) with the tokenizer's own decoder.
"""

from __future__ import annotations

from pathlib import Path

from ._files import ModelLoadError, first_line, is_library_error

#: the largest tokenizer.json read (large multilingual ones are about 35 MB)
TOKENIZER_LIMIT = 256 * 2**20
#: a text made of characters no vocabulary holds as words (rare symbols): encoding it needs
#: the tokenizer's unknown token, or byte-level pieces
RARE = "\U0001F9FF\u2603\u27C1 q\u0336\u0337x"
#: the least share of config.json's vocab_size a model's own tokenizer covers: checkpoints
#: pad their embedding past the tokenizer by a few rows (Phi-2: 50,295 of 51,200, 98%), so a
#: tokenizer far smaller than the embedding is another model's (BERT's 30,522 on GPT-2's 50,257)
COVERAGE = 0.9


def load_tokenizer(path: Path, vocab_size: int, *, markers: bool = False):
    """``tokenizer.json`` at ``path``, checked to parse, to be non-empty, to give ids below
    ``vocab_size`` (config.json's) and to cover at least :data:`COVERAGE` of them, and, with
    ``markers`` (a BERT encoder's), to write a special token at both ends of a text ([CLS]
    ... [SEP]); padding and truncation are switched off (callers do both).

    Raises:
        ModelLoadError: naming ``path`` and what is wrong with it.

    Example:
        >>> from multihead.models import default_model_dir
        >>> tok = load_tokenizer(default_model_dir() / "tokenizer.json", 30522)
        >>> tok.encode("it rains").tokens
        ['[CLS]', 'it', 'rains', '[SEP]']
        >>> load_tokenizer(default_model_dir() / "tokenizer.json", 1000)
        Traceback (most recent call last):
        ...
        multihead.models._files.ModelLoadError: ... has token ids up to ... but config.json's vocab_size is 1000: the tokenizer belongs to another model
        >>> load_tokenizer(default_model_dir() / "tokenizer.json", 50257)     # GPT-2's
        Traceback (most recent call last):
        ...
        multihead.models._files.ModelLoadError: ... has 30,522 tokens but config.json's vocab_size is 50,257 (61%; ...
    """
    from tokenizers import Tokenizer
    size = path.stat().st_size
    if not 0 < size <= TOKENIZER_LIMIT:
        raise ModelLoadError(f"{path} is {size:,} bytes ({'empty' if not size else 'too large'}): "
                             f"copy tokenizer.json from the original model")
    try:
        tok = Tokenizer.from_file(str(path))
        tok.no_padding()
        tok.no_truncation()
        vocab = tok.get_vocab()
        probe = tok.encode("hello world")        # runs the normalizer, model and post-processor
        tok.encode(RARE)                         # a word it lacks: WordPiece's unknown token
        count = tok.get_vocab_size(with_added_tokens=True)
    except BaseException as e:
        if not is_library_error(e):
            raise
        raise ModelLoadError(f"{path} is not a usable tokenizer.json ({first_line(e)}): copy it from the "
                             f"original model, or save one with tokenizers' Tokenizer.save") from None
    if not vocab:
        raise ModelLoadError(f"{path} has an empty vocabulary: copy tokenizer.json from the original model")
    top = max([*vocab.values(), *probe.ids])
    if top >= vocab_size:
        raise ModelLoadError(f"{path} has token ids up to {top} but config.json's vocab_size is "
                             f"{vocab_size}: the tokenizer belongs to another model")
    if count < COVERAGE * vocab_size:
        raise ModelLoadError(f"{path} has {count:,} tokens but config.json's vocab_size is "
                             f"{vocab_size:,} ({count / vocab_size:.0%}; a model's own tokenizer "
                             f"covers all but a few padded rows): the tokenizer belongs to "
                             f"another model; copy tokenizer.json from this one")
    ends = probe.special_tokens_mask
    if markers and not (ends and ends[0] and ends[-1]):
        raise ModelLoadError(f"{path} writes no special token at both ends of a text (\"hello "
                             f"world\" is {probe.tokens}): a BERT encoder reads [CLS] ... [SEP], "
                             f"which the tokenizer's post_processor adds; copy tokenizer.json "
                             f"from the original model")
    return tok


def lower_cased(tokenizer):
    """``tokenizer`` made to lower-case every text first, as sentence-transformers does for a
    model whose ``do_lower_case`` is set: a ``Lowercase`` normalizer before its own (unless it
    has one). It runs after the tokenizer has found its special tokens, so a literal
    ``[MASK]`` in a text stays one, and offsets point into the text as given.

    Example:
        >>> from tokenizers import Tokenizer, models, pre_tokenizers
        >>> tok = Tokenizer(models.WordLevel({"hello": 0, "[UNK]": 1}, unk_token="[UNK]"))
        >>> tok.pre_tokenizer = pre_tokenizers.Whitespace()
        >>> lower_cased(tok).encode("HeLLo").tokens
        ['hello']
    """
    from tokenizers import normalizers
    own = tokenizer.normalizer
    try:                           # (a Sequence lists its steps in tokenizers 0.20 and later)
        steps = list(own) if isinstance(own, normalizers.Sequence) else [own]
    except TypeError:
        steps = [own]
    if any(isinstance(n, normalizers.Lowercase) for n in steps):
        return tokenizer
    tokenizer.normalizer = normalizers.Lowercase() if own is None else \
        normalizers.Sequence([normalizers.Lowercase(), own])
    return tokenizer


def display(tokenizer, token_id: int, token: str) -> str:
    """A token as a reader expects it: word-boundary markers (``Ġ``, ``▁``) and byte-level
    spelling decoded by ``tokenizer``'s decoder, surrounding spaces dropped; a token that is
    only whitespace is shown escaped (``"␣"``, ``"\\\\n"``) so that it stays visible.

    Example:
        >>> from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        >>> tok = Tokenizer(models.WordLevel({"Ġanimal": 0, "Ċ": 1, "Ġ": 2}, unk_token="Ġ"))
        >>> tok.decoder = decoders.ByteLevel()
        >>> [display(tok, i, t) for i, t in [(0, "Ġanimal"), (1, "Ċ"), (2, "Ġ")]]
        ['animal', '\\\\n', '␣']
    """
    if tokenizer.decoder is None:
        text = token
    else:
        try:
            text = tokenizer.decode([token_id], skip_special_tokens=False)
        except BaseException as e:      # a decoder that cannot handle one token alone
            if not is_library_error(e):
                raise
            text = token
    shown = text.strip()
    if shown:
        return shown
    text = text or token                               # a decoder may drop a lone marker
    for space in (" ", "▁", "Ġ"):
        text = text.replace(space, "␣")
    return text.encode("unicode_escape").decode("ascii").replace("\\u2423", "␣")


#: what a decoder gives for bytes that are not a whole character
REPLACEMENT = "\ufffd"


def byte_pieces(shown: list[str], spans: list, text: str) -> list[str]:
    """``shown`` (tokens as :func:`display` gives them) with each piece that holds part of a
    character's bytes (a byte-level tokenizer's: decoded alone, it is U+FFFD) named by
    that character in ``text`` (the piece's span), numbered where several pieces share it.

    Example:
        >>> byte_pieces(["\ufffd", "\ufffd", "\ufffd", "a"], [(0, 1), (0, 1), (0, 1), (2, 3)], "北 a")
        ['北(1/3)', '北(2/3)', '北(3/3)', 'a']
    """
    groups = {}                           # the characters of a span: the pieces sharing it
    for i, (piece, (start, end)) in enumerate(zip(shown, spans)):
        under = text[start:end].strip()
        if REPLACEMENT in piece and under and REPLACEMENT not in under:
            groups.setdefault((start, end, under), []).append(i)
    out = list(shown)
    for (_, _, name), pieces in groups.items():
        for k, i in enumerate(pieces, 1):
            out[i] = name if len(pieces) == 1 else f"{name}({k}/{len(pieces)})"
    return out

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


def load_tokenizer(path: Path, vocab_size: int):
    """``tokenizer.json`` at ``path``, checked to parse, to be non-empty, and to give ids below
    ``vocab_size`` (config.json's); padding and truncation are switched off (callers do both).

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
        probe = tok.encode("hello world").ids    # runs the normalizer, model and post-processor
    except BaseException as e:
        if not is_library_error(e):
            raise
        raise ModelLoadError(f"{path} is not a usable tokenizer.json ({first_line(e)}): copy it from the "
                             f"original model, or save one with tokenizers' Tokenizer.save") from None
    if not vocab:
        raise ModelLoadError(f"{path} has an empty vocabulary: copy tokenizer.json from the original model")
    top = max([*vocab.values(), *probe])
    if top >= vocab_size:
        raise ModelLoadError(f"{path} has token ids up to {top} but config.json's vocab_size is "
                             f"{vocab_size}: the tokenizer belongs to another model")
    return tok


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

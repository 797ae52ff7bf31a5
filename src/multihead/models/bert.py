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

import json
from dataclasses import dataclass, fields
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import masks
from ..modules import MultiHeadAttention

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
    pad_token_id: int = 0
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1

    def __post_init__(self):
        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "intermediate_size", "max_position_embeddings", "type_vocab_size"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise UnsupportedModel(f"config.json: {f} must be a positive integer, got {v!r}")
        if self.hidden_size % self.num_attention_heads:
            raise UnsupportedModel(f"config.json: hidden_size ({self.hidden_size}) is not divisible "
                                   f"by num_attention_heads ({self.num_attention_heads})")
        if self.hidden_act not in ACTIVATIONS:
            raise UnsupportedModel(f"config.json: hidden_act {self.hidden_act!r} is not supported; "
                                   f"supported: {sorted(ACTIVATIONS)}")

    @property
    def head_dim(self) -> int:
        """d_k = hidden_size / num_attention_heads."""
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_dict(cls, d: dict) -> "BertConfig":
        """Read a ``config.json`` dict; refuses architectures this encoder would run wrongly."""
        kind = d.get("model_type")
        archs = d.get("architectures") or []
        if kind != "bert":
            raise UnsupportedModel(
                f"config.json: model_type is {kind!r} (architectures {archs}); only BERT-family "
                f"encoders (model_type 'bert') are supported")
        pos = d.get("position_embedding_type", "absolute")
        if pos != "absolute":
            raise UnsupportedModel(f"config.json: position_embedding_type {pos!r} is not supported "
                                   f"(only 'absolute')")
        if d.get("is_decoder") or d.get("add_cross_attention"):
            raise UnsupportedModel("config.json: decoder BERT variants are not supported")
        names = {f.name for f in fields(cls)}
        required = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                    "intermediate_size")
        missing = [r for r in required if r not in d]
        if missing:
            raise UnsupportedModel(f"config.json: missing {missing}")
        return cls(**{k: v for k, v in d.items() if k in names})

    @classmethod
    def from_file(cls, path) -> "BertConfig":
        """Read ``config.json`` at ``path`` (invalid JSON raises :class:`UnsupportedModel`)."""
        try:
            with open(path, encoding="utf-8") as f:
                d = json.load(f)
        except json.JSONDecodeError as e:
            raise UnsupportedModel(f"{path} is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise UnsupportedModel(f"{path} must hold a JSON object, got {type(d).__name__}")
        return cls.from_dict(d)


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


class BertEncoder(nn.Module):
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

    def _check_ids(self, ids: torch.Tensor, dims: int, legend: str) -> None:
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids must be an integer tensor {legend}, got "
                            f"{getattr(ids, 'dtype', type(ids).__name__)}")
        if ids.dim() != dims:
            raise ValueError(f"input_ids must be {legend}, got shape {tuple(ids.shape)}")
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size):
            raise ValueError(f"input_ids must lie in [0, {self.config.vocab_size}) (the vocabulary), "
                             f"got values in [{int(ids.min())}, {int(ids.max())}]")

    def _check_length(self, longest: int) -> None:
        limit = self.config.max_position_embeddings
        if longest > limit:
            raise ValueError(f"a sequence has {longest} tokens but the model has {limit} positions: "
                             f"truncate it to {limit}")

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
        self._check_ids(input_ids, 2, "(B, S)")
        B, S = input_ids.shape
        self._check_length(S)
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
        self._check_ids(input_ids, 1, "(N,)")
        cu = torch.as_tensor(cu_seqlens, dtype=torch.long, device=input_ids.device)
        if cu.dim() != 1 or int(cu[0]) != 0 or int(cu[-1]) != input_ids.numel() or bool((cu.diff() <= 0).any()):
            raise ValueError(f"cu_seqlens must be [0, ..., N={input_ids.numel()}], strictly "
                             f"increasing, got {cu.tolist()[:8]}{'...' if len(cu) > 8 else ''}")
        lengths = cu.diff()                                                     # (n,)
        self._check_length(int(lengths.max()))
        starts = torch.repeat_interleave(cu[:-1], lengths)                      # (N,)
        positions = torch.arange(input_ids.numel(), device=cu.device) - starts  # (N,)
        h = self.embeddings(input_ids, positions, torch.zeros_like(input_ids))  # (N, E)
        h, _ = self._run(h.unsqueeze(0), masks.document(cu_seqlens=cu), False)  # (1, N, E)
        return h.squeeze(0)

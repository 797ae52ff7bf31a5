"""Capture every head's attention weights for a text, and find where a query token looks.

Notation used for tensor shapes: L layers, H heads, S tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .metrics import SPECIAL

PRONOUNS = ("it", "he", "she", "they", "him", "her", "them", "its", "his", "their", "this",
            "that", "who", "which", "we", "you", "i")


class InspectError(ValueError):
    """A user's input the inspector cannot use; the message says why and what to do."""


@dataclass
class Capture:
    """A text's tokens and all attention weights ``(L, H, S, S)`` (float32, rows sum to 1)."""

    text: str
    tokens: list[str]
    weights: torch.Tensor
    truncated: bool
    original_length: int


@torch.inference_mode()
def capture(model, text: str, *, truncate: bool = True) -> Capture:
    """Run ``model`` (a :class:`multihead.models.Pretrained`) on ``text`` and keep the weights.

    Example:
        >>> from multihead.models import load
        >>> c = capture(load(), "It rains.")
        >>> c.tokens, tuple(c.weights.shape)
        (['[CLS]', 'it', 'rains', '.', '[SEP]'], (6, 12, 5, 5))
    """
    if not isinstance(text, str) or not text.strip():
        raise InspectError("the text is empty: give some words to inspect")
    limit = model.config.max_position_embeddings
    tok = model.tokenize(text)
    if tok.truncated and not truncate:
        raise InspectError(f"the text has {tok.original_length} tokens but the model has {limit} "
                           f"positions: shorten it, or drop --no-truncate to keep the first {limit}")
    out = model.encoder(tok.ids[None], return_weights=True)
    w = torch.stack([x[0] for x in out.weights]).float()                     # (L, H, S, S)
    return Capture(text, tok.tokens, w, tok.truncated, tok.original_length)


def find_query(model, tokens: list[str], word: str | None) -> int:
    """Position of ``word``'s first word piece in ``tokens`` (default: the first pronoun).

    Example:
        >>> from multihead.models import load
        >>> model = load()
        >>> toks = model.tokenize("The dog barked because it was hungry.").tokens
        >>> toks[find_query(model, toks, None)], find_query(model, toks, "dog")
        ('it', 2)
    """
    content = [(i, t) for i, t in enumerate(tokens) if t not in SPECIAL]
    if word is None:
        for i, t in content:
            if t in PRONOUNS:
                return i
        return content[0][0] if content else 0
    pieces = model.tokenizer.encode(word, add_special_tokens=False).tokens
    if not pieces:
        raise InspectError(f"--query-token {word!r} has no tokens: pass a word from the text")
    for i in range(len(tokens) - len(pieces) + 1):
        if tokens[i:i + len(pieces)] == pieces:
            return i
    shown = " ".join(t for _, t in content[:60]) + (" ..." if len(content) > 60 else "")
    raise InspectError(f"--query-token {word!r} (tokens {pieces}) is not in the text; its tokens "
                       f"are: {shown}")


@dataclass
class Look:
    """One head's strongest attention from the query token to another content token."""

    layer: int
    head: int
    target: int
    weight: float

    def distance(self, query: int) -> int:
        """How many tokens separate the target from the query."""
        return abs(self.target - query)

    def label(self, tokens: list[str], query: int) -> str:
        """``"L3H1: it → animal 0.68"``."""
        return f"L{self.layer}H{self.head}: {tokens[query]} → {tokens[self.target]} {self.weight:.2f}"


def headline(looks: list[Look], query: int, tokens: list[str] | None = None) -> Look | None:
    """The look worth showing first: the strongest one beyond the neighbouring tokens
    (previous/next-token heads are common and positional), and for a pronoun the strongest
    one back to an earlier word (where its antecedent is: "it → animal"); else the strongest.

    Example:
        >>> toks = ["[CLS]", "dog", "ran", "it", "fell"]
        >>> looks = [Look(0, 0, 2, 0.9), Look(1, 3, 4, 0.8), Look(2, 5, 1, 0.7)]
        >>> headline(looks, 3, toks).label(toks, 3)
        'L2H5: it → dog 0.70'
    """
    far = [k for k in looks if k.distance(query) > 1]
    if tokens is not None and tokens[query] in PRONOUNS:
        far = [k for k in far if k.target < query] or far
    return far[0] if far else (looks[0] if looks else None)


def strongest_looks(weights: torch.Tensor, tokens: list[str], query: int, top: int = 8) -> list[Look]:
    """The heads whose largest weight from ``query`` to another content token (not itself,
    not [CLS]/[SEP]) is highest, best first.

    Example:
        >>> import torch
        >>> w = torch.zeros(1, 2, 3, 3); w[..., 0] = 1.0
        >>> w[0, 1, 2] = torch.tensor([0.1, 0.7, 0.2])
        >>> strongest_looks(w, ["[CLS]", "dog", "it"], 2, top=1)[0].label(["[CLS]", "dog", "it"], 2)
        'L0H1: it → dog 0.70'
    """
    keep = torch.tensor([t not in SPECIAL and j != query for j, t in enumerate(tokens)])
    if not bool(keep.any()):
        return []
    row = weights[:, :, query, :].masked_fill(~keep, -1.0)                 # (L, H, S)
    best, target = row.max(dim=-1)                                          # (L, H)
    H = best.shape[1]
    order = torch.argsort(best.flatten(), descending=True)[:top].tolist()
    return [Look(i // H, i % H, int(target.flatten()[i]), float(best.flatten()[i])) for i in order]

"""A loaded model: encoder + tokenizer, with tokenization and packed sentence embeddings.

Notation used for tensor shapes: n texts, S tokens of one text, N packed tokens, E hidden size.
"""

from __future__ import annotations

import contextlib
import numbers
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, NamedTuple, Sequence

import torch

from .._args import counted, positive_int
from .._fork import module_lock
from .._progress import track
from .bert import BertConfig, BertEncoder, EncoderOutput
from .sentence import POOLINGS, SentenceConfig
from .tokenizer import lower_cased

#: tokens per packed forward in :meth:`Pretrained.embed` (bounds peak memory)
PACK_TOKENS = 16384


class Tokens(NamedTuple):
    """One tokenized text: ``ids`` (S,), the token strings, whether it was truncated, and
    each token's word (the tokenizer's word ids: the pieces of one word share one; None for
    a marker the tokenizer adds, such as [CLS]) and characters in the text (``(start,
    end)``; a marker's: (0, 0)). A special token written in the text (``"[MASK]"``) is one
    of its words, with its characters, as in ``transformers``."""

    ids: torch.Tensor
    tokens: list[str]
    truncated: bool
    original_length: int
    words: list[int | None] | None = None
    spans: list[tuple[int, int]] | None = None


def check_max_length(max_length, positions: int, tokenizer=None, *,
                     name: str = "max_length") -> int:
    """The tokens a text keeps: ``max_length`` (a positive int, at least the special tokens
    ``tokenizer`` adds to a text: fewer would cut its markers, and at most the model's
    ``positions``), or ``positions`` for None; an error names it as ``name``.

    Example:
        >>> check_max_length(None, 512), check_max_length(8, 512)
        (512, 8)
        >>> check_max_length(0, 512)
        Traceback (most recent call last):
        ...
        ValueError: max_length must be a positive integer (or None: the model's 512 positions), got 0
        >>> check_max_length(1000, 512)
        Traceback (most recent call last):
        ...
        ValueError: max_length=1000 is more than the model's 512 positions (config.json max_position_embeddings): pass at most 512 (or None)
    """
    post = getattr(tokenizer, "post_processor", None)
    added = 0 if post is None else post.num_special_tokens_to_add(False)
    if positions <= added:
        raise ValueError(f"the model has {counted(positions, 'position')} "
                         f"(config.json max_position_embeddings) but the tokenizer adds "
                         f"{counted(added, 'special token')} to every text: no room for a "
                         f"word; this checkpoint cannot read text")
    if max_length is None:
        return positions
    if isinstance(max_length, bool) or not isinstance(max_length, numbers.Integral) \
            or max_length < 1:
        raise ValueError(f"{name} must be a positive integer (or None: the model's "
                         f"{positions} positions), got {max_length!r}")
    if max_length > positions:
        raise ValueError(f"{name}={max_length} is more than the model's {positions} positions "
                         f"(config.json max_position_embeddings): pass at most {positions} (or "
                         f"None)")
    if max_length < added:
        raise ValueError(f"{name}={max_length} is shorter than the "
                         f"{counted(added, 'special token')} the tokenizer adds to every text "
                         f"(BERT's [CLS] and [SEP], say): pass {name}={added} or more")
    return int(max_length)


#: the modules inside an :func:`evaluating` block: id -> (blocks inside, its mode before)
_EVALUATING: dict[int, tuple[int, bool]] = {}
_EVALUATING_LOCK = module_lock(globals(), "_EVALUATING_LOCK")


@contextlib.contextmanager
def evaluating(module: torch.nn.Module):
    """``module`` in eval mode for the block (no dropout: the same text gives the same
    numbers whatever mode a caller left it in), then back in the mode it was.

    Blocks in several threads at once share one eval period, module by module (a block on
    a model and one on a layer of it included): the first block to reach a module saves
    its mode and the last to leave restores it (each block saving and restoring its own
    would let one thread's restore turn dropout back on under another's forward). A
    training step in another thread at the same time still sees eval mode, as it would
    after ``.eval()``.

    Example:
        >>> import torch
        >>> m = torch.nn.Dropout().train()
        >>> with evaluating(m):
        ...     m.training
        False
        >>> m.training
        True
    """
    mods = list(module.modules())   # (alive while the block runs: their ids are their own)
    with _EVALUATING_LOCK:
        for m in mods:
            inside, mode = _EVALUATING.get(id(m), (0, m.training))    # the first saves it
            _EVALUATING[id(m)] = (inside + 1, mode)
            m.training = False
    try:
        yield module
    finally:
        with _EVALUATING_LOCK:
            for m in mods:
                inside, mode = _EVALUATING.pop(id(m))
                if inside > 1:
                    _EVALUATING[id(m)] = (inside - 1, mode)
                else:                                   # the last one restores it
                    m.training = mode


def check_text(name: str, text) -> str:
    """``text``, after checking that it is a str a tokenizer can read (Unicode text: no lone
    surrogate, which a str holds after decoding with ``errors="surrogateescape"``).

    Example:
        >>> check_text("texts[1]", b"hi")
        Traceback (most recent call last):
        ...
        TypeError: texts[1] must be a str, got bytes: decode it first (b.decode("utf-8"))
    """
    if not isinstance(text, str):
        fix = (': decode it first (b.decode("utf-8"))' if isinstance(text, (bytes, bytearray))
               else ": tokenize_batch takes a list of texts" if isinstance(text, (list, tuple))
               else "")
        raise TypeError(f"{name} must be a str, got {type(text).__name__}{fix}")
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ValueError(f"{name} holds a lone surrogate {text[e.start]!r} at character "
                         f"{e.start}, which is no Unicode text: decode its bytes with "
                         f"errors='replace' instead of 'surrogateescape'") from None
    return text


def check_texts(texts) -> list[str]:
    """``texts`` as a list, after checking that it is a sequence (not one str) of texts a
    tokenizer can read (see :func:`check_text`).

    Example:
        >>> check_texts(("a", "b"))
        ['a', 'b']
        >>> check_texts("ab")
        Traceback (most recent call last):
        ...
        TypeError: texts must be a list of str, got str: wrap one text in a list (['ab'])
        >>> check_texts(["a", None])
        Traceback (most recent call last):
        ...
        TypeError: texts[1] must be a str, got NoneType
    """
    if isinstance(texts, str) or not isinstance(texts, Sequence):
        cut = repr(texts[:30]) + ("..." if len(texts) > 30 else "") if isinstance(texts, str) else ""
        fix = f": wrap one text in a list ([{cut}])" if cut else ""
        raise TypeError(f"texts must be a list of str, got {type(texts).__name__}{fix}")
    return [check_text(f"texts[{i}]", t) for i, t in enumerate(texts)]


def kept(special: list[int], limit: int) -> list[int]:
    """The indices of the tokens an encoding keeps at ``limit`` positions, from its
    ``special_tokens_mask``: the first ones, with an end marker (a special token last, such
    as ``[SEP]``) kept last, as a tokenizer truncating before it adds its markers keeps
    them; a text without one is cut.

    Example:
        >>> kept([1, 0, 0, 0, 1], 4), kept([0, 0, 0], 2)
        ([0, 1, 2, 4], [0, 1])
    """
    n = len(special)
    keep = list(range(min(n, limit)))
    if n > limit and special[-1]:
        keep[-1] = n - 1
    return keep


def kept_tokens(enc, limit: int, show=None) -> Tokens:
    """The :class:`Tokens` of an encoding at ``limit`` positions (see :func:`kept`); ``show``
    (``(id, token) -> str``) gives a text token's shown form (special tokens stay as they are).

    Each of the encoding's properties is read once: a read copies the whole encoding into a
    new list, so reading one per kept token took seconds on a long text.

    Example:
        >>> from types import SimpleNamespace as E
        >>> enc = E(ids=[101, 7, 8, 102], tokens=["[CLS]", "a", "b", "[SEP]"],
        ...         special_tokens_mask=[1, 0, 0, 1], word_ids=[None, 0, 1, None],
        ...         offsets=[(0, 0), (0, 1), (2, 3), (0, 0)])
        >>> t = kept_tokens(enc, 3)
        >>> t.tokens, t.truncated, t.original_length, t.words
        (['[CLS]', 'a', '[SEP]'], True, 4, [None, 0, None])
    """
    ids, tokens, special = enc.ids, enc.tokens, enc.special_tokens_mask
    words, spans = enc.word_ids, enc.offsets
    keep = kept(special, limit)
    shown = [tokens[i] if show is None or special[i] else show(ids[i], tokens[i]) for i in keep]
    return Tokens(torch.tensor([ids[i] for i in keep], dtype=torch.long), shown,
                  len(ids) > limit, len(ids), [words[i] for i in keep], [spans[i] for i in keep])


@dataclass
class Pretrained:
    """A pretrained BERT-family model; build it with :func:`multihead.models.load`.

    Attributes:
        encoder: the :class:`BertEncoder` (eval mode).
        tokenizer: a ``tokenizers.Tokenizer`` (no padding, no truncation: we do both).
        config: the encoder's :class:`BertConfig`.
        sentence: max length, pooling and normalization of sentence embeddings.
        directory, name: where it came from.
    """

    encoder: BertEncoder
    tokenizer: object
    config: BertConfig
    sentence: SentenceConfig
    directory: Path
    name: str
    #: an encoder: each token attends to every token (see Decoder for causal models)
    causal: ClassVar[bool] = False
    #: one line on which tokens each token can attend to
    attention_note: ClassVar[str] = "encoder (bidirectional): each token attends to every token"

    def tokenize(self, text: str, *, max_length: int | None = None) -> Tokens:
        """Tokenize one text with [CLS]/[SEP]; longer than ``max_length`` (default: the model's
        positions) keeps the first tokens and the final [SEP], and says so in ``truncated``.

        Example:
            >>> from multihead.models import load
            >>> load().tokenize("The animal didn't cross.").tokens
            ['[CLS]', 'the', 'animal', 'didn', "'", 't', 'cross', '.', '[SEP]']
        """
        return self.tokenize_batch([check_text("text", text)], max_length=max_length)[0]

    def tokenize_batch(self, texts: Sequence[str], *, max_length: int | None = None) -> list[Tokens]:
        """:meth:`tokenize` for many texts at once (the tokenizer's batch encoder).

        Example:
            >>> from multihead.models import load
            >>> [len(t.ids) for t in load().tokenize_batch(["hi", "a b c"], max_length=4)]
            [3, 4]
        """
        limit = check_max_length(max_length, self.config.max_position_embeddings, self.tokenizer)
        return self._encode(check_texts(texts), limit)

    def _encode(self, texts: list[str], limit: int) -> list[Tokens]:
        """:meth:`tokenize_batch` of texts and a limit already checked."""
        return [kept_tokens(enc, limit) for enc in self._texts_tokenizer().encode_batch(texts)]

    def _texts_tokenizer(self):
        """The tokenizer texts go through: :attr:`tokenizer`, made to lower-case them first
        (see :func:`.tokenizer.lower_cased`) while ``sentence.lower_case`` says so; that copy
        is kept, and made again for another :attr:`tokenizer`."""
        if not self.sentence.lower_case:
            return self.tokenizer
        kept_copy = self.__dict__.get("_lower_cased")
        if kept_copy is None or kept_copy[0] is not self.tokenizer:
            copy = type(self.tokenizer).from_str(self.tokenizer.to_str())
            kept_copy = (self.tokenizer, lower_cased(copy))
            self.__dict__["_lower_cased"] = kept_copy
        return kept_copy[1]

    def query_pieces(self, word: str) -> list[list[str]]:
        """The word pieces ``word`` becomes in a text (one way for BERT's WordPiece).

        Example:
            >>> from multihead.models import load
            >>> load().query_pieces("Tired")
            [['tired']]
        """
        return [self._texts_tokenizer().encode(word, add_special_tokens=False).tokens]

    @property
    def device(self) -> torch.device:
        """Where the weights are."""
        return next(self.encoder.parameters()).device

    @torch.inference_mode()
    def attention_weights(self, ids: torch.Tensor) -> EncoderOutput:
        """The encoder on ``ids`` ``(1, S)``: hidden states ``(1, S, E)`` and every layer's
        attention weights, each ``(1, H, S, S)`` (in eval mode, whatever the encoder's)."""
        with evaluating(self.encoder):
            return self.encoder(ids, return_weights=True)

    @torch.inference_mode()
    def embed(self, texts: Sequence[str], *, prompt_name: str | None = None,
              prompt: str | None = None, progress: bool = False,
              pack_tokens: int = PACK_TOKENS) -> torch.Tensor:
        """Sentence embeddings ``(n, E)``: pooled (mean over tokens for MiniLM) and normalized
        as the model's sentence-transformers files say, computed packed with no padding, in
        eval mode (the encoder's mode is restored after).

        Texts are sorted longest first and packed back to back into forwards of at most
        ``pack_tokens`` tokens; each text attends only to itself (a document mask run by the
        ``varlen`` backend), and the token-wise layers never see a padding token.

        A prompt is put before each text, as sentence-transformers' ``encode`` does:
        ``prompt`` (its text; ``""`` for none), else the one named ``prompt_name`` in
        ``sentence.prompts``, else the model's default (``sentence.default_prompt_name``).
        Its tokens are pooled with the text's unless the Pooling config's
        ``include_prompt`` is false. (Passing both ``prompt`` and ``prompt_name`` is an
        error; sentence-transformers warns and takes ``prompt``.)

        Example:
            >>> from multihead.models import load
            >>> e = load().embed(["a cat sat", "the dog ran away"])
            >>> e.shape, [round(float(x), 4) for x in e.norm(dim=1)]
            (torch.Size([2, 384]), [1.0, 1.0])
            >>> q = load().embed(["a cat sat"], prompt="query: ")      # (MiniLM has no prompts)
            >>> round(float(q[0] @ e[0]), 2) < 1
            True
        """
        texts = check_texts(texts)
        pack_tokens = positive_int("pack_tokens", pack_tokens,
                                   hint="the most tokens one packed forward holds")
        if self.sentence.pooling not in POOLINGS.values():           # (set after loading?)
            raise ValueError(f"sentence.pooling must be 'mean' or 'cls', got "
                             f"{self.sentence.pooling!r}: the poolings multihead runs")
        limit = check_max_length(self.sentence.max_seq_length,          # (it may be set)
                                 self.config.max_position_embeddings, self.tokenizer,
                                 name="sentence.max_seq_length")
        prompt = self._prompt(prompt_name, prompt)
        skip = 0 if not prompt or self.sentence.include_prompt else \
            self._prompt_length(prompt, limit)
        E = self.config.hidden_size
        device = self.device
        toks = self._encode([prompt + t for t in texts] if prompt else texts, limit)
        lengths = torch.tensor([len(t.ids) for t in toks])                       # (n,)
        order = torch.argsort(lengths, descending=True, stable=True).tolist()
        result = torch.empty(len(texts), E, dtype=next(self.encoder.parameters()).dtype)
        packs, cur, size = [], [], 0
        for i in order:
            if cur and size + int(lengths[i]) > pack_tokens:
                packs.append(cur)
                cur, size = [], 0
            cur.append(i)
            size += int(lengths[i])
        if cur:
            packs.append(cur)
        with evaluating(self.encoder):              # dropout would make embeddings random
            for pack in track(packs, progress, len(texts), "embedding", weight=len):
                ids = torch.cat([toks[i].ids for i in pack]).to(device)          # (N,)
                ln = lengths[pack].to(device)                                    # (m,)
                cu = torch.nn.functional.pad(ln.cumsum(0), (1, 0))               # (m + 1,)
                h = self.encoder.forward_packed(ids, cu)                         # (N, E)
                result[pack] = self._pool(h, ln, skip).cpu()
        return result

    def _prompt(self, name, text) -> str:
        """The prompt :meth:`embed` puts before each text (see there); ``""`` for none."""
        if text is not None:
            if name is not None:
                raise ValueError(f"pass prompt or prompt_name, not both (got prompt={text!r} "
                                 f"and prompt_name={name!r})")
            return check_text("prompt", text)
        prompts, what = self.sentence.prompts, "prompt_name"
        if name is None:
            name, what = self.sentence.default_prompt_name, "sentence.default_prompt_name"
            if name is None:
                return ""
        if not isinstance(name, str) or name not in prompts:
            raise ValueError(f"{what} {name!r} is not one of this model's prompts "
                             f"({sorted(prompts) or 'it has none'}, from "
                             f"config_sentence_transformers.json): pass one of them, or the "
                             f"prompt's text as prompt=")
        return prompts[name]

    def _prompt_length(self, prompt: str, limit: int) -> int:
        """The tokens a text's ``prompt`` takes at its start, its leading [CLS] included (as
        sentence-transformers counts them: the prompt alone, cut at ``limit`` tokens, without
        its closing [SEP])."""
        enc = self._texts_tokenizer().encode(prompt)
        keep = kept(enc.special_tokens_mask, limit)
        return len(keep) - (1 if enc.special_tokens_mask[keep[-1]] else 0)

    def _pool(self, h: torch.Tensor, lengths: torch.Tensor, skip: int = 0) -> torch.Tensor:
        """Pool packed token states ``(N, E)`` into one vector per text ``(m, E)``, leaving
        out each text's first ``skip`` tokens (a prompt's; a text no longer than them pools
        to zeros, or to its [CLS], as in sentence-transformers)."""
        starts = torch.nn.functional.pad(lengths.cumsum(0)[:-1], (1, 0))       # (m,)
        if self.sentence.pooling == "cls":
            first = torch.where(lengths > skip, skip, 0)                        # (m,)
            pooled = h[starts + first]                                          # (m, E)
        else:
            seg = torch.repeat_interleave(torch.arange(len(lengths), device=h.device), lengths)
            if skip:                                     # a prompt's tokens count as zeros
                pooled_tokens = torch.arange(h.shape[0], device=h.device) - starts[seg] >= skip
                h = h * pooled_tokens[:, None].to(h.dtype)                      # (N, E)
            pooled = h.new_zeros(len(lengths), h.shape[1]).index_add_(0, seg, h)  # (m, E)
            pooled = pooled / (lengths - skip).clamp(min=1)[:, None].to(h.dtype)
        if self.sentence.normalize:
            pooled = torch.nn.functional.normalize(pooled, dim=-1)
        return pooled

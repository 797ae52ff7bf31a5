"""Head metrics: what each attention head looks at, measured on its attention weights.

Every metric is an average over query rows (and over texts, weighted by their rows) of one
number per row of a head's attention matrix ``w`` (rows sum to 1):

- ``cls``, ``sep``, ``punct``: the weight a query puts on [CLS], on [SEP], and on
  punctuation tokens. Clark et al. (2019), "What Does BERT Look At?", found that much of
  BERT's attention goes to [SEP] and punctuation, often as a "no-op".
- ``prev``, ``next``, ``self``: the weight on the previous token, the next token, the token
  itself ("broad positional heads", Clark et al. 2019 sec. 3; Voita et al. 2019's
  "positional heads" attend to a neighbour with high weight).
- ``entropy``: the row's entropy divided by ``log(n_keys)``, 0 = all weight on one token,
  1 = uniform (Clark et al. 2019 sec. 3.3, "broad vs focused" heads).
- ``confidence``: the row's largest weight (Voita et al. 2019, "Analyzing Multi-Head
  Self-Attention": confident heads matter most and survive pruning).

Roles are assigned by the thresholds in :data:`ROLE_RULES` (shown in every report).

Decoders (``causal=True``) look only backwards, so some numbers mean nothing there and are
marked not applicable (:meth:`HeadMetrics.not_applicable`), never shown as a 0: ``next``
(no token sees the next one, so no "next token" role either), and ``cls``/``sep`` when no
text has such a token (GPT-2 adds none). The first token of a decoder sees only itself, so
its row (weight 1 on itself) is not counted, and ``entropy`` divides by the log of the
number of keys the row can see (``i + 1`` for query ``i``; ``min(i + 1, W)`` in a layer with
a sliding window of ``W`` tokens), not of the whole text.

Notation used for tensor shapes: L layers, H heads, S tokens.
"""

from __future__ import annotations

import math
import string
import unicodedata
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

METRICS = ("cls", "sep", "punct", "prev", "next", "self", "entropy", "confidence")

#: (role, metric, threshold): a head whose metric reaches the threshold takes the role; when
#: several do, the one with the largest metric value wins.
ROLE_RULES = (("previous token", "prev", 0.5), ("next token", "next", 0.5),
              ("self", "self", 0.5), ("[CLS]", "cls", 0.5), ("[SEP]", "sep", 0.5),
              ("punctuation", "punct", 0.5))
#: heads with no positional role: "broad" at normalized entropy >= BROAD, else "focused"
#: at confidence >= FOCUSED, else "mixed".
BROAD, FOCUSED = 0.8, 0.5


#: float32 stores a two-decimal value in [0, 1] at most 2.87e-8 below it (0.78); its
#: largest value below 0.5 is 2.98e-8 below: a slack between the two reads the first as
#: the value it stands for and keeps the second below the threshold. This holds for every
#: threshold of 0.5 or more (those of ROLE_RULES, BROAD, FOCUSED: tested); below 0.5,
#: float32's spacing is finer than the slack.
FLOAT32_SLACK = 2.93e-8


def round_down(x, digits: int = 2):
    """``x`` (a float or a tensor) cut to ``digits`` decimals, never rounded up: every rule
    in :data:`ROLE_RULES` is ``metric >= threshold``, so a shown value reaches a threshold
    exactly when the value does (0.4996 shows as 0.49, not as a 0.50 that "should" be a
    role). Shown scores, the JSON's metrics and the role rules' comparisons use it.

    Values computed in float32 (weights, metrics) are read as the two-decimal number they
    stand for: float32 stores 0.7 as 0.69999998, which shows as 0.70, while its largest
    value below 0.5 (0.49999997) still shows as 0.49.

    Example:
        >>> round_down(0.4996), round_down(torch.tensor([0.29, 0.7, 0.49999997]), 2).tolist()
        (0.49, [0.29, 0.7, 0.49])
        >>> round_down(float(torch.tensor(0.78)))       # float32: 0.77999997
        0.78
    """
    scale = 10 ** digits
    if isinstance(x, torch.Tensor):
        return torch.floor((x.double() + FLOAT32_SLACK) * scale) / scale
    return math.floor((x + FLOAT32_SLACK) * scale) / scale


def shown(x) -> str:
    """``x`` as every score is shown: cut (:func:`round_down`) to two decimals.

    Example:
        >>> shown(0.6768), shown(0.7)
        ('0.67', '0.70')
    """
    return f"{round_down(x):.2f}"


SPECIAL = {"[CLS]", "[SEP]", "[PAD]", "[MASK]", "<s>", "</s>"}
#: tokens that open a text (the ``cls`` metric) and close one (``sep``)
OPENERS = {"[CLS]", "<s>", "<|begin_of_text|>"}
CLOSERS = {"[SEP]", "</s>", "<|end_of_text|>", "<|endoftext|>"}
#: why a metric can have no rows to measure
NOT_APPLICABLE = {
    "next": "a decoder's tokens never see the next token",
    "cls": "no [CLS] or <s> token in the text",
    "sep": "no [SEP] or </s> token in the text",
}


def is_special(token: str) -> bool:
    """A tokenizer's marker rather than text: [CLS], <s>, ... and ``<|...|>`` tokens.

    Example:
        >>> [is_special(t) for t in ["[SEP]", "<|endoftext|>", "it", "<"]]
        [True, True, False, False]
    """
    return token in SPECIAL or (len(token) > 4 and token.startswith("<|") and token.endswith("|>"))


def all_finite(t: torch.Tensor) -> bool:
    """Whether every value of ``t`` is finite (one cheap reduction when they are).

    Example:
        >>> all_finite(torch.ones(3)), all_finite(torch.tensor([1.0, float("nan")]))
        (True, False)
    """
    # any NaN or inf makes the sum NaN or inf; only a finite overflow needs the full check
    return bool(torch.isfinite(t.sum())) or bool(torch.isfinite(t).all())


def is_punct(token: str) -> bool:
    """A token made only of punctuation: ASCII's, and any character Unicode calls
    punctuation (``“ — … 。 ¿``), as BERT's tokenizer splits them off (word-piece ``##``
    prefixes ignored).

    Example:
        >>> [is_punct(t) for t in [".", "##,", "it", "'", "[SEP]", "—", "「", "。", "¿"]]
        [True, True, False, True, False, True, True, True, True]
    """
    t = token[2:] if token.startswith("##") else token
    return bool(t) and not is_special(token) and all(
        c in string.punctuation or unicodedata.category(c).startswith("P") for c in t)


def _row_metrics(w: torch.Tensor, tokens: list[str], causal: bool = False,
                 window: int | None = None) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Per-row values ``(L, H, S)`` and which rows count ``(S,)`` for each metric (a decoder's
    layer with a sliding ``window``: each row sees its last ``window`` tokens)."""
    S = w.shape[-1]
    if len(tokens) != S:
        raise ValueError(f"weights cover {S} tokens but {len(tokens)} tokens were given")
    w = w.double()
    keys = lambda pred: torch.tensor([pred(t) for t in tokens], dtype=torch.double)  # (S,)
    i = torch.arange(S)
    every = i >= 1 if causal else torch.ones(S, dtype=torch.bool)   # a decoder's row 0: itself
    below = F.pad(w.diagonal(offset=-1, dim1=-2, dim2=-1), (1, 0))        # (L, H, S): w[i, i-1]
    above = F.pad(w.diagonal(offset=1, dim1=-2, dim2=-1), (0, 1))         # (L, H, S): w[i, i+1]
    if causal:                                  # row i sees keys 0..i: uniform is log(i + 1)
        seen = (i + 1).clamp(max=window) if window else i + 1                # (S,)
        norm = torch.log(seen.double()).clamp_min(1e-30)                     # (S,)
    else:
        norm = torch.full((S,), math.log(S) if S > 1 else 1.0, dtype=torch.double)
    entropy = -(w * torch.log(w.clamp_min(1e-30))).sum(-1) / norm
    opens, closes = keys(lambda t: t in OPENERS), keys(lambda t: t in CLOSERS)
    return {
        "cls": (w @ opens, every & bool(opens.any())),
        "sep": (w @ closes, every & bool(closes.any())),
        "punct": (w @ keys(is_punct), every),
        "prev": (below, i >= 1),
        "next": (above, (i <= S - 2) & (not causal)),
        "self": (w.diagonal(dim1=-2, dim2=-1), every),
        "entropy": (entropy, every),
        "confidence": (w.amax(-1), every),
    }


@dataclass
class HeadMetrics:
    """Running averages of every metric per head, over the rows of one or more texts.

    Example:
        >>> import torch
        >>> w = torch.eye(4).roll(-1, dims=1)                   # row i puts all weight on i-1 ...
        >>> w[0] = torch.tensor([1., 0, 0, 0])                  # ... row 0 on itself
        >>> m = HeadMetrics.of(w[None, None], ["[CLS]", "a", "b", "[SEP]"])
        >>> round(m.value("prev")[0, 0].item(), 3), m.roles()[0][0]
        (1.0, ('previous token', 1.0))
        >>> d = HeadMetrics.of(w[None, None], ["The", "dog", "ran", "."], causal=True)
        >>> sorted(d.not_applicable()), d.roles()[0][0]
        (['cls', 'next', 'sep'], ('previous token', 1.0))
    """

    sums: dict = field(default_factory=dict)
    counts: dict = field(default_factory=dict)
    texts: int = 0
    #: the weights are a decoder's: each token sees only itself and earlier tokens
    causal: bool = False
    #: a decoder's layers with a sliding window: ``{layer: W}``, a token sees its last W
    windows: dict = field(default_factory=dict)

    @classmethod
    def of(cls, weights: torch.Tensor, tokens: list[str], *, causal: bool = False,
           windows: dict | None = None) -> "HeadMetrics":
        """The metrics of one text's weights ``(L, H, S, S)`` (a decoder's: ``causal=True``,
        with its layers' sliding ``windows`` ``{layer: W}`` if any)."""
        if windows and not causal:
            raise ValueError("windows: a sliding window is a decoder's (pass causal=True)")
        m = cls(causal=causal, windows=dict(windows or {}))
        m.add(weights, tokens)
        return m

    def add(self, weights: torch.Tensor, tokens: list[str]) -> None:
        """Add one text's weights ``(L, H, S, S)`` (rows sum to 1) and its tokens."""
        if weights.dim() != 4 or weights.shape[-1] != weights.shape[-2]:
            raise ValueError(f"weights must be (L, H, S, S), got shape {tuple(weights.shape)}")
        if not all_finite(weights):
            raise ValueError("weights hold NaN or inf values: the model's weights are probably "
                             "corrupt (multihead.inspect.capture.check_finite names the layer)")
        sums, counts = {name: [] for name in METRICS}, {}
        for l, layer in enumerate(weights.split(1)):     # (1, H, S, S): bounds the fp64 copies
            metrics = _row_metrics(layer, tokens, self.causal, self.windows.get(l))
            for name, (vals, rows) in metrics.items():
                sums[name].append(vals[..., rows].sum(-1))                    # (1, H)
                counts[name] = int(rows.sum())
        for name in METRICS:
            self.sums[name] = self.sums.get(name, 0) + torch.cat(sums[name])  # (L, H)
            self.counts[name] = self.counts.get(name, 0) + counts[name]
        self.texts += 1

    def value(self, name: str) -> torch.Tensor:
        """The average of metric ``name`` per head, ``(L, H)`` (NaN-free: 0 with no rows;
        :meth:`not_applicable` says which metrics had none)."""
        if name not in METRICS:
            raise ValueError(f"unknown metric {name!r}: choose one of {METRICS}")
        if not self.texts:
            raise ValueError("no text added yet: call add(weights, tokens) first")
        return self.sums[name] / max(self.counts[name], 1)

    def not_applicable(self) -> dict[str, str]:
        """``{metric: why}`` for the metrics with no row to measure in any text added (for a
        decoder, ``next`` always; ``cls``/``sep`` when no text has such a token).

        Example:
            >>> HeadMetrics.of(torch.ones(1, 2, 1, 1), ["it"]).not_applicable()["next"]
            'no token has a next one (every text given has one token)'
        """
        why = dict(NOT_APPLICABLE)
        if self.causal:
            rest = "no query row to measure (a decoder's first token sees only itself)"
        else:                            # (an encoder's rows go unmeasured only for 1 token)
            rest = "no query row to measure (every text given has one token)"
            why["next"] = "no token has a next one (every text given has one token)"
        return {name: why.get(name, rest)
                for name in METRICS if self.texts and not self.counts.get(name)}

    def check_measured(self) -> None:
        """Raise ``ValueError`` when no query row was measured (texts of one token, given
        to a decoder: its first token sees only itself), so that no head has a role.

        Example:
            >>> HeadMetrics.of(torch.ones(1, 2, 1, 1), ["it"], causal=True).check_measured()
            Traceback (most recent call last):
            ...
            ValueError: no head has a role: no query row could be measured (a decoder's first token sees only itself, and every text given has one token); give a text of at least two tokens
        """
        if "entropy" in self.not_applicable():
            raise ValueError("no head has a role: no query row could be measured (a decoder's "
                             "first token sees only itself, and every text given has one "
                             "token); give a text of at least two tokens")

    def table(self) -> dict[str, torch.Tensor]:
        """Every metric's per-head average, ``{name: (L, H)}``."""
        return {name: self.value(name) for name in METRICS}

    def roles(self) -> list[list[tuple[str, float]]]:
        """``[layer][head] -> (role, score)`` by :data:`ROLE_RULES`, then BROAD / FOCUSED.

        Raises:
            ValueError: no query row was measured (:meth:`check_measured`).
        """
        self.check_measured()
        t = self.table()
        L, H = t["prev"].shape
        na = self.not_applicable()
        rules = [(role, m, thr) for role, m, thr in ROLE_RULES if m not in na]
        reaches = lambda x, thr: round_down(x) >= thr     # as shown (float64 means too)
        out = []
        for l in range(L):
            row = []
            for h in range(H):
                hits = [(float(t[m][l, h]), role) for role, m, thr in rules
                        if reaches(float(t[m][l, h]), thr)]
                if hits:
                    score, role = max(hits)
                elif reaches(float(t["entropy"][l, h]), BROAD):
                    role, score = "broad", float(t["entropy"][l, h])
                elif reaches(float(t["confidence"][l, h]), FOCUSED):
                    role, score = "focused", float(t["confidence"][l, h])
                else:
                    role, score = "mixed", float(t["confidence"][l, h])
                row.append((role, score))
            out.append(row)
        return out


def thresholds_text(skip=()) -> str:
    """The role rules, in one line, for reports; rules on the metrics in ``skip`` (those not
    applicable) are left out.

    Example:
        >>> thresholds_text(skip={"next", "cls", "sep"})[:60]
        'roles: previous token if prev >= 0.5, self if self >= 0.5, p'
    """
    rules = ", ".join(f"{role} if {m} >= {thr}" for role, m, thr in ROLE_RULES if m not in skip)
    return (f"roles: {rules} (largest wins); otherwise broad if entropy >= {BROAD}, "
            f"focused if confidence >= {FOCUSED}, else mixed")

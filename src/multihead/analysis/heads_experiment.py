"""Why several heads beat one (seed 003's claim; seed 004's exercise on heads that share
W_Q, W_K, W_V): a small controlled experiment.

The task needs two relations per token at once. Tokens are drawn uniformly from a
vocabulary of V; the target at position t is ``(x[t-1] + 2 * x[t-3]) mod V``: the model must
fetch the previous token and the token three back, and must know which is which (the
combination is not symmetric). One attention layer (causal), with learned token and
position embeddings, a residual connection and an MLP read-out, is trained three ways at
equal d_model:

- ``h=8``: eight heads of width d/8 (the seeds' multi-head attention);
- ``h=1``: one head of the full width d;
- ``h=8 shared``: eight heads that share one W_Q, W_K, W_V (seed 004's exercise predicts
  they compute one pattern and converge to the same loss as a single head).

Which relation each head learned is read off its attention weights: the mean weight at each
relative offset (0 = itself, 1 = the previous token, ...), plus entropy and confidence
from :mod:`multihead.inspect.metrics`.

Notation used for tensor shapes: B batch, T sequence length, V vocabulary, d model width.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

import multihead as mh

from .._args import positive_int

PREDICTION = ("seed 003: one head 'can only produce one pattern of weights', so it must mix "
              "both relations into one pattern ('severely limiting expressiveness'); seed 004: "
              "heads sharing W_Q/W_K/W_V compute identical patterns and 'converge to the same "
              "loss' as one head; h=8 separate heads can each take one relation.")


@dataclass(frozen=True)
class Setup:
    """The experiment's sizes and training schedule (``quick()``: a CI smoke run)."""

    vocab: int = 12
    length: int = 16
    d_model: int = 64
    steps: int = 1000
    batch: int = 128
    lr: float = 3e-3
    seed: int = 0
    eval_sequences: int = 2000
    offsets: tuple = (1, 3)            # the two relations: x[t-1] and x[t-3]

    def __post_init__(self):
        for f, least in (("vocab", 2), ("length", 2), ("d_model", 8), ("steps", 1),
                         ("batch", 1), ("eval_sequences", 1)):           # (frozen: set once)
            object.__setattr__(self, f, positive_int(f, getattr(self, f), least=least))
        offs = self.offsets
        pair = isinstance(offs, (tuple, list)) and len(offs) == 2
        a, b = (positive_int("each offset", o) for o in offs) if pair else (0, 0)
        if not 0 < a < b < self.length:
            raise ValueError(f"offsets must be two ints 0 < a < b < length ({self.length}): the "
                             f"target is (x[t-a] + 2 * x[t-b]) mod vocab; got {offs!r:.60}")
        object.__setattr__(self, "offsets", (a, b))
        if self.d_model % 8:
            raise ValueError(f"d_model must be a multiple of 8 (the h=8 models split it into 8 "
                             f"heads), got {self.d_model}")

    @classmethod
    def quick(cls) -> "Setup":
        """150 steps: checks the pipeline end to end, too short to learn the task."""
        return cls(steps=150, eval_sequences=500)


def make_batch(s: Setup, n: int, g: torch.Generator):
    """Tokens ``(n, T)`` and targets ``(n, T)`` (-100 where the target is undefined).

    Example:
        >>> x, y = make_batch(Setup(), 1, torch.Generator().manual_seed(0))
        >>> int(y[0, 5]) == (int(x[0, 4]) + 2 * int(x[0, 2])) % 12, int(y[0, 2])
        (True, -100)
    """
    x = torch.randint(0, s.vocab, (n, s.length), generator=g)
    a, b = s.offsets
    y = torch.full_like(x, -100)
    y[:, b:] = (x[:, b - a:s.length - a] + 2 * x[:, :s.length - b]) % s.vocab
    return x, y


class SharedQKVAttention(nn.Module):
    """``heads`` heads that all use one W_Q, W_K, W_V of width d/heads (and their own W_O)."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads, self.dk = heads, d // heads
        self.qkv = nn.Linear(d, 3 * self.dk)
        self.out_proj = nn.Linear(heads * self.dk, d)

    def forward(self, x, mask=None, return_weights=False):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(self.dk, dim=-1)                        # (B, T, dk) each
        q, k, v = (t.unsqueeze(1).expand(B, self.heads, T, self.dk) for t in (q, k, v))  # (B, h, T, dk)
        res = mh.attention(q, k, v, mask=mask, return_weights=return_weights)
        out, w = res if return_weights else (res, None)
        y = self.out_proj(out.transpose(1, 2).reshape(B, T, -1))            # (B, T, d)
        return (y, w) if return_weights else y


class TinyModel(nn.Module):
    """Embeddings, one causal attention layer with a residual, and an MLP read-out:
    tokens (B, T) -> logits (B, T, V) (and the attention weights (B, h, T, T) on request)."""

    def __init__(self, s: Setup, attn: nn.Module):
        super().__init__()
        self.tok = nn.Embedding(s.vocab, s.d_model)
        self.pos = nn.Embedding(s.length, s.d_model)
        self.attn = attn
        self.norm = nn.LayerNorm(s.d_model)
        self.head = nn.Sequential(nn.Linear(s.d_model, 4 * s.d_model), nn.GELU(),
                                  nn.Linear(4 * s.d_model, s.vocab))

    def forward(self, x, return_weights=False):
        h = self.tok(x) + self.pos(torch.arange(x.shape[1]))                # (B, T, d)
        a = self.attn(h, mask=mh.masks.causal(), return_weights=return_weights)
        a, w = a if return_weights else (a, None)
        logits = self.head(self.norm(h + a))                                # (B, T, V)
        return (logits, w) if return_weights else logits


def build(kind: str, s: Setup) -> TinyModel:
    """``"h=8"``, ``"h=1"`` or ``"h=8 shared"``, initialized under ``s.seed``."""
    makers = {"h=8": lambda: mh.MultiHeadAttention(s.d_model, 8),
              "h=1": lambda: mh.MultiHeadAttention(s.d_model, 1),
              "h=8 shared": lambda: SharedQKVAttention(s.d_model, 8)}
    if kind not in makers:
        raise ValueError(f"unknown model kind {kind!r:.40}: choose one of {', '.join(makers)}")
    torch.manual_seed(s.seed)
    return TinyModel(s, makers[kind]())


@dataclass
class Result:
    """One trained model's evaluation and what its heads attend to."""

    kind: str
    parameters: int
    loss: float
    accuracy: float
    seconds: float
    offset_profile: list = field(default_factory=list)    # [head][offset] mean weight
    entropy: list = field(default_factory=list)           # [head]
    confidence: list = field(default_factory=list)        # [head]
    curve: list = field(default_factory=list)             # (step, train loss)

    def tops(self) -> list[tuple[int, float]]:
        """Each head's top offset and the mean weight there: ``[(k, weight)]``, one per head
        of ``offset_profile`` ``[head][offset]``.

        Example:
            >>> Result("h=2", 1, 1.0, 0.5, 0.1, [[0.1, 0.9, 0.0], [0.2, 0.3, 0.5]]).tops()
            [(1, 0.9), (2, 0.5)]
        """
        return [max(enumerate(prof), key=lambda kw: kw[1]) for prof in self.offset_profile]

    def relations(self) -> list[str]:
        """Each head's dominant relation: 'x[t-k] 0.93' (mean weight at its top offset, cut
        to two decimals as inspect's scores are: 0.4996 shows as 0.49, not as a 0.50 a head
        "mainly" on it would have)."""
        from ..inspect.metrics import shown
        return [("itself" if k == 0 else f"x[t-{k}]") + f" {shown(w)}" for k, w in self.tops()]


def train(kind: str, s: Setup) -> Result:
    """Train one model under ``s.seed`` and evaluate it on held-out sequences."""
    model = build(kind, s)
    opt = torch.optim.AdamW(model.parameters(), lr=s.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=s.lr, total_steps=s.steps)
    g = torch.Generator().manual_seed(s.seed + 1)
    t0, curve = time.perf_counter(), []
    for step in range(s.steps):
        x, y = make_batch(s, s.batch, g)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % max(1, s.steps // 20) == 0 or step == s.steps - 1:
            curve.append((step, loss.item()))
    seconds = time.perf_counter() - t0
    x, y = make_batch(s, s.eval_sequences, torch.Generator().manual_seed(s.seed + 2))
    with torch.no_grad():
        logits, w = model.eval()(x, return_weights=True)                    # w: (B, h, T, T)
    keep = y != -100
    loss = float(F.cross_entropy(logits[keep], y[keep]))
    acc = float((logits.argmax(-1)[keep] == y[keep]).float().mean())
    return Result(kind, sum(p.numel() for p in model.parameters()), loss, acc, seconds,
                  *_head_relations(w, s), curve)


def _head_relations(w: torch.Tensor, s: Setup):
    """Mean weight by relative offset per head ``[h][offset]``, every offset 0..T-1, over the
    queries t >= max offset (a query with no key that far back counts 0 there, so the
    first token, at a different offset for each query, is never read as one far offset),
    and each head's entropy and confidence (multihead.inspect.metrics)."""
    from ..inspect.metrics import HeadMetrics
    T, start = w.shape[-1], max(s.offsets)
    rows = w[:, :, start:, :]                          # queries t >= start: row r is t = start + r
    n = T - start
    prof = [[float(rows.diagonal(offset=start - k, dim1=-2, dim2=-1)[:, h].sum(-1).mean()) / n
             for k in range(T)] for h in range(w.shape[1])]  # key t - k: col r + start - k (rows t >= k)
    m = HeadMetrics(causal=True)                       # (the model's one layer is causal)
    for i in range(min(len(w), 200)):
        m.add(w[i][None], [f"t{j}" for j in range(T)])
    return prof, m.value("entropy")[0].tolist(), m.value("confidence")[0].tolist()


def run(s: Setup, kinds=("h=8", "h=1", "h=8 shared")) -> list[Result]:
    """Train and evaluate each model kind under the same setup."""
    return [train(k, s) for k in kinds]


def one_relation(s: Setup) -> float:
    """The accuracy a model that fetches only ``x[t-a]`` (the better of the two relations
    alone) can reach: ``2·x[t-b] mod V`` is left unknown, one of ``V / gcd(2, V)`` values.

    Example:
        >>> one_relation(Setup())                       # V = 12: 6 values left, 1/6
        0.16666666666666666
    """
    return math.gcd(2, s.vocab) / s.vocab


def _split(r: Result, a: int, b: int, head: int = 0) -> str:
    """``"0.98 on x[t-1], 0.00 on x[t-3]"``: one head's weight on the two relations."""
    from ..inspect.metrics import shown
    p = r.offset_profile[head]
    return f"{shown(p[a])} on x[t-{a}], {shown(p[b])} on x[t-{b}]"


#: accuracy above what one relation alone gives that counts as having learned the task
LEARNED = 0.05
#: an accuracy difference between two models that counts as one beating the other
CLEAR = 0.02
#: the weight on one offset above which a head "attends mainly" to it
MAINLY = 0.5


def ahead(x: float, y: float, margin: float) -> bool:
    """Whether accuracy ``x`` is more than ``margin`` above ``y``, without float rounding
    deciding a tie (0.50 - 0.48 and 0.30 - 0.28 both differ by exactly 2 points).

    Example:
        >>> ahead(0.50, 0.48, 0.02), ahead(0.30, 0.28, 0.02), ahead(0.31, 0.28, 0.02)
        (False, False, True)
    """
    return round(x - y - margin, 9) > 0


def finding(results: list[Result], setup: Setup = Setup()) -> str:
    """The outcome in words, from the measured numbers (nothing assumed): which model is
    best and how the heads split the work only when some model learned more than one
    relation alone gives (:func:`one_relation`) by :data:`LEARNED`; a model is named best
    only :data:`CLEAR` ahead of the next, and a head counts for a relation only when more
    than :data:`MAINLY` of its weight is on it. Accuracies are compared as printed (to 0.1%),
    so two runs that print alike read alike; differences are in percentage points.

    Example:
        >>> flat = [[0.25] * 4] * 8                     # untrained: weight spread evenly
        >>> r = [Result(k, 1, 2.5, 0.09, 0.1, flat) for k in ("h=8", "h=1")]
        >>> finding(r)
        'h=8: accuracy 9.0%, loss 2.500; h=1: accuracy 9.0%, loss 2.500. No model learned the task (chance is 8.3%, and x[t-1] alone gives 16.7%): train longer (--steps) before reading the heads.'
    """
    a, b = setup.offsets
    by = {r.kind: r for r in results}
    acc = {r.kind: round(r.accuracy, 3) for r in results}   # (decided on the figures shown)
    ranked = sorted(results, key=lambda r: acc[r.kind], reverse=True)
    best = ranked[0]
    text = "; ".join(f"{r.kind}: accuracy {r.accuracy:.1%}, loss {r.loss:.3f}" for r in results)
    one = one_relation(setup)
    learned = lambda r: not ahead(one + LEARNED, acc[r.kind], 0)     # (5 points above: learned)
    if not learned(best):
        return (f"{text}. No model learned the task (chance is {1 / setup.vocab:.1%}, and "
                f"x[t-{a}] alone gives {one:.1%}): train longer (--steps) before reading the "
                f"heads.")
    if len(ranked) > 1:
        text += (f". Best: {best.kind}." if ahead(acc[best.kind], acc[ranked[1].kind], CLEAR) else
                 f". No clear best: {best.kind} and {ranked[1].kind} are within "
                 f"{_points(CLEAR)} of each other.")
    else:
        text += "."
    if "h=8" in by and learned(by["h=8"]):        # (heads that learned nothing split nothing)
        tops = by["h=8"].tops()
        mainly = [k for k, w in tops if w > MAINLY]
        text += (f" Of the {len(tops)} heads, {mainly.count(a)} put most of their weight on "
                 f"x[t-{a}] and {mainly.count(b)} on x[t-{b}]"
                 + (" (the heads split the work)." if mainly.count(a) and mainly.count(b)
                    else "."))
    if {"h=8", "h=1"} <= by.keys():
        h8, h1 = acc["h=8"], acc["h=1"]
        text += (f" Eight heads beat one full-width head by {_points(h8 - h1)}" if ahead(h8, h1, CLEAR)
                 else f" One full-width head beat eight heads by {_points(h1 - h8)}"
                 if ahead(h1, h8, CLEAR) else
                 f" Eight heads and one head are within {_points(CLEAR)} ({_points(h8 - h1, '+')})")
        text += f" (the single head: {_split(by['h=1'], a, b)})."
    if {"h=8 shared", "h=1"} <= by.keys():
        sh = by["h=8 shared"]
        s, h1 = acc["h=8 shared"], acc["h=1"]
        same = max(max(abs(x - y) for x, y in zip(p, sh.offset_profile[0])) for p in sh.offset_profile)
        where = ("above" if s > h1 else "below") if s != h1 else "level with"
        text += (f" Heads sharing W_Q/W_K/W_V computed one pattern (largest difference between "
                 f"heads {same:.3f}: {_split(sh, a, b)}) and ended {_points(abs(s - h1))} "
                 f"{where} the single full-width head")
        text += (": better than predicted (the seed expects the same loss as one head; "
                 "one run does not say why; both patterns are shown above)."
                 if ahead(s, h1, CLEAR) else
                 ": worse than predicted (the seed expects the same loss as one head)."
                 if ahead(h1, s, CLEAR) else f": as predicted, within {_points(CLEAR)} of it.")
    return text


def _points(gap: float, sign: str = "") -> str:
    """An accuracy difference in percentage points: ``_points(0.833)`` is '83.3 points'."""
    points = round(gap * 100, 1)
    return f"{points:{sign}.1f} point{'' if abs(points) == 1 else 's'}"

"""The terminal view of ``multihead inspect`` (rich tables)."""

from __future__ import annotations

from rich.markup import escape
from rich.table import Table

from ..inspect.metrics import METRICS, shown, thresholds_text
from ._common import plain, table


def _text(s: str) -> str:
    """A user's or a model's text as rich markup that shows it as written: markup and
    terminal control characters escaped."""
    return escape(plain(s))


SHORT = {"previous token": "prev", "next token": "next", "punctuation": "punct",
         "focused": "focus"}


def _cell(role: str, score: float, selected: bool) -> str:
    """A grid cell: the role, short, and its score (bold when it is the selected head)."""
    text = f"{escape(SHORT.get(role, role))}\n{shown(score)}"
    return f"[bold reverse]{text}[/]" if selected else text


def show(result, console, full: bool = False) -> None:
    """Print the query token's strongest heads and a table of every head's role and metrics."""
    c, toks = result.capture, result.capture.tokens
    console.print(f"[bold]{_text(result.model)}[/]: {_text(result.summary())}")
    if result.attention:
        console.print(escape(result.attention), style="bold" if c.causal else None)
    console.print("text: " + _text(c.text), soft_wrap=True)

    back = ", to earlier tokens only" if c.causal else ""
    if result.looks:
        q = table(f"Heads attending most from {_text(repr(toks[result.query]))} "
                  f"(token {result.query}{back})", ("head", "from → to", "weight", "distance"),
                  left=("head", "from → to"))
        for k in result.looks:
            far = (k.layer, k.head) == tuple(result.selected)
            q.add_row(f"L{k.layer}H{k.head}", _text(f"{toks[result.query]} → {toks[k.target]}"),
                      shown(k.weight), str(k.distance(result.query)),
                      style="bold green" if far and k.weight >= 0.5 else None)
        console.print(q)
    else:
        other, fix = ("earlier token", "pick a later --query-token or give a longer text") \
            if c.causal else ("other token", "give a longer text")
        console.print(f"Heads attending most from {_text(repr(toks[result.query]))} (token "
                      f"{result.query}): none to show, the text has no {other} to look at "
                      f"besides special tokens; {fix}")

    values, roles = result.metrics.table(), result.metrics.roles()
    na = result.metrics.not_applicable()
    L, H = values["prev"].shape
    avg = f", averaged over {result.metrics.texts} texts" if result.metrics.texts > 1 else ""
    if full:
        t = table(f"Every head: role (score) and metrics{avg}", ("head", "role", "score", *METRICS),
                  left=("head", "role"))
        for l in range(L):
            for h in range(H):
                role, score = roles[l][h]
                t.add_row(f"L{l}H{h}", escape(role), shown(score),
                          *("n/a" if n in na else shown(float(values[n][l, h]))
                            for n in METRICS),
                          style="bold" if (l, h) == tuple(result.selected) else None,
                          end_section=h == H - 1)
    else:
        t = Table(title=f"Every head's role (score){avg}; --metrics for all metrics",
                  title_justify="left", padding=(0, 0, 0, 1))
        t.add_column("")
        for h in range(H):
            t.add_column(f"H{h}", justify="center")
        for l in range(L):
            t.add_row(f"L{l}", *(_cell(*roles[l][h], (l, h) == tuple(result.selected))
                                 for h in range(H)))
    console.print(t)
    console.print(escape(thresholds_text(skip=na)), style="dim")
    console.print("metrics: cls/sep/punct = weight on [CLS]/[SEP]/punctuation, prev/next/self = "
                  "weight on the neighbouring/own token, entropy = normalized row entropy "
                  "(1 = uniform), confidence = mean max weight (Clark et al. 2019; Voita et al. "
                  "2019). Bold: the head shown large in the report.", style="dim")
    if na:
        console.print(escape("n/a (not measured, not 0): " + "; ".join(
            f"{name}: {why}" for name, why in na.items())), style="dim")
    if c.causal:
        console.print("decoder: the first token sees only itself, so its row is not counted; "
                      "entropy is normalized by the number of tokens each row can see.", style="dim")

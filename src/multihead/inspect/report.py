"""An inspection's results as data (JSON) and as a self-contained offline HTML report.

The HTML page inlines all of its script, style and data (no CDN, no request of any kind; a
Content-Security-Policy forbids them). Tokens and texts reach the page only as JSON inside a
``<script type="application/json">`` whose ``<``, ``>`` and ``&`` are escaped, and are
written into the page with ``textContent``: a text like ``<script>alert(1)</script>``
renders as text.

Attention weights are packed one byte each (:mod:`multihead.inspect.packing`): a 512-token
report is 13.6 MB, not hundreds. The page and ``inspect.json`` hold the same bytes, so the
weights the page shows (two decimals: a byte keeps a weight within 1/255 of its head's
largest) are the ones the JSON unpacks to; the query token's rows are also kept exact
(``query.rows``, cut to the JSON's decimals), and the page shows those for it, so a weight
of the summary and the same weight on the page are one number. The characters the terminal shows escaped
(control and bidirectional-override ones, :data:`multihead._args.CONTROLS`) are escaped in
the page's data and shown escaped (``\\u202e``, ``\\r``), never obeyed; the text keeps its
newlines and tabs. JSON is strict (no ``NaN``/``Infinity``), and every file is
built in memory before the first one is written, each through a temporary file
(:mod:`multihead.inspect.files`): an error leaves no half-written report.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path

from .._args import CONTROLS
from .capture import Capture, Look, headline
from .files import write_all
from .metrics import METRICS, HeadMetrics, round_down, thresholds_text
from .packing import pack_weights
from .plots import head_image


@dataclass
class Inspection:
    """Everything one ``multihead inspect`` run found."""

    model: str
    capture: Capture            # the text shown in detail
    metrics: HeadMetrics        # averaged over every text given
    query: int                  # position of the query token in capture.tokens
    looks: list[Look]           # strongest heads from the query token, best first (listed)
    selected: tuple[int, int]   # (layer, head) shown large
    attention: str = ""         # which tokens each token sees (the model's attention_note)
    every: list[Look] = field(default_factory=list)     # every head's look, best
    #                                     first: the headline's choice (empty: ``looks``)

    def to_dict(self, digits: int = 4, *, curve: str = "sqrt") -> dict:
        """JSON-ready: tokens, weights (L, H, S, S) packed with ``curve``
        (:func:`multihead.inspect.packing.unpack_weights` reads them), metrics [L][H] (null
        where not applicable, with the reason in ``not_applicable``), roles, query looks;
        ``causal`` and ``attention`` say whether tokens see only earlier tokens (a decoder)."""
        c, toks = self.capture, self.capture.tokens
        rnd = lambda t: round_down(t, digits).tolist()       # (never up across a threshold)
        L, H = c.weights.shape[:2]
        roles = self.metrics.roles()
        na = self.metrics.not_applicable()
        return {
            "model": self.model, "text": c.text, "tokens": toks, "layers": L, "heads": H,
            "causal": c.causal, "attention": self.attention,
            "truncated": c.truncated, "original_length": c.original_length,
            "texts_averaged": self.metrics.texts,
            "weights": pack_weights(c.weights, curve=curve),
            "metrics": {name: None if name in na else rnd(self.metrics.value(name))
                        for name in METRICS},
            "not_applicable": na,
            "roles": [[[r, round_down(s, digits)] for r, s in row] for row in roles],
            "thresholds": thresholds_text(skip=na),
            "query": {"position": self.query, "token": toks[self.query],
                      "rows": rnd(c.weights[:, :, self.query, :]),            # [L][H][S]
                      "heads": [{"layer": k.layer, "head": k.head, "target": k.target,
                                 "target_token": toks[k.target], "weight": round_down(k.weight, digits),
                                 "label": k.label(toks, self.query)} for k in self.looks]},
            "selected": {"layer": self.selected[0], "head": self.selected[1]},
            "summary": self.summary(),
        }

    def summary(self) -> str:
        """One line: token count, truncation, texts averaged, the headline look."""
        c = self.capture
        s = (f"{len(c.tokens)} tokens" + (f" (truncated from {c.original_length})" if c.truncated
                                          else "")
             + f"; metrics averaged over {self.metrics.texts} text(s)")
        best = headline(self.every or self.looks, self.query, c.tokens)
        if best is not None:
            back = " (looking back)" if c.causal else ""
            far = "long-range " if best.long_range(self.query) else ""   # (none is further)
            s += (f"; strongest {far}head from the query token{back}: "
                  + best.label(c.tokens, self.query))
        elif c.causal:
            s += (f"; the query token {c.tokens[self.query]!r} has no word before it, and a "
                  f"decoder's token sees only itself and earlier tokens: pick a later word "
                  f"with --query-token")
        return s


def _json(obj) -> str:
    """Strict JSON: NaN or infinity raise ``ValueError`` instead of writing invalid JSON."""
    return json.dumps(obj, ensure_ascii=False, allow_nan=False)


def _safe_json(obj) -> str:
    """JSON that cannot close its ``<script>`` element or start markup."""
    return CONTROLS.sub(lambda m: f"\\u{ord(m[0]):04x}",     # (only inside strings: raw there)
                        _json(obj).replace("<", "\\u003c").replace(">", "\\u003e")
                        .replace("&", "\\u0026"))


def html(inspection: Inspection) -> str:
    """The report page (one string, nothing external): the data of ``inspect.json`` (the
    same packed weights: the page's numbers are the JSON's), and the pattern of the
    characters it shows escaped (as the terminal does)."""
    template = resources.files(__package__).joinpath("report.html").read_text(encoding="utf-8")
    return template.replace("__DATA__", _safe_json({**inspection.to_dict(),
                                                   "controls": CONTROLS.pattern}))


#: the file each text format is written to
TEXT_FILES = {"json": "inspect.json", "html": "report.html"}


def known_names(formats: set[str], selected: tuple[int, int] | None = None) -> tuple[str, ...]:
    """The files :func:`write` makes for ``formats`` before the text is read: all of them
    when the head shown large is ``selected`` (layer, head), else all but its image, whose
    name says which head (``head_L3H1.png``).

    Example:
        >>> known_names({"json", "png"}), known_names({"svg"}, (3, 1))
        (('inspect.json', 'heads.png'), ('heads.svg', 'head_L3H1.svg'))
    """
    images = [f for f in ("png", "svg") if f in formats]
    return (tuple(TEXT_FILES[f] for f in TEXT_FILES if f in formats)
            + tuple(f"heads.{f}" for f in images)
            + (tuple(head_image(*selected, f) for f in images) if selected else ()))


def render(inspection: Inspection, formats: set[str]) -> dict[str, bytes]:
    """Every requested file (html, json, png, svg) as ``{file name: content}``, in memory."""
    files = {}
    if "json" in formats:
        files[TEXT_FILES["json"]] = _json(inspection.to_dict()).encode("utf-8")
    if "html" in formats:
        files[TEXT_FILES["html"]] = html(inspection).encode("utf-8")
    images = formats & {"png", "svg"}
    if images:
        from .plots import render_figures
        files.update(render_figures(inspection, images))
    return files


def write(inspection: Inspection, out: Path, formats: set[str]) -> list[Path]:
    """Write the requested formats (html, json, png, svg) into ``out``; returns the paths.

    Everything is rendered first, then each file replaces its name atomically (a symlink
    planted at a name is replaced, never followed).
    """
    return write_all(out, render(inspection, formats))

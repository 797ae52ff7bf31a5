"""Heatmap figures (matplotlib, imported only here): the layer × head grid and one head large.

Figures are sized for reading, not in proportion to the text: a long text's heatmaps are
max-pooled (each pixel shows the largest weight of the block of tokens it covers, so a sharp
diagonal stays visible), the large figure is at most :data:`BIG_INCHES` square, and its
axes label every token only while the labels can be read (beyond :data:`LABELS` tokens, every
k-th token is labelled with its position).

Notation used for tensor shapes: L layers, H heads, S tokens.
"""

from __future__ import annotations

import io
import math
import warnings

import torch
import torch.nn.functional as F

from .._args import plain
from .metrics import shown

#: pixels per side of a head's thumbnail in the grid figure (larger texts are pooled)
THUMB = 128
#: pixels per side of the large heatmap (larger texts are pooled)
BIG = 512
#: the large figure's side, inches, at most
BIG_INCHES = 12.0
#: the most tokens labelled along an axis of the large figure
LABELS = 80
#: the longest side of a PNG, pixels
MAX_PIXELS = 2400


def pooled(weights: torch.Tensor, n: int) -> torch.Tensor:
    """Max-pool the last two dimensions of ``weights`` ``(..., S, S)`` to at most ``n`` × ``n``.

    Example:
        >>> w = torch.eye(6)
        >>> pooled(w, 3).tolist()
        [[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [0.0, 0.0, 1.0]]

    Shapes:
        weights: (..., S, S); returns (..., ceil(S / k), ceil(S / k)), k = ceil(S / n).
    """
    S = weights.shape[-1]
    k = math.ceil(S / n)
    if k <= 1:
        return weights
    pad = k * math.ceil(S / k) - S
    x = F.pad(weights.reshape(-1, 1, S, S), (0, pad, 0, pad))                  # (N, 1, S', S')
    x = F.max_pool2d(x, k)                                                      # (N, 1, S'/k, S'/k)
    return x.reshape(*weights.shape[:-2], *x.shape[-2:])


#: tokens and names are drawn as they are: a ``$`` pair is not TeX math (a token ``$$``
#: failed to parse), whatever the user's matplotlibrc says
LITERAL_TEXT = {"text.parse_math": False, "text.usetex": False}


#: matplotlib's own last-resort font draws a box for every character: it is no fallback
PLACEHOLDER_FONT = "Last Resort"


class MissingGlyphs(UserWarning):
    """Characters of a figure's text that no installed font draws (they show as boxes)."""


def fonts_for(texts) -> tuple[list[str], str]:
    """The installed font families that draw the characters of ``texts`` that matplotlib's
    default font lacks (its fallbacks, in order), and the characters that none draws.

    Example:
        >>> fonts_for(["the animal", "L3H1"])
        ([], '')
    """
    from matplotlib import font_manager as fm
    from matplotlib.ft2font import FT2Font

    def drawn(path: str) -> set[str]:
        return set(map(chr, FT2Font(path).get_charmap()))

    chars = {ch for t in texts for ch in t if ch.isprintable() and not ch.isspace()}
    missing = chars - drawn(fm.findfont(fm.FontProperties()))
    upright = {}                    # family: its upright face nearest to normal weight
    for f in fm.fontManager.ttflist:
        near = (abs(f.weight - 400) if isinstance(f.weight, int) else 0, f.fname)
        if f.style == "normal" and not f.name.startswith(PLACEHOLDER_FONT):
            upright[f.name] = min(upright.get(f.name, near), near)
    families = []
    for name, (_, fname) in sorted(upright.items()):
        if not missing:
            break
        try:
            has = drawn(fname)
        except (OSError, RuntimeError):
            continue
        if missing & has:
            families.append(name)
            missing -= has
    return families, "".join(sorted(missing))


def _dpi(fig, want: int = 200) -> float:
    """``want`` dpi, lowered so that the figure's longest side stays within MAX_PIXELS."""
    return min(want, MAX_PIXELS / max(fig.get_size_inches()))


def _grid(plt, inspection, w: torch.Tensor):
    """Every head's (pooled) heatmap, one row per layer, drawn as one image (72 small axes
    would cost seconds to lay out and draw)."""
    import numpy as np
    L, H, S = w.shape[0], w.shape[1], w.shape[-1]
    roles = inspection.metrics.roles()
    thumbs = pooled(w, THUMB).numpy()                                           # (L, H, s, s)
    s = thumbs.shape[-1]
    gx, gy = max(1, s // 6), max(2, s // 3)            # gaps between tiles; gy holds a title
    mosaic = np.full((L * (s + gy), H * (s + gx) - gx), np.nan, dtype=np.float32)
    for l in range(L):
        for h in range(H):
            top, left = l * (s + gy) + gy, h * (s + gx)
            mosaic[top:top + s, left:left + s] = thumbs[l, h]
    fig = plt.figure(figsize=(1.2 * H, 1.3 * L + 0.4))
    ax = fig.add_axes((0.01, 0.01, 0.98, 1 - 0.45 / (1.3 * L + 0.4)))
    cmap = plt.get_cmap("Blues").with_extremes(bad="white")
    ax.imshow(mosaic, cmap=cmap, vmin=0, vmax=1, interpolation="nearest", aspect="auto")
    ax.set_axis_off()
    for l in range(L):
        for h in range(H):
            ax.text(h * (s + gx) + s / 2, l * (s + gy) + gy * 0.9, f"L{l}H{h}\n{roles[l][h][0]}",
                    ha="center", va="bottom", fontsize=6)
    pooled_note = "" if s == S else "; long text: max over blocks of tokens"
    causal = "\ndecoder (causal): nothing above the diagonal" if inspection.capture.causal else ""
    fig.suptitle(f"{plain(inspection.model)}: attention of every head ({S} tokens{pooled_note}){causal}",
                 fontsize=9)
    return fig


def _big(plt, inspection, w: torch.Tensor):
    """The selected head, large, with its tokens on the axes (every k-th for long texts)."""
    c = inspection.capture
    S = len(c.tokens)
    l, h = inspection.selected
    role, score = inspection.metrics.roles()[l][h]
    side = min(BIG_INCHES, max(4.0, 0.28 * S + 2))
    fig, ax = plt.subplots(figsize=(side, side * 0.92))
    image = pooled(w[l, h], BIG).numpy()                                        # (s, s)
    im = ax.imshow(image, cmap="Blues", vmin=0, vmax=1, interpolation="nearest",
                   extent=(-0.5, S - 0.5, S - 0.5, -0.5))                       # axes in tokens
    step = math.ceil(S / LABELS)
    ticks = list(range(0, S, step))
    names = [plain(c.tokens[i]) if step == 1 else f"{plain(c.tokens[i])} {i}" for i in ticks]
    ax.set_xticks(ticks, names, rotation=90, fontsize=7)
    ax.set_yticks(ticks, names, fontsize=7)
    every = "" if step == 1 else f" (every {step}th token labelled)"
    ax.set_xlabel("key" + every)
    ax.set_ylabel("query")
    pooled_note = "" if image.shape[-1] == S else ", max over blocks of tokens"
    ax.set_title(f"L{l}H{h}: {role} ({shown(score)}{pooled_note})", fontsize=9)
    fig.colorbar(im, ax=ax, fraction=0.046)
    fig.tight_layout()
    return fig


def head_image(layer: int, head: int, fmt: str) -> str:
    """The file name of one head's large heatmap.

    Example:
        >>> head_image(3, 1, "png")
        'head_L3H1.png'
    """
    return f"head_L{layer}H{head}.{fmt}"


def render_figures(inspection, formats: set[str]) -> dict[str, bytes]:
    """``heads.{fmt}`` (every head) and ``head_L{l}H{h}.{fmt}`` (the selected head), as bytes.

    Args:
        inspection: a :class:`multihead.inspect.report.Inspection`.
        formats: a subset of ``{"png", "svg"}``.

    Returns:
        ``{file name: content}``.
    """
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    w = inspection.capture.weights                                              # (L, H, S, S)
    l, h = inspection.selected
    # (drawn as the terminal and the page show them: a control character escaped, which
    # an SVG could not hold, nor a font draw)
    fallbacks, missing = fonts_for([plain(inspection.model), *map(plain, inspection.capture.tokens)])
    fonts = {"font.family": [*matplotlib.rcParams["font.family"], *fallbacks]}
    files = {}
    with matplotlib.rc_context({**LITERAL_TEXT, **fonts}), warnings.catch_warnings():
        if missing:           # (said once, below; matplotlib also names a character it
            #                    has next to a combining one it lacks: '#' of "##ि")
            warnings.filterwarnings("ignore", r"Glyph \d+ .*missing from font", UserWarning)
        figures = ((_grid(plt, inspection, w), "heads.{}".format),
                   (_big(plt, inspection, w), lambda fmt: head_image(l, h, fmt)))
        try:
            for fmt in sorted(formats):
                for fig, name in figures:
                    buf = io.BytesIO()
                    fig.savefig(buf, format=fmt, dpi=_dpi(fig) if fmt == "png" else None)
                    files[name(fmt)] = buf.getvalue()
        finally:
            for fig, _ in figures:
                plt.close(fig)
    if missing:
        shown_chars = "".join(missing[:20]) + ("…" if len(missing) > 20 else "")
        warnings.warn(MissingGlyphs(
            f"no installed font draws {shown_chars!r}: the PNG/SVG figures show boxes for "
            f"{'them' if len(missing) > 1 else 'it'} (report.html and inspect.json are "
            f"unaffected); install a font that has them, such as Noto (Debian: fonts-noto-cjk "
            f"for Chinese, Japanese and Korean)"), stacklevel=2)
    return files

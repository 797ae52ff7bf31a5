"""Heatmap figures (matplotlib, imported only here): the layer × head grid and one head large.

Notation used for tensor shapes: L layers, H heads, S tokens.
"""

from __future__ import annotations

from pathlib import Path


def save_figures(inspection, out: Path, formats: set[str]) -> list[Path]:
    """Write ``heads.{fmt}`` (every head) and ``head_L{l}H{h}.{fmt}`` (the selected head)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    c = inspection.capture
    w = c.weights.numpy()                                             # (L, H, S, S)
    L, H, S = w.shape[0], w.shape[1], w.shape[2]
    roles = inspection.metrics.roles()
    written = []

    grid, axes = plt.subplots(L, H, figsize=(1.2 * H, 1.3 * L), squeeze=False)
    for l in range(L):
        for h in range(H):
            ax = axes[l][h]
            ax.imshow(w[l, h], cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
            ax.set_xticks([])
            ax.set_yticks([])
            ax.set_title(f"L{l}H{h}\n{roles[l][h][0]}", fontsize=6)
    grid.suptitle(f"{inspection.model}: attention of every head ({S} tokens)", fontsize=9)
    grid.tight_layout()

    l, h = inspection.selected
    big, ax = plt.subplots(figsize=(max(4.0, 0.28 * S + 2), max(3.5, 0.28 * S + 1.5)))
    im = ax.imshow(w[l, h], cmap="Blues", vmin=0, vmax=1, interpolation="nearest")
    ax.set_xticks(range(S), c.tokens, rotation=90, fontsize=7)
    ax.set_yticks(range(S), c.tokens, fontsize=7)
    ax.set_xlabel("key")
    ax.set_ylabel("query")
    ax.set_title(f"L{l}H{h}: {roles[l][h][0]} ({roles[l][h][1]:.2f})", fontsize=9)
    big.colorbar(im, ax=ax, fraction=0.046)
    big.tight_layout()

    for fmt in sorted(formats):
        for fig, stem in ((grid, "heads"), (big, f"head_L{l}H{h}")):
            p = out / f"{stem}.{fmt}"
            fig.savefig(p, dpi=200 if fmt == "png" else None)
            written.append(p)
    plt.close(grid)
    plt.close(big)
    return written

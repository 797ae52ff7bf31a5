"""Write a benchmark run: a rich table, ``results.json``, ``results.md`` and ``results.png``."""

from __future__ import annotations

import io
import json
import shlex
import textwrap
from dataclasses import asdict
from pathlib import Path

from .._files import atomic_write_all
from .units import duration, si


def _rate(row) -> str:
    r, unit = row["rate"], row["unit"]
    if r is None:
        return "-"
    if unit in ("FLOP/s", "B/s"):
        return si(r, unit)
    return f"{r:.0f} {unit}" if r >= 100 else f"{r:.3g} {unit}"      # 2.65 texts/s, not 3


def _peers(row) -> list[str]:
    """Each peer's time and ratio; one whose calls did not settle (its spread past the
    rule) is marked, as our own time's spread is: its ratio is not to be trusted.

    Example:
        >>> _peers({"peers": {"sdpa": {"median_ms": 2.0, "ratio": 2.0, "settled": False},
        ...                   "flex": {"median_ms": 1.0, "ratio": 1.0, "compile_s": 3.2}}})
        ['sdpa: 2.00 ms (2.00x, unsettled)', 'flex: 1.00 ms (1.00x, compile 3.2 s)']
    """
    out = []
    for name, p in row["peers"].items():
        if "skipped" in p:
            out.append(f"{name}: {p['skipped']}")
        else:
            extra = f", compile {p['compile_s']:.1f} s" if "compile_s" in p else ""
            extra += "" if p.get("settled", True) else ", unsettled"
            out.append(f"{name}: {duration(p['median_ms'] / 1e3)} ({p['ratio']:.2f}x{extra})")
    if "overhead_us" in row:
        out.append(f"overhead = ours - {row.get('overhead_vs', 'sdpa')}: "
                   f"{duration(row['overhead_us'] / 1e6)} per call")
    return out


def _spread(o) -> str:
    """The fastest and slowest call against the median, each side on its own (a slow
    outlier is not a symmetric "±": 1.20, 1.56 and 19.7 ms are "-23% +1163%").

    Example:
        >>> _spread({"median_ms": 1.56, "low_ms": 1.2, "high_ms": 19.7, "settled": False})
        '-23% +1163% (unsettled)'
    """
    m = o["median_ms"]
    below, above = ((m - o["low_ms"]) / m, (o["high_ms"] - m) / m) if m else (0, 0)
    return f"-{below:.0%} +{above:.0%}" + ("" if o.get("settled", True) else " (unsettled)")


def lines(run) -> list[list[str]]:
    """One list of cells per row: case, mode, ours, spread, rate, % limit, peak MiB, peers
    (for a case that did not run: why, in the peers' column)."""
    out = []
    for r in run.rows:
        o = r["ours"]
        if o is None:
            out.append([r["case"], r["mode"], "not run", "-", "-", "-", "-", "-", r["skipped"]])
            continue
        frac = r["fraction_of_limit"]
        out.append([r["case"], r["mode"], duration(o["median_ms"] / 1e3), _spread(o),
                    _rate(r), "-" if frac is None else f"{frac:.0%}",
                    f"{o['peak_bytes'] / 2**20:.1f}",
                    f"{r['naive_bytes'] / 2**20:.1f}" if r["naive_bytes"] else "-",
                    "; ".join(_peers(r))])
    return out


HEADER = ["case", "mode", "ours", "spread", "achieved", "of limit", "peak MiB", "naive MiB",
          "peers: time (their time / ours)"]


def header_text(run) -> str:
    """The run's first line: command, machine, and the limits measured."""
    lim = run.limits
    cold = " --cold-l2" if run.cold_l2 else ""
    only = "".join(f" --family {shlex.quote(f)}" for f in run.families or ())
    return (f"multihead bench --suite {run.suite}{only} --device {run.device} --dtype "
            f"{run.dtype}{cold}: "
            f"{run.machine}. Limits measured in this run: matmul {si(lim.gemm_flops, 'FLOP/s')}, "
            f"memory read {si(lim.read_bw, 'B/s')}."
            + (f" {run.timing}" if run.timing else "")
            + (f" {run.busy}" if run.busy else "")
            + (" INTERRUPTED: partial results." if run.interrupted else ""))


NOTES = ("FLOPs: 4·B·H·Sq·Sk·D forward, 2.5x that for the backward, only the unmasked pairs "
         "counted for sparse masks (FlashAttention's convention); module rows add the "
         "projections. Decode rows are memory-bound: K/V cache bytes read per second. Ratio = "
         "peer time / our time (above 1: we are faster). 'naive MiB' = the H·S² score matrices "
         "a naive implementation materializes (decode rows: its scores and the K/V it repeats "
         "to every query head; '-' where no naive peer runs); naive peers are refused where that does not fit. "
         "Per-call overhead rows: a call small enough that launching it is the cost; "
         "'overhead' = our time - that of the SDPA call the row names, per call.")


#: the files :func:`write` puts in ``--out``
FILES = ("results.json", "results.md", "results.png")


def write(run, out: Path, *, plot: bool = True) -> list[Path]:
    """Write results.json, results.md and (with ``plot``) results.png into ``out``, all or
    none (every content is rendered and staged before any file is replaced; a reader never
    sees half a file; a symlink there is replaced, not followed); returns their paths. A
    missing ``out`` is made, and removed again if the write fails."""
    data = {"suite": run.suite, "families": run.families, "device": run.device,
            "dtype": run.dtype, "machine": run.machine,
            "limits": asdict(run.limits), "cold_l2": run.cold_l2, "timing": run.timing,
            "busy": run.busy,
            "interrupted": run.interrupted, "seconds": run.seconds, "notes": NOTES,
            "rows": run.rows}
    body = ["| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    body += ["| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |" for cells in lines(run)]
    files = {out / "results.json": json.dumps(data, indent=2),
             out / "results.md": f"# Benchmark results\n\n{header_text(run)}\n\n"
                                 + "\n".join(body) + f"\n\n{NOTES}\n"}
    if plot:
        files[out / "results.png"] = _plot(run)
    return atomic_write_all(files)


def _plot(run) -> bytes:
    """Time vs sequence length (log-log) for dense and causal attention, and (CUDA suites)
    the time of each mask kind at the longest length measured, ours against each peer, as
    PNG bytes."""
    done = [r for r in run.rows if r["ours"] is not None and r["mode"] == "fwd"]
    fams = {}
    for r in done:
        if r["seq"] is not None and r["family"] in ("dense", "causal"):
            fams.setdefault(r["family"], []).append(r)
    masks = [r for r in done if r["family"] == "masks"]
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    panels = max(1, len(fams) + bool(masks))
    fig, axes = plt.subplots(1, panels, figsize=(5.5 * panels, 4), squeeze=False)
    for ax, (fam, rows) in zip(axes[0], fams.items()):
        rows = sorted(rows, key=lambda r: r["seq"])
        xs = [r["seq"] for r in rows]
        ax.plot(xs, [r["ours"]["median_ms"] for r in rows], "o-", label="multihead", lw=2)
        for name in rows[0]["peers"]:
            pts = [(r["seq"], r["peers"][name]["median_ms"]) for r in rows
                   if "median_ms" in r["peers"].get(name, {})]
            if pts:
                ax.plot(*zip(*pts), "s--", label=name)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("sequence length")
        ax.set_ylabel("time (ms)")
        ax.set_title(f"{fam} attention, forward")
        ax.legend(fontsize=7)
    if masks:
        _mask_bars(axes[0][-1], masks)
    if not fams and not masks:
        axes[0][0].text(0.5, 0.5, "no multi-length cases measured", ha="center")
    head = header_text(run).split(". Limits")[0]              # the command and the machine
    head += ". INTERRUPTED: partial results." if run.interrupted else ""
    fig.suptitle(textwrap.fill(head, 80 * panels), fontsize=7)   # (~80 characters an inch of 5.5)
    fig.tight_layout()
    png = io.BytesIO()
    try:
        fig.savefig(png, format="png", dpi=120)
    finally:
        plt.close(fig)
    return png.getvalue()


def _mask_bars(ax, rows) -> None:
    """Horizontal bars: one group per mask kind at the longest length, ours and each peer."""
    S = max(r["seq"] for r in rows)
    rows = [r for r in rows if r["seq"] == S]
    series = {"multihead": [r["ours"]["median_ms"] for r in rows]}
    for name in ("sdpa", "sdpa + dense mask", "flex_attention (compiled)"):
        series[name] = [r["peers"].get(name, {}).get("median_ms", 0.0) for r in rows]
    height = 0.8 / len(series)
    for i, (name, ms) in enumerate(series.items()):
        ax.barh([j + i * height for j in range(len(rows))], ms, height, label=name)
    ax.set_yticks([j + 0.4 - height / 2 for j in range(len(rows))])
    ax.set_yticklabels([r["case"].split(",")[0] for r in rows], fontsize=7)
    ax.set_xscale("log")
    ax.set_xlabel("time (ms); no bar: not measured")
    ax.set_title(f"mask kinds, S={S}, forward")
    ax.legend(fontsize=7)

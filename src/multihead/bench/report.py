"""Write a benchmark run: a rich table, ``results.json``, ``results.md`` and ``results.png``."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path


def _rate(row) -> str:
    r, unit = row["rate"], row["unit"]
    if r is None:
        return "-"
    if unit == "FLOP/s":
        return f"{r / 1e9:.1f} GFLOP/s"
    if unit == "B/s":
        return f"{r / 1e9:.1f} GB/s"
    return f"{r:.0f} {unit}"


def _peers(row) -> list[str]:
    out = []
    for name, p in row["peers"].items():
        if "skipped" in p:
            out.append(f"{name}: {p['skipped']}")
        else:
            extra = f", compile {p['compile_s']:.1f} s" if "compile_s" in p else ""
            out.append(f"{name}: {p['median_ms']:.2f} ms ({p['ratio']:.2f}x{extra})")
    return out


def lines(run) -> list[list[str]]:
    """One list of cells per row: case, mode, ours, spread, rate, % limit, peak MiB, peers."""
    out = []
    for r in run.rows:
        o = r["ours"]
        frac = r["fraction_of_limit"]
        spread = (o["high_ms"] - o["low_ms"]) / o["median_ms"] if o["median_ms"] else 0
        out.append([r["case"], r["mode"], f"{o['median_ms']:.2f} ms", f"±{spread / 2:.0%}",
                    _rate(r), "-" if frac is None else f"{frac:.0%}",
                    f"{o['peak_bytes'] / 2**20:.1f}", f"{r['naive_bytes'] / 2**20:.0f}",
                    "; ".join(_peers(r))])
    return out


HEADER = ["case", "mode", "ours", "spread", "achieved", "of limit", "peak MiB", "naive MiB",
          "peers: time (their time / ours)"]


def header_text(run) -> str:
    """The run's first line: command, machine, and the limits measured."""
    lim = run.limits
    return (f"multihead bench --suite {run.suite} --device {run.device} --dtype {run.dtype}: "
            f"{run.machine}. Limits measured in this run: matmul {lim.gemm_flops / 1e9:.1f} "
            f"GFLOP/s, memory read {lim.read_bw / 1e9:.1f} GB/s."
            + (" INTERRUPTED: partial results." if run.interrupted else ""))


NOTES = ("FLOPs: 4·B·H·Sq·Sk·D forward, 2.5x that for the backward, only the unmasked pairs "
         "counted for sparse masks (FlashAttention's convention); module rows add the "
         "projections. Decode rows are memory-bound: K/V cache bytes read per second. Ratio = "
         "peer time / our time (above 1: we are faster). 'naive MiB' = the H·S² score matrices "
         "a naive implementation materializes; naive peers are refused where that does not fit.")


def write(run, out: Path) -> list[Path]:
    """Write results.json, results.md and results.png into ``out``; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    data = {"suite": run.suite, "device": run.device, "dtype": run.dtype, "machine": run.machine,
            "limits": asdict(run.limits), "interrupted": run.interrupted, "seconds": run.seconds,
            "notes": NOTES, "rows": run.rows}
    js = out / "results.json"
    js.write_text(json.dumps(data, indent=2))
    md = out / "results.md"
    body = ["| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    body += ["| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |" for cells in lines(run)]
    md.write_text(f"# Benchmark results\n\n{header_text(run)}\n\n" + "\n".join(body)
                  + f"\n\n{NOTES}\n")
    paths = [js, md]
    png = _plot(run, out / "results.png")
    if png is not None:
        paths.append(png)
    return paths


def _plot(run, path: Path):
    """Time vs sequence length (log-log) for the families measured at several lengths."""
    fams = {}
    for r in run.rows:
        if r["seq"] is not None and r["mode"] == "fwd" and r["family"] in ("dense", "causal"):
            fams.setdefault(r["family"], []).append(r)
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, max(1, len(fams)), figsize=(5.5 * max(1, len(fams)), 4),
                             squeeze=False)
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
    if not fams:
        axes[0][0].text(0.5, 0.5, "no multi-length cases measured", ha="center")
    fig.suptitle(header_text(run)[:110], fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path

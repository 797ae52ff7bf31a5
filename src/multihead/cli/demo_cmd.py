"""``multihead demo``: the seeds' claims reproduced on real numbers.

``multihead demo scaling``: why scores are divided by sqrt(d_k), and -inf vs -1e9 masks in
float16 (seed 004, exercises 1 and 2). ``multihead demo heads``: several heads vs one head
vs heads sharing W_Q/W_K/W_V, trained on a task that needs two relations (exercise 3).
"""

from __future__ import annotations

import io
import json

from .._args import counted
from .._files import atomic_write_all
from ._common import console, int_in, path, prepare_out, summary, table, wrote

#: seeds are 32-bit (the experiment derives seed + 1 and seed + 2 from it)
MAX_SEED = 2**32 - 1
#: each draw holds 11 float64 vectors of d_k = 4096 (~360 KB): 5000 draws are ~1.8 GB
MAX_DRAWS = 5000
#: draws per d_k when --draws is not given
DRAWS = 500
#: the default run is 1000 steps; 100 times that is already far past any use
MAX_STEPS = 100_000


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="reproduce the seeds' claims (scaling, heads)",
                       description=summary(__doc__))
    p.add_argument("name", choices=["scaling", "heads"], help="which demonstration")
    p.add_argument("--seed", type=int_in(0, MAX_SEED), default=0, help="random seed (0)")
    p.add_argument("--draws", type=int_in(2, MAX_DRAWS),
                   help=f"scaling: draws per d_k, 2 to {MAX_DRAWS} ({DRAWS})")
    p.add_argument("--quick", action="store_true", help="heads: a short run (CI smoke test)")
    p.add_argument("--steps", type=int_in(1, MAX_STEPS),
                   help=f"heads: training steps, 1 to {MAX_STEPS} (1000; --quick 150)")
    p.add_argument("--out", type=path, help="heads: write heads.png and heads.json here")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


#: the options that only one demonstration reads
ONLY = {"scaling": ("draws",), "heads": ("quick", "steps", "out")}


def run(args) -> int:
    for name, options in ONLY.items():
        given = [o for o in options if name != args.name and getattr(args, o) not in (None, False)]
        if given:
            raise ValueError(f"--{given[0]} applies to 'demo {name}' only, not to 'demo "
                             f"{args.name}': drop it, or run 'multihead demo {name}'")
    return _scaling(args) if args.name == "scaling" else _heads(args)


def _scaling(args) -> int:
    from ..analysis.scaling import GRAD_FORMAT, fp16_masking, scaling, summary
    draws = DRAWS if args.draws is None else args.draws
    rows, masks = scaling(draws=draws, seed=args.seed), fp16_masking(args.seed)
    if args.json:
        print(json.dumps({"scaling": rows, "fp16_masking": masks}, indent=2))
        return 0
    con = console(markup=False)
    t = table(f"q, k ~ N(0, 1); softmax over 10 keys; mean of {draws} draws (seed {args.seed})",
              ("d_k", "sqrt(d_k)", "std q·k", "seed 004 says", "max prob", "grad",
               "std q·k/sqrt(d_k)", "max prob (scaled)", "grad (scaled)"))
    for r in rows:
        t.add_row(str(r["d_k"]), f"{r['sqrt_d_k']:.1f}", f"{r['unscaled_std']:.2f}",
                  f"≈ {r['seed_004_unscaled_std']}", f"{r['unscaled_max_prob']:.3f}",
                  f"{r['unscaled_grad']:{GRAD_FORMAT}}", f"{r['scaled_std']:.3f}",
                  f"{r['scaled_max_prob']:.3f}", f"{r['scaled_grad']:.2g}")
    con.print(t)
    con.print("grad: the median norm of the softmax's Jacobian, how much the weights move when "
              "the scores do (unscaled, one figure: it moves several-fold with the seed).",
              style="dim")
    con.print(summary(rows), style="dim")
    cols = ("mask", "row 0 (keys 2, 3 masked)", "row 1 (all masked)")
    m = table("fp16: masking keys 2-3 of row 0 and every key of row 1", cols, left=cols)
    fmt = lambda w: "NaN" if w is not None and None in w else ", ".join(f"{x:.3f}" for x in w)
    for r in masks:
        if r["error"]:
            m.add_row(r["method"], f"torch error: {r['error']}", "")
        else:
            m.add_row(r["method"], fmt(r["partly_masked_row"]), fmt(r["fully_masked_row"]))
    con.print(m)
    con.print("-1e9 does not fit in float16 (max 65504): masked_fill refuses it and a cast mask "
              "becomes -inf, so an all-masked row is NaN; finfo(fp16).min instead spreads that "
              "row over the masked keys, and a bias of -16 or less added to it overflows to -inf and "
              "NaN again. multihead masks with -inf and returns zeros for a row with nothing to "
              "attend to.", style="dim")
    return 0


def _heads(args) -> int:
    from dataclasses import replace

    from ..analysis import heads_experiment as hx
    setup = hx.Setup.quick() if args.quick else hx.Setup()
    setup = replace(setup, seed=args.seed, **({"steps": args.steps} if args.steps else {}))
    prepare_out(args.out, ("heads.json", "heads.png"))
    con = console(markup=False)
    if not args.json:
        steps = counted(setup.steps, "step")
        con.print(f"Task: y[t] = (x[t-1] + 2·x[t-3]) mod {setup.vocab}, T={setup.length}, "
                  f"d_model={setup.d_model}, {steps} of batch {setup.batch}, seed {setup.seed}.")
    from .._progress import track
    kinds = ("h=8", "h=1", "h=8 shared")
    results = [hx.train(k, setup) for k in track(kinds, not args.json, len(kinds), "training")]
    text = hx.finding(results, setup)
    data = {"setup": setup.__dict__, "prediction": hx.PREDICTION, "finding": text,
            "results": [r.__dict__ for r in results]}
    if args.out is not None:
        atomic_write_all({args.out / "heads.json": json.dumps(data, indent=2),
                          args.out / "heads.png": _plot(results)})
    if args.json:
        print(json.dumps(data, indent=2))
        return 0
    t = table("One attention layer, equal d_model", ("model", "parameters", "eval loss",
              "accuracy", "train s", "what each head attends to"),
              left=("model", "what each head attends to"))
    for r in results:
        t.add_row(r.kind, f"{r.parameters:,}", f"{r.loss:.3f}", f"{r.accuracy:.1%}",
                  f"{r.seconds:.1f}", ", ".join(r.relations()))
    con.print(t)
    con.print(f"Prediction ({hx.PREDICTION})", style="dim")
    con.print(f"Finding: {text}")
    if args.out is not None:
        wrote(con, args.out / "heads.png", args.out / "heads.json")
    return 0


def _plot(results) -> bytes:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, len(results), figsize=(4 * len(results), 3.2), squeeze=False)
    for ax, r in zip(axes[0], results):
        im = ax.imshow(r.offset_profile, cmap="Blues", vmin=0, vmax=1, aspect="auto")
        ax.set_xlabel("offset k (weight on x[t-k])")
        ax.set_ylabel("head")
        ax.set_yticks(range(len(r.offset_profile)))
        ax.set_title(f"{r.kind}: accuracy {r.accuracy:.1%}", fontsize=10)   # (as the table)
    fig.colorbar(im, ax=axes[0].tolist(), fraction=0.02)
    png = io.BytesIO()
    try:
        fig.savefig(png, format="png", dpi=150, bbox_inches="tight")
    finally:
        plt.close(fig)
    return png.getvalue()

"""``multihead params``: parameters, memory and FLOPs of attention layers, checked on a real module.

Seed 003's claims as numbers: 4d² parameters whatever the number of heads, the h·n² score
matrices naive attention materializes, and how MQA/GQA shrink the KV cache.
"""

from __future__ import annotations

import json
import re

from ..analysis.params import DTYPES
from ._common import console, int_in, summary, table


#: the accepted range of each numeric option: far beyond any real model, small enough that
#: the meta-device check stays instant and no count overflows
LIMITS = {"d-model": 2**20, "heads": 2**16, "kv-heads": 2**16, "head-dim": 2**16,
          "layers": 100_000, "seq": 2**30, "batch": 2**20}


def add_parser(sub) -> None:
    p = sub.add_parser("params", help="parameter, memory and FLOP counts of attention layers",
                       description=summary(__doc__))
    n = {k: int_in(1, hi) for k, hi in LIMITS.items()}
    p.add_argument("--preset", help="a named configuration (see --table)")
    p.add_argument("--d-model", type=n["d-model"], help="model width d")
    p.add_argument("--heads", type=n["heads"], help="query heads h")
    p.add_argument("--kv-heads", type=n["kv-heads"],
                   help="K/V heads (GQA; 1 = MQA; default: heads)")
    p.add_argument("--head-dim", type=n["head-dim"], help="d_k (default d_model / heads)")
    p.add_argument("--layers", type=n["layers"],
                   help="attention layers (default: 1, or the preset's)")
    p.add_argument("--seq", type=n["seq"], default=2048, help="sequence length n (2048)")
    p.add_argument("--batch", type=n["batch"], default=1, help="batch size (1)")
    p.add_argument("--dtype", default="bf16", choices=DTYPES, metavar="DTYPE",
                   help=f"bytes per element: {', '.join(DTYPES)} (bf16)")
    p.add_argument("--no-bias", action="store_true", help="projections without biases")
    p.add_argument("--table", action="store_true",
                   help="every preset side by side, and MHA vs GQA vs MQA cache sizes")
    p.add_argument("--json", action="store_true", help="print JSON instead of tables")


#: the options that shape the layer, by their field in AttentionShape
SHAPE_OPTIONS = {"d_model": "--d-model", "heads": "--heads", "kv_heads": "--kv-heads",
                 "head_dim": "--head-dim", "layers": "--layers"}


def _options_named(e: ValueError, preset: str | None = None, given=()) -> ValueError:
    """AttentionShape's message with its fields spelled as this command's options; with a
    ``preset``, a value shown that the command line did not ``give`` is said to be the
    preset's.

    Example:
        >>> str(_options_named(ValueError("heads (8) must be a multiple of kv_heads (3)")))
        '--heads (8) must be a multiple of --kv-heads (3)'
        >>> str(_options_named(ValueError("d_model (512) must be divisible by heads (12)"),
        ...                    "gpt2-small", given=["d_model"]))
        "--d-model (512) must be divisible by --heads (12, the gpt2-small preset's)"
    """
    names = "|".join(sorted(SHAPE_OPTIONS, key=len, reverse=True))

    def spelled(m):
        option, value = SHAPE_OPTIONS[m[1]], m[2]
        if value is None:
            return option
        whose = f", the {preset} preset's" if preset is not None and m[1] not in given else ""
        return f"{option} ({value}{whose})"
    return ValueError(re.sub(rf"(?<![\w-])({names})\b(?: \((\d+)\))?", spelled, str(e)))


def _shape(args):
    from dataclasses import asdict

    from ..analysis.params import AttentionShape, preset
    given = {k: getattr(args, k) for k in SHAPE_OPTIONS if getattr(args, k) is not None}
    try:
        if args.preset is not None:
            s = preset(args.preset)
            if args.no_bias:
                given["bias"] = False
            now = {**asdict(s), "kv_heads": s.hkv, "head_dim": s.dk}     # (its effective sizes)
            over = {k: v for k, v in given.items() if now[k] != v}     # (named as changed)
            if not over:
                return s
            changed = ", ".join(f"{k}={v}" for k, v in over.items())  # no longer the preset
            return AttentionShape(**{**asdict(s), **given, "name": f"{s.name} (changed: {changed})",
                                     "source": f"{s.source}, changed here ({changed})"})
        if args.d_model is None or args.heads is None:
            named = [f"--{k.replace('_', '-')}" for k in given] + (
                ["--no-bias"] if args.no_bias else [])       # (what asked for one configuration)
            listed = ", ".join(named[:-1]) + (" and " if len(named) > 1 else "") + named[-1] \
                if named else ""
            said = f"{listed} {'is' if len(named) == 1 else 'are'} not enough to " \
                   f"describe a configuration: " if named else ""
            raise ValueError(f"{said}give --preset NAME, or --d-model and --heads"
                             + ("" if args.table else " (see --table for presets)"))
        return AttentionShape(args.d_model, args.heads, kv_heads=args.kv_heads,
                              head_dim=args.head_dim, layers=args.layers or 1,
                              bias=not args.no_bias)
    except ValueError as e:
        raise _options_named(e, args.preset, given) from None


def _variants(s):
    """The same model as MHA, GQA and MQA, each once: GQA with 8 K/V heads where the heads
    divide into 8 groups (LLaMA-2-70B's 64), else with half the heads, else the largest
    group count that divides them (9 heads: 3); with 1, 2 or a prime number of heads, none.

    Example:
        >>> from multihead.analysis.params import AttentionShape
        >>> [[v.kind for v in _variants(AttentionShape(64 * h, h))] for h in (64, 12, 9, 8, 7)]
        [['MHA', 'GQA-8', 'MQA'], ['MHA', 'GQA-6', 'MQA'], ['MHA', 'GQA-3', 'MQA'], ['MHA', 'GQA-4', 'MQA'], ['MHA', 'MQA']]
    """
    h = s.heads
    groups = [8] if h % 8 == 0 and h > 8 else [d for d in range(h // 2, 1, -1) if h % d == 0][:1]
    kvs = sorted({h, *groups, 1, s.hkv}, reverse=True)               # (most K/V heads first)
    return [s.with_kv_heads(k) for k in kvs]


def run(args) -> int:
    from ..analysis.params import PRESETS, human_bytes, human_count, report
    kw = dict(seq=args.seq, batch=args.batch, dtype=args.dtype)
    if args.table:
        rows = [report(s, **kw) for s in PRESETS.values()]
        shaped = args.preset is not None or args.no_bias or any(
            getattr(args, k) is not None for k in SHAPE_OPTIONS)
        focus = _shape(args) if shaped else PRESETS["llama2-70b"]
        variants = [report(v, **kw) for v in _variants(focus)]
        if args.json:
            print(json.dumps({"presets": rows, "kv_variants": variants}, indent=2))
            return 0
        _print_table(rows, variants, focus, args, human_bytes, human_count)
        return 0
    r = report(_shape(args), **kw)
    if args.json:
        print(json.dumps(r, indent=2))
        return 0
    _print_one(r, human_bytes, human_count)
    return 0


def _print_one(r, hb, hc) -> None:
    c, con = r["config"], console(markup=False)
    t = table(f"{c['name'] or 'attention'}: d={c['d_model']}, h={c['heads']}, "
              f"h_kv={c['kv_heads']} ({c['kind']}), d_k={c['head_dim']}, layers={c['layers']}, "
              f"n={r['seq']}, batch={r['batch']}, {r['dtype']}", ("quantity", "value"),
              left=("quantity",))
    check = "= sum(p.numel()) of a real MultiHeadAttention" if r["params_match_module"] else \
        f"!= module ({r['params_per_layer_module']:,})"
    rows = [
        ("parameters per layer", f"{r['params_per_layer']:,}  ({check})"),
        ("  4d² (+4d): MHA with h·d_k = d", f"{r['mha_equivalent_params_per_layer']:,}"),
        ("parameters, all layers", f"{r['params_all_layers']:,}"),
        ("naive attention scores h·n², per layer per sequence",
         hb(r["naive_scores_bytes_per_layer_per_sequence"])),
        ("  fused backend instead (fp32 log-sum-exp h·n)",
         hb(r["fused_extra_bytes_per_layer_per_sequence"])),
        ("KV cache per token, one layer", hb(r["kv_cache_bytes_per_token_per_layer"])),
        ("KV cache per token, all layers", hb(r["kv_cache_bytes_per_token"])),
        ("KV cache per sequence (n tokens)", hb(r["kv_cache_bytes_per_sequence"])),
        ("KV cache for the batch", hb(r["kv_cache_bytes_batch"])),
        ("FLOPs per token, projections, all layers", hc(r["flops_per_token_projections"])),
        ("FLOPs per token, attention core (causal, average), all layers",
         hc(r["flops_per_token_attention_core_avg"])),
        ("FLOPs per sequence, all layers", hc(r["flops_per_sequence"])),
    ]
    for q, v in rows:
        t.add_row(q, v)
    con.print(t)
    con.print("FLOPs: 2 per multiply-add; attention core 4·h·n²·d_k forward, halved by the causal "
              "mask (FlashAttention's convention).", style="dim")


def _print_table(rows, variants, focus, args, hb, hc) -> None:
    con = console(markup=False)
    t = table(f"Seed 003's configurations (n={args.seq}, {args.dtype})",
              ("model", "d", "h", "h_kv", "d_k", "layers", "params/layer", "= 4d²\n(+4d)",
               "module", "KV/token", "scores/layer"), left=("model",))
    for r in rows:
        c = r["config"]
        four = "yes" if r["params_per_layer"] == r["mha_equivalent_params_per_layer"] else \
            f"no: {c['kind']}"
        t.add_row(c["name"], str(c["d_model"]), str(c["heads"]), str(c["kv_heads"]),
                  str(c["head_dim"]), str(c["layers"]), f"{r['params_per_layer']:,}", four,
                  "ok" if r["params_match_module"] else "MISMATCH",
                  hb(r["kv_cache_bytes_per_token"]), hb(r["naive_scores_bytes_per_layer_per_sequence"]))
    con.print(t)
    con.print("params/layer by the formula; = 4d² (+4d): the count MHA with h·d_k = d has (4d² "
              "weights, + 4d biases where the model has biases); module = the same count from "
              "sum(p.numel()) of a real "
              "MultiHeadAttention; KV/token over all layers; scores/layer = the h·n² matrix naive "
              "attention materializes per sequence.", style="dim")
    kinds = [r["config"]["kind"].split("-")[0] for r in variants]
    named = ", ".join(dict.fromkeys(kinds[:-1])) + f" and {kinds[-1]}" if len(kinds) > 1 \
        else kinds[0]
    v = table(f"{focus.name or 'this model'}: the KV cache as {named} "
              f"(n={args.seq}, batch={args.batch}, {args.dtype})",
              ("variant", "kv heads", "params/layer", "cache/token", "cache/sequence",
               "cache/batch", "vs MHA"), left=("variant",))
    base = variants[0]["kv_cache_bytes_per_token"]
    for r in variants:
        c = r["config"]
        v.add_row(c["kind"], str(c["kv_heads"]), f"{r['params_per_layer']:,}",
                  hb(r["kv_cache_bytes_per_token"]), hb(r["kv_cache_bytes_per_sequence"]),
                  hb(r["kv_cache_bytes_batch"]), f"{r['kv_cache_bytes_per_token'] / base:.3f}x")
    con.print(v)

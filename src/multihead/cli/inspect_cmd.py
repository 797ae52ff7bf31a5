"""``multihead inspect``: what each head of a real model does, for any text.

Loads the model (default: the embedded all-MiniLM-L6-v2; ``--model`` takes a BERT-family
encoder, a GPT-2/Llama/Mistral/Qwen2 decoder, or BART, whose encoder is shown), captures
every head's attention for the text, prints a table of head roles with the scores behind
them and the heads that attend most from the query token ("L3H1: it → animal 0.68"; a
decoder's only to earlier tokens), and with ``--out`` writes an offline HTML report,
PNG/SVG heatmaps and the raw data as JSON.
"""

from __future__ import annotations

import codecs
import warnings
from pathlib import Path

from ._common import console, int_in, path, prepare_out, summary, wrote

DEFAULT_TEXT = "The animal didn't cross the street because it was too tired."
FORMATS = ("html", "json", "png", "svg")


def add_parser(sub) -> None:
    p = sub.add_parser("inspect", help="show what each attention head does for a text",
                       description=summary(__doc__))
    p.add_argument("text", nargs="?", help=f"the text (default: {DEFAULT_TEXT!r})")
    p.add_argument("--file", type=path, help="texts, one per line: head metrics are averaged over "
                   "all of them (the first, or TEXT, is shown in detail)")
    p.add_argument("--model", type=path, help="a model directory (config.json, model.safetensors, "
                   "tokenizer.json): a BERT-family encoder, a GPT-2, Llama, Mistral or Qwen2 "
                   "decoder, or a BART encoder-decoder (its encoder's attention is shown); all "
                   "but BERT need transformers: pip install 'multihead[hf]'; default: the "
                   "embedded all-MiniLM-L6-v2")
    p.add_argument("--query-token", help="the word whose attention is followed "
                   "(default: the first pronoun)")
    p.add_argument("--layer", type=int_in(None, None),
                   help="layer of the head shown large (0-based)")
    p.add_argument("--head", type=int_in(None, None), help="head shown large (0-based)")
    p.add_argument("--top", type=int_in(1, 100000), default=8,
                   help="heads listed for the query token (8)")
    p.add_argument("--out", type=path, help="directory for the report files")
    p.add_argument("--format",
                   help=f"what --out gets, comma-separated from {','.join(FORMATS)} (all)")
    p.add_argument("--metrics", action="store_true",
                   help="print every metric of every head (one row per head)")
    p.add_argument("--no-truncate", action="store_true",
                   help="refuse texts longer than the model's positions instead of truncating")


def _formats(spec: str) -> set[str]:
    got = {f.strip().lower() for f in spec.split(",") if f.strip()}
    bad = sorted(got - set(FORMATS))
    if bad or not got:
        raise ValueError(f"--format {spec!r}: unknown {bad or 'empty'}; choose from {','.join(FORMATS)}")
    return got


def _texts(args) -> list[tuple[int | None, str]]:
    """The texts the metrics average over, the one shown in detail first, each with its
    line number in ``--file`` (None: TEXT, or the default text)."""
    from ..inspect.capture import check_utf8
    others = []
    if args.text is not None:
        check_utf8(args.text, "TEXT (the command-line text)")
    if args.query_token is not None:
        check_utf8(args.query_token, "--query-token")
    if args.file is not None:
        others = [(i + 1, ln) for i, ln in enumerate(_read_lines(args.file)) if ln.strip()]
        if not others:
            raise ValueError(f"--file {str(args.file)!r} holds no text (one text per line)")
    if args.text is not None or not others:
        others.insert(0, (None, DEFAULT_TEXT if args.text is None else args.text))
    if not others[0][1].strip():
        raise ValueError("the text is empty: give some words to inspect, e.g. "
                         f"multihead inspect {DEFAULT_TEXT!r}")
    return others


def _read_lines(path: Path) -> list[str]:
    """The lines of the UTF-8 text file ``--file``, split at line feeds only (a text may hold
    a form feed or U+2028; a line's ending ``\\r`` and a leading byte-order mark are dropped).

    Example:
        >>> import tempfile
        >>> with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as f:
        ...     _ = f.write("one\\u2028line\\r\\ntwo\\fparts\\n".encode())
        >>> _read_lines(Path(f.name))
        ['one\\u2028line', 'two\\x0cparts']
        >>> Path(f.name).unlink()
    """
    try:
        data = path.read_bytes()
    except OSError as e:
        raise ValueError(f"--file {str(path)!r} cannot be read ({e.strerror or e}): "
                         f"pass a readable text file, one text per line") from None
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ValueError(f"--file {str(path)!r} is not UTF-8 text (line {line}, byte "
                         f"0x{data[e.start]:02x} at offset {e.start}): save it as UTF-8, e.g. "
                         f"iconv -f latin1 -t utf-8 FILE > FILE.utf8") from None
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()                                  # the file's last line feed ends a line
    return [ln[:-1] if ln.endswith("\r") else ln for ln in lines]


def _check_index(name: str, value: int | None, size: int, what: str) -> None:
    if value is not None and not 0 <= value < size:
        raise ValueError(f"--{name} {value} is out of range: the model has {size} {what} "
                         f"(0..{size - 1})")


def _select(args, cap, every, query: int) -> tuple[int, int]:
    """The head shown large: ``--layer`` and ``--head``; with one of them, the headline
    (:func:`multihead.inspect.capture.headline`) of the looks from the query token by that
    layer's heads (or by that head in every layer); with neither, the headline of ``every``
    head's look (not only of the ``--top`` listed: their number must not change it)."""
    L, H = cap.weights.shape[:2]
    _check_index("layer", args.layer, L, "layers")
    _check_index("head", args.head, H, "heads per layer")
    if args.layer is not None and args.head is not None:
        return args.layer, args.head
    from ..inspect.capture import headline
    looks = [k for k in every if args.layer in (None, k.layer) and args.head in (None, k.head)]
    best = headline(looks, query, cap.tokens)
    if best is not None:
        return best.layer, best.head
    return (args.layer or 0), (args.head or 0)


def _capture(model, text: str, line: int | None, args):
    """:func:`multihead.inspect.capture.capture`, its errors saying which ``--file`` line."""
    from ..inspect.capture import InspectError, capture
    try:
        return capture(model, text, truncate=not args.no_truncate)
    except InspectError as e:
        if line is None:
            raise
        raise type(e)(f"--file {str(args.file)!r} line {line}: {e}") from None


def run(args) -> int:
    formats = set(FORMATS) if args.format is None else _formats(args.format)
    if args.out is None and args.format is not None:
        raise ValueError(f"--format {args.format!r} says what --out gets, and no --out was "
                         f"given: add --out DIR, or drop --format")
    (first, shown), *rest = _texts(args)
    from ..inspect.report import known_names
    chosen = None if args.layer is None or args.head is None else (args.layer, args.head)
    prepare_out(args.out, known_names(formats, chosen))

    from ..inspect.capture import InspectError, PartOfWordError, find_query, strongest_looks
    from ..inspect.metrics import HeadMetrics
    from ..inspect.report import Inspection, write
    from ..models import load
    from .._progress import track

    err = console(stderr=True)
    model = load(args.model)
    cap = _capture(model, shown, first, args)
    if cap.truncated and first is None:
        err.print(f"[yellow]warning:[/] the text has {cap.original_length} tokens; keeping the first "
                  f"{len(cap.tokens)} (the model's positions). Pass --no-truncate to refuse instead.")
    metrics = HeadMetrics.of(cap.weights, cap.tokens, causal=cap.causal, windows=cap.windows)
    cut = [(first, cap.original_length)] if cap.truncated and first is not None else []
    for line, text in track(rest, len(rest) > 20, len(rest), "inspecting"):
        c = _capture(model, text, line, args)
        metrics.add(c.weights, c.tokens)
        if c.truncated:
            cut.append((line, c.original_length))                  # (line of --file, its tokens)
    if cut:
        (line, n), more = cut[0], len(cut) - 1
        err.print(f"[yellow]warning:[/] {len(cut)} line(s) of --file are longer than the "
                  f"model's {model.config.max_position_embeddings} positions (line {line}: {n} "
                  f"tokens{f', and {more} more' if more else ''}); their metrics use the first "
                  f"tokens only. Pass --no-truncate to refuse instead.", highlight=False)
    try:
        metrics.check_measured()
    except ValueError as e:
        raise InspectError(str(e)) from None
    try:
        query = find_query(model, cap.tokens, args.query_token, cap.words, text=cap.text,
                           spans=cap.spans, name="--query-token")
    except InspectError as e:
        if (isinstance(e, PartOfWordError) or not cap.truncated
                or args.query_token.casefold() not in cap.text.casefold()):
            raise
        raise InspectError(f"{e} (the text was cut to the model's "
                           f"{model.config.max_position_embeddings} positions: {len(cap.tokens)} "
                           f"of its {cap.original_length} tokens are read, and a word after "
                           f"them cannot be the query: pick one from the start)") from None
    L, H = cap.weights.shape[:2]
    every = strongest_looks(cap.weights, cap.tokens, query, top=L * H, causal=cap.causal)
    selected = _select(args, cap, every, query)
    result = Inspection(model.name, cap, metrics, query, every[:args.top], selected,
                        attention=getattr(model, "attention_note", ""), every=every)

    if args.out is not None:         # the files first: a reader that leaves (``| head -1``) keeps them
        from rich.markup import escape

        from ..inspect.plots import MissingGlyphs
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", MissingGlyphs)
            paths = write(result, args.out, formats)
        for w in caught:             # ours as one warning line; any other as Python shows it
            if issubclass(w.category, MissingGlyphs):
                err.print(f"[yellow]warning:[/] {escape(str(w.message))}", highlight=False)
            else:
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        for p in paths:
            wrote(err, p)
    from .inspect_view import show
    show(result, console(), full=args.metrics)
    return 0

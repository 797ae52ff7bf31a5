"""``multihead bench``: measure multihead against every installed peer, on this machine.

The machine's matmul FLOP/s and memory read bandwidth are measured first, in the same run;
every row reports time, the achieved rate, its fraction of that limit, peak memory, and
the ratio against each peer. ``--out`` writes results.json, results.md and results.png.
The cases are sized for ``--device`` (the CPU suites are frozen; the CUDA ones go to 32k
tokens); on CUDA, times come from CUDA events around batches of calls, or around single
calls after an L2 flush with ``--cold-l2``. A case that cannot run here says why in its row.
Ctrl-C keeps the cases measured so far (the files say ``interrupted``); before the first case
finishes it writes nothing, so an earlier run's results are not replaced by an empty one.
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from pathlib import Path

from .._args import counted
from ._common import console, path, prepare_out, summary, wrote


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmark against torch, HF and the tutorial on this machine",
                       description=summary(__doc__))
    p.add_argument("--suite", default="quick", help="quick (< 1 min on 2 CPU cores), standard "
                   "or full (default quick)")
    p.add_argument("--device", default="cpu", help="cpu or cuda (default cpu)")
    p.add_argument("--dtype", default="fp32", help="fp32, bf16 or fp16 (cuda), or torch's names "
                   "float32, bfloat16, float16 (default fp32)")
    p.add_argument("--cold-l2", action="store_true", help="cuda: flush the L2 cache before every "
                   "timed call and time calls singly (default: batches of back-to-back calls, "
                   "warm caches)")
    p.add_argument("--family", action="append", help="run only the suite's cases of this family "
                   "(e.g. 'decode'; 'hf model' is in --suite standard; repeatable)")
    p.add_argument("--out", type=path, help="directory for results.json, results.md, results.png")


def run(args) -> int:
    from ..bench.catalog import suite_cases
    from ..bench.report import FILES
    from ..bench.suite import check_target, run_suite
    check_target(args.device, args.dtype, args.cold_l2)
    if args.family:                                  # (--family decode --family decode)
        args.family = list(dict.fromkeys(args.family))
    cases = suite_cases(args.suite, args.device, args.family)
    prepare_out(args.out, FILES)

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ..bench.timing import busy_note, others_running, usable_cores
    err = console(stderr=True)
    busy = busy_note(others_running(), usable_cores())
    if busy:                                         # (said again above the table)
        err.print(f"warning: {busy}", markup=False)
    result = None
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                      TimeElapsedColumn(), console=err, transient=True) as bar:
            task = bar.add_task("measuring the machine's limits", total=len(cases))
            result = run_suite(args.suite, args.device, args.dtype, cold_l2=args.cold_l2,
                               busy=busy, families=args.family,
                               progress=lambda c: bar.update(task, description=c.name[:60]),
                               on_row=lambda r: bar.advance(task))
    except KeyboardInterrupt:       # (while measuring the machine's limits, before any case)
        pass
    if result is None or (result.interrupted and not result.rows):
        return _nothing_measured(args.out)
    failed = None                   # a write that fails still shows the table, then says why
    stopped = False                 # Ctrl-C while writing the files
    if args.out is not None:        # the files first: a reader that leaves (``| head -1``),
        try:                        # a full stdout or Ctrl-C while printing keeps them
            stopped = _save(result, args.out, err, len(cases))
        except Exception as e:      # noqa: BLE001 (raised again below, after the table)
            failed = e
    try:
        _show(result, console(width=160, markup=False))
    except KeyboardInterrupt:
        saved = args.out is not None and failed is None
        err.print("interrupted while printing the table"
                  + (f"; the results measured are saved in {args.out}" if saved else ""),
                  markup=False)
        return 130
    if failed is not None:
        raise failed
    if result.interrupted:
        err.print(f"interrupted: {len(result.rows)} of {len(cases)} cases measured"
                  + (f", saved in {args.out}" if args.out is not None else ""), markup=False)
        return 130
    if stopped:
        err.print(f"interrupted while writing: all {counted(len(cases), 'case')} were measured "
                  f"and saved in {args.out}", markup=False)
        return 130
    return 0


def _nothing_measured(out: Path | None) -> int:
    """Ctrl-C before any case finished: write nothing (an earlier run's results stay)."""
    kept = ""
    if out is not None:
        old = out / "results.json"
        kept = (f"; the results already in {out} are left as they were" if old.exists()
                else f"; nothing written to {out}")
    print(f"multihead bench: interrupted before any case finished{kept}", file=sys.stderr)
    return 130


def _save(result, out: Path, err, planned: int) -> bool:
    """Write the results; Ctrl-C while writing writes results.json and results.md again
    (results.png is left as it is), with Ctrl-C ignored for that moment, so the files on
    disk are whole and say whether the run was interrupted: it was if fewer than
    ``planned`` cases were measured (a complete run stopped while writing is complete).
    Returns whether Ctrl-C came while writing."""
    from ..bench.report import write
    stopped = False
    try:
        paths = write(result, out)
    except KeyboardInterrupt:
        stopped = True
        result.interrupted = len(result.rows) < planned
        png = (out / "results.png").exists()
        with _sigint_ignored():
            paths = write(result, out, plot=False)
        err.print(f"results.png in {out} was not {'updated' if png else 'written'}",
                  markup=False)
    for p in paths:
        wrote(err, p)
    return stopped


@contextlib.contextmanager
def _sigint_ignored():
    """Ignore Ctrl-C inside the block (only the main thread can; elsewhere, no change)."""
    old = signal.getsignal(signal.SIGINT)
    if old is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _show(result, con) -> None:
    from rich.table import Table

    from ..bench.report import HEADER, NOTES, header_text, lines
    con.print(header_text(result))
    t = Table(show_lines=True)
    for col in HEADER:
        t.add_column(col, overflow="fold")
    for cells in lines(result):
        t.add_row(*cells)
    con.print(t)
    con.print(NOTES, style="dim")
    not_run = sum(r["ours"] is None for r in result.rows)
    con.print(f"{counted(len(result.rows), 'case')} in {result.seconds:.0f} s"
              + (f"; {not_run} not run (the reason is in the row)" if not_run else ""), style="dim")

"""Run a suite: the machine's limits first, then every case against its peers, same run.

Each row holds our median time and spread, the achieved rate and its fraction of the
measured limit, peak memory, and for every peer its time and ``peer time / our time``
(above 1: we are faster), or why it did not run. A case that cannot be built or whose own
call fails (a model package that is not installed, out of memory, ...) is a row that says
why, and the suite goes on. Ctrl-C stops the run; what was measured is kept.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass, field

import torch

from .._device import available_memory
from .cases import Case
from .catalog import device_type, suite_cases
from .flex import NotComparable, compile_limits, forbid_recompiles
from .measure import DTYPE_ALIASES, DTYPES, Limits, describe, machine_limits, peak_memory
from .timing import busy_note, describe_timing, measure, others_running, usable_cores

#: a naive peer runs only if its score matrices (times this factor) fit in free memory
NAIVE_HEADROOM = 3


@dataclass
class Run:
    """A suite's results: the machine, its limits, one row per case measured."""

    suite: str
    device: str
    dtype: str
    machine: str
    limits: Limits
    rows: list = field(default_factory=list)
    interrupted: bool = False
    seconds: float = 0.0
    cold_l2: bool = False
    timing: str = ""          # how the times were taken (one sentence)
    busy: str = ""            # other work running as the run began (a sentence), or ""
    families: list | None = None   # the --family options: only these cases were run


def check_target(device: str, dtype: str, cold_l2: bool = False) -> tuple[torch.device, torch.dtype]:
    """Validate --device, --dtype and --cold-l2; one clear error each.

    Example:
        >>> check_target("cpu", "bf16"), check_target("cpu", "float32")
        ((device(type='cpu'), torch.bfloat16), (device(type='cpu'), torch.float32))
    """
    device_type(device)
    given, dtype = dtype, DTYPE_ALIASES.get(dtype, dtype)
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda: CUDA is not available here (torch {torch.__version__}, "
                         f"no GPU found): use --device cpu")
    if dtype not in DTYPES:
        raise ValueError(f"--dtype {dtype!r} is unknown: choose one of {', '.join(DTYPES)} "
                         f"(or torch's names: {', '.join(DTYPE_ALIASES)})")
    if device == "cpu" and dtype == "fp16":
        raise ValueError(f"--dtype {given} is not supported on the CPU (emulated, not a fast "
                         f"path anyone would use): use fp32 or bf16 on the CPU, {given} on cuda")
    if cold_l2 and device != "cuda":
        raise ValueError(f"--cold-l2 needs --device cuda: it flushes the GPU's L2 cache before "
                         f"each timed call; on {device} the times are wall clock with warm caches "
                         f"(drop --cold-l2)")
    return torch.device(device), DTYPES[dtype]


def _ms(stats) -> dict:
    return {"median_ms": stats.median * 1e3, "low_ms": stats.low * 1e3,
            "high_ms": stats.high * 1e3, "reps": stats.reps, "calls": stats.calls,
            "settled": stats.settled}


def _first_line(e: BaseException, limit: int = 160) -> str:
    return (str(e).strip().splitlines() or [""])[0][:limit]


def why_not(e: Exception) -> str:
    """A row's or peer's reason: ``skipped: ...`` for something not installed here,
    ``failed: Type: message`` for anything else.

    Example:
        >>> why_not(ImportError("transformers is not installed"))
        'skipped: transformers is not installed'
        >>> why_not(RuntimeError("CUDA out of memory. Tried to allocate 16.00 GiB"))
        'failed: RuntimeError: CUDA out of memory. Tried to allocate 16.00 GiB'
    """
    from ..models.loading import ModelLoadError
    if isinstance(e, (ImportError, ModelLoadError)):
        return f"skipped: {_first_line(e, 300)}"
    return f"failed: {type(e).__name__}: {_first_line(e)}"


def _release(device: torch.device) -> None:
    """Return a failed or finished case's memory to the device (CUDA's free memory is what
    the naive peers are refused against)."""
    if device.type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def run_case(case: Case, device, dtype, limits: Limits, reps: int, *,
             cold_l2: bool = False) -> dict:
    """Time ``case`` and its peers. If the case cannot be built or our call fails, the row
    says why (``skipped``) and has no times; a peer that cannot run says why in its entry."""
    row = {"family": case.family, "case": case.name, "seq": case.seq, "mode": case.mode,
           "unit": None, "ours": None, "flops": None, "bytes": None, "items": None, "rate": None,
           "fraction_of_limit": None, "naive_bytes": 0, "peers": {}}
    budget = 15 if device.type == "cpu" else 3
    timed = lambda fn: measure(fn, device, reps=reps, budget_s=budget, cold_l2=cold_l2)
    _release(device)
    built = None
    try:
        built = case.build(device, dtype)
        ours = timed(built.ours)
        peak = peak_memory(built.ours, device)
    except KeyboardInterrupt:
        raise
    except Exception as e:  # noqa: BLE001 (a case that cannot run here is a row that says why)
        row["skipped"], built = why_not(e), None
    if built is None:               # (released once the traceback, which holds tensors, is gone)
        _release(device)
        return row
    work = next((w for w in (built.flops, built.bytes, built.items) if w is not None), None)
    rate = work / ours.median if work is not None else None
    limit = limits.gemm_flops if built.unit == "FLOP/s" else limits.read_bw if built.unit == "B/s" \
        else None
    row.update({"unit": built.unit, "ours": {**_ms(ours), "peak_bytes": peak},
                "flops": built.flops, "bytes": built.bytes, "items": built.items, "rate": rate,
                "fraction_of_limit": rate / limit if rate is not None and limit else None,
                "naive_bytes": built.naive_bytes})
    free = available_memory(device)
    for name, fn in built.peers.items():
        if isinstance(fn, str):
            row["peers"][name] = {"skipped": fn}
            continue
        if name in built.naive and built.naive_bytes * NAIVE_HEADROOM > free:
            row["peers"][name] = {"skipped": f"refused: its O(H·S²) scores need "
                                             f"{built.naive_bytes * NAIVE_HEADROOM / 2**30:.1f} GiB, "
                                             f"{free / 2**30:.1f} GiB free"}
            continue
        entry, s = {}, None
        try:
            if name in built.compile:          # compiled: fresh, checked, then no recompiles
                entry = built.compile[name]()
                with forbid_recompiles():
                    s = timed(fn)
            else:
                s = timed(fn)
        except KeyboardInterrupt:
            raise
        except NotComparable as e:
            row["peers"][name] = {**entry, "skipped": f"not measured: {e}"}
            continue
        except Exception as e:  # noqa: BLE001 (a peer's own failure is a result, not our crash)
            row["peers"][name] = {"skipped": why_not(e)}
        if s is None:               # (released once the traceback, which holds tensors, is gone)
            _release(device)
            continue
        row["peers"][name] = {**entry, **_ms(s), "ratio": s.median / ours.median}
    base = row["peers"].get(built.overhead_vs or "", {})
    if "median_ms" in base:
        row["overhead_us"] = (row["ours"]["median_ms"] - base["median_ms"]) * 1e3
        row["overhead_vs"] = built.overhead_vs
    return row


def run_suite(suite: str = "quick", device: str = "cpu", dtype: str = "fp32",
              on_row=None, progress=None, cold_l2: bool = False, families=None,
              busy: str | None = None) -> Run:
    """Measure the limits, then every case of ``suite`` sized for ``device`` (only those of
    ``families`` when given); Ctrl-C keeps what was measured. ``cold_l2`` (CUDA): flush the
    L2 cache before every timed call. ``busy``: :func:`.timing.busy_note` as the caller read
    it (default: read here, before the limits, which are this run's own load)."""
    dev, dt = check_target(device, dtype, cold_l2)
    dtype = DTYPE_ALIASES.get(dtype, dtype)                 # (the run names it as fp32 does)
    cases = suite_cases(suite, dev, families)
    start = time.perf_counter()
    if busy is None:
        busy = busy_note(others_running(), usable_cores())
    run = Run(suite, device, dtype, describe(dev), machine_limits(dev, dt, quick=suite == "quick"),
              cold_l2=cold_l2, timing=describe_timing(dev, cold_l2), busy=busy,
              families=list(families) if families else None)
    reps = 3 if suite == "quick" else 5
    try:
        with compile_limits():
            for case in cases:
                if progress is not None:
                    progress(case)
                row = run_case(case, dev, dt, run.limits, reps, cold_l2=cold_l2)
                run.rows.append(row)
                if on_row is not None:
                    on_row(row)
    except KeyboardInterrupt:
        run.interrupted = True
    run.seconds = time.perf_counter() - start
    return run

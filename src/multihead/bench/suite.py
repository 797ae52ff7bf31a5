"""Run a suite: the machine's limits first, then every case against its peers, same run.

Each row holds our median time and spread, the achieved rate and its fraction of the
measured limit, peak memory, and for every peer its time and ``peer time / our time``
(above 1: we are faster), or why it did not run. Ctrl-C stops the run; what was measured
is kept.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from .cases import Case, suite_cases
from .measure import DTYPES, Limits, available_memory, describe, machine_limits, measure, peak_memory

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


def check_target(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    """Validate --device and --dtype; one clear error each.

    Example:
        >>> check_target("cpu", "bf16")
        (device(type='cpu'), torch.bfloat16)
    """
    if device not in ("cpu", "cuda"):
        raise ValueError(f"unknown device {device!r}: choose cpu or cuda")
    if device == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device cuda: CUDA is not available here (torch {torch.__version__}, "
                         f"no GPU found): use --device cpu")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
    if device == "cpu" and dtype == "fp16":
        raise ValueError("--dtype fp16 is not supported on the CPU (emulated, not a fast path "
                         "anyone would use): use fp32 or bf16 on the CPU, fp16 on cuda")
    return torch.device(device), DTYPES[dtype]


def _ms(stats) -> dict:
    return {"median_ms": stats.median * 1e3, "low_ms": stats.low * 1e3,
            "high_ms": stats.high * 1e3, "reps": stats.reps}


def run_case(case: Case, device, dtype, limits: Limits, reps: int) -> dict:
    """Time ``case`` and its peers; a peer that cannot run says why in its entry."""
    built = case.build(device, dtype)
    ours = measure(built.ours, device, reps=reps, budget_s=15)
    work = built.flops if built.flops is not None else built.bytes
    rate = work / ours.median if work is not None else None
    limit = limits.gemm_flops if built.unit == "FLOP/s" else limits.read_bw if built.unit == "B/s" \
        else None
    row = {"family": case.family, "case": case.name, "seq": case.seq, "mode": case.mode,
           "unit": built.unit, "ours": {**_ms(ours), "peak_bytes": peak_memory(built.ours, device)},
           "flops": built.flops, "bytes": built.bytes, "rate": rate,
           "fraction_of_limit": rate / limit if rate is not None and limit else None,
           "naive_bytes": built.naive_bytes, "peers": {}}
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
        entry = {}
        try:
            if name in built.compile:
                t = time.perf_counter()
                built.compile[name]()
                entry["compile_s"] = time.perf_counter() - t
            s = measure(fn, device, reps=reps, budget_s=15)
        except KeyboardInterrupt:
            raise
        except Exception as e:  # noqa: BLE001 (a peer's own failure is a result, not our crash)
            msg = (str(e).strip().splitlines() or [""])[0][:160]
            row["peers"][name] = {"skipped": f"failed: {type(e).__name__}: {msg}"}
            continue
        row["peers"][name] = {**entry, **_ms(s), "ratio": s.median / ours.median}
    return row


def run_suite(suite: str = "quick", device: str = "cpu", dtype: str = "fp32",
              on_row=None, progress=None) -> Run:
    """Measure the limits, then every case of ``suite``; Ctrl-C keeps what was measured."""
    dev, dt = check_target(device, dtype)
    cases = suite_cases(suite)
    start = time.perf_counter()
    run = Run(suite, device, dtype, describe(dev), machine_limits(dev, dt, quick=suite == "quick"))
    reps = 3 if suite == "quick" else 5
    try:
        for case in cases:
            if progress is not None:
                progress(case)
            row = run_case(case, dev, dt, run.limits, reps)
            run.rows.append(row)
            if on_row is not None:
                on_row(row)
    except KeyboardInterrupt:
        run.interrupted = True
    run.seconds = time.perf_counter() - start
    return run

"""Compiled FlexAttention as a peer, timed only in steady state.

On an H100 (measurements of 2026-11-22) every flex case after the 8th hit dynamo's recompile
limit and silently ran flex's eager path (155 ms where the compiled kernel takes 0.3 ms), and
a ``requires_grad`` mismatch between cases made it recompile. So here:

- each flex peer is compiled fresh (``torch._dynamo.reset()``), with the exact tensors it is
  timed with (``requires_grad`` as timed), and its first call (the compile) is timed apart;
- for the suite, dynamo's recompile limit is raised and hitting it is an error, not a silent
  fall back to eager (:func:`compile_limits`);
- the first call must compile without a failed frame or a graph break, and a second call
  must compile nothing (:func:`steady`); the timed calls then run under dynamo's
  ``fail_on_recompile`` stance (:func:`forbid_recompiles`);
- in a forward case its output must agree with ours (a mask rewritten for flex that drifted
  from ours would be a fast wrong answer).

A peer that fails a check raises :class:`NotComparable`; its entry says why, never a time.

Notation used for tensor shapes: B batch, H heads, S length, D head dim.
"""

from __future__ import annotations

import contextlib
import time
from typing import Callable

import torch

NAME = "flex_attention (compiled)"
#: torch.compile's backend for flex; tests use "eager" (dynamo's guards, no code generation)
COMPILE_BACKEND = "inductor"
#: dynamo's recompile limit during a suite (torch's default is 8)
RECOMPILE_LIMIT = 64
#: a forward output further than this from ours (relative to ours' largest value) is refused
TOLERANCE = 0.05


class NotComparable(RuntimeError):
    """A peer whose time would not be comparable: not in steady state, or a different result."""


@contextlib.contextmanager
def compile_limits(limit: int = RECOMPILE_LIMIT):
    """Raise dynamo's recompile limit (``recompile_limit``, ``cache_size_limit`` in older
    torch) to ``limit`` and make hitting it an error; both are restored on exit.

    Example:
        >>> import torch._dynamo.config as cfg
        >>> before = cfg.cache_size_limit
        >>> with compile_limits(100):
        ...     cfg.cache_size_limit
        100
        >>> cfg.cache_size_limit == before
        True
    """
    import torch._dynamo.config as cfg
    name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    saved = {name: getattr(cfg, name)}
    new = {name: max(limit, saved[name])}
    if hasattr(cfg, "fail_on_recompile_limit_hit") and not getattr(cfg, "suppress_errors", False):
        saved["fail_on_recompile_limit_hit"] = cfg.fail_on_recompile_limit_hit
        new["fail_on_recompile_limit_hit"] = True
    try:
        for key, value in new.items():
            setattr(cfg, key, value)
        yield
    finally:
        for key, value in saved.items():
            setattr(cfg, key, value)


def forbid_recompiles():
    """A context in which a recompile raises (dynamo's ``fail_on_recompile`` stance)."""
    stance = getattr(torch.compiler, "set_stance", None)
    return stance("fail_on_recompile") if stance is not None else contextlib.nullcontext()


def compiles_during(fn: Callable) -> tuple[int, int, int]:
    """Run ``fn()``; return (frames dynamo compiled, of which failed and run eagerly, graph breaks).

    Example:
        >>> f = torch.compile(lambda x: x * 2, backend="eager")
        >>> x = torch.ones(3)
        >>> compiles_during(lambda: f(x)), compiles_during(lambda: f(x))
        ((1, 0, 0), (0, 0, 0))
    """
    from torch._dynamo.utils import counters

    def snap():
        return (counters["frames"]["total"], counters["frames"]["ok"],
                sum(counters["graph_break"].values()))
    before = snap()
    fn()
    after = snap()
    frames, ok = after[0] - before[0], after[1] - before[1]
    return frames, frames - ok, after[2] - before[2]


def steady(run: Callable, sync: Callable[[], None] = lambda: None) -> float:
    """Compile ``run`` by calling it, check it reached steady state, return the first call's
    seconds (compile included). Raises :class:`NotComparable` when nothing was compiled, a
    frame fell back to eager, the graph broke, or a second call compiled again."""
    t = time.perf_counter()
    frames, failed, breaks = compiles_during(run)
    sync()
    seconds = time.perf_counter() - t
    if failed:
        raise NotComparable(f"dynamo failed to compile {failed} frame(s), which run eagerly")
    if breaks:
        raise NotComparable(f"{breaks} graph break(s): part of each call runs eagerly")
    if not frames:
        raise NotComparable("its first call compiled nothing: dynamo is disabled or the "
                            "function was compiled before (not a fresh compile)")
    again = compiles_during(run)[0]
    if again:
        raise NotComparable(f"it recompiled on its second call ({again} frame(s)): its times "
                            f"would include compiles or its eager path")
    return seconds


def mods(kind: str, *, heads: int, device, window: int = 0, doc_lengths=(),
         key_lengths: torch.Tensor | None = None):
    """``(mask_mod, score_mod, mask_batch)``: a case's mask in FlexAttention's terms (S == S).

    Example:
        >>> mask_mod, score_mod, batch = mods("window", heads=1, device="cpu", window=2)
        >>> [bool(mask_mod(0, 0, torch.tensor(3), torch.tensor(k))) for k in range(5)]
        [False, False, True, True, False]
    """
    if kind == "dense":
        return None, None, None
    if kind == "causal":
        return (lambda b, h, q, k: q >= k), None, None
    if kind == "window":
        return (lambda b, h, q, k: (q >= k) & (q - k < window)), None, None
    if kind == "documents":
        doc = torch.repeat_interleave(torch.arange(len(doc_lengths)),
                                      torch.tensor(doc_lengths)).to(device)         # (S,)
        return (lambda b, h, q, k: doc[q] == doc[k]), None, None
    if kind in ("padding", "causal&padding"):
        n = key_lengths.to(device)                                                  # (B,)
        if kind == "padding":
            return (lambda b, h, q, k: k < n[b]), None, len(n)
        return (lambda b, h, q, k: (q >= k) & (k < n[b])), None, len(n)
    if kind == "alibi":
        from ..masks import alibi_slopes
        slopes = alibi_slopes(heads).to(device)                                     # (H,)
        return None, (lambda score, b, h, q, k: score - slopes[h] * (q - k).abs()), None
    raise ValueError(f"kind {kind!r} has no FlexAttention form")


def add_peer(built, peer: Callable, q, k, v, mask_mod, score_mod, mask_batch, *,
             reference: Callable | None = None) -> None:
    """Add compiled flex_attention to ``built`` as a peer, with the compile-and-check step
    that runs before it is timed. ``peer`` wraps a call the way the case times it (forward,
    or forward + backward); ``reference`` returns our forward output to compare with."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        built.peers[NAME] = "not available in this torch"
        return
    S, state = q.shape[2], {}
    run = peer(lambda: state["fn"](q, k, v, score_mod=score_mod, block_mask=state["block"]))
    sync = (lambda: torch.cuda.synchronize(q.device)) if q.device.type == "cuda" else (lambda: None)

    def compile_step() -> dict:
        import torch._dynamo
        torch._dynamo.reset()
        state["block"] = (None if mask_mod is None else
                          create_block_mask(mask_mod, mask_batch, None, S, S, device=str(q.device)))
        state["fn"] = torch.compile(flex_attention, backend=COMPILE_BACKEND, dynamic=False)
        info = {"compile_s": steady(run, sync)}
        if reference is not None:
            ours, theirs = reference().float(), run().float()
            diff = ((theirs - ours).abs().max() / ours.abs().max().clamp_min(1e-30)).item()
            info["max_rel_diff"] = diff
            if not diff <= TOLERANCE:
                raise NotComparable(f"its output differs from ours by {diff:.1%} of our largest "
                                    f"value (the same mask in flex's terms should agree)")
        return info

    built.peers[NAME] = run
    built.compile[NAME] = compile_step

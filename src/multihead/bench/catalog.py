"""Which cases each suite runs, sized for the device.

The CPU suites are frozen (names and sizes): runs before and after a change are compared
row by row. The CUDA suites use GPU sizes: H=16 (H=32 where a model has it), D=128,
sequences up to 32k, decode at B=1 and B=8, one case per mask kind against SDPA with the
mask materialized and compiled flex_attention, and the per-call overhead of a tiny call.
"""

from __future__ import annotations

import torch

from .. import kernels
from .cases import (Case, attention_case, decode_case, dropin_case, mha_case, minilm_case,
                    overhead_case, paged_decode_case)
from .hf_cases import hf_model_cases

SUITES = ("quick", "standard", "full")

#: the mask kinds of the CUDA "masks" family: (kind, sliding window)
MASK_KINDS = (("dense", 0), ("causal", 0), ("window", 256), ("window", 2048), ("documents", 0),
              ("padding", 0), ("causal&padding", 0), ("alibi", 0))
#: the ones the quick CUDA suite keeps
QUICK_MASK_KINDS = (("window", 256), ("documents", 0), ("causal&padding", 0), ("alibi", 0))


def device_type(device: str | torch.device) -> str:
    """``"cpu"`` or ``"cuda"``: the kind of device a suite is sized for (``--device``).

    Example:
        >>> device_type("cuda"), device_type(torch.device("cpu"))
        ('cuda', 'cpu')
    """
    kind = getattr(device, "type", device)
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r} is unknown: choose cpu or cuda")
    return kind


def suite_cases(suite: str, device: str | torch.device = "cpu", families=None) -> list[Case]:
    """The cases of ``quick`` (< 1 min on 2 CPU cores), ``standard`` or ``full`` on ``device``,
    only those of ``families`` when given.

    Example:
        >>> [c.name for c in suite_cases("quick")][:2]
        ['dense, B=1 H=8 S=256 D=64', 'dense, B=1 H=8 S=512 D=64']
        >>> [c.name for c in suite_cases("standard", families=["hf model"])][0][:40]
        'Llama-like 8x512 (GQA 8/2), 32 texts of '
        >>> [c.name for c in suite_cases("quick", "cuda") if c.family == "decode"]
        ['GQA decode step, H=32 Hkv=8 D=128, cache 4096', 'GQA decode step, B=8 H=32 Hkv=8 D=128, cache 4096']
    """
    if suite not in SUITES:
        raise ValueError(f"--suite {suite!r} is unknown: choose one of {', '.join(SUITES)}")
    kind = device_type(device)
    sized = _cpu if kind == "cpu" else _cuda
    cases = sized(suite)
    if families:
        known = sorted({c.family for c in cases})
        unknown = [f for f in families if f not in known]
        if unknown:
            elsewhere = [s for s in SUITES if s != suite and unknown[0] in
                         {c.family for c in sized(s)}]
            other, other_sized = ("cuda", _cuda) if kind == "cpu" else ("cpu", _cpu)
            there = [s for s in SUITES if unknown[0] in {c.family for c in other_sized(s)}]
            where = ""
            if elsewhere:
                where = f" (it is in --suite {elsewhere[0]})"
            elif there:                                  # (this suite's first, if it has it)
                flag = "" if suite in there else f" --suite {there[0]}"
                where = f" (it is in --device {other}{flag})"
            raise ValueError(f"--family {unknown[0]!r} is not in the {suite} suite on {kind}"
                             f"{where}: choose from {', '.join(known)}")
        cases = [c for c in cases if c.family in families]
    return cases


def _overhead() -> list[Case]:
    return [overhead_case("dense"), overhead_case("causal")]


def _small_calls() -> list[Case]:
    """Small masked calls, where deciding and checking are most of the cost: a fresh key
    padding tensor per call, and the drop-in with torch's key_padding_mask."""
    return [overhead_case("padding", B=4),
            dropin_case(16, 16, 64, 4, need_weights=False, padding=True)]


def _dropin(B: int, S: int, E: int, H: int) -> list[Case]:
    """The drop-in on torch's most common calls: its default (weights returned), in
    inference and training, and training with a key padding mask and no weights."""
    return [dropin_case(B, S, E, H), dropin_case(B, S, E, H, train=True),
            dropin_case(B, S, E, H, train=True, need_weights=False, padding=True)]


def _cpu(suite: str) -> list[Case]:
    if suite == "quick":
        return ([attention_case(k, S, H=8) for k in ("dense", "causal") for S in (256, 512)]
                + [attention_case("causal", 512, H=8, train=True),
                   attention_case("window", 1024, H=8, window=64),
                   attention_case("documents", 1024, H=8),
                   decode_case(2048), mha_case(2, 256, 256, 4)])
    lengths = (1024, 2048, 4096) + ((8192, 16384) if suite == "full" else ())
    cases = [attention_case(k, S) for k in ("dense", "causal") for S in lengths]
    cases += [attention_case("causal", 2048, train=True),
              attention_case("window", 4096, flex=True),
              attention_case("window", 4096, train=True),
              attention_case("documents", 4096, flex=True),
              decode_case(4096), decode_case(32768),
              mha_case(8, 512, 768, 12), minilm_case()]
    if suite == "full":
        cases += [attention_case("window", 16384, flex=True),
                  attention_case("documents", 16384), mha_case(8, 512, 768, 12, train=True)]
    cases += _overhead() + hf_model_cases()
    return cases + _dropin(2, 1024, 512, 8) + _small_calls()    # (the newest rows last)


def _cuda(suite: str) -> list[Case]:
    gpu = dict(H=16, D=128)
    quick, full = suite == "quick", suite == "full"
    lengths = ((1024, 4096) if quick else
               (1024, 2048, 4096, 8192, 16384) + ((32768,) if full else ()))
    cases = [attention_case(k, S, **gpu) for k in ("dense", "causal") for S in lengths]
    cases += [attention_case("causal", S, train=True, **gpu)
              for S in ((4096,) if quick else (4096, 16384))]
    if not quick:
        cases += [attention_case(k, 4096, train=True, **gpu) for k in ("window", "documents")]
    kinds = QUICK_MASK_KINDS if quick else MASK_KINDS
    cases += [attention_case(k, S, B=2, window=w or 256, flex=True, family="masks", **gpu)
              for S in ((4096, 16384) if full else (4096,)) for k, w in kinds]
    cases += [decode_case(L, B=B) for B in (1, 8) for L in ((4096,) if quick else (4096, 32768))]
    cases += [mha_case(8, 2048, 1024, 16)] + ([] if quick else [mha_case(8, 2048, 1024, 16,
                                                                          train=True)])
    if not quick:
        cases += _dropin(8, 2048, 1024, 16)
    if full:       # issue 12's band targets (B=1, fwd and fwd+bwd); a 7B-class layer's shape
        cases += [attention_case("window", 16384, window=w, train=t, family="window, S=16384",
                                 **gpu) for w in (256, 2048) for t in (False, True)]
        cases += [attention_case("causal", 8192, H=32, D=128, train=t, family="causal, H=32")
                  for t in (False, True)]
        cases += [attention_case("documents", 16384, longest=2048, train=t, flex=True,
                                 family="documents, S=16384", **gpu) for t in (False, True)]
        # training with attention dropout (p = 0.1): windows and ALiBi through our kernels'
        # draws, causal kept on SDPA's fused kernel; SDPA with its mask and dropout beside
        cases += [attention_case(k, S, window=w, train=True, dropout=0.1, family="dropout",
                                 **gpu)
                  for k, S, w in (("window", 16384, 256), ("window", 16384, 2048),
                                  ("alibi", 4096, 256), ("causal", 4096, 256))]
        if kernels.available():
            cases += [paged_decode_case(32768, B=B) for B in (1, 8)]
    if not quick:
        cases += [minilm_case(), *hf_model_cases()]
    return cases + _overhead() + _small_calls()

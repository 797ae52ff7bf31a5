"""Seed 004's exercises 1 and 2, measured: why scores are divided by sqrt(d_k), and why
masks are -inf (not -1e9) in half precision.

Exercise 1: with q and k drawn from N(0, 1), q·k has variance d_k, so unscaled scores grow
as sqrt(d_k) and the softmax over a row of keys saturates (one key takes nearly all the
weight, and the softmax's gradient, the norm of its Jacobian, shrinks); dividing by
sqrt(d_k) keeps the std near 1.

Exercise 2: -1e9 cannot be stored in float16 (its largest magnitude is 65504): torch refuses
to ``masked_fill`` it, an additive mask cast to float16 becomes -inf, and a row whose keys
are all masked then turns into NaN, while "safe" large negatives silently spread the row's
weight over the masked keys.
"""

from __future__ import annotations

import math

import torch

from .._args import positive_int

SEED_004_UNSCALED_STD = {8: 2.8, 64: 8.0, 512: 22.6, 4096: 64.0}
#: how the unscaled gradient is shown: one figure, since past d_k = 8 its median over 500
#: draws moves with the seed (seeds 0 to 7: 0.051 to 0.092 at d_k=64, 5e-5 to 8e-4 at 512)
GRAD_FORMAT = ".1g"


def scaling(dks=(8, 64, 512, 4096), keys: int = 10, draws: int = 500, seed: int = 0) -> list[dict]:
    """Std of q·k, the mean max softmax probability over ``keys`` keys and the median norm of
    the softmax's Jacobian (its gradient with respect to the scores), unscaled and scaled.

    Example:
        >>> rows = scaling(dks=(64,), draws=200)
        >>> round(rows[0]["unscaled_std"]), round(rows[0]["scaled_std"])
        (8, 1)
    """
    keys = positive_int("keys", keys, hint="the keys a query's softmax spreads over")
    draws = positive_int("draws", draws, least=2, hint="the samples a std is taken over")
    if isinstance(dks, (str, bytes)) or not hasattr(dks, "__iter__"):
        raise TypeError(f"dks must be a sequence of d_k values such as (8, 64), got {dks!r:.60}")
    dks = [positive_int("each d_k", dk) for dk in dks]
    g = torch.Generator().manual_seed(seed)
    rows = []
    for dk in dks:
        q = torch.randn(draws, 1, dk, generator=g, dtype=torch.float64)          # (N, 1, d_k)
        k = torch.randn(draws, keys, dk, generator=g, dtype=torch.float64)       # (N, keys, d_k)
        dots = (q @ k.transpose(1, 2)).squeeze(1)                                # (N, keys)
        scaled = dots / math.sqrt(dk)
        p, ps = torch.softmax(dots, -1), torch.softmax(scaled, -1)                # (N, keys)
        rows.append({
            "d_k": dk, "sqrt_d_k": math.sqrt(dk),
            "unscaled_std": float(dots.std()), "scaled_std": float(scaled.std()),
            "unscaled_max_prob": float(p.amax(-1).mean()),
            "scaled_max_prob": float(ps.amax(-1).mean()),
            "unscaled_grad": _jacobian_norm(p), "scaled_grad": _jacobian_norm(ps),
            "seed_004_unscaled_std": SEED_004_UNSCALED_STD.get(dk),
        })
    return rows


def _jacobian_norm(p: torch.Tensor) -> float:
    """The median over rows of ``||diag(p) - p p^T||_F``, the softmax's Jacobian at weights
    ``p`` ``(N, keys)``: how much the weights move when the scores do (0 when one key has
    all the weight; a uniform row over 10 keys gives 0.30)."""
    jac = torch.diag_embed(p) - p[:, :, None] * p[:, None, :]                 # (N, keys, keys)
    return float(jac.flatten(1).norm(dim=1).median())


def summary(rows: list[dict]) -> str:
    """What the rows of :func:`scaling` show, in words made from their numbers.

    Example:
        >>> print(summary(scaling(dks=(8, 4096), draws=100)))
        Unscaled, the std of q·k grows with d_k (2.9 at d_k=8 to 63.9 at d_k=4096, ...
    """
    lo, hi = rows[0], rows[-1]
    at64 = next((r for r in rows if r["d_k"] == 64), None)
    span = lambda key, f: (f"{min(r[key] for r in rows):{f}} to "
                           f"{max(r[key] for r in rows):{f}}")
    text = (f"Unscaled, the std of q·k grows with d_k ({lo['unscaled_std']:.1f} at d_k="
            f"{lo['d_k']} to {hi['unscaled_std']:.1f} at d_k={hi['d_k']}, sqrt(d_k) is "
            f"{lo['sqrt_d_k']:.1f} to {hi['sqrt_d_k']:.1f}); the largest weight averages "
            f"{lo['unscaled_max_prob']:.3f} to {hi['unscaled_max_prob']:.3f}")
    if at64 is not None:
        text += (f" (seed 004 expects saturation near 1.0 from d_k=64: "
                 f"{at64['unscaled_max_prob']:.3f} there)")
    text += (f", and the softmax's gradient (median Jacobian norm, to one figure: it moves "
             f"with the draws) goes from {lo['unscaled_grad']:{GRAD_FORMAT}} to "
             f"{hi['unscaled_grad']:{GRAD_FORMAT}}. Scaled, the std is "
             f"{span('scaled_std', '.3f')}, the largest weight {span('scaled_max_prob', '.3f')} "
             f"(seed 004 says '0.2 to 0.3'; 10 N(0,1) scores give ~0.32 on average) and the "
             f"gradient {span('scaled_grad', '.3g')}.")
    return text


def _try(fn):
    try:
        return fn(), None
    except RuntimeError as e:
        return None, str(e).splitlines()[0]


def fp16_masking(seed: int = 0) -> list[dict]:
    """Softmax of one fp16 score row with two keys masked and one row with all keys masked,
    masked six ways; what each gives (weights, NaN as None, or torch's error).

    Example:
        >>> rows = {r["method"]: r for r in fp16_masking()}
        >>> rows["-inf in fp16"]["fully_masked_row"], rows["multihead.attention (True = may attend)"]["fully_masked_row"]
        ([None, None, None, None], [0.0, 0.0, 0.0, 0.0])
    """
    import multihead as mh
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(2, 4, generator=g).half()                                    # (2 rows, 4 keys)
    hide = torch.tensor([[False, False, True, True], [True, True, True, True]])  # True = masked
    bias = torch.full((2, 4), -32.0).half()                      # e.g. ALiBi's -0.5 * 64 tokens
    fmin = torch.finfo(torch.float16).min
    cases = [
        ("masked_fill(-1e9) in fp16", lambda: torch.softmax(s.masked_fill(hide, -1e9), -1)),
        ("additive -1e9 mask cast to fp16", lambda: torch.softmax(
            s + torch.zeros(2, 4).masked_fill(hide, -1e9).half(), -1)),
        ("-1e9 in fp32 (no overflow)", lambda: torch.softmax(
            s.float() + torch.zeros(2, 4).masked_fill(hide, -1e9), -1)),
        ("finfo(fp16).min", lambda: torch.softmax(s.masked_fill(hide, fmin), -1)),
        ("finfo(fp16).min, plus a bias of -32", lambda: torch.softmax(
            s.masked_fill(hide, fmin) + bias, -1)),
        ("-inf in fp16", lambda: torch.softmax(s.masked_fill(hide, float("-inf")), -1)),
        ("multihead.attention (True = may attend)", lambda: _weights(mh, s, ~hide)),
    ]
    out = []
    for name, fn in cases:
        w, err = _try(fn)
        out.append({"method": name, "error": err,
                    "partly_masked_row": None if w is None else [round(float(x), 4) for x in w[0]],
                    "fully_masked_row": None if w is None else [
                        None if math.isnan(float(x)) else round(float(x), 4) for x in w[1]]})
    return out


def _weights(mh, s, allowed):
    """Weights of mh.attention for scores ``s`` (built as q·k with one-hot keys)."""
    q = s.float().view(1, 1, 2, 4) * 2.0                  # scale 1/sqrt(4) undoes the 2
    k = torch.eye(4).view(1, 1, 4, 4)
    _, w = mh.attention(q.half(), k.half(), k.half(), mask=mh.masks.dense(allowed),
                        return_weights=True)
    return w[0, 0]

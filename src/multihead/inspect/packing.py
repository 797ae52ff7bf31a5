"""Attention weights packed small for reports: one byte per weight, compressed, in base64.

A long text's weights are large (6 layers x 12 heads x 512 x 512 tokens = 19 million
numbers: ~130 MB as JSON text). Packed, each head's weights ``w`` are divided by the head's
largest weight ``scale``, optionally square-rooted (the ``"sqrt"`` curve keeps small weights,
which most weights of a long text are, ~16 times finer), quantized to a byte, and the bytes
of all heads are zlib-compressed and base64-encoded:

    q = round(255 * (w / scale) ** (1/2 if curve == "sqrt" else 1))
    w ~= (q / 255) ** (2 if curve == "sqrt" else 1) * scale

The absolute error is at most ``scale / 510`` ("linear") or ``scale / 255`` ("sqrt").
:func:`unpack_weights` reads it back; the HTML report's script decodes either curve (it
holds the same packing as ``inspect.json``).

Notation used for tensor shapes: L layers, H heads, S tokens.
"""

from __future__ import annotations

import base64
import zlib

import torch

from .metrics import all_finite

CURVES = ("linear", "sqrt")
FORMAT = "uint8-zlib-base64"


def _describe(curve: str) -> str:
    power = "(q / 255) ** 2" if curve == "sqrt" else "q / 255"
    return (f"{FORMAT}: data is base64 of zlib-compressed bytes q, one per weight in [l][h][i][j] "
            f"order (row-major over shape); weight = {power} * scale[l][h]. "
            f"Python: multihead.inspect.packing.unpack_weights(this)")


def pack_weights(weights: torch.Tensor, *, curve: str = "linear") -> dict:
    """Pack attention weights ``(L, H, S, S)`` (all >= 0) into a small JSON-ready dict.

    Args:
        weights: finite, non-negative attention weights ``(L, H, S, S)``.
        curve: ``"linear"`` (byte proportional to the weight) or ``"sqrt"`` (finer near 0).

    Returns:
        ``{"format", "curve", "shape", "scale" [L][H], "data" (base64), "decode" (how)}``.

    Example:
        >>> w = torch.softmax(torch.randn(2, 3, 5, 5), -1)
        >>> p = pack_weights(w, curve="sqrt")
        >>> p["shape"], bool((unpack_weights(p) - w).abs().max() < 1 / 255)
        ([2, 3, 5, 5], True)

    Shapes:
        weights: (L, H, S, S).
    """
    if curve not in CURVES:
        raise ValueError(f"curve must be one of {CURVES}, got {curve!r}")
    if weights.dim() != 4:
        raise ValueError(f"weights must be (L, H, S, S), got shape {tuple(weights.shape)}")
    if not all_finite(weights):
        raise ValueError("weights hold NaN or inf values: they cannot be packed")
    scale = weights.float().amax(dim=(-2, -1)).clamp_min(0)                  # (L, H)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    z = zlib.compressobj(4)                  # level 4: within 10% of the smallest, 3x faster
    chunks = []
    for layer, s in zip(weights, scale):                                      # one layer at a time
        x = (layer.float() / s[:, None, None]).clamp(0, 1)                    # (H, S, S)
        if curve == "sqrt":
            x = x.sqrt()
        q = torch.round(x * 255).to(torch.uint8)                              # (H, S, S)
        chunks.append(z.compress(q.numpy().tobytes()))
    chunks.append(z.flush())
    return {"format": FORMAT, "curve": curve, "shape": list(weights.shape),
            "scale": scale.tolist(), "data": base64.b64encode(b"".join(chunks)).decode("ascii"),
            "decode": _describe(curve)}


def unpack_weights(packed: dict) -> torch.Tensor:
    """The weights ``(L, H, S, S)`` (float32) of a dict made by :func:`pack_weights`.

    Example:
        >>> w = torch.tensor([[[[0.25, 0.75], [1.0, 0.0]]]])
        >>> unpack_weights(pack_weights(w)).tolist()
        [[[[0.250980406999588, 0.7490196228027344], [1.0, 0.0]]]]

    Shapes:
        returns: (L, H, S, S).
    """
    if packed.get("format") != FORMAT or packed.get("curve") not in CURVES:
        raise ValueError(f"not packed weights: expected format {FORMAT!r} and a curve in {CURVES}, "
                         f"got {packed.get('format')!r}, {packed.get('curve')!r}")
    raw = zlib.decompress(base64.b64decode(packed["data"]))
    q = torch.frombuffer(bytearray(raw), dtype=torch.uint8).reshape(packed["shape"])
    x = q.float() / 255
    if packed["curve"] == "sqrt":
        x = x * x
    return x * torch.tensor(packed["scale"], dtype=torch.float32)[..., None, None]

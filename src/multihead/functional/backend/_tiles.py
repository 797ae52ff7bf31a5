"""The work plan of the blocksparse kernel: which key tiles each query tile visits, in steps.

For every query tile, the key tiles the mask does not rule out are listed in order.
Query tiles are grouped into chunks (bounded memory); a chunk walks its lists in steps of
``W`` tiles. Steps made only of full tiles skip mask evaluation; the rest evaluate the
mask (and tile validity) on the fly. A step whose key
tiles are the same for every query tile of the chunk is *shared*: one matmul with no
gather, and when those tiles are consecutive, no copy at all.

Notation: Bm = the mask's batch size (1 if it does not depend on the batch), nQc = query
tiles in a chunk, W = key tiles in a step, tq/tk = tile sizes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ... import masks as M
from ..._device import to_device
from .._call import AttentionCall

TILE = 64                 # columns (keys) of a tile
TILE_Q = 64               # rows (queries) of a tile
BUDGET = 1 << 21          # score elements one step holds (8 MiB in fp32)
MAX_STEP_TILES = 16       # key tiles a step gathers at most


@dataclass
class Step:
    idx: torch.Tensor            # (Bm, nQc, W) key tile index per query tile
    valid: torch.Tensor          # (Bm, nQc, W) False where a query tile has fewer tiles
    masked: bool                 # evaluate the mask on this step
    shared: bool                 # same key tiles for every query tile (and batch) of the chunk
    first: int | None            # when shared and consecutive: the first key tile


@dataclass
class Chunk:
    i0: int                      # first query tile
    i1: int                      # one past the last query tile
    steps: list[Step]


@dataclass
class Plan:
    tq: int
    tk: int
    nq: int
    nk: int
    chunks: list[Chunk]


def tile_sizes(call: AttentionCall) -> tuple[int, int]:
    """``(tq, tk)``: rows and columns of a tile (``torch.sym_min``/``sym_max``: a traced
    size gets no guard; ints stay ints)."""
    lo, hi = torch.sym_min, torch.sym_max
    return hi(1, lo(TILE_Q, call.Sq)), hi(1, lo(TILE, call.Sk))


class Geometry(NamedTuple):
    """Tile sizes and counts, key tiles a step holds, query tiles a chunk holds."""

    tq: int
    tk: int
    nq: int
    nk: int
    width: int
    per_chunk: int


def geometry(call: AttentionCall, kmax: int) -> Geometry:
    """The plan's sizes when a query tile visits at most ``kmax`` key tiles."""
    tq, tk = tile_sizes(call)
    nq, nk = -(-call.Sq // tq), -(-call.Sk // tk)
    rows = call.B * call.H * tq * tk
    width = max(1, min(MAX_STEP_TILES, kmax, BUDGET // max(rows, 1)))
    return Geometry(tq, tk, nq, nk, width, max(1, BUDGET // max(rows * width, 1)))


class Estimate(NamedTuple):
    """What a plan would compute, counted without building it."""

    pairs: int             # (query, key) pairs computed, heads and batch included
    masked_pairs: int      # of which in steps that evaluate the mask
    steps: int
    masked_steps: int
    chunks: int
    gathered_tiles: int    # key tiles copied per K/V head (0 when steps read slices)
    density: float         # fraction of the tile pairs computed (a chunk of query tiles
                           # computes as many key tiles for each as its busiest needs)
    allowed: float         # fraction of the tile pairs holding a pair the mask allows
    exact: bool            # False: an upper bound (the mask's tiles live on a device)


def estimate(call: AttentionCall) -> Estimate:
    """Count the plan's work from the host tile map, with no loop over its steps; an upper
    bound (every tile computed and masked) when the mask's tiles live on a device."""
    tq, tk = tile_sizes(call)
    nq, nk = -(-call.Sq // tq), -(-call.Sk // tk)
    unit = call.B * call.H * tq * tk
    if not on_host(call):
        g = geometry(call, nk)
        chunks = -(-nq // g.per_chunk)
        steps = chunks * -(-nk // g.width)
        return Estimate(unit * nq * nk, unit * nq * nk, steps, steps, chunks, nq * nk, 1.0, 1.0,
                        False)
    nonempty, full, _ = _classify(call, tq, tk, nq, nk, "cpu", banded=True)  # (Bm, nQ, nK|W)
    count = nonempty.sum(-1).amax(0)                              # (nQ,) key tiles per row
    partial = (nonempty & ~full).any(-1).any(0)                   # (nQ,) rows with a mask
    g = geometry(call, int(count.max()) if nq else 0)
    chunks = -(-nq // g.per_chunk)
    pad = chunks * g.per_chunk - nq
    kc = F.pad(count, (0, pad)).view(chunks, g.per_chunk).amax(1)           # (chunks,)
    rows = torch.full((chunks,), g.per_chunk, device=count.device)       # (chunks,) host
    rows[-1] -= pad
    masked = F.pad(partial, (0, pad)).view(chunks, g.per_chunk).any(1)       # (chunks,)
    steps_c = -(-kc // g.width)
    pairs_c = rows * kc * unit
    visited = int((rows * kc).sum())                              # tile pairs multiplied
    gathered = 0 if call.effective_mask is None else visited
    return Estimate(int(pairs_c.sum()), int(pairs_c[masked].sum()), int(steps_c.sum()),
                    int(steps_c[masked].sum()), chunks, gathered, visited / max(nq * nk, 1),
                    int(nonempty.sum()) / max(nonempty.shape[0] * nq * nk, 1), True)


def on_host(call: AttentionCall) -> bool:
    """Whether the mask's tiles can be classified on the host without reading a device
    tensor: no mask, a mask determined by ints (causal, windows), or a mask on the CPU."""
    m = call.effective_mask
    return m is None or not m.has_predicate or m.on_host


def _classify(call: AttentionCall, tq: int, tk: int, nq: int, nk: int, device,
              banded: bool = False):
    """``(nonempty, full, keys)``: bool tensors (Bm, nQ, nK) on ``device``, reduced over
    heads soundly, and None; or with ``banded`` and a mask that bounds each query tile's
    keys (a window, packed documents), (Bm, nQ, W) over the key tiles ``keys`` (nQ, W)
    names (see :class:`~multihead.masks.base.TileMap`)."""
    mask = call.effective_mask
    keys = None                                                  # key tile of each column
    if mask is None or not mask.has_predicate:
        ones = torch.ones(1, nq, nk, dtype=torch.bool, device=device)
        nonempty, full = ones, ones.clone()
    else:
        tm = mask._tile_map(call.Sq, call.Sk, tile_q=tq, tile_k=tk, device=device, banded=banded)
        keys = tm.key_tiles
        nonempty = (tm.state != M.EMPTY).any(dim=1)              # (Bm, nQ, nK|W)
        full = (tm.state == M.FULL).all(dim=1)
    if call.Sk % tk:
        # padded keys need masking
        full = full & (torch.arange(nk, device=device) < nk - 1 if keys is None else keys < nk - 1)
    return nonempty, full, keys


def make_plan(call: AttentionCall) -> Plan:
    """The kernel's plan. Built on the host when :func:`on_host` (then no host-device sync:
    its index tensors are copied to the device without one); else on the device, reading
    its tile counts back (syncs)."""
    tq, tk = tile_sizes(call)
    nq, nk = -(-call.Sq // tq), -(-call.Sk // tk)
    device = torch.device("cpu") if on_host(call) else call.q.device
    nonempty, full, keys = _classify(call, tq, tk, nq, nk, device, banded=True)
    w = nonempty.shape[-1]                                       # nK, or W columns if banded
    rank = torch.where(nonempty, 0, 1) * w + torch.arange(w, device=device)
    order = rank.argsort(dim=-1)                                 # (Bm, nQ, w): visited first
    ncount = nonempty.sum(-1).cpu()                              # (Bm, nQ)
    _, _, _, _, width, per_chunk = geometry(call, int(ncount.max()) if ncount.numel() else 0)
    target = call.q.device
    chunks = []
    for i0 in range(0, nq, per_chunk):
        i1 = min(nq, i0 + per_chunk)
        count = ncount[:, i0:i1]
        kc = int(count.max())
        ord_c = order[:, i0:i1, :kc]                             # (Bm, nQc, Kc) columns
        valid_c = torch.arange(kc, device=device) < count.to(device).unsqueeze(-1)
        full_c = full[:, i0:i1].gather(-1, ord_c) & valid_c      # (Bm, nQc, Kc)
        if keys is not None:                                     # columns -> key tiles
            ord_c = keys[i0:i1].expand(len(ord_c), i1 - i0, w).gather(-1, ord_c)
        steps = []
        for s0 in range(0, kc, width):
            idx, valid = ord_c[..., s0:s0 + width], valid_c[..., s0:s0 + width]
            masked = not bool(full_c[..., s0:s0 + width].all())
            # shared: every query tile of the chunk (and every batch) visits the same tiles
            shared = bool(valid.all()) and bool((idx == idx[:1, :1]).all())
            row, first = idx[0, 0], None
            if shared and bool((row == row[0] + torch.arange(len(row), device=device)).all()):
                first = int(row[0])
            steps.append(Step(to_device(idx, target), to_device(valid, target), masked, shared,
                              first))
        chunks.append(Chunk(i0, i1, steps))
    return Plan(tq, tk, nq, nk, chunks)

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
    """Count the plan's work from the host tile map, as :func:`make_plan` would lay it out
    (its steps, which of them evaluate the mask, which copy key tiles) without building it;
    an upper bound (every tile computed and masked) when the mask's tiles live on a device.

    Example:
        >>> import multihead as mh
        >>> from multihead.functional._call import make_call
        >>> q = torch.empty(1, 8, 2048, 16)
        >>> call = make_call(q, q, q, mask=mh.masks.padding([1034]), scale=None,
        ...                  dropout_p=0.0, return_weights=False, return_lse=False)
        >>> e = estimate(call)      # 8 chunks of 2 steps: the second holds key 1034's tile
        >>> e.steps, e.masked_steps, e.gathered_tiles, round(e.density, 3)
        (16, 8, 0, 0.531)
    """
    tq, tk = tile_sizes(call)
    nq, nk = -(-call.Sq // tq), -(-call.Sk // tk)
    unit = call.B * call.H * tq * tk
    if not on_host(call):
        g = geometry(call, nk)
        chunks = -(-nq // g.per_chunk)
        steps = chunks * -(-nk // g.width)
        return Estimate(unit * nq * nk, unit * nq * nk, steps, steps, chunks, nq * nk, 1.0, 1.0,
                        False)
    v = _visits(call, "cpu")
    f = _step_facts(v)
    pairs = f.width * f.rows.unsqueeze(1)                          # (chunks, S) tile pairs
    copied = torch.where(f.first >= 0, 0, torch.where(f.shared, f.width, pairs))
    visited = int(pairs.sum())
    return Estimate(visited * unit, int(pairs[f.masked].sum()) * unit, int((f.width > 0).sum()),
                    int(f.masked.sum()), len(f.rows), int(copied.sum()),
                    visited / max(nq * nk, 1),
                    int(v.count.sum()) / max(len(v.count) * nq * nk, 1), True)


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


class Visits(NamedTuple):
    """Each query tile's key tiles in the order the plan visits them: the tiles the mask does
    not rule out, by key (K: the most visits of any query tile; a row with fewer is padded
    with tiles it does not visit, marked invalid), or a run of key tiles its chunk shares
    (:func:`_aligned`)."""

    tiles: torch.Tensor          # (Bm, nQ, K) key tile of each visit
    valid: torch.Tensor          # (Bm, nQ, K) the query tile needs this visit (False on
                                 # padding positions and on a shared run's other tiles)
    full: torch.Tensor           # (Bm, nQ, K) a valid visit whose every pair is allowed
    count: torch.Tensor          # (Bm, nQ) visits of each query tile
    geometry: Geometry


def _visits(call: AttentionCall, device) -> Visits:
    """The visits of :func:`make_plan`, classified on ``device`` (a device reads its most
    visits back: one sync), kept on the mask as its tile maps are: :func:`estimate` prices
    the plan with the visits :func:`make_plan` then builds it from."""
    m = call.effective_mask
    if m is None:
        return _new_visits(call, device)
    key = (call.Sq, call.Sk, call.B * call.H, str(device))       # (what geometry reads)
    return m.cached("visits", key, lambda: _new_visits(call, device))


def _new_visits(call: AttentionCall, device) -> Visits:
    tq, tk = tile_sizes(call)
    nq, nk = -(-call.Sq // tq), -(-call.Sk // tk)
    nonempty, full, keys = _classify(call, tq, tk, nq, nk, device, banded=True)  # (Bm, nQ, w)
    w = nonempty.shape[-1]                                       # nK, or W columns if banded
    count = nonempty.sum(-1)                                     # (Bm, nQ)
    most = int(count.max()) if count.numel() else 0
    rank = torch.where(nonempty, 0, 1) * w + torch.arange(w, device=device)
    order = rank.argsort(dim=-1)[..., :most]                     # (Bm, nQ, K): visited first
    valid = torch.arange(most, device=device) < count.unsqueeze(-1)
    tiles = order if keys is None else keys.expand(len(order), nq, w).gather(-1, order)
    v = Visits(tiles, valid, full.gather(-1, order) & valid, count, geometry(call, most))
    return _aligned(v, nonempty, full, keys) if most else v


def _aligned(v: Visits, nonempty: torch.Tensor, full: torch.Tensor,
             keys: torch.Tensor | None) -> Visits:
    """``v`` where a chunk's query tiles visit, together, a run of no more key tiles than its
    busiest visits alone (causal: the chunk's triangle; causal & padding): each of them then
    visits the whole run in key order, the tiles it does not need marked invalid (masked).
    Its steps are shared (one matmul, no copy) at no more tiles computed."""
    g = v.geometry
    bm, nq, most = v.tiles.shape
    P, C, dev = g.per_chunk, -(-nq // g.per_chunk), v.tiles.device
    seen = v.count > 0
    last = v.tiles.gather(-1, (v.count - 1).clamp(min=0).unsqueeze(-1)).squeeze(-1)  # (Bm, nQ)

    def per_chunk(t: torch.Tensor, fill: int) -> torch.Tensor:      # (Bm, nQ) -> (Bm, C, P)
        return F.pad(t, (0, C * P - nq), value=fill).view(bm, C, P)
    lo = per_chunk(torch.where(seen, v.tiles[..., 0], g.nk), g.nk).amin(dim=(0, 2))  # (C,)
    hi = per_chunk(torch.where(seen, last, -1), -1).amax(dim=(0, 2)) + 1            # (C,)
    kc = per_chunk(v.count, 0).amax(dim=(0, 2))                                     # (C,)
    chunk = torch.arange(nq, device=dev) // P                          # (nQ,) each row's chunk
    aligned = ((hi - lo == kc) & (kc > 0))[chunk].view(1, nq, 1)
    run = (lo[chunk].view(nq, 1) + torch.arange(most, device=dev)).clamp(max=g.nk - 1)  # (nQ, K)
    col, inside = run, True                                     # the run's columns in the map
    if keys is not None:
        col = run - keys[:, :1]
        inside = (col >= 0) & (col < keys.shape[1])
        col = col.clamp(0, keys.shape[1] - 1)
    col = col.expand(bm, nq, most)
    within = torch.arange(most, device=dev) < (hi - lo)[chunk].view(nq, 1)
    valid = nonempty.gather(-1, col) & inside & within                     # (Bm, nQ, K)
    return v._replace(tiles=torch.where(aligned, run, v.tiles),
                      valid=torch.where(aligned, valid, v.valid),
                      full=torch.where(aligned, full.gather(-1, col) & valid, v.full))


class StepFacts(NamedTuple):
    """What each step of the plan does, per chunk of query tiles and step (C chunks, S the
    most steps of a chunk)."""

    rows: torch.Tensor           # (C,) query tiles of the chunk
    width: torch.Tensor          # (C, S) key tiles of the step (0: the chunk has no such step)
    masked: torch.Tensor         # (C, S) some pair of the step needs the mask (or bounds)
    shared: torch.Tensor         # (C, S) every query tile (and batch row) visits the same tiles
    first: torch.Tensor          # (C, S) when shared and consecutive, the first key tile; else -1


def _step_facts(v: Visits) -> StepFacts:
    """Lay the visits out in chunks of ``per_chunk`` query tiles and steps of ``width`` key
    tiles: a chunk takes as many steps as its busiest query tile needs."""
    g = v.geometry
    bm, nq, most = v.tiles.shape
    P, W = g.per_chunk, g.width
    C, S = -(-nq // P), -(-most // W)
    dev = v.tiles.device

    def blocks(t: torch.Tensor) -> torch.Tensor:                 # (Bm, nQ, K) -> (Bm, C, P, S, W)
        return F.pad(t, (0, S * W - most, 0, C * P - nq)).view(bm, C, P, S, W)
    tiles, full = blocks(v.tiles), blocks(v.full)
    kc = F.pad(v.count, (0, C * P - nq)).view(bm, C, P).amax(dim=(0, 2))       # (C,) visits
    rows = (nq - torch.arange(C, device=dev) * P).clamp(max=P)                  # (C,)
    start = torch.arange(S, device=dev) * W                                      # (S,)
    width = (kc.view(C, 1) - start).clamp(0, W)                                  # (C, S)
    inside = ((torch.arange(W, device=dev) < width.unsqueeze(-1)).view(1, C, 1, S, W)
              & (torch.arange(P, device=dev) < rows.view(C, 1)).view(1, C, P, 1, 1))
    masked = (inside & ~full).any(4).any(2).any(0)                               # (C, S)
    same = tiles == tiles[:1, :, :1]                             # as the chunk's first row
    shared = (width > 0) & ~(inside & ~same).any(4).any(2).any(0)
    lead = tiles[0, :, 0]                                        # (C, S, W)
    steady = (lead == lead[..., :1] + torch.arange(W, device=dev)) | ~inside[0, :, 0]
    first = torch.where(shared & steady.all(-1), lead[..., 0], -1)
    return StepFacts(rows, width, masked, shared, first)


def make_plan(call: AttentionCall) -> Plan:
    """The kernel's plan. Built on the host when :func:`on_host` (then no host-device sync:
    its index tensors are copied to the device without one); else on the device, reading
    its visit counts and step facts back (two syncs)."""
    device = torch.device("cpu") if on_host(call) else call.q.device
    v = _visits(call, device)
    g, f = v.geometry, _step_facts(v)
    facts = torch.stack([f.width, f.masked.long(), f.shared.long(), f.first.long()]).tolist()
    target = call.q.device
    chunks = []
    for c, i0 in enumerate(range(0, g.nq, g.per_chunk)):
        i1 = min(g.nq, i0 + g.per_chunk)
        steps = []
        for s, (w, masked, shared, first) in enumerate(zip(*(x[c] for x in facts))):
            if not w:
                break
            a = s * g.width
            idx, valid = v.tiles[:, i0:i1, a:a + w], v.valid[:, i0:i1, a:a + w]
            steps.append(Step(to_device(idx, target), to_device(valid, target), bool(masked),
                              bool(shared), None if first < 0 else first))
        chunks.append(Chunk(i0, i1, steps))
    return Plan(g.tq, g.tk, g.nq, g.nk, chunks)

"""torch's ``FlopCounterMode`` counts our Triton operators: torch's own SDPA FLOPs per
(query, key) pair (``sdpa_flop_count``, ``sdpa_backward_flop_count``), over the pairs the
kernels compute. Under the interpreter on a CPU (CI), with 16x16 tiles so that small
shapes cross many blocks; the oracle of the pairs is the mask's dense form."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch.utils.flop_counter import (FlopCounterMode, sdpa_backward_flop_count,
                                      sdpa_flop_count)

import multihead as mh

pytest.importorskip("triton")
from multihead.kernels import _band  # noqa: E402

M = mh.masks
DEV = "cuda" if torch.cuda.is_available() else "cpu"
TILE = 16


#: each kernel's tiles in these tests, distinct, so that a count on another kernel's tiles
#: shows (the decode kernel: blocks of 16 keys)
TILES = {"fwd": (16, 16), "fwd_narrow": (32, 16), "bwd_q": (16, 32), "bwd_kv": (32, 16),
         "fwd_sparse": (16, 16), "fwd_sparse_short": (16, 16)}


@pytest.fixture
def distinct_tiles(monkeypatch, triton_on_this_device):
    """Every kernel on the small tiles of :data:`TILES`."""
    table = {name: {64: (TILE,) + row[64][1:] if name == "decode" else TILES[name] + (4, 1)}
             for name, row in _band.LAUNCH.items()}
    monkeypatch.setattr(_band, "LAUNCH", table)
    monkeypatch.delenv("MULTIHEAD_TRITON_LAUNCH", raising=False)


def _inputs(B, H, Hkv, Sq, Sk, D, Dv, grad=True):
    g = torch.Generator().manual_seed(0)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEV, torch.float16).requires_grad_(grad)  # noqa: E731
    return mk(B, H, Sq, D), mk(B, Hkv, Sk, D), mk(B, Hkv, Sk, Dv)


def _count(q, k, v, mask, backward=True) -> dict:
    """``{operator name: FLOPs}`` of a call through the triton backend (and its backward)."""
    with FlopCounterMode(display=False) as counter:
        out = mh.attention(q, k, v, mask=mask, backend="triton")
        if backward:
            out.float().sum().backward()
    return {str(op).split(".")[-1]: n for op, n in counter.get_flop_counts()["Global"].items()}


def _visited(allowed: torch.Tensor, block_m: int, block_n: int) -> int:
    """Pairs of a band kernel's call, from the dense mask ``(B, Sq, Sk)``: each block of
    queries computes its rows against the keys from the block holding its least allowed key
    to its greatest allowed key."""
    total = 0
    for rows in allowed:                                        # (Sq, Sk) per sequence
        for m0 in range(0, rows.shape[0], block_m):
            keys = rows[m0:m0 + block_m].any(0).nonzero()
            if len(keys):
                lo = int(keys.min()) // block_n * block_n
                total += (int(keys.max()) + 1 - lo) * len(rows[m0:m0 + block_m])
    return total


def _listed(allowed: torch.Tensor, block_m: int, block_n: int) -> int:
    """Pairs of a block-sparse kernel's call, from the dense mask ``(B, H, Sq, Sk)``: every
    pair of each tile holding an allowed pair."""
    B, H, Sq, Sk = allowed.shape
    pad = torch.zeros(B, H, -(-Sq // block_m) * block_m, -(-Sk // block_n) * block_n,
                      dtype=torch.bool)
    pad[..., :Sq, :Sk] = allowed
    real = torch.zeros_like(pad)
    real[..., :Sq, :Sk] = True
    tiles = lambda t: t.unflatten(2, (-1, block_m)).unflatten(4, (-1, block_n))  # noqa: E731
    any_allowed = tiles(pad).any(5).any(3)                      # (B, H, nQ, nK)
    return int((tiles(real).sum((3, 5)) * any_allowed).sum())


def test_a_call_without_mask_counts_what_torch_counts_for_sdpa(triton_on_this_device):
    """No mask, GQA, Sq != Sk, D != Dv: exactly torch's formulas for the same shapes."""
    q, k, v = _inputs(2, 4, 2, 40, 56, 32, 16)
    assert _count(q, k, v, None) == {
        "flash_attention": sdpa_flop_count(q.shape, k.shape, v.shape),
        "flash_attention_backward": sdpa_backward_flop_count((2, 4, 40, 16), q.shape, k.shape,
                                                             v.shape)}


BANDS = {
    "causal": lambda B: M.causal(),
    "window 9": lambda B: M.sliding_window(9),
    "window 1000": lambda B: M.sliding_window(1000),      # wider than the band: as causal
    "causal & padding": lambda B: M.causal() & M.padding(torch.tensor([50, 21])),
    "window 20 & padding": lambda B: M.sliding_window(20) & M.padding(torch.tensor([0, 37])),
    "padding": lambda B: M.padding(torch.tensor([70, 3])),
}


@pytest.mark.parametrize("name", list(BANDS))
def test_band_masks_count_the_keys_each_block_of_queries_visits(distinct_tiles, name):
    """Per block of 16 queries, its rows against the keys from the block of its least
    allowed key to its greatest (lower-right aligned, 48 queries over 70 keys); the counts
    taken while the counter runs change no output or gradient."""
    B, H, Hkv, Sq, Sk, D, Dv = 2, 4, 2, 48, 70, 16, 32
    q, k, v = _inputs(B, H, Hkv, Sq, Sk, D, Dv)
    mask = BANDS[name](B)
    counts = _count(q, k, v, mask)
    allowed = mask.materialize(Sq, Sk).expand(B, 1, Sq, Sk)[:, 0]
    forward = H * _visited(allowed, *TILES["fwd_narrow" if "window" in name else "fwd"])
    backward = H * _visited(allowed, *TILES["bwd_q"])
    per_pair = sdpa_flop_count(q.shape, k.shape, v.shape) // (B * H * Sq * Sk)
    back = sdpa_backward_flop_count((B, H, Sq, Dv), q.shape, k.shape, v.shape) // (B * H * Sq * Sk)
    assert counts == {"flash_attention": forward * per_pair,
                      "flash_attention_backward": backward * back}
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    out = mh.attention(q, k, v, mask=mask, backend="triton")     # no mode: the kernels directly
    out.float().sum().backward()
    with FlopCounterMode(display=False):
        seen = mh.attention(q, k, v, mask=mask, backend="triton")
    assert torch.equal(seen, out)
    assert all(torch.equal(t.grad, g) for t, g in zip((q, k, v), grads))


def test_packed_documents_count_each_document_from_its_first_token(distinct_tiles):
    """Documents known on the host run one program per (document, query block): a block's
    keys are counted within its document, blocks aligned at the document's first token."""
    lengths = [21, 40, 3]
    ids = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])[None]   # (1, 64)
    q, k, v = _inputs(1, 2, 2, 64, 64, 16, 16)
    counts = _count(q, k, v, M.document(ids) & M.causal())
    pairs = sum(_visited(torch.ones(n, n).tril().bool()[None], TILE, TILE) for n in lengths)
    assert counts["flash_attention"] == 2 * pairs * 2 * (16 + 16)


@pytest.mark.parametrize("name", ["alibi", "causal & alibi", "dense"])
def test_block_sparse_masks_count_every_pair_of_the_tiles_they_list(distinct_tiles, name):
    """Every pair of each 16x16 tile that holds an allowed pair, per batch and head; ALiBi
    alone lists every tile."""
    B, H, Sq, Sk = 2, 2, 48, 70
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(B, 1, Sq // TILE, -(-Sk // TILE), generator=g) < 0.5
    dense = (keep.repeat_interleave(TILE, 2).repeat_interleave(TILE, 3)[..., :Sk]
             & (torch.rand(B, 1, Sq, Sk, generator=g) < 0.5))
    mask = {"alibi": M.alibi(H), "causal & alibi": M.causal() & M.alibi(H),
            "dense": M.dense(dense)}[name]
    q, k, v = _inputs(B, H, H, Sq, Sk, 16, 16)
    counts = _count(q, k, v, mask)
    allowed = mask.materialize(Sq, Sk).expand(B, H, Sq, Sk)
    forward, backward = _listed(allowed, *TILES["fwd_sparse"]), _listed(allowed, *TILES["bwd_q"])
    assert forward < B * H * Sq * Sk or name == "alibi"
    assert counts == {"flash_sparse": forward * 2 * 32, "flash_sparse_backward": backward * 160}


def test_a_decoding_step_counts_the_keys_of_its_one_block_of_queries(distinct_tiles):
    """The split-K decode kernel (no gradients, 3 queries over a padded cache under a
    window): its queries are one block."""
    q, k, v = _inputs(2, 4, 2, 3, 70, 16, 16, grad=False)
    mask = M.sliding_window(30) & M.padding(torch.tensor([64, 41]))
    assert "split-K decode" in str(mh.explain(q, k, v, mask=mask, backend="triton"))
    counts = _count(q, k, v, mask, backward=False)
    pairs = 4 * _visited(mask.materialize(3, 70).expand(2, 1, 3, 70)[:, 0], 3, TILE)
    assert counts == {"flash_decode": pairs * 2 * 32}


def test_without_values_lengths_and_lists_count_every_pair(distinct_tiles):
    """Fake tensors (what torch.compile's estimates run on): key lengths and block lists
    hold no values, so every key of the band, and every pair of a block-sparse call,
    counts; a band without them counts as with real tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    B, H, Sq, Sk, D = 2, 2, 48, 70, 16
    real = _count(*_inputs(B, H, H, Sq, Sk, D, D), M.causal())
    with FakeTensorMode():
        q, k, v = (torch.empty(B, H, n, D, dtype=torch.float16, device=DEV, requires_grad=True)
                   for n in (Sq, Sk, Sk))
        fake = {name: _count(q, k, v, mask) for name, mask in [
            ("causal", M.causal()), ("padded", M.causal() & M.padding(torch.tensor([9, 9]))),
            ("alibi & causal", M.alibi(H) & M.causal())]}
    assert fake["causal"] == real == fake["padded"]
    every = B * H * Sq * Sk
    assert fake["alibi & causal"] == {"flash_sparse": every * 64,
                                      "flash_sparse_backward": every * 160}


@pytest.mark.parametrize("first", ["multihead", "torch.utils.flop_counter"])
def test_the_formulas_join_torchs_registry_whichever_is_imported_first(first):
    """A ``FlopCounterMode`` copies torch's registry when made: the formulas are there by
    then, whether multihead or the counter was imported first, and importing multihead
    imports neither the counter nor Triton."""
    code = f"""
import sys, torch
import {first}
import multihead
if "{first}" == "multihead":
    early = {{"triton", "torch.utils.flop_counter"}} & set(sys.modules)
    assert not early, early
from torch.utils.flop_counter import FlopCounterMode
mode = FlopCounterMode(display=False)
names = ("flash_attention", "flash_attention_backward", "flash_decode", "flash_sparse",
         "flash_sparse_backward")
missing = [n for n in names if getattr(torch.ops.multihead, n) not in mode.flop_registry]
assert not missing, missing
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]

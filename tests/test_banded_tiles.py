"""Banded tile maps: a window or packed documents classify only the key tiles each query
tile can reach, so planning is linear in the length, and what it says matches the dense map
and the materialized mask."""

import pytest
import torch

import multihead as mh
from multihead.functional._call import make_call
from multihead.functional.backend import _tiles
from multihead.masks import EMPTY, FULL

from conftest import assert_kernel_matches_oracle, oracle, small_tiles
from test_masks import exact_states

M = mh.masks


def _docs(S: int, every: int, batch: int = 1) -> torch.Tensor:
    """Sorted per-token document ids: ``batch`` rows of documents ``every`` tokens apart,
    shifted per row (each sequence packs its own)."""
    pos = torch.arange(S) + torch.arange(batch).unsqueeze(1) * (every // 3)   # (batch, S)
    return pos // every


BANDED = {      # masks that bound each query tile's keys: (mask, batch)
    "window": (lambda S: M.sliding_window(21), None),
    "window_upper_left": (lambda S: M.sliding_window(30, align="upper_left"), None),
    "cu_seqlens": (lambda S: M.document(cu_seqlens=torch.tensor([0, 17, 18, 60, 104, 150, 199, 230, 262, S])), None),
    "ids_per_row": (lambda S: M.document(_docs(S, 40, batch=3)), 3),
    "causal&docs": (lambda S: M.causal() & M.document(_docs(S, 33)), None),
    "window&padding": (lambda S: M.sliding_window(25) & M.padding(torch.tensor([S, 90, 0])), 3),
    "window&alibi": (lambda S: M.sliding_window(16) & M.alibi(2), None),
    "window&dense": (lambda S: M.sliding_window(19) & M.dense(torch.rand(3, 1, S, S) > 0.3), 3),
    "window&bias": (lambda S: M.sliding_window(19) & M.bias(
        torch.where(torch.rand(S, S) > 0.3, 0.0, float("-inf"))), None),
    "window&bool_padding": (lambda S: M.sliding_window(19) & M.padding(torch.rand(3, S) > 0.3), 3),
    "window&~docs": (lambda S: M.sliding_window(40) & ~M.document(_docs(S, 9)), None),
    "docs|docs": (lambda S: M.document(_docs(S, 20)) | M.document(_docs(S, 31)), None),
    "docs&unsorted": (lambda S: M.document(_docs(S, 30)) & M.document(torch.randint(0, 3, (S,))),
                      None),
    "placed_window&docs": (lambda S: M.at_positions(M.sliding_window(30), *[
        torch.sort(torch.randint(0, S, (2, S)), 1).values] * 2) & M.document(_docs(S, 50)), 2),
    "bool_padding": (lambda S: M.padding((torch.arange(S) >= torch.tensor([[40], [150], [S]]))
                                         & (torch.arange(S) < torch.tensor([[90], [170], [S]]))),
                     3),
}
DENSE = {       # masks whose tiles may reach every key: classified whole
    "causal": lambda S: M.causal(),
    "unsorted_ids": lambda S: M.document(torch.randint(0, 9, (S,))),
    "window|padding": lambda S: M.sliding_window(8) | M.padding(torch.tensor([5])),
    "not_window": lambda S: ~M.sliding_window(8),
    "one_long_document": lambda S: M.document(cu_seqlens=torch.tensor([0, S - 9, S])),
}


def spread(tm, nk: int) -> torch.Tensor:
    """A banded map's states at their key tiles, EMPTY elsewhere: ``(B', H', nQ, nK)``."""
    b, h, nq, w = tm.state.shape
    out = torch.full((b, h, nq, nk), EMPTY, dtype=torch.int8)
    return out.scatter_reduce(-1, tm.key_tiles.expand(b, h, nq, w).long(), tm.state, reduce="amax")


#: masks built from tensors sized for one call (Sq = Sk): not classified at another Sq
SIZED = ("window&dense", "window&bias", "placed_window&docs")


@pytest.mark.parametrize("name, sq, tiles", [
    (name, sq, tiles) for sq, tiles in [(300, (8, 8)), (300, (16, 5)), (170, (7, 9))]
    for name in BANDED if sq == 300 or name not in SIZED])
def test_a_banded_map_is_the_dense_map_at_a_fraction_of_its_columns(name, sq, tiles):
    torch.manual_seed(0)
    S = 300
    make, batch = BANDED[name]
    m = make(S)
    tq, tk = tiles
    nk = -(-S // tk)
    kw = dict(tile_q=tq, tile_k=tk, batch=batch)
    banded = m._tile_map(sq, S, banded=True, **kw)
    dense = m._tile_map(sq, S, **kw).state
    assert banded.key_tiles is not None and 2 * banded.state.shape[-1] <= nk, banded.state.shape
    got = spread(banded, nk)
    want = exact_states(m.materialize(sq, S).expand(batch or 1, -1, sq, S), tq, tk)
    got, dense = (t.long().expand_as(want) for t in (got, dense))
    assert not ((got == EMPTY) & (want != EMPTY)).any()         # sound
    assert not ((got == FULL) & (want != FULL)).any()
    assert torch.equal(got, dense)                              # what the dense map says
    assert banded.counts() == m.tiles(sq, S, **kw).counts()
    assert banded.density == pytest.approx(m.tiles(sq, S, **kw).density, abs=1e-12)


@pytest.mark.parametrize("name", DENSE)
def test_masks_whose_tiles_reach_every_key_get_the_dense_map(name):
    torch.manual_seed(0)
    m = DENSE[name](300)
    tm = m._tile_map(300, 300, tile_q=8, tile_k=8, banded=True)
    assert tm.key_tiles is None and tm.state.shape[-1] == 38
    assert torch.equal(tm.state, m._tile_map(300, 300, tile_q=8, tile_k=8).state)


def test_a_users_subclass_is_classified_whole_since_its_bounds_may_assume_every_key_tile():
    class Mine(M.Window):               # bounds written for a (1, 1, 1, nK) key index
        def _tile_bounds(self, tx):
            assert tx.k0.shape[:3] == (1, 1, 1)
            return super()._tile_bounds(tx)

    padding = M.padding(torch.tensor([200]))
    for m, ours in ((Mine(16, "lower_right"), M.sliding_window(16)),
                    (Mine(16, "lower_right") & padding, M.sliding_window(16) & padding)):
        tm = m._tile_map(300, 300, tile_q=8, tile_k=8, banded=True)
        assert tm.key_tiles is None
        assert torch.equal(tm.state, m._tile_map(300, 300, tile_q=8, tile_k=8).state)
        assert torch.equal(tm.state, ours.tiles(300, 300, tile_q=8, tile_k=8).state)


def test_a_window_over_a_million_tokens_is_planned_in_linear_memory():
    S = 1 << 20                     # a dense map would be 16384 x 16384 tiles
    m = M.sliding_window(128)
    tm = m._tile_map(S, S, banded=True)
    assert tm.state.shape == (1, 1, S // 64, 3)
    nq = S // 64                    # query tile i: tile i partial, i - 1 full, i - 2 partial
    assert tm.counts() == {"empty": nq * nq - 3 * nq + 3, "partial": 2 * nq - 2, "full": nq - 1}
    q = torch.randn(1, 1, S, 8)
    e = mh.explain(q, q, q, mask=m, backend="blocksparse")
    share = mh.functional.cost.share((3 * nq - 3) / nq ** 2)
    assert f"computes {share} of the tiles" in str(e), str(e)


@pytest.mark.parametrize("name", ["window", "ids_per_row", "causal&docs", "window&padding",
                                  "window&alibi", "window&dense", "placed_window&docs"])
def test_blocksparse_on_a_banded_plan_matches_the_oracle_forward_and_backward(name):
    torch.manual_seed(0)
    make, batch = BANDED[name]
    B, S = batch or 2, 300
    m = make(S)
    q, k, v = (torch.randn(B, 2, S, 16, requires_grad=True) for _ in range(3))
    with small_tiles(tile=16, budget=1 << 14):
        call = make_call(q, k, v, mask=m, scale=None, dropout_p=0.0, return_weights=False,
                         return_lse=False)
        _, _, keys = _tiles._classify(call, 16, 16, 19, 19, "cpu", banded=True)
        assert keys is not None                     # the plan below is banded
        out, lse = mh.attention(q, k, v, mask=m, backend="blocksparse", return_lse=True)
        assert_kernel_matches_oracle(out, lse, q, k, v, mask=m)
        g = torch.randn_like(out)
        grads = torch.autograd.grad(out, (q, k, v), g)
    want = torch.autograd.grad(oracle(q, k, v, mask=m), (q, k, v), g.double())
    for got, ref in zip(grads, want):
        torch.testing.assert_close(got, ref, atol=2e-5, rtol=1e-4)  # (fp64, rounded)


@pytest.mark.parametrize("make", [lambda: M.padding(torch.zeros(0, dtype=torch.long)),
                                  lambda: M.document(torch.zeros(0, 400, dtype=torch.long)),
                                  lambda: M.sliding_window(8) & M.padding(torch.zeros(0).long())])
def test_a_mask_of_no_sequence_has_an_empty_map(make):
    tm = make()._tile_map(400, 400, tile_q=16, tile_k=16, banded=True)
    assert tm.state.shape[0] == 0 and tm.counts() == {"empty": 0, "partial": 0, "full": 0}

"""The mask model: semantics, composition, tile classification soundness, repr."""

import copy
import dataclasses
import pickle
import re

import pytest
import torch

import multihead as mh
from multihead.masks import EMPTY, FULL, PARTIAL

M = mh.masks


def test_causal_alignment_drawn():
    lr = M.causal().materialize(2, 5)[0, 0].int().tolist()
    ul = M.causal(align="upper_left").materialize(2, 5)[0, 0].int().tolist()
    assert lr == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert ul == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0]]


def test_sliding_window_sees_itself_and_size_minus_one_before():
    m = M.sliding_window(3).materialize(6, 6)[0, 0]
    for i in range(6):
        assert m[i].nonzero().flatten().tolist() == list(range(max(0, i - 2), i + 1))


def test_padding_forms_agree():
    lengths = torch.tensor([3, 5])
    as_bool = torch.arange(5).unsqueeze(0) < lengths.unsqueeze(1)
    a = M.padding(lengths).materialize(4, 5)
    b = M.padding(as_bool).materialize(4, 5)
    assert a.shape == (2, 1, 4, 5) and torch.equal(a, b)
    q = M.padding(torch.tensor([2, 4]), side="query").materialize(4, 5)
    assert q[0, 0, :2].all() and not q[0, 0, 2:].any()


def test_document_ids_and_cu_seqlens_agree():
    ids = torch.tensor([0, 0, 0, 1, 1, 2])
    a = M.document(ids).materialize(6, 6)
    b = M.document(cu_seqlens=torch.tensor([0, 3, 5, 6])).materialize(6, 6)
    assert torch.equal(a, b)
    assert torch.equal(a[0, 0], ids.unsqueeze(0) == ids.unsqueeze(1))
    # decoding: queries are the last Sq positions
    assert torch.equal(M.document(ids).materialize(2, 6)[0, 0], a[0, 0, 4:])


@pytest.mark.parametrize("cu, error, match", [
    ("0,2,5", TypeError, r"cu_seqlens must be integers \(a list or an integer tensor\), got "
                         r"'0,2,5' \(str\)"),
    ([0, None, 5], TypeError, r"got \[0, None, 5\] \(list\)"),
    ([0, 10**12], ValueError, r"cu_seqlens ends at 1,000,000,000,000 tokens, whose ids would "
                              r"take 14.6 TiB, but cpu has .* free: is its last entry the total")])
def test_cu_seqlens_that_cannot_be_documents_are_named(cu, error, match):
    with pytest.raises(error, match=match):
        M.document(cu_seqlens=cu)


def test_composition_and_complement():
    c, w = M.causal(), M.sliding_window(2)
    a, b = c.materialize(5, 5), w.materialize(5, 5)
    assert torch.equal((c & w).materialize(5, 5), a & b)
    d = M.dense(torch.eye(5, dtype=torch.bool))
    assert torch.equal((w | d).materialize(5, 5), b | d.materialize(5, 5))
    assert torch.equal((~c).materialize(5, 5), ~a)


def test_biases_add_under_and_and_mask_with_minus_inf():
    al = M.alibi(2)
    b = torch.randn(1, 2, 3, 3)
    m = M.causal() & al & M.bias(b)
    add = m.additive(3, 3)
    want = (al.additive(3, 3) + b).masked_fill(~M.causal().materialize(3, 3), float("-inf"))
    torch.testing.assert_close(add, want)
    with pytest.raises(TypeError, match=r"\|"):
        _ = M.causal() | al


def test_a_long_chain_built_in_a_loop_runs_and_means_what_its_leaves_say():
    # 1000 `&` (and `|`) in a row: every analysis walks a mask recursively, so a chain
    # as deep as it is long overflowed Python's stack
    S = 24
    lens = torch.tensor([S - 5, S])
    both = M.causal() & M.padding(lens)
    either = M.dense(torch.eye(S, dtype=torch.bool))
    want_both, want_either = both.materialize(S, S), either.materialize(S, S)
    for n in range(1000):
        w = M.sliding_window(3 + n % 40)
        both, want_both = both & w, want_both & w.materialize(S, S)
        either = either | M.sliding_window(1 + n % 3, align="upper_left")
        want_either = want_either | M.sliding_window(1 + n % 3, align="upper_left").materialize(S, S)
    assert both._depth <= 32 and either._depth <= 32     # (a flattened chain grows again)
    assert len(list(both.leaves())) == 1002
    assert torch.equal(both.materialize(S, S), want_both)
    assert torch.equal(either.materialize(S, S), want_either)
    q = torch.randn(2, 2, S, 8, dtype=torch.float64)
    for m, dense in ((both, want_both), (either, want_either)):
        out = mh.attention(q, q, q, mask=m)
        torch.testing.assert_close(out, mh.attention(q, q, q, mask=dense, backend="reference"))
    # biases still add up, whatever the grouping
    values = torch.randn(1, 2, S, S, dtype=torch.float64)
    bias = M.alibi(2)
    for n in range(99):
        bias = bias & M.bias(values * n)
    torch.testing.assert_close(bias.additive(S, S, dtype=torch.float64),
                               M.alibi(2).additive(S, S, dtype=torch.float64) + 4851 * values)


def test_a_composition_too_deep_to_flatten_is_refused_by_name():
    m = M.causal()
    with pytest.raises(ValueError, match=r"nest 129 deep, more than 128.*combine"):
        for n in range(200):       # alternating & and |: no chain of one operator to flatten
            m = (m & M.sliding_window(4)) if n % 2 else (m | M.sliding_window(2))
    assert m._depth == 128
    c = M.causal()
    assert ~~c is c                # a double complement is the mask itself
    old = pickle.loads(pickle.dumps(m))
    del old.__dict__["_depth"]     # as pickled before compositions kept their depth
    again = pickle.loads(pickle.dumps(old))
    assert again._depth == 128
    with pytest.raises(ValueError, match="more than 128"):
        _ = ~again


def test_compositions_pickled_when_they_lived_in_masks_base_still_load():
    """And/Or/Not moved from masks/base.py to masks/combine.py: a pickle names a class by
    its module, so the old name must still resolve (protocol 0 spells it as text)."""
    lengths = torch.tensor([3, 5])
    m = (M.causal() & M.sliding_window(2)) | ~M.padding(lengths)
    raw = pickle.dumps(m, protocol=0)
    assert b"multihead.masks.combine" in raw
    old = pickle.loads(raw.replace(b"multihead.masks.combine", b"multihead.masks.base"))
    assert type(old) is M.Or and type(old.b) is M.Not
    assert torch.equal(old.materialize(5, 5), m.materialize(5, 5))


def test_alibi_slopes_match_the_paper():
    assert M.alibi_slopes(8).tolist() == [2.0 ** -(i + 1) for i in range(8)]
    s12 = M.alibi_slopes(12).tolist()      # 8 slopes, then every other of the 16-head ones
    assert s12[:8] == M.alibi_slopes(8).tolist()
    assert s12[8:] == M.alibi_slopes(16).tolist()[0::2][:4]


def test_bias_minus_inf_is_a_mask():
    b = torch.tensor([[0.0, float("-inf")], [1.0, 2.0]])
    assert M.bias(b).materialize(2, 2)[0, 0].tolist() == [[True, False], [True, True]]


MASKS = {
    "causal": lambda: M.causal(),
    "upper_left": lambda: M.causal(align="upper_left"),
    "window": lambda: M.sliding_window(7),
    "padding": lambda: M.padding(torch.tensor([13, 40, 0])),
    "padding_bool": lambda: M.padding(torch.rand(3, 40) > 0.3),
    "query_padding": lambda: M.padding(torch.tensor([5, 0, 37]), side="query"),
    "document": lambda: M.document(torch.sort(torch.randint(0, 5, (3, 40))).values),
    "dense": lambda: M.dense(torch.rand(3, 2, 37, 40) > 0.7),
    "and": lambda: M.sliding_window(9) & M.padding(torch.tensor([13, 40, 20])),
    "or": lambda: M.sliding_window(3) | M.document(torch.tensor([0] * 20 + [1] * 20)),
    "not": lambda: ~M.causal(),
    # positions in any order (tiles bounded by their least and greatest position)
    "positions": lambda: M.at_positions(M.sliding_window(9), torch.randint(-3, 45, (3, 37)),
                                        torch.randint(-3, 45, (3, 40))),
    # a left-padded cache's: cumsum - 1 of the real slots, a window's tiles skipped
    "positions_cache": lambda: M.at_positions(
        M.causal() & M.sliding_window(6), *(lambda p: (p[:, 3:], p))(
            (torch.arange(40) >= torch.tensor([[0], [11], [25]])).cumsum(-1) - 1)),
}


def exact_states(dense: torch.Tensor, tq: int, tk: int) -> torch.Tensor:
    """Tile states computed the slow way, from the materialized mask (B, H, Sq, Sk)."""
    b, h, sq, sk = dense.shape
    nq, nk = -(-sq // tq), -(-sk // tk)
    out = torch.empty(b, h, nq, nk, dtype=torch.long)
    for i in range(nq):
        for j in range(nk):
            block = dense[..., i * tq:(i + 1) * tq, j * tk:(j + 1) * tk].flatten(2)
            out[..., i, j] = torch.where(block.all(-1), FULL,
                                         torch.where(block.any(-1), PARTIAL, EMPTY))
    return out


@pytest.mark.parametrize("name", MASKS)
@pytest.mark.parametrize("tiles", [(8, 8), (5, 16), (64, 64), (1, 1)])
def test_tile_states_are_exact_or_sound(name, tiles):
    torch.manual_seed(0)
    m = MASKS[name]()
    sq, sk = 37, 40
    tm = m.tiles(sq, sk, tile_q=tiles[0], tile_k=tiles[1], batch=3, heads=2)
    want = exact_states(m.materialize(sq, sk).expand(3, 2, sq, sk), *tiles)
    got = tm.state.long().expand_as(want)
    # sound: EMPTY only if truly empty, FULL only if truly full
    assert not ((got == EMPTY) & (want != EMPTY)).any()
    assert not ((got == FULL) & (want != FULL)).any()
    if name not in ("document", "and", "or", "not", "padding_bool", "positions",
                    "positions_cache"):
        assert torch.equal(got, want)           # exact for these


def _gathered(t, ix):
    """``t[b, h, q, k]`` by advanced indexing, as torch reads it (size-1 dims broadcast)."""
    idx = [i if n > 1 else i * 0 for i, n in zip((ix.b, ix.h, ix.q, ix.k), t.shape)]
    return t[idx[0], idx[1], idx[2], idx[3]]


@pytest.mark.parametrize("shape", [(6, 7), (3, 1, 1, 7), (1, 2, 6, 7), (3, 2, 6, 7), (3, 2, 6, 1)])
@pytest.mark.parametrize("kind", ["dense", "bias"])
def test_a_tensor_mask_on_its_grid_is_read_where_it_lies_with_the_values_a_gather_reads(
        shape, kind):
    g = torch.Generator().manual_seed(len(shape))
    if kind == "dense":
        t = torch.rand(shape, generator=g) > 0.4
        m, read = M.dense(t), lambda ix: m.at(ix)[0]
    else:
        t = torch.randn(shape, generator=g).masked_fill(torch.rand(shape, generator=g) > 0.8,
                                                        float("-inf"))
        m, read = M.bias(t), lambda ix: m.at(ix)[1]
    ix = m.index(6, 7)
    got = read(ix)
    t4 = t.reshape((1,) * (4 - t.dim()) + t.shape)
    want = _gathered(t4, ix)
    if kind == "bias":
        want = want.masked_fill(want.isneginf(), 0.0)
    assert got.shape == want.shape and torch.equal(got, want)
    if kind == "dense":     # no copy: the mask's own memory, expanded
        assert got.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    # an index copied, sliced or written in place is read as it is, by a gather
    rows = dataclasses.replace(ix, q=ix.q[:, :, 2:5])
    assert torch.equal(read(rows), read(ix)[:, :, 2:5])
    ix.k[..., 0] = 3                                                    # key 3 read twice
    again = read(ix)
    assert torch.equal(again[..., 0], again[..., 3]) and torch.equal(again[..., 1:], got[..., 1:])


def test_tile_map_density_and_counts():
    m = M.sliding_window(256)
    tm = m.tiles(4096, 4096)
    want = exact_states(m.materialize(4096, 4096), 64, 64)
    assert tm.counts() == {"empty": int((want == EMPTY).sum()), "partial": int((want == PARTIAL).sum()),
                           "full": int((want == FULL).sum())}
    assert tm.counts()["partial"] == 64 + 60      # the diagonal, and tile i-4 for i >= 4
    assert tm.counts()["full"] == 63 + 62 + 61    # tiles i-1, i-2, i-3
    assert abs(tm.density - 310 / 4096) < 1e-9    # about 5 of 64 key tiles per query tile


def test_repr_draws_the_mask():
    r = repr(M.causal() & M.padding(torch.tensor([3])))
    assert "causal" in r and "padding" in r
    assert "1 1 1 . . . . ." in r            # the last row: 3 real keys


@pytest.mark.parametrize("make", [
    lambda: M.sliding_window(2) & M.padding([3]),
    lambda: (M.sliding_window(2) & M.padding([3])) & M.causal(),
    lambda: M.causal() & (M.padding([3]) & M.sliding_window(2)),
    lambda: ~(~M.sliding_window(2) | ~M.padding([3])),
], ids=["window-padding", "nested-left", "nested-right", "complement"])
def test_repr_draws_a_composition_where_it_allows_something(make):
    """A window's preview (4 queries, 8 keys, lower right) keeps no key of a padding to
    3: the composition was drawn as an empty grid. It is drawn at the padding's 3 by 3,
    and as the mask itself gives it there."""
    m = make()
    lines = repr(m).splitlines()
    assert "Sq=3, Sk=3" in lines[1], lines
    want = m.materialize(3, 3)[0, 0]
    assert want.any() and lines[2:] == ["  " + " ".join("1" if x else "." for x in row)
                                        for row in want.tolist()]


@pytest.mark.parametrize("make", [
    lambda: M.causal() & M.padding(torch.ones(2, 5, dtype=torch.bool)),
    lambda: M.padding(torch.ones(1, 5, dtype=torch.bool), side="query") | M.sliding_window(9),
    lambda: ~M.dense(torch.ones(1, 1, 5, 5, dtype=torch.bool)) & M.causal(),
    lambda: M.bias(torch.zeros(1, 1, 1, 5)) & M.causal(),
    lambda: M.document(torch.tensor([0, 0, 1, 1, 1])) & M.sliding_window(12),
    lambda: M.at_positions(M.causal(), torch.tensor([[4]]), torch.arange(5)[None]) & M.causal(),
    lambda: M.padding(torch.ones(1, 4, dtype=torch.bool), side="query") & M.padding([5]),
], ids=["padding", "query-padding", "dense", "bias", "document", "positions", "both-paddings"])
def test_repr_of_a_composition_fits_the_tensors_of_its_parts(make):
    """Drawn at lengths every part covers (positions: one query; a query padding of 4 and
    a key padding of 5: 4 by 5, not squared to 4 by 4, which the lengths do not fit)."""
    r = repr(make())
    assert "unavailable" not in r and re.search(r"Sq=[145], Sk=5", r), r   # (causal: Sq < Sk)


@pytest.mark.parametrize("mask, name", [
    (M.causal(), "size"), (M.sliding_window(3), "align"), (M.alibi(2), "num_heads"),
    (M.padding([3]), "side"), (M.causal() & M.alibi(2), "b"), (M.causal() | M.causal(), "a"),
    (~M.padding([3]), "m"), (M.at_positions(M.causal(), torch.arange(3), torch.arange(3)), "m")])
def test_what_a_masks_hash_and_cached_facts_follow_is_read_only(mask, name):
    """Setting ``padding.side`` left its cached key-side tile map in use; swapping an
    operand changed a composition's hash (lost from a dict)."""
    with pytest.raises(AttributeError):
        setattr(mask, name, getattr(mask, name))


def test_repr_draws_batch_0_and_head_0_alone():
    """A mask built for many sequences and heads is drawn from one (Sq, Sk) grid, not by
    building every sequence's (2 million sequences took 11 s and 6 GB)."""
    t = torch.rand(3, 2, 4, 4) > 0.5
    m = M.dense(t) & M.padding(torch.tensor([4, 3, 2]))
    grid = m._grid(4, 4, first=True)
    assert grid.shape == (1, 1, 4, 4) and torch.equal(grid, m.materialize(4, 4)[:1, :1])
    assert repr(m).splitlines()[2:] == ["  " + " ".join("1" if x else "." for x in row)
                                        for row in t[0, 0].tolist()]


@pytest.mark.parametrize("make", [
    lambda: M.document(torch.tensor([[0, 0, 1], [0, 1, 1]])),
    lambda: M.causal() & M.document(torch.tensor([[0, 0, 1], [0, 1, 1]])),
    lambda: M.document(torch.tensor([[0, 0, 1], [0, 1, 1]]), kv_ids=torch.tensor([[0, 1, 1, 1]])),
    lambda: M.document(torch.tensor([[0, 1, 1]]), kv_ids=torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])),
], ids=["ids", "composed", "kv_ids", "kv_ids-batched"])
def test_a_batched_document_mask_draws_its_first_sequence(make):
    """ids of two sequences: repr's one-sequence grid failed in expand ("preview
    unavailable: The expanded size of the tensor (1) must match ...")."""
    m = make()
    sk = 4 if "kv_ids" in m.describe() else 3
    grid = m._grid(3, sk, first=True)
    assert torch.equal(grid, m.materialize(3, sk)[:1, :1])
    assert repr(m).splitlines()[2:] == ["  " + " ".join("1" if x else "." for x in row)
                                        for row in grid[0, 0].tolist()]


def test_masks_made_of_ints_are_values_and_repr_shows_alignment_and_long_masks():
    assert M.causal() == M.causal() and M.sliding_window(4) == M.sliding_window(4)
    assert M.causal() != M.causal(align="upper_left") and M.alibi(4) != M.alibi(8)
    assert len({M.causal() & M.alibi(2), M.causal() & M.alibi(2), M.causal()}) == 2
    pad = M.padding(torch.tensor([3]))
    assert pad == pad and pad != M.padding(torch.tensor([3]))     # tensors: itself only
    lower, upper = repr(M.causal()).splitlines(), repr(M.causal(align="upper_left")).splitlines()
    assert lower[2] == "  1 1 1 1 1 . . ." and upper[2] == "  1 . . . . . . ."   # first query
    for long in (M.padding(torch.tensor([100, 50])), M.causal() & M.padding(torch.tensor([100])),
                 M.document(torch.arange(120) // 40)):
        r = repr(long)
        assert "unavailable" not in r and "too large to draw" in r, r
    assert "1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1 1" in repr(M.padding(torch.tensor([20, 7])))
    for drawn in (M.dense(torch.ones(40, 40, dtype=torch.bool)), M.bias(torch.zeros(20, 40)),
                  M.at_positions(M.causal(), torch.arange(3), torch.arange(6))):
        assert "unavailable" not in repr(drawn), repr(drawn)

    class Keyed(mh.masks.Window):
        def cache_key(self):
            return ["a list", "does not hash"]
    assert hash(Keyed(None)) == hash(Keyed(None)) and Keyed(None) == Keyed(None)


def test_at_positions_of_a_placed_mask_says_so():
    placed = M.at_positions(M.causal(), torch.arange(2), torch.arange(2))
    with pytest.raises(ValueError, match=r"already placed at positions: give the positions once"):
        M.at_positions(placed, torch.arange(2), torch.arange(2))


def test_masks_move_between_devices_and_check_them():
    m = M.padding(torch.tensor([3, 4]))
    assert m.to("cpu")._tensors()[0].device.type == "cpu"
    with pytest.raises(ValueError, match="meta"):
        m.check(2, 1, 4, 4, device="meta")


# -- host facts: what backends decide on without reading a device tensor -------------------

from conftest import make_masks  # noqa: E402


@pytest.mark.parametrize("sq,sk", [(7, 7), (3, 11), (11, 3), (1, 5), (16, 16)])
@pytest.mark.parametrize("seed", range(3))
def test_may_have_empty_rows_is_sound(sq, sk, seed):
    """False only if every query row really has a key (what lets sdpa skip its row fix)."""
    cases = dict(make_masks(2, 3, sq, sk, seed=seed))
    cases.update({"window 2 ul": M.sliding_window(2, align="upper_left"),
                  "window 3": M.sliding_window(3), "causal ul": M.causal(align="upper_left"),
                  "padding all real": M.padding(torch.tensor([sk, sk])),
                  "padding bool": M.padding(torch.ones(2, sk, dtype=torch.bool))})
    for name, m in cases.items():
        if m is None:
            continue
        has_empty = bool((~m.materialize(sq, sk).any(-1)).any())
        if has_empty:
            assert m.may_have_empty_rows(sq, sk), f"{name} ({sq}x{sk}) claims no empty rows"


def test_may_have_empty_rows_is_exact_where_it_can_be():
    assert not M.causal().may_have_empty_rows(4, 9) and M.causal().may_have_empty_rows(9, 4)
    assert not M.causal(align="upper_left").may_have_empty_rows(9, 4)
    assert M.sliding_window(2, align="upper_left").may_have_empty_rows(9, 4)
    assert not M.padding(torch.tensor([3, 1])).may_have_empty_rows(5, 5)
    assert M.padding(torch.tensor([3, 0])).may_have_empty_rows(5, 5)
    assert not (M.causal() & M.alibi(2)).may_have_empty_rows(5, 5)
    assert not (M.causal() | M.dense(torch.zeros(5, 5, dtype=torch.bool))).may_have_empty_rows(5, 5)
    for m in (M.causal(align="upper_left"), M.alibi(2), M.causal() & M.alibi(2)):   # no keys
        assert m.may_have_empty_rows(3, 0) and not m.may_have_empty_rows(0, 0)


@pytest.mark.parametrize("copy_of", [copy.copy, copy.deepcopy,
                                     lambda m: pickle.loads(pickle.dumps(m))],
                         ids=["copy", "deepcopy", "pickle"])
def test_a_copy_never_trusts_host_facts_of_values_written_over_since(copy_of):
    """Facts read at version 1, then a second write: a copy's tensors count versions afresh,
    so the old stamp (1,) matched the copy's counter and vouched for the old runs and
    lengths (varlen was off by 1.3; a length of 7 passed for Sk = 4)."""
    doc = M.document(torch.zeros(8, dtype=torch.long))
    doc.ids.copy_(torch.tensor([[0, 0, 0, 0, 1, 1, 1, 1]]))
    doc.runs()                                                  # found and stamped
    doc.ids.copy_(torch.tensor([[0, 0, 1, 1, 2, 2, 3, 3]]))
    c = copy_of(doc)
    assert [t.tolist() for t in c.runs().lengths] == [[2, 2, 2, 2]]
    q, k, v = (torch.randn(1, 2, 8, 4, dtype=torch.float64) for _ in range(3))
    want = mh.attention(q, k, v, mask=c.materialize(8, 8), backend="reference")
    torch.testing.assert_close(mh.attention(q, k, v, mask=c, backend="varlen"), want)
    pad = M.padding(torch.tensor([2, 2]))
    pad.lengths.copy_(torch.tensor([3, 3]))
    pad.describe()                                              # read again and stamped
    pad.lengths.copy_(torch.tensor([0, 7]))
    c = copy_of(pad)
    assert c.may_have_empty_rows(8, 8) and "lengths=[0, 7]" in c.describe()
    with pytest.raises(ValueError, match="has a length 7 > Sk = 4"):
        c.materialize(4, 4)
    fresh = M.document(cu_seqlens=[0, 3, 8])
    fresh.runs()
    assert copy_of(fresh)._facts_hold()                         # facts that hold travel


def test_a_tensor_assigned_in_place_of_a_masks_own_is_read_not_its_old_facts():
    """A new tensor starts its own version count, which may equal the old one's: the
    facts read from the old one (lengths, runs, tile maps) used to stay in use."""
    pad = M.padding(torch.tensor([3, 3]))
    assert not pad.may_have_empty_rows(8, 8)
    pad.lengths = torch.tensor([0, 7])
    assert pad.may_have_empty_rows(8, 8) and "lengths=[0, 7]" in pad.describe()
    doc = M.document(torch.tensor([0, 0, 1, 1]))
    doc.runs()
    doc.ids = torch.tensor([[0, 1, 2, 3]])
    assert [t.tolist() for t in doc.runs().lengths] == [[1, 1, 1, 1]]
    dense = M.dense(torch.ones(1, 1, 8, 8, dtype=torch.bool))
    dense.tiles(8, 8, tile_q=4, tile_k=4)
    dense.t = torch.zeros(1, 1, 8, 8, dtype=torch.bool)
    assert dense.tiles(8, 8, tile_q=4, tile_k=4).state.eq(EMPTY).all()


@pytest.mark.parametrize("make, attr, rows", [
    (M.padding, "lengths", torch.tensor([2, 4, 3])),
    (M.padding, "real", torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]).bool()),
    (M.document, "ids", torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 0, 1]])),
    (lambda p: M.at_positions(M.causal(), p, torch.arange(4)), "q_positions",
     torch.tensor([[0, 1, 2, 3], [3, 3, 3, 3], [1, 1, 2, 2]])),
])
def test_a_tensor_assigned_in_place_of_a_masks_own_sets_its_batch(make, attr, rows):
    """The batch size was read once, when the mask was built: 3 rows assigned to a mask
    built with 2 ran a batch of 2 with the first 2 rows, and 1 row indexed out of bounds."""
    q = torch.randn(2, 2, 4, 8)
    mask = make(rows[:2])
    setattr(mask, attr, rows)
    assert mask.batch_size == 3 and (mask & M.causal()).batch_size == 3
    for m in (mask, mask & M.causal(), ~(mask & M.causal())):
        with pytest.raises(ValueError, match="built for batch size 3, but the inputs have batch "
                                             "size 2"):
            mh.attention(q, q, q, mask=m)
    if attr == "q_positions":                     # rows that disagree: said, by a call and repr
        mask.k_positions = torch.arange(4).expand(2, 4)
        assert "the batch sizes disagree (q_positions 3, k_positions 2" in repr(mask)
        with pytest.raises(ValueError, match="the batch sizes disagree"):
            mh.attention(q, q, q, mask=mask)
        mask.k_positions = torch.arange(4)[None]
    setattr(mask, attr, rows[2:])                 # one row for all: broadcast to the batch
    assert mask.batch_size in (1, None)
    torch.testing.assert_close(mh.attention(q, q, q, mask=mask),
                               mh.attention(q, q, q, mask=make(rows[2:])))


def test_a_tile_map_is_the_callers_own():
    """Writing into a returned map used to change the cached one, which the kernels' block
    lists come from (blocksparse causal attention then skipped 64 rows)."""
    tm = M.causal().tiles(128, 128, tile_q=64, tile_k=64)
    tm.state.fill_(EMPTY)
    assert M.causal().tiles(128, 128, tile_q=64, tile_k=64).state[0, 0].tolist() == [
        [PARTIAL, EMPTY], [FULL, PARTIAL]]
    q, k, v = (torch.randn(1, 1, 128, 8, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(mh.attention(q, k, v, mask=M.causal(), backend="blocksparse"),
                               mh.attention(q, k, v, mask=M.causal(), backend="reference"))


@pytest.mark.parametrize("build", [lambda t: M.padding(t), lambda t: M.document(cu_seqlens=t)],
                         ids=["padding", "document"])
def test_values_on_the_meta_device_that_a_mask_must_read_are_refused_by_name(build):
    with pytest.raises(ValueError, match=r"(padding's lengths|document's cu_seqlens) are on the "
                                         r"meta device.*build it from real ones, then move it"):
        build(torch.tensor([0, 3]).to("meta"))
    moved = build(torch.tensor([0, 3])).to("meta")                    # as the message says
    assert moved._tensors()[0].device.type == "meta"


def test_moving_a_mask_keeps_its_host_facts_and_reads_nothing_back():
    from nosync import NoReadBack
    doc = M.document(cu_seqlens=torch.tensor([0, 3, 8]))
    pad = M.padding(torch.tensor([5, 2]))
    with NoReadBack():
        d, p = doc.to("meta"), pad.to("meta")
        assert d.runs_known and d.runs().lengths[0].tolist() == [3, 5]
        assert "2 runs" in d.describe() and p.describe() == "padding(lengths=[5, 2])"
        assert not p.may_have_empty_rows(4, 5)
        b = M.bias(torch.zeros(1, 1, 4, 4)).to("meta")
        assert b.values.device.type == "meta" and b.has_predicate
    born = M.document(torch.zeros(6, dtype=torch.long, device="meta"))
    assert not born.runs_known and "on meta" in born.describe()


def test_a_masks_tensors_written_in_place_are_followed_not_facts_of_their_old_values():
    """Facts a mask read from its tensors (document runs, lengths) describe those values:
    written in place, every backend follows the new values, as a mask built afresh."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 4, generator=g) for _ in range(3))
    doc = M.document(torch.tensor([0, 0, 0, 0, 1, 1, 1, 1]))
    assert doc.runs().lengths[0].tolist() == [4, 4]
    doc.ids.copy_(torch.tensor([[0, 0, 1, 1, 1, 1, 1, 2]]))
    assert doc.runs().lengths[0].tolist() == [2, 5, 1] and "3 runs" in doc.describe()
    pad = M.padding(torch.tensor([3, 8]))
    assert not pad.may_have_empty_rows(8, 8)
    pad.lengths.copy_(torch.tensor([0, 6]))          # a sequence with no keys at all now
    assert pad.may_have_empty_rows(8, 8) and pad.describe() == "padding(lengths=[0, 6])"
    fresh = {id(doc): M.document(torch.tensor([0, 0, 1, 1, 1, 1, 1, 2])),
             id(pad): M.padding(torch.tensor([0, 6]))}
    for mask in (doc, pad):
        want = mh.attention(q, k, v, mask=fresh[id(mask)], backend="reference")
        for backend in ("reference", "sdpa", "blocksparse", "rows") + (
                ("varlen",) if mask is doc else ()):
            out = mh.attention(q, k, v, mask=mask, backend=backend)
            torch.testing.assert_close(out, want, msg=f"{backend}, {mask.describe()}")
    assert (mh.attention(q, k, v, mask=pad, backend="sdpa")[0] == 0).all()
    on_device = pad.to("meta")                       # a device's lengths are not read back
    on_device.lengths.fill_(2)
    assert on_device.may_have_empty_rows(8, 8) and on_device._host_lengths is None


def test_masks_built_and_written_in_inference_mode_follow_their_tensors():
    """Inference tensors keep no version counter; a mask's own copies keep one anyway."""
    q = torch.randn(1, 2, 8, 4)
    with torch.inference_mode():
        doc, pad = M.document(torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])), M.padding(torch.tensor([8]))
        for m in (doc, pad, doc.to("cpu")):
            mh.attention(q, q, q, mask=m, backend="varlen" if m is doc else "sdpa")
        doc.ids.copy_(torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2]]))
        pad.lengths.fill_(0)
        want = mh.attention(q, q, q, mask=M.document(torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])),
                            backend="reference")
        torch.testing.assert_close(mh.attention(q, q, q, mask=doc, backend="varlen"), want)
        assert "3 runs" in doc.describe() and pad.may_have_empty_rows(8, 8)
        assert (mh.attention(q, q, q, mask=pad, backend="sdpa") == 0).all()


def test_a_tensor_mask_says_whether_a_row_allows_nothing_and_follows_writes_into_it():
    """A host bias is read once (each row's maximum) for NaN, +inf and rows with nothing to
    attend to, a dense mask for rows with no True; written in place (also as an inference
    tensor, which counts no versions), they are read again, and a device's or a subclass's
    rows are never vouched for."""
    inf = float("inf")
    t = torch.tensor([[0.0, -inf, 1.0], [-inf, 2.0, -inf]])
    b = M.bias(t)
    assert not b.may_have_empty_rows(2, 3) and b.may_have_empty_rows(2, 0)
    t[1, 1] = -inf                                   # row 1 has nothing left to attend to
    assert b.may_have_empty_rows(2, 3)
    assert M.bias(torch.full((1, 2, 3, 1), -inf)).may_have_empty_rows(3, 5)   # broadcast keys
    assert not M.bias(torch.zeros(1, 2, 3, 1)).may_have_empty_rows(3, 5)
    with torch.inference_mode():
        u = torch.zeros(2, 3)
        c = M.bias(u)
        assert not c.may_have_empty_rows(2, 3)
        u[0] = -inf
        assert c.may_have_empty_rows(2, 3)
    assert M.bias(torch.zeros(2, 3, device="meta")).may_have_empty_rows(2, 3)

    class Mine(type(b)):
        pass
    assert Mine(torch.zeros(2, 3)).may_have_empty_rows(2, 3)
    a = torch.tensor([[True, False], [False, True]])
    d = M.dense(a)                                   # (read at its first question)
    assert not d.may_have_empty_rows(2, 2) and d.may_have_empty_rows(2, 0)
    a[0, 0] = False
    assert d.may_have_empty_rows(2, 2)
    assert M.dense(torch.ones(2, 1, dtype=torch.bool, device="meta")).may_have_empty_rows(2, 2)
    with pytest.raises(ValueError, match=r"bias contains NaN or \+inf \(2 of 6 values; the "
                                         r"first at index \(0, 2\): inf\)"):
        M.bias(torch.tensor([[0.0, 1.0, inf], [-inf, float("nan"), 0.0]]))


def test_a_subclass_of_a_tensor_mask_is_read_through_its_own_methods():
    """The tensor of a bias passes as its own additive form only for the class itself: a
    subclass's ``_bias`` and ``_allowed`` are what it means, wherever it is read."""
    inf = float("inf")

    class Doubled(type(M.bias(torch.zeros(1)))):
        def _bias(self, ix):
            return super()._bias(ix) * 2

        def may_have_empty_rows(self, sq, sk):
            return False

    t = torch.tensor([[0.5, -inf, 1.0], [0.25, 0.0, 2.0], [1.0, 1.0, 1.0]])
    m = Doubled(t)
    assert m.additive(3, 3)[0, 0].tolist() == [[1.0, -inf, 2.0], [0.5, 0.0, 4.0], [2.0] * 3]
    q = torch.randn(1, 2, 3, 4, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(mh.attention(q, q, q, mask=m, backend="sdpa"),
                               mh.attention(q, q, q, mask=M.bias(2 * t), backend="reference"))


def test_lengths_written_negative_or_too_long_are_refused_by_the_call_not_the_repr():
    q = torch.randn(2, 2, 4, 8)
    pad = M.padding(torch.tensor([2, 3]))
    pad.lengths.copy_(torch.tensor([-1, 3]))
    assert "padding(lengths=[-1, 3])" in repr(pad)
    with pytest.raises(ValueError, match=r"padding\(lengths=\[-1, 3\]\) has a negative length"):
        mh.attention(q, q, q, mask=pad)
    pad.lengths.copy_(torch.tensor([9, 3]))
    with pytest.raises(ValueError, match="has a length 9 > Sk = 4"):
        mh.attention(q, q, q, mask=pad)


def test_a_mask_written_between_forward_and_backward_is_refused_where_backward_reads_it():
    """blocksparse evaluates the mask again in its backward: a mask written in place since
    the forward would give the gradient of another forward (torch refuses the same for the
    tensors autograd saves). Backends that save the materialized mask are unaffected."""
    q, k, v = (torch.randn(2, 2, 32, 8, requires_grad=True) for _ in range(3))
    for backend in ("blocksparse", "sdpa"):
        pad = M.sliding_window(8) & M.padding(torch.tensor([32, 20]))
        out = mh.attention(q, k, v, mask=pad, backend=backend)
        pad.b.lengths.copy_(torch.tensor([10, 32]))
        if backend == "blocksparse":
            with pytest.raises(RuntimeError,
                               match=r"written in place \(or replaced\) after the forward ran"):
                out.sum().backward()
        else:
            out.sum().backward()
            fresh = mh.attention(q, k, v, mask=M.sliding_window(8) & M.padding(
                torch.tensor([32, 20])), backend="reference")
            want = torch.autograd.grad(fresh.sum(), q)[0]
            torch.testing.assert_close(q.grad, want)


def test_cache_keys_name_everything_that_determines_a_mask():
    assert M.causal().cache_key() != M.causal(align="upper_left").cache_key()
    assert M.sliding_window(8).cache_key() != M.sliding_window(9).cache_key()
    assert (M.causal() & M.alibi(4)).cache_key() == (M.causal() & M.alibi(4)).cache_key()
    assert (M.causal() & M.alibi(4)).cache_key() != (M.causal() & M.alibi(8)).cache_key()
    assert M.padding(torch.tensor([3])).cache_key() is None            # holds a tensor
    assert (M.causal() & M.padding(torch.tensor([3]))).cache_key() is None

    class Mine(M.Mask):
        def _allowed(self, ix):
            return ix.q >= ix.k
    assert Mine().cache_key() is None and not Mine().memoizable    # a user's class: not shared


@pytest.mark.parametrize("build", ["alibi", "causal & alibi", "window & padding",
                                   "padding rows", "document"])
def test_masks_built_inside_a_fullgraph_compiled_function_trace(build):
    """Building a mask is part of the traced program: no construction reads a tensor back
    (ALiBi's slopes and padding's lengths once did, failing ``fullgraph=True`` with every
    backend)."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 24, 8, generator=g) for _ in range(3))
    lengths, ids = torch.tensor([20, 9]), torch.arange(24) // 5

    def fn(q, k, v, lengths, ids):
        m = {"alibi": lambda: mh.masks.alibi(4),
             "causal & alibi": lambda: mh.masks.causal() & mh.masks.alibi(4),
             "window & padding": lambda: mh.masks.sliding_window(5) & mh.masks.padding(lengths),
             "padding rows": lambda: mh.masks.padding(torch.arange(24) < lengths[:, None]),
             "document": lambda: mh.masks.document(ids)}[build]()
        return mh.attention(q, k, v, mask=m)
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(q, k, v, lengths, ids)
    torch.testing.assert_close(got, fn(q, k, v, lengths, ids))


def test_tiles_of_an_empty_side_are_empty():
    """Zero queries (or a batch of 0) give a tile map with no tiles, as broadcasting says."""
    m = M.padding(torch.tensor([5, 7]))
    t = m.tiles(0, 64, tile_q=16, tile_k=16)
    assert tuple(t.state.shape) == (2, 1, 0, 4)
    for side in ("key", "query"):                             # a (B, 0) bool mask: no tiles
        none = M.padding(torch.zeros(2, 0, dtype=torch.bool), side=side)
        sizes = (3, 0) if side == "key" else (0, 3)
        assert none.tiles(*sizes, tile_q=2, tile_k=2).state.numel() == 0
    one = M.padding(torch.tensor([5]))                        # one row broadcasts to none
    both = (M.causal() & one).tiles(32, 32, tile_q=16, tile_k=16, batch=0)
    assert both.state.shape[0] == 0 and both.state.numel() == 0
    with pytest.raises(ValueError, match=r"tiles: batch=0, but .* was built for 2"):
        m.tiles(32, 32, batch=0)                              # as a call of B=0 is refused


def test_at_positions_measures_distances_between_the_given_positions():
    g = torch.Generator().manual_seed(0)
    B, Sq, Sk, H = 2, 3, 7, 4
    k_pos = torch.randint(0, 9, (B, Sk), generator=g)
    q_pos = torch.randint(0, 9, (B, Sq), generator=g)
    d = (q_pos[:, None, :, None] - k_pos[:, None, None, :]).double()     # (B, 1, Sq, Sk)
    slopes = mh.masks.alibi_slopes(H).double().view(1, H, 1, 1)
    want = torch.where((d >= 0) & (d < 3), -slopes * d.abs(), float("-inf"))
    m = mh.masks.at_positions(mh.masks.sliding_window(3) & mh.masks.alibi(H), q_pos, k_pos)
    got = m.additive(Sq, Sk, dtype=torch.float64)
    torch.testing.assert_close(got, want, atol=0, rtol=0)
    q = torch.randn(B, H, Sq, 8, dtype=torch.float64)
    kv = torch.randn(B, H, Sk, 8, dtype=torch.float64)
    ref = torch.softmax(q @ kv.transpose(-1, -2) / 8 ** 0.5 + want, -1).nan_to_num(0) @ kv
    for backend in ("reference", "sdpa", "blocksparse"):
        out = mh.attention(q, kv, kv, mask=m, backend=backend)
        torch.testing.assert_close(out, ref, atol=1e-12, rtol=1e-12, msg=backend)


def test_a_tensor_assigned_in_place_of_another_never_gets_its_cached_tiles():
    """Facts cached on a mask are keyed by its tensors' versions and identities. ``id()`` is
    reused once a tensor is freed, so a new positions tensor could take the old one's id
    with an equal (fresh) version and get the old tile map: all FULL where the new
    positions allow nothing. Tried until the id is reused (CPython reuses it often)."""
    reused = 0
    for _ in range(300):
        m = M.at_positions(M.causal(), torch.zeros(32, dtype=torch.long),
                           torch.zeros(32, dtype=torch.long))
        both = m & M.padding(torch.tensor([32]))
        for mask in (m, both):
            assert mask.tiles(32, 32, tile_q=8, tile_k=8).counts()["full"] == 16
        old = id(m.q_positions)
        for _ in range(20):
            m.q_positions = torch.full((1, 32), -1)          # before every key: none allowed
            if id(m.q_positions) == old:
                break
        if id(m.q_positions) == old:
            reused += 1
            for mask in (m, both):
                assert mask.tiles(32, 32, tile_q=8, tile_k=8).counts()["full"] == 0
        if reused >= 3:
            break
    assert reused >= 3, "no id was reused: the case was not exercised"


def test_a_window_wider_than_any_distance_is_causal_at_negative_positions_too():
    """A window compares each key with the query's edge minus its size: for a size near
    2**63 that difference wrapped around at negative positions, and rows saw nothing."""
    import sys
    p = torch.tensor([-3, -2, -1, 0, 5])
    for size in (sys.maxsize, 1 << 62):
        got = mh.masks.at_positions(mh.masks.sliding_window(size), p, p).materialize(5, 5)
        want = mh.masks.at_positions(mh.masks.causal(), p, p).materialize(5, 5)
        assert torch.equal(got, want), size


def test_a_padded_caches_window_skips_the_tiles_outside_it():
    """The tile map of a window at positions: a decoding step over 4096 slots (the first
    1000 of the second row padding) with a window of 256 tokens visits the key tiles that
    hold those tokens, not all 64 (every tile was visited before); the map is sound."""
    valid = torch.arange(4096) >= torch.tensor([[0], [1000]])                    # (2, 4096)
    from multihead.masks.positioned import distances_in_tokens
    m = distances_in_tokens(M.causal() & M.sliding_window(256), valid, 1) & M.padding(valid)
    state = m.tiles(1, 4096, tile_q=16, tile_k=64, batch=2).state              # (2, 1, 1, 64)
    want = exact_states(m.materialize(1, 4096), 16, 64)
    assert not ((state.long() == EMPTY) & (want != EMPTY)).any()
    assert not ((state.long() == FULL) & (want != FULL)).any()
    visited = (state != EMPTY).sum(-1).flatten().tolist()
    assert visited == [4, 4], visited          # the last 256 tokens: slots 3840..4095


@pytest.mark.parametrize("args, message", [
    ((torch.arange(3.0), torch.arange(4)), "q_positions must be an integer tensor"),
    ((torch.arange(3), torch.zeros(1, 1, 4, dtype=torch.long)), "k_positions must be an integer"),
    ((torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 4, dtype=torch.long)),
     "the batch sizes disagree"),
])
def test_at_positions_refuses_what_is_not_positions(args, message):
    with pytest.raises(ValueError, match=message):
        mh.masks.at_positions(mh.masks.causal(), *args)


def test_at_positions_checks_the_call_sizes():
    m = mh.masks.at_positions(mh.masks.sliding_window(2), torch.arange(3), torch.arange(4))
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="k_positions has 4 positions but the call has 5"):
        mh.attention(q, torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4), mask=m)


def test_at_positions_is_one_custom_leaf_to_backends_that_compile_masks_by_kind():
    from multihead.functional._call import make_call
    from multihead.functional.capabilities import Capabilities
    inner = mh.masks.sliding_window(2) & mh.masks.alibi(2)
    m = mh.masks.at_positions(inner, torch.arange(4), torch.arange(4))
    assert [leaf.kind for leaf in m.leaves()] == ["custom", "custom"]
    q = torch.randn(1, 2, 4, 8, dtype=torch.float16)
    call = make_call(q, q, q, mask=m, scale=None, dropout_p=0.0, return_weights=False,
                     return_lse=False)
    kernels = Capabilities(masks=frozenset({"window", "alibi", "and"}))   # as SDPA's would be
    assert ("does not apply at_positions masks (a padded KV cache puts a window or ALiBi at its "
            "tokens' positions that way)") in kernels.reasons(call, "cpu")
    placed = Capabilities(masks=frozenset({"window", "alibi", "and", "at_positions"}))  # Triton's
    assert placed.reasons(call, "cpu") == []
    from multihead.masks.base import Mask
    other = Mask() & mh.masks.causal()                          # a user's own kind: still refused
    call = make_call(q, q, q, mask=other, scale=None, dropout_p=0.0, return_weights=False,
                     return_lse=False)
    assert "does not apply causal, custom masks" in " ".join(placed.reasons(call, "cpu"))


def test_at_positions_moves_order_and_distance_leaves_and_leaves_per_slot_data_on_slots():
    """A left-padded row: positions -1, 0, 1, 2, 3 (cumsum - 1). The window counts
    positions; the padding and a dense mask keep naming slots (they were indexed by the
    positions: a raw IndexError past their size, a silent wrap-around for -1)."""
    valid = torch.tensor([[False, True, True, True, True]])
    pos = valid.long().cumsum(-1) - 1                                   # (1, 5)
    rows = torch.tensor([[True, True, False, True, True], [True] * 5])  # (Sq=2, Sk=5)
    m = M.at_positions(M.sliding_window(2) & M.padding(valid) & M.dense(rows), pos[:, 3:], pos)
    assert [leaf.describe().split("(")[0] for leaf in m.leaves()] == \
        ["at_positions", "padding", "dense"]
    want = torch.tensor([[False, False, False, True, False],            # positions 1, 2:
                         [False, False, False, True, True]])            # slots 2 (dense: no), 3
    assert torch.equal(m.materialize(2, 5)[0, 0], want)
    with pytest.raises(ValueError, match=r"padding\(lengths=\[3\]\) has no leaf that measures "
                                         r"order or distance.*use the mask as it is"):
        M.at_positions(M.padding(torch.tensor([3])), torch.arange(2), torch.arange(4))
    with pytest.raises(ValueError, match=r"one needs Sq = 3, the other Sq = 4, which no call fits"):
        M.at_positions(M.causal(), torch.arange(3), torch.arange(5)) & M.dense(
            torch.ones(4, 5, dtype=torch.bool))


def test_at_positions_refuses_a_non_mask_and_positions_on_two_devices():
    with pytest.raises(TypeError, match="mask must be a multihead mask, got Tensor"):
        mh.masks.at_positions(torch.ones(2, 2, dtype=torch.bool), torch.arange(2), torch.arange(2))
    with pytest.raises(ValueError, match="q_positions is on meta but k_positions on cpu"):
        mh.masks.at_positions(mh.masks.causal(), torch.arange(2, device="meta"), torch.arange(2))


# -- the mask methods and compositions refuse sizes no call fits -----------------------------

_SQUARE = torch.tensor([[True, False, True, True]] * 4)                  # (4, 4)


@pytest.mark.parametrize("mask, sq, sk", [
    (M.dense(_SQUARE), 2, 2),                   # used to come back cropped to (2, 2)
    (M.dense(_SQUARE), 8, 8),                   # used to fail deep in an index
    (M.bias(torch.zeros(4, 4)), 2, 3),
    (M.padding(torch.ones(2, 5, dtype=torch.bool)), 5, 3),
], ids=["dense-smaller", "dense-larger", "bias", "padding-row"])
def test_materialize_additive_and_tiles_refuse_lengths_the_mask_does_not_cover(mask, sq, sk):
    """A call with these lengths is refused by attention; so are the mask's own dense forms
    (a cropped dense mask is a different mask), naming the method."""
    q = torch.zeros(mask.batch_size or 1, 1, sq, 8)
    k = torch.zeros(mask.batch_size or 1, 1, sk, 8)
    with pytest.raises(ValueError, match="does not broadcast|covers"):
        mh.attention(q, k, k, mask=mask)
    for method in ("materialize", "additive", "tiles"):
        with pytest.raises(ValueError, match=f"^{method}: mask: .*(does not broadcast|covers)"):
            getattr(mask, method)(sq, sk)
    assert mask.materialize(4, 4 if mask.kind != "padding" else 5).shape[-2:] in ((4, 4), (4, 5))


@pytest.mark.parametrize("call, message", [
    (lambda: M.causal().materialize(-1, 4), r"materialize: sq must be an int >= 0, got -1"),
    (lambda: M.causal().materialize(2.5, 4), r"materialize: sq must be an int >= 0, got 2.5"),
    (lambda: M.causal().additive(3, "4"), r"additive: sk must be an int >= 0, got '4'"),
    (lambda: M.causal().tiles(8, 8, tile_q=0), r"tiles: tile_q must be a positive int, got 0"),
    (lambda: M.causal().tiles(8, 8, tile_k=2.5), r"tiles: tile_k must be a positive int, got 2.5"),
    (lambda: M.causal().tiles(8, 8, batch=-1), r"tiles: batch must be an int >= 0, got -1"),
    (lambda: M.alibi_slopes(0), r"alibi_slopes: num_heads must be a positive int, got 0"),
    (lambda: M.alibi_slopes(2.0), r"alibi_slopes: num_heads must be a positive int, got 2.0"),
    (lambda: M.alibi(2**40), r"alibi: num_heads must be at most 1048576, got 1099511627776: pass "
                             r"the number of heads"),
], ids=["negative", "float", "str", "tile-0", "tile-float", "batch-negative", "slopes-0",
        "slopes-float", "alibi-huge"])
def test_mask_methods_refuse_bad_sizes_by_name(call, message):
    with pytest.raises(ValueError, match=message):
        call()


@pytest.mark.parametrize("dtype,words", [
    (torch.bool, r"floating-point dtype .* got torch.bool: use materialize\(\) for bool"),
    (torch.int64, r"torch.float64, got torch.int64"),
    ("float32", r"torch.float64, got 'float32' \(a str\): pass torch.float32"),
    (torch.float8_e4m3fn, r"got torch.float8_e4m3fn: float8_e4m3fn is a storage format")])
def test_additive_refuses_a_dtype_it_cannot_compute_in(dtype, words):
    with pytest.raises(TypeError, match=r"additive: dtype must be .*" + words):
        M.causal().additive(2, 2, dtype=dtype)
    assert M.causal().additive(2, 2, dtype=torch.float16).dtype == torch.float16


def test_numpy_lengths_are_lengths():
    np = pytest.importorskip("numpy")
    want = M.causal().materialize(3, 5)
    assert torch.equal(M.causal().materialize(np.int64(3), np.int32(5)), want)
    assert M.causal().tiles(np.int64(64), 64, tile_q=np.int64(16)).state.shape == (1, 1, 4, 1)


@pytest.mark.parametrize("build, message", [
    (lambda: M.padding(torch.tensor([1, 2])) & M.padding(torch.tensor([1, 2, 3])),
     "built for batch size 2 and 3, which no call fits"),
    (lambda: M.alibi(2) & M.alibi(3), "built for heads 2 and 3, which no call fits"),
    (lambda: M.dense(_SQUARE) & M.dense(torch.ones(5, 5, dtype=torch.bool)),
     "one needs Sq = 4, the other Sq = 5"),
    (lambda: ~M.document(torch.zeros(1, 6, dtype=torch.long)) & M.bias(torch.zeros(3, 7)),
     "one needs Sk = 6, the other Sk = 7"),
    (lambda: M.causal() & M.padding(torch.ones(2, 5, dtype=torch.bool)) & M.dense(_SQUARE),
     "one needs Sk = 5, the other Sk = 4"),
    (lambda: M.dense(torch.ones(3, 5, dtype=torch.bool)) & M.padding([7]),
     "one needs Sk = 5, the other Sk >= 7"),
    (lambda: M.padding([9, 2], side="query") & M.causal() & M.bias(torch.zeros(4, 4)),
     "one needs Sq = 4, the other Sq >= 9"),
    (lambda: ~M.document(torch.arange(10)) | (M.padding([20]) & M.causal()),
     "one needs Sk = 10, the other Sk >= 20"),
], ids=["batch", "heads", "dense-lengths", "document-bias", "nested", "padding-longer",
        "query-padding-longer", "nested-padding-longer"])
def test_a_composition_no_call_fits_is_refused_when_built(build, message):
    """Not at the first call, after the model was built: the operator's line names both."""
    with pytest.raises(ValueError, match=message):
        build()


def test_compositions_that_broadcast_are_still_built():
    built = [M.padding(torch.tensor([3])) & M.padding(torch.tensor([1, 2])),    # batch 1
             M.alibi(1) & M.alibi(4),
             M.dense(torch.ones(4, 1, dtype=torch.bool)) | M.dense(_SQUARE),
             M.document(torch.zeros(1, 6, dtype=torch.long)) & M.bias(torch.zeros(3, 6))]
    assert [m.additive(*((3, 6) if i == 3 else (4, 4))).shape for i, m in enumerate(built)] \
        == [(2, 1, 4, 4), (1, 4, 4, 4), (1, 1, 4, 4), (1, 1, 3, 6)]


@pytest.mark.parametrize("dynamic", [None, True])
@pytest.mark.parametrize("kind", ["padding", "document"])
def test_masks_built_in_a_compiled_forward_follow_the_batch(kind, dynamic):
    """A batch size that changes becomes symbolic: the masks' size checks must read it as
    the number it stands for (no false "built for batch size 3, inputs have 3")."""
    torch._dynamo.reset()
    m = mh.MultiHeadAttention(32, 4, num_kv_heads=2).eval()

    def forward(x, t):
        return m(x, mask=M.padding(t) if kind == "padding" else M.document(t))
    compiled = torch.compile(forward, backend="eager", fullgraph=True, dynamic=dynamic)
    g = torch.Generator().manual_seed(3)
    for B in (2, 3, 4):
        x = torch.randn(B, 8, 32, generator=g)
        t = torch.randint(1, 9, (B,), generator=g) if kind == "padding" else \
            torch.randint(0, 3, (B, 8), generator=g).sort(-1).values
        with torch.no_grad():
            torch.testing.assert_close(compiled(x, t), forward(x, t))


def test_a_mask_whose_bias_broadcasts_over_the_queries_runs_on_the_gqa_fold():
    """Mask.at may return terms broadcastable to the index's shape: a bias of the keys only
    ``(1, 1, 1, Sk)``, repeated per query head when sdpa folds a group into the queries
    (GQA with few queries), as the reference reads it."""
    from multihead.masks.base import Mask

    class KeyBias(Mask):
        has_bias, has_predicate = True, False

        def _allowed(self, ix):
            return torch.ones((), dtype=torch.bool)

        def _bias(self, ix):
            return -0.1 * ix.k.double()                                   # (1, 1, 1, Sk)

        def _tile_bounds(self, tx):
            return torch.tensor(True), torch.tensor(True)

    g = torch.Generator().manual_seed(16)
    q = torch.randn(2, 8, 4, 16, dtype=torch.float64, generator=g)
    k = torch.randn(2, 2, 20, 16, dtype=torch.float64, generator=g)
    assert "folded" in str(mh.explain(q, k, k, mask=KeyBias(), backend="sdpa"))
    torch.testing.assert_close(mh.attention(q, k, k, mask=KeyBias(), backend="sdpa"),
                               mh.attention(q, k, k, mask=KeyBias(), backend="reference"))


def test_an_empty_list_of_lengths_or_ids_is_an_empty_batch_not_floats():
    """torch makes [] a float tensor: padding([]) was refused for a dtype never passed."""
    assert mh.masks.padding([]).batch_size == 0
    assert mh.masks.padding(torch.tensor([], dtype=torch.long)).batch_size == 0
    assert mh.masks.document([]).ids.dtype == torch.int64


def test_read_free_reads_a_host_tensor_and_nothing_it_cannot_read_for_free():
    """The one gate of the backends' host reads: a CPU tensor in eager is read; under vmap,
    a fake-tensor mode or torch.compile nothing is (None), and nothing raises."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from multihead.masks.tensor import read_free
    t = torch.tensor([[0.0, float("-inf")], [1.0, 2.0]])
    assert read_free(t, lambda: bool(t.isneginf().any())) is True
    seen = torch.func.vmap(lambda r: torch.tensor(float(
        read_free(r, lambda: bool(r.isneginf().any())) is None)))(t)
    assert seen.tolist() == [1.0, 1.0]
    with FakeTensorMode():
        f = torch.ones(2)
        assert read_free(f, lambda: bool(f.all())) is None
    compiled = torch.compile(lambda x: x + float(read_free(x, lambda: 1.0) is None),
                             backend="eager", fullgraph=True)
    assert compiled(torch.zeros(1)).item() == 1.0


def test_index_grids_are_kept_and_made_again_when_written():
    m = mh.masks.causal()
    ix = m._index_grid(3, 4)
    assert m._index_grid(3, 4).q is ix.q
    assert m.index(3, 4).q is not ix.q            # the public grid: the caller's own
    ix.q.add_(1)                                  # written: the next grid is a fresh one
    again = m._index_grid(3, 4)
    assert again.q is not ix.q and again.q.flatten().tolist() == [0, 1, 2]
    assert m.materialize(3, 4)[0, 0].tolist() == torch.ones(3, 4).tril(1).bool().tolist()


def test_index_grids_made_in_inference_mode_are_normal_tensors():
    mh.masks.base._GRIDS.clear()
    with torch.inference_mode():
        ix = mh.masks.causal()._index_grid(5, 7)
    assert not any(t.is_inference() for t in (ix.b, ix.h, ix.q, ix.k))


class _WritesItsIndex(mh.masks.Mask):
    """A user's mask whose predicate writes into its index where no version counter sees."""

    def _allowed(self, ix):
        ix.q.numpy()[...] += 1
        return ix.q >= ix.k

    def _tile_bounds(self, tx):
        t = torch.ones_like(tx.q0, dtype=torch.bool)
        return t, ~t


def test_a_users_mask_is_given_grids_of_its_own():
    q = torch.randn(1, 1, 4, 8)
    want = mh.attention(q, q, q, mask=mh.masks.causal(), backend="reference")
    for m in (_WritesItsIndex(), mh.masks.causal() & _WritesItsIndex()):
        mh.attention(q, q, q, mask=m, backend="reference")
        torch.testing.assert_close(
            mh.attention(q, q, q, mask=mh.masks.causal(), backend="reference"), want)


def test_no_grid_is_kept_from_a_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    mh.masks.base._GRIDS.clear()
    with FakeTensorMode():
        mh.masks.causal()._index_grid(3, 5)
    assert len(mh.masks.base._GRIDS) == 0
    assert mh.masks.causal().materialize(3, 5)[0, 0].tolist() == \
        torch.ones(3, 5).tril(2).bool().tolist()

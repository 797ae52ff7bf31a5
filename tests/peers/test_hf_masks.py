"""Our reading of ``transformers``' mask functions equals ``transformers``' own dense masks.

For every mask function ``transformers`` 5.x composes (causal, bidirectional, sliding
window, packed sequences, padding, offsets of a cache) and for ones we do not read as
structure (a blockwise overlay, chunked attention), the :class:`HFMask` our builder returns,
materialized, must equal the 4-D bool mask of Hugging Face's ``sdpa_mask`` with the same
arguments, and must not be dense where it has structure.
"""

import re

import pytest
import torch

pytest.importorskip("transformers")
mu = pytest.importorskip("transformers.masking_utils")

import multihead.interop.hf  # noqa: E402,F401 (registers "multihead")
from multihead.interop.hf_masks import HFMask, build_mask  # noqa: E402


def _ours(m: HFMask, B: int, Sq: int, Sk: int) -> torch.Tensor:
    """The allowed pairs ``(B, 1, Sq, Sk)`` of an HFMask; keys past ``m.keys`` are never seen."""
    out = torch.zeros(B, 1, Sq, Sk, dtype=torch.bool)
    if m.mask is None:
        out[..., :m.keys] = True
    else:
        out[..., :m.keys] = m.mask.materialize(Sq, m.keys).expand(B, 1, Sq, m.keys)
    return out


def _theirs(B, Sq, Sk, q_off, kv_off, fn, am):
    got = mu.sdpa_mask(B, Sq, Sk, q_off, kv_off, fn, am, allow_is_causal_skip=False,
                       allow_is_bidirectional_skip=False, use_vmap=True)
    return torch.ones(B, 1, Sq, Sk, dtype=torch.bool) if got is None else got.expand(B, 1, Sq, Sk)


def _packed(lengths):
    pos = torch.cat([torch.arange(n) for n in lengths])[None]           # (1, S)
    return pos, mu.find_packed_sequence_indices(pos)


def _pad(B, L, left: bool, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = torch.randint(1, L + 1, (B,), generator=g)
    n[0] = L                                                          # one full row
    ar = torch.arange(L)
    return (ar >= L - n[:, None]) if left else (ar < n[:, None])      # (B, L) True = real


CASES = {
    # name: (mask function, structured?)
    "causal": (mu.causal_mask_function, "causal"),
    "bidirectional": (mu.bidirectional_mask_function, None),
    "sliding 3": (mu.sliding_window_causal_mask_function(3), "sliding_window(3"),
    "sliding 1": (mu.sliding_window_causal_mask_function(1), "sliding_window(1"),
}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("padding", [None, "right", "left"])
@pytest.mark.parametrize("sizes", [(7, 7, 0, 0, 7), (1, 9, 8, 0, 9), (3, 10, 7, 0, 10),
                                   (2, 16, 5, 0, 7), (1, 4, 9, 6, 10), (4, 12, 0, 0, 12)],
                         ids=["prefill", "decode", "chunk", "static", "sliding-cache", "cross"])
def test_structured_masks_equal_transformers_dense_masks(name, padding, sizes):
    fn, expect = CASES[name]
    Sq, Sk, q_off, kv_off, seen = sizes         # seen: tokens the 2-D padding mask covers
    B = 3
    am = None if padding is None else _pad(B, seen, padding == "left")
    ours = build_mask(B, Sq, Sk, q_off, kv_off, fn, am)
    assert not ours.dense
    assert _ours(ours, B, Sq, Sk).equal(_theirs(B, Sq, Sk, q_off, kv_off, fn, am)), ours
    if expect is not None:
        assert expect in ours.describe()


@pytest.mark.parametrize("base", [mu.causal_mask_function, mu.sliding_window_causal_mask_function(3),
                                  mu.bidirectional_mask_function], ids=["causal", "sliding", "bidir"])
def test_packed_sequences_become_a_document_mask(base):
    lengths = [5, 1, 7, 3]
    pos, seq = _packed(lengths)
    S = pos.shape[1]
    if hasattr(mu, "packed_sequence_compatibility_function"):       # transformers < 5.24
        fn = mu.packed_sequence_compatibility_function(base, pos, seq)
    else:                                                           # 5.24: this order
        fn = mu.and_masks(mu.remap_positions_for_packed_sequence(base, pos),
                          mu.packed_sequence_mask_function(seq))
    ours = build_mask(1, S, S, 0, 0, fn, None)
    assert not ours.dense and "document" in ours.describe()
    assert _ours(ours, 1, S, S).equal(_theirs(1, S, S, 0, 0, fn, None))


@pytest.mark.parametrize("make", [
    lambda: mu.or_masks(mu.causal_mask_function,
                        mu.blockwise_overlay(torch.tensor([[0, 0, 1, 1, 1, -1, 2, 2]]))),
    lambda: mu.chunked_causal_mask_function(3, torch.zeros(1, dtype=torch.long)),
    lambda: (lambda b, h, q, kv: (q + kv) % 3 != 0),
], ids=["blockwise", "chunked", "custom"])
def test_pieces_we_do_not_read_fall_back_to_transformers_own_dense_mask(make):
    fn = make()
    am = torch.tensor([[True] * 8])
    ours = build_mask(1, 8, 8, 0, 0, fn, am)
    assert ours.dense
    assert _ours(ours, 1, 8, 8).equal(_theirs(1, 8, 8, 0, 0, fn, am))


def test_a_0_1_integer_padding_mask_falls_back_exactly_too():
    """Tokenizers give attention_mask as 0/1 ints; the dense fallback reads them as bools."""
    fn = mu.chunked_causal_mask_function(3, torch.zeros(2, dtype=torch.long))
    am = torch.tensor([[1] * 6, [0] + [1] * 5])
    ours = build_mask(2, 6, 6, 0, 0, fn, am)
    assert ours.dense
    assert _ours(ours, 2, 6, 6).equal(_theirs(2, 6, 6, 0, 0, fn, am.bool()))


@pytest.mark.parametrize("rows", [1, 3])
def test_a_padding_mask_with_another_number_of_rows_is_refused_naming_it(rows):
    """transformers reads rows 0..B-1 of it (3 rows: the last ignored; 1 row: an IndexError
    deep in its mask function); ours names it with its shape and the batch size."""
    am = torch.ones(rows, 4, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"attention_mask has {rows} rows \(shape \({rows}, 4\)\) "
                                         r"but the batch has 2 sequences: pass one row per"):
        build_mask(2, 4, 4, 0, 0, mu.causal_mask_function, am)


@pytest.mark.parametrize("sizes,cols,said", [
    ((3, 8, 5, 0), 3, "but there are 8 keys so far: give one column per key token (with a "
                      "cache, the cached ones included"),
    ((6, 6, 0, 0), 5, "but there are 6 keys so far"),
    ((6, 6, 0, 0), 8, "but there are only 6 keys: give one column per key token so far"),
    ((1, 16, 7, 0), 17, "but there are only 16 keys"),       # past a static cache's slots
], ids=["new-tokens-only", "short", "long", "past-the-slots"])
def test_a_padding_mask_of_another_length_is_refused_naming_it(sizes, cols, said):
    """transformers pads a short mask with zeros, masking real tokens (with a window, every
    key a query has: its row attends to nothing), and ignores a long one's extra columns;
    both are a mask of some other input, never right."""
    Sq, Sk, q_off, kv_off = sizes
    am = torch.ones(2, cols, dtype=torch.long)
    with pytest.raises(ValueError, match=rf"attention_mask has {cols} columns \(shape \(2, {cols}\)\) "
                                         + re.escape(said)):
        build_mask(2, Sq, Sk, q_off, kv_off, mu.sliding_window_causal_mask_function(3), am)
    for fine in {q_off + Sq, kv_off + Sk}:        # the tokens so far; a static cache's slots
        build_mask(2, Sq, Sk, q_off, kv_off, mu.causal_mask_function,
                   torch.ones(2, fine, dtype=torch.long))


def test_a_mask_prepared_by_generate_passes_through_unchanged():
    m = build_mask(2, 1, 6, 5, 0, mu.causal_mask_function, None)
    assert build_mask(2, 1, 6, 5, 0, mu.causal_mask_function, m) is m
    assert m.contiguous() is m and m.ndim == 4 and m.shape == (2, 1, 1, 6)


def test_right_padding_becomes_lengths_and_no_padding_becomes_no_mask():
    am = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    m = build_mask(2, 4, 4, 0, 0, mu.bidirectional_mask_function, am)
    assert "lengths=[3, 4]" in m.describe()
    assert build_mask(2, 4, 4, 0, 0, mu.bidirectional_mask_function,
                      torch.ones(2, 4, dtype=torch.long)).mask is None


def test_offsets_with_tensor_pieces_and_callable_objects_fall_back_exactly():
    import functools
    g = torch.tensor([[True, False, True, True, False, True]])
    cases = [  # (fn, q_offset): a user's or_mask_function, a functools.partial piece
        (mu.or_masks(mu.causal_mask_function, mu.padding_mask_function(g)), 2),
        (mu.and_masks(mu.causal_mask_function,
                      functools.partial(lambda b, h, q, kv, w: kv > q - w, w=2)), 0),
    ]
    for fn, q_off in cases:
        ours = build_mask(1, 4 - q_off, 6, q_off, 0, fn, None)
        assert ours.dense
        assert _ours(ours, 1, 4 - q_off, 6).equal(_theirs(1, 4 - q_off, 6, q_off, 0, fn, None))


def test_masks_of_other_ranks_are_refused_not_ignored():
    with pytest.raises(TypeError, match=r"2-D padding mask \(B, S\).*shape \(2, 4, 4\)"):
        build_mask(2, 4, 4, 0, 0, mu.causal_mask_function, torch.ones(2, 4, 4, dtype=torch.bool))


def test_a_model_using_the_mask_as_a_tensor_gets_a_clear_error():
    m = build_mask(2, 4, 4, 0, 0, mu.causal_mask_function, None)
    with pytest.raises(TypeError, match="outside transformers' AttentionInterface"):
        torch.zeros(4) + m
    with pytest.raises(TypeError, match="attn_implementation='eager'"):
        m[:, :, :2]
    with pytest.raises(AttributeError, match="no 'dtype'.*AttentionInterface"):
        m.dtype
    for use in (lambda: torch.zeros(2, 1, 4, 4).masked_fill(m, 0.0),      # MPT's, say
                lambda: torch.where(m, 1.0, 0.0)):
        with pytest.raises(TypeError, match="outside transformers' AttentionInterface"):
            use()
    assert not hasattr(m, "device") and m.to("cpu").mask is not None


def test_attention_forward_refuses_what_it_would_otherwise_drop():
    from multihead.interop.hf import attention_forward
    q = torch.randn(1, 2, 4, 8)
    m = build_mask(1, 4, 4, 0, 0, mu.causal_mask_function, None)
    with pytest.raises(ValueError, match=r"indices.*Module passes indices=tensor of shape \(4,\)"):
        attention_forward(torch.nn.Module(), q, q, q, m, indices=torch.arange(4))
    with pytest.raises(ValueError, match="sinks"):
        attention_forward(torch.nn.Module(), q, q, q, m, sinks=torch.zeros(2))
    with pytest.raises(ValueError, match=r"built its mask for 4 queries and 4 keys but this layer "
                                         r"attends with 4 queries to 6 keys.*'eager' if you "
                                         r"accept that, or without a cache"):
        k = torch.randn(1, 2, 6, 8)
        attention_forward(torch.nn.Module(), q, k, k, m)
    with pytest.raises(TypeError, match=r"got Tensor of shape \(1, 4, 4\).*as \(B, S\)"):
        attention_forward(torch.nn.Module(), q, q, q, torch.ones(1, 4, 4, dtype=torch.bool))
    out, w = attention_forward(torch.nn.Module(), q, q, q, m, position_ids=torch.arange(4),
                               use_cache=False, output_attentions=True)
    assert out.shape == (1, 4, 2, 8) and w.shape == (1, 2, 4, 4)

"""A Llama attention layer decoding: our MultiHeadAttention with RoPE and a KV cache (static
or paged) against Hugging Face's LlamaAttention with its rotary embedding and DynamicCache
(`multihead.bench.peers.HFLlamaDecoder`), token by token, GQA and MHA, both of Hugging
Face's attention implementations, positions past the first size of our RoPE table."""

import pytest
import torch

import multihead as mh
from multihead.bench.peers import HFLlamaDecoder

pytest.importorskip("transformers")


def _layer(E, H, Hkv, seed=0):
    torch.manual_seed(seed)
    return mh.MultiHeadAttention(E, H, num_kv_heads=Hkv, bias=False,
                                 rope=mh.RotaryEmbedding(E // H, base=500000.0)).eval()


def _cache(m, B, kind):
    if kind == "static":
        return m.make_cache(B, 64)
    pool = mh.PagedKVCache(num_pages=16, page_size=8, num_kv_heads=m.num_kv_heads,
                           head_dim=m.head_dim)
    return pool.batch([pool.add_sequence() for _ in range(B)])


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
@pytest.mark.parametrize("kind", ["static", "paged"])
@pytest.mark.parametrize("heads", [(8, 2), (4, 4)], ids=["gqa", "mha"])
def test_decoding_equals_hugging_face_llama_attention(implementation, kind, heads):
    H, Hkv = heads
    E, B = 64, 2
    m = _layer(E, H, Hkv)
    hf = HFLlamaDecoder(m, implementation)
    cache = _cache(m, B, kind)
    g = torch.Generator().manual_seed(1)
    steps = [torch.randn(B, 7, E, generator=g)] + [torch.randn(B, n, E, generator=g)
                                                   for n in (1, 1, 3, 1, 1, 2, 1)]
    with torch.no_grad():
        for x in steps:
            ours = m(x, cache=cache, mask=mh.masks.causal())
            torch.testing.assert_close(ours, hf(x), atol=2e-5, rtol=1e-4)


def test_positions_past_the_first_table_size_still_equal_hugging_face():
    """A prefill that ends past our table's first 2,048 rows (it grows while decoding)."""
    from multihead.modules import rope as rope_mod
    rope_mod._TABLES.clear()
    m = _layer(32, 4, 2, seed=2)
    hf = HFLlamaDecoder(m)
    cache = m.make_cache(1, rope_mod.FIRST_ROWS + 16)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        x = torch.randn(1, rope_mod.FIRST_ROWS - 2, 32, generator=g)
        torch.testing.assert_close(m(x, cache=cache, mask=mh.masks.causal()), hf(x),
                                   atol=2e-5, rtol=1e-4)
        for _ in range(5):
            x = torch.randn(1, 1, 32, generator=g)
            torch.testing.assert_close(m(x, cache=cache, mask=mh.masks.causal()), hf(x),
                                       atol=2e-5, rtol=1e-4)
    assert rope_mod._TABLES.get((8, 500000.0, torch.device("cpu"), torch.float32)).shape[0] \
        == 2 * rope_mod.FIRST_ROWS                                     # it grew on the way


def test_the_peer_refuses_a_module_it_cannot_hold():
    with pytest.raises(ValueError, match=r"rope, bias=False and self-attention projections"):
        HFLlamaDecoder(mh.MultiHeadAttention(32, 4))

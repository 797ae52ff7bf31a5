"""Tensors without values: ``FakeTensorMode`` (what memory and FLOP estimators, meta
initialization and sharding tools run a model on), ``make_fx`` traces (real, fake, symbolic
and before dispatch) and the meta device. A call there reads no value on the host and keeps
nothing (under a fake or tracing mode it takes the path a traced graph takes), so every
mask kind runs, a backend that must read values says so, and a ``make_fx`` graph computes
in the graph what an eager call reads, giving eager's results on inputs it was not traced
with."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode, is_fake
from torch.fx.experimental.proxy_tensor import make_fx

import multihead as mh
from conftest import ALL_BACKENDS, MASK_NAMES, make_masks, oracle

M = mh.masks
B, H, S, D = 2, 4, 12, 8


@pytest.mark.parametrize("backend", ["auto", *ALL_BACKENDS])
@pytest.mark.parametrize("name", MASK_NAMES)
def test_every_mask_kind_runs_on_fake_tensors_or_the_backend_says_why_not(name, backend):
    with FakeTensorMode():
        q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
        mask = make_masks(B, H, S, S, seed=3)[name]         # (its tensors are fake too)
        try:
            out, w, lse = mh.attention(q, k, v, mask=mask, backend=backend,
                                       return_weights=True, return_lse=True)
        except ValueError as e:
            assert backend != "auto", e
            assert f"backend={backend!r} cannot run this call: it " in str(e)
            return
    assert all(is_fake(t) for t in (out, w, lse))
    assert (out.shape, w.shape, lse.shape) == ((B, H, S, D), (B, H, S, S), (B, H, S))


@pytest.mark.parametrize("backend", ["auto", *ALL_BACKENDS])
@pytest.mark.parametrize("name", MASK_NAMES)
def test_every_mask_kind_runs_on_the_meta_device_or_the_backend_says_why_not(name, backend):
    q, k, v = (torch.randn(B, H, S, D, device="meta") for _ in range(3))
    mask = make_masks(B, H, S, S, seed=3)[name]
    mask = None if mask is None else mask.to("meta")
    try:
        out = mh.attention(q, k, v, mask=mask, backend=backend)
    except ValueError as e:         # (varlen read a document's ids: "no data" from torch)
        assert backend != "auto", e
        assert f"backend={backend!r} cannot run this call: it " in str(e)
        return
    assert out.device.type == "meta" and out.shape == (B, H, S, D)


def test_auto_runs_on_fake_tensors_without_extras_too():
    with FakeTensorMode():
        q, k, v = (torch.randn(B, H, S, D) for _ in range(3))
        for name, mask in make_masks(B, H, S, S, seed=4).items():
            out = mh.attention(q, k, v, mask=mask)
            assert is_fake(out) and out.shape == (B, H, S, D), name


def test_a_backend_that_reads_values_says_so_on_fake_tensors():
    with FakeTensorMode():
        q = torch.randn(B, H, S, D)
        with pytest.raises(ValueError, match="backend='rows' cannot run this call: it reads "
                                             "values on the host.*FakeTensorMode"):
            mh.attention(q, q, q, mask=M.causal(), backend="rows")


def test_a_mask_whose_tensors_are_on_the_meta_device_is_refused_by_blocksparse_by_name():
    q = torch.randn(B, H, S, D, device="meta")
    mask = M.padding(torch.tensor([S, 5])).to("meta")
    with pytest.raises(ValueError, match="backend='blocksparse' cannot run this call: it plans "
                                         "its tiles from the mask's values, which meta tensors "
                                         "do not have"):
        mh.attention(q, q, q, mask=mask, backend="blocksparse")
    assert mh.attention(q, q, q, mask=M.causal(), backend="blocksparse").device.type == "meta"


def test_offsets_without_values_are_refused_with_what_to_pass():
    with FakeTensorMode():
        cu = torch.tensor([0, 5, 12])
        with pytest.raises(ValueError, match=r"fake tensors cannot.*torch\.bucketize"):
            M.document(cu_seqlens=cu)


def _inputs(s: int, seed: int, empty_row: bool = False) -> tuple:
    """q, k, v ``(B, H, s, D)`` and the tensors the traced masks are built from."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, H, s, D, generator=g) for _ in range(3))
    lengths = torch.tensor([s, 0 if empty_row else s // 2 + 1])                # (B,)
    real = torch.arange(s) >= torch.tensor([[0], [s // 3]])                    # (B, s) left
    ids = torch.arange(s) * 3 // s                                             # (s,) 3 docs
    allowed = torch.rand(B, 1, s, s, generator=g) > 0.5
    bias = torch.randn(1, H, s, s, generator=g)
    return q, k, v, lengths, real, ids, allowed, bias


#: masks built inside the traced function from its inputs (a graph input, not a constant)
TRACED = {
    "none": lambda t: None,
    "causal": lambda t: M.causal(),
    "window": lambda t: M.sliding_window(3),
    "alibi&causal": lambda t: M.alibi(H) & M.causal(),
    "padding": lambda t: M.padding(t[0]),
    "causal&padding_bool": lambda t: M.causal() & M.padding(t[1]),
    "document&window": lambda t: M.document(t[2]) & M.sliding_window(4),
    "dense|causal": lambda t: M.dense(t[3]) | M.causal(),
    "bias&causal": lambda t: M.bias(t[4]) & M.causal(),
}


@pytest.mark.parametrize("mode", ["real", "fake", "symbolic", "real, before dispatch"])
@pytest.mark.parametrize("name", TRACED)
def test_a_make_fx_graph_equals_eager_attention_on_inputs_it_was_not_traced_with(mode, name):
    build = TRACED[name]

    def f(q, k, v, *mask_tensors):
        return mh.attention(q, k, v, mask=build(mask_tensors))

    before = mode.endswith("before dispatch")      # (its proxies on a stack of their own)
    graph = make_fx(f, tracing_mode=mode.split(",")[0], pre_dispatch=before)(
        *_inputs(S, seed=0))
    # other values (a row with no key to attend to), and under "symbolic" another length
    args = _inputs(S if mode != "symbolic" else 2 * S - 3, seed=1, empty_row=True)
    got = graph(*args)
    want = oracle(*args[:3], mask=build(args[3:]))
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["auto", "sdpa", "reference"])
def test_a_make_fx_graph_of_a_gradient_penalty_equals_eager(backend):
    def penalty_grad(q, k, v):
        q = q.detach().requires_grad_()
        out = mh.attention(q, k, v, mask=M.causal(), backend=backend)
        g, = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
        return torch.autograd.grad(g.pow(2).sum(), q)[0]

    q, k, v = _inputs(S, seed=0)[:3]
    graph = make_fx(penalty_grad)(q.double(), k.double(), v.double())
    q, k, v = (t.double() for t in _inputs(S, seed=1)[:3])
    torch.testing.assert_close(graph(q, k, v), penalty_grad(q, k, v))


def test_a_module_with_gqa_rope_and_kv_caches_runs_on_fake_tensors():
    E, heads, kv_heads = 32, 4, 2
    shapes = []
    for fake in (False, True):
        with FakeTensorMode() if fake else torch.no_grad():
            torch.manual_seed(0)
            m = mh.MultiHeadAttention(E, heads, num_kv_heads=kv_heads,
                                      rope=mh.RotaryEmbedding(E // heads))
            x = torch.randn(B, S, E, requires_grad=fake)
            pad = M.padding(torch.tensor([S, 5]))
            full = m(x, mask=M.causal() & pad)
            weights = m(x, mask=M.sliding_window(4), return_weights=True)[1]
            cache = mh.KVCache(B, 2 * S, kv_heads, E // heads)
            m(x, mask=M.causal(), cache=cache)
            step = m(torch.randn(B, 1, E), mask=M.causal(), cache=cache)
            pool = mh.PagedKVCache(num_pages=8, page_size=4, num_kv_heads=kv_heads,
                                   head_dim=E // heads)
            seqs = [pool.add_sequence() for _ in range(B)]
            m(x, mask=M.causal(), cache=pool.batch(seqs))
            paged = m(torch.randn(B, 1, E), mask=M.causal(), cache=pool.batch(seqs))
            dropin = mh.nn.MultiheadAttention(E, heads, batch_first=True)
            kpm = torch.arange(S) >= torch.tensor([[S], [5]])              # (B, S) True: ignore
            torch_out = dropin(x, x, x, key_padding_mask=kpm)[0]
            if fake:
                full.sum().backward()
                assert all(is_fake(t) for t in (full, weights, step, paged, torch_out, x.grad))
        shapes.append([t.shape for t in (full, weights, step, paged, torch_out, cache.k)])
    assert shapes[0] == shapes[1]


def test_a_fake_call_leaves_later_real_calls_exact():
    q, k, v = (torch.randn(B, H, 2 * S + 1, D) for _ in range(3))     # (sizes of its own)
    masks = make_masks(B, H, 2 * S + 1, 2 * S + 1, seed=5)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        for mask in masks.values():
            mh.attention(fq, fk, fv, mask=mask)
    for name, mask in masks.items():
        torch.testing.assert_close(mh.attention(q, k, v, mask=mask),
                                   oracle(q, k, v, mask).float(), atol=1e-5, rtol=1e-5,
                                   msg=name)


def test_a_hugging_face_model_on_our_attention_runs_on_fake_tensors():
    transformers = pytest.importorskip("transformers")
    import multihead.interop.hf  # noqa: F401  (registers "multihead")
    cfg = transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, max_position_embeddings=64)
    outs = {}
    for impl in ("multihead", "sdpa"):
        cfg._attn_implementation = impl
        with FakeTensorMode():
            model = transformers.LlamaForCausalLM(cfg).eval()
            ids = torch.randint(1, 100, (2, 10))
            attention_mask = (torch.arange(10) >= torch.tensor([[0], [3]])).long()  # left pad
            outs[impl] = model(input_ids=ids, attention_mask=attention_mask).logits
    assert is_fake(outs["multihead"]) and outs["multihead"].shape == outs["sdpa"].shape

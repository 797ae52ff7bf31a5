"""Parity with torch.nn.MultiheadAttention on copied weights: the drop-in and from_torch/to_torch."""

import itertools

import pytest
import torch
from torch import nn

import multihead as mh

E, H, L, S, B = 16, 4, 5, 7, 3


def _pair(batch_first, kdim, vdim, bias, add_bias_kv=False, add_zero_attn=False):
    torch.manual_seed(0)
    t = nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first,
                              add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn)
    ours = mh.nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first,
                                    add_bias_kv=add_bias_kv, add_zero_attn=add_zero_attn)
    ours.load_state_dict(t.state_dict())            # torch's state_dict, unchanged
    return t.eval(), ours.eval()


def _inputs(batch_first, kdim, vdim, unbatched=False):
    g = torch.Generator().manual_seed(1)
    shape = lambda s, w: (s, w) if unbatched else ((B, s, w) if batch_first else (s, B, w))
    mk = lambda *s: torch.randn(*s, generator=g, requires_grad=True)
    return mk(*shape(L, E)), mk(*shape(S, kdim or E)), mk(*shape(S, vdim or E))


def _masks(kind, dtype):
    g = torch.Generator().manual_seed(2)
    kpm = torch.rand(B, S, generator=g) > 0.7
    kpm[:, 0] = False                              # at least one key each (torch gives NaN otherwise)
    am2 = torch.rand(L, S, generator=g) > 0.7
    am2[:, 0] = False
    am3 = torch.rand(B * H, L, S, generator=g) > 0.7
    am3[..., 0] = False
    conv = (lambda m: m) if dtype == "bool" else (
        lambda m: torch.zeros(m.shape).masked_fill(m, float("-inf")) + torch.randn(m.shape, generator=g) * 0.1)
    return {"none": {}, "kpm": dict(key_padding_mask=conv(kpm)), "attn2d": dict(attn_mask=conv(am2)),
            "attn3d": dict(attn_mask=conv(am3)),
            "both": dict(attn_mask=conv(am2), key_padding_mask=conv(kpm))}[kind]


CONFIGS = list(itertools.product([True, False], [None, 10], [True, False]))


@pytest.mark.parametrize("batch_first,kdim,bias", CONFIGS)
@pytest.mark.parametrize("mask_kind", ["none", "kpm", "attn2d", "attn3d", "both"])
@pytest.mark.parametrize("mask_dtype", ["bool", "float"])
@pytest.mark.parametrize("need_weights,average", [(False, True), (True, True), (True, False)])
def test_drop_in_parity(batch_first, kdim, bias, mask_kind, mask_dtype, need_weights, average):
    t, ours = _pair(batch_first, kdim, kdim, bias)
    q, k, v = _inputs(batch_first, kdim, kdim)
    kw = dict(_masks(mask_kind, mask_dtype), need_weights=need_weights, average_attn_weights=average)
    a_out, a_w = ours(q, k, v, **kw)
    b_out, b_w = t(q, k, v, **kw)
    torch.testing.assert_close(a_out, b_out, atol=1e-5, rtol=1e-5)
    if need_weights:
        torch.testing.assert_close(a_w, b_w, atol=1e-6, rtol=1e-5)
    else:
        assert a_w is None and b_w is None
    ga = torch.autograd.grad(a_out.sum(), (q, k, v, *ours.parameters()), allow_unused=True)
    gb = torch.autograd.grad(b_out.sum(), (q, k, v, *t.parameters()), allow_unused=True)
    for x, y in zip(ga, gb):
        if y is not None:
            torch.testing.assert_close(x, y, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("batch_first,bias", [(True, True), (False, True), (True, False)])
@pytest.mark.parametrize("which", ["self", "key is value"])
@pytest.mark.parametrize("need_weights", [False, True])
def test_self_attention_and_a_shared_key_value_tensor_project_as_torch(which, batch_first,
                                                                       bias, need_weights):
    """Where query, key and value are one tensor (or key and value are), the packed weights
    project them in one matmul, as torch does: outputs, weights and every gradient agree
    with torch's (the other test passes three tensors)."""
    t, ours = _pair(batch_first, None, None, bias)
    x, mem, _ = _inputs(batch_first, None, None)
    args = (x, x, x) if which == "self" else (x, mem, mem)
    kpm = torch.zeros(B, L if which == "self" else S, dtype=torch.bool)
    kpm[1, 3:] = True
    kw = dict(key_padding_mask=kpm, need_weights=need_weights)
    (a_out, a_w), (b_out, b_w) = ours(*args, **kw), t(*args, **kw)
    torch.testing.assert_close(a_out, b_out, atol=1e-6, rtol=1e-5)
    if need_weights:
        torch.testing.assert_close(a_w, b_w, atol=1e-6, rtol=1e-5)
    leaves = (x,) if which == "self" else (x, mem)
    ga = torch.autograd.grad(a_out.square().sum(), (*leaves, *ours.parameters()))
    gb = torch.autograd.grad(b_out.square().sum(), (*leaves, *t.parameters()))
    for a, b in zip(ga, gb):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("add_bias_kv,add_zero_attn", [(True, False), (False, True), (True, True)])
def test_bias_kv_and_zero_attn(add_bias_kv, add_zero_attn):
    t, ours = _pair(True, None, None, True, add_bias_kv, add_zero_attn)
    if add_bias_kv:
        with torch.no_grad():
            t.bias_k.normal_(), t.bias_v.normal_()
    ours.load_state_dict(t.state_dict())
    q, k, v = _inputs(True, None, None)
    kw = _masks("both", "bool")
    torch.testing.assert_close(ours(q, k, v, **kw)[0], t(q, k, v, **kw)[0], atol=1e-5, rtol=1e-5)


def test_is_causal_and_unbatched():
    t, ours = _pair(False, None, None, True)
    mask = nn.Transformer.generate_square_subsequent_mask(L)
    x = torch.randn(L, E)                                     # unbatched (L, E)
    a = ours(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0]
    b = t(x, x, x, attn_mask=mask, is_causal=True, need_weights=False)[0]
    assert a.shape == (L, E)
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    wa, wb = ours(x, x, x, attn_mask=mask)[1], t(x, x, x, attn_mask=mask)[1]
    torch.testing.assert_close(wa, wb)
    with pytest.raises(RuntimeError, match="is_causal"):
        ours(x, x, x, is_causal=True)


def test_all_keys_padded_gives_zeros_where_torch_gives_nan():
    t, ours = _pair(True, None, None, True)
    q, k, v = _inputs(True, None, None)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[1] = True
    a, b = ours(q, k, v, key_padding_mask=kpm)[0], t(q, k, v, key_padding_mask=kpm)[0]
    assert torch.isfinite(a).all()
    bias = ours.out_proj.bias
    torch.testing.assert_close(a[1], bias.expand(L, E))      # zero attention, then out_proj
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("need_weights", [True, False])
def test_two_float_masks_whose_sum_overflows_hide_the_key_as_in_torch(dtype, need_weights):
    # Hugging Face style masks (finfo.min = ignore) given twice: torch's sum is -inf there
    t, ours = _pair(True, None, None, True)
    t, ours = t.to(dtype), ours.to(dtype)
    q, k, v = (x.detach().to(dtype) for x in _inputs(True, None, None))
    low = torch.finfo(dtype).min
    attn_mask = torch.zeros(L, S, dtype=dtype)
    attn_mask[:2] = low                            # rows 0-1: every key at finfo.min once
    kpm = torch.zeros(B, S, dtype=dtype)
    kpm[:, 3:] = low                               # keys 3.. at finfo.min twice in rows 0-1
    kpm[2] = low                                   # batch 2, rows 0-1: every key twice: none left
    kw = dict(attn_mask=attn_mask, key_padding_mask=kpm, need_weights=need_weights)
    a_out, a_w = ours(q, k, v, **kw)
    b_out, b_w = t(q, k, v, **kw)
    tol = dict(atol=2e-3, rtol=2e-3) if dtype == torch.float16 else {}
    finite = torch.ones(B, dtype=torch.bool)
    finite[2] = False                              # (torch: NaN there, where it returns weights)
    if need_weights:
        assert (a_w[:2, :2, 3:] == 0).all()      # hidden, not weighted like keys 0-2
        assert (a_w[2, :2] == 0).all() and torch.isfinite(a_out).all()
        if dtype == torch.float32:   # (fp16: torch rounds -65504 + score to -65504, we add in fp32)
            torch.testing.assert_close(a_w[:2], b_w[:2])
            torch.testing.assert_close(a_out[finite], b_out[finite])
    else:
        torch.testing.assert_close(a_out, b_out, **tol)


def test_two_half_precision_masks_on_a_float32_query_are_summed_in_float32():
    """torch refuses masks of another dtype than the query's; we add them at the query's
    precision at least: -40000 twice in float16 is -80000 (a number), not -inf."""
    _, ours = _pair(True, None, None, True)
    q, k, v = (x.detach() for x in _inputs(True, None, None))
    g = torch.Generator().manual_seed(5)
    attn_mask = (torch.rand(L, S, generator=g) * -6e4).half()      # down to -60000: finite
    kpm = (torch.rand(B, S, generator=g) * -6e4).half()
    w = ours(q, k, v, attn_mask=attn_mask, key_padding_mask=kpm)[1]
    scores = _scores(ours, q, k) + attn_mask.double() + kpm.double()[:, None, None, :]
    torch.testing.assert_close(w, scores.softmax(-1).mean(1).float(), atol=1e-5, rtol=1e-4)


def _scores(m, q, k):
    """(B, H, L, S) scaled scores of the drop-in ``m`` in fp64 (batch_first inputs)."""
    E_ = m.embed_dim
    w_q, w_k, _ = m.in_proj_weight.double().split(E_)
    b_q, b_k, _ = m.in_proj_bias.double().split(E_)
    heads = lambda x: x.view(B, -1, H, E_ // H).transpose(1, 2)      # (B, H, n, E/H)  # noqa: E731
    qh, kh = heads(q.double() @ w_q.T + b_q), heads(k.double() @ w_k.T + b_k)
    return qh @ kh.transpose(-1, -2) / (E_ // H) ** 0.5


@pytest.mark.parametrize("masks, named", [
    ((torch.tensor([[0.0] * (S - 1) + [float("inf")]]).expand(L, S), torch.zeros(B, S)),
     "attn_mask: bias contains NaN or \\+inf"),
    ((torch.full((L, S), 3e38), torch.full((B, S), 3e38)),
     "attn_mask \\+ key_padding_mask \\(their sum overflows to \\+inf\\)"),
], ids=["one +inf", "sum past the range"])
def test_a_bad_float_mask_is_named_before_the_sum(masks, named):
    _, ours = _pair(True, None, None, True)
    q, k, v = _inputs(True, None, None)
    with pytest.raises(ValueError, match=named):
        ours(q, k, v, attn_mask=masks[0], key_padding_mask=masks[1])


@pytest.mark.parametrize("kdim,bias", [(None, True), (None, False), (10, True)])
def test_from_torch_and_back(kdim, bias):
    torch.manual_seed(0)
    t = nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=kdim, batch_first=True).eval()
    ours = mh.MultiHeadAttention.from_torch(t)
    x, ctx = torch.randn(B, L, E), torch.randn(B, S, kdim or E)
    mask = torch.rand(L, S) > 0.3
    mask[:, 0] = True
    a = ours(x, ctx, mask=mh.masks.dense(mask), return_weights=True, average_weights=True)
    b = t(x, ctx, ctx, attn_mask=~mask)
    torch.testing.assert_close(a[0], b[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(a[1], b[1], atol=1e-6, rtol=1e-5)
    back = ours.to_torch()
    torch.testing.assert_close(back(x, ctx, ctx)[0], t(x, ctx, ctx)[0])


def test_from_torch_refuses_a_sequence_first_module_instead_of_mixing_the_batch():
    """torch's default layout is (L, N, E); ours is (N, L, E). Converted silently, code fed
    as before attends across the batch (outputs off by about 1): refused, naming the fix."""
    t = nn.MultiheadAttention(E, H)                        # batch_first=False
    with pytest.raises(ValueError, match=r"from_torch: the torch module has batch_first=False "
                                         r"\(inputs \(L, N, E\)\).*batch_first=True.*"
                                         r"multihead.nn.MultiheadAttention"):
        mh.MultiHeadAttention.from_torch(t)
    keeps = mh.nn.MultiheadAttention(E, H)                 # the advice works
    keeps.load_state_dict(t.state_dict())
    x = torch.randn(L, B, E)
    torch.testing.assert_close(keeps(x, x, x)[0], t(x, x, x)[0], atol=1e-6, rtol=1e-5)


def test_from_torch_keeps_frozen_parameters_frozen_and_names_itself_in_errors():
    t = nn.MultiheadAttention(E, H, batch_first=True)
    t.in_proj_weight.requires_grad_(False)
    ours = mh.MultiHeadAttention.from_torch(t)
    assert {n: p.requires_grad for n, p in ours.named_parameters()} == \
        {n: p.requires_grad for n, p in t.named_parameters()}
    assert not ours.in_proj_weight.requires_grad and ours.out_proj.weight.requires_grad
    with pytest.raises(ValueError, match=r"from_torch: .*dropout must be a float in \[0, 1\), "
                                         r"got 1.0; use multihead.nn.MultiheadAttention"):
        mh.MultiHeadAttention.from_torch(nn.MultiheadAttention(E, H, dropout=1.0,
                                                                batch_first=True))
    with pytest.raises(TypeError, match="to_torch takes a multihead.MultiHeadAttention, got Linear"):
        mh.interop.to_torch(nn.Linear(2, 2))


def test_from_torch_refuses_bias_kv_clearly():
    t = nn.MultiheadAttention(E, H, add_bias_kv=True, batch_first=True)
    with pytest.raises(ValueError, match="bias_k.*multihead.nn.MultiheadAttention"):
        mh.MultiHeadAttention.from_torch(t)
    with pytest.raises(ValueError, match="add_zero_attn"):
        mh.MultiHeadAttention.from_torch(nn.MultiheadAttention(E, H, add_zero_attn=True))
    with pytest.raises(ValueError, match=r"to_torch: torch\.nn\.MultiheadAttention needs head_dim "
                                         r"== embed_dim / num_heads; this module has 4 heads of "
                                         r"head_dim 3 and embed_dim 16"):
        mh.MultiHeadAttention(16, 4, head_dim=3).to_torch()


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("kdim, bias", [(None, True), (None, False), (7, True)])
def test_to_torch_of_a_gqa_module_repeats_its_kv_heads(kv_heads, kdim, bias):
    """torch's module has no GQA/MQA: to_torch refused it. Each K/V head's projection rows
    are now repeated for its group's query heads; torch's outputs and weights are ours."""
    g = torch.Generator().manual_seed(kv_heads)
    ours = mh.MultiHeadAttention(E, H, num_kv_heads=kv_heads, kdim=kdim, vdim=kdim, bias=bias)
    ours.in_proj_weight.requires_grad_(False) if ours.packed else ours.k_proj_weight.requires_grad_(False)
    t = ours.to_torch().eval()
    assert t.num_heads == H and (t.in_proj_bias is not None) == bias
    x, ctx = torch.randn(B, L, E, generator=g), torch.randn(B, S, kdim or E, generator=g)
    mask = torch.rand(L, S, generator=g) > 0.3
    mask[:, 0] = True
    a = ours.eval()(x, ctx, mask=mh.masks.dense(mask), return_weights=True)
    b = t(x, ctx, ctx, attn_mask=~mask, average_attn_weights=False)
    torch.testing.assert_close(b[0], a[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(b[1], a[1], atol=1e-6, rtol=1e-5)
    frozen = "in_proj_weight" if ours.packed else "k_proj_weight"
    assert [n for n, p in t.named_parameters() if not p.requires_grad] == [frozen]


def _compile_masks(dtype):
    g = torch.Generator().manual_seed(9)
    am, kpm = torch.rand(L, S, generator=g) > 0.7, torch.rand(B, S, generator=g) > 0.7
    am[:, 0] = kpm[:, 0] = False
    if dtype == "bool":
        return am, kpm
    to_float = lambda m: torch.randn(m.shape, generator=g).masked_fill(m, float("-inf"))
    return to_float(am), to_float(kpm)


@pytest.mark.parametrize("mask_dtype", ["bool", "float"])
def test_torch_compile_fullgraph_matches_eager(mask_dtype):
    """One graph, no break, for masks of either dtype (the cheap "eager" backend keeps it fast)."""
    _, ours = _pair(True, None, None, True)
    q, k, v = (t.detach() for t in _inputs(True, None, None))
    am, kpm = _compile_masks(mask_dtype)
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True, backend="eager")
    for kw in (dict(attn_mask=am, need_weights=False), dict(key_padding_mask=kpm),
               dict(attn_mask=am, key_padding_mask=kpm, need_weights=False),
               dict(attn_mask=am, key_padding_mask=kpm, average_attn_weights=False)):
        torch.testing.assert_close(compiled(q, k, v, **kw), ours(q, k, v, **kw))


@pytest.mark.parametrize("mask_kind", ["none", "kpm", "both"])
@pytest.mark.parametrize("need_weights", [True, False])
def test_on_the_meta_device_the_shapes_are_torchs(mask_kind, need_weights):
    """Shape inference (deferred init, FLOP counters) runs the module on meta tensors."""
    t, ours = (m.to("meta") for m in _pair(True, None, None, True))
    q, k, v = (x.detach().to("meta") for x in _inputs(True, None, None))
    kw = {name: m.to("meta") for name, m in _masks(mask_kind, "bool").items()}
    got, want = (m(q, k, v, need_weights=need_weights, **kw) for m in (ours, t))
    assert [None if x is None else (x.shape, x.device.type) for x in got] == \
        [None if x is None else (x.shape, x.device.type) for x in want]

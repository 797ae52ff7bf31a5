"""MultiHeadAttention: GQA/MQA as repeated K/V, fused = split, cross-attention, head
contributions, RoPE, torch.compile, state_dict, the seeds' tutorial class, bad input, and
no host-device sync in a forward (on the meta device, under NoReadBack).

gqa_and_repeated_mha and split_forward also serve tests/test_cuda_modules.py."""

import collections
import re

import pytest
import torch
import torch.nn.functional as F

import multihead as mh
from multihead.bench.peers import SeedTutorialMHA
from nosync import NoReadBack


def test_default_parameter_count_is_the_seeds_4d2_plus_4d():
    for d, h in [(512, 8), (768, 12), (64, 4)]:
        assert mh.MultiHeadAttention(d, h).num_parameters == 4 * d * d + 4 * d
    m = mh.MultiHeadAttention(512, 8, num_kv_heads=2)
    dh = 64
    assert m.num_parameters == (512 * 512 + 2 * 512 * 2 * dh) + (512 + 2 * 2 * dh) + 512 * 512 + 512
    assert "num_kv_heads=2 (GQA)" in repr(m) and "head_dim=64" in repr(m)


def gqa_and_repeated_mha(kv_heads, E=32, H=4):
    """A GQA/MQA module with random biases, and the MHA module whose K/V weights repeat its
    K/V heads (each group of query heads sees its shared head): the two are equal."""
    torch.manual_seed(0)
    g = mh.MultiHeadAttention(E, H, num_kv_heads=kv_heads).eval()
    full = mh.MultiHeadAttention(E, H).eval()
    dh, rep = E // H, H // kv_heads
    with torch.no_grad():
        full.q_proj.weight.copy_(g.q_proj.weight)
        full.q_proj.bias.copy_(g.q_proj.bias.normal_())
        for role in ("k_proj", "v_proj"):
            w, b = getattr(g, role)
            b.normal_()
            getattr(full, role).weight.copy_(w.view(kv_heads, dh, E).repeat_interleave(rep, 0).reshape(E, E))
            getattr(full, role).bias.copy_(b.view(kv_heads, dh).repeat_interleave(rep, 0).reshape(E))
        full.out_proj.load_state_dict(g.out_proj.state_dict())
    return g, full


@pytest.mark.parametrize("kv_heads", [2, 1])
def test_gqa_equals_mha_with_repeated_kv_weights(kv_heads):
    g, full = gqa_and_repeated_mha(kv_heads)
    x = torch.randn(2, 9, 32)
    torch.testing.assert_close(g(x, mask=mh.masks.causal()), full(x, mask=mh.masks.causal()))


def split_forward(m, x):
    """``m``'s self-attention computed with three separate projections and torch's SDPA."""
    B, S, _ = x.shape
    split = lambda p: F.linear(x, *p).view(B, S, m.num_heads, m.head_dim).transpose(1, 2)
    q, k, v = split(m.q_proj), split(m.k_proj), split(m.v_proj)    # (B, H, S, Dh)
    out = F.scaled_dot_product_attention(q, k, v)                   # (B, H, S, Dh)
    return m.out_proj(out.transpose(1, 2).reshape(B, S, m.num_heads * m.head_dim))


def test_fused_equals_split_projections():
    torch.manual_seed(0)
    m = mh.MultiHeadAttention(24, 3).eval()
    x = torch.randn(2, 6, 24)
    torch.testing.assert_close(m(x), split_forward(m, x))


def test_forward_on_meta_never_syncs():
    m = mh.MultiHeadAttention(32, 4, num_kv_heads=2, rope=mh.RotaryEmbedding(8)).to("meta").eval()
    x, ctx = torch.randn(2, 6, 32, device="meta"), torch.randn(2, 9, 32, device="meta")
    with torch.no_grad(), NoReadBack() as mode:
        assert m(x).shape == (2, 6, 32)
        m(x, positions=torch.arange(6))                # host positions: sent without a sync
        m(x, positions=[[0, 1, 2, 3, 4, 5]] * 2)
        m(x, ctx, return_weights=True)
        mh.RotaryEmbedding(8)(torch.randn(1, 2, 6, 8, device="meta"), torch.arange(6))
    assert "_to_copy" in mode.ops


def test_cross_attention_with_other_width_and_length():
    torch.manual_seed(0)
    m = mh.MultiHeadAttention(16, 4, kdim=10, vdim=10).eval()
    t = m.to_torch().eval()
    x, ctx = torch.randn(2, 3, 16), torch.randn(2, 11, 10)
    y, w = m(x, ctx, return_weights=True)
    assert y.shape == (2, 3, 16) and w.shape == (2, 4, 3, 11)
    torch.testing.assert_close(y, t(x, ctx, ctx)[0])
    packed = mh.MultiHeadAttention(16, 4).eval()
    c2 = torch.randn(2, 11, 16)
    torch.testing.assert_close(packed(x, c2), packed.to_torch()(x, c2, c2)[0])


def test_head_contributions_sum_to_the_output():
    torch.manual_seed(0)
    m = mh.MultiHeadAttention(32, 4, num_kv_heads=2, rope=mh.RotaryEmbedding(8)).eval()
    x = torch.randn(2, 7, 32)
    parts = m.head_contributions(x, mask=mh.masks.causal())
    assert parts.shape == (2, 4, 7, 32)
    torch.testing.assert_close(parts.sum(1) + m.out_proj.bias, m(x, mask=mh.masks.causal()))


def test_rope_is_a_rotation_and_relative():
    rope = mh.RotaryEmbedding(16)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    rq = lambda m: rope(q, torch.tensor([m]))
    rk = lambda n: rope(k, torch.tensor([n]))
    torch.testing.assert_close(rq(5).norm(), q.norm())
    dot = lambda m, n: (rq(m) * rk(n)).sum()
    torch.testing.assert_close(dot(7, 3), dot(104, 100), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dot(0, 0), (q * k).sum())
    assert not torch.allclose(dot(7, 3), dot(7, 4))


def test_rope_module_positions():
    torch.manual_seed(0)
    m = mh.MultiHeadAttention(32, 4, rope=mh.RotaryEmbedding(8)).eval()
    x = torch.randn(2, 5, 32)
    torch.testing.assert_close(m(x), m(x, positions=torch.arange(5)))
    # shifting every position by the same offset changes nothing (relative encoding)
    torch.testing.assert_close(m(x), m(x, positions=torch.arange(5) + 100), atol=1e-4, rtol=1e-4)


def test_average_weights_is_the_head_mean():
    m = mh.MultiHeadAttention(16, 4).eval()
    x = torch.randn(2, 5, 16)
    _, w = m(x, return_weights=True)
    _, wa = m(x, return_weights=True, average_weights=True)
    torch.testing.assert_close(wa, w.mean(1))


def test_state_dict_round_trip():
    a = mh.MultiHeadAttention(16, 4, num_kv_heads=2)
    b = mh.MultiHeadAttention(16, 4, num_kv_heads=2)
    b.load_state_dict(a.state_dict())
    x = torch.randn(1, 3, 16)
    torch.testing.assert_close(a(x), b(x))


@pytest.mark.parametrize("case", ["torch MHA into GQA", "wrong out_proj", "strict extra key"])
def test_a_failed_load_leaves_every_parameter_as_it_was(case):
    m = mh.MultiHeadAttention(16, 4, num_kv_heads=2)
    good = mh.MultiHeadAttention(16, 4, num_kv_heads=2).state_dict()
    sd = {"torch MHA into GQA": torch.nn.MultiheadAttention(16, 4).state_dict(),
          "wrong out_proj": {**good, "out_proj.weight": torch.zeros(16, 8)},
          "strict extra key": {**good, "rope.inv_freq": torch.zeros(2)}}[case]
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"num_kv_heads=2 \(GQA\).*Nothing was loaded"):
        m.load_state_dict(sd)
    assert all(torch.equal(m.state_dict()[k], v) for k, v in before.items())
    m.load_state_dict({**good, "rope.inv_freq": torch.zeros(2)}, strict=False)   # loads
    assert all(torch.equal(m.state_dict()[k], v) for k, v in good.items())


@pytest.mark.parametrize("bad,message", [
    (lambda t: torch.empty_like(t, device="meta"), "out_proj.bias is on the meta device in "
     "the checkpoint"),
    (lambda t: torch.ones_like(t, dtype=torch.complex64), "out_proj.bias is torch.complex64 "
     "in the checkpoint but torch.float32 here")], ids=["meta", "complex"])
def test_a_tensor_torch_would_fail_on_or_mangle_part_way_is_refused_first(bad, message):
    """torch copies key by key: a meta tensor (no values) fails at its copy, after the
    keys before it were copied; a complex one is copied without its imaginary part."""
    m = mh.MultiHeadAttention(16, 4, num_kv_heads=2)
    sd = {k: torch.randn_like(v) for k, v in m.state_dict().items()}
    sd["out_proj.bias"] = bad(sd["out_proj.bias"])             # the last key torch copies
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(RuntimeError, match=re.escape(message) + r".*Nothing was loaded"):
        m.load_state_dict(sd)
    assert all(torch.equal(m.state_dict()[k], v) for k, v in before.items())


def test_a_model_of_several_layers_loads_all_or_nothing_through_mh_load_state_dict():
    """A parent's torch load has copied layer 0 when layer 1 refuses: the refusal says so,
    and mh.load_state_dict checks the whole model before copying anything."""
    model = torch.nn.Sequential(mh.MultiHeadAttention(32, 4), torch.nn.LayerNorm(32),
                                mh.MultiHeadAttention(32, 4))
    other = torch.nn.Sequential(mh.MultiHeadAttention(32, 4), torch.nn.LayerNorm(32),
                                mh.MultiHeadAttention(32, 4, num_kv_heads=2))
    sd = other.state_dict()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"load_state_dict: 2\.in_proj_weight has shape "
                                           r"\(64, 32\).*Nothing was loaded$"):
        mh.load_state_dict(model, sd)
    assert all(torch.equal(model.state_dict()[k], v) for k, v in before.items())
    with pytest.raises(RuntimeError, match=r"Nothing of it was loaded \(but the load of the "
                                           r"model holding it has copied the modules it "
                                           r"reached before: multihead\.load_state_dict"):
        model.load_state_dict(sd)
    assert torch.equal(model[0].in_proj_weight, sd["0.in_proj_weight"])     # (torch's copy)
    good = {k: v + 1 for k, v in before.items()}
    missing, unexpected = mh.load_state_dict(model, good)
    assert missing == unexpected == []
    assert all(torch.equal(model.state_dict()[k], v) for k, v in good.items())
    for bad in (None, [1]):
        with pytest.raises(TypeError, match="must be a"):
            mh.load_state_dict(bad, good) if bad is None else mh.load_state_dict(model, bad)


def test_mh_load_state_dict_puts_everything_back_when_torchs_load_fails():
    """A module not ours refusing (torch's size mismatch, after copying the rest): every
    tensor is put back, the same objects with their values, with assign too; what torch's
    load takes through hooks and its rules for old checkpoints loads here too."""
    model = torch.nn.Sequential(mh.MultiHeadAttention(8, 2), torch.nn.Linear(8, 8),
                                torch.nn.BatchNorm1d(8))
    before = {k: (id(v), v.clone()) for k, v in model.state_dict(keep_vars=True).items()}
    sd = {k: v + 1 for k, v in model.state_dict().items()}
    sd["1.weight"] = torch.zeros(3, 3)
    for assign in (False, True):
        with pytest.raises(RuntimeError, match=r"size mismatch for 1\.weight"):
            mh.load_state_dict(model, sd, assign=assign)
        now = model.state_dict(keep_vars=True)
        assert all(id(now[k]) == i and torch.equal(now[k], v) for k, (i, v) in before.items())
    old = collections.OrderedDict((k, v) for k, v in sd.items()          # (a version-1 BN)
                                  if k != "2.num_batches_tracked")
    old["1.weight"] = torch.ones(8, 8)
    old._metadata = {"2": {"version": 1}}
    assert mh.load_state_dict(model, old) == torch.nn.modules.module._IncompatibleKeys([], [])
    assert torch.equal(model[1].weight, torch.ones(8, 8))


@pytest.mark.parametrize("change", ["out_proj.half()", "in_proj_weight.data", "q_proj_weight.data",
                                    "out_proj.bias.data"])
def test_projections_converted_apart_are_refused_by_name_before_torch_fails(change):
    """``m.out_proj.half()`` (or a float64 tensor put in a weight's ``.data``) left the
    forward to fail in F.linear with "mat1 and mat2 must have the same dtype"."""
    m = mh.MultiHeadAttention(16, 4, **(dict(kdim=8, vdim=8) if "q_proj" in change else {}))
    x, ctx = torch.randn(1, 3, 16), torch.randn(1, 2, 8) if "q_proj" in change else None
    if change == "out_proj.half()":
        m.out_proj.half()
        x = x.half()
    else:
        name, _, attr = change.rpartition(".")
        owner, _, leaf = name.rpartition(".")
        t = getattr(m.get_submodule(owner) if owner else m, leaf)
        t.data = t.data.double()
    with pytest.raises(TypeError, match=r"the module's parameters disagree \(.*(float64|float16).*"
                                        r"\): convert the whole module, e\.g\. module\.to\("):
        m(x, ctx)
    m.to(torch.float32)                                   # converted whole: it runs again
    assert m(x.float(), ctx).shape == (1, 3, 16)


def test_assigned_tensors_of_two_dtypes_are_refused_before_the_forward_fails_in_torch():
    """assign=True makes the checkpoint's tensors the parameters: bfloat16 weights beside
    float32 biases loaded, then failed in F.linear; a float32 norm beside a bfloat16
    attention layer is a model's own business and loads."""
    m = mh.MultiHeadAttention(32, 4)
    for change in ("weight", "out_proj"):
        before = {k: v.clone() for k, v in m.state_dict().items()}
        sd = {k: v.bfloat16() if change in k else v for k, v in before.items()}
        with pytest.raises(RuntimeError, match=r"is torch\.(bfloat16|float32) on cpu, .* is "
                                               r"torch\.(float32|bfloat16) on cpu once loaded "
                                               r".*: assigned \(assign=True\)"):
            m.load_state_dict(sd, assign=True)
        assert all(torch.equal(m.state_dict()[k], v) for k, v in before.items())
        m.load_state_dict(sd)                                  # copied: the module's float32
        assert m.in_proj_weight.dtype == torch.float32
    partial = {k: v.bfloat16() for k, v in before.items() if k.startswith("in_proj")}
    with pytest.raises(RuntimeError, match=r"in_proj_weight is torch\.bfloat16 on cpu, "
                                           r"out_proj\.weight is torch\.float32 on cpu once "
                                           r"loaded \(the checkpoint's tensor, or the module's"):
        m.load_state_dict(partial, assign=True, strict=False)      # (out_proj: its own)
    rope = mh.MultiHeadAttention(32, 4, rope=mh.RotaryEmbedding(8, base=500.0))
    with torch.no_grad():
        rope.rope.inv_freq.mul_(1.5)                  # written: kept in float32 by .to()
    sd = rope.to(torch.bfloat16).state_dict()
    assert sd["rope.inv_freq"].dtype == torch.float32 and sd["in_proj_weight"].dtype == torch.bfloat16
    twin = mh.MultiHeadAttention(32, 4, rope=mh.RotaryEmbedding(8, base=500.0))
    twin.load_state_dict(sd, assign=True)                            # (its own forward runs)
    x = torch.randn(1, 3, 32, dtype=torch.bfloat16)
    torch.testing.assert_close(twin(x), rope(x))
    model = torch.nn.Sequential(torch.nn.LayerNorm(32), mh.MultiHeadAttention(32, 4))
    sd = {k: v.bfloat16() if k.startswith("1.") else v for k, v in model.state_dict().items()}
    mh.load_state_dict(model, sd, assign=True)
    x = torch.randn(1, 3, 32)
    assert model[1](model[0](x).bfloat16()).dtype == torch.bfloat16


def _bert():
    from multihead.models import BertConfig, BertEncoder
    return BertEncoder(BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2,
                                  num_attention_heads=4, intermediate_size=64))


@pytest.mark.parametrize("holder, bad_key", [
    (lambda: torch.nn.Sequential(mh.MultiHeadAttention(16, 4)), "0.out_proj.bias"),
    (lambda: torch.nn.Sequential(torch.nn.Linear(16, 16), mh.MultiHeadAttention(16, 4)),
     "1.out_proj.weight"),
    (lambda: mh.nn.MultiheadAttention(16, 4), "out_proj.weight"),
    (_bert, "layers.1.output.weight"),
], ids=["sequential", "after-a-sibling", "drop-in", "bert-encoder"])
def test_a_failed_load_through_a_parent_leaves_the_attention_as_it_was(holder, bad_key):
    """torch's load copies what fits, then raises: our modules check their whole subtree
    before copying, also when a parent's load reaches them, so none is left half-loaded."""
    m = holder()
    sd = {k: torch.randn_like(v) for k, v in m.state_dict().items()}
    sd[bad_key] = torch.zeros(3, 3)
    before = {k: v.clone() for k, v in m.state_dict().items()}
    with pytest.raises(RuntimeError, match=rf"load_state_dict.*{re.escape(bad_key)} has shape "
                                           rf"\(3, 3\) in the checkpoint.*Nothing (of it )?was loaded"):
        m.load_state_dict(sd)
    ours = [n for n, x in m.named_modules()
            if isinstance(x, (mh.MultiHeadAttention, mh.nn.MultiheadAttention))
            or type(x).__name__ == "BertEncoder"]
    for k, v in before.items():
        if any(k.startswith(f"{n}.") or not n for n in ours):
            assert torch.equal(m.state_dict()[k], v), k
    del sd[bad_key]
    if ours[0] == "":                  # our load_state_dict: strict misses refused first too
        with pytest.raises(RuntimeError, match=r"missing keys \[" + re.escape(repr(bad_key))):
            m.load_state_dict(sd)
        assert all(torch.equal(m.state_dict()[k], v) for k, v in before.items())
    m.load_state_dict(sd, strict=False)                        # the rest loads
    assert all(torch.equal(m.state_dict()[k], v) for k, v in sd.items())


def test_torch_compile_fullgraph_parity():
    torch.manual_seed(0)
    m = mh.MultiHeadAttention(32, 4, num_kv_heads=2).eval()
    x = torch.randn(2, 8, 32)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x), m(x))
    torch.testing.assert_close(compiled(x, mask=mh.masks.causal()), m(x, mask=mh.masks.causal()))


def test_torch_compile_fullgraph_training_with_weights():
    """The reference backend (what returns weights) traces in one graph with gradients."""
    m = mh.MultiHeadAttention(32, 4, num_kv_heads=2)
    x = torch.randn(2, 8, 32, generator=torch.Generator().manual_seed(1), requires_grad=True)
    step = lambda x: m(x, mask=mh.masks.causal(), return_weights=True)[1].square().sum()
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    want = torch.autograd.grad(step(x), x)[0]
    torch.testing.assert_close(torch.autograd.grad(compiled(x), x)[0], want)


def test_a_compiled_gqa_rope_module_trains_at_a_new_length():
    """Inductor (the default backend), dynamic lengths: SDPA's GQA fold of a strided q (RoPE
    rotates q and k as one tensor, then splits it) made the compiled backward assert the
    strides of the first length at the second ("expected ... stride 640==320"); the
    gradients now equal eager's at each length."""
    torch.manual_seed(1)
    m = mh.MultiHeadAttention(32, 4, num_kv_heads=2, rope=mh.RotaryEmbedding(8))
    compiled = torch.compile(m, dynamic=True)
    for S in (10, 20):
        x = torch.randn(2, S, 32)
        grads = []
        for fn in (compiled, m):
            m.zero_grad()
            fn(x).square().sum().backward()
            grads.append([p.grad.clone() for p in m.parameters()])
        for got, want in zip(*grads):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("masked", [False, True])
def test_seed_tutorial_parity(masked):
    torch.manual_seed(0)
    tut = SeedTutorialMHA(32, 4)
    ours = mh.MultiHeadAttention(32, 4).eval()
    with torch.no_grad():
        ours.in_proj_weight.copy_(torch.cat([tut.w_q.weight, tut.w_k.weight, tut.w_v.weight]))
        ours.in_proj_bias.copy_(torch.cat([tut.w_q.bias, tut.w_k.bias, tut.w_v.bias]))
        ours.out_proj.load_state_dict(tut.w_o.state_dict())
    x = torch.randn(2, 6, 32)
    causal = torch.tril(torch.ones(6, 6))
    want, w_want = tut(x, causal if masked else None)
    got, w_got = ours(x, mask=mh.masks.causal() if masked else None, return_weights=True)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w_got, w_want, atol=1e-6, rtol=1e-5)


BAD = [
    (lambda: mh.MultiHeadAttention(770, 12), ValueError,
     r"embed_dim \(770\) must be divisible by num_heads \(12\): try num_heads in \[1, 2, 5, 7, 10, 11"),
    (lambda: mh.MultiHeadAttention(64, 8, num_kv_heads=3), ValueError,
     r"num_heads \(8\) must be a multiple of num_kv_heads \(3\): try num_kv_heads in \[1, 2, 4, 8\]"),
    (lambda: mh.RotaryEmbedding(7), ValueError, r"head_dim must be a positive even int"),
    (lambda: mh.MultiHeadAttention(64, 8, rope=mh.RotaryEmbedding(16)), ValueError,
     r"rope was built for head_dim 16 but the module's head_dim is 8"),
    (lambda: mh.MultiHeadAttention(64, 8)(torch.randn(5, 64)), ValueError,
     r"x must be \(B, S, 64\), got shape \(5, 64\).*unsqueeze"),
    (lambda: mh.MultiHeadAttention(64, 8)(torch.randn(2, 5, 32)), ValueError, r"x must be \(B, S, 64\)"),
    (lambda: mh.MultiHeadAttention(16, 4, kdim=8, vdim=8)(torch.randn(1, 2, 16), torch.randn(1, 3, 9)),
     ValueError, r"context must be \(B, S, 8\)"),
    (lambda: mh.MultiHeadAttention(16, 4)(torch.randn(1, 2, 16).double()), TypeError,
     r"x is torch.float64 on cpu but the module is torch.float32"),
    (lambda: mh.MultiHeadAttention(16, 4, rope=mh.RotaryEmbedding(4))(torch.randn(1, 3, 16),
                                                                   positions=torch.arange(4)),
     ValueError, r"positions must be an int \(the first of Sq consecutive positions\) or "
                 r"\(Sq,\) or \(B, Sq\) = \(3,\) or \(1, 3\), got shape \(4,\)"),
    (lambda: mh.MultiHeadAttention(16, 4, dropout=1.5), ValueError, r"dropout must be a float in \[0, 1\)"),
    (lambda: mh.MultiHeadAttention(16, 4, backend="SDPA"), ValueError,
     r"unknown backend 'SDPA': choose one of auto, .*sdpa"),
    (lambda: mh.MultiHeadAttention(16, 4, rope=mh.RotaryEmbedding(4))(torch.randn(1, 3, 16),
                                                                   positions=2.5),
     TypeError, r"positions must be an int .* got the scalar 2.5: pass an int"),
    (lambda: mh.MultiHeadAttention(16, 4, kdim=6, vdim=5), ValueError,
     r"kdim \(6\) != vdim \(5\).*multihead.nn.MultiheadAttention"),
    (lambda: mh.MultiHeadAttention.from_torch(torch.nn.MultiheadAttention(16, 4, kdim=6, vdim=5)),
     ValueError, r"from_torch: kdim \(6\) != vdim \(5\)"),
]


@pytest.mark.parametrize("fn,exc,pattern", BAD)
def test_bad_input(fn, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fn()


def test_from_torch_names_the_drop_in_once():
    """Our constructor's refusal may already advise the drop-in; from_torch adds it only
    where it does not (torch allows dropout=1.0, ours does not)."""
    for torch_module in (torch.nn.MultiheadAttention(16, 4, kdim=6, vdim=5, batch_first=True),
                         torch.nn.MultiheadAttention(16, 4, dropout=1.0, batch_first=True)):
        with pytest.raises(ValueError, match=r"^from_torch: ") as info:
            mh.MultiHeadAttention.from_torch(torch_module)
        assert str(info.value).count("multihead.nn.MultiheadAttention") == 1, info.value


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
def test_dynamic_quantization_of_a_model_around_the_module():
    """quantize_dynamic swaps every nn.Linear for a packed one; the module's out_proj, whose
    weight its forward reads, stays float (as torch's own MHA does) and the model runs."""
    net = torch.nn.Sequential(mh.MultiHeadAttention(32, 4, num_kv_heads=2), torch.nn.Linear(32, 8))
    net.eval()
    x = torch.randn(2, 5, 32, generator=torch.Generator().manual_seed(2))
    quantized = torch.ao.quantization.quantize_dynamic(net, {torch.nn.Linear}, dtype=torch.qint8)
    assert type(quantized[1]) is not torch.nn.Linear                     # the Linear was packed
    torch.testing.assert_close(quantized(x), net(x), atol=0.05, rtol=0.05)


def test_a_hugging_face_checkpoint_is_refused_with_the_conversion_that_then_matches_llama():
    """HF's separate q/k/v/o projections used to be told to "build it with the checkpoint's
    sizes", which already matched; the conversion the error names gives LlamaAttention's
    outputs."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding
    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=64, num_attention_heads=8, num_key_value_heads=2,
                         head_dim=8, attention_bias=True)
    config._attn_implementation = "eager"
    hf = LlamaAttention(config, 0).eval()
    ours = mh.MultiHeadAttention(64, 8, num_kv_heads=2, rope=mh.RotaryEmbedding(8)).eval()
    sd = hf.state_dict()
    with pytest.raises(RuntimeError, match=r"Hugging Face's layout .* in_proj_weight = torch.cat"
                                           r"\(\[q_proj.weight, k_proj.weight, v_proj.weight\]\), "
                                           r"in_proj_bias = the same of their biases .*out_proj.\* "
                                           r"= o_proj.\*\. Nothing was loaded"):
        ours.load_state_dict(sd)
    ours.load_state_dict({
        "in_proj_weight": torch.cat([sd[f"{n}_proj.weight"] for n in "qkv"]),
        "in_proj_bias": torch.cat([sd[f"{n}_proj.bias"] for n in "qkv"]),
        "out_proj.weight": sd["o_proj.weight"], "out_proj.bias": sd["o_proj.bias"]})
    x = torch.randn(2, 7, 64)
    cos, sin = LlamaRotaryEmbedding(config)(x, torch.arange(7)[None])
    causal = torch.full((7, 7), float("-inf")).triu(1)
    with torch.no_grad():
        torch.testing.assert_close(ours(x, mask=mh.masks.causal()),
                                   hf(x, (cos, sin), attention_mask=causal)[0],
                                   atol=1e-5, rtol=1e-5)
    plain = mh.MultiHeadAttention(64, 8, num_kv_heads=2, bias=False)
    with pytest.raises(RuntimeError, match=r"v_proj.weight\]\), out_proj"):   # no bias to name
        plain.load_state_dict(sd)


@pytest.mark.parametrize("call, error, match", [
    (lambda m, x: m(x, average_weights=True), ValueError,
     r"average_weights=True averages the weights that return_weights=True returns"),
    (lambda m, x: m(x.to(torch.complex64)), TypeError,
     r"x must be floating point \(the module's dtype torch.float32\), got torch.complex64"),
    (lambda m, x: m(x.long()), TypeError, r"x must be floating point .* got torch.int64"),
    *(pytest.param(call, ValueError, match, id=name, marks=pytest.mark.skipif(
        torch.cuda.is_available(), reason="this machine has CUDA")) for name, call, match in [
        ("module-cuda", lambda m, x: mh.MultiHeadAttention(16, 4, device="cuda"),
         r"device 'cuda' cannot be used here \(.*\): pass device='cpu'"),
        ("rope-cuda", lambda m, x: mh.RotaryEmbedding(8, device="cuda"),
         r"device 'cuda' cannot be used here")]),
], ids=["average-without-weights", "complex", "integer", "module-cuda", "rope-cuda"])
def test_arguments_that_did_nothing_or_crashed_in_torch_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call(mh.MultiHeadAttention(16, 4), torch.randn(1, 3, 16))

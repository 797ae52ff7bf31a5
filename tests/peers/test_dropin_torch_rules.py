"""The drop-in follows torch.nn.MultiheadAttention's rules, not only its numbers.

Which inputs it refuses (and with which exception types), which dtype mismatches it
tolerates, what the ``is_causal`` hint means, TorchScript, and NestedTensor inputs.
Every case is checked against torch's own class on the same weights.
"""

import warnings

import pytest
import torch
from torch import nn

import multihead as mh

E, H, L, S, B = 16, 4, 5, 7, 3


def _pair(**kw):
    torch.manual_seed(0)
    t = nn.MultiheadAttention(E, H, **kw)
    ours = mh.nn.MultiheadAttention(E, H, **kw)
    ours.load_state_dict(t.state_dict())
    return t.eval(), ours.eval()


def _torch_error(module, *args, **kw) -> BaseException:
    """The exception torch's own class raises for this call (the test fails if none)."""
    with pytest.raises(Exception) as info:
        module(*args, **kw)
    return info.value


def _seq_first():
    g = torch.Generator().manual_seed(3)
    return torch.randn(L, B, E, generator=g), torch.randn(S, B, E, generator=g)


# ----------------------------------------------------------------------------- mask shapes

BAD_ATTN_MASKS = {
    "1-D (S,)": (S,),
    "(1, S)": (1, S),
    "(L, 1)": (L, 1),
    "(S, L)": (S, L),
    "4-D (B, H, L, S)": (B, H, L, S),
    "3-D (1, L, S)": (1, L, S),
    "3-D (B, L, S)": (B, L, S),
    "3-D (B*H, S, L)": (B * H, S, L),
}


@pytest.mark.parametrize("need_weights", [True, False])
@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
@pytest.mark.parametrize("name", list(BAD_ATTN_MASKS))
def test_attn_mask_of_a_shape_torch_refuses_is_refused(name, dtype, need_weights):
    t, ours = _pair()
    q, kv = _seq_first()
    kw = dict(attn_mask=torch.zeros(BAD_ATTN_MASKS[name], dtype=dtype), need_weights=need_weights)
    want = type(_torch_error(t, q, kv, kv, **kw))
    with pytest.raises(want) as info:
        ours(q, kv, kv, **kw)
    assert isinstance(info.value, ValueError)
    msg = str(info.value)
    assert "attn_mask" in msg and str(tuple(BAD_ATTN_MASKS[name])) in msg
    assert f"({L}, {S})" in msg and f"({B * H}, {L}, {S})" in msg     # the shapes that would do


@pytest.mark.parametrize("shape", [(S,), (B, S, 1), (B + 1, S), (B, S + 1), (1, S)])
def test_key_padding_mask_of_a_shape_torch_refuses_is_refused(shape):
    t, ours = _pair()
    q, kv = _seq_first()
    kw = dict(key_padding_mask=torch.zeros(shape, dtype=torch.bool))
    want = type(_torch_error(t, q, kv, kv, **kw))
    with pytest.raises(want) as info:
        ours(q, kv, kv, **kw)
    assert isinstance(info.value, ValueError)
    assert "key_padding_mask" in str(info.value) and str(shape) in str(info.value)
    assert f"(N, S) = ({B}, {S})" in str(info.value)


@pytest.mark.parametrize("shape,fix", [((B, H, L, S), r"attn_mask.flatten\(0, 1\)"),
                                       ((B, L, S), r"repeat_interleave\(num_heads, dim=0\)"),
                                       ((1, L, S), r"attn_mask\[0\]"),
                                       ((1, S), rf"attn_mask.expand\({L}, {S}\)"),
                                       ((S,), "key_padding_mask")])
def test_attn_mask_errors_suggest_the_likely_fix(shape, fix):
    _, ours = _pair()
    q, kv = _seq_first()
    with pytest.raises(ValueError, match=fix):
        ours(q, kv, kv, attn_mask=torch.zeros(shape, dtype=torch.bool))


def test_transposed_key_padding_mask_is_refused_not_reinterpreted():
    """The classic mistake with batch_first=False: a (S, B) mask, like the (S, B, E) keys."""
    t, ours = _pair()
    q, kv = _seq_first()
    kpm = torch.zeros(S, B, dtype=torch.bool)
    kpm[-1] = True                                      # meant: the last key of every sequence
    with pytest.raises(AssertionError):
        t(q, kv, kv, key_padding_mask=kpm)
    want = r"key_padding_mask.*\(7, 3\).*\(N, S\) = \(3, 7\)"
    with pytest.raises(ValueError, match=want) as info:
        ours(q, kv, kv, key_padding_mask=kpm)
    assert isinstance(info.value, AssertionError)
    assert "transpose" in str(info.value)               # the likely fix is suggested


def test_unbatched_masks_follow_torchs_shapes():
    t, ours = _pair()
    x, ctx = torch.randn(L, E), torch.randn(S, E)
    ok = dict(key_padding_mask=torch.zeros(S, dtype=torch.bool),
              attn_mask=torch.zeros(H, L, S, dtype=torch.bool))
    torch.testing.assert_close(ours(x, ctx, ctx, **ok)[0], t(x, ctx, ctx, **ok)[0],
                               atol=1e-5, rtol=1e-5)
    for bad in (dict(key_padding_mask=torch.zeros(1, S, dtype=torch.bool)),
                dict(attn_mask=torch.zeros(H + 1, L, S, dtype=torch.bool)),
                dict(attn_mask=torch.zeros(S, dtype=torch.bool))):
        want = type(_torch_error(t, x, ctx, ctx, **bad))
        with pytest.raises(want) as info:
            ours(x, ctx, ctx, **bad)
        assert isinstance(info.value, ValueError) and "unbatched" in str(info.value)


# ------------------------------------------------------------------ exception types

def _bad_calls():
    q, kv = _seq_first()
    return {
        "query 4-D": (q[None], kv[None], kv[None]),
        "key 2-D": (q, kv[:, 0], kv),
        "value 2-D": (q, kv, kv[:, 0]),
        "unbatched key 3-D": (q[:, 0], kv, kv[:, 0]),
        "query embed dim": (q[..., :-1], kv, kv),
        "key embed dim": (q, kv[..., :-1], kv[..., :-1]),
        "key/value lengths": (q, kv, kv[:-1]),
        "key batch": (q, kv[:, :-1], kv[:, :-1]),
    }


@pytest.mark.parametrize("kdim", [None, 12], ids=["packed", "kdim"])
@pytest.mark.parametrize("case", list(_bad_calls()))
def test_bad_inputs_raise_torchs_type_and_value_error(case, kdim):
    t, ours = _pair(kdim=kdim, vdim=kdim)
    args = _bad_calls()[case]
    if kdim is not None:                                  # the keys and values at kdim wide
        args = (args[0], *(a[..., :kdim] if a.shape[-1] == E else a[..., :kdim - 1]
                           for a in args[1:]))
    torch_err = _torch_error(t, *args)
    assert type(torch_err) in (AssertionError, RuntimeError)
    with pytest.raises(type(torch_err)) as info:
        ours(*args)
    assert isinstance(info.value, ValueError)
    assert info.value.args[0]                            # a message, not a bare assertion


@pytest.mark.parametrize("dtype", [torch.int64, torch.uint8, torch.int32])
@pytest.mark.parametrize("arg", ["attn_mask", "key_padding_mask"])
def test_integer_masks_raise_assertion_and_type_error(arg, dtype):
    t, ours = _pair()
    q, kv = _seq_first()
    shape = (L, S) if arg == "attn_mask" else (B, S)
    kw = {arg: torch.zeros(shape, dtype=dtype)}
    with pytest.raises(AssertionError):
        t(q, kv, kv, **kw)
    with pytest.raises(TypeError, match=f"{arg}.*{dtype}") as info:
        ours(q, kv, kv, **kw)
    assert isinstance(info.value, AssertionError)


def test_is_causal_without_attn_mask_is_a_runtime_and_value_error():
    _, ours = _pair()
    q, kv = _seq_first()
    with pytest.raises(RuntimeError, match="is_causal") as info:
        ours(q, kv, kv, is_causal=True, need_weights=False)
    assert isinstance(info.value, ValueError)


def test_indivisible_embed_dim_is_assertion_and_value_error_with_suggestions():
    with pytest.raises(AssertionError):
        nn.MultiheadAttention(10, 3)
    want = r"embed_dim \(10\).*num_heads \(3\).*\[1, 2, 5, 10\]"
    with pytest.raises(ValueError, match=want) as info:
        mh.nn.MultiheadAttention(10, 3)
    assert isinstance(info.value, AssertionError)


@pytest.mark.parametrize("how", ["keyword", "positional"])
@pytest.mark.parametrize("dtype", [torch.int32, torch.float8_e4m3fn])
def test_a_dtype_torch_fails_to_build_in_is_a_runtime_and_type_error_naming_it(dtype, how):
    """torch fails deep inside its init (no gradients for integers, no uniform init for
    float8); ours refuses the argument first, as either exception."""
    args = (E, H) + ((0.0, True, False, False, None, None, False, None, dtype)
                     if how == "positional" else ())
    kwargs = {} if how == "positional" else {"dtype": dtype}
    with pytest.raises(RuntimeError):
        nn.MultiheadAttention(*args, **kwargs)
    with pytest.raises(TypeError, match=rf"dtype must be torch.float16, .* got {dtype}") as info:
        mh.nn.MultiheadAttention(*args, **kwargs)
    assert isinstance(info.value, RuntimeError)


def test_weights_converted_to_float8_are_named_before_the_projection():
    _, ours = _pair()
    ours.to(torch.float8_e4m3fn)
    q, kv = (t.to(torch.float8_e4m3fn) for t in _seq_first())
    with pytest.raises(TypeError, match=r"the module's weights are torch.float8_e4m3fn, .* "
                                        r"module.to\(torch.bfloat16\)") as info:
        ours(q, kv, kv)
    assert isinstance(info.value, RuntimeError)


# ------------------------------------------------------------------ dtype tolerance

@torch.no_grad()
def test_in_proj_bias_of_another_dtype_than_query_is_tolerated_like_torch():
    t, ours = _pair(batch_first=True, dtype=torch.float64)
    for m in (t, ours):
        m.in_proj_bias = nn.Parameter(t.in_proj_bias.detach().to(torch.float16))
    x = torch.randn(B, L, E, dtype=torch.float64)
    a, b = ours(x, x, x)[0], t(x, x, x)[0]
    assert a.dtype == b.dtype == torch.float64
    torch.testing.assert_close(a, b)


@pytest.mark.parametrize("kpm_float", [True, False])
def test_mismatched_mask_dtypes_warn_like_torch_and_agree(kpm_float):
    t, ours = _pair()
    q, kv = _seq_first()
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[:, -2:] = True
    am = torch.rand(L, S, generator=torch.Generator().manual_seed(0)) > 0.6
    am[:, 0] = False
    to_float = lambda m: torch.zeros(m.shape).masked_fill(m, float("-inf"))
    kw = dict(key_padding_mask=to_float(kpm) if kpm_float else kpm,
              attn_mask=am if kpm_float else to_float(am))
    results = []
    for m in (ours, t):
        with pytest.warns(UserWarning, match="mismatched key_padding_mask and attn_mask"):
            results.append(m(q, kv, kv, **kw))
    torch.testing.assert_close(results[0], results[1], atol=1e-5, rtol=1e-5)


def test_mismatched_mask_dtypes_trace_without_a_graph_break():
    """torch's warning for a bool key_padding_mask with a float attn_mask (the usual
    generate_square_subsequent_mask pairing) is a call Dynamo cannot trace: fullgraph
    failed there, as torch's own module does. The warning is left out while tracing."""
    ours = _pair(batch_first=True)[1]
    x = torch.randn(B, L, E)
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, -2:] = True
    am = nn.Transformer.generate_square_subsequent_mask(L)
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True, backend="eager")
    got = compiled(x, x, x, key_padding_mask=kpm, attn_mask=am, need_weights=False)[0]
    with pytest.warns(UserWarning, match="mismatched key_padding_mask and attn_mask"):
        want = ours(x, x, x, key_padding_mask=kpm, attn_mask=am, need_weights=False)[0]
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("module, mask", [(torch.float16, torch.float32),
                                          (torch.float32, torch.float64)])
@pytest.mark.parametrize("arg", ["attn_mask", "key_padding_mask"])
def test_a_float_mask_of_a_wider_dtype_is_added_at_its_own_precision(module, mask, arg):
    """A finite value past the query dtype's range (-70000 in float16, -1e39 in float32)
    is a number, as a bias is (a row of it a shift that float32 scores ignore, or that
    swamps them: uniform): rounded into the query's dtype first it became -inf and hid the
    whole row (weights all 0).
    torch refuses these calls; values in range give torch's result on the mask rounded."""
    t, ours = _pair(batch_first=True, dtype=module)
    x = torch.randn(B, L, E, generator=torch.Generator().manual_seed(1)).to(module)
    far = -70000.0 if module == torch.float16 else -1e39
    shape = (L, S) if arg == "attn_mask" else (B, S)
    m = torch.zeros(shape, dtype=mask)
    m[0] = far                                        # row 0 of attn_mask; sequence 0 of kpm
    kv = torch.randn(B, S, E, generator=torch.Generator().manual_seed(2)).to(module)
    with pytest.raises(RuntimeError):
        t(x, kv, kv, **{arg: m})
    _, w = ours(x, kv, kv, **{arg: m})
    _, w_plain = ours(x, kv, kv)
    row = (0, 0) if arg == "attn_mask" else (0, slice(None))
    tol = 2e-3 if module == torch.float16 else 1e-6
    # float32 scores: -1e39 saturates at float32's most negative, which swamps the scores
    want = w_plain[row] if module == torch.float16 else torch.full_like(w[row], 1 / S)
    torch.testing.assert_close(w[row].float(), want.float(), atol=tol, rtol=0)
    small = torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(mask)
    torch.testing.assert_close(ours(x, kv, kv, **{arg: small})[0].float(),
                               t(x, kv, kv, **{arg: small.to(module)})[0].float(),
                               atol=tol * 10, rtol=0)


@pytest.mark.parametrize("arg", ["attn_mask", "key_padding_mask"])
def test_mask_and_input_mistakes_name_the_argument(arg):
    _, ours = _pair(batch_first=True)
    x = torch.randn(B, L, E)
    shape = (L, L) if arg == "attn_mask" else (B, L)
    bad = torch.zeros(shape)
    bad[0, 1] = float("nan")
    with pytest.raises(ValueError, match=f"{arg}: bias contains NaN or \\+inf"):
        ours(x, x, x, **{arg: bad})
    with pytest.raises(RuntimeError, match=f"{arg} is on meta but query is on cpu") as info:
        ours(x, x, x, **{arg: torch.zeros(shape, dtype=torch.bool, device="meta")})
    assert isinstance(info.value, ValueError)
    with pytest.raises(RuntimeError, match="key is torch.float64 but the module's weights "
                                           "are torch.float32") as info:
        ours(x, x.double(), x)
    assert isinstance(info.value, ValueError)
    with torch.autocast("cpu", dtype=torch.bfloat16):   # autocast casts: no refusal
        assert ours(x.bfloat16(), x.bfloat16(), x.bfloat16())[0].dtype == torch.bfloat16


def test_matching_mask_dtypes_do_not_warn():
    _, ours = _pair()
    q, kv = _seq_first()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ours(q, kv, kv, key_padding_mask=torch.zeros(B, S, dtype=torch.bool),
             attn_mask=torch.zeros(L, S, dtype=torch.bool))


# ------------------------------------------------------------------ the is_causal hint

@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kv_len", [L, S])
def test_is_causal_hint_replaces_attn_mask_when_nothing_else_needs_it(batch_first, kv_len):
    """need_weights=False and no key_padding_mask: the causal mask, whatever attn_mask says."""
    t, ours = _pair(batch_first=batch_first)
    g = torch.Generator().manual_seed(4)
    shape = lambda n: (B, n, E) if batch_first else (n, B, E)
    q, kv = torch.randn(shape(L), generator=g), torch.randn(shape(kv_len), generator=g)
    nothing_masked = torch.zeros(L, kv_len, dtype=torch.bool)
    kw = dict(attn_mask=nothing_masked, is_causal=True, need_weights=False)
    a, b = ours(q, kv, kv, **kw)[0], t(q, kv, kv, **kw)[0]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    # the hint is upper-left causal (query i sees keys 0..i), as in torch
    causal = torch.ones(L, kv_len, dtype=torch.bool).triu(1)
    torch.testing.assert_close(a, ours(q, kv, kv, attn_mask=causal, need_weights=False)[0])
    # the hint does not even read the mask's shape (only its rank and dtype)
    odd = dict(kw, attn_mask=torch.zeros(1, 1, dtype=torch.bool))
    torch.testing.assert_close(ours(q, kv, kv, **odd)[0], t(q, kv, kv, **odd)[0],
                               atol=1e-5, rtol=1e-5)


def test_is_causal_hint_is_ignored_when_weights_or_padding_need_the_mask():
    t, ours = _pair()
    q, kv = _seq_first()
    nothing_masked = torch.zeros(L, S, dtype=torch.bool)
    kpm = torch.zeros(B, S, dtype=torch.bool)
    kpm[0, -1] = True
    for kw in (dict(need_weights=True), dict(need_weights=False, key_padding_mask=kpm)):
        kw = dict(kw, attn_mask=nothing_masked, is_causal=True)
        a, b = ours(q, kv, kv, **kw), t(q, kv, kv, **kw)
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        plain = {k: v for k, v in kw.items() if k != "is_causal"}
        torch.testing.assert_close(a, ours(q, kv, kv, **plain))


@torch.no_grad()
def test_is_causal_hint_is_ignored_where_torchs_fused_kernel_runs():
    """Self-attention in eval mode without gradients: torch's fused kernel applies attn_mask
    and never reads the hint; a wrong hint gives torch's answer there too."""
    t, ours = _pair(batch_first=True)
    t.eval(), ours.eval()
    x = torch.randn(B, L, E, generator=torch.Generator().manual_seed(6))
    only_key_1 = torch.ones(L, L, dtype=torch.bool)
    only_key_1[:, 1] = False                                # True = may not attend
    kw = dict(attn_mask=only_key_1, is_causal=True, need_weights=False)
    a, b = ours(x, x, x, **kw)[0], t(x, x, x, **kw)[0]
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    plain = ours(x, x, x, attn_mask=only_key_1, need_weights=False)[0]
    torch.testing.assert_close(a, plain)


# ------------------------------------------------------------------ TorchScript

def _masks_seq_first():
    am = torch.rand(L, L, generator=torch.Generator().manual_seed(5)) > 0.7
    am.fill_diagonal_(False)
    am[:, 0] = False                                   # every query keeps a key under kpm too
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[1, -2:] = True
    return am, kpm


_NO_JIT_DEPRECATION = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")


@_NO_JIT_DEPRECATION
@pytest.mark.parametrize("batch_first", [True, False])
@pytest.mark.parametrize("kdim", [None, 10])
def test_torchscript_of_the_drop_in_matches_eager(batch_first, kdim):
    _, ours = _pair(batch_first=batch_first, kdim=kdim, vdim=kdim)
    scripted = torch.jit.script(ours)
    g = torch.Generator().manual_seed(6)
    shape = lambda n, w: (B, n, w) if batch_first else (n, B, w)
    q, kv = torch.randn(shape(L, E), generator=g), torch.randn(shape(L, kdim or E), generator=g)
    am, kpm = _masks_seq_first()
    for kw in (dict(), dict(attn_mask=am, key_padding_mask=kpm),
               dict(attn_mask=am, need_weights=False), dict(key_padding_mask=kpm,
                                                            average_attn_weights=False)):
        torch.testing.assert_close(scripted(q, kv, kv, **kw), ours(q, kv, kv, **kw),
                                   atol=1e-5, rtol=1e-5)
    # scripting keeps the module: same parameters, still our class in eager code
    assert isinstance(ours, mh.nn.MultiheadAttention)
    with torch.no_grad():
        ours.out_proj.bias.add_(1.0)
    torch.testing.assert_close(scripted(q, kv, kv)[0], ours(q, kv, kv)[0], atol=1e-5, rtol=1e-5)


@pytest.mark.filterwarnings("ignore:`torch.jit.trace")
@pytest.mark.filterwarnings("ignore::torch.jit.TracerWarning")
def test_a_trace_of_the_drop_in_runs_torchs_forward_for_masks_it_did_not_see():
    torch.manual_seed(0)
    theirs = nn.MultiheadAttention(E, H, batch_first=True).eval()
    _, ours = _pair(batch_first=True, kdim=None, vdim=None)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(B, L, E)
    am, kpm = _masks_seq_first()

    class SelfAttention(nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, x, am, kpm):
            return self.m(x, x, x, attn_mask=am, key_padding_mask=kpm, need_weights=False)[0]
    traced = torch.jit.trace(SelfAttention(ours), (x, torch.zeros_like(am),
                                                   torch.zeros_like(kpm)))     # no mask seen
    torch.testing.assert_close(traced(x, am, kpm), SelfAttention(theirs)(x, am, kpm))


@_NO_JIT_DEPRECATION
def test_a_model_that_keeps_multihead_attention_out_of_its_script_still_scripts():
    """TorchScript calls every submodule's ``__prepare_scriptable__`` before it reads
    ``__jit_ignored_attributes__``: a refusal there (tried twice, reverted twice) broke
    models that hold the module outside what they script."""
    class Model(nn.Module):
        __jit_ignored_attributes__ = ["attn"]

        def __init__(self):
            super().__init__()
            self.lin, self.attn = nn.Linear(E, E), mh.MultiHeadAttention(E, H)

        def forward(self, x):
            return self.lin(x)
    model = Model()
    x = torch.randn(B, L, E)
    torch.testing.assert_close(torch.jit.script(model)(x), model(x))


def test_a_trace_of_multihead_attention_is_refused_with_what_to_use():
    m = mh.MultiHeadAttention(E, H, num_kv_heads=2, rope=mh.RotaryEmbedding(E // H)).eval()
    x = torch.randn(B, L, E)
    heads = x.view(B, L, H, E // H).transpose(1, 2)                  # (B, H, L, E/H)
    for what, traced, args in (("MultiHeadAttention", m, (x,)),
                               ("RotaryEmbedding", m.rope, (heads, torch.arange(L))),
                               ("multihead.attention", lambda t: mh.attention(t, t, t), (heads,))):
        with pytest.raises(RuntimeError, match=f"{what} cannot be recorded by torch.jit.trace"
                           ".*use torch.export.export or torch.compile"), pytest.warns():
            torch.jit.trace(traced, args)

    class Causal(nn.Module):                       # what it advises works
        def forward(self, x):
            return m(x, mask=mh.masks.causal())
    exported = torch.export.export(Causal(), (x,)).module()
    y = torch.randn(B, L, E)
    torch.testing.assert_close(exported(y), m(y, mask=mh.masks.causal()))


class _EncoderLayerWithOurs(nn.TransformerEncoderLayer):
    """A user's layer that builds our attention itself."""

    def __init__(self, d_model, nhead, **kw):
        super().__init__(d_model, nhead, **kw)
        self.self_attn = mh.nn.MultiheadAttention(d_model, nhead, dropout=kw.get("dropout", 0.1),
                                                  batch_first=kw.get("batch_first", False))


@_NO_JIT_DEPRECATION
@pytest.mark.parametrize("build", ["assigned", "subclass"])
@pytest.mark.parametrize("batch_first", [True, False])
def test_torchscript_of_an_encoder_layer_holding_the_drop_in(build, batch_first):
    torch.manual_seed(0)
    kw = dict(dim_feedforward=32, dropout=0.0, batch_first=batch_first)
    if build == "assigned":
        layer = nn.TransformerEncoderLayer(E, H, **kw)
        layer.self_attn = mh.nn.MultiheadAttention(E, H, batch_first=batch_first)
    else:
        layer = _EncoderLayerWithOurs(E, H, **kw)
    layer.eval()
    scripted = torch.jit.script(layer)
    assert isinstance(layer.self_attn, mh.nn.MultiheadAttention)
    x = torch.randn((B, L, E) if batch_first else (L, B, E))
    am, kpm = _masks_seq_first()
    for mk in (dict(), dict(src_mask=am), dict(src_key_padding_mask=kpm),
               dict(src_mask=am, src_key_padding_mask=kpm)):
        torch.testing.assert_close(scripted(x, **mk), layer(x, **mk), atol=1e-5, rtol=1e-5)


# ------------------------------------------------------------------ NestedTensor inputs

_NO_PROTOTYPE_WARNING = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")


def _nested(lengths, layout, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.nested.nested_tensor([torch.randn(n, E, generator=g) for n in lengths],
                                      layout=layout)


@_NO_PROTOTYPE_WARNING
@pytest.mark.parametrize("need_weights,average", [(False, True), (True, True), (True, False)])
@torch.no_grad()
def test_nested_self_attention_matches_torchs_inference_fast_path(need_weights, average):
    t, ours = _pair(batch_first=True)
    x = _nested([4, 6, 1], torch.strided)
    a_out, a_w = ours(x, x, x, need_weights=need_weights, average_attn_weights=average)
    b_out, b_w = t(x, x, x, need_weights=need_weights, average_attn_weights=average)
    assert a_out.is_nested and a_out.layout == b_out.layout == torch.strided
    for a, b in zip(a_out.unbind(), b_out.unbind()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    if need_weights:
        torch.testing.assert_close(a_w, b_w, atol=1e-6, rtol=1e-5)
    else:
        assert a_w is None and b_w is None


@_NO_PROTOTYPE_WARNING
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
@torch.no_grad()
def test_nested_inputs_equal_each_sequence_on_its_own(layout):
    """Self- and cross-attention on nested inputs of either layout, sequence by sequence."""
    _, ours = _pair(batch_first=True)
    x, ctx = _nested([4, 6, 1], layout), _nested([2, 3, 5], layout, seed=8)
    for kv in (x, ctx):
        out = ours(x, kv, kv, need_weights=False)[0]
        assert out.is_nested and out.layout == layout
        for o, xi, ki in zip(out.unbind(), x.unbind(), kv.unbind()):
            torch.testing.assert_close(o, ours(xi, ki, ki)[0], atol=1e-5, rtol=1e-5)


@_NO_PROTOTYPE_WARNING
@torch.no_grad()
def test_nested_inputs_torch_cannot_take_are_refused_clearly():
    t, ours = _pair(batch_first=True)
    x = _nested([4, 6], torch.strided)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    with pytest.raises(AssertionError):
        t(x, x, x, key_padding_mask=kpm)
    with pytest.raises(ValueError, match="NestedTensor.*key_padding_mask") as info:
        ours(x, x, x, key_padding_mask=kpm)
    assert isinstance(info.value, AssertionError)
    with pytest.raises(ValueError, match="NestedTensor.*batch_first"):
        _pair(batch_first=False)[1](x, x, x)
    with pytest.raises(ValueError, match="NestedTensor"):
        ours(x, x.to_padded_tensor(0.0), x)
    # torch's fused kernel drops the hint (no causal mask) and nested inputs take no mask
    with pytest.raises(ValueError, match="is_causal.*NestedTensor.*to_padded_tensor") as info:
        ours(x, x, x, is_causal=True, need_weights=False)
    assert isinstance(info.value, RuntimeError)


# ------------------------------------------------------------------ memory layout

@pytest.mark.parametrize("layout", ["batch_first", "seq_first", "unbatched"])
def test_output_memory_layout_is_torchs_so_a_following_dropout_agrees(layout):
    """A Dropout after attention draws its mask in memory order: same strides, same mask."""
    t, ours = _pair(batch_first=layout == "batch_first")
    x = torch.randn({"batch_first": (B, L, E), "seq_first": (L, B, E), "unbatched": (L, E)}[layout])
    assert ours(x, x, x)[0].stride() == t(x, x, x)[0].stride()
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(E, H, 32, dropout=0.2, batch_first=layout == "batch_first")
    with_ours = nn.TransformerEncoderLayer(E, H, 32, dropout=0.2,
                                           batch_first=layout == "batch_first")
    with_ours.self_attn = mh.nn.MultiheadAttention(E, H, dropout=0.2,
                                                   batch_first=layout == "batch_first")
    with_ours.load_state_dict(layer.state_dict())
    torch.manual_seed(1)
    a = layer(x)
    torch.manual_seed(1)
    torch.testing.assert_close(with_ours(x), a, atol=1e-5, rtol=1e-5)


FAST_PATH_CASES = {                   # (grad mode, self-attention, key padding mask dtype)
    "no_grad": (torch.no_grad, True, None), "inference_mode": (torch.inference_mode, True, None),
    "no_grad bool kpm": (torch.no_grad, True, torch.bool),
    "no_grad float kpm": (torch.no_grad, True, torch.float32),     # torch's slow path
    "no_grad cross": (torch.no_grad, False, None), "grad": (torch.enable_grad, True, None)}


@pytest.mark.parametrize("case", FAST_PATH_CASES)
@pytest.mark.parametrize("fastpath", [True, False])
def test_output_layout_follows_torchs_fused_inference_path(case, fastpath):
    """In eval, without gradients, torch's fused kernel returns a contiguous (N, L, E): so
    does ours, so ``out.view(N, -1)`` works on both; elsewhere both return a view."""
    mode, self_attention, kpm_dtype = FAST_PATH_CASES[case]
    t, ours = _pair(batch_first=True)
    g = torch.Generator().manual_seed(4)
    x, c = torch.randn(B, L, E, generator=g), torch.randn(B, L, E, generator=g)
    kv = x if self_attention else c
    kpm = None if kpm_dtype is None else torch.zeros(B, L, dtype=kpm_dtype)
    was = torch.backends.mha.get_fastpath_enabled()
    torch.backends.mha.set_fastpath_enabled(fastpath)
    try:
        with mode():
            want, got = (m(x, kv, kv, key_padding_mask=kpm)[0] for m in (t, ours))
    finally:
        torch.backends.mha.set_fastpath_enabled(was)
    fused = fastpath and case in ("no_grad", "inference_mode", "no_grad bool kpm")
    assert got.stride() == want.stride() and got.is_contiguous() == fused
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_output_layout_under_a_torch_function_mode_and_compile_is_torchs():
    """A TorchFunctionMode (``with torch.device(...)``) sends torch's module down its other
    path; a compiled one takes its fused kernel. A mask that is not a tensor is still named
    before the layout is decided."""
    t, ours = _pair(batch_first=True)
    x = torch.randn(B, L, E)
    with torch.no_grad():
        with torch.device("cpu"):
            assert ours(x, x, x)[0].stride() == t(x, x, x)[0].stride() != (L * E, E, 1)
        torch._dynamo.reset()
        want, got = (torch.compile(m, backend="aot_eager")(x, x, x)[0] for m in (t, ours))
        assert got.stride() == want.stride()
        with pytest.raises(TypeError, match="key_padding_mask must be a tensor or None, got list"):
            ours(x, x, x, key_padding_mask=[[False] * L] * B)


FLAGS = {"numpy True": "np.True_", "1": 1, "0": 0, "None": None, "tensor": "tensor"}


@pytest.mark.parametrize("flag", FLAGS)
@pytest.mark.parametrize("arg", ["need_weights", "average_attn_weights"])
def test_flags_are_read_by_their_truth_as_torch_reads_them(arg, flag):
    value = FLAGS[flag]
    if value == "np.True_":
        value = pytest.importorskip("numpy").True_
    elif value == "tensor":
        value = torch.tensor(True)
    t, ours = _pair()
    q, kv = _seq_first()
    want, got = t(q, kv, kv, **{arg: value}), ours(q, kv, kv, **{arg: value})
    torch.testing.assert_close(got[0], want[0], atol=1e-6, rtol=1e-5)
    assert (got[1] is None) == (want[1] is None)
    if want[1] is not None:
        torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("need_weights", [True, False])
def test_dropout_of_one_drops_everything_as_torch_does(need_weights):
    """Zeros whose gradients are zeros: every parameter gets a gradient, as torch's do
    (outputs made from nothing gave the input projection None, which an optimizer's weight
    decay skips)."""
    t, ours = (m.train() for m in _pair(dropout=1.0))
    q, kv = _seq_first()
    q.requires_grad_()
    want, got = t(q, kv, kv, need_weights=need_weights), ours(q, kv, kv, need_weights=need_weights)
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)      # the output bias alone
    if need_weights:
        torch.testing.assert_close(got[1], want[1], atol=0, rtol=0)    # zeros
    for m, out in ((t, want[0]), (ours, got[0])):
        out.sum().backward()
    for (name, a), b in zip(ours.named_parameters(), t.parameters()):
        assert a.grad is not None, name
        torch.testing.assert_close(a.grad, b.grad, atol=0, rtol=0)


@pytest.mark.parametrize("need_weights", [True, False])
def test_dropout_past_one_raises_torchs_type(need_weights):
    t, ours = (m.train() for m in _pair(dropout=1.5))
    q, kv = _seq_first()
    err = _torch_error(t, q, kv, kv, need_weights=need_weights)
    with pytest.raises(type(err), match="dropout probability has to be between 0 and 1"):
        ours(q, kv, kv, need_weights=need_weights)


@pytest.mark.parametrize("shape", [(B, H, L, L), (B, L + 1), (L,)], ids=["4-D", "kpm-wide", "1-D"])
def test_mask_shapes_refused_where_torchs_fused_kernel_runs_raise_its_runtime_error(shape):
    """Eval, no grad, batch_first self-attention: torch's fused kernel raises RuntimeError
    for these masks (its other path AssertionError); code catching RuntimeError keeps
    catching ours."""
    t, ours = _pair(batch_first=True)
    x = torch.randn(B, L, E)
    arg = "attn_mask" if len(shape) == 4 else "key_padding_mask"
    kw = {arg: torch.zeros(shape, dtype=torch.bool)}
    with torch.no_grad():
        want = type(_torch_error(t, x, x, x, **kw))
        assert want is RuntimeError
        with pytest.raises(want) as info:
            ours(x, x, x, **kw)
    assert isinstance(info.value, ValueError) and arg in str(info.value)


def test_out_proj_is_read_as_torch_reads_it_not_called():
    """torch reads out_proj.weight and .bias: its hooks never run. Ours called the module
    (a pre-hook doubled the output)."""
    t, ours = _pair()
    q, kv = _seq_first()
    for m in (t, ours):
        m.out_proj.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
    torch.testing.assert_close(ours(q, kv, kv)[0], t(q, kv, kv)[0], atol=1e-6, rtol=1e-6)


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore:torch.quantize_per_tensor")
def test_eager_static_quantization_names_what_it_did_to_the_drop_in():
    """prepare/convert swap torch's class by exact type: ours is left whole and only its
    out_proj is converted (a weight() method); the forward says so instead of failing in
    AttributeError: 'function' object has no attribute 'dtype'."""
    aq = torch.ao.quantization
    _, ours = _pair()
    net = nn.Sequential(aq.QuantStub(), ours).eval()
    net.qconfig = aq.get_default_qconfig("fbgemm")
    aq.prepare(net, inplace=True)
    q, _ = _seq_first()
    net[0](q)
    aq.convert(net, inplace=True)
    assert not isinstance(ours.out_proj.weight, torch.Tensor)
    with pytest.raises(RuntimeError, match=r"out_proj is a torch\.ao\.nn\.quantized.*Linear "
                                           r"whose weight is a method, not a tensor.*quantize a "
                                           r"torch\.nn\.MultiheadAttention holding these weights"):
        ours(q, q, q)


@pytest.mark.parametrize("dtype", [torch.int64, torch.bool, torch.complex64])
def test_a_query_of_a_dtype_no_module_takes_is_not_told_to_convert_the_module(dtype):
    """module.to(torch.int64) itself raises: the advice is to convert the query alone."""
    _, ours = _pair()
    q, _ = _seq_first()
    with pytest.raises(RuntimeError, match=r"pass query\.to\(torch\.float32\)$"):
        ours(q.to(dtype), q, q)


def test_per_sample_float_masks_under_vmap_and_fake_tensors_run_as_torchs():
    """A float mask was read for NaN when built: vmap over per-sample masks raised
    'data-dependent control flow' and FakeTensorMode a DataDependentOutputException."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    t, ours = _pair()
    g = torch.Generator().manual_seed(5)
    xs, masks, kpms = (torch.randn(4, L, E, generator=g), torch.randn(4, L, L, generator=g),
                       torch.randn(4, L, generator=g))
    for kw in ("attn_mask", "key_padding_mask"):
        per = masks if kw == "attn_mask" else kpms
        want, got = (torch.func.vmap(lambda a, m, mod=mod: mod(a, a, a, **{kw: m})[0])(xs, per)
                     for mod in (t, ours))
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.randn(L, B, E)
        assert ours(x, x, x, attn_mask=torch.randn(L, L))[0].shape == (L, B, E)
    with pytest.raises(ValueError, match="bias contains NaN or \\+inf"):     # read where it can be
        ours(xs[0], xs[0], xs[0], attn_mask=torch.full((L, L), float("nan")))


@pytest.mark.parametrize("mask", [None, mh.masks.causal()], ids=["none", "causal"])
def test_an_export_with_a_dynamic_length_runs_every_length_as_the_module_does(mask):
    """``auto``'s choice compared symbolic cost estimates, a guard on the length that
    torch.export refused ("Constraints violated (S)"); it now compares them at the traced
    sizes. The drop-in exports as torch.nn.MultiheadAttention does."""
    ours = mh.MultiHeadAttention(E, H).eval()
    dropin = mh.nn.MultiheadAttention(E, H, batch_first=True).eval()

    class Ours(nn.Module):
        def forward(self, x):
            return ours(x, mask=mask)

    class DropIn(nn.Module):
        def forward(self, x):
            causal = None if mask is None else \
                nn.Transformer.generate_square_subsequent_mask(x.shape[1])    # (S, S)
            return dropin(x, x, x, need_weights=False, attn_mask=causal,
                          is_causal=mask is not None)[0]
    S = torch.export.Dim("S", min=2, max=256)
    for module, plain in ((Ours(), Ours()), (DropIn(), DropIn())):
        exported = torch.export.export(module, (torch.randn(B, 6, E),),
                                       dynamic_shapes=({1: S},)).module()
        for n in (2, 37, 200):
            y = torch.randn(B, n, E)
            torch.testing.assert_close(exported(y), plain(y), atol=1e-6, rtol=1e-5)


def test_the_constructor_shows_torchs_signature():
    """Tools that read a constructor's signature (config instantiation, hyperparameter
    capture) see torch's parameters, not ``*args, **kwargs``."""
    import inspect
    assert inspect.signature(mh.nn.MultiheadAttention) == inspect.signature(nn.MultiheadAttention)
    bound = inspect.signature(mh.nn.MultiheadAttention).bind(E, H, batch_first=True, kdim=10)
    m = mh.nn.MultiheadAttention(*bound.args, **bound.kwargs)
    assert m.batch_first and m.kdim == 10 and not m._qkv_same_embed_dim

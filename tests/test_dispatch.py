"""backend="auto" picks the cheapest exact backend; explain() says why; dispatch verified by mock."""

import threading
from unittest import mock

import importlib.util

import pytest
import torch

import multihead as mh
from multihead.functional import registry
from multihead.functional._call import make_call
from conftest import oracle

M = mh.masks


def _qkv(S=256, H=4, Hkv=4, D=32, B=1, Sq=None):
    return (torch.randn(B, H, Sq or S, D), torch.randn(B, Hkv, S, D), torch.randn(B, Hkv, S, D))


CASES = [
    # (name, kwargs builder, expected backend)
    ("no mask", lambda: dict(), "sdpa"),
    ("causal", lambda: dict(mask=M.causal()), "sdpa"),
    ("weights", lambda: dict(mask=M.causal(), return_weights=True), "rows"),
    ("lse", lambda: dict(return_lse=True), "blocksparse"),
    ("sparse window", lambda: dict(mask=M.sliding_window(64), S=2048), "blocksparse"),
    ("packed documents", lambda: dict(mask=M.document(torch.arange(2048) // 128), S=2048), "varlen"),
    ("interleaved documents", lambda: dict(mask=M.document(torch.arange(2048) // 128 % 4), S=2048),
     "blocksparse"),
    ("dense random", lambda: dict(mask=M.dense(torch.rand(256, 256) > 0.5)), "sdpa"),
    ("window + dropout", lambda: dict(mask=M.sliding_window(64), S=2048, dropout_p=0.1), "sdpa"),
    ("decode step, causal", lambda: dict(mask=M.causal(), Sq=1), "sdpa"),
]


def test_weights_with_gradients_go_to_the_reference_and_padding_crops_rows():
    q, k, v = (t.requires_grad_() for t in _qkv(B=2))
    assert mh.explain(q, k, v, mask=M.causal(), return_weights=True).chosen == "reference"
    q, k, v = _qkv(B=2, S=512)
    e = mh.explain(q, k, v, mask=M.padding(torch.tensor([128, 512])), return_weights=True)
    assert e.chosen == "rows" and "62.5% of the keys" in str(e)


@pytest.mark.parametrize("name,build,expected", CASES, ids=[c[0] for c in CASES])
def test_auto_choice_and_actual_dispatch(name, build, expected):
    kw = build()
    S, Sq = kw.pop("S", 256), kw.pop("Sq", None)
    q, k, v = _qkv(S=S, Sq=Sq)
    assert mh.explain(q, k, v, **kw).chosen == expected
    ran = []
    for n, b in registry.all_backends().items():
        orig = b.run
        def spy(call, plan, _n=n, _orig=orig):
            ran.append(_n)
            return _orig(call, plan)
        mock.patch.object(b, "run", side_effect=spy).start()
    try:
        mh.attention(q, k, v, **kw)
    finally:
        mock.patch.stopall()
    assert ran == [expected]


def test_sdpa_uses_is_causal_only_when_aligned():
    q, k, v = _qkv(S=64)
    with mock.patch("torch.nn.functional.scaled_dot_product_attention",
                    wraps=torch.nn.functional.scaled_dot_product_attention) as f:
        mh.attention(q, k, v, mask=M.causal(), backend="sdpa")
        assert f.call_args.kwargs["is_causal"] and f.call_args.kwargs["attn_mask"] is None
        q2 = q[:, :, :10]
        mh.attention(q2, k, v, mask=M.causal(), backend="sdpa")   # Sq != Sk: lower-right
        assert not f.call_args.kwargs["is_causal"]
        assert f.call_args.kwargs["attn_mask"] is not None


@pytest.mark.parametrize("heads", [(4, 4), (8, 2)], ids=["MHA", "GQA folded"])
def test_sdpa_gets_a_key_padding_mask_as_one_row_it_broadcasts(heads):
    """A mask the same for every query (key padding) reaches SDPA as ``(B, 1, 1, Sk)``,
    which it broadcasts: expanded over the queries (a view) torch's CPU kernel ran 20%
    slower, and a GQA fold copied it G x Sq times. The rows that see nothing stay zeros."""
    H, Hkv = heads
    q, k, v = _qkv(B=3, S=8 if Hkv < H else 64, H=H, Hkv=Hkv)
    mask = M.padding(torch.tensor([64, 0, 9])) if Hkv == H else \
        M.padding(torch.tensor([8, 0, 5]))
    with mock.patch("torch.nn.functional.scaled_dot_product_attention",
                    wraps=torch.nn.functional.scaled_dot_product_attention) as f:
        out = mh.attention(q, k, v, mask=mask, backend="sdpa")
    assert f.call_args.kwargs["attn_mask"].shape == (3, 1, 1, k.shape[2])
    torch.testing.assert_close(out, oracle(q, k, v, mask).float(), atol=1e-5, rtol=1e-5)
    assert (out[1] == 0).all()


def test_sdpa_gqa_never_copies_kv():
    q, k, v = _qkv(S=64, H=8, Hkv=2)
    with mock.patch("torch.nn.functional.scaled_dot_product_attention",
                    wraps=torch.nn.functional.scaled_dot_product_attention) as f:
        mh.attention(q, k, v, backend="sdpa")
        args = f.call_args.args
        assert args[1] is k and args[2] is v                     # same tensors, not expanded
        assert args[0].shape == (1, 2, 4 * 64, 32)               # query heads folded in
        mh.attention(q, k, v, mask=M.causal(), backend="sdpa")   # is_causal: enable_gqa
        assert f.call_args.args[1] is k and f.call_args.kwargs["enable_gqa"]


@pytest.mark.parametrize("shape", [(64, 64), (2, 4, 64, 64), (2, 1, 1, 64)],
                         ids=["shared", "per-head", "per-key"])
def test_sdpa_takes_a_tensor_bias_as_it_is_while_no_row_is_minus_inf_everywhere(shape):
    """A float bias (torch's attn_mask) reached the kernel split into a predicate and a bias
    and joined again: passes over the whole grid and two fresh buffers, 4x SDPA's own time
    for 8 x 2048 x 2048 on a CPU (241 against 62 ms). While no row is -inf everywhere, the
    kernel reads the tensor itself (a copy of it where a backward keeps it, so that the
    tensor may be written before the backward runs); a row written to -inf in place is
    opened and zeroed."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 4, 64, 16, generator=g, dtype=torch.float64).requires_grad_()
               for _ in range(3))
    t = torch.randn(shape, generator=g, dtype=torch.float64)
    t = t.masked_fill(torch.rand(shape, generator=g) > 0.6, float("-inf"))
    t[..., 0] = 0.5                                  # every row has a key
    t.requires_grad_()
    mask = M.bias(t)
    shares = lambda sent: sent.untyped_storage().data_ptr() == t.untyped_storage().data_ptr()
    with mock.patch("torch.nn.functional.scaled_dot_product_attention",
                    wraps=torch.nn.functional.scaled_dot_product_attention) as f:
        with torch.no_grad():
            plain = mh.attention(q, k, v, mask=mask, backend="sdpa")
        assert shares(f.call_args.kwargs["attn_mask"])
        out = mh.attention(q, k, v, mask=mask, backend="sdpa")
        assert not shares(f.call_args.kwargs["attn_mask"])
    assert "bias tensor passed as it is" in mh.explain(q.detach(), k, v, mask=mask,
                                                       backend="sdpa").plan.note
    want = mh.attention(q, k, v, mask=mask, backend="reference")
    torch.testing.assert_close(plain, want.detach())
    torch.testing.assert_close(out, want)
    wanted = torch.autograd.grad(want.sum(), (q, k, v, t))
    with torch.no_grad():
        t.mul_(2.0)                                  # the next step's bias, before backward
    for got, ref in zip(torch.autograd.grad(out.sum(), (q, k, v, t)), wanted):
        torch.testing.assert_close(got, ref)
    with torch.no_grad():
        t[0] = float("-inf")                         # written in place: rows with no key
    out = mh.attention(q, k, v, mask=mask, backend="sdpa")
    empty = (out == 0).all(-1)
    assert not out.isnan().any() and empty.sum() == empty.numel() // (2 if t.dim() > 2 else 64)
    torch.testing.assert_close(out, mh.attention(q, k, v, mask=mask, backend="reference"))


def test_sdpa_opens_the_rows_of_a_joined_mask_only_where_one_allows_nothing():
    """A bias joined to key padding is built in one pass (the bias's tensor, -inf where the
    padding rules out); a host mask's rows are then read, and opened (and zeroed after the
    kernel) only where a row allows no key."""
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 32, 8, generator=g) for _ in range(3))
    t = torch.randn(2, 4, 32, 32, generator=g)
    for lengths in ([32, 20], [32, 0]):
        mask = M.bias(t) & M.padding(torch.tensor(lengths))
        with mock.patch("torch.nn.functional.scaled_dot_product_attention",
                        wraps=torch.nn.functional.scaled_dot_product_attention) as f:
            out = mh.attention(q, k, v, mask=mask, backend="sdpa")
        sent, form = f.call_args.kwargs["attn_mask"], mask.additive(32, 32)
        if lengths[1]:
            assert torch.equal(sent, form)
        else:
            assert torch.equal(sent[0], form[0]) and (sent[1] == 0).all() and \
                (out[1] == 0).all()
        torch.testing.assert_close(out, mh.attention(q, k, v, mask=mask, backend="reference"))


def test_sdpa_takes_a_dense_mask_as_it_is_while_every_row_allows_a_key():
    """Opening rows that allow nothing takes two passes over the grid and a buffer (180
    against SDPA's own 142 ms for 8 x 2048 x 2048 on a CPU): only a mask that may have
    such rows pays them."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, 4, 64, 16, generator=g) for _ in range(3))
    allowed = torch.rand(2, 4, 64, 64, generator=g) > 0.6
    allowed[..., 0] = True
    mask = M.dense(allowed)
    with mock.patch("torch.nn.functional.scaled_dot_product_attention",
                    wraps=torch.nn.functional.scaled_dot_product_attention) as f:
        out = mh.attention(q, k, v, mask=mask, backend="sdpa")
    assert f.call_args.kwargs["attn_mask"].data_ptr() == allowed.data_ptr()
    torch.testing.assert_close(out, mh.attention(q, k, v, mask=mask, backend="reference"))
    allowed[1, 2, 7] = False                          # written in place: a row with no key
    out = mh.attention(q, k, v, mask=mask, backend="sdpa")
    assert not out.isnan().any() and (out[1, 2, 7] == 0).all() and (out != 0).any(-1).sum() \
        == 2 * 4 * 64 - 1
    torch.testing.assert_close(out, mh.attention(q, k, v, mask=mask, backend="reference"))


def test_explain_report_lists_every_backend_with_a_reason():
    q, k, v = _qkv()
    rep = mh.explain(q, k, v, mask=M.causal(), return_weights=True)
    text = str(rep)
    assert "backend: rows" in text and "reference    est." in text
    assert "sdpa" in text and "cannot run: does not return attention weights" in text
    assert "blocksparse" in text and "reads the device back" not in text
    without = [b for b in registry.all_backends().values() if not b.capabilities.weights]
    assert {b.name for b in registry.all_backends().values()} - {b.name for b in without} \
        >= {"rows", "reference"}
    assert text.count("does not return attention weights") == len(without)
    rep = mh.explain(*_qkv(S=2048), mask=M.sliding_window(64))
    assert "computes" in str(rep) and "of the tiles" in str(rep)
    assert "est." in str(rep) and "device profile: cpu" in str(rep)


def test_explicit_backend_runs_even_if_not_cheapest():
    q, k, v = _qkv()
    assert mh.explain(q, k, v, backend="reference").chosen == "reference"
    assert "requested" in str(mh.explain(q, k, v, backend="reference"))


def test_open_mask_is_dropped():
    q, k, v = _qkv(Sq=1)
    rep = mh.explain(q, k, v, mask=M.causal())
    assert "allows every pair: dropped" in str(rep)


def test_backends_listing():
    extra = {"triton"} if importlib.util.find_spec("triton") else set()
    assert set(mh.backends()) == {"reference", "rows", "sdpa", "blocksparse", "varlen"} | extra


# -- decisions are cached, keyed by what fully determines them ----------------------------

class Band(M.Mask):
    """A user's own mask class: keys within ``width`` of the query (no cache_key: not shared)."""

    def __init__(self, width):
        self.width = width

    def _allowed(self, ix):
        return (ix.q - ix.k).abs() < self.width

    def _tile_bounds(self, tx):
        near = (tx.q0 - tx.k1 < self.width) & (tx.k0 - tx.q1 < self.width)
        inside = (tx.q1 - tx.k0 < self.width) & (tx.k1 - tx.q0 < self.width)
        return near, inside


def test_two_custom_masks_of_one_class_never_share_a_tile_map():
    """Review bug: a band of width 8 then one of width 300 on blocksparse gave a max error
    of 0.57, because tile maps were shared under describe() (the class name)."""
    q, k, v = _qkv(S=512, H=2, Hkv=2, D=16)
    for width in (8, 300, 8):
        out = mh.attention(q, k, v, mask=Band(width), backend="blocksparse")
        ref = mh.attention(q, k, v, mask=Band(width), backend="reference")
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


def test_a_mask_changed_in_place_is_planned_again():
    q, k, v = _qkv(S=256, H=2, Hkv=2, D=16)
    allowed = torch.zeros(256, 256, dtype=torch.bool)
    allowed[:, :64] = True
    mask = M.dense(allowed)
    first = mh.attention(q, k, v, mask=mask, backend="blocksparse")
    torch.testing.assert_close(first, mh.attention(q, k, v, mask=mask, backend="reference"))
    allowed[:, 128:] = True                      # in place: the tensor's version changes
    again = mh.attention(q, k, v, mask=mask, backend="blocksparse")
    torch.testing.assert_close(again, mh.attention(q, k, v, mask=mask, backend="reference"))
    assert not torch.allclose(first, again)


def _count_plans():
    """A list that gets the name of each backend that plans, from now until
    ``mock.patch.stopall()``."""
    calls = []
    for b in registry.all_backends().values():
        orig = b.plan
        mock.patch.object(b, "plan", side_effect=lambda c, p, _o=orig, _n=b.name:
                          calls.append(_n) or _o(c, p)).start()
    return calls


@pytest.mark.parametrize("mask", [None, M.causal(), M.sliding_window(32) & M.alibi(4),
                                  M.padding(torch.tensor([100]))],
                         ids=["none", "causal", "window&alibi", "padding"])
def test_a_repeated_call_is_not_planned_again(mask):
    q, k, v = _qkv(S=128)
    mh.functional.dispatch.clear_cache()
    calls = _count_plans()
    try:
        mh.attention(q, k, v, mask=mask)
        mh.attention(q, k, v, mask=mask)         # kept from its second time (keep_on_repeat)
        planned = len(calls)
        mh.attention(q, k, v, mask=mask)
        mh.attention(q + 1, k, v, mask=mask)     # other values, same shapes
        assert planned > 0 and len(calls) == planned
        mh.attention(q[:, :, :64], k, v, mask=mask)   # another shape: planned again
        assert len(calls) > planned
    finally:
        mock.patch.stopall()


def test_a_new_profile_drops_cached_decisions():
    q, k, v = _qkv(S=2048)
    mask = M.sliding_window(64)
    assert mh.explain(q, k, v, mask=mask).chosen == "blocksparse"
    mh.attention(q, k, v, mask=mask)
    ran = []
    sdpa = registry.get("sdpa")
    try:
        mh.functional.profiles.set_profile("cpu", "h100")      # price the CPU as an H100
        with mock.patch.object(sdpa, "run", side_effect=lambda c, p: ran.append(1) or
                               sdpa.__class__.run(sdpa, c, p)):
            mh.attention(q, k, v, mask=mask)
        assert ran == [1]
    finally:
        mh.functional.profiles.set_profile("cpu", None)


def test_bad_input_is_refused_also_after_a_cached_call():
    q, k, v = _qkv(S=64)
    mh.attention(q, k, v, mask=M.causal())
    with pytest.raises(ValueError, match="dropout_p"):
        mh.attention(q, k, v, mask=M.causal(), dropout_p=1.5)
    with pytest.raises(ValueError, match="dropout_p"):
        mh.attention(q, k, v, mask=M.causal(), dropout_p=True)
    with pytest.raises(TypeError, match="scale"):
        mh.attention(q, k, v, mask=M.causal(), scale="big")
    with pytest.raises(ValueError, match="head_dim"):
        mh.attention(q, k[..., :16], v, mask=M.causal())


def _transposed_layout(fn):
    """SDPA as CUDA's fp32 kernels return it: the same values in a (B, S, H, D) memory layout."""
    def sdpa(*args, **kwargs):
        out = fn(*args, **kwargs)                                        # (B, H, S, D)
        return out.transpose(1, 2).contiguous().transpose(1, 2)          # strides of (B, S, H, D)
    return sdpa


@pytest.mark.parametrize("mask", [None, M.padding(torch.tensor([50, 20])), M.sliding_window(9)],
                         ids=["none", "padding", "window"])
def test_sdpa_output_in_another_memory_layout(mask):
    """The fp32 GQA crash on CUDA ("view size is not compatible"), reproduced on the CPU."""
    q, k, v = torch.randn(2, 8, 50, 16), torch.randn(2, 2, 50, 16), torch.randn(2, 2, 50, 16)
    real = torch.nn.functional.scaled_dot_product_attention
    with mock.patch("torch.nn.functional.scaled_dot_product_attention", _transposed_layout(real)):
        out = mh.attention(q, k, v, mask=mask, backend="sdpa")
    torch.testing.assert_close(out, mh.attention(q, k, v, mask=mask, backend="reference"),
                               atol=1e-5, rtol=1e-5)


# -- what an adversarial pass found: every cached path must stay exactly right -------------

def _ref(q, k, v, mask):
    return mh.attention(q.double(), k.double(), v.double(), mask=mask, backend="reference")


def test_a_learned_bias_gets_its_gradient_after_a_no_grad_call():
    """Frozen q/k/v, trainable bias: a decision made under no_grad must not be reused."""
    q, k, v = _qkv(S=512, H=2, Hkv=2, D=16)
    w = torch.randn(1, 2, 512, 512)
    w[..., ::3] = float("-inf")
    w.requires_grad_()
    mask = M.bias(w) & M.sliding_window(64)
    with torch.no_grad():
        mh.attention(q, k, v, mask=mask)
    out = mh.attention(q, k, v, mask=mask)
    assert out.requires_grad
    (g,) = torch.autograd.grad(out.sum(), w)
    (want,) = torch.autograd.grad(mh.attention(q, k, v, mask=mask, backend="reference").sum(), w)
    torch.testing.assert_close(g, want, atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        mh.attention(q, k, v, mask=mask, backend="blocksparse")
    with pytest.raises(ValueError, match="no gradient w.r.t. a bias"):
        mh.attention(q, k, v, mask=mask, backend="blocksparse")


class Strided(M.Window):
    """A user's subclass of one of our masks: causal, every other key."""

    def __init__(self):
        super().__init__(None)

    def _allowed(self, ix):
        return super()._allowed(ix) & (ix.k % 2 == 0)

    def _tile_bounds(self, tx):
        any_, _ = super()._tile_bounds(tx)
        return any_, torch.zeros_like(any_)


def test_a_subclass_of_a_builtin_mask_is_a_mask_of_its_own():
    q, k, v = _qkv(S=128, H=2, Hkv=2, D=16)
    mh.attention(q, k, v, mask=M.causal())           # causal's decision and tile map cached
    mask = Strided()
    assert mask.cache_key() is None and mask.kind == "custom" and not mask.memoizable
    for backend in ("auto", "sdpa", "blocksparse"):
        torch.testing.assert_close(mh.attention(q, k, v, mask=mask, backend=backend).double(),
                                   _ref(q, k, v, mask), atol=1e-5, rtol=1e-5)


def test_masks_cannot_be_changed_behind_the_caches():
    window, alibi = M.sliding_window(8), M.alibi(4)
    with pytest.raises(AttributeError):
        window.size = 128
    with pytest.raises(AttributeError):
        alibi.num_heads = 8
    alibi.slopes.mul_(100)                           # a fresh tensor: the mask is unchanged
    q, k, v = _qkv(S=64)
    torch.testing.assert_close(mh.attention(q, k, v, mask=alibi),
                               mh.attention(q, k, v, mask=M.alibi(4)))
    lengths, ids = torch.tensor([40]), torch.arange(64) // 16
    pad, doc = M.padding(lengths), M.document(ids)
    before = [mh.attention(q, k, v, mask=m, backend=b) for m, b in ((pad, "sdpa"), (doc, "varlen"))]
    lengths[0], ids[:] = 3, ids.flip(0)              # the masks kept their own copies
    after = [mh.attention(q, k, v, mask=m, backend=b) for m, b in ((pad, "sdpa"), (doc, "varlen"))]
    for a, b in zip(before, after):
        torch.testing.assert_close(a, b)


def test_a_copied_mask_does_not_carry_stale_plans():
    import copy
    q, k, v = _qkv(S=256, H=2, Hkv=2, D=16)
    allowed = torch.rand(256, 256) > 0.7
    mask = M.dense(allowed)
    mh.attention(q, k, v, mask=mask, backend="blocksparse")
    allowed[:, :128] = False
    twin = copy.deepcopy(mask)
    torch.testing.assert_close(mh.attention(q, k, v, mask=twin, backend="blocksparse").double(),
                               _ref(q, k, v, twin), atol=1e-5, rtol=1e-5)


def test_a_bias_is_read_as_it_is_at_each_call():
    """A learned bias reused across steps: updated in place, gradients every step."""
    q, k, v = _qkv(S=64, H=2, Hkv=2, D=16)
    w = torch.nn.Parameter(torch.zeros(1, 2, 64, 64))
    mask = M.bias(w)
    for _ in range(2):
        out = mh.attention(q, k, v, mask=mask)
        torch.testing.assert_close(out.double(), _ref(q, k, v, M.bias(w.detach())),
                                   atol=1e-5, rtol=1e-5)
        out.sum().backward()
        assert w.grad is not None and torch.isfinite(w.grad).all()
        with torch.no_grad():
            w.add_(torch.randn_like(w))
            w[0, 0, 5] = float("-inf")               # a row that gains -inf everywhere
    with torch.no_grad():
        out = mh.attention(q, k, v, mask=mask, backend="blocksparse")
    assert (out[0, 0, 5] == 0).all()
    torch.testing.assert_close(out.double(), _ref(q, k, v, M.bias(w.detach())),
                               atol=1e-5, rtol=1e-5)


def test_half_precision_sdpa_keeps_a_large_fp32_bias_finite():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 16, 8, generator=g).half() for _ in range(3))
    b = torch.zeros(1, 1, 16, 16)
    b[0, 0, 3, 5] = 1e5                                # beyond fp16's range
    b[0, 0, 7] = torch.finfo(torch.float32).min        # Hugging Face's "masked" value
    got = mh.attention(q, k, v, mask=M.bias(b), backend="sdpa")
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got[:, :, 3], v[:, :, 5])        # the +1e5 key takes the row
    # the bias is added in fp32, as on every backend: fp32's min swamps row 7's scores
    # (uniform weights), and every row agrees with the fp64 oracle
    torch.testing.assert_close(got[:, :, 7], v.mean(2), atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(got.double(), _ref(q, k, v, M.bias(b)), atol=2e-3, rtol=2e-3)


def test_odd_arguments_get_the_same_clear_errors_on_every_path():
    q, k, v = _qkv(S=32)
    s = torch.tensor(0.25)
    mh.attention(q, k, v, scale=s)
    s.fill_(float("nan"))
    with pytest.raises(ValueError, match="scale must be finite"):
        mh.attention(q, k, v, scale=s)
    with pytest.raises(TypeError, match="scale must be a float.*bool"):
        mh.attention(q, k, v, scale=torch.tensor(True))
    with pytest.raises(TypeError, match="requires grad"):
        mh.attention(q, k, v, scale=torch.tensor(0.3, requires_grad=True))
    with pytest.raises(TypeError, match="return_weights must be True, False or \"mean\".*"
                                        "got 'no'"):
        mh.attention(q, k, v, return_weights="no")
    with pytest.raises(TypeError, match="return_weights must be True, False or \"mean\""):
        mh.attention(q, k, v, return_weights=1)
    with pytest.raises(ValueError, match="backend='sdpa' cannot run this call"):
        mh.attention(q[:, :, :0], k, v, backend="sdpa", return_weights=True)

    class Listy(M.Mask):
        def cache_key(self):
            return ["not", "hashable"]

        def _allowed(self, ix):
            return ix.q >= ix.k

        def _tile_bounds(self, tx):
            return tx.q1 >= tx.k0, tx.q0 >= tx.k1
    with pytest.raises(TypeError, match=r"Listy.cache_key\(\) must return a hashable value"):
        mh.attention(q, k, v, mask=Listy(), backend="blocksparse")


def test_a_decoding_loop_plans_only_the_backend_auto_chose():
    """The key length grows every step: the choice is kept per structure, and a plan that
    holds at any key length (SDPA's with no mask in effect) is reused within a doubling of
    it: the chosen backend plans once more, for the step that keeps it, then never."""
    q = torch.randn(1, 8, 1, 32)
    kv = torch.randn(1, 2, 300, 32)
    mh.functional.dispatch.clear_cache()
    calls = _count_plans()
    try:
        mh.attention(q, kv[:, :, :200], kv[:, :, :200], mask=M.causal())
        first = len(calls)
        for t in range(201, 256):                          # one power-of-two bucket
            mh.attention(q, kv[:, :, :t], kv[:, :, :t], mask=M.causal())
        assert first >= 3 and calls[first:] == ["sdpa"]
    finally:
        mock.patch.stopall()


@pytest.mark.parametrize("backend", ["auto", "sdpa"])
def test_a_plan_reused_across_key_lengths_gives_each_lengths_answer(backend):
    """Every step of a growing GQA decoding loop (folded query heads) against the fp64
    softmax of its own keys, over four doublings of the length."""
    torch.manual_seed(0)
    q, kv = torch.randn(2, 8, 1, 16), torch.randn(2, 2, 520, 16)
    mh.functional.dispatch.clear_cache()
    for t in range(60, 520, 7):
        got = mh.attention(q, kv[:, :, :t], kv[:, :, :t], mask=M.causal(), backend=backend)
        keys = kv[:, :, :t].double().repeat_interleave(4, 1)                   # (2, 8, t, 16)
        ref = torch.softmax(q.double() @ keys.transpose(-1, -2) / 4, -1) @ keys
        torch.testing.assert_close(got.double(), ref, atol=1e-6, rtol=1e-6)


def test_a_plan_shared_across_lengths_still_validates_and_spares_other_masks():
    """k and v of different lengths still get the named error after the lengths' shared
    plan is kept; a window (whose mask matters at some lengths only) plans every length."""
    q, kv = torch.randn(1, 4, 1, 8), torch.randn(1, 2, 90, 8)
    mh.functional.dispatch.clear_cache()
    for t in range(70, 80):
        mh.attention(q, kv[:, :, :t], kv[:, :, :t], mask=M.causal())
    with pytest.raises(ValueError, match=r"must agree on heads \(dim 1\) and"):
        mh.attention(q, kv[:, :, :81], kv[:, :, :82], mask=M.causal())
    calls = _count_plans()
    try:
        for t in range(70, 80):
            mh.attention(q, kv[:, :, :t], kv[:, :, :t], mask=M.sliding_window(75))
        assert calls.count("sdpa") >= 10
    finally:
        mock.patch.stopall()


@pytest.mark.parametrize("padded", ["kv_cache", "bias"])
def test_a_padded_cache_chooses_once_per_doubling(padded):
    """A padded cache's step carries a mask as long as its keys: the mask's structure held
    that exact length, so auto priced every backend again at every step (300 times in 300
    steps: two thirds of a step on our CPU)."""
    from multihead.functional import dispatch
    m = mh.MultiHeadAttention(32, 4, num_kv_heads=2, rope=mh.RotaryEmbedding(8)).eval()
    cache, x = m.make_cache(2, 200), torch.randn(2, 200, 32)
    dispatch.clear_cache()
    chose = []
    real = dispatch._choose
    with torch.no_grad(), mock.patch.object(dispatch, "_choose", side_effect=lambda *a: chose.append(
            1) or real(*a)):
        valid = torch.ones(2, 20, dtype=torch.bool)
        valid[0, :5] = False                              # a left-padded prompt
        m(x[:, :20], cache=cache, valid=valid, mask=M.causal())
        for t in range(20, 150):
            if padded == "kv_cache":
                m(x[:, t:t + 1], cache=cache, mask=M.causal())
            else:                                         # a bias as long as the keys
                mh.attention(torch.randn(2, 4, 1, 8), *(torch.randn(2, 2, t, 8),) * 2,
                             mask=M.bias(torch.zeros(2, 1, 1, t)))
    assert len(chose) == 5       # the prefill's, then one per key range: ..32, ..64, ..128, ..256


def test_a_growing_cache_pushes_no_kept_decision_out():
    """A decoding loop meets a new key length every step: its decisions, never reused, are
    not kept (1,024 of them used to push out every other call's), and a named backend
    plans itself alone (it used to plan all five to pick itself)."""
    from multihead.functional import dispatch
    q, kv = torch.randn(1, 8, 1, 16), torch.randn(1, 2, 1200, 16)
    dispatch.clear_cache()
    prefill = (q.expand(1, 8, 64, 16), kv[:, :, :64], kv[:, :, :64])
    for _ in range(2):
        mh.attention(*prefill, mask=M.causal(), backend="sdpa")
    kept = dict(dispatch._DECISIONS._data)
    assert len(kept) == 1
    calls = _count_plans()
    try:
        for t in range(65, 1200):
            out = mh.attention(q, kv[:, :, :t], kv[:, :, :t], mask=M.causal(), backend="sdpa")
        assert calls == ["sdpa"] * 10          # twice per doubling: 128, 256, 512, 1024, 2048
    finally:
        mock.patch.stopall()
    now = dict(dispatch._DECISIONS._data)     # one decision per doubling, shared by its lengths
    assert kept.items() <= now.items() and len(now) == len(kept) + 5
    last = kv[:, :, :1199].repeat_interleave(4, 1)                      # (1, 8, 1199, 16)
    ref = torch.softmax(q @ last.transpose(-1, -2) / 4, -1) @ last     # (1, 8, 1, 16)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    for _ in range(2):                       # a call met twice is kept
        mh.attention(q, kv, kv, mask=M.sliding_window(8), backend="sdpa")
    assert len(dispatch._DECISIONS) == len(now) + 1


def test_masked_gqa_folds_query_heads_only_when_decoding():
    """Folding copies a materialized mask once per query head of a group: worth it for a
    few queries (decoding), not for a prefill, where enable_gqa reads the mask as it is."""
    q, k, v = _qkv(S=256, H=8, Hkv=2, B=2)
    mask = M.padding(torch.tensor([100, 256])) & M.causal()
    assert "enable_gqa" in str(mh.explain(q, k, v, mask=mask, backend="sdpa"))
    assert "folded" in str(mh.explain(q[:, :, -1:], k, v, mask=mask, backend="sdpa"))


def _record(method: str) -> list:
    """The names of the backends whose ``method`` runs, in order, from now until
    ``mock.patch.stopall()`` (each backend's method still runs)."""
    names = []
    for b in registry.all_backends().values():
        mock.patch.object(b, method, side_effect=lambda c, p, _o=getattr(b, method), _n=b.name:
                          names.append(_n) or _o(c, p)).start()
    return names


def test_a_padded_caches_steps_share_autos_choice_and_plan_one_backend():
    """A padded cache's window is a new at_positions mask every step: its steps share auto's
    choice by the mask's structure, so after the first only the chosen backend plans (each
    step planned every backend, 0.5 ms of host time per step on an H100), and each equals
    fp64."""
    from multihead.masks.positioned import distances_in_tokens
    mh.functional.dispatch.clear_cache()
    planned = _record("plan")
    try:
        g = torch.Generator().manual_seed(3)
        valid = torch.arange(40) >= torch.tensor([[0], [9]])                     # (2, 40)
        for t in range(34, 38):                                  # (key lengths of one bucket)
            v_ = valid[:, :t].clone()
            v_[1, t - 2] = False                                 # a paused slot, each step
            mask = distances_in_tokens(M.causal() & M.sliding_window(6) & M.alibi(4), v_, 1) \
                & M.padding(v_)
            assert mask.structure() is not None
            q, k = torch.randn(2, 4, 1, 16, generator=g), torch.randn(2, 2, t, 16, generator=g)
            planned.clear()
            out = mh.attention(q, k, k, mask=mask)
            assert (len(set(planned)) == 1) == (t > 34), planned   # the first: all that can
            want = mh.attention(q.double(), k.double(), k.double(), mask=mask,
                                backend="reference")
            torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)
    finally:
        mock.patch.stopall()


def test_a_choice_one_calls_content_cannot_use_stays_for_the_calls_that_can():
    """Auto shares its choice among calls of one mask structure; varlen's, for documents,
    also needs the ids to be contiguous runs. A call whose ids are not runs runs another
    backend without replacing varlen's choice, and explain() says what it runs."""
    pytest.importorskip("multihead.functional.backend.varlen")
    q, k, v = _qkv(S=512, D=16)
    packed, interleaved = torch.arange(512) // 64, torch.arange(512) % 8     # 8 docs each
    mh.functional.dispatch.clear_cache()
    ran = _record("run")
    try:
        mh.attention(q, k, v, mask=M.document(packed))
        assert ran[-1] == "varlen"
        e = mh.explain(q, k, v, mask=M.document(interleaved))
        mh.attention(q, k, v, mask=M.document(interleaved))
        assert ran[-1] == e.chosen != "varlen" and e.reused is None and "note:" not in str(e)
        mh.attention(q, k, v, mask=M.document(packed))
        assert ran[-1] == "varlen"
    finally:
        mock.patch.stopall()


def test_a_new_thread_count_is_seen_by_the_next_call_and_explain_changes_nothing():
    """The CPU's profile follows torch.set_num_threads; a cached decision hid the change
    from attention() (which ran the 2-thread choice) until explain() was called."""
    q = torch.randn(1, 1, 128, 16)
    mask = M.alibi(1) & M.causal()
    threads = torch.get_num_threads()
    ran = _record("run")
    try:
        torch.set_num_threads(2)
        mh.functional.dispatch.clear_cache()
        for _ in range(2):
            mh.attention(q, q, q, mask=mask)                         # (the second: cached)
        two = ran[-1]
        torch.set_num_threads(1)
        mh.attention(q, q, q, mask=mask)
        e = mh.explain(q, q, q, mask=mask)
        mh.attention(q, q, q, mask=mask)
        mh.functional.dispatch.clear_cache()
        mh.attention(q, q, q, mask=mask)                   # what a fresh decision runs
        got, after, fresh = ran[-3:]
        assert got == after == fresh == (e.reused or e.chosen), (two, ran)
    finally:
        torch.set_num_threads(threads)
        mock.patch.stopall()


@pytest.mark.parametrize("mask", [M.padding(torch.tensor([10, 10])), M.sliding_window(8)],
                         ids=["kept on the mask", "kept for the exact call"])
def test_explain_names_a_kept_plan_and_clear_cache_forgets_it(mask):
    """A plan kept on a mask that holds tensors (or for an int mask's exact call) runs again
    after auto's choice for the call's structure is forgotten: explain() names it as
    chosen, with auto's fresh choice beside it, and clear_cache() makes the next call
    decide afresh."""
    dispatch = mh.functional.dispatch
    q = torch.randn(2, 4, 512, 16)
    dispatch.clear_cache()
    fresh = mh.explain(q, q, q, mask=mask).chosen
    other = next(n for n in ("sdpa", "reference") if n != fresh)
    call = make_call(q, q, q, mask=mask, scale=None, dropout_p=0.0, return_weights=False,
                     return_lse=False)
    dispatch._CHOICES.put(dispatch._structure(call), other)
    ran = _record("run")
    try:
        for _ in range(2):                              # (a plan is kept from the second)
            mh.attention(q, q, q, mask=mask)
        dispatch._CHOICES.clear()                       # (evicted, say)
        e = mh.explain(q, q, q, mask=mask)
        mh.attention(q, q, q, mask=mask)
        assert ran == [other] * 3 and (e.chosen, e.reused, e.fresh) == (other, other, fresh)
        assert f"backend: {other} (auto's earlier choice, kept; chosen afresh: {fresh})" in str(e)
        assert f" * {other} " in str(e) and f" * {fresh} " not in str(e)
        dispatch.clear_cache()
        e = mh.explain(q, q, q, mask=mask)
        mh.attention(q, q, q, mask=mask)
        assert ran[-1] == e.chosen == fresh and e.fresh is None and e.reused is None
        assert "note: attention() runs" not in str(e)
    finally:
        mock.patch.stopall()


def test_explain_with_this_machines_profile_named_says_what_runs():
    """profile="cpu" on CPU inputs is auto's own profile: explain() names auto's earlier
    choice for the structure (reused), as it does with no profile given."""
    w = M.sliding_window(32)
    x, y = torch.randn(1, 1, 513, 16), torch.randn(1, 1, 1024, 16)
    mh.functional.dispatch.clear_cache()
    mh.attention(x, x, x, mask=w)
    plain, named = (mh.explain(y, y, y, mask=w, profile=p) for p in (None, "cpu"))
    assert (plain.chosen, plain.reused) == (named.chosen, named.reused)
    assert named.profile is mh.profiles.profile_for(y.device)
    assert mh.explain(y, y, y, mask=w, profile="h100").reused is None     # (other figures)


@pytest.mark.parametrize("dynamic", [None, True])
def test_compiled_attention_follows_changing_head_counts(dynamic):
    """Heads that change between calls become symbolic: the fused kernel's GQA flag must
    still be a plain bool (MHA, GQA and MQA in one compiled function)."""
    torch._dynamo.reset()
    f = torch.compile(mh.attention, backend="eager", fullgraph=True, dynamic=dynamic)
    g = torch.Generator().manual_seed(5)
    for H, Hkv in ((4, 4), (8, 2), (2, 1)):
        q = torch.randn(2, H, 16, 8, generator=g)
        k, v = (torch.randn(2, Hkv, 16, 8, generator=g) for _ in range(2))
        for mask in (None, mh.masks.causal()):
            torch.testing.assert_close(f(q, k, v, mask=mask),
                                       mh.attention(q, k, v, mask=mask, backend="reference"))


@pytest.mark.parametrize("mask", [None, M.causal(), M.sliding_window(8)],
                         ids=["none", "causal", "window"])
def test_a_scale_passed_into_a_compiled_function_is_traced(mask):
    """With ``dynamic=True`` torch.compile traces a float argument as a symbol: the
    scale's check compares it (a guard) instead of calling math.isfinite on it, which
    Dynamo cannot trace (a fullgraph error before)."""
    torch._dynamo.reset()
    f = torch.compile(lambda q, s: mh.attention(q, q, q, mask=mask, scale=s), dynamic=True,
                      fullgraph=True, backend="eager")
    g = torch.Generator().manual_seed(10)
    for S, scale in ((16, 0.3), (70, 1.7)):
        q = torch.randn(1, 2, S, 8, dtype=torch.float64, generator=g, requires_grad=True)
        got, want = f(q, scale), mh.attention(q, q, q, mask=mask, scale=scale,
                                             backend="reference")
        torch.testing.assert_close(got, want)
        torch.testing.assert_close(*(torch.autograd.grad(t.pow(2).sum(), q)[0]
                                     for t in (got, want)))
    for bad in (float("nan"), float("inf"), 0.0, -1.0):
        with pytest.raises(ValueError, match="scale must be finite and > 0"):
            mh.attention(q, q, q, scale=bad)


def test_eager_calls_between_compiled_ones_do_not_recompile_them():
    """One graph serves every length and window (dynamic=True), however many eager calls of
    the same function come between compiled ones: what an eager call caches (the device's
    profile, decisions) is not something the graph guards on."""
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    mh.functional.profiles._RESOLVED.clear()        # as in a fresh process: nothing priced

    def f(q, k, v, w):
        return mh.attention(q, k, v, mask=M.sliding_window(w) & M.causal())
    graphs = CompileCounter()
    compiled = torch.compile(f, backend=graphs, dynamic=True)
    g = torch.Generator().manual_seed(8)
    for S, w in ((40, 8), (64, 16), (100, 5), (130, 64), (33, 40)):
        q, k, v = (torch.randn(2, 4, S, 16, generator=g) for _ in range(3))
        got = compiled(q, k, v, w)
        torch.testing.assert_close(got, f(q, k, v, w))
        torch.testing.assert_close(got, mh.attention(q, k, v, backend="reference",
                                                     mask=M.sliding_window(w) & M.causal()))
    assert graphs.frame_count == 1


@pytest.mark.parametrize("mask", [None, M.sliding_window(64), M.document(torch.arange(600) // 100)])
def test_an_explanation_can_be_copied_and_saved(mask):
    """Its plans hold caches (with locks): copies and pickles carry them empty."""
    import copy
    import pickle
    q = torch.randn(1, 2, 600, 16)
    e = mh.explain(q, q, q, mask=mask, backend="blocksparse")
    for twin in (pickle.loads(pickle.dumps(e)), copy.deepcopy(e)):
        assert str(twin) == str(e) and twin.chosen == "blocksparse"


@pytest.mark.parametrize("backend", ["auto", "reference", "sdpa", "blocksparse", "rows"])
def test_autocast_computes_float32_inputs_in_its_dtype_on_every_backend(backend):
    """As torch's F.scaled_dot_product_attention under autocast: bfloat16 in, bfloat16 out,
    on every backend alike; float32 gradients reach float32 leaves; nothing changes outside."""
    g = torch.Generator().manual_seed(6)
    q = torch.randn(2, 4, 40, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 40, 16, generator=g) for _ in range(2))
    mask = M.causal()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True,
                                                                enable_gqa=True)
        grad_free = backend == "rows"                            # (rows: inference only)
        out = mh.attention(q.detach() if grad_free else q, k, v, mask=mask, backend=backend)
        assert "bfloat16" in str(mh.explain(q, k, v, mask=mask))
    assert out.dtype == want.dtype == torch.bfloat16
    exact = mh.attention(q.double(), k.double(), v.double(), mask=mask)
    assert (out.double() - exact).abs().max() <= 2 * (want.double() - exact).abs().max() + 1e-3
    if not grad_free:
        out.float().sum().backward()
        assert q.grad.dtype == torch.float32 and q.grad.isfinite().all()
    assert mh.attention(q.detach(), k, v, mask=mask, backend=backend).dtype == torch.float32


@pytest.mark.parametrize("mask", ["causal", "window", "window & padding"])
@pytest.mark.parametrize("backend", ["reference", "sdpa", "blocksparse"])
def test_a_backward_inside_autocast_gives_the_gradients_of_one_after_it(backend, mask):
    """Training loops often call .backward() inside the autocast region. Our backward then
    runs as the forward did, with autocast off: the same gradients, bit for bit, as a
    backward after the region (blocksparse raised index_add_'s dtype error there, and the
    reference's products were recast to bfloat16)."""
    m = {"causal": M.causal(), "window": M.sliding_window(24),
         "window & padding": M.sliding_window(24) & M.padding(torch.tensor([70, 150]))}[mask]
    inside, after = (_autocast_grads(lambda q, k, v: mh.attention(q, k, v, mask=m, backend=backend),
                                     within) for within in (True, False))
    for a, b in zip(inside, after):
        assert a.dtype == torch.float32 and a.isfinite().all()
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _autocast_grads(fn, inside: bool):
    """q, k, v's gradients of ``fn`` called under bfloat16 autocast, its backward inside
    the region or after it."""
    g = torch.Generator().manual_seed(9)
    q = torch.randn(2, 4, 150, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 150, 16, generator=g, requires_grad=True) for _ in range(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = fn(q, k, v).float().square().sum()
        if inside:
            loss.backward()
    if not inside:
        loss.backward()
    return [t.grad for t in (q, k, v)]


@pytest.mark.parametrize("backend", ["reference", "blocksparse"])
def test_a_compiled_backward_under_autocast_computes_as_the_eager_one(backend):
    """Compiled, the backward is traced while the forward's autocast is off but runs under
    the caller's: it recast the reference's products to bfloat16 (gradients 0.016 off the
    eager ones, whether .backward() ran inside the region or after it)."""
    def fn(q, k, v):
        return mh.attention(q, k, v, mask=M.sliding_window(24), backend=backend)
    want = _autocast_grads(fn, inside=False)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    for inside in (True, False):
        for a, b in zip(_autocast_grads(compiled, inside), want):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_autocast_casts_mixed_half_and_float_inputs_as_torch_does():
    """float32 q with float16 k/v under bfloat16 autocast: torch casts all three; so do we
    (no "q, k, v must share a dtype" about a dtype the caller never passed)."""
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 2, 8, 16, generator=g)
    k, v = (torch.randn(1, 2, 8, 16, generator=g).half() for _ in range(2))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        out = mh.attention(q, k, v)
        doubles = mh.attention(q.double(), k.double(), v.double())       # float64 stays
    assert out.dtype == want.dtype == torch.bfloat16 and doubles.dtype == torch.float64
    torch.testing.assert_close(out, want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("case", ["plain", "dropout", "dv", "stride", "stride-gqa"])
def test_sdpa_says_which_kernel_torch_runs_on_the_cpu(case):
    """torch's CPU flash kernel takes no dropout, no Dv != D and no last dim of stride != 1:
    it runs its unfused math path, which explain() called 'the fused kernel' (0 bytes of
    scores; 128 GiB for S=32768 with dropout). The profiler names the kernel that ran."""
    from torch.profiler import profile
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 32, 16, generator=g) for _ in range(3))
    if case == "stride-gqa":                  # (its q folded into a copy: flash runs)
        q = torch.randn(1, 4, 32, 16, generator=g)
    kw = {}
    if case == "dropout":
        kw["dropout_p"] = 0.1
    elif case == "dv":
        v = v[..., :8].contiguous()
    elif case.startswith("stride"):
        q = q.transpose(-1, -2).contiguous().transpose(-1, -2)              # stride(-1) = 32
    mask = None if case == "stride-gqa" else M.causal()      # (no mask: the heads fold)
    plan = mh.explain(q, k, v, mask=mask, backend="sdpa", **kw).plan
    with profile() as prof:
        mh.attention(q, k, v, mask=mask, backend="sdpa", **kw)
    ran = {e.name for e in prof.events()}
    math = "aten::_scaled_dot_product_attention_math" in ran
    assert math != ("aten::_scaled_dot_product_flash_attention_for_cpu" in ran)
    assert math == (case != "plain") if case != "stride-gqa" else math != plan.detail.fold
    assert ("torch runs its unfused math path" in plan.note) == math, plan.note


def test_a_backend_refusing_at_positions_names_it():
    """at_positions masks are of kind "custom": the refusal said "does not apply custom
    masks" of a padded cache's window, a mask the user never wrote."""
    q, k = torch.randn(2, 4, 8, 16), torch.randn(2, 4, 12, 16)
    m = M.at_positions(M.sliding_window(4), torch.arange(8).expand(2, 8) + 4,
                       torch.arange(12).expand(2, 12))
    text = str(mh.explain(q, k, k, mask=m))
    assert "does not apply at_positions masks (a padded KV cache puts a window" in text
    assert "custom masks" not in text


def test_blocksparse_keeps_its_host_scratch_between_calls_and_returns_none_of_it():
    """A step's scratch buffers of a few MiB were mapped fresh by glibc on every call and
    page-faulted as written (a 64-key window over 2048 tokens: 22.5 against 10.5 ms kept).
    A thread keeps its workspace per dtype; results never live in it; a call made while it
    is in use (here: inside a backward) gets its own; inference mode and autograd share it."""
    from multihead.functional.backend import blocksparse as bs
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 4, 300, 16, generator=g, requires_grad=True) for _ in range(3))
    mask = M.sliding_window(40)
    want = mh.attention(q, k, v, mask=mask, backend="reference")
    mh.functional.dispatch.clear_cache()                             # (frees kept scratch)
    assert not getattr(bs._KEPT, "by_dtype", {})
    first = mh.attention(q, k, v, mask=mask, backend="blocksparse")
    kept = bs._KEPT.by_dtype[torch.float32]
    buffers = {n: b.data_ptr() for n, b in kept.bufs.items()}
    assert buffers and kept.nbytes <= bs.KEEP_BYTES
    with torch.inference_mode():
        again = mh.attention(q, k, v, mask=mask, backend="blocksparse")
    second = mh.attention(q, k, v, mask=mask, backend="blocksparse")
    assert bs._KEPT.by_dtype[torch.float32] is kept
    assert {n: kept.bufs[n].data_ptr() for n in buffers} == buffers       # written in place
    for out in (first, again, second):
        assert all(out.untyped_storage().data_ptr() != b.untyped_storage().data_ptr()
                   for b in kept.bufs.values())
        torch.testing.assert_close(out, want)
    grads = torch.autograd.grad(second.square().sum(), (q, k, v))
    for got, ref in zip(grads, torch.autograd.grad(want.square().sum(), (q, k, v))):
        torch.testing.assert_close(got, ref)
    assert bs._KEPT.by_dtype[torch.float32] is kept
    with bs._workspace(q) as taken:                  # in use: a call meanwhile gets its own
        assert taken is kept and torch.float32 not in bs._KEPT.by_dtype
        inner = mh.attention(q, k, v, mask=mask, backend="blocksparse")
        assert bs._KEPT.by_dtype[torch.float32] is not kept
        assert {n: kept.bufs[n].data_ptr() for n in buffers} == buffers
    assert bs._KEPT.by_dtype[torch.float32] is kept
    torch.testing.assert_close(inner, want)
    done = []                                        # another thread's scratch is freed too
    worker = threading.Thread(target=lambda: done.append(
        mh.attention(q.detach(), k.detach(), v.detach(), mask=mask, backend="blocksparse")))
    worker.start()
    worker.join()
    assert len(bs._EVERY_KEPT) >= 1 and any(len(d) for d in bs._EVERY_KEPT)
    mh.functional.dispatch.clear_cache()
    assert not any(len(d) for d in bs._EVERY_KEPT) and not bs._KEPT.by_dtype

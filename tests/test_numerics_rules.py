"""One numerical semantics on every backend.

- Biases are added in fp32 (at the bias's own precision) whatever the inputs' dtype: a
  backend whose kernel adds them in fp16/bf16 must not be less accurate for it.
- A bias of ``finfo(dtype).min`` is a (very negative) number, not a mask: every backend
  adds it as fp32 arithmetic says (a row of it is a shift that softmax ignores, or swamps
  the scores: uniform weights); only ``-inf`` masks.
- Masked keys and values never influence a row, however non-finite; a row that may attend
  to a non-finite query, key or value is all NaN; a row with nothing to attend to is zeros.
"""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from conftest import ALL_BACKENDS, oracle, skip_unless_runs

M = mh.masks
HALF = [torch.float16, torch.bfloat16]
BACKENDS = ["reference", "sdpa", "blocksparse"]


def _qkv(B=2, H=4, S=64, D=32, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, D, generator=g).to(dtype) for _ in range(3)]


def _err(x, ref):
    return (x.double() - ref).abs().max().item()


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("name", ["bias N(0, 20)", "bias N(0, 20) & causal", "alibi"])
def test_a_float32_bias_costs_no_backend_accuracy_in_half_precision(dtype, name):
    """sdpa used to round an fp32 bias to bf16 first: 15x the reference's error (0.23)."""
    q, k, v = _qkv(S=128)
    g = torch.Generator().manual_seed(3)
    b = torch.randn(1, 4, 128, 128, generator=g) * 20
    mask = {"bias N(0, 20)": M.bias(b), "bias N(0, 20) & causal": M.bias(b) & M.causal(),
            "alibi": M.alibi(4)}[name]
    ref = oracle(q, k, v, mask)
    qh, kh, vh = q.to(dtype), k.to(dtype), v.to(dtype)
    errs = {be: _err(mh.attention(qh, kh, vh, mask=mask, backend=be), ref) for be in BACKENDS}
    floor = _err(qh.double(), q.double()) / 4            # the inputs' own rounding, scaled
    for be, e in errs.items():
        assert e <= 1.5 * errs["reference"] + floor, errs


@pytest.mark.parametrize("dtype", HALF + [torch.float32], ids=["fp16", "bf16", "fp32"])
def test_finfo_min_is_a_number_and_large_biases_stay_finite(dtype):
    q, k, v = _qkv(B=1, H=2, S=8, D=16, dtype=dtype)
    b = torch.zeros(1, 2, 8, 8)
    b[0, 0, 3] = torch.finfo(dtype).min                        # Hugging Face's "masked"
    b[0, 1, 5, 2] = 1e5                                        # beyond fp16's range
    outs = {be: mh.attention(q, k, v, mask=M.bias(b), backend=be) for be in BACKENDS}   # fp32
    ref = oracle(q, k, v, M.bias(b))         # fp16's min shifts a row (softmax ignores it);
    for be, out in outs.items():             # bf16's and fp32's swamp the scores: uniform
        assert torch.isfinite(out).all(), be
        torch.testing.assert_close(out[0, 0, 3].double(), ref[0, 0, 3], atol=2e-2, rtol=0)
        torch.testing.assert_close(out[0, 1, 5].float(), v[0, 1, 2].float(), atol=2e-2, rtol=0)
    for be in BACKENDS[1:]:
        torch.testing.assert_close(outs[be].float(), outs["reference"].float(),
                                   atol=3e-2 if dtype == torch.bfloat16 else 4e-3, rtol=0)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_a_float64_bias_past_float32s_range_is_a_number_on_float32_scores(backend):
    """-1e39 is finite in float64; added to float32 scores it saturates at float32's most
    negative number on every backend (a row of it is uniform, as finfo.min's is), never
    -inf, which would mask the row and return zeros on some backends."""
    q, k, v = _qkv(B=1, H=2, S=8, D=16)
    b = torch.zeros(1, 2, 8, 8, dtype=torch.float64)
    b[0, 0, 0] = -1e39                                         # a whole row
    b[0, 1, 4, :3] = -1e39                                     # part of one
    skip_unless_runs(backend, q, k, v, mask=M.bias(b))
    out = mh.attention(q, k, v, mask=M.bias(b), backend=backend)
    most = torch.finfo(torch.float32).max
    want = mh.attention(q, k, v, mask=M.bias(b.clamp(min=-most).float()), backend="reference")
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(out[0, 0, 0], v[0, 0].mean(0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("sign", [1, -1])
@pytest.mark.parametrize("backend", BACKENDS)
def test_an_infinite_key_makes_nan_every_row_that_sees_it_in_half_precision(backend, sign,
                                                                            dtype):
    """torch's fused CPU kernel turns a +inf score into finite values in half precision
    (neither the row's NaN nor the key's value): the rule's check reads k there."""
    q, k, v = _qkv(B=1, H=2, S=64, D=16, dtype=dtype)
    k[0, 1, 2, 3] = sign * float("inf")
    out = mh.attention(q, k, v, mask=M.causal(), backend=backend)
    sees = torch.zeros(1, 2, 64, dtype=torch.bool)
    sees[0, 1, 2:] = True                                      # head 1, rows from 2 on
    assert out[sees].isnan().all() and torch.isfinite(out[~sees]).all()
    ref = oracle(q, k.nan_to_num(posinf=0.0, neginf=0.0), v, M.causal())
    torch.testing.assert_close(out[~sees].double(), ref[~sees], atol=2e-2, rtol=0)


def _masks(S):
    return {
        "none": None,
        "causal": M.causal(),
        "padding": M.padding(torch.tensor([S - 3, S])),
        "window": M.sliding_window(3),
        "document": M.document(torch.tensor([[0] * 3 + [1] * (S - 5) + [2] * 2] * 2)),
        "bias": M.bias(torch.randn(1, 1, S, S, generator=torch.Generator().manual_seed(1))),
        "causal&padding": M.causal() & M.padding(torch.tensor([S - 3, S - 1])),
    }


def _expected(q, k, v, mask):
    """The rule, written out: the oracle on finite inputs, NaN where a row sees a bad one."""
    S = q.shape[2]
    allowed = torch.ones(1, 1, S, S, dtype=torch.bool) if mask is None \
        else mask.materialize(S, S).expand(q.shape[0], q.shape[1], S, S)
    bad_q = ~torch.isfinite(q).all(-1)                                      # (B, H, Sq)
    bad_kv = ~(torch.isfinite(k).all(-1) & torch.isfinite(v).all(-1))      # (B, H, Sk)
    clean = [t.nan_to_num(0.0, 0.0, 0.0) for t in (q, k, v)]
    out = oracle(*clean, mask)
    rows = ((allowed & bad_kv[:, :, None]).any(-1) | (bad_q & allowed.any(-1)))
    return out.masked_fill(rows[..., None], float("nan")), rows


@pytest.mark.parametrize("mask_name", list(_masks(12)))
@pytest.mark.parametrize("where", ["q", "k", "v", "hidden k", "hidden v"])
@pytest.mark.parametrize("value", [float("nan"), float("inf")], ids=["nan", "inf"])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_non_finite_inputs_follow_one_rule_on_every_backend(backend, value, where, mask_name):
    S = 12
    q, k, v = _qkv(B=2, H=2, S=S, D=8, seed=4)
    mask = _masks(S)[mask_name]
    try:
        mh.explain(q, k, v, mask=mask, backend=backend)
    except ValueError:
        pytest.skip(f"{backend} does not run {mask_name}")
    if where == "q":
        q[0, 1, 4, 2] = value
    elif where in ("k", "v"):
        (k if where == "k" else v)[1, 0, 1, 3] = value          # key 1: seen by most rows
    else:                                   # keys hidden from every row of batch 0 (padding)
        if mask_name not in ("padding", "causal&padding"):
            pytest.skip("only padding hides keys from every row")
        (k if where == "hidden k" else v)[0, :, S - 1] = value
    want, rows = _expected(q, k, v, mask)
    got = mh.attention(q, k, v, mask=mask, backend=backend)
    assert torch.equal(got.isnan(), want.isnan()), (backend, got.isnan().any(-1))
    ok = ~rows[..., None].expand_as(got)
    torch.testing.assert_close(got[ok], want[ok].float(), atol=1e-5, rtol=1e-5)
    if where.startswith("hidden"):
        assert not got.isnan().any()                              # masked: no influence


def test_a_nan_query_is_nan_not_zeros_on_sdpa():
    """torch's CPU flash kernel returns zeros for a NaN query row; the reference NaN."""
    q, k, v = _qkv(B=1, H=1, S=4, D=8)
    q[0, 0, 2, 0] = float("nan")
    out = mh.attention(q, k, v, backend="sdpa")
    assert out[0, 0, 2].isnan().all() and not out[0, 0, [0, 1, 3]].isnan().any()


def test_a_row_with_nothing_to_attend_to_stays_zeros_even_with_a_nan_query():
    q, k, v = _qkv(B=1, H=1, S=4, D=8)
    q[0, 0, 0, 0] = float("nan")
    pad = M.padding(torch.tensor([2]), side="query") & M.padding(torch.tensor([3]))
    for be in BACKENDS:
        out = mh.attention(q, k, v, mask=~M.dense(torch.eye(4, dtype=torch.bool)
                                                  .roll(0)[None, None]) & pad, backend=be)
        assert out[0, 0, 2:].eq(0).all()          # padded queries: zeros
        assert out[0, 0, 0].isnan().all()        # a NaN query that sees keys: NaN


# -- the careful path: what it costs and what it keeps ---------------------------------------
def test_finite_half_precision_inputs_whose_sums_overflow_run_once(monkeypatch):
    """A finite fp16 q of large values overflowed the check's fp16 sum: a second run."""
    from multihead.functional import registry
    q, k, v = _qkv(B=1, H=2, S=64, D=32, dtype=torch.float16)
    q = q * 2000                                   # finite; its fp16 sum is not
    assert torch.isinf(q.sum()) and torch.isfinite(q).all()
    runs = []
    sdpa = registry.get("sdpa")
    real = type(sdpa).run
    monkeypatch.setattr(type(sdpa), "run", lambda self, c, p: runs.append(1) or real(self, c, p))
    mh.attention(q, k, v, backend="sdpa")
    assert len(runs) == 1


def test_the_careful_path_works_in_chunks_of_rows(monkeypatch):
    """One NaN used to build (B, H, Sq, Sk) booleans at once (3.3 GB at S=16384)."""
    from multihead.functional import nonfinite
    q, k, v = _qkv(B=2, H=2, S=12, D=8, seed=4)
    v[1, 0, 1, 3] = float("nan")
    mask = M.causal() & M.padding(torch.tensor([9, 12]))
    whole = nonfinite.poisoned_rows(mh.functional._call.make_call(
        q, k, v, mask=mask, scale=None, dropout_p=0.0, return_weights=False, return_lse=False))
    monkeypatch.setattr(nonfinite, "_CHUNK_ELEMS", 30)          # a few rows per chunk
    want, _ = _expected(q, k, v, mask)
    for be in BACKENDS:
        got = mh.attention(q, k, v, mask=mask, backend=be)
        assert torch.equal(got.isnan(), want.isnan()), be
    assert torch.equal(whole, want.isnan().all(-1))


@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_a_hidden_nan_does_not_change_dropout(backend):
    """The careful path ran the call again with fresh dropout draws."""
    q, k, v = _qkv(B=2, H=2, S=12, D=8, seed=5)
    pad = M.padding(torch.tensor([9, 12]))
    torch.manual_seed(7)
    clean = mh.attention(q, k, v, mask=pad, dropout_p=0.3, backend=backend)
    after_clean = torch.rand(3)
    v[0, :, 10] = float("nan")                                 # hidden by the padding
    torch.manual_seed(7)
    poisoned = mh.attention(q, k, v, mask=pad, dropout_p=0.3, backend=backend)
    torch.testing.assert_close(poisoned, clean)
    assert torch.equal(torch.rand(3), after_clean)             # the stream moved the same


def test_vmap_over_attention_still_works():
    q, k, v = (torch.randn(3, 1, 2, 4, 8) for _ in range(3))
    out = torch.func.vmap(lambda a, b, c: mh.attention(a, b, c, mask=M.causal()))(q, k, v)
    torch.testing.assert_close(out[1], mh.attention(q[1], k[1], v[1], mask=M.causal()))


def test_a_minus_inf_key_score_hides_that_key_as_a_minus_inf_bias_does():
    """IEEE arithmetic: a score of -inf gives weight 0 (documented, not a NaN row)."""
    q, k, v = _qkv(B=1, H=1, S=4, D=8)
    q = q.abs() + 0.1                                          # every component positive
    k[0, 0, 2, 0] = float("-inf")                              # score of key 2: -inf
    hide = torch.zeros(1, 1, 4, 4)
    hide[..., 2] = float("-inf")
    k_clean = k.clone()
    k_clean[0, 0, 2, 0] = 0.0
    for be in BACKENDS:
        got = mh.attention(q, k, v, backend=be)
        torch.testing.assert_close(got, mh.attention(q, k_clean, v, mask=M.bias(hide),
                                                     backend="reference"))
        # the same with gradients (a training call that reads k for q's gradient)
        trained = mh.attention(q.clone().requires_grad_(), k, v, backend=be)
        assert torch.equal(trained.detach(), got), be


def test_fp32_inputs_with_an_fp64_bias_are_not_upcast():
    q = torch.randn(1, 2, 8, 8)
    e = mh.explain(q, q, q, mask=M.bias(torch.randn(1, 1, 8, 8, dtype=torch.float64)),
                   backend="sdpa")
    assert "computed in float32" not in str(e) and not e.plan.detail.upcast
    h = q.half()
    e = mh.explain(h, h, h, mask=M.bias(torch.randn(1, 1, 8, 8)), backend="sdpa")
    assert "computed in float32" in str(e) and e.plan.detail.upcast


@pytest.mark.parametrize("where", ["k", "v", "k-minus-inf", "v-nothing-seen"])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_a_hidden_nan_changes_no_gradient(backend, where):
    """A NaN in a key or value padding hides from every row: the gradients of q, k and v
    equal those of the same inputs with that position zeroed (finite: no ``0 * NaN``
    reaches them through the score or weight products). So does a hidden key whose one
    -inf component makes its scores -inf: the output stayed finite, and q's gradient
    summed ``0 * -inf`` into NaN on sdpa and blocksparse. So does a NaN value of a
    sequence of length 0: its rows are zeros (finite), and blocksparse's dq and dk were
    NaN (the backward's ``dO · vᵀ`` times weight 0)."""
    S = 12
    mask = M.padding(torch.tensor([0 if where == "v-nothing-seen" else S - 3, S]))
    q, k, v = _qkv(B=2, H=2, S=S, D=8, seed=5)
    q[..., 0] = q[..., 0].abs() + 0.1                        # a -inf k component: score -inf
    skip_unless_runs(backend, q.clone().requires_grad_(), k, v, mask=mask)

    def grads(poison):
        q_, k_, v_ = (t.clone().requires_grad_() for t in (q, k, v))
        with torch.no_grad():
            if where == "k-minus-inf":
                k_[0, :, S - 1, 0] = poison
            else:
                (k_ if where == "k" else v_)[0, :, S - 1] = poison
        out = mh.attention(q_, k_, v_, mask=mask, backend=backend)
        out.square().sum().backward()
        return [t.grad for t in (q_, k_, v_)]
    bad = float("-inf") if where == "k-minus-inf" else float("nan")
    for name, got, want in zip("qkv", grads(bad), grads(0.0)):
        assert torch.isfinite(got).all(), (backend, name)
        torch.testing.assert_close(got, want, msg=f"{backend}: d{name}")


def _exact_sum(*biases):
    """One float64 bias: the exact sum of ``biases``' values (the oracle of a composition)."""
    return M.bias(sum(b.double() for b in biases))


@pytest.mark.parametrize("dtype", HALF + [torch.float32], ids=["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("backend", BACKENDS + ["rows"])
def test_composed_half_precision_biases_are_summed_in_float32(dtype, backend):
    """bias(b1) & bias(b2) in bf16 used to be added in bf16 (errors 0.04-0.07 against 1e-6
    for their sum given as one fp32 bias), and two finfo(fp16).min to -inf (a zero row)."""
    g = torch.Generator().manual_seed(1)
    q, k, v = _qkv(B=1, H=2, S=48, D=16, dtype=dtype)
    b1, b2 = (torch.randn(1, 2, 48, 48, generator=g).mul(30).to(b) for b in HALF)
    low = torch.zeros(1, 1, 48, 48, dtype=torch.float16)
    low[..., 0, :] = torch.finfo(torch.float16).min        # row 0: every key at min + min
    for parts in ((b1, b2), (low, low)):
        got = mh.attention(q, k, v, mask=M.bias(parts[0]) & M.bias(parts[1]), backend=backend)
        want = mh.attention(q, k, v, mask=M.bias(parts[0].float() + parts[1].float()),
                            backend=backend)
        torch.testing.assert_close(got, want, atol=0, rtol=0)
        ref = oracle(q, k, v, _exact_sum(*parts))
        assert _err(got, ref) <= 2 * _err(want, ref) + 2 * torch.finfo(dtype).eps


@pytest.mark.parametrize("backend", ["reference", "blocksparse"])
def test_float64_calls_sum_and_slope_biases_in_float64(backend):
    """fp32 biases summed in fp32, and ALiBi's slopes for 12 heads (2^(-2/3) ...) kept in
    fp32, cost fp64 calls errors of 1e-8 to 1e-7."""
    g = torch.Generator().manual_seed(2)
    q, k, v = _qkv(B=1, H=12, S=40, D=16, dtype=torch.float64)
    b1, b2 = (torch.randn(1, 12, 40, 40, generator=g) * 10 for _ in range(2))
    got = mh.attention(q, k, v, mask=M.bias(b1) & M.bias(b2) & M.alibi(12), backend=backend)
    slopes = torch.tensor(M.alibi(12)._slopes, dtype=torch.float64)        # Python floats
    dist = (torch.arange(40)[:, None] - torch.arange(40)[None, :]).abs().double()
    want = mh.attention(q, k, v, mask=M.bias(b1.double() + b2.double()
                                             - slopes[:, None, None] * dist), backend="reference")
    assert _err(got, want) < 1e-12


@pytest.mark.parametrize("dtype", HALF, ids=["fp16", "bf16"])
@pytest.mark.parametrize("backend", ["reference", "sdpa"])
def test_a_broadcast_half_precision_bias_gets_its_gradient_summed_in_float32(dtype, backend):
    """A per-key bf16 bias broadcast over B, H and queries: its gradient was summed in bf16
    (error 0.51 against plain torch's 0.114, with gradients up to 43)."""
    g = torch.Generator().manual_seed(0)
    B, H, S, D = 4, 2, 512, 32
    q, k, v, dout = (torch.randn(B, H, S, D, generator=g) for _ in range(4))
    b0 = torch.randn(1, 1, 1, S, generator=g).to(dtype)
    bd = b0.double().requires_grad_()
    ref = torch.softmax(q.double() @ k.double().transpose(-1, -2) * D ** -0.5 + bd, -1) @ v.double()
    want, = torch.autograd.grad(ref, bd, dout.double())
    bp = b0.clone().requires_grad_()                  # plain torch: fp32 scores + the bias
    plain = torch.softmax(q @ k.transpose(-1, -2) * D ** -0.5 + bp, -1) @ v
    base, = torch.autograd.grad(plain, bp, dout)
    bm = b0.clone().requires_grad_()
    got, = torch.autograd.grad(mh.attention(q, k, v, mask=M.bias(bm), backend=backend), bm, dout)
    assert got.dtype == dtype
    assert _err(got, want) <= 1.5 * _err(base, want), (_err(got, want), _err(base, want))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("backend", ["auto", "sdpa", "varlen", "reference", "blocksparse"])
def test_a_row_whose_every_key_is_nan_is_nan(dtype, backend):
    """torch's CPU kernel returns zeros for a row of NaN scores (a decoding step over one
    NaN key): the rule says NaN."""
    q, k, v = _qkv(B=1, H=2, S=4, D=8, dtype=dtype)
    k[0, 0, 0, 3] = float("nan")
    mask = (M.causal() if backend != "varlen" else
            M.causal() & M.document(torch.tensor([[0, 1, 1, 1]])))
    if backend != "auto":
        skip_unless_runs(backend, q, k, v, mask=mask)
    out = mh.attention(q, k, v, mask=mask, backend=backend)
    assert out[0, 0, 0].isnan().all() and not out[0, 1].isnan().any()
    assert out[0, 0, 1:].isnan().all(-1).tolist() == [backend != "varlen"] * 3  # (documents)
    one = mh.attention(q[:, :, :1], k[:, :, :1], v[:, :, :1], mask=M.causal(),
                       backend="sdpa" if backend == "varlen" else backend)
    assert one[0, 0].isnan().all() and not one[0, 1].isnan().any()


def test_blocksparse_gives_a_row_of_minus_inf_scores_no_weight(monkeypatch):
    """Where nothing is read back (a GPU), a row whose only score is -inf (an infinite key)
    is zeros with lse -inf, as on every other backend: blocksparse's exp, clamped at -80,
    gave that key all the row's weight."""
    from multihead.functional import nonfinite
    monkeypatch.setattr(nonfinite, "_finite", lambda *args: True)
    q, k, v = _qkv(B=1, H=1, S=3, D=4)
    q = q.abs() + 0.1
    k[0, 0, 0, 0] = float("-inf")
    for be in ["reference", "rows", "blocksparse"]:
        out, lse = mh.attention(q, k, v, mask=M.causal(), backend=be, return_lse=True)
        assert out[0, 0, 0].eq(0).all() and lse[0, 0, 0] == float("-inf"), be
        assert out[0, 0, 1:].isfinite().all()


def test_sdpa_runs_a_sum_of_alibis_in_float32_on_half_inputs():
    """One ALiBi is exact in fp16; a sum of two is not (2.65x the error rule's bound)."""
    h = torch.randn(1, 6, 13, 16).half()
    two = M.alibi(6) & M.alibi(1, align="upper_left")
    assert mh.explain(h, h, h, mask=two, backend="sdpa").plan.detail.upcast
    assert not mh.explain(h, h, h, mask=M.alibi(6), backend="sdpa").plan.detail.upcast


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_a_bias_written_since_it_was_built_with_a_hidden_nan_keeps_its_row(backend, poison):
    """bias() reads its values when built; a value written later where causal hides the
    pair never reaches the row: blocksparse added it to the mask's -inf (NaN) and made the
    whole row NaN, where the reference and rows kept it."""
    q, k, v = _qkv(B=1, H=2, S=6, D=8, seed=3)
    b = torch.zeros(1, 1, 6, 6)
    mask = M.bias(b) & M.causal()
    skip_unless_runs(backend, q, k, v, mask=mask)
    b[0, 0, 0, 5] = poison                                    # hidden from query 0
    got = mh.attention(q, k, v, mask=mask, backend=backend)
    torch.testing.assert_close(got, mh.attention(q, k, v, mask=M.causal(), backend="reference"))


def _huge_bias(Sq, Sk, value, dtype):
    """Row 3 carries ``value`` on every key (a positive one: on keys 2 and 6, a tie), row
    5 on its first 7 keys; the other rows an ordinary N(0, 1) bias."""
    b = torch.randn(1, 2, Sq, Sk, generator=torch.Generator().manual_seed(5), dtype=dtype)
    if value < 0:
        b[:, :, 3] = value
    else:
        b[:, :, 3, [2, 6]] = value
    b[:, :, 5, :7] = value
    return b


@pytest.mark.parametrize("value", [-1e7, -1e30, torch.finfo(torch.float32).min, 1e30],
                         ids=["-1e7", "-1e30", "finfo.min", "+1e30"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("backend, with_bias", [   # (blocksparse gives no bias gradient)
    ("auto", False), ("auto", True), ("sdpa", False), ("sdpa", True), ("blocksparse", False)])
def test_a_row_only_a_huge_bias_reaches_gets_the_gradients_of_its_forward(backend, with_bias,
                                                                           dtype, value):
    """Such a row's lse cannot also hold the log of its sum (row 3: 32 keys, log 32 is
    below half an ulp of 1e30): torch's fused CPU kernel (which runs where the bias needs
    no gradient), and blocksparse before it saved (m, log l) apart, differentiated weights
    32 times too large (dQ off by 16 where it is 1). The gradients, the bias's included,
    equal autograd through the reference's ops."""
    q, k, v = (t[:, :, :24] for t in _qkv(B=2, H=2, S=32, D=16, dtype=dtype))
    k, v = _qkv(B=2, H=2, S=32, D=16, seed=1, dtype=dtype)[1:]
    b = _huge_bias(24, 32, value, dtype)
    dout = torch.randn(2, 2, 24, 16, generator=torch.Generator().manual_seed(6), dtype=dtype)
    grads = {}
    for be in (backend, "reference"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        bias = b.clone().requires_grad_(with_bias)
        out = mh.attention(*leaves, mask=M.bias(bias) & M.padding(torch.tensor([32, 29])),
                           backend=be)
        out.backward(dout)
        grads[be] = [t.grad for t in leaves] + ([bias.grad] if with_bias else [])
    tol = 1e-4 if dtype == torch.float32 else 1e-10
    for name, got, ref in zip(["q", "k", "v", "bias"], grads[backend], grads["reference"]):
        torch.testing.assert_close(got, ref, atol=tol, rtol=tol, msg=lambda m: f"{name}: {m}")


def test_only_a_row_every_score_of_which_is_huge_sends_sdpa_to_the_math_path(monkeypatch):
    """A padding bias (finfo.min on the padded keys of every row) keeps torch's fused
    kernel, since each row's maximum stays ordinary, as does a row the mask empties (opened,
    then zeroed); a row of finfo.min, or one huge positive score, sends the call to torch's
    math operator; a call without gradients never goes."""
    from multihead.functional.backend import sdpa
    ran = []
    monkeypatch.setattr(sdpa, "_math", lambda *a, **kw: ran.append(1) or
                        torch.ops.aten._scaled_dot_product_attention_math(*a, **kw)[0])
    q, k, v = _qkv(B=2, H=1, S=6, D=8)
    b = torch.zeros(2, 1, 6, 6)
    b[0, :, :, 4:] = torch.finfo(torch.float32).min              # padded keys
    hidden = torch.ones(2, 1, 6, 6, dtype=torch.bool)
    hidden[1, :, 3] = False                                      # an empty row ...
    b[1, :, 3] = torch.finfo(torch.float32).min                  # ... with a huge bias

    def math_ran(bias, grad=True):
        ran.clear()
        mh.attention(q.clone().requires_grad_(grad), k, v, backend="sdpa",
                     mask=M.bias(bias) & M.dense(hidden))
        return bool(ran)
    assert not math_ran(b)
    b[0, :, 1] = torch.finfo(torch.float32).min                  # a whole live row
    assert math_ran(b) and not math_ran(b, grad=False)
    b[0, :, 1] = 0.0
    b[1, :, 0, 5] = 1e30                                         # one huge score
    assert math_ran(b)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_per_sample_gradients_under_vmap_keep_rows_only_a_huge_bias_reaches_exact(dtype):
    """Under torch.func nothing can be read back: such a call takes torch's math operator
    (and the NaN rule's key read counts the keys finite), and each sample's gradient equals
    the reference's."""
    q, k, v = (t[:3, :2, :8, :16].contiguous() for t in _qkv(B=3, H=2, S=8, D=16, dtype=dtype))
    b = torch.randn(3, 1, 8, 8, generator=torch.Generator().manual_seed(2))
    b[0, :, 3] = -1e30

    def per_sample(backend):
        def f(q1, k1, v1, b1):
            out = mh.attention(q1[None], k1[None], v1[None], mask=M.bias(b1[None]),
                               backend=backend)
            return (out.float() * torch.arange(16.0)).sum()
        return torch.func.vmap(torch.func.grad(f))(q, k, v, b)
    torch.testing.assert_close(per_sample("auto"), per_sample("reference"),
                               atol=1e-2 if dtype == torch.bfloat16 else 1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_rows_weights_over_a_wide_range_of_scores_are_the_fp64_softmax(dtype):
    """rows computes its softmax in place and gives weight 0 to a score more than 79 below
    its row's largest (exp of such scores takes a slow path on x86); weights, output and
    lse must still be the fp64 softmax's, masked keys exactly 0 and an empty row zeros."""
    g = torch.Generator().manual_seed(3)
    B, H, S, D = 2, 3, 40, 8
    q, k, v = (torch.randn(B, H, S, D, generator=g, dtype=torch.float64) for _ in range(3))
    spread = torch.linspace(0, -240, S, dtype=torch.float64)      # scores from 0 to -240,
    bias = spread[torch.randperm(S, generator=g)].expand(B, H, S, S).clone()  # per key
    allowed = torch.rand(B, 1, S, S, generator=g) > 0.3
    allowed[0, :, 5] = False                                      # a row with nothing to see
    mask = M.bias(bias) & M.dense(allowed)
    out, w, lse = mh.attention(*(t.to(dtype) for t in (q, k, v)), mask=mask, backend="rows",
                               return_weights=True, return_lse=True)
    s = (q @ k.transpose(-1, -2)) * D ** -0.5 + bias
    s = s.masked_fill(~allowed, float("-inf"))
    want_lse = torch.logsumexp(s, -1)
    want_w = torch.exp(s - want_lse[..., None]).nan_to_num(0.0)
    tol = dict(atol=1e-6, rtol=1e-5) if dtype == torch.float32 else dict(atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(w.double(), want_w, **tol)
    torch.testing.assert_close(out.double(), want_w @ v, **tol)
    torch.testing.assert_close(lse.double(), want_lse, **tol)
    assert (w[~allowed.expand(B, H, S, S)] == 0).all()
    assert (w[0, :, 5] == 0).all() and (lse[0, :, 5] == float("-inf")).all()
    far = (s - s.amax(-1, keepdim=True)) < -80                    # flushed to 0, not left
    assert far.any() and (w[far] == 0).all()                      # subnormal (slow on x86)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64])
def test_sdpa_joins_a_predicate_to_a_bias_of_more_dims_exactly(dtype):
    """SDPA's materialized mask adds 0 or -inf for a predicate that broadcasts over the
    bias's heads (causal & ALiBi, padding & a per-head bias), and fills -inf in the others:
    the same mask, entry for entry, as torch.where puts -inf in, in every dtype, and the
    same as the mask's own additive form; a bias's gradient flows the same."""
    from multihead.functional._call import make_call
    from multihead.functional.backend.sdpa import _dense_mask
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 6, 8, generator=g, dtype=dtype)
    learned = torch.randn(1, 4, 6, 6, generator=g, dtype=dtype, requires_grad=True)
    for mask in (mh.masks.causal() & mh.masks.alibi(4),
                 mh.masks.padding(torch.tensor([3, 6])) & mh.masks.bias(learned),
                 mh.masks.padding(torch.tensor([3, 6])) & mh.masks.alibi(1)):   # masked_fill
        call = make_call(q, q, q, mask=mask, scale=None, dropout_p=0.0, return_weights=False,
                         return_lse=False)
        got, _ = _dense_mask(call, False, dtype)
        allowed, bias = mask.at(mask.index(6, 6, dtype=call.compute_dtype))
        want = torch.where(allowed, bias.to(dtype), float("-inf"))
        assert got.dtype == dtype and got.shape == want.shape
        assert torch.equal(got, want)
        additive = mask.additive(6, 6, dtype=dtype)    # the mask's own form: the same join
        assert torch.equal(additive, want.expand(additive.shape))
    weights = torch.rand(2, 4, 6, 6, generator=g, dtype=dtype)
    mask = mh.masks.padding(torch.tensor([3, 6])) & mh.masks.bias(learned)
    call = make_call(q, q, q, mask=mask, scale=None, dropout_p=0.0, return_weights=False,
                     return_lse=False)
    got, _ = _dense_mask(call, False, dtype)
    (dgot,) = torch.autograd.grad(got.masked_fill(got.isneginf(), 0).mul(weights).sum(), learned)
    allowed, bias = mask.at(mask.index(6, 6, dtype=call.compute_dtype))
    want = torch.where(allowed, bias.to(dtype), float("-inf"))
    (dwant,) = torch.autograd.grad(want.masked_fill(want.isneginf(), 0).mul(weights).sum(),
                                   learned)
    assert torch.equal(dgot, dwant)


@pytest.mark.parametrize("empty", ["none", "masked rows", "overflowed row"])
def test_the_reference_softmax_is_torchs_softmax_to_every_order_with_empty_rows_zero(empty):
    """The reference's softmax is torch's fused softmax, with rows that are all -inf (read
    on the CPU) filled around it: weights, lse, their gradients, second derivatives and
    forward-mode tangents are torch's softmax and logsumexp (fp64) on every row that has a
    finite score, and zeros (lse -inf, no NaN gradient through the weights) on a row that
    has none, masked or overflowed. (An lse of -inf has no finite gradient:
    :func:`multihead.attention` keeps such rows out of it.)"""
    from multihead.functional.backend.reference import safe_softmax
    g = torch.Generator().manual_seed(7)
    scores = torch.randn(2, 3, 5, 9, generator=g, dtype=torch.float64) * 4
    scores[0, 1, 2, 4:] = float("-inf")                             # a partly masked row
    if empty != "none":
        scores[1, 0, 3] = float("-inf")                             # a row that sees nothing
        scores[0, 2, 0] = float("-inf")
    live = ~torch.isinf(scores).all(-1)                             # (2, 3, 5)
    s = scores.clone().requires_grad_()
    w, lse = safe_softmax(s)
    up = torch.randn(w.shape, generator=g, dtype=torch.float64)
    up_lse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    def loss(w, lse):                      # (with an empty row, through the weights only)
        return (w * up).sum() + ((lse * up_lse).sum() if empty == "none" else 0)
    (gs,) = torch.autograd.grad(loss(w, lse), s, create_graph=True)
    (gg,) = torch.autograd.grad((gs * up).sum(), s)                 # a second derivative

    ref_s = scores.clone().requires_grad_()
    ref_w, ref_lse = torch.softmax(ref_s, -1), torch.logsumexp(ref_s, -1)
    (ref_gs,) = torch.autograd.grad(loss(ref_w, ref_lse), ref_s, create_graph=True)
    (ref_gg,) = torch.autograd.grad((ref_gs * up).sum(), ref_s)
    for ours, ref in ((w, ref_w), (lse, ref_lse), (gs, ref_gs), (gg, ref_gg)):
        torch.testing.assert_close(ours[live], ref.detach()[live], atol=1e-12, rtol=1e-12)
    assert (w[~live] == 0).all() and (lse[~live] == float("-inf")).all()
    assert (gs[~live] == 0).all() and (gg[~live] == 0).all()        # finite: no NaN

    tangent = torch.randn(scores.shape, generator=g, dtype=torch.float64)
    _, jw = torch.func.jvp(lambda x: safe_softmax(x)[0],
                           (scores,), (tangent.masked_fill(torch.isinf(scores), 0),))
    _, ref_jw = torch.func.jvp(lambda x: torch.softmax(x, -1), (scores,),
                               (tangent.masked_fill(torch.isinf(scores), 0),))
    torch.testing.assert_close(jw[live], ref_jw[live], atol=1e-12, rtol=1e-12)
    assert (jw[~live] == 0).all()


def test_the_reference_gives_a_row_of_minus_inf_scores_zeros_where_it_reads_nothing():
    """Under vmap and torch.compile nothing is read back, and a row may be -inf everywhere
    whatever the mask says (infinite keys, or scores past float32's range): such a row
    stays zeros there as in eager (torch's softmax alone gives NaN), and the weights of the
    other rows are torch's softmax."""
    from multihead.functional.backend.reference import safe_softmax
    scores = torch.randn(3, 4, 6, dtype=torch.float64)
    scores[1, 2] = float("-inf")
    w, lse = torch.func.vmap(safe_softmax)(scores)
    assert (w[1, 2] == 0).all() and lse[1, 2] == float("-inf")
    torch.testing.assert_close(w[0], torch.softmax(scores[0], -1), atol=1e-12, rtol=0)
    v = torch.randn(1, 1, 3, 2)
    cases = {"infinite keys": (torch.ones(1, 1, 1, 2), torch.full((1, 1, 3, 2), -float("inf"))),
             "overflowing scores": (torch.full((1, 1, 1, 2), 1e20), torch.full((1, 1, 3, 2), -1e20))}
    for name, (q, k) in cases.items():
        def f(q, k, v):
            return mh.attention(q, k, v, backend="reference")
        for run in (f, torch.func.vmap(f)):
            args = (q, k, v) if run is f else (q[None], k[None], v[None])
            assert (run(*args) == 0).all(), name
    q, k = cases["infinite keys"]
    assert (torch.compile(f, backend="eager")(q, k, v) == 0).all()


def test_the_reference_scales_the_scores_where_scaling_the_queries_would_overflow():
    """q is scaled before its product with k (torch's order) only for a scale of at most 1:
    a larger one scales the scores, where q times it could overflow and q·k not."""
    q = torch.full((1, 1, 1, 1), 1e20)
    k = torch.tensor([1e-30, 2e-30, -1e-30]).view(1, 1, 3, 1)
    v = torch.arange(3.0).view(1, 1, 3, 1)
    ref = mh.attention(q.double(), k.double(), v.double(), scale=1e20, backend="reference")
    out = mh.attention(q, k, v, scale=1e20, backend="reference")
    torch.testing.assert_close(out, ref.float())
    assert out.item() == 1.0


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf"), None])
def test_the_reference_gradient_product_reads_a_non_finite_operand_as_zero(bad):
    """The reference's backward reads non-finite entries of an operand as 0; where that
    operand is the large one (the weights, in the values' gradient) it multiplies first and
    cleans only when the product is not finite: the same values either way, bit for bit
    where all is finite."""
    from multihead.functional.backend.reference import _finite_product
    g = torch.Generator().manual_seed(5)
    w = torch.rand(2, 3, 40, 50, generator=g, dtype=torch.float64)       # weights (B, H, Sq, Sk)
    up = torch.randn(2, 3, 40, 8, generator=g, dtype=torch.float64)       # dO (B, H, Sq, Dv)
    if bad is not None:
        w[1, 2, 7, 11] = bad
    clean = w.nan_to_num(0.0, 0.0, 0.0)
    got = _finite_product(w.transpose(-2, -1), up, clean=0)               # (B, H, Sk, Dv)
    assert torch.equal(got, clean.transpose(-2, -1) @ up)
    small = torch.randn(2, 3, 8, 50, generator=g, dtype=torch.float64)    # vᵀ
    if bad is not None:
        small[0, 1, 2, 3] = bad
    got = _finite_product(up, small, clean=1)                             # (B, H, Sq, Sk)
    assert torch.equal(got, up @ small.nan_to_num(0.0, 0.0, 0.0))
    batched = torch.func.vmap(lambda a, b: _finite_product(a, b, clean=0))(
        w.transpose(-2, -1), up)
    assert torch.equal(batched, clean.transpose(-2, -1) @ up)


def test_the_reference_lse_gradient_sums_to_one_on_a_row_a_huge_bias_shifts():
    """A row whose every score carries -1e30 keeps an lse of -1e30 (adding log Sk rounds
    away): torch.logsumexp's gradient, exp(s - lse), was 1 per key there, Sk times the
    softmax it must be; the reference's lse is its own, whose gradient is the weights."""
    from multihead.functional.backend.reference import safe_softmax
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(3, 24, generator=g, dtype=torch.float64)
    scores[1] += -1e30
    s = scores.clone().requires_grad_()
    w, lse = safe_softmax(s)
    (grad,) = torch.autograd.grad(lse.sum(), s)
    torch.testing.assert_close(grad.sum(-1), torch.ones(3, dtype=torch.float64),
                               atol=1e-12, rtol=0)
    torch.testing.assert_close(grad, w.detach(), atol=1e-12, rtol=0)

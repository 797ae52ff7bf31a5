"""A mask object used again (every layer of a forward, every batch of one padding) has its
dense form built for its first two calls and kept from then on, by the backends that
materialize it (SDPA, the reference). Keeping must never change a result: a write into
the mask's tensors is seen, what is kept serves a later backward, a bias is built at
every call, and a mask made for one call stores nothing."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from multihead.functional.backend import _common
from multihead.masks.structured import Padding
from multihead.masks.tensor import Dense

B, H, S, D = 2, 2, 6, 8


def _qkv(seed=0, **kw):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, S, D, generator=g, dtype=torch.float64).to(**kw)
            for _ in range(3)]


def _expected(q, k, v, allowed):
    """fp64 softmax attention with ``allowed (B', H', S, S)`` (True = may attend); a row
    with nothing to attend to gives zeros."""
    scores = (q.double() @ k.double().transpose(-2, -1)) / D ** 0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    w = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return (w @ v.double()).to(q.dtype)


def _count_builds(monkeypatch, cls=Padding):
    built = []
    real = cls._allowed

    def counting(self, ix):
        built.append(1)
        return real(self, ix)
    monkeypatch.setattr(cls, "_allowed", counting)
    return built


def _kept_entries(mask) -> list:
    store = mask.__dict__.get("_memo")
    return [] if store is None else [key for key in store._data if key[0] != "plan"]


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_a_reused_mask_is_built_twice_then_kept(monkeypatch, backend):
    q, k, v = _qkv()
    m = mh.masks.causal() & mh.masks.padding(torch.tensor([4, 6]))
    allowed = m.materialize(S, S)
    built = _count_builds(monkeypatch)
    for _ in range(5):
        got = mh.attention(q, k, v, mask=m, backend=backend)
        torch.testing.assert_close(got, _expected(q, k, v, allowed))
    assert len(built) == 2
    assert len(_kept_entries(m)) == 1


def test_a_mask_made_for_each_call_stores_nothing():
    q, k, v = _qkv()
    for n in range(1, 4):
        m = mh.masks.padding(torch.tensor([n, S]))
        got = mh.attention(q, k, v, mask=m, backend="sdpa")
        torch.testing.assert_close(got, _expected(q, k, v, m.materialize(S, S)))
        assert _kept_entries(m) == []


def test_the_dropin_builds_a_reused_padding_once_kept(monkeypatch):
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(16, 2, batch_first=True).eval()
    ours = mh.nn.MultiheadAttention(16, 2, batch_first=True).eval()
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(3, 5, 16)
    built = _count_builds(monkeypatch, Dense)        # (torch's bool masks: dense, inverted)
    with torch.no_grad():
        for _ in range(4):              # a new tensor of the same padding at each call
            kpm = torch.tensor([[False] * 5, [False] * 3 + [True] * 2, [False] + [True] * 4])
            got, _ = ours(x, x, x, key_padding_mask=kpm, need_weights=False)
            torch.testing.assert_close(got, ref(x, x, x, key_padding_mask=kpm,
                                                need_weights=False)[0])
    assert len(built) == 2


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_a_write_into_the_masks_tensor_is_seen(backend):
    q, k, v = _qkv()
    m = mh.masks.padding(torch.tensor([5, 6]))
    for _ in range(3):
        mh.attention(q, k, v, mask=m, backend=backend)
    m.lengths[0] = 2                                          # in place: a version bump
    got = mh.attention(q, k, v, mask=m, backend=backend)
    want = _expected(q, k, v, mh.masks.padding(torch.tensor([2, 6])).materialize(S, S))
    torch.testing.assert_close(got, want)


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
@pytest.mark.parametrize("write", ["numpy", "data"])
def test_a_write_that_bumps_no_version_counter_is_seen(backend, write):
    q, k, v = _qkv()
    hidden = torch.zeros(S, S, dtype=torch.bool)
    m = ~mh.masks.dense(hidden) & mh.masks.causal()
    for _ in range(3):
        mh.attention(q, k, v, mask=m, backend=backend)
    if write == "numpy":
        hidden.numpy()[1:, 0] = True
    else:
        hidden.data[1:, 0] = True
    got = mh.attention(q, k, v, mask=m, backend=backend)
    want = _expected(q, k, v, ~hidden.clone() & torch.ones(S, S, dtype=torch.bool).tril())
    torch.testing.assert_close(got, want)


def test_a_write_into_a_dense_masks_tensor_is_seen_through_a_composition():
    q, k, v = _qkv()
    hidden = torch.zeros(S, S, dtype=torch.bool)
    m = ~mh.masks.dense(hidden) & mh.masks.causal()
    for _ in range(3):
        mh.attention(q, k, v, mask=m, backend="sdpa")
    hidden[:, 0] = True                                       # the first key hidden from all
    got = mh.attention(q, k, v, mask=m, backend="sdpa")
    want = _expected(q, k, v, (~hidden & torch.ones(S, S, dtype=torch.bool).tril()))
    torch.testing.assert_close(got, want)
    assert got[:, :, 0].abs().max() == 0                      # row 0 sees no key: zeros


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_what_inference_mode_kept_serves_a_backward(backend):
    q, k, v = _qkv()
    m = mh.masks.causal() & mh.masks.padding(torch.tensor([3, 6]))
    with torch.inference_mode():
        for _ in range(3):
            mh.attention(q, k, v, mask=m, backend=backend)
    kept = [m._memo.peek(key) for key in _kept_entries(m)]
    tensors = [t for value in kept for t in value if isinstance(t, torch.Tensor)]
    assert tensors and not any(t.is_inference() for t in tensors)    # (one could not be saved)
    qg = q.clone().requires_grad_()
    mh.attention(qg, k, v, mask=m, backend=backend).sum().backward()
    qe = q.clone().requires_grad_()
    _expected(qe, k, v, m.materialize(S, S)).sum().backward()
    torch.testing.assert_close(qg.grad, qe.grad)


def test_a_dense_form_over_the_limit_is_built_at_every_call(monkeypatch):
    q, k, v = _qkv()
    monkeypatch.setattr(_common, "KEPT_MASK_BYTES", 8)       # under (B, 1, S, S) bool
    m = mh.masks.causal() & mh.masks.padding(torch.tensor([4, 6]))
    built = _count_builds(monkeypatch)
    for _ in range(4):
        mh.attention(q, k, v, mask=m, backend="sdpa")
    assert len(built) == 4 and _kept_entries(m) == []


@pytest.mark.parametrize("backend", ["sdpa", "reference"])
def test_a_bias_is_built_at_every_call_and_takes_its_gradient(backend):
    q, k, v = _qkv()
    bias = torch.randn(1, H, S, S, dtype=torch.float64, requires_grad=True)
    m = mh.masks.bias(bias) & mh.masks.padding(torch.tensor([4, 6]))
    allowed = m.materialize(S, S)
    grads = []
    for step in range(3):
        bias.grad = None
        out = mh.attention(q, k, v, mask=m, backend=backend)
        scores = (q @ k.transpose(-2, -1)) / D ** 0.5 + bias
        want = torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1) @ v
        torch.testing.assert_close(out, want)
        out.sum().backward()
        grads.append(bias.grad.clone())
        with torch.no_grad():
            bias.mul_(2.0)                     # a new bias for the next call
    assert not torch.equal(grads[0], grads[2])
    assert _kept_entries(m) == []


@pytest.mark.cuda
def test_a_kept_mask_serves_another_stream():
    q, k, v = _qkv(device="cuda", dtype=torch.float16)
    m = (mh.masks.causal() & mh.masks.padding(torch.tensor([4, 6]))).to("cuda")
    want = _expected(q, k, v, m.materialize(S, S, "cuda"))
    for _ in range(3):
        mh.attention(q, k, v, mask=m, backend="sdpa")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        got = mh.attention(q, k, v, mask=m, backend="sdpa")
    torch.cuda.current_stream().wait_stream(side)
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("backend", ["sdpa", "reference", "auto"])
@pytest.mark.parametrize("make", [lambda: mh.masks.causal(),
                                  lambda: mh.masks.sliding_window(3),
                                  lambda: mh.masks.causal() & mh.masks.padding(torch.tensor([3, 6]))],
                         ids=["causal", "window", "causal&padding"])
def test_calls_under_a_fake_tensor_mode_keep_nothing_for_real_ones(backend, make):
    from torch._subclasses.fake_tensor import FakeTensorMode
    q, k, v = _qkv()
    m = make()
    mh.attention(q, k, v, mask=m, backend=backend)   # (auto plans from values: a real call)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fakes = [mode.from_tensor(t) for t in (q, k, v)]
        for _ in range(3):
            mh.attention(*fakes, mask=m, backend=backend)
    for mask in (m, make()):                         # the same object, and an equal one
        got = mh.attention(q, k, v, mask=mask, backend=backend)
        assert type(got) is torch.Tensor
        torch.testing.assert_close(got, _expected(q, k, v, m.materialize(S, S)))


def test_a_trace_for_symbolic_lengths_takes_a_tensor_free_mask():
    from torch.fx.experimental.proxy_tensor import make_fx
    run = lambda a, b, c: mh.attention(a, b, c, mask=mh.masks.sliding_window(2),
                                       backend="sdpa")
    graph = make_fx(run, tracing_mode="symbolic")(*_qkv())
    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, H, 9, D, generator=g, dtype=torch.float64) for _ in range(3))
    torch.testing.assert_close(graph(q, k, v), run(q, k, v))


def test_a_counting_dispatch_mode_still_keeps_plans_and_masks(monkeypatch):
    from torch.utils.flop_counter import FlopCounterMode
    from multihead.functional import dispatch
    made = []
    real = dispatch._new_decision
    monkeypatch.setattr(dispatch, "_new_decision", lambda *a: made.append(1) or real(*a))
    q, k, v = _qkv()
    m = mh.masks.causal() & mh.masks.padding(torch.tensor([4, 6]))
    built = _count_builds(monkeypatch)
    with FlopCounterMode(display=False):             # on from the first call (real tensors)
        for _ in range(5):
            got = mh.attention(q, k, v, mask=m, backend="sdpa")
    assert len(made) == 1 and len(built) == 2
    torch.testing.assert_close(got, _expected(q, k, v, m.materialize(S, S)))


@pytest.mark.cuda
def test_a_gpu_bool_padding_is_read_at_every_call():
    q, k, v = _qkv(device="cuda", dtype=torch.float16)
    real = torch.ones(B, S, dtype=torch.bool, device="cuda")
    m = mh.masks.padding(real)                       # (a GPU bool mask: the caller's tensor)
    for _ in range(3):
        mh.attention(q, k, v, mask=m, backend="sdpa")
    real.data[0, 2:] = False                         # (no version bump)
    got = mh.attention(q, k, v, mask=m, backend="sdpa")
    want = _expected(q, k, v, mh.masks.padding(real.clone()).materialize(S, S, "cuda"))
    torch.testing.assert_close(got, want, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("backend", ["rows", "blocksparse", "sdpa", "reference"])
def test_a_first_call_under_a_fake_tensor_mode_leaves_no_cache_behind(backend):
    from torch._subclasses.fake_tensor import FakeTensorMode
    q, k, v = (torch.randn(2, 4, 19, 12) for _ in range(3))    # (sizes no other test uses:
    m = mh.masks.causal()                                       # no real call's facts kept)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        try:               # (whether a backend can plan on fake tensors is not the point)
            mh.attention(*(mode.from_tensor(t) for t in (q, k, v)), mask=m, backend=backend)
        except ValueError:                    # (rows: cannot run there, and says so)
            pass
    got = mh.attention(q, k, v, mask=m, backend=backend)
    want = mh.attention(q.double(), k.double(), v.double(), mask=m, backend="reference")
    assert type(got) is torch.Tensor
    torch.testing.assert_close(got, want.float(), atol=1e-5, rtol=1e-5)


def test_a_call_whose_mask_fails_to_build_changes_nothing(monkeypatch):
    q, k, v = _qkv()
    m = mh.masks.causal() & mh.masks.padding(torch.tensor([4, 6]))
    real = Padding._allowed

    def failing(self, ix):
        raise RuntimeError("out of memory (simulated)")
    monkeypatch.setattr(Padding, "_allowed", failing)
    with pytest.raises(RuntimeError, match="simulated"):
        mh.attention(q, k, v, mask=m, backend="sdpa")
    monkeypatch.setattr(Padding, "_allowed", real)
    got = mh.attention(q, k, v, mask=m, backend="sdpa")       # its first call, as before
    assert _kept_entries(m) == []
    torch.testing.assert_close(got, _expected(q, k, v, m.materialize(S, S)))
    mh.attention(q, k, v, mask=m, backend="sdpa")
    assert len(_kept_entries(m)) == 1

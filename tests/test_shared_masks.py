"""Small host mask tensors of equal contents share one mask object (and so one decision):
the drop-in's key_padding_mask / attn_mask and the tensors passed to ``multihead.attention``.
Sharing must never change a result: the kept object is keyed by contents (not identity or
version counters), holds copies, and is skipped where the tensor itself must be held (a
gradient, a forward-mode tangent)."""

from __future__ import annotations

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import multihead as mh
from multihead.functional import dispatch
from multihead.masks._content import by_content

E, H, B, S = 16, 2, 3, 5


def _pair(seed=0):
    torch.manual_seed(seed)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True)
    ours = mh.nn.MultiheadAttention(E, H, batch_first=True)
    ours.load_state_dict(ref.state_dict())
    return ref.eval(), ours.eval()


def _kpm(*pads):
    kpm = torch.zeros(B, S, dtype=torch.bool)
    for row, n in enumerate(pads):
        if n:
            kpm[row, S - n:] = True
    return kpm


def _count_decisions(monkeypatch):
    made = []
    real = dispatch._new_decision

    def counting(*args):
        made.append(1)
        return real(*args)
    monkeypatch.setattr(dispatch, "_new_decision", counting)
    return made


def test_equal_padding_masks_share_one_decision_in_the_dropin(monkeypatch):
    ref, ours = _pair()
    x = torch.randn(B, S, E)
    made = _count_decisions(monkeypatch)
    for _ in range(3):                       # a fresh tensor of the same padding each time
        kpm = _kpm(0, 2, 4)
        got, _ = ours(x, x, x, key_padding_mask=kpm, need_weights=False)
        want, _ = ref(x, x, x, key_padding_mask=kpm, need_weights=False)
        torch.testing.assert_close(got, want)
    assert len(made) == 1
    ours(x, x, x, key_padding_mask=_kpm(1, 0, 0), need_weights=False)     # other contents
    assert len(made) == 2


def test_equal_tensor_masks_share_one_decision_in_attention(monkeypatch):
    q = torch.randn(B, H, S, 8)
    made = _count_decisions(monkeypatch)
    outs = [mh.attention(q, q, q, mask=~_kpm(0, 1, 3)[:, None, None, :]) for _ in range(3)]
    assert len(made) == 1
    want = mh.attention(q, q, q, mask=mh.masks.padding(torch.tensor([S, S - 1, S - 3])))
    for out in outs:
        torch.testing.assert_close(out, want)


def test_a_tensor_rewritten_without_a_version_bump_is_read_again():
    # a loader that refills one buffer through .data (or a shared numpy array) changes no
    # version counter: the contents key the mask, so the new padding is the one applied
    ref, ours = _pair(1)
    x = torch.randn(B, S, E)
    kpm = _kpm(0, 2, 0)
    ours(x, x, x, key_padding_mask=kpm)
    kpm.data.copy_(_kpm(3, 0, 1))
    got, w = ours(x, x, x, key_padding_mask=kpm)
    want, w_ref = ref(x, x, x, key_padding_mask=kpm)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(w, w_ref)


def test_a_kept_mask_shares_no_memory_with_the_callers_tensor():
    q = torch.randn(1, 1, S, 4)
    bias = torch.zeros(1, 1, S, S)
    first = mh.attention(q, q, q, mask=bias)
    bias.fill_(-1e4)
    bias[..., 0] = 0.0                       # now every query sees key 0 only
    torch.testing.assert_close(mh.attention(q, q, q, mask=torch.zeros(1, 1, S, S)), first)
    torch.testing.assert_close(mh.attention(q, q, q, mask=bias), q[:, :, :1].expand_as(q))


def test_a_mask_that_takes_a_gradient_is_never_shared():
    ref, ours = _pair(2)
    x = torch.randn(B, S, E)
    grads, values = [], torch.randn(S, S)
    for _ in range(2):                       # equal contents, two tensors: each its gradient
        am = values.clone().requires_grad_()
        out, _ = ours(x, x, x, attn_mask=am, need_weights=False)
        out.sum().backward()
        grads.append(am.grad)
    assert grads[0] is not None and grads[1] is not None
    torch.testing.assert_close(grads[0], grads[1])
    am_ref = am.detach().clone().requires_grad_()
    ref(x, x, x, attn_mask=am_ref, need_weights=False)[0].sum().backward()
    torch.testing.assert_close(grads[1], am_ref.grad)


def test_a_dual_mask_keeps_its_own_tangent():
    q = torch.randn(1, 1, 3, 4)
    primal, direction = torch.randn(1, 1, 3, 3), torch.randn(1, 1, 3, 3)
    tangents = []
    with fwAD.dual_level():
        for scale in (1.0, 2.0):                # equal primals, tangents of two sizes
            bias = fwAD.make_dual(primal.clone(), direction * scale)
            out = mh.attention(q, q, q, mask=bias, backend="reference")
            tangents.append(fwAD.unpack_dual(out).tangent)
    assert tangents[0] is not None and tangents[0].abs().max() > 0
    torch.testing.assert_close(tangents[1], 2 * tangents[0])


def test_a_mask_first_met_in_inference_mode_serves_a_backward():
    # kept from a call in inference mode, it holds normal tensors (an inference tensor
    # cannot be saved for a backward, nor written, outside inference mode)
    q = torch.randn(B, H, S, 8)
    bias = torch.randn(1, 1, S, S)
    with torch.inference_mode():
        mh.attention(q, q, q, mask=bias.clone())
    kept = by_content("attention's mask", mh.masks.bias, (bias.clone(),))
    assert not any(t.is_inference() for t in kept._tensors())
    qg = q.clone().requires_grad_()
    mh.attention(qg, qg, qg, mask=bias.clone()).sum().backward()
    assert qg.grad is not None and qg.grad.isfinite().all()


def test_by_content_keys_dtype_shape_and_values():
    build = lambda t: mh.masks.bias(t.float())  # noqa: E731
    a = by_content("t", build, (torch.zeros(2, 3),))
    assert by_content("t", build, (torch.zeros(2, 3),)) is a
    assert by_content("t", build, (torch.zeros(3, 2),)) is not a
    assert by_content("t", build, (torch.zeros(2, 3, dtype=torch.float64),)) is not a
    assert by_content("t", build, (torch.zeros(2, 3), ), ("other",)) is not a
    assert by_content("another caller", build, (torch.zeros(2, 3),)) is not a
    half = by_content("t", build, (torch.zeros(2, 3, dtype=torch.bfloat16),))    # (no numpy dtype)
    assert by_content("t", build, (torch.zeros(2, 3, dtype=torch.bfloat16),)) is half
    big = torch.zeros(64, 1024)                                              # past MAX_BYTES
    assert by_content("t", build, (big,)) is not by_content("t", build, (big,))


def test_the_calls_other_arguments_are_checked_before_its_mask():
    q, nan = torch.randn(1, 2, 4, 8), torch.full((4, 4), float("nan"))
    for call in (lambda: mh.attention(q[0], q, q, mask=nan),
                 lambda: mh.explain(q[0], q, q, mask=nan)):
        with pytest.raises(ValueError, match="q must be 4-D"):
            call()
    with pytest.raises(ValueError, match="dropout_p must be"):
        mh.attention(q, q, q, mask=torch.zeros(4, 4, dtype=torch.long), dropout_p=2.0)
    with pytest.raises(ValueError, match="unknown backend 'nope'"):
        mh.attention(q, q, q, mask=nan, backend="nope")


def test_nothing_is_kept_from_a_fake_tensor_mode():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from multihead.masks import _content
    _content._BUILT.clear()
    real = torch.tensor([[True, False, True, True]] * 4)
    with FakeTensorMode(allow_non_fake_inputs=True):
        assert by_content("t", mh.masks.dense, (real,)) is not None
    assert len(_content._BUILT) == 0


def test_a_refused_mask_is_refused_every_time():
    q = torch.randn(1, 1, 2, 4)
    for _ in range(2):
        try:
            mh.attention(q, q, q, mask=torch.tensor([[1, 0], [1, 1]]))
        except TypeError as e:
            assert "mask has dtype torch.int64" in str(e)
        else:
            raise AssertionError("an int mask was accepted")

"""torch's cuDNN SDPA kernel: decoding steps run without it (it builds a graph for each new
length), and a backward that builds a graph keeps its node out (it takes no undefined output
gradient). The CUDA tests (marker ``cuda``) check the real kernel; the CPU ones check the
switch and the hooks on a node that behaves as cuDNN's does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import multihead as mh
from multihead.functional.backend import _cudnn


def test_the_switch_is_left_on_when_the_call_raises():
    def boom(*args):
        assert not torch.backends.cuda.cudnn_sdp_enabled()
        raise ValueError("inside")
    with pytest.raises(ValueError, match="inside"):
        _cudnn.run_without_cudnn(boom)
    assert torch.backends.cuda.cudnn_sdp_enabled()


def test_no_call_on_a_cpu_touches_the_switch(monkeypatch):
    seen = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: (
        seen.append(torch.backends.cuda.cudnn_sdp_enabled()), real(*a, **kw))[1])
    q = torch.randn(1, 4, 1, 8)
    mh.attention(q, q, q, backend="sdpa")
    assert seen == [True] and not _cudnn.skips_cudnn(q.device.type, 1)


class _FakeCudnnAttention(torch.autograd.Function):
    """A node named as torch's cuDNN one (``..CudnnAttentionBackward``), which, as it does,
    reads an output gradient it was not given (NaN here) and returns gradients that cannot
    be differentiated again."""

    @staticmethod
    def forward(ctx, q):
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(q)
        return q * 2.0

    @staticmethod
    def backward(ctx, grad):
        if grad is None:
            grad = torch.full_like(ctx.saved_tensors[0], float("nan"))
        if torch.is_grad_enabled():
            return _NotDifferentiable.apply(grad * 2.0)
        return grad * 2.0


class _NotDifferentiable(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("derivative for the cuDNN-like backward is not implemented")


def _kernel_then_again(q):
    """What dispatch builds for an SDPA call that records gradients: the kernel's node, the
    ops after it (a dtype, a row fix), and a node standing for :mod:`multihead._second_order`'s,
    which in a backward that builds a graph gives the kernel's output no gradient and q its
    own (here ``3 * grad``, differentiable)."""
    kernel = _FakeCudnnAttention.apply(q)
    _cudnn._mute(SimpleNamespace(requires_grad=True, dropout_p=0.0), kernel.grad_fn)
    return _Again.apply(kernel.to(torch.float64).mul(1.0), q)


class _Again(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, q):
        return out.detach()

    @staticmethod
    def backward(ctx, grad):
        if not torch.is_grad_enabled():
            return grad, None
        return None, 3.0 * grad


def test_a_muted_node_stays_out_of_a_backward_that_builds_a_graph():
    q = torch.randn(5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64)
    g, = torch.autograd.grad((_kernel_then_again(q) * w).sum(), q, create_graph=True)
    assert torch.equal(g, 3.0 * w)                     # no NaN from the kernel's node
    gg, = torch.autograd.grad((g * q).sum(), q)         # differentiable again
    assert torch.equal(gg, 3.0 * w)


def test_a_muted_node_runs_as_it_is_in_a_plain_backward():
    q = torch.randn(5, dtype=torch.float64, requires_grad=True)
    w = torch.randn(5, dtype=torch.float64)
    g, = torch.autograd.grad((_kernel_then_again(q) * w).sum(), q)
    assert torch.equal(g, 2.0 * w)


def test_without_the_hooks_that_backward_fails():
    """The double of the test above is a real one: unmuted, the node's NaN reaches q."""
    q = torch.randn(5, dtype=torch.float64, requires_grad=True)
    out = _Again.apply(_FakeCudnnAttention.apply(q), q)
    g, = torch.autograd.grad(out.sum(), q, create_graph=True)
    assert g.isnan().all()


def test_only_an_attention_node_of_cudnn_is_muted():
    """q made by another cuDNN op (an LSTM's, say) keeps its gradients in such a backward."""
    class _FakeCudnnRnn(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x * 2.0

        @staticmethod
        def backward(ctx, grad):
            return grad * 2.0

    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    q = _FakeCudnnRnn.apply(x)
    _cudnn._mute(SimpleNamespace(requires_grad=True, dropout_p=0.0), q.grad_fn)
    g, = torch.autograd.grad(q.sum(), x, create_graph=True)
    assert torch.equal(g, torch.full_like(x, 2.0))


def test_a_user_who_pinned_cudnn_keeps_it():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    assert _cudnn.cudnn_switchable()
    with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
        assert not _cudnn.cudnn_switchable()
    torch.backends.cuda.enable_cudnn_sdp(False)
    try:
        assert not _cudnn.cudnn_switchable()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(True)


@pytest.mark.cuda
@pytest.mark.parametrize("Sq, off", [(1, True), (16, True), (17, False)])
def test_a_decoding_step_runs_without_cudnn_on_cuda(monkeypatch, Sq, off):
    seen = []
    real = F.scaled_dot_product_attention
    monkeypatch.setattr(F, "scaled_dot_product_attention", lambda *a, **kw: (
        seen.append(torch.backends.cuda.cudnn_sdp_enabled()), real(*a, **kw))[1])
    q = torch.randn(2, 8, Sq, 64, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, 2, 300, 64, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    out = mh.attention(q, k, v, backend="sdpa")
    ref = mh.attention(q.double(), k.double(), v.double(), backend="reference")
    assert seen == [not off] and torch.backends.cuda.cudnn_sdp_enabled()
    assert (out.double() - ref).norm() / ref.norm() < 1e-2
    assert ("cuDNN's kernel switched off" in str(mh.explain(q, k, v, backend="sdpa"))) == off

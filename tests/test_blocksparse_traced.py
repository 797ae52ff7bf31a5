"""``blocksparse`` under ``torch.compile`` and ``torch.export``: sliding windows (and, in a
non-strict export, any band and key padding) run as the operator
``torch.ops.multihead.blocksparse``, which plans its tiles when it runs, so one graph
serves every length and the window's tiles are skipped as in an eager call; forward and
gradients equal the reference's (fp64), and torch's own operator checks pass. Under
Dynamo, ``auto`` takes it for a window without comparing traced estimates, so a change of
length alone never recompiles, for any mask."""

from __future__ import annotations

import pytest
import torch

import multihead as mh

M = mh.masks
OP = torch.ops.multihead.blocksparse.default


def _graphs():
    """A torch.compile backend that keeps each graph it is given (and runs it as is)."""
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm.forward
    return backend, graphs


def _ops(gm) -> set:
    return {n.target for n in gm.graph.nodes if n.op == "call_function"}


WINDOWS = {   # name: (mask for Sq and Sk, keys beyond the queries)
    "window": (lambda S, K: M.sliding_window(max(1, S // 5)), 0),
    "window & lengths of batch 1": (lambda S, K: M.sliding_window(30)
                                    & M.padding(torch.tensor([K - 3])), 0),
    "window & bool padding": (lambda S, K: M.sliding_window(9) & M.padding(
        torch.arange(K).expand(2, K) < torch.tensor([[K], [K - 7]])), 0),
    "cross, lower-right window": (lambda S, K: M.sliding_window(12), 23),
    "cross, upper-left window": (lambda S, K: M.sliding_window(12, align="upper_left"), 23),
    "cross, upper-left window & lengths": (lambda S, K: M.sliding_window(5, align="upper_left")
                                           & M.padding(torch.tensor([K, 5])), -9),
}
BANDS = {   # exported (non-strict) only: under Dynamo these stay on SDPA
    "causal & lengths": (lambda S, K: M.causal() & M.padding(torch.tensor([K, K // 2])), 0),
    "lengths of batch 1": (lambda S, K: M.padding(torch.tensor([K - 3])), 0),
    "cross, upper-left causal & lengths": (lambda S, K: M.causal(align="upper_left")
                                           & M.padding(torch.tensor([K, 5])), -9),
    **WINDOWS,
    "window": (lambda S, K: M.sliding_window(17), 0),    # (a traced size is no window)
}


@pytest.mark.parametrize("name", WINDOWS)
def test_compiled_band_runs_the_operator_for_every_length_in_one_graph(name):
    """Lengths on both sides of the 64-row tiles (and of the band's width), Sq != Sk
    (more keys, or fewer), GQA: one graph, equal to the reference in fp64."""
    torch._dynamo.reset()
    backend, graphs = _graphs()

    def f(q, k, v, mask):
        return mh.attention(q, k, v, mask=mask, backend="blocksparse")
    compiled = torch.compile(f, backend=backend, dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(1)
    mask_of, more = WINDOWS[name]
    for S in (40, 131, 260):
        q = torch.randn(2, 4, S, 16, dtype=torch.float64, generator=g, requires_grad=True)
        k, v = (torch.randn(2, 2, S + more, 16, dtype=torch.float64, generator=g,
                            requires_grad=True) for _ in range(2))     # GQA
        mask = mask_of(S, S + more)
        got = compiled(q, k, v, mask)
        want = mh.attention(q, k, v, mask=mask, backend="reference")
        torch.testing.assert_close(got, want)
        w = torch.randn(got.shape, dtype=torch.float64, generator=g)
        for a, b in zip(torch.autograd.grad((got * w).sum(), (q, k, v)),
                        torch.autograd.grad((want * w).sum(), (q, k, v))):
            torch.testing.assert_close(a, b)
    assert len(graphs) == 1 and OP in _ops(graphs[0])


class _Attend(torch.nn.Module):
    def __init__(self, mask_of, more, backend="auto"):
        super().__init__()
        self.mask_of, self.more, self.backend = mask_of, more, backend

    def forward(self, q, k, v):
        return mh.attention(q, k, v, mask=self.mask_of(q.shape[2], k.shape[2]),
                            backend=self.backend)


@pytest.mark.parametrize("name", BANDS)
def test_an_exported_band_runs_the_operator_at_every_length(name):
    """Non-strict export (sizes symbolic, estimates compared at the traced sizes, no
    guard): every band and key padding, Sq != Sk both ways; fp64, against the reference."""
    mask_of, more = BANDS[name]
    g = torch.Generator().manual_seed(3)
    make = lambda S: (torch.randn(2, 4, S, 16, dtype=torch.float64, generator=g),  # noqa: E731
                      *(torch.randn(2, 2, S + more, 16, dtype=torch.float64, generator=g)
                        for _ in range(2)))
    S, K = torch.export.Dim("S", min=20, max=1024), torch.export.Dim("K", min=11, max=1100)
    shapes = ({2: S}, {2: K}, {2: K}) if more else ({2: S},) * 3
    program = torch.export.export(_Attend(mask_of, more, "blocksparse"), make(200),
                                  dynamic_shapes=shapes)
    assert OP in _ops(program.graph_module)
    for n in (20, 131, 300):
        q, k, v = make(n)
        torch.testing.assert_close(program.module()(q, k, v), mh.attention(
            q, k, v, mask=mask_of(n, n + more), backend="reference"))


@pytest.mark.parametrize("mask", ["causal", "window", "query padding", "padding & padding",
                                  "dense", "document", "window & padding & causal"])
def test_compiled_auto_keeps_one_graph_for_every_mask_as_only_the_length_changes(mask):
    """No guard on a comparison of traced estimates (a causal band stays on SDPA, a window
    takes the operator unpriced), and masks the operator does not take are refused
    without formatting a traced size (a Dynamo error before)."""
    make = {"causal": lambda S: M.causal(),
            "window": lambda S: M.sliding_window(24),
            "query padding": lambda S: M.padding(torch.tensor([3, S]), side="query"),
            "padding & padding": lambda S: M.padding(torch.tensor([S, 4]))
            & M.padding(torch.tensor([S - 5, S])),
            "dense": lambda S: M.dense(torch.ones(S, S, dtype=torch.bool).tril(-2)),
            "document": lambda S: M.document(torch.arange(S) // 30),
            "window & padding & causal": lambda S: M.sliding_window(4)
            & M.padding(torch.tensor([3, S])) & M.causal()}[mask]
    from torch._dynamo.testing import CompileCounter
    torch._dynamo.reset()
    graphs = CompileCounter()
    f = torch.compile(lambda q, m: mh.attention(q, q, q, mask=m), backend=graphs,
                      dynamic=True, fullgraph=True)
    g = torch.Generator().manual_seed(4)
    for S in (100, 37, 250, 300, 700):
        q = torch.randn(2, 4, S, 16, generator=g)
        torch.testing.assert_close(f(q, make(S)), mh.attention(q, q, q, mask=make(S),
                                                               backend="reference"))
    assert graphs.frame_count == 1


def test_a_strict_export_of_a_window_runs_at_every_length():
    """Dynamo traces a strict export: the window takes the operator without a guard on
    the length, so the program runs wherever its Dim allows."""
    mask_of = lambda S, K: M.sliding_window(9)                        # noqa: E731
    x = torch.randn(3, 4, 100, 8)
    B, S = torch.export.Dim("B", max=64), torch.export.Dim("S", max=1024)
    program = torch.export.export(_Attend(mask_of, 0), (x, x, x), strict=True,
                                  dynamic_shapes=({0: B, 2: S},) * 3)
    for b, n in ((2, 300), (5, 17), (1, 900)):
        x = torch.randn(b, 4, n, 8)
        torch.testing.assert_close(program.module()(x, x, x), mh.attention(
            x, x, x, mask=M.sliding_window(9), backend="reference"), atol=1e-5, rtol=1e-5)


def test_auto_takes_the_operator_for_a_long_compiled_window_and_exports_it():
    """Priced from the band's width while tracing: a long window is cheaper tiled than
    SDPA's dense mask, and an exported program keeps the operator for every length."""
    from torch import nn

    class Attend(nn.Module):
        def forward(self, q, k, v):
            return mh.attention(q, k, v, mask=M.sliding_window(64))

    q = torch.randn(1, 8, 2048, 32)
    kv = torch.randn(1, 1, 2048, 32)                                  # MQA
    S = torch.export.Dim("S", min=2, max=8192)
    program = torch.export.export(Attend(), (q, kv, kv), dynamic_shapes=({2: S},) * 3)
    assert OP in _ops(program.graph_module)
    runner = program.module()
    for n in (5, 300, 3000):
        q, kv = torch.randn(1, 8, n, 32), torch.randn(1, 1, n, 32)
        torch.testing.assert_close(runner(q, kv, kv), mh.attention(
            q, kv, kv, mask=M.sliding_window(64), backend="reference"), atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()
    backend, graphs = _graphs()
    torch.compile(Attend(), backend=backend, dynamic=True)(q, kv, kv)
    assert OP in _ops(graphs[0])


def test_a_mask_that_cannot_travel_as_arguments_is_refused_with_the_reason():
    q = torch.randn(1, 2, 64, 8)
    f = torch.compile(lambda q: mh.attention(q, q, q, mask=M.causal() & M.alibi(2),
                                             backend="blocksparse"),
                      backend="eager", fullgraph=True)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"band \(causal, sliding window\), key padding, or "
                                        r"band & key padding, not this alibi mask"):
        f(q)
    torch.testing.assert_close(torch.compile(lambda q: mh.attention(q, q, q, mask=M.alibi(2)),
                                             backend="eager", fullgraph=True)(q),
                               mh.attention(q, q, q, mask=M.alibi(2), backend="reference"))


@pytest.mark.parametrize("bad,match", [
    (dict(k_heads=3), "q has 4 heads and k/v have 3"),
    (dict(align="sideways"), "align must be one of"),
    (dict(padding=torch.tensor([99])), "length 99 > Sk = 20"),
    (dict(causal=False), r"window=4 needs causal=True .* or window=0 for no band"),
])
def test_the_operator_refuses_bad_arguments_as_attention_does(bad, match):
    """(A window without causal=True ran unmasked attention.)"""
    q = torch.randn(1, 4, 20, 8)
    k = torch.randn(1, bad.get("k_heads", 2), 20, 8)
    with pytest.raises(ValueError, match=match):
        OP(q, k, k, 0.3, bad.get("causal", True), 4, bad.get("align", "lower_right"),
           bad.get("padding"))


def test_the_operator_is_not_traced_off_the_cpu():
    """On a GPU its plan would read the device inside the graph (a sync, and no CUDA
    graph): the call goes to another backend there, with this reason."""
    from multihead.functional._call import make_call
    from multihead.functional.backend._blocksparse_op import band_of
    q = torch.empty(1, 2, 64, 8, device="meta")
    call = make_call(q, q, q, mask=M.sliding_window(8), scale=None, dropout_p=0.0,
                     return_weights=False, return_lse=False)
    assert "on the CPU only" in band_of(call)


@pytest.mark.parametrize("case", ["window", "lengths", "bool keys, upper-left causal"])
def test_the_operator_passes_torchs_own_checks(case):
    """Schema, fake tensors (shapes and strides from symbolic sizes, for a q laid out as a
    module's (B, S, H, D) transposed), autograd registration and AOT dispatch with dynamic
    shapes: ``torch.library.opcheck``, on both operators."""
    g = torch.Generator().manual_seed(2)
    q = torch.randn(2, 70, 4, 16, generator=g).transpose(1, 2).requires_grad_()
    k, v = (torch.randn(2, 2, 90, 16, generator=g, requires_grad=True) for _ in range(2))
    args = {"window": (True, 16, "lower_right", None),
            "lengths": (False, 0, "lower_right", torch.tensor([90, 0])),       # a row of 0
            "bool keys, upper-left causal": (True, 0, "upper_left",
                                             torch.rand(2, 90, generator=g) > 0.2)}[case]
    result = torch.library.opcheck(OP, (q, k, v, 0.25, *args))
    assert set(result.values()) == {"SUCCESS"}, result
    out, stats = OP(q, k, v, 0.25, *args)
    dout = torch.randn(out.shape, generator=g)
    result = torch.library.opcheck(torch.ops.multihead.blocksparse_backward.default,
                                   (dout, None, q.detach(), k.detach(), v.detach(),
                                    out.detach(), stats.detach(), 0.25, *args))
    assert set(result.values()) == {"SUCCESS"}, result


def test_the_operators_docstring_examples_run():
    """pytest's doctests do not see a custom operator's docstring (the op object has its
    own): the examples run here."""
    import doctest

    from multihead.functional.backend import _blocksparse_op
    for op in (_blocksparse_op.blocksparse, _blocksparse_op.blocksparse_backward):
        doc = op._init_fn.__doc__
        test = doctest.DocTestParser().get_doctest(doc, {}, op._init_fn.__name__, None, 0)
        runner = doctest.DocTestRunner(optionflags=doctest.NORMALIZE_WHITESPACE)
        runner.run(test)
        assert test.examples and runner.summarize(verbose=False).failed == 0

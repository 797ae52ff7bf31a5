"""The block-sparse Triton kernels (every mask of our model) against the fp64 oracle, under
Triton's interpreter on the CPU (compiled on a GPU): forward, lse and gradients for every
mask kind and composition of ``conftest.make_masks``, MHA/GQA/MQA, ``Sq != Sk`` both ways,
empty rows; the block lists against the materialized mask; the generated mask programs."""

from __future__ import annotations

import pytest
import torch

import multihead as mh
from conftest import MASK_NAMES, assert_kernel_matches_oracle, make_masks

triton = pytest.importorskip("triton")
from multihead.functional._call import make_call  # noqa: E402
from multihead.functional.backend import triton as tb  # noqa: E402
from multihead.kernels import ops  # noqa: E402
from multihead.kernels.flash_sparse import (KERNELS, block_lists, flatten, plan,  # noqa: E402
                                            sparse_backward, sparse_forward)
from multihead.kernels.mask_program import mask_program, source_of  # noqa: E402

M = mh.masks
DEV = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [  # B, H, Hkv, Sq, Sk, D
    (2, 4, 2, 40, 48, 16),         # GQA, Sq < Sk
    (2, 2, 1, 45, 30, 32),         # MQA, Sq > Sk: early rows of a lower-right band see nothing
    (1, 2, 2, 37, 37, 16),         # MHA
]
TILES = (16, 16, 4, 1)             # many blocks at these sizes: FULL, PARTIAL and EMPTY ones
KINDS = [n for n in MASK_NAMES if n != "none"]


def _inputs(B, H, Hkv, Sq, Sk, D, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g).to(DEV, torch.float16)  # noqa: E731
    return mk(B, H, Sq, D), mk(B, Hkv, Sk, D), mk(B, Hkv, Sk, D)


def _mask(name, B, H, Sq, Sk):
    return make_masks(B, H, Sq, Sk)[name].to(DEV)


def _reference(q, k, v, m):
    return mh.attention(q, k, v, mask=m, backend="reference", return_lse=True)


@pytest.mark.parametrize("config", [None, TILES], ids=["default", "tiles16"])
@pytest.mark.parametrize("shape", SHAPES, ids=[f"{s[3]}x{s[4]}-H{s[1]}kv{s[2]}" for s in SHAPES])
@pytest.mark.parametrize("name", KINDS)
def test_forward_and_lse_equal_the_fp64_oracle_for_every_mask(name, shape, config):
    B, H, Hkv, Sq, Sk, D = shape
    q, k, v = _inputs(B, H, Hkv, Sq, Sk, D)
    m = _mask(name, B, H, Sq, Sk)
    out, lse = sparse_forward(q, k, v, m, scale=D ** -0.5, config=config)
    assert_kernel_matches_oracle(out, lse, q, k, v, m)


def _grads(q, k, v, fn):
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out, lse = fn(*leaves)
    w = torch.randn(out.shape, generator=torch.Generator().manual_seed(7)).to(out.device, out.dtype)
    (out * w).sum().add(torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    return [t.grad for t in leaves]


@pytest.mark.parametrize("kv_tiles", [TILES, (16, 32, 4, 1)], ids=["queries-left", "keys-left"])
@pytest.mark.parametrize("shape", SHAPES[:2], ids=["GQA", "MQA"])
@pytest.mark.parametrize("name", KINDS)
def test_gradients_equal_the_fp64_oracle_for_every_mask(name, shape, kv_tiles):
    """dQ, dK, dV (summed over each GQA group) and the lse's gradient, with small tiles so
    the dK/dV loop walks transposed lists of FULL and PARTIAL query blocks; with 32 keys per
    dK/dV program it computes its blocks transposed, the mask program on transposed grids
    (keys_left)."""
    B, H, Hkv, Sq, Sk, D = shape
    q, k, v = _inputs(B, H, Hkv, Sq, Sk, D, seed=1)
    _assert_small_tile_gradients_match_the_oracle(q, k, v, _mask(name, B, H, Sq, Sk), kv_tiles)


def _assert_small_tile_gradients_match_the_oracle(q, k, v, m, kv_tiles):
    """dQ, dK, dV of the kernels at small tiles (``kv_tiles`` for dK/dV), with the lse in
    the loss, within twice an fp32 reference's error of the fp64 oracle (plus 4 eps)."""
    scale = q.shape[-1] ** -0.5

    class Small(torch.autograd.Function):          # ops.sparse with 16x16 tiles
        @staticmethod
        def forward(ctx, q, k, v):
            out, lse = sparse_forward(q, k, v, m, scale=scale, config=TILES)
            ctx.save_for_backward(q, k, v, out, lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, dlse):
            q, k, v, out, lse = ctx.saved_tensors
            return sparse_backward(dout, q, k, v, out, lse, m, scale=scale, dlse=dlse,
                                   config=(kv_tiles, TILES))

    got = _grads(q, k, v, Small.apply)
    ref = _grads(q.double(), k.double(), v.double(), lambda *t: _reference(*t, m))
    plain = _grads(q.float(), k.float(), v.float(), lambda *t: _reference(*t, m))
    for which, a, r, p in zip("qkv", got, ref, plain):
        err = (a.double() - r).abs().max()
        base = (p.to(q.dtype).double() - r).abs().max()
        assert torch.isfinite(a).all(), which
        assert err <= 2 * base + 4 * torch.finfo(q.dtype).eps * r.abs().max(), (which, err, base)


def test_the_operator_gives_gradients_with_the_default_tiles():
    B, H, Hkv, Sq, Sk, D = SHAPES[0]
    q, k, v = _inputs(B, H, Hkv, Sq, Sk, D, seed=2)
    m = _mask("window&document", B, H, Sq, Sk)
    got = _grads(q, k, v, lambda *t: ops.sparse(*t, m, D ** -0.5))
    ref = _grads(q.double(), k.double(), v.double(), lambda *t: _reference(*t, m))
    for a, r in zip(got, ref):
        torch.testing.assert_close(a.double(), r, atol=2e-2, rtol=2e-2)


def test_a_mask_written_after_the_forward_is_refused_by_the_backward():
    """The backward evaluates the mask again: written in place since the forward, it would
    differentiate another forward than the one that ran."""
    B, H, Hkv, Sq, Sk, D = SHAPES[0]
    q, k, v = (t.requires_grad_() for t in _inputs(B, H, Hkv, Sq, Sk, D, seed=2))
    m = M.padding(torch.tensor([Sk, 20], device=DEV)) & M.causal()
    out, _ = ops.sparse(q, k, v, m, D ** -0.5)
    m.a.lengths.copy_(torch.tensor([10, Sk]))
    with pytest.raises(RuntimeError, match="triton backward: a tensor of the mask"):
        out.float().sum().backward()


def test_the_sparse_operator_passes_torch_library_opcheck():
    """Schema, fake implementation, autograd registration (lists of tensors included) and
    the traced (AOT) forms agree with the kernels, checked by torch's op tester."""
    B, H, Hkv, Sq, Sk, D = SHAPES[0]
    q, k, v = (t.requires_grad_() for t in _inputs(B, H, Hkv, Sq, Sk, D, seed=4))
    m = _mask("~dense&alibi", B, H, Sq, Sk)
    prog, launches = plan(m, q, k, v, kernels=tuple(KERNELS))
    torch.library.opcheck(ops.flash_sparse, (q, k, v, 0.25, *flatten(prog, launches, Sq, Sk)))


def test_the_sparse_operators_refuse_a_plan_that_does_not_fit_the_call():
    """The operators take a plan as plain lists: one built for other lengths, blocks or a
    forward only would read out of bounds or give wrong numbers, so each is refused by name,
    as are backward inputs the forward did not give."""
    B, H, Hkv, Sq, Sk, D = SHAPES[0]
    q, k, v = _inputs(B, H, Hkv, Sq, Sk, D, seed=4)
    m = _mask("~dense&alibi", B, H, Sq, Sk)
    prog, launches = plan(m, q, k, v, kernels=tuple(KERNELS))
    source, tensors, ints, lists, configs = flatten(prog, launches, Sq, Sk)
    out, lse = ops.flash_sparse(q, k, v, 0.25, source, tensors, ints, lists, configs)
    bad = {"lengths": dict(configs=[Sq + 1] + configs[1:]),
           "blocks": dict(configs=configs[:2] + [16, 16] + configs[4:]),
           "block size": dict(configs=configs[:2] + [24] + configs[3:]),
           "lists": dict(lists=lists[:2]),
           "list dtype": dict(lists=[lists[0].long()] + lists[1:]),
           "no ints": dict(ints=[])}
    if DEV == "cpu":            # host lists are read (a device's would cost a sync)
        cols = lists[2].shape[-1]
        bad.update({"block id past the keys": dict(lists=lists[:2] + [lists[2] + cols] + lists[3:]),
                    "negative block id": dict(lists=lists[:2] + [lists[2] - cols] + lists[3:]),
                    "count past the row": dict(lists=[lists[0] + cols + 1] + lists[1:]),
                    "negative count": dict(lists=[lists[0]] + [lists[1] - 10**6] + lists[2:])})
    base = dict(source=source, tensors=tensors, ints=ints, lists=lists, configs=configs)
    for name, change in bad.items():
        with pytest.raises(ValueError, match="flash_sparse: .*(plan|config must be|block lists)"):
            ops.flash_sparse(q, k, v, 0.25, **{**base, **change})
        if "lists" in change and DEV == "cpu":
            with pytest.raises(ValueError, match="flash_sparse_backward: .*(block lists|plan)"):
                ops.flash_sparse_backward(torch.ones_like(out), None, q, k, v, out, lse, 0.25,
                                          **{**base, **change})
    forward_only = flatten(prog, launches[:1], Sq, Sk)
    args = (q, k, v, out, lse, 0.25)
    with pytest.raises(ValueError, match="flash_sparse_backward: the plan must hold"):
        ops.flash_sparse_backward(torch.ones_like(out), None, *args, *forward_only)
    with pytest.raises(ValueError, match="flash_sparse_backward: dout is torch.float32"):
        ops.flash_sparse_backward(torch.ones_like(out).float(), None, *args, source, tensors,
                                  ints, lists, configs)
    with pytest.raises(ValueError, match="flash_sparse_backward: dlse must have shape"):
        ops.flash_sparse_backward(torch.ones_like(out), lse[:, :1], *args, source, tensors,
                                  ints, lists, configs)
    with pytest.raises(ValueError, match="flash_sparse_backward: q has 4 heads, not a mult"):
        ops.flash_sparse_backward(torch.ones_like(out), None, q, k[:, :1].expand(-1, 3, -1, -1),
                                  v[:, :1].expand(-1, 3, -1, -1), out, lse, 0.25, source,
                                  tensors, ints, lists, configs)


def _counting_backend():
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return torch._dynamo.lookup_backend("aot_eager")(gm, example_inputs)
    return backend, graphs


@pytest.mark.parametrize("structure", ["document&alibi", "dense|causal", "bias&padding"])
def test_fullgraph_compile_traces_block_lists_and_kernels_and_a_new_mask_reuses_the_graph(
        structure):
    """Under ``torch.compile(fullgraph=True)`` the mask's plan (program, block lists) is
    traced into the graph and the kernels run as ``multihead::flash_sparse``: gradients
    equal the eager call's, and a second mask of the same structure with other values
    reuses the compiled graph."""
    B, H, Hkv, Sq, Sk, D = SHAPES[0]
    q, k, v = _inputs(B, H, Hkv, Sq, Sk, D, seed=5)
    g = torch.Generator().manual_seed(5)

    def mask():
        if structure == "document&alibi":
            ids = torch.sort(torch.randint(0, 4, (B, Sk), generator=g), dim=1).values
            return M.document(ids) & M.alibi(H)
        if structure == "dense|causal":
            return M.dense(torch.rand(B, 1, Sq, Sk, generator=g) > 0.7) | M.causal()
        return (M.bias(torch.randn(1, H, Sq, Sk, generator=g))
                & M.padding(torch.rand(B, Sk, generator=g) > 0.2))

    def loss(q, k, v, m):
        out, lse = ops.sparse(q, k, v, m, D ** -0.5)
        return out.float().square().sum() + torch.where(torch.isfinite(lse), lse, 0).sum()
    torch._dynamo.reset()                 # count this case's graphs only
    backend, graphs = _counting_backend()
    compiled = torch.compile(loss, fullgraph=True, backend=backend)
    results = []
    for _ in range(2):
        m = mask().to(DEV)
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        compiled(*leaves, m).backward()
        plain = [t.clone().requires_grad_() for t in (q, k, v)]
        loss(*plain, m).backward()
        for a, b in zip(leaves, plain):
            torch.testing.assert_close(a.grad, b.grad)
        results.append(leaves[0].grad)
    assert len(graphs) == 1
    assert "flash_sparse" in graphs[0].code
    assert not torch.equal(*results)                  # the second mask did change the result
    with torch.no_grad():                             # without gradients: the forward's lists
        out, lse = torch.compile(lambda *a: ops.sparse(*a, D ** -0.5), fullgraph=True,
                                 backend="aot_eager")(q, k, v, m)
    want, want_lse = ops.sparse(q, k, v, m, D ** -0.5)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("name", ["causal", "window&padding", "packed documents",
                                  "document&alibi", "alibi&causal"])
def test_every_route_of_the_backend_traces_whole_under_fullgraph_compile(name, triton_on_this_device):
    """``mh.attention(backend="triton")`` inside ``torch.compile(fullgraph=True)``, here on
    the CPU (the backend let onto it, the kernels interpreted): bands run the band operator,
    packed documents (whose host table a graph cannot read) and other masks the block lists
    traced into the graph (a mask without tensors too, whose tiles a plan once counted in
    the graph, failing on a data-dependent size); forward and gradients equal the eager
    call's."""
    B, H, Hkv, S, D = 2, 4, 2, 40, 16
    q, k, v = _inputs(B, H, Hkv, S, S, D, seed=6)
    g = torch.Generator().manual_seed(6)
    m = {"causal": M.causal(),
         "window&padding": M.sliding_window(7) & M.padding(torch.tensor([33, 18])),
         "packed documents": M.document(torch.arange(S) // 9),
         "document&alibi": M.document(torch.sort(torch.randint(0, 4, (B, S), generator=g),
                                                 dim=1).values) & M.alibi(H),
         "alibi&causal": M.alibi(H) & M.causal()}[name].to(DEV)
    fn = lambda *t: mh.attention(*t, mask=m, backend="triton", return_lse=True)  # noqa: E731
    torch._dynamo.reset()
    backend, graphs = _counting_backend()
    got = _grads(q, k, v, torch.compile(fn, fullgraph=True, backend=backend))
    want = _grads(q, k, v, fn)
    op = "flash_attention" if name in ("causal", "window&padding") else "flash_sparse"
    assert len(graphs) == 1 and f"multihead.{op}" in graphs[0].code
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("name", ["causal", "packed documents", "alibi"])
def test_double_backward_through_the_backend_equals_the_reference(name, triton_on_this_device):
    """A backward that builds a graph through the kernels (band, per-document and
    block-sparse routes, whose own backward is first-order only) gets the reference's
    gradients, which a second backward differentiates; with lse, GQA."""
    S = 40
    q, k, v = (t.requires_grad_() for t in _inputs(1, 4, 2, S, S, 16, seed=8))
    m = {"causal": M.causal(), "packed documents": M.document(torch.arange(S) // 9),
         "alibi": M.alibi(4)}[name].to(DEV)
    w = torch.randn(q.shape, generator=torch.Generator().manual_seed(9)).to(DEV)
    grads = []
    for backend in ("triton", "reference"):          # (a loss linear in the outputs: the
        out, lse = mh.attention(q, k, v, mask=m, backend=backend, return_lse=True)
        g = torch.autograd.grad((out * w).sum() + lse.sum(), (q, k, v),  # same gradients
                                create_graph=True)                       # flow into both)
        grads.append((*g, *torch.autograd.grad(sum(x.float().pow(2).sum() for x in g),
                                               (q, k, v))))
        node = out.grad_fn                   # triton: no second node, the kernels' own
        while backend == "triton" and node.name() == "ToCopyBackward0":  # Function gives
            node = node.next_functions[0][0]           # them (past the CPU run's casts)
        assert backend != "triton" or node.name() in ("_FlashBackward", "_SparseBackward")
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b)


@pytest.mark.parametrize("route", ["band", "sparse"])
def test_the_kernels_called_directly_refuse_a_backward_that_builds_a_graph(route):
    """Without the call's mask (kernels.ops called directly), the kernels' backward
    cannot give differentiable gradients: it says so instead of giving constants."""
    from multihead.kernels import ops
    q = torch.randn(1, 2, 32, 16, dtype=torch.float16, device=DEV, requires_grad=True)
    out, _ = (ops.attention(q, q, q, 0.25, True, 0, 0, None) if route == "band" else
              ops.sparse(q, q, q, M.alibi(2), 0.25))
    with pytest.raises(RuntimeError, match="first-order only"):
        torch.autograd.grad(out.float().sum(), q, create_graph=True)


@pytest.mark.parametrize("case", ["causal", "document&alibi", "decode"])
def test_changing_lengths_under_compile_trace_once_more_not_once_per_length(case,
                                                                            triton_on_this_device):
    """With ``torch.compile``'s automatic dynamic shapes, a second length retraces with
    symbolic sizes, and that graph serves every later length: planning and messages read
    no traced size (formatting one failed, or specialized the graph to it)."""
    torch._dynamo.reset()                 # no sizes remembered from another case's frames
    backend, graphs = _counting_backend()
    mask = {"causal": lambda S: M.causal(),
            "document&alibi": lambda S: M.document(torch.arange(S) // 7) & M.alibi(4),
            "decode": lambda S: M.causal()}[case]
    fn = lambda q, k, v, m: mh.attention(q, k, v, mask=m, backend="triton")  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, backend=backend)
    with torch.no_grad():
        for S in (32, 48, 61, 40):
            q, k, v = _inputs(2, 4, 2, 1 if case == "decode" else S, S, 16, seed=S)
            m = mask(S).to(DEV)
            torch.testing.assert_close(compiled(q, k, v, m), fn(q, k, v, m))
    assert len(graphs) == 2


def _sparse_grads(q, k, v, m, dout, config=TILES):
    """(out, dq, dk, dv) of the block-sparse kernels with small tiles."""
    out, lse = sparse_forward(q, k, v, m, scale=0.25, config=config)
    return (out, *sparse_backward(dout, q, k, v, out, lse, m, scale=0.25,
                                  config=(config, config)))


@pytest.mark.parametrize("side", ["key", "query"])
def test_hidden_nan_and_inf_never_reach_a_row_or_a_gradient(side):
    """The rule of ``multihead.functional.nonfinite`` kept by the kernels themselves (on a
    GPU nothing scans the inputs): padded positions full of NaN and inf, hidden by a bool
    padding mask, change no output and no gradient; the result equals the kernels' own on
    the same inputs with those positions zeroed."""
    B, H, Hkv, S, D = 2, 4, 2, 40, 16
    q, k, v = _inputs(B, H, Hkv, S, S, D, seed=8)
    real = torch.arange(S).expand(B, S) < torch.tensor([[29], [35]])      # (B, S)
    m = M.padding(real.to(DEV), side=side)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(8)).to(q)
    garbage = torch.tensor([float("nan"), float("inf"), -float("inf")], dtype=q.dtype)
    hidden = ~real[:, None, :, None]                                        # (B, 1, S, 1)

    def poisoned(t):
        fill = garbage[torch.arange(t.numel()) % 3].view(t.shape).to(t.device)
        return torch.where(hidden.to(t.device), fill, t)
    padded = (1, 2) if side == "key" else (0,)          # which of q, k, v the mask pads
    clean = [torch.where(hidden.to(t.device), 0, t) if i in padded else t
             for i, t in enumerate((q, k, v))]
    dirty = [poisoned(t) if i in padded else t for i, t in enumerate(clean)]
    got = _sparse_grads(*dirty, m, dout)
    want = _sparse_grads(*clean, m, dout)
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, want):   # hidden: exactly 0 in both
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, msg=name)


def test_a_row_that_sees_a_nan_value_is_nan_and_its_neighbours_are_not():
    """A NaN (head 0) or inf (head 1) in a value some rows of a block see and others do
    not: the rows that see it are NaN, output and lse, as the reference makes them; the
    others exact (0 * NaN inside the block's product would poison them)."""
    B, H, Hkv, S, D = 1, 2, 2, 32, 16
    q, k, v = _inputs(B, H, Hkv, S, S, D, seed=9)
    m = M.dense(torch.ones(S, S, dtype=torch.bool).tril().to(DEV))        # causal, as lists
    bad = v.clone()
    bad[:, 0, 20], bad[:, 1, 20] = float("nan"), float("inf")     # key 20: rows 20.. see it
    out, lse = sparse_forward(q, k, bad, m, scale=0.25, config=TILES)
    want, want_lse = sparse_forward(q, k, v, m, scale=0.25, config=TILES)
    # the rule as the CPU applies it (on a GPU nothing scans the reference's inputs)
    ref, ref_lse = mh.attention(q.float().cpu(), k.float().cpu(), bad.float().cpu(),
                                mask=m.to("cpu"), scale=0.25, backend="reference",
                                return_lse=True)
    assert out[:, :, 20:].isnan().all() and lse[:, :, 20:].isnan().all()
    assert ref[:, :, 20:].isnan().all() and ref_lse[:, :, 20:].isnan().all()
    assert torch.equal(out[:, :, :20], want[:, :, :20])
    assert torch.equal(lse[:, :, :20], want_lse[:, :, :20])


def _band_call(path, q, k, v):
    """(out, lse) of the band or decode kernel with a mask that shows key 20 to some rows
    and hides it from others: causal (rows 20.. see it), a window of 8 (rows 20..27), or
    the decode kernel's last 8 queries under that window (rows 24..27 of them)."""
    from multihead.kernels.decode import decode_forward
    from multihead.kernels.flash_fwd import flash_forward
    S = q.shape[2]
    if path == "decode":
        return decode_forward(q[:, :, -8:], k, v, scale=0.25, causal=True, window=8,
                              offset=S - 8, splits=2)
    return flash_forward(q, k, v, scale=0.25, causal=True,
                         window=8 if path == "window" else None, config=TILES)


@pytest.mark.parametrize("path", ["causal", "window", "decode"])
def test_band_kernels_keep_a_hidden_nan_value_out_of_the_rows_that_do_not_see_it(path):
    """The band and decode kernels' edge blocks hold keys some rows see and others do not:
    a NaN (head 0) or inf (head 1) in key 20's value makes the rows that see it NaN, output
    and lse, and leaves every other row exactly as without it (0 * NaN inside the block's
    product would poison them all)."""
    q, k, v = _inputs(1, 2, 2, 32, 32, 16, seed=11)
    bad = v.clone()
    bad[:, 0, 20], bad[:, 1, 20] = float("nan"), float("inf")
    out, lse = _band_call(path, q, k, bad)
    want, want_lse = _band_call(path, q, k, v)
    first = 32 - out.shape[2]                                   # the first query's position
    pos = torch.arange(first, 32)
    sees = (pos >= 20) & ((pos < 28) if path != "causal" else True)         # (rows,)
    assert sees.any() and (~sees).any()
    assert out[:, :, sees].isnan().all() and lse[:, :, sees].isnan().all()
    assert torch.equal(out[:, :, ~sees], want[:, :, ~sees])
    assert torch.equal(lse[:, :, ~sees], want_lse[:, :, ~sees])


def test_band_gradients_keep_a_hidden_nan_out_of_the_rows_and_keys_that_do_not_see_it():
    """Causal band backward: a NaN in key 20 reaches no dQ row before 20, and a NaN in
    query 10 no dK/dV row after 10 (each is hidden from them), as on clean inputs."""
    from multihead.kernels.flash_bwd import flash_backward
    from multihead.kernels.flash_fwd import flash_forward
    q, k, v = _inputs(1, 2, 2, 32, 32, 16, seed=12)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(12)).to(q)

    def grads(q, k):
        out, lse = flash_forward(q, k, v, scale=0.25, causal=True, config=TILES)
        return flash_backward(dout, q, k, v, out, lse, scale=0.25, causal=True,
                              config=(TILES, TILES))
    dq, _, _ = grads(q, k)
    _, dk, dv = grads(q, k)
    bad_k, bad_q = k.clone(), q.clone()
    bad_k[:, :, 20], bad_q[:, :, 10] = float("nan"), float("nan")
    got_dq, _, _ = grads(q, bad_k)
    _, got_dk, got_dv = grads(bad_q, k)
    assert torch.equal(got_dq[:, :, :20], dq[:, :, :20])
    assert got_dq[:, :, 20:].isnan().any()                 # the rows that see it: NaN
    assert torch.equal(got_dk[:, :, 11:], dk[:, :, 11:])
    assert torch.equal(got_dv[:, :, 11:], dv[:, :, 11:])


@pytest.mark.parametrize("path", ["sparse", "band"])
def test_a_broadcast_output_gradient_gives_the_same_gradients_as_a_dense_one(path):
    """``out.sum().backward()`` hands the backward a ``dout`` (and ``dlse``) of stride 0:
    the gradients equal those of the same values laid out densely (compiled on an H100,
    the block-sparse dK kernel once read such a tile wrongly)."""
    B, H, Hkv, Sq, Sk, D = SHAPES[0]
    q, k, v = _inputs(B, H, Hkv, Sq, Sk, D, seed=4)
    if path == "sparse":
        m = _mask("~dense&alibi", B, H, Sq, Sk)
        out, lse = sparse_forward(q, k, v, m, scale=0.25)
        grads = lambda do, dl: sparse_backward(do, q, k, v, out, lse, m, scale=0.25,  # noqa: E731
                                               dlse=dl)
    else:
        from multihead.kernels.flash_bwd import flash_backward
        from multihead.kernels.flash_fwd import flash_forward
        kw = dict(scale=0.25, causal=True, window=9)
        out, lse = flash_forward(q, k, v, **kw)
        grads = lambda do, dl: flash_backward(do, q, k, v, out, lse, dlse=dl, **kw)  # noqa: E731
    dout = torch.full((), 1.5, device=DEV, dtype=q.dtype).expand(out.shape)
    dlse = torch.full((), -1.0, device=DEV).expand(lse.shape)
    got = grads(dout, dlse)
    want = grads(dout.contiguous(), dlse.contiguous())
    for name, a, b in zip(["dq", "dk", "dv"], got, want):
        assert torch.isfinite(a).all(), name
        assert torch.equal(a, b), name


def test_the_sparse_backward_is_deterministic():
    B, H, Hkv, Sq, Sk, D = SHAPES[0]
    q, k, v = _inputs(B, H, Hkv, Sq, Sk, D, seed=3)
    m = _mask("causal|dense", B, H, Sq, Sk)
    out, lse = sparse_forward(q, k, v, m, scale=0.25, config=TILES)
    dout = torch.randn_like(out)
    runs = [sparse_backward(dout, q, k, v, out, lse, m, scale=0.25, config=(TILES, TILES))
            for _ in range(2)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))


@pytest.mark.parametrize("by_key", [False, True], ids=["per query block", "per key block"])
@pytest.mark.parametrize("name", KINDS)
def test_block_lists_cover_every_allowed_pair_and_full_blocks_are_full(name, by_key):
    """Every allowed pair lies in a listed block; a FULL block has only allowed pairs and
    lies inside both sequences; no block is listed twice."""
    B, H, Sq, Sk, bm, bn = 2, 4, 37, 45, 8, 16
    m = _mask(name, B, H, Sq, Sk)
    allowed = m.materialize(Sq, Sk).expand(B, H, Sq, Sk).cpu()              # (B, H, Sq, Sk)
    n_full, n_part, index = (t.cpu() for t in block_lists(m, Sq, Sk, bm, bn, DEV, by_key=by_key))
    rows, cols = (bn, bm) if by_key else (bm, bn)
    a = allowed.transpose(-1, -2) if by_key else allowed              # (B, H, rows, cols)
    R, C = -(-a.shape[2] // rows), -(-a.shape[3] // cols)
    for b in range(B):
        for h in range(H):
            bl, hl = min(b, n_full.shape[0] - 1), min(h, n_full.shape[1] - 1)
            for r in range(R):
                nf, np_ = int(n_full[bl, hl, r]), int(n_part[bl, hl, r])
                listed = index[bl, hl, r, :nf + np_].tolist()
                assert len(set(listed)) == len(listed)
                tile = a[b, h, r * rows:(r + 1) * rows]                 # (rows, all cols)
                for c in range(C):
                    blk = tile[:, c * cols:(c + 1) * cols]
                    if blk.any():
                        assert c in listed, (b, h, r, c)
                for c in listed[:nf]:
                    blk = tile[:, c * cols:(c + 1) * cols]
                    assert blk.shape == (rows, cols) and blk.all(), (b, h, r, c)


def test_block_lists_are_built_once_per_mask_and_lengths():
    m = M.document(torch.arange(64) // 10) & M.causal()
    first = block_lists(m, 64, 64, 16, 16, "cpu")
    assert block_lists(m, 64, 64, 16, 16, "cpu") is first
    assert block_lists(m, 64, 64, 16, 32, "cpu") is not first


def test_a_mask_program_reads_only_the_structure_and_refuses_a_user_subclass():
    """Window sizes are arguments, not code: one compiled kernel for every size."""
    assert source_of(M.sliding_window(4), 8, 8) == source_of(M.sliding_window(9), 30, 30)
    src = source_of(M.document(torch.arange(8) // 3) & M.alibi(2), 8, 8)
    assert "==" in src and "tl.abs" in src

    class Mine(M.Window):
        pass

    class Stronger(M.ALiBi):                  # keeps the kind "alibi", redefines the bias
        def _bias(self, ix):
            return 2 * super()._bias(ix)

    with pytest.raises(ValueError, match="no Triton form for Mine"):
        mask_program(Mine(3), 8, 8, "cpu")
    q = torch.randn(1, 2, 8, 16, dtype=torch.float16)
    for m in (Mine(3), M.causal() & Stronger(2)):
        e = mh.explain(q, q, q, mask=m, profile="h100")
        row = next(r for r in e.rows if r.name == "triton")
        assert row.plan is None and any("custom" in r or "no Triton form" in r
                                        for r in row.reasons), row.reasons


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")   # the interpreter
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_a_bias_of_finfo_min_is_a_number_not_a_mask(dtype):
    """HF-style "masked" values (finfo.min) are finite: a row of them averages its values,
    as the oracle does, and the gradients stay finite (base 2 would overflow to -inf)."""
    q, k, v = _inputs(1, 4, 4, 32, 32, 16, seed=8)
    b = torch.zeros(1, 1, 32, 32, dtype=dtype)
    b[0, 0, 3] = torch.finfo(dtype).min                       # a whole row
    b[0, 0, 5, :7] = torch.finfo(dtype).min                   # part of one
    m = M.bias(b.to(DEV))
    out, lse = sparse_forward(q, k, v, m, scale=0.25, config=TILES)
    ref, ref_lse = mh.attention(q.double(), k.double(), v.double(), mask=m, scale=0.25,
                                backend="reference", return_lse=True)
    torch.testing.assert_close(out.double(), ref, atol=4e-3, rtol=4e-3)
    huge = ref_lse < -1e37             # every score ~finfo.min: clamped in base 2, finite
    torch.testing.assert_close(lse[~huge].double(), ref_lse[~huge], atol=1e-4, rtol=1e-4)
    assert huge.sum() == 4 and (lse[huge] < -1e38).all()     # row 3 of each head
    grads = sparse_backward(torch.randn_like(out), q, k, v, out, lse, m, scale=0.25,
                            config=(TILES, TILES))
    assert all(torch.isfinite(g).all() for g in grads)


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")   # the interpreter
@pytest.mark.parametrize("value", [-1e7, -1e30, torch.finfo(torch.float32).min, 1e30],
                         ids=["-1e7", "-1e30", "finfo.min", "+1e30"])
@pytest.mark.parametrize("structure", ["bias", "bias&causal"])
def test_rows_only_a_huge_bias_reaches_get_the_oracles_gradients(structure, value):
    """A row whose every visible score carries a huge finite bias has an lse too large to
    hold its softmax's sum (log2 of it is below half an ulp): the backward recomputes that
    row's maximum and sum instead of reading them from the lse (each of its probabilities
    was ``l`` times too large; at -1e7 part of it is lost). Row 3 carries the bias on every
    key (a positive one: on keys 2 and 6, a tie); row 5 on its first 7 keys, which a
    negative bias leaves an ordinary row and a positive one a tie of 7. With causal, dK/dV
    run transposed (keys left)."""
    B, H, Hkv, Sq, Sk, D = SHAPES[0]
    q, k, v = _inputs(B, H, Hkv, Sq, Sk, D, seed=13)
    b = torch.zeros(1, 1, Sq, Sk)
    if value < 0:
        b[0, 0, 3] = value
    else:
        b[0, 0, 3, [2, 6]] = value
    b[0, 0, 5, :7] = value
    m = M.bias(b.to(DEV))
    if structure == "bias&causal":
        m = m & M.causal()
    _assert_small_tile_gradients_match_the_oracle(
        q, k, v, m, TILES if structure == "bias" else (16, 32, 4, 1))


def test_a_float64_bias_past_float32s_range_saturates_instead_of_masking():
    """A float64 tile of -1e39 (finite) is added as float32's most negative number, as
    every torch backend adds it: a row of it averages its values; -inf still masks."""
    q, k, v = _inputs(1, 2, 2, 32, 32, 16, seed=10)
    b = torch.zeros(1, 1, 32, 32, dtype=torch.float64)
    b[0, 0, 3] = -1e39
    b[0, 0, 7, :5], b[0, 0, 7, 5] = -1e39, float("-inf")
    m = M.bias(b.to(DEV))
    assert "3.4e38" in source_of(m, 32, 32)
    out, _ = sparse_forward(q, k, v, m, scale=0.25, config=TILES)
    ref = mh.attention(q.float(), k.float(), v.float(), mask=m, scale=0.25,
                       backend="reference")
    torch.testing.assert_close(out.float(), ref, atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(out[0, :, 3].float(), v[0].float().mean(-2), atol=4e-3,
                               rtol=4e-3)                          # uniform: not zeros


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")   # the interpreter
def test_opposite_extreme_biases_cancel_as_in_the_oracle():
    """finfo.max in one bias tile and finfo.min in another add to 0, as in the oracle (in
    base 2 each would overflow, to +inf and -inf, and their sum be NaN unclamped); a lone
    finfo.max score takes its row's whole weight."""
    q, k, v = _inputs(1, 2, 2, 32, 32, 16, seed=9)
    top, bottom = torch.zeros(1, 1, 32, 32), torch.zeros(1, 1, 32, 32)
    top[0, 0, 4:9], bottom[0, 0, 4:9] = torch.finfo(torch.float32).max, torch.finfo(torch.float32).min
    alone = torch.zeros(1, 1, 32, 32)
    alone[0, 0, 11, 6] = torch.finfo(torch.float32).max
    for m in (M.bias(top.to(DEV)) & M.bias(bottom.to(DEV)), M.bias(alone.to(DEV))):
        out, lse = sparse_forward(q, k, v, m, scale=0.25, config=TILES)
        ref = mh.attention(q.double(), k.double(), v.double(), mask=m, scale=0.25,
                           backend="reference")
        assert torch.isfinite(out).all()
        torch.testing.assert_close(out.double(), ref, atol=4e-3, rtol=4e-3)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "posinf"])
@pytest.mark.parametrize("tiles", [1, 2], ids=["one-tile", "two-tiles"])
def test_a_nan_or_posinf_bias_entry_gives_its_row_nan_as_the_oracle_does(bad, dtype, tiles):
    """A device bias is never scanned, so a NaN or +inf entry written into it reaches the
    kernel: its row is NaN, as in the oracle and torch, not clamped to a finite row; the
    other rows are untouched."""
    q, k, v = _inputs(1, 2, 2, 32, 32, 16, seed=12)
    b = torch.zeros(1, 1, 32, 32, dtype=dtype, device=DEV)
    m = M.bias(b) if tiles == 1 else M.bias(b) & M.bias(torch.zeros_like(b))
    b[0, 0, 3, 5] = bad                              # after the build: as a GPU bias may be
    out, lse = sparse_forward(q, k, v, m, scale=0.25, config=TILES)
    ref, ref_lse = mh.attention(q.double(), k.double(), v.double(), mask=m, scale=0.25,
                                backend="reference", return_lse=True)
    assert out[0, :, 3].isnan().all() and lse[0, :, 3].isnan().all()
    assert ref[0, :, 3].isnan().all()
    rest = [i for i in range(32) if i != 3]
    torch.testing.assert_close(out[0, :, rest].double(), ref[0, :, rest], atol=4e-3, rtol=4e-3)


def test_the_backend_routes_non_band_masks_to_the_block_lists_and_says_so():
    q = torch.empty(2, 16, 4096, 128, dtype=torch.bfloat16)
    ids = torch.arange(4096) // 512                       # 8 documents on the host
    e = mh.explain(q, q, q, mask=M.document(ids) & M.alibi(16), profile="h100",
                   backend="triton")
    # 8 documents of 512 in 128x64 blocks: each one's 4 x 8 blocks of the 32 x 64 in all:
    # 256 / 2048 = 12.5%
    assert "block lists: 12.5% of the pairs visited" in str(e), str(e)
    band = tb._band(make_call(q, q, q, mask=M.causal(), scale=None, dropout_p=0.0,
                              return_weights=False, return_lse=False))
    assert isinstance(band, tb.Band)                      # bands keep the band kernels


def test_the_sparse_kernels_refuse_bad_input_by_name():
    q = torch.randn(1, 2, 8, 16, dtype=torch.float16, device=DEV)
    with pytest.raises(ValueError, match="sparse_forward: mask: .*batch size 3"):
        sparse_forward(q, q, q, M.padding(torch.tensor([1, 2, 3])), scale=1.0)
    with pytest.raises(ValueError, match="sparse_forward: q is torch.float32"):
        sparse_forward(q.float(), q, q, M.alibi(2), scale=1.0)
    with pytest.raises(TypeError, match="sparse_forward: mask must be a multihead.masks.Mask, "
                                        "got NoneType: without a mask, call .*flash_forward"):
        sparse_forward(q, q, q, None, scale=1.0)
    with pytest.raises(ValueError, match="sparse_forward: scale must be a finite number, got "
                                         "None"):
        sparse_forward(q, q, q, M.alibi(2), scale=None)
    out, lse = sparse_forward(q, q, q, M.alibi(2), scale=1.0)
    with pytest.raises(ValueError, match="sparse_backward: lse must have shape"):
        sparse_backward(out, q, q, q, out, lse[:, :1], M.alibi(2), scale=1.0)


@pytest.mark.cuda
def test_a_device_mask_runs_without_a_host_sync_on_cuda():
    """Block lists of a mask whose tensors are on the GPU are built there: no sync."""
    B, H, S = 2, 4, 512
    q = torch.randn(B, H, S, 64, device="cuda", dtype=torch.bfloat16)
    ids = torch.sort(torch.randint(0, 6, (B, S), device="cuda"), dim=1).values
    m = M.document(ids) & M.causal()
    ref = mh.attention(q.float(), q.float(), q.float(), mask=m, backend="reference")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        out = mh.attention(q, q, q, mask=m, backend="triton")
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.testing.assert_close(out.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.cuda
@pytest.mark.parametrize("name", ["window", "causal", "cu_seqlens", "ids & causal", "alibi",
                                  "padding", "window & alibi"])
def test_a_training_step_on_the_kernels_never_syncs_on_cuda(name):
    """Forward and backward on the kernels, with masks built from host data and moved (the
    recommended way) and with device ids: with a mask built afresh and a cached one, no
    synchronizing CUDA call (a sync per step leaves the GPU idle while the host prepares
    the next step)."""
    from nosync import cuda_sync_is_an_error
    B, H, S = (1 if name == "cu_seqlens" else 2), 4, 1000
    ids = torch.sort(torch.randint(0, 7, (B, S), device="cuda"), dim=1).values
    build = {"window": lambda: M.sliding_window(100), "causal": M.causal,
             "cu_seqlens": lambda: M.document(cu_seqlens=torch.tensor([0, 100, 613, S]))
             .to("cuda"),
             "ids & causal": lambda: M.document(ids) & M.causal(), "alibi": lambda: M.alibi(H),
             "padding": lambda: M.padding(torch.tensor([S, 377])).to("cuda"),
             "window & alibi": lambda: M.sliding_window(64) & M.alibi(H)}[name]
    q, k, v = (torch.randn(B, H, S, 64, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for _ in range(3))
    dout = torch.randn(B, H, S, 64, device="cuda", dtype=torch.bfloat16)
    step = lambda mask: torch.autograd.backward(                         # noqa: E731
        mh.attention(q, k, v, mask=mask, backend="triton"), dout)
    step(build())                                                # compiles the kernels
    mh.functional.dispatch.clear_cache()
    with cuda_sync_is_an_error():
        mask = build()
        step(mask)                                               # decided afresh
        step(mask)                                               # cached
    assert all(torch.isfinite(t.grad).all() for t in (q, k, v))


@pytest.mark.cuda
def test_attention_under_fullgraph_compile_runs_any_mask_on_the_kernels_on_cuda():
    """``mh.attention(backend="triton")`` traced whole: a device-id document mask with
    ALiBi trains through ``multihead::flash_sparse`` as it does eagerly."""
    B, H, S = 2, 4, 600
    g = torch.Generator().manual_seed(11)
    q, k, v = (torch.randn(B, H, S, 64, generator=g).to("cuda", torch.bfloat16)
               for _ in range(3))
    ids = torch.sort(torch.randint(0, 5, (B, S), generator=g), dim=1).values.to("cuda")
    m = M.document(ids) & M.alibi(H)
    fn = lambda *t: mh.attention(*t, mask=m, backend="triton", return_lse=True)  # noqa: E731
    got = _grads(q, k, v, torch.compile(fn, fullgraph=True))
    want = _grads(q, k, v, fn)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name", ["document", "dense", "bias", "padding_left_bool",
                                  "window&document", "causal|dense", "~dense&alibi"])
def test_block_lists_and_mask_programs_of_device_masks_never_read_the_device(name):
    """On the ``meta`` device (a stand-in GPU) under NoReadBack, which fails on any read of
    device data: the tile map, the sorted lists and the program's arguments stay there."""
    from nosync import NoReadBack
    m = make_masks(2, 4, 64, 64)[name].to("meta")
    with NoReadBack():
        n_full, n_part, index = block_lists(m, 64, 64, 16, 16, "meta")
        block_lists(m, 64, 64, 16, 16, "meta", by_key=True)
        prog = mask_program(m, 64, 64, "meta")
    assert index.device.type == "meta" and index.shape[-2:] == (4, 4)
    assert all(t.device.type == "meta" for t in prog.tensors)


# -- packed documents, scheduled per (document, block) ----------------------------------------

from multihead.kernels.flash_bwd import flash_backward  # noqa: E402
from multihead.kernels.flash_fwd import flash_forward  # noqa: E402

DOC_LENGTHS = [[10, 33, 1, 26], [70]]      # per batch row; a one-token document among them


def _documents(lengths=DOC_LENGTHS):
    ids = torch.tensor([sum(([i] * n for i, n in enumerate(row)), []) for row in lengths])
    return M.document(ids)


@pytest.mark.parametrize("config", [None, TILES], ids=["default", "tiles16"])
@pytest.mark.parametrize("band", ["none", "causal", "window 5"])
def test_packed_documents_run_one_program_per_document_block(band, config):
    """Documents (with a band) through the band kernels' per-document schedule: forward,
    lse and gradients against the fp64 oracle, GQA, documents crossing block edges."""
    B, H, Hkv, S, D = 2, 4, 2, 70, 16
    q, k, v = _inputs(B, H, Hkv, S, S, D, seed=5)
    m = _documents()
    if band != "none":
        m = m & (M.causal() if band == "causal" else M.sliding_window(5))
    m = m.to(DEV)
    route = tb._band(make_call(q, k, v, mask=m, scale=None, dropout_p=0.0,
                               return_weights=False, return_lse=False))
    assert isinstance(route, tb.Band) and route.documents.tolist() == [
        [0, 0, 10], [0, 10, 33], [0, 43, 1], [0, 44, 26], [1, 0, 70]]
    kw = dict(scale=D ** -0.5, causal=route.causal, window=route.window,
              documents=route.documents)
    out, lse = flash_forward(q, k, v, config=config, **kw)
    ref, ref_lse = _reference(q.double(), k.double(), v.double(), m)
    torch.testing.assert_close(out.double(), ref, atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-4)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(6)).to(DEV, out.dtype)
    got = flash_backward(dout, q, k, v, out, lse, config=(config, config) if config else None,
                         **kw)
    leaves = [t.double().requires_grad_() for t in (q, k, v)]
    mh.attention(*leaves, mask=m, backend="reference").backward(dout.double())
    for a, t in zip(got, leaves):
        torch.testing.assert_close(a.double(), t.grad, atol=2e-2, rtol=2e-2)


def test_documents_the_host_cannot_see_go_to_the_block_lists():
    q = torch.empty(1, 2, 64, 16, dtype=torch.float16)

    def route(m):
        return tb._band(make_call(q, q, q, mask=m, scale=None, dropout_p=0.0,
                                  return_weights=False, return_lse=False))
    ids = torch.arange(64) // 20
    assert isinstance(route(M.document(ids)), tb.Band)
    split = torch.tensor([0] * 10 + [1] * 20 + [0] * 34)          # document 0 in two runs
    assert isinstance(route(M.document(split)), tb.Sparse)
    assert isinstance(route(M.document(ids) & M.padding(torch.tensor([50]))), tb.Sparse)
    e = mh.explain(torch.empty(1, 16, 16384, 128, dtype=torch.bfloat16, device="meta"),
                   torch.empty(1, 16, 16384, 128, dtype=torch.bfloat16, device="meta"),
                   torch.empty(1, 16, 16384, 128, dtype=torch.bfloat16, device="meta"),
                   mask=(M.document(torch.arange(16384) // 1024) & M.causal()).to("meta"),
                   profile="h100")
    assert e.chosen == "triton" and "16 packed documents, one program per" in str(e)


@pytest.mark.parametrize("docs, match", [
    (torch.tensor([[0, 0, 30], [0, 30, 30]]), "cover each of the 1 sequences of 64"),
    (torch.tensor([[0, 0, 64], [0, 0, 64]]), "exactly once"),
    (torch.tensor([[1, 0, 64]]), "exactly once"),
    (torch.tensor([[0.0, 0.0, 64.0]]), "integer tensor"),
])
def test_a_bad_document_table_is_refused_by_name(docs, match):
    q = torch.randn(1, 2, 64, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match=f"flash_forward: documents .*{match}"):
        flash_forward(q, q, q, scale=1.0, documents=docs)
    with pytest.raises(ValueError, match="Sq == Sk"):
        flash_forward(q, q[:, :, :32], q[:, :, :32], scale=1.0,
                      documents=torch.tensor([[0, 0, 64]]))
    with pytest.raises(ValueError, match="documents or kv_lengths, not both"):
        flash_forward(q, q, q, scale=1.0, documents=torch.tensor([[0, 0, 64]]),
                      kv_lengths=torch.tensor([50]))


def test_a_document_table_is_checked_and_scheduled_once_until_it_changes():
    """The backend hands the kernels the same table each step (cached on the mask); its
    check and device schedule are derived once, and again after an in-place change."""
    from multihead.kernels._band import schedule
    q = torch.randn(1, 2, 64, 16, dtype=torch.float16, device=DEV)
    m = M.document(cu_seqlens=torch.tensor([0, 20, 40, 60, 64])).to(DEV)  # runs on the host
    call = make_call(q, q, q, mask=m, scale=None, dropout_p=0.0, return_weights=False,
                     return_lse=False)
    docs = tb._band(call).documents
    again = make_call(q, q, q, mask=m, scale=None, dropout_p=0.0, return_weights=False,
                      return_lse=False)
    assert tb._band(again).documents is docs
    first, grid = schedule(docs, 16, 2, 64, 2, q)
    assert schedule(docs, 16, 2, 64, 2, q)[0] is first
    assert grid == (7, 2)                               # blocks of 16: 2 + 2 + 2 + 1
    flash_forward(q, q, q, scale=1.0, documents=docs)
    docs[0, 2] = 30                                     # now overlaps the next document
    with pytest.raises(ValueError, match="exactly once"):
        flash_forward(q, q, q, scale=1.0, documents=docs)


def test_a_growing_decoding_loop_plans_the_triton_kernel_twice_per_doubling(triton_on_this_device):
    """A decoding step with no mask in effect (causal, one query): the split-K kernel's plan
    holds at any key length, so a cache growing across 64 keys plans twice below it and twice
    above, and every step equals the fp64 oracle of its own keys."""
    from unittest import mock
    from multihead.functional import dispatch, registry
    from conftest import oracle
    q, k, v = _inputs(1, 4, 2, 1, 68, 16, seed=3)
    be = registry.get("triton")
    dispatch.clear_cache()
    with mock.patch.object(be, "plan", side_effect=be.plan) as planned:
        for t in range(60, 68):
            got = mh.attention(q, k[:, :, :t], v[:, :, :t], mask=M.causal(), backend="triton")
            want = oracle(q, k[:, :, :t], v[:, :, :t], M.causal())
            torch.testing.assert_close(got.double(), want, atol=2e-3, rtol=2e-3)
    assert planned.call_count == 4


def _padded_window_steps(backend):
    """A left-padded prompt, then three decoding steps (one with a padded slot) of a GQA
    module whose window and ALiBi count tokens (at_positions over the cache's padding)."""
    torch.manual_seed(0)
    attn = mh.MultiHeadAttention(64, 8, num_kv_heads=2, backend=backend).to(DEV).eval()
    attn = attn.to(torch.float16) if backend == "triton" else attn.double()
    g = torch.Generator().manual_seed(2)
    x = lambda n: torch.randn(2, n, 64, generator=g).to(DEV, attn.out_proj.weight.dtype)  # noqa: E731
    valid = torch.arange(19, device=DEV)[None] >= torch.tensor([[0], [6]], device=DEV)
    cache, mask = attn.make_cache(2, 40), M.sliding_window(5) & M.alibi(8)
    with torch.no_grad():
        out = [attn(x(19), cache=cache, mask=mask, valid=valid)]
        out.append(attn(x(1), cache=cache, mask=mask,
                        valid=torch.tensor([[True], [False]], device=DEV)))
        out += [attn(x(1), cache=cache, mask=mask) for _ in range(2)]
    return out


def test_a_padded_cache_with_a_window_and_alibi_decodes_on_the_kernels(triton_on_this_device):
    """A padded KV cache puts its window and ALiBi at token positions (``at_positions``):
    the kernels run those masks from the positions (refused before), prompt and steps equal
    the module computed in fp64 on the reference backend."""
    got, want = _padded_window_steps("triton"), _padded_window_steps("reference")
    for g, w in zip(got, want):
        torch.testing.assert_close(g.double(), w, atol=3e-3, rtol=3e-3)


def test_a_step_of_few_queries_runs_16_row_tiles_and_visits_the_window_alone():
    """A padded cache's step (1 query, 4096 slots, a window of 256 tokens) plans the
    block-sparse forward with 16-row tiles (128 before: 127 rows computed for nothing) and
    key blocks of the window's tokens only (all 64 before); a prompt keeps 128-row tiles."""
    from multihead.masks.positioned import distances_in_tokens
    valid = torch.arange(4096) >= torch.tensor([[0], [700]])                   # (2, 4096)
    for sq, rows, blocks in ((1, 16, 4), (16, 16, 5), (17, 128, 5)):    # of 64 keys each
        m = distances_in_tokens(M.causal() & M.sliding_window(256), valid, sq) & M.padding(valid)
        q = torch.zeros(2, 4, sq, 128, dtype=torch.float16)
        kv = torch.zeros(2, 2, 4096, 128, dtype=torch.float16)
        _, (fwd,) = plan(m, q, kv, kv, kernels=("fwd",))
        n_full, n_part, _ = fwd.lists
        assert fwd.config[0] == rows
        assert (n_full + n_part).flatten().tolist() == [blocks, blocks], sq


def test_at_positions_of_a_custom_mask_is_refused_by_name():
    class Even(M.Mask):
        def _allowed(self, ix):
            return (ix.k % 2) == 0

        def _tile_bounds(self, tx):
            return torch.ones(1, 1, 1, 1, dtype=torch.bool), torch.zeros(1, 1, 1, 1,
                                                                         dtype=torch.bool)
    m = M.at_positions(Even(), torch.arange(8), torch.arange(8))
    q = torch.randn(1, 2, 8, 16, dtype=torch.float16)
    call = make_call(q, q, q, mask=m, scale=None, dropout_p=0.0, return_weights=False,
                     return_lse=False)
    assert "no Triton form for Even" in tb.TritonFlash().check(call)
    placed = M.at_positions(M.causal(), torch.arange(8), torch.arange(8))
    with pytest.raises(ValueError, match="at token positions it runs causal, sliding_window"):
        mask_program(type(placed)(M.padding(torch.tensor([3])), torch.arange(8),
                                  torch.arange(8)), 8, 8, "cpu")


def test_a_padded_caches_window_and_alibi_load_their_positions_once_per_block():
    """distances_in_tokens places the window and ALiBi each at the same positions: the
    program loads the query and the key positions once, not once per leaf."""
    from multihead.masks.positioned import distances_in_tokens
    valid = torch.tensor([[False, True, True, True, True]])
    m = distances_in_tokens(M.causal() & M.sliding_window(3) & M.alibi(2), valid, 2)
    p = mask_program(m, 2, 5, "cpu")
    assert len(p.tensors) == 3                  # q positions, k positions, slopes
    assert source_of(m, 2, 5, "cpu").count("tl.load") == 3

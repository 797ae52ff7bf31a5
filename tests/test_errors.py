"""Every bad input gets a ValueError/TypeError naming the argument, the value and the fix."""

import math
import re

import pytest
import torch

import multihead as mh

M = mh.masks
q = torch.randn(2, 4, 5, 8)
k = v = torch.randn(2, 2, 7, 8)

BAD = [
    ("3-D q", lambda: mh.attention(torch.randn(2, 5, 32), k, v), ValueError,
     r"q must be 4-D \(B, H, Sq, D\), got shape \(2, 5, 32\).*MultiHeadAttention"),
    ("list q", lambda: mh.attention([1, 2], k, v), TypeError, r"q must be a torch.Tensor"),
    ("int dtype", lambda: mh.attention(q.long(), k, v), TypeError, r"q has dtype torch.int64.*float"),
    ("mixed dtype", lambda: mh.attention(q, k.double(), v), TypeError, r"share a dtype.*\.to\("),
    ("batch", lambda: mh.attention(q, torch.randn(3, 2, 7, 8), torch.randn(3, 2, 7, 8)), ValueError,
     r"batch sizes differ: q \(2, 4, 5, 8\), k \(3, 2, 7, 8\)"),
    ("head_dim", lambda: mh.attention(q, torch.randn(2, 2, 7, 6), v), ValueError,
     r"head_dim of q \(8\) and k \(6\) must match"),
    ("kv mismatch", lambda: mh.attention(q, k, torch.randn(2, 2, 6, 8)), ValueError,
     r"k \(2, 2, 7, 8\) and v \(2, 2, 6, 8\) must agree"),
    ("gqa", lambda: mh.attention(q, torch.randn(2, 3, 7, 8), torch.randn(2, 3, 7, 8)), ValueError,
     r"q has 4 heads and k/v have 3.*one of \[1, 2, 4\]"),
    ("mask broadcast", lambda: mh.attention(q, k, v, mask=M.dense(torch.ones(5, 6, dtype=torch.bool))),
     ValueError, r"dense\(shape \(1, 1, 5, 6\)\) does not broadcast to \(B, H, Sq, Sk\) = \(2, 4, 5, 7\) "
                 r"\(Sk 6 where the inputs have 7\)"),
    ("key padding as dense", lambda: mh.attention(q, k, v, mask=torch.ones(2, 7, dtype=torch.bool)),
     ValueError, r"\(B, Sk\) key padding mask goes in as mh\.masks\.padding\(mask\)"),
    ("key padding as bias", lambda: mh.attention(q, k, v, mask=torch.zeros(2, 7)),
     ValueError, r"\(B, Sk\) key padding bias goes in as mask\[:, None, None, :\]"),
    ("mask dtype", lambda: mh.attention(q, k, v, mask=torch.ones(5, 7, dtype=torch.int32)), TypeError,
     r"mask has dtype torch.int32.*: mask\.bool\(\) where nonzero means may attend; a "
     r"torch\.nn\.MultiheadAttention mask, where nonzero means ignore, is ~mask\.bool\(\)"),
    ("bias with NaN", lambda: mh.attention(q, k, v, mask=torch.zeros(5, 7).index_fill_(1, torch.tensor([2, 4]), math.nan)),
     ValueError, r"bias contains NaN or \+inf \(10 of 35 values; the first at index \(0, 2\): nan\).*"
                 r"torch\.where\(bias\.isnan\(\), float\('-inf'\), bias\)"),
    ("dense dtype", lambda: M.dense(torch.ones(5, 7)), TypeError, r"bool tensor.*bias"),
    ("padding batch", lambda: mh.attention(q, k, v, mask=M.padding(torch.tensor([1, 2, 3]))),
     ValueError, r"batch size 3.*batch size 2"),
    ("padding too long", lambda: mh.attention(q, k, v, mask=M.padding(torch.tensor([9, 2]))),
     ValueError, r"length 9 > Sk = 7"),
    ("alibi heads", lambda: mh.attention(q, k, v, mask=M.alibi(3)), ValueError,
     r"built for 3 heads.*num_heads=4"),
    ("mask device", lambda: mh.attention(q.to("meta"), k.to("meta"), v.to("meta"),
                                         mask=M.padding(torch.tensor([1, 2]))),
     ValueError, r"holds a tensor on cpu, but the inputs are on meta: move it with mask.to\('meta'\)"),
    ("dropout", lambda: mh.attention(q, k, v, dropout_p=1.0), ValueError, r"dropout_p must be.*\[0, 1\).*1.0"),
    ("dropout neg", lambda: mh.attention(q, k, v, dropout_p=-0.1), ValueError, r"dropout_p"),
    ("dropout tensor", lambda: mh.attention(q, k, v, dropout_p=torch.tensor(0.1)), ValueError,
     r"got tensor\(0.1000\) \(a Tensor\): pass a Python float in \[0, 1\) \(a tensor's \.item\(\)\)"),
    ("scale on meta", lambda: mh.attention(q, k, v, scale=torch.tensor(0.5, device="meta")),
     TypeError, r"scale is a tensor on the meta device, which holds no value: pass a Python float"),
    ("nested q", lambda: mh.attention(torch.nested.nested_tensor(
        [torch.randn(4, 5, 8), torch.randn(4, 3, 8)], layout=torch.jagged), k, v), TypeError,
     r"q is a nested tensor; attention takes dense"),
    *((f"padding of {bad!r}", lambda bad=bad: M.padding(bad), TypeError,
       r"padding: lengths_or_mask must be lengths \(a list of ints or a 1-D integer tensor "
       r"\(B,\)\) or a \(B, S\) bool tensor, got .*\((str|NoneType|list)\)")
      for bad in ("32", None, [3, None])),
    ("mask to a dtype", lambda: M.padding([3]).to(torch.float16), TypeError,
     r"Mask.to takes a device \(a torch.device or a name such as 'cuda:0'\), got torch.float16"),
    ("mask to nothing", lambda: (M.causal() & M.sliding_window(2)).to(3.5), TypeError,
     r"Mask.to takes a device .*got 3.5"),
    ("padding ragged", lambda: M.padding([[3, 2], [1]]), ValueError,
     r"padding: lengths_or_mask \[\[3, 2\], \[1\]\] cannot be a tensor \(expected sequence"),
    ("padding overflow", lambda: M.padding([2 ** 70]), ValueError,
     r"cannot be a tensor \(.*\): pass one length per sequence, each below 2\*\*63"),
    ("scale inf", lambda: mh.attention(q, k, v, scale=float("inf")), ValueError,
     r"scale must be finite and > 0, got inf.*0.3536"),
    ("scale zero", lambda: mh.attention(q, k, v, scale=0.0), ValueError, r"scale must be finite and > 0"),
    ("scale type", lambda: mh.attention(q, k, v, scale="1"), TypeError, r"scale must be a float"),
    ("scale overflows the scores", lambda: mh.attention(q, k, v, scale=1e39), ValueError,
     r"scale 1e\+39 is past the largest torch.float32 \(3.403e\+38\)"),
    ("scale past any float", lambda: mh.attention(q, k, v, scale=2 ** 1100), ValueError,
     r"scale must be finite and > 0, got an int of 1101 bits, past any float"),
    ("no heads", lambda: mh.attention(q[:, :0], k[:, :0], v[:, :0]), ValueError,
     r"q has 0 heads \(\(2, 0, 5, 8\)\)"),
    ("backend name", lambda: mh.attention(q, k, v, backend="flash"), ValueError,
     r"unknown backend 'flash': choose one of auto, blocksparse, reference, rows, sdpa"),
    ("backend cannot", lambda: mh.attention(q, k, v, backend="sdpa", return_weights=True), ValueError,
     r"backend='sdpa' cannot run this call: it does not return attention weights.*\['reference', 'rows'\]"),
    ("window size", lambda: M.sliding_window(0), ValueError, r"size must be a positive int, got 0"),
    ("window past int64", lambda: M.sliding_window(2**63), ValueError,
     r"size must be at most 2\*\*63 - 1 \(an int64\), got 9223372036854775808"),
    ("sparse q", lambda: mh.attention(q.to_sparse(), k, v), TypeError,
     r"q is a torch.sparse_coo tensor; attention takes dense \(strided\) tensors: convert it "
     r"with .to_dense\(\)"),
    ("sparse explain", lambda: mh.explain(q, k, v.to_sparse()), TypeError, r"v is a torch.sparse_coo"),
    ("sparse bias", lambda: mh.attention(q, k, v, mask=torch.zeros(5, 7).to_sparse()), TypeError,
     r"bias is a torch.sparse_coo tensor"),
    ("sparse dense mask", lambda: M.dense(torch.ones(5, 7, dtype=torch.bool).to_sparse()),
     TypeError, r"is a torch.sparse_coo tensor"),
    ("sparse lengths", lambda: M.padding(torch.tensor([3, 7]).to_sparse()), TypeError,
     r"padding's lengths_or_mask is a torch.sparse_coo tensor"),
    ("sparse ids", lambda: M.document(torch.tensor([0, 0, 1]).to_sparse()), TypeError,
     r"ids is a torch.sparse_coo tensor"),
    ("sparse module input", lambda: mh.MultiHeadAttention(8, 2)(torch.randn(1, 3, 8).to_sparse()),
     TypeError, r"x is a torch.sparse_coo tensor"),
    ("nested module input", lambda: mh.MultiHeadAttention(8, 2)(torch.nested.nested_tensor(
        [torch.randn(2, 8), torch.randn(3, 8)], layout=torch.jagged)), TypeError,
     r"x is a nested tensor; .*torch.nested.to_padded_tensor\(t, 0.0\).*masks.padding"),
    ("sparse positions", lambda: mh.MultiHeadAttention(8, 2, rope=mh.RotaryEmbedding(4))(
        torch.randn(1, 3, 8), positions=torch.arange(3).to_sparse()), TypeError,
     r"positions is a torch.sparse_coo tensor"),
    ("sparse positions to RoPE", lambda: mh.RotaryEmbedding(4)(torch.randn(1, 1, 3, 4),
                                                                positions=torch.arange(3).to_sparse()),
     TypeError, r"positions is a torch.sparse_coo tensor"),
    ("sparse valid", lambda: (lambda m: m(torch.randn(1, 3, 8), cache=m.make_cache(1, 8),
                                          valid=torch.ones(1, 3, dtype=torch.bool).to_sparse()))(
        mh.MultiHeadAttention(8, 2)), TypeError, r"valid is a torch.sparse_coo tensor"),
    ("module backend type", lambda: mh.MultiHeadAttention(8, 2, backend=None), TypeError,
     r"backend must be a string, got NoneType"),
    ("align", lambda: M.causal(align="top"), ValueError, r"align must be one of"),
    ("document args", lambda: M.document(), ValueError, r"exactly one of ids"),
    ("document len", lambda: mh.attention(q, k, v, mask=M.document(torch.zeros(6, dtype=torch.long))),
     ValueError, r"6 ids but Sk = 7"),
    ("cu_seqlens", lambda: M.document(cu_seqlens=torch.tensor([1, 3])), ValueError, r"start at 0"),
    ("cu_seqlens total", lambda: mh.attention(q, k, v, mask=M.document(cu_seqlens=[0, 2, 9])),
     ValueError, r"built from cu_seqlens ending at 9, but Sk = 7: the last entry of cu_seqlens"),
    ("bias nan", lambda: M.bias(torch.tensor([float("nan")])), ValueError, r"NaN"),
    ("or bias", lambda: M.causal() | M.bias(torch.zeros(2, 2)), TypeError, r"combine biases with &"),
    ("and tensor", lambda: M.causal() & torch.ones(2, 2, dtype=torch.bool), TypeError, r"masks.dense"),
    ("negative lengths", lambda: M.padding(torch.tensor([-1, 2])), ValueError, r"lengths must be >= 0"),
    ("explain too", lambda: mh.explain(q, k, v, backend="nope"), ValueError, r"unknown backend"),
    ("uncalled factory", lambda: mh.attention(q, k, v, mask=M.causal), TypeError,
     r"got function: call it: multihead.masks.causal\(...\)"),
    ("uncalled in &", lambda: M.causal() & M.sliding_window, TypeError,
     r"got function: call it: multihead.masks.sliding_window\(...\)"),
    ("tiles batch", lambda: M.padding(torch.tensor([3, 5])).tiles(8, 8, batch=3), ValueError,
     r"tiles: batch=3, but padding\(lengths=\[3, 5\]\) was built for 2: pass batch=2"),
    ("tiles heads", lambda: M.alibi(2).tiles(8, 8, heads=3), ValueError,
     r"tiles: heads=3, but .* was built for 2: pass heads=2"),
    ("bias flag", lambda: mh.MultiHeadAttention(16, 2, bias="no"), TypeError,
     r"bias must be True or False .* got 'no'"),
    ("dropout nan", lambda: mh.MultiHeadAttention(16, 2, dropout=float("nan")), ValueError,
     r"dropout must be a float in \[0, 1\), got nan"),
]

F8 = torch.float8_e4m3fn
SUPPORTED = r"must be torch.float16, torch.bfloat16, torch.float32 or torch.float64, got "
#: dtypes refused where they are passed, not later deep inside torch
DTYPES = [
    ("module int", lambda: mh.MultiHeadAttention(16, 2, dtype=torch.int64), "dtype " + SUPPORTED
     + r"torch.int64: attention computes in a floating-point dtype"),
    ("module str", lambda: mh.MultiHeadAttention(16, 2, dtype="bfloat16"), "dtype " + SUPPORTED
     + r"'bfloat16' \(a str\): pass torch.bfloat16"),
    ("module complex", lambda: mh.MultiHeadAttention(16, 2, dtype=torch.complex64),
     "dtype " + SUPPORTED + "torch.complex64"),
    ("module float8", lambda: mh.MultiHeadAttention(16, 2, dtype=F8), "dtype " + SUPPORTED
     + r"torch.float8_e4m3fn: float8_e4m3fn is a storage format .* use torch.bfloat16"),
    ("cache float8", lambda: mh.KVCache(1, 8, 2, 8, dtype=F8), "dtype " + SUPPORTED + "torch.float8"),
    ("paged float8", lambda: mh.PagedKVCache(4, 16, 2, 8, dtype=torch.float8_e5m2),
     "dtype " + SUPPORTED + "torch.float8_e5m2"),
    ("converted module", lambda: mh.MultiHeadAttention(16, 2).to(F8)(torch.ones(1, 3, 16).to(F8)),
     r"the module's weights are torch.float8_e4m3fn, which attention cannot compute in: convert "
     r"the module with module.to\(torch.bfloat16\)"),
]


@pytest.mark.parametrize("name,fn,pattern", DTYPES, ids=[d[0] for d in DTYPES])
def test_a_dtype_attention_cannot_compute_in_is_refused_where_it_is_passed(name, fn, pattern):
    with pytest.raises(TypeError, match=pattern):
        fn()


@pytest.mark.parametrize("name,fn,exc,pattern", BAD, ids=[b[0] for b in BAD])
def test_bad_input_message(name, fn, exc, pattern):
    with pytest.raises(exc, match=pattern):
        fn()


def test_a_numpy_scale_is_a_number():
    np = pytest.importorskip("numpy")
    torch.testing.assert_close(mh.attention(q, k, v, scale=np.float32(0.5)),
                               mh.attention(q, k, v, scale=0.5), atol=0, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_an_empty_calls_lse_has_the_dtype_of_any_other(dtype):
    qq, kk = q.to(dtype), k.to(dtype)
    full = mh.attention(qq, kk, kk, return_lse=True)[1].dtype
    empty = mh.attention(qq, kk[:, :, :0], kk[:, :, :0], return_lse=True)[1].dtype
    assert empty == full


def test_numpy_numbers_are_numbers_everywhere():
    """What indexing an array gives (np.int64, np.float32) is accepted, stored as Python's."""
    np = pytest.importorskip("numpy")
    torch.testing.assert_close(mh.attention(q, k, v, dropout_p=np.float32(0.0)),
                               mh.attention(q, k, v), atol=0, rtol=0)
    assert M.sliding_window(np.int64(4)) == M.sliding_window(4)
    assert type(M.sliding_window(np.int64(4)).size) is int
    assert M.alibi(np.int64(2)) == M.alibi(2)
    assert mh.MultiHeadAttention(16, 2, dropout=np.float64(0.25)).dropout == 0.25


def test_a_sparse_input_is_refused_after_dense_calls_of_its_shape():
    """The plan cache knows the inputs' layout: a warm shape does not let one through."""
    for _ in range(2):
        mh.attention(q, k, v)
    with pytest.raises(TypeError, match="q is a torch.sparse_coo tensor"):
        mh.attention(q.to_sparse(), k, v)


_MODULE, _DROP_IN = mh.MultiHeadAttention(16, 4), mh.nn.MultiheadAttention(16, 4, batch_first=True)
_ROPE = mh.MultiHeadAttention(16, 4, rope=mh.RotaryEmbedding(4))
#: masks built outside the compiled function: their host facts (lengths, runs) are known
_LONG, _THREE = M.padding(torch.tensor([30, 5])), M.padding(torch.tensor([3, 5, 7]))
_DOCS, _ALIBI = M.document(torch.tensor([0, 0, 1, 1, 1, 2, 2, 2])), M.alibi(3)
#: mistakes whose message holds sizes that torch.compile(dynamic=True) traces as symbolic
TRACED = [
    ("batch", lambda q, k, v, s: mh.attention(q, k[:1], v[:1])),
    ("head_dim", lambda q, k, v, s: mh.attention(q, k[..., :4], v)),
    ("kv length", lambda q, k, v, s: mh.attention(q, k, v[:, :, :3])),
    ("gqa", lambda q, k, v, s: mh.attention(q, k[:, :3], v[:, :3])),
    ("3-D q", lambda q, k, v, s: mh.attention(q[0], k, v)),
    ("scale", lambda q, k, v, s: mh.attention(q, k, v, scale=-s)),
    ("scale overflows", lambda q, k, v, s: mh.attention(q, k, v, scale=s * 1e39)),
    ("dense", lambda q, k, v, s: mh.attention(q, k, v, mask=torch.ones(
        q.shape[2], k.shape[2] + 1, dtype=torch.bool))),
    ("bias", lambda q, k, v, s: mh.attention(q, k, v, mask=torch.zeros(
        q.shape[2] - 1, k.shape[2]))),
    ("padding rows", lambda q, k, v, s: mh.attention(q, k, v, mask=M.padding(torch.ones(
        q.shape[0], k.shape[2] + 1, dtype=torch.bool)))),
    ("padding batch", lambda q, k, v, s: mh.attention(q, k, v, mask=M.padding(
        torch.tensor([1, 2, 3])))),
    ("padding too long, built outside", lambda q, k, v, s: mh.attention(q, k, v, mask=_LONG)),
    ("padding batch, built outside", lambda q, k, v, s: mh.attention(q, k, v, mask=_THREE)),
    ("document ids, built outside", lambda q, k, v, s: mh.attention(q, k, v, mask=_DOCS)),
    ("alibi heads, built outside", lambda q, k, v, s: mh.attention(q, k, v, mask=_ALIBI)),
    ("document ids", lambda q, k, v, s: mh.attention(q, k, v, mask=M.document(
        torch.zeros(k.shape[2] + 1, dtype=torch.long)))),
    ("module width", lambda q, k, v, s: _MODULE(q[:, 0, :, :8])),
    ("module context", lambda q, k, v, s: _MODULE(q[:, 0], k[:1, 0])),
    ("module positions", lambda q, k, v, s: _ROPE(q[:, 0], positions=torch.arange(q.shape[2] + 1))),
    ("rope positions", lambda q, k, v, s: _ROPE.rope(q[..., :4], positions=torch.arange(
        q.shape[2] + 1))),
    ("drop-in width", lambda q, k, v, s: _DROP_IN(*(q[:, 0, :, :8],) * 3)),
    ("drop-in key padding", lambda q, k, v, s: _DROP_IN(
        q[:, 0], k[:, 0], v[:, 0], key_padding_mask=torch.ones(q.shape[0], k.shape[2] + 1,
                                                               dtype=torch.bool))),
    ("drop-in attn_mask", lambda q, k, v, s: _DROP_IN(q[:, 0], k[:, 0], v[:, 0], attn_mask=(
        torch.ones(q.shape[2], k.shape[2] + 1, dtype=torch.bool)))),
    ("drop-in 3-D attn_mask", lambda q, k, v, s: _DROP_IN(q[:, 0], k[:, 0], v[:, 0], attn_mask=(
        torch.ones(q.shape[0] * 4, q.shape[2], k.shape[2] + 1, dtype=torch.bool)))),
    ("rope lengths", lambda q, k, v, s: _ROPE.rope.rotate(q[..., :4], k[..., :4], positions=0)),
    ("drop-in key and value", lambda q, k, v, s: _DROP_IN(q[:, 0], k[:, 0], v[:, 0, :3])),
]


@pytest.mark.parametrize("name,fn", TRACED, ids=[t[0] for t in TRACED])
def test_a_mistake_under_fullgraph_compile_shows_our_message(name, fn):
    """Under torch.compile(fullgraph=True) with symbolic sizes (dynamic=True, or a shape
    that changed between calls), Dynamo cannot format a symbolic number: a message that held
    one became Dynamo's "Failed to trace builtin operator str" (or "BUILD_STRING type
    error"), without ours. The sizes are now shown as this call's, so the message Dynamo
    reports is the one eager raises."""
    g = torch.Generator().manual_seed(3)
    args = (torch.randn(2, 4, 6, 16, generator=g), torch.randn(2, 4, 7, 16, generator=g),
            torch.randn(2, 4, 7, 16, generator=g), 0.5)
    with pytest.raises((ValueError, TypeError, RuntimeError, AssertionError)) as eager:
        fn(*args)
    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend="eager")
    with pytest.raises(Exception) as traced:
        compiled(*args)
    said, text = str(eager.value), str(traced.value)
    if said.startswith("mask: "):     # traced, a mask is described without its host facts
        #                               (lengths of shape (3,), not lengths=[1, 2, 3]): what
        said = re.split(r"\) (?=was built|has |covers |does not |needs )", said, 1)[1]  # follows
    assert said in text or repr(said)[1:-1] in text, (said, text[:600])
    assert not re.search(r"\bs\d+\b", text), text[:600]      # no symbol (s0, s77) shown


def test_document_from_cu_seqlens_under_compile_breaks_the_graph_or_gives_our_reason():
    """The offsets are read on the host to size the ids: traced, that failed with Dynamo's
    data-dependent guard error. Now a graph break runs it (the result is eager's), and
    fullgraph=True and torch.export refuse it with our reason."""
    attn = mh.MultiHeadAttention(16, 4).eval()

    def fn(x, cu):
        return attn(x, mask=M.document(cu_seqlens=cu))

    x, cu = torch.randn(1, 9, 16), torch.tensor([0, 3, 9])
    torch._dynamo.reset()
    torch.testing.assert_close(torch.compile(fn, backend="eager")(x, cu), fn(x, cu))
    torch._dynamo.reset()
    reason = r"document\(cu_seqlens=...\) reads the offsets when the mask is built"
    with pytest.raises(Exception, match=reason):
        torch.compile(fn, backend="eager", fullgraph=True)(x, cu)

    class Wrapped(torch.nn.Module):
        def forward(self, x, cu):
            return fn(x, cu)

    with pytest.raises(ValueError, match=reason):
        torch.export.export(Wrapped(), (x, cu))


@pytest.mark.parametrize("compiler,side", [("aot_eager", "key"), ("aot_eager", "query"),
                                           ("inductor", "key")])
def test_padding_lengths_traced_as_a_graph_input_are_checked_when_the_graph_runs(compiler,
                                                                                   side):
    """A padding mask built inside a compiled function from lengths the function takes has
    no values while it is traced: a length past the sequence (lengths of untruncated text)
    was read as "every key is real" and a negative one as "none is", where eager raises. On
    the CPU the graph now checks them when it runs."""
    q = torch.randn(2, 4, 8, 16, generator=torch.Generator().manual_seed(0))

    def fn(q, lengths):
        return mh.attention(q, q, q, mask=M.padding(lengths, side=side) & M.causal())

    torch._dynamo.reset()
    compiled = torch.compile(fn, fullgraph=True, dynamic=True, backend=compiler)
    what = "Sk" if side == "key" else "Sq"
    for bad in ([5, 9], [-1, 3]):
        with pytest.raises(ValueError, match="length"):
            fn(q, torch.tensor(bad))                                      # eager
        with pytest.raises(RuntimeError, match=f"padding.side='{side}'. has a length < 0 or "
                                               f"> {what}: lengths count real tokens"):
            compiled(q, torch.tensor(bad))
    good = torch.tensor([5, 8])
    torch.testing.assert_close(compiled(q, good), fn(q, good))

"""RotaryEmbedding: equal to Hugging Face's LLaMA rotary embedding and to an fp64 closed
form, by every route to its angles (the shared table: a slice for an int or consecutive
host positions, a gather for other host positions; computed angles for float positions,
negative ones and torch.compile), the table's sharing and growth, and what a decoding step
on a cache costs on the device (``meta`` standing in for a GPU)."""

import math

import pytest
import torch

import multihead as mh
from multihead.modules import rope as rope_mod
from test_kv_cache import _DeviceOps


def closed_form(x: torch.Tensor, positions: torch.Tensor, base: float = 10000.0,
                freq: torch.Tensor | None = None) -> torch.Tensor:
    """The rotation in fp64, written from the formula: channel pairs (i, i + D/2) turned by
    the angle position * base^(-2i/D) (or by position * ``freq``)."""
    D = x.shape[-1]
    x = x.double()
    freq = torch.tensor([base ** (-2 * i / D) for i in range(D // 2)], dtype=torch.float64) \
        if freq is None else freq.double()
    ang = positions.double().unsqueeze(-1) * freq                      # (..., S, D/2)
    if ang.dim() == 3:
        ang = ang.unsqueeze(1)                                         # (B, 1, S, D/2)
    c, s = ang.cos(), ang.sin()
    x1, x2 = x[..., :D // 2], x[..., D // 2:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1)


def hf_rotated(q, k, positions, base=10000.0):
    """Hugging Face's LLaMA rotary embedding (fp32 angles) applied to q and k."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    D = q.shape[-1]
    config = LlamaConfig(hidden_size=D * 4, num_attention_heads=4, head_dim=D, rope_theta=base,
                         max_position_embeddings=8192)
    emb = LlamaRotaryEmbedding(config)
    pos = positions if positions.dim() == 2 else positions[None]       # (B|1, S)
    cos, sin = emb(q, pos)
    return apply_rotary_pos_emb(q, k, cos, sin)


ROUTES = {                                         # positions of S=6 tokens, each route's way
    "int": lambda: 100,
    "consecutive": lambda: torch.arange(100, 106),
    "gathered": lambda: torch.tensor([[3, 1, 4, 1, 5, 9], [100, 101, 102, 103, 104, 200]]),
    "float": lambda: torch.arange(100, 106, dtype=torch.float32),
    "negative": lambda: torch.arange(-3, 3),
}


def _as_tensor(p, S=6):
    return torch.arange(p, p + S) if isinstance(p, int) else p


@pytest.mark.parametrize("route", ROUTES)
def test_every_route_equals_hugging_face_llama(route):
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16)
    p = ROUTES[route]()
    ours = mh.RotaryEmbedding(16).rotate(q, k, positions=p)
    theirs = hf_rotated(q, k, _as_tensor(p).long())
    for a, b in zip(ours, theirs):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_every_route_equals_the_fp64_closed_form(route, dtype):
    """Angles in fp64 for fp64 inputs (1e-12), fp32 otherwise: the error grows with the
    position (fp32 angles of position ~200 are off by ~1e-5 rad); bf16 rounds the output."""
    torch.manual_seed(0)
    x = torch.randn(2, 3, 6, 32, dtype=dtype)
    p = ROUTES[route]()
    got = mh.RotaryEmbedding(32)(x, p)
    assert got.dtype == dtype
    tol = {torch.float64: 1e-12, torch.float32: 1e-4, torch.bfloat16: 3e-2}[dtype]
    torch.testing.assert_close(got.double(), closed_form(x, _as_tensor(p)), atol=tol, rtol=tol)


def test_positions_read_from_the_table_equal_computed_ones():
    """A slice, a gather and computed angles of the same positions agree to fp32 rounding."""
    torch.manual_seed(0)
    rope, x = mh.RotaryEmbedding(64), torch.randn(1, 2, 5, 64)
    sliced = rope(x, 4000)
    gathered = rope(x, torch.tensor([[4000, 4001, 4002, 4003, 4004]]))
    computed = rope(x, torch.arange(4000, 4005, dtype=torch.float64))
    torch.testing.assert_close(sliced, gathered, atol=0, rtol=0)
    torch.testing.assert_close(sliced, computed, atol=1e-6, rtol=1e-6)


def _table_of(head_dim, base=10000.0, device="cpu", dtype=torch.float32):
    return rope_mod._TABLES.get((head_dim, base, torch.device(device), dtype))


def test_the_table_is_shared_grows_by_doubling_and_is_exact_at_its_edge():
    rope_mod._TABLES.clear()
    a, b = mh.RotaryEmbedding(16, base=500), mh.RotaryEmbedding(16, base=500)
    x = torch.randn(1, 1, 3, 16)
    a(x, 0)
    first = _table_of(16, 500.0)
    assert first.shape == (rope_mod.FIRST_ROWS, 2, 16)
    b(x, 7)
    assert _table_of(16, 500.0) is first                               # shared, not rebuilt
    edge = rope_mod.FIRST_ROWS - 1                                     # needs FIRST_ROWS + 2
    got = b(x, edge)
    assert _table_of(16, 500.0).shape[0] == 2 * rope_mod.FIRST_ROWS
    torch.testing.assert_close(got.double(), closed_form(x, torch.arange(edge, edge + 3), 500.0),
                               atol=1e-3, rtol=1e-3)


def test_positions_past_the_largest_table_compute_their_angles():
    """A call at position 10^9 must not build a table of 10^9 rows (it would hold gigabytes
    for the life of the process): past TABLE_BYTES the angles are computed, as for floats."""
    rope, x = mh.RotaryEmbedding(128), torch.randn(1, 2, 3, 128)
    most = rope_mod.TABLE_BYTES // (2 * 128 * 4)
    before = _table_of(128)
    for far in (10 ** 9, torch.tensor([5, 10 ** 9, 7])):
        got = rope(x, far)
        pos = torch.arange(10 ** 9, 10 ** 9 + 3) if isinstance(far, int) else far
        torch.testing.assert_close(got, rope(x, pos.double()), atol=0, rtol=0)
    table = _table_of(128)
    assert table is before or table.shape[0] <= most
    near = rope(x, most - 3)                                           # the last rows fit
    assert _table_of(128).shape[0] == most
    torch.testing.assert_close(near, rope(x, torch.arange(most - 3, most).double()),
                               atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.int8, torch.int16, torch.int32, torch.uint8])
def test_small_integer_positions_are_gathered_as_indices(dtype):
    rope, x = mh.RotaryEmbedding(8), torch.randn(2, 3, 5, 8)
    pos = torch.tensor([4, 1, 0, 9, 3], dtype=dtype)
    torch.testing.assert_close(rope(x, pos), rope(x, pos.double()), atol=1e-6, rtol=1e-6)
    m = mh.MultiHeadAttention(32, 4, rope=mh.RotaryEmbedding(8)).eval()
    xm = torch.randn(2, 5, 32)
    torch.testing.assert_close(m(xm, positions=pos[None].expand(2, 5)), m(xm, positions=pos.long()))


def test_vmap_over_positions_and_over_x():
    rope, x = mh.RotaryEmbedding(8), torch.randn(1, 2, 5, 8)
    pos = torch.arange(15).view(3, 5)
    got = torch.func.vmap(lambda p: rope(x, p))(pos)                   # (3, 1, 2, 5, 8)
    torch.testing.assert_close(got, torch.stack([rope(x, p) for p in pos]))
    xs = torch.randn(4, 1, 2, 5, 8)
    torch.testing.assert_close(torch.func.vmap(lambda t: rope(t, 3))(xs),
                               torch.stack([rope(t, 3) for t in xs]))


def test_frequencies_written_into_inv_freq_are_used_and_stay_private():
    """Position interpolation by scaling inv_freq in place: this module then rotates by the
    scaled frequencies (computing its angles), and another module's shared table is not
    touched."""
    x = torch.randn(1, 2, 4, 8)
    scaled, plain = mh.RotaryEmbedding(8), mh.RotaryEmbedding(8)
    want_plain = plain(x, 40)
    scaled.inv_freq.mul_(0.25)
    pos = torch.arange(40, 44)
    torch.testing.assert_close(scaled(x, 40), plain(x, pos * 0.25), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(scaled(x, pos), plain(x, pos * 0.25), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(plain(x, 40), want_plain, atol=0, rtol=0)
    replaced = mh.RotaryEmbedding(8)
    replaced.inv_freq = plain.inv_freq * 0.5
    torch.testing.assert_close(replaced(x, 40), plain(x, pos * 0.5), atol=1e-6, rtol=1e-6)


def test_casting_the_module_keeps_exact_fp32_frequencies():
    rope = mh.RotaryEmbedding(16).to(torch.bfloat16)
    assert rope.inv_freq.dtype == torch.float32
    torch.testing.assert_close(rope.inv_freq, mh.RotaryEmbedding(16).inv_freq, atol=0, rtol=0)
    assert rope._unchanged()                                          # still reads the table
    m = mh.MultiHeadAttention(32, 4, rope=mh.RotaryEmbedding(8)).to("meta")
    assert m.rope.inv_freq.is_meta and m.rope._unchanged()


@pytest.mark.parametrize("write", ["data.mul_", "data =", "numpy"])
def test_writes_past_the_version_counter_are_honoured_on_the_cpu(write):
    """Writes through ``.data`` or a NumPy view do not bump the buffer's version; on the
    CPU the values are compared too, so the module stops reading the unscaled table."""
    x, pos = torch.randn(1, 2, 4, 8), torch.arange(40, 44)
    rope, plain = mh.RotaryEmbedding(8), mh.RotaryEmbedding(8)
    rope(x, 40)                                                       # the table exists
    if write == "data.mul_":
        rope.inv_freq.data.mul_(0.5)
    elif write == "data =":
        rope.inv_freq.data = rope.inv_freq * 0.5
    else:
        rope.inv_freq.numpy()[:] *= 0.5
    torch.testing.assert_close(rope(x, 40), plain(x, pos * 0.5), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("kind", ["written", "parameter"])
def test_casting_a_module_with_written_frequencies_does_not_round_them(dtype, kind):
    """Linear scaling, then ``model.half()``: the scaled frequencies keep fp32, so the
    error at a far position is the output's rounding, as for an unscaled module; learned
    ones in an nn.Parameter too (the same Parameter, and its gradient's dtype follows)."""
    x = torch.randn(1, 1, 3, 64)
    rope = mh.RotaryEmbedding(64)
    rope.inv_freq.mul_(0.25)
    if kind == "parameter":
        rope.inv_freq = torch.nn.Parameter(rope.inv_freq.clone())
        rope(x, 4000).sum().backward()
    scaled, held = rope.inv_freq.detach().clone(), rope.inv_freq
    rope.to(dtype)
    assert rope.inv_freq.dtype == torch.float32 and torch.equal(rope.inv_freq, scaled)
    if kind == "parameter":
        assert rope.inv_freq is held and held.grad.dtype == torch.float32
        rope(x.to(dtype), 4000).sum().backward()                         # accumulates
    got = rope(x.to(dtype), 4000).double()
    want = closed_form(x, torch.arange(4000, 4003), freq=scaled)          # fp32 frequencies
    tol = {torch.float16: 4e-3, torch.bfloat16: 3e-2, torch.float64: 1e-12}[dtype]
    torch.testing.assert_close(got, want, atol=tol, rtol=0)


def test_a_module_is_built_and_cast_under_inference_mode():
    with torch.inference_mode():
        rope = mh.RotaryEmbedding(16)
        m = mh.MultiHeadAttention(64, 4, rope=mh.RotaryEmbedding(16))
        assert rope._unchanged() and m.rope._unchanged()
    outside = mh.RotaryEmbedding(16)
    with torch.inference_mode():
        outside.float()
        outside.to(torch.float16)
        x16 = torch.randn(1, 1, 2, 16).half()
        y = outside(x16, 7)
    assert outside._unchanged() and outside.inv_freq.dtype == torch.float32
    torch.testing.assert_close(y.double(), closed_form(x16, torch.arange(7, 9)),
                               atol=4e-3, rtol=0)
    x = torch.randn(1, 2, 3, 16)
    torch.testing.assert_close(rope(x, 5).double(), closed_form(x, torch.arange(5, 8)),
                               atol=1e-5, rtol=0)


def test_fp64_is_exact_when_compiled_and_when_mixed_with_fp32():
    """fp64 angles come from the exact fp64 frequencies under torch.compile too, and any
    fp64 input of ``rotate`` gets fp64 angles (not those of the first input's dtype)."""
    rope = mh.RotaryEmbedding(32)
    x = torch.randn(1, 1, 4, 32, dtype=torch.float64)
    pos = torch.arange(100000, 100004)
    compiled = torch.compile(lambda x, p: rope(x, p), backend="eager", fullgraph=True)
    torch.testing.assert_close(compiled(x, pos), closed_form(x, pos), atol=1e-12, rtol=0)
    q = torch.randn(1, 2, 4, 32)
    rq, rk = rope.rotate(q, x, positions=100000)
    assert (rq.dtype, rk.dtype) == (torch.float32, torch.float64)
    torch.testing.assert_close(rk, closed_form(x, pos), atol=1e-12, rtol=0)
    torch.testing.assert_close(rq.double(), closed_form(q, pos), atol=1e-5, rtol=0)


def test_inputs_without_a_batch_take_positions_of_one_row():
    rope, x = mh.RotaryEmbedding(8), torch.randn(2, 5, 8)                 # (H, S, D)
    got = rope(x, torch.arange(3, 8)[None])                               # (1, S)
    assert got.shape == x.shape
    torch.testing.assert_close(got, rope(x, 3), atol=0, rtol=0)


def test_a_capture_keeps_no_new_table_and_holds_the_one_it_reads(monkeypatch):
    """While a CUDA graph captures, a table is never grown into the cache (that call's
    angles are computed in the graph), and a table the capture reads is held for as long as
    the process lives: a later growth replaces it in the cache but cannot free it."""
    from multihead import _device
    rope, x = mh.RotaryEmbedding(40), torch.randn(1, 1, 2, 40)
    rope_mod._TABLES.clear()
    monkeypatch.setattr(_device, "capturing", lambda: True)
    monkeypatch.setattr(_device, "_HELD", {})
    got = rope(x, 5)
    assert _table_of(40) is None and not _device._HELD
    monkeypatch.setattr(_device, "capturing", lambda: False)
    torch.testing.assert_close(got, rope(x, 5), atol=1e-6, rtol=1e-6)
    table = _table_of(40)
    monkeypatch.setattr(_device, "capturing", lambda: True)
    rope(x, 6)
    assert list(_device._HELD.values()) == [table]


def test_a_table_made_on_one_stream_is_waited_for_on_another():
    """Simulated streams (as tests/test_streams.py): the stream that reads a table made on
    another first waits for the making, once, and keeps the table's memory for itself."""
    from test_streams import streams
    rope, x = mh.RotaryEmbedding(44), torch.randn(1, 1, 2, 44)
    rope_mod._TABLES.clear()
    with streams() as rec:
        rope(x, 0)                                                     # made on stream 1
        rope(x, 1)
        assert rec.log == []
        rec.now = 2
        rope(x, 2)
        rope(x, 3)
        assert rec.log == [("wait", 2, "event 1 on stream 1"),
                           ("keep", 2, _table_of(44).data_ptr())]


def test_a_table_built_in_inference_mode_serves_training():
    """The first call in inference mode must not leave an inference tensor that a later
    training call cannot save for its backward."""
    rope_mod._TABLES.clear()
    rope = mh.RotaryEmbedding(24)
    with torch.inference_mode():
        rope(torch.randn(1, 1, 4, 24), 0)
    x = torch.randn(1, 1, 4, 24, requires_grad=True)
    rope(x, 2).square().sum().backward()
    # a rotation keeps norms: d/dx of sum(rot(x)^2) = 2x
    torch.testing.assert_close(x.grad, 2 * x.detach(), atol=1e-5, rtol=1e-5)


def test_device_argument_builds_the_table_up_front():
    rope_mod._TABLES.clear()
    rope = mh.RotaryEmbedding(12, device="meta")
    assert _table_of(12, device="meta").is_meta and rope.inv_freq.is_meta


def test_inv_freq_is_the_frequencies():
    torch.testing.assert_close(mh.RotaryEmbedding(8, base=100).inv_freq,
                               torch.tensor([1.0, 100 ** -0.25, 0.1, 100 ** -0.75]))


def test_repr_gives_the_base_exactly_and_says_when_the_frequencies_are_not_its():
    assert repr(mh.RotaryEmbedding(8, base=1.0000001)) == \
        "RotaryEmbedding(head_dim=8, base=1.0000001)"           # (not rounded to 1)
    assert "base=1234567.0)" in repr(mh.RotaryEmbedding(8, base=1234567))
    rope = mh.RotaryEmbedding(8)
    rope.load_state_dict({"inv_freq": mh.RotaryEmbedding(8, base=5e5).inv_freq * 0.5})
    assert repr(rope) == "RotaryEmbedding(head_dim=8, base=10000.0, inv_freq=written)"
    rope.inv_freq.requires_grad_()
    assert repr(rope).endswith(", inv_freq=learned)")


@pytest.mark.parametrize("bad, error, match", [
    ([1, 2, 3], TypeError, r"positions must be an int \(the first of S consecutive positions\) "
                           r"or an integer or float tensor \(S,\) or \(B, S\), got list"),
    (torch.arange(5), ValueError, r"positions must be \(S,\) or \(B, S\) = \(3,\) or \(2, 3\) "
                                  r"for inputs of shape \(2, 1, 3, 8\), got shape \(5,\)"),
    (torch.zeros(1, 1, 3), ValueError, r"got shape \(1, 1, 3\)"),
    (torch.zeros(3, 3), ValueError, r"\(2, 3\) for inputs of shape \(2, 1, 3, 8\), got shape \(3, 3\)"),
    (torch.arange(3, device="meta"), ValueError, r"positions are on the meta device \(they hold "
                                                 r"no values\) and the inputs on cpu: pass "
                                                 r"positions on cpu$"),
    # as an int start past 2**53 is: those positions round to one another in any float
    (torch.arange(3) + 2**60, ValueError, r"positions reach 1152921504606846978, past ±2\*\*53"),
    (torch.tensor([0, 1, -2**63]), ValueError, r"positions reach -9223372036854775808, past"),
])
def test_bad_positions_are_named(bad, error, match):
    with pytest.raises(error, match=match):
        mh.RotaryEmbedding(8)(torch.randn(2, 1, 3, 8), bad)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_positions_it_holds_exactly_rotate_as_integers(dtype):
    rope, x = mh.RotaryEmbedding(8), torch.randn(1, 1, 3, 8)
    torch.testing.assert_close(rope(x, torch.arange(253, 256).to(dtype)), rope(x, 253),
                               atol=0, rtol=0)


def test_rotate_broadcasts_an_input_of_one_sequence_over_positions_per_sequence():
    rope = mh.RotaryEmbedding(8)
    q, k, p = torch.randn(2, 4, 3, 8), torch.randn(1, 2, 3, 8), torch.tensor([[0, 1, 2], [5, 6, 7]])
    rq, rk = rope.rotate(q, k, positions=p)
    assert rk.shape == (2, 2, 3, 8)
    torch.testing.assert_close(rk[1:], rope(k, 5))
    kq, qk = rope.rotate(k, q, positions=p)             # the one sequence first, too
    assert kq.shape == (2, 2, 3, 8) and torch.equal(kq, rk) and torch.equal(qk, rq)
    with pytest.raises(ValueError, match=r"positions of shape \(3, 3\) hold one row per "
                                         r"sequence, but the inputs are \[\(2, 4, 3, 8\), "
                                         r"\(3, 2, 3, 8\)\]"):
        rope.rotate(q, torch.randn(3, 2, 3, 8), positions=torch.arange(9).view(3, 3))
    a, b = rope.rotate(q, torch.randn(3, 2, 3, 8), positions=5)    # (one row: any batches)
    assert a.shape == (2, 4, 3, 8) and b.shape == (3, 2, 3, 8)


def test_rotate_needs_tensors_of_one_length_and_takes_numpy_ints():
    import numpy as np
    rope = mh.RotaryEmbedding(8)
    with pytest.raises(TypeError, match=r"pass the tensors to rotate"):
        rope.rotate(positions=0)
    with pytest.raises(ValueError, match=r"with one S, got \[\(1, 1, 3, 8\), \(1, 1, 4, 8\)\]"):
        rope.rotate(torch.randn(1, 1, 3, 8), torch.randn(1, 1, 4, 8), positions=0)
    x = torch.randn(1, 1, 3, 8)
    torch.testing.assert_close(rope(x, np.int64(2)), rope(x, 2), atol=0, rtol=0)
    m = mh.MultiHeadAttention(16, 2, rope=mh.RotaryEmbedding(8)).eval()
    xm = torch.randn(1, 3, 16)
    torch.testing.assert_close(m(xm, positions=4), m(xm, positions=torch.arange(4, 7)))
    with pytest.raises(TypeError, match=r"positions must be an int .* got a bool"):
        m(xm, positions=True)


def test_compiled_module_with_rope_equals_eager():
    torch.manual_seed(0)
    m = mh.MultiHeadAttention(32, 4, num_kv_heads=2, rope=mh.RotaryEmbedding(8)).eval()
    x = torch.randn(2, 7, 32)
    compiled = torch.compile(m, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(x, mask=mh.masks.causal()), m(x, mask=mh.masks.causal()))
    pos = torch.tensor([5, 6, 7, 9, 10, 11, 12])
    torch.testing.assert_close(compiled(x, positions=pos), m(x, positions=pos))


@pytest.mark.parametrize("kind", ["static", "paged"])
def test_a_decoding_step_rotates_with_four_device_ops(kind):
    """With a cache whose sequences hold no padding, the positions are host ints: q and k
    read their angles from the table as a slice (equal lengths) or one gather (paged,
    unequal), and are rotated together: one concatenation, one multiply, one roll and one
    fused multiply-add. Before, the positions took 4 device ops and each rotation 11."""
    m = mh.MultiHeadAttention(64, 4, num_kv_heads=2, rope=mh.RotaryEmbedding(16),
                              device="meta").eval()
    if kind == "static":
        cache = m.make_cache(2, 32)
    else:
        pool = mh.PagedKVCache(num_pages=8, page_size=16, num_kv_heads=2, head_dim=16,
                               device="meta")
        cache = pool.batch([pool.add_sequence(), pool.add_sequence()])
    step = torch.empty(2, 1, 64, device="meta")
    with torch.no_grad():
        m(torch.empty(2, 5, 64, device="meta"), cache=cache, mask=mh.masks.causal())
        if kind == "paged":                                            # unequal lengths
            m.forward(step[:1], cache=pool.batch(cache.ids[:1]), mask=mh.masks.causal())
        with _DeviceOps() as mode:
            m.rope.rotate(*m._project(step, None)[:2], positions=cache.rope_positions(1))
    want = ["cat", "mul", "roll", "addcmul"]
    if kind == "paged":
        assert isinstance(cache.rope_positions(1), torch.Tensor)      # (B, 1) on the host
        want = ["_to_copy", "index"] + want
    else:
        assert cache.rope_positions(1) == 5
    ops = [o for o in mode.ops if o not in ("t", "addmm", "unsqueeze", "expand")]
    assert ops == want, mode.ops


def test_padded_sequences_take_their_positions_from_the_device():
    cache = mh.KVCache(2, 16, num_kv_heads=1, head_dim=8)
    kv = torch.zeros(2, 1, 3, 8)
    cache.update(kv, kv, valid=torch.tensor([[True] * 3, [False, True, True]]))
    pos = cache.rope_positions(2)
    assert isinstance(pos, torch.Tensor) and pos.tolist() == [[3, 4], [2, 3]]
    assert cache.rope_positions(1, valid=torch.tensor([[True], [True]])).tolist() == [[3], [2]]


def test_rotation_is_relative_at_large_positions():
    """The score of a query at m and a key at n depends on m - n only: checked where an
    fp32 table holds the angles (positions past 2^15)."""
    torch.manual_seed(0)
    rope = mh.RotaryEmbedding(16)
    q, k = torch.randn(1, 1, 1, 16), torch.randn(1, 1, 1, 16)
    near = (rope(q, 7) * rope(k, 3)).sum()
    far = (rope(q, 40_007) * rope(k, 40_003)).sum()
    other = (rope(q, 7) * rope(k, 57)).sum()                             # another offset
    assert math.isclose(float(near), float(far), rel_tol=0, abs_tol=3e-3)
    assert not math.isclose(float(near), float(other), abs_tol=0.1)


@pytest.mark.parametrize("route", ROUTES)
def test_a_base_set_after_construction_is_used_by_every_route(route):
    x = torch.randn(2, 3, 6, 16, dtype=torch.float64)
    rope = mh.RotaryEmbedding(16)
    rope(x, 0), rope(x, torch.arange(6))                  # the old base's table and angles
    rope.base = 500000.0
    torch.testing.assert_close(rope(x, ROUTES[route]()), closed_form(x, _as_tensor(ROUTES[route]()),
                                                                    base=500000.0),
                               atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("base", ["1e4", float("inf"), True, 1.0])
def test_a_bad_base_is_named(base):
    with pytest.raises(ValueError, match=r"base must be a finite number > 1.*got"):
        mh.RotaryEmbedding(8, base=base)
    rope = mh.RotaryEmbedding(8)
    with pytest.raises(ValueError, match="base must be"):
        rope.base = base
    assert rope.base == 10000.0


def test_head_dim_is_read_only():
    rope = mh.RotaryEmbedding(8)
    with pytest.raises(AttributeError):
        rope.head_dim = 4
    for name in ("rotary_dim", "attention_factor"):
        with pytest.raises(AttributeError):
            setattr(rope, name, 4)


@pytest.mark.parametrize("route", ROUTES)
def test_partial_rotary_equals_gpt_neox(route):
    """GPT-NeoX rotates the first rotary_pct of each head's channels (Pythia: 25%); the
    module refused any rope narrower than its heads, with advice to rotate them all."""
    from transformers import GPTNeoXConfig
    from transformers.models.gpt_neox.modeling_gpt_neox import (GPTNeoXRotaryEmbedding,
                                                                apply_rotary_pos_emb)
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 6, 32), torch.randn(2, 2, 6, 32)
    p = ROUTES[route]()
    config = GPTNeoXConfig(hidden_size=128, num_attention_heads=4, rotary_pct=0.25,
                           rotary_emb_base=10000, max_position_embeddings=512)
    pos = _as_tensor(p).long()
    cos, sin = GPTNeoXRotaryEmbedding(config)(q, pos if pos.dim() == 2 else pos[None])
    rope = mh.RotaryEmbedding(32, rotary_dim=8)
    ours = rope.rotate(q, k, positions=p)
    for a, b, x in zip(ours, apply_rotary_pos_emb(q, k, cos, sin), (q, k)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
        assert torch.equal(a[..., 8:], x[..., 8:])                  # the rest pass unchanged
    assert rope.inv_freq.shape == (4,) and "rotary_dim=8" in repr(rope)


@pytest.mark.parametrize("route", ROUTES)
def test_yarn_attention_factor_equals_hugging_face(route):
    """YaRN scales cos and sin by an attention factor besides its frequencies: written
    frequencies alone were 6% off Hugging Face's outputs, with no way to say the factor."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb
    torch.manual_seed(0)
    q, k = torch.randn(2, 4, 6, 16), torch.randn(2, 2, 6, 16)
    p = ROUTES[route]()
    config = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16,
                         max_position_embeddings=1024, rope_parameters={
                             "rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                             "original_max_position_embeddings": 256})
    hf = LlamaRotaryEmbedding(config)
    assert hf.attention_scaling > 1.1
    pos = _as_tensor(p).long()
    cos, sin = hf(q, pos if pos.dim() == 2 else pos[None])
    rope = mh.RotaryEmbedding(16, attention_factor=hf.attention_scaling)
    rope.inv_freq = hf.inv_freq.clone()
    for a, b in zip(rope.rotate(q, k, positions=p), apply_rotary_pos_emb(q, k, cos, sin)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)
    plain = mh.RotaryEmbedding(16, attention_factor=hf.attention_scaling)   # built frequencies
    torch.testing.assert_close(plain(q, p).double(), closed_form(q, _as_tensor(p)) *
                               hf.attention_scaling, atol=1e-4, rtol=1e-4)


def test_a_module_with_partial_rotary_decodes_as_its_full_forward():
    torch.manual_seed(0)
    m = mh.MultiHeadAttention(64, 4, num_kv_heads=2,
                              rope=mh.RotaryEmbedding(16, rotary_dim=4, attention_factor=1.2)).eval()
    x = torch.randn(2, 9, 64)
    with torch.no_grad():
        full = m(x, mask=mh.masks.causal())
        cache = m.make_cache(2, 12)
        steps = [m(x[:, :5], cache=cache, mask=mh.masks.causal())] + [
            m(x[:, t:t + 1], cache=cache, mask=mh.masks.causal()) for t in range(5, 9)]
    torch.testing.assert_close(torch.cat(steps, 1), full, atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match=r"rope was built for head_dim 8 but the module's head_dim "
                                         r"is 16: use RotaryEmbedding\(16\) \(or, to rotate only "
                                         r"the first 8 channels .*RotaryEmbedding\(16, rotary_dim=8\)"):
        mh.MultiHeadAttention(64, 4, rope=mh.RotaryEmbedding(8))
    with pytest.raises(ValueError, match=r"use RotaryEmbedding\(16\)$"):    # wider: no partial
        mh.MultiHeadAttention(64, 4, rope=mh.RotaryEmbedding(32))


def test_a_rope_pickled_before_rotary_dim_loads_as_a_full_rotation():
    import pickle
    rope = mh.RotaryEmbedding(8)
    state = rope.__getstate__()
    del state["_rotary_dim"], state["_factor"]                  # as an older version pickled
    old = mh.RotaryEmbedding.__new__(mh.RotaryEmbedding)
    old.__setstate__(state)
    x = torch.randn(1, 2, 3, 8)
    assert torch.equal(pickle.loads(pickle.dumps(old))(x, 2), rope(x, 2))


@pytest.mark.parametrize("kwargs, match", [
    (dict(rotary_dim=12), "rotary_dim 12 is more than head_dim 8"),
    (dict(rotary_dim=3), r"rotary_dim must be a positive even int at most head_dim 8 .*got 3"),
    (dict(rotary_dim=0), "rotary_dim must be a positive even int"),
    (dict(attention_factor=0.0), r"attention_factor must be a finite number > 0 .*got 0.0"),
    (dict(attention_factor=float("nan")), "attention_factor must be a finite number > 0"),
    (dict(attention_factor="2"), "attention_factor must be"),
])
def test_bad_rotary_dim_or_attention_factor_is_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        mh.RotaryEmbedding(8, **kwargs)


def test_head_dim_takes_numpy_ints():
    np = pytest.importorskip("numpy")
    rope = mh.RotaryEmbedding(np.int64(8), rotary_dim=np.int64(4))
    assert type(rope.head_dim) is int and rope.head_dim == 8 and rope.rotary_dim == 4


def _rotation_ops(rope: mh.RotaryEmbedding) -> list[str]:
    """The device ops of one rotation by ``rope`` (moved to meta, a stand-in for a GPU)."""
    import copy
    rope = copy.deepcopy(rope).to("meta")
    x = torch.empty(1, 2, 3, rope.head_dim, device="meta")
    with _DeviceOps() as mode:
        rope(x, 4)
    return mode.ops


def test_written_frequencies_survive_a_checkpoint_and_copies_keep_the_table():
    """Scaled RoPE saved, loaded and copied: the frequencies travel (state_dict, deepcopy,
    pickle, torch.save) and the built ones are neither saved nor lose the shared table."""
    import copy
    import io
    import pickle
    torch.manual_seed(0)
    m = mh.MultiHeadAttention(32, 4, rope=mh.RotaryEmbedding(8))
    x = torch.randn(1, 6, 32)
    assert "rope.inv_freq" not in m.state_dict()                      # built: not saved
    m.rope.inv_freq.mul_(0.25)
    want = m(x)
    loaded = mh.MultiHeadAttention(32, 4, rope=mh.RotaryEmbedding(8))
    loaded.load_state_dict(m.state_dict())
    torch.testing.assert_close(loaded(x), want, atol=0, rtol=0)

    def saved(o):
        buf = io.BytesIO()
        torch.save(o, buf)
        buf.seek(0)
        return torch.load(buf, weights_only=False)
    plain = mh.RotaryEmbedding(8)
    _rotation_ops(plain)                                               # builds the table
    fast = _rotation_ops(plain)
    for copied in (copy.deepcopy, lambda o: pickle.loads(pickle.dumps(o)), saved):
        torch.testing.assert_close(copied(m)(x), want, atol=0, rtol=0)
        assert _rotation_ops(copied(plain)) == fast                    # the table still serves
    assert len(_rotation_ops(m.rope)) > len(fast)                      # angles computed


def test_a_checkpoint_holding_inv_freq_loads_strictly_where_there_is_a_rope():
    """Older exports (and Hugging Face's before 4.3x) saved the built frequencies: accepted,
    and equal ones keep the table; a module without RoPE still refuses the key."""
    m = mh.MultiHeadAttention(32, 4, rope=mh.RotaryEmbedding(8))
    sd = {**m.state_dict(), "rope.inv_freq": m.rope.inv_freq.clone()}
    fresh = mh.RotaryEmbedding(8)
    _rotation_ops(fresh)                                               # builds the table
    fast = _rotation_ops(fresh)
    m.load_state_dict(sd)
    assert _rotation_ops(m.rope) == fast
    before = {k: v.clone() for k, v in m.state_dict().items()}
    for bad in (torch.zeros(3), torch.arange(4)):                     # refused before copying
        with pytest.raises(RuntimeError, match=r"rope.inv_freq: the frequencies must be a float "
                                               r"tensor of shape \(4,\).*Nothing was loaded"):
            m.load_state_dict({k: v + 1 for k, v in sd.items()} | {"rope.inv_freq": bad})
        assert all(torch.equal(m.state_dict()[k], v) for k, v in before.items())
    with pytest.raises(RuntimeError, match=r"unexpected keys \['rope.inv_freq'\]"):
        mh.MultiHeadAttention(32, 4).load_state_dict(sd)
    nan = sd["rope.inv_freq"].clone()
    nan[1] = float("nan")
    with pytest.raises(RuntimeError, match=r"rope.inv_freq holds NaN or inf in the checkpoint "
                                           r"\(every rotated query and key would be NaN\)"):
        m.load_state_dict(sd | {"rope.inv_freq": nan})
    assert all(torch.equal(m.state_dict()[k], v) for k, v in before.items())


def test_learned_frequencies_get_gradients_from_every_kind_of_position():
    x = torch.randn(1, 2, 4, 8)
    grads = []
    for positions in (3, torch.arange(3, 7), torch.arange(3, 7).float()):
        rope = mh.RotaryEmbedding(8)
        rope.inv_freq.requires_grad_()
        rope(x, positions).pow(2).mul(torch.arange(8.0)).sum().backward()
        grads.append(rope.inv_freq.grad)
    assert grads[0] is not None and grads[0].abs().sum() > 0
    for g in grads[1:]:
        torch.testing.assert_close(g, grads[0])


@pytest.mark.parametrize("call, error, match", [
    (lambda r, x: r(x, torch.tensor([0.0, float("nan"), 2.0])), ValueError,
     r"positions must be finite, got \[nan\] at index \[\(1,\)\]"),
    (lambda r, x: r(x, torch.tensor([True, False, True])), TypeError,
     r"positions must be an integer or float tensor, got torch.bool"),
    (lambda r, x: r(x, torch.tensor([1j, 2j, 3j])), TypeError, r"got torch.complex64"),
    (lambda r, x: r(x.long(), 0), TypeError, r"must be floating point .* got torch.int64"),
    (lambda r, x: r(x, 2 ** 70), ValueError, r"past 2\*\*53"),
    (lambda r, x: mh.MultiHeadAttention(16, 2, rope=r)(torch.randn(1, 3, 16), positions="abc"),
     TypeError, r"positions must be an int .* got 'abc'"),
    (lambda r, x: mh.MultiHeadAttention(16, 2, rope=r)(
        torch.randn(1, 3, 16), positions=torch.tensor([0.0, float("inf"), 1.0])),
     ValueError, r"positions must be finite, got \[inf\]"),
    (lambda r, x: r(x, torch.arange(300, 303).bfloat16()), ValueError,    # (300, 300, 302)
     r"positions in torch.bfloat16 reach 302, past 256, where torch.bfloat16 no longer holds "
     r"every integer \(257 is stored as 256\): pass them as int64"),
    (lambda r, x: r(x, torch.arange(2048, 2051).half()), ValueError,    # (2048, 2048, 2050)
     r"torch.float16 reach 2050, past 2048.*\(2049 is stored as 2048\)"),
    (lambda r, x: r.rotate(torch.randn(2, 4, 3, 8), torch.randn(3, 2, 3, 8),
                           positions=torch.arange(3).expand(2, 3)), ValueError,
     r"positions of shape \(2, 3\) hold one row per sequence, but the inputs are "
     r"\[\(2, 4, 3, 8\), \(3, 2, 3, 8\)\]: rotate tensors \(B, H, S, D\) of batch B = 2 \(or 1\)"),
], ids=["nan", "bool", "complex", "int x", "huge", "str", "module inf", "bf16", "fp16",
        "batches"])
def test_positions_and_inputs_that_are_not_positions_or_numbers_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call(mh.RotaryEmbedding(8), torch.randn(1, 1, 3, 8))


@pytest.mark.parametrize("write, match", [
    (lambda r: setattr(r, "inv_freq", torch.ones(2)),
     r"inv_freq must be a float tensor of shape \(4,\) \(rotary_dim 8 / 2\), got "
     r"torch.float32 \(2,\): assign frequencies of that shape, or set .base"),
    (lambda r: setattr(r, "inv_freq", torch.arange(4)), r"got torch.int64 \(4,\)"),
    (lambda r: setattr(r, "inv_freq", torch.full((4,), float("nan"))), r"inv_freq holds NaN or inf"),
    (lambda r: r.inv_freq.__setitem__(1, float("inf")), r"inv_freq holds NaN or inf"),
    (lambda r: delattr(r, "inv_freq") or setattr(r, "inv_freq", torch.nn.Parameter(
        torch.full((4,), float("nan")))), r"inv_freq holds NaN or inf"),        # (learned)
], ids=["shape", "dtype", "nan", "inf in place", "learned nan"])
def test_frequencies_written_that_cannot_serve_are_named_at_the_call(write, match):
    """A checkpoint's inv_freq is checked as it loads; one assigned or written in place
    reached the rotation as it was: a shape torch's broadcasting names in its own terms,
    or NaN in every rotated row."""
    rope = mh.RotaryEmbedding(8)
    write(rope)
    with pytest.raises(ValueError, match=match):
        rope(torch.randn(1, 1, 3, 8), 0)
    if "inv_freq" in rope._parameters:        # learned: not replaced by a rebuilt buffer
        with pytest.raises(ValueError, match=r"inv_freq is a learned nn.Parameter here"):
            rope.base = rope.base
        return
    learned = mh.RotaryEmbedding(8)
    learned.inv_freq.requires_grad_()
    with pytest.raises(ValueError, match=r"inv_freq is a learned buffer \(it requires grad\) here"):
        learned.base = 500000.0
    assert learned.inv_freq.requires_grad and learned.base == 10000.0
    rope.base = rope.base                     # setting the base rebuilds the frequencies
    assert rope(torch.randn(1, 1, 3, 8), 0).isfinite().all()


def test_built_frequencies_in_other_precisions_or_formulas_keep_the_table():
    """An fp16/bf16 export of the built frequencies, or Hugging Face's 1 / base^(2i/D)
    (an ulp away in fp32), are the built ones: not adopted as scaled RoPE."""
    fresh = mh.RotaryEmbedding(64)
    _rotation_ops(fresh)
    fast = _rotation_ops(fresh)
    hf = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    for saved in (fresh.inv_freq.bfloat16(), fresh.inv_freq.half(), hf):
        rope = mh.RotaryEmbedding(64)
        rope.load_state_dict({"inv_freq": saved})
        assert _rotation_ops(rope) == fast, saved.dtype


@pytest.mark.parametrize("saved", ["scaled", "built"])     # (built: a step-0 checkpoint)
@pytest.mark.parametrize("learned", ["buffer", "parameter"])
def test_loading_into_learned_frequencies_copies_into_them_and_copies_share_nothing(saved,
                                                                                     learned):
    """A learned inv_freq (a buffer that requires grad, or an nn.Parameter) is what an
    optimizer holds: a load copies into it, built frequencies included (they replaced it
    with a buffer that did not learn, or, for a Parameter, failed halfway through the
    module's load), and every other tensor loads."""
    import copy
    src = mh.MultiHeadAttention(32, 4, rope=mh.RotaryEmbedding(8))
    state = {**src.state_dict(), "rope.inv_freq": src.rope.inv_freq.clone() if saved == "built"
             else torch.tensor([1.0, 0.5, 0.25, 0.125])}
    mod = mh.MultiHeadAttention(32, 4, rope=mh.RotaryEmbedding(8))
    if learned == "buffer":
        mod.rope.inv_freq.requires_grad_()
    else:
        mod.rope.inv_freq = torch.nn.Parameter(mod.rope.inv_freq.clone())
    held = mod.rope.inv_freq
    mod.load_state_dict(state)
    assert mod.rope.inv_freq is held and held.requires_grad
    assert torch.equal(held, state["rope.inv_freq"])
    assert torch.equal(mod.in_proj_weight, src.in_proj_weight)
    assert torch.equal(mod.out_proj.weight, src.out_proj.weight)
    mod(torch.randn(1, 3, 32)).sum().backward()
    assert held.grad is not None and held.grad.abs().sum() > 0
    mod.load_state_dict(state, assign=True)              # replaced, as torch's assign does,
    assert mod.rope.inv_freq is not held and mod.rope.inv_freq.requires_grad     # still learned
    assert torch.equal(mod.rope.inv_freq, state["rope.inv_freq"])
    bad = {**state, "rope.inv_freq": torch.full((4,), float("nan"))}
    before = mod.rope.inv_freq.detach().clone()
    with pytest.raises(RuntimeError, match=r"inv_freq holds NaN or inf in the checkpoint"):
        mod.rope.load_state_dict({"inv_freq": bad["rope.inv_freq"]})
    assert torch.equal(mod.rope.inv_freq, before)        # (a Parameter was written first)
    plain = mh.RotaryEmbedding(8)
    shallow = copy.copy(plain)
    assert "inv_freq" not in plain.state_dict() and "inv_freq" not in shallow.state_dict()
    assert _rotation_ops(plain) == _rotation_ops(shallow)


def test_a_meta_module_takes_written_frequencies_with_assign():
    src = mh.MultiHeadAttention(32, 4, rope=mh.RotaryEmbedding(8))
    src.rope.inv_freq.mul_(0.5)
    meta = mh.MultiHeadAttention(32, 4, rope=mh.RotaryEmbedding(8)).to("meta")
    meta.load_state_dict(src.state_dict(), assign=True)
    x = torch.randn(1, 5, 32)
    torch.testing.assert_close(meta(x), src(x), atol=0, rtol=0)


def test_meta_frequencies_are_refused_by_a_rope_with_values():
    rope = mh.RotaryEmbedding(8)
    rope.inv_freq.mul_(0.5)
    before = rope.inv_freq.clone()
    with pytest.raises(RuntimeError, match=r"inv_freq is on the meta device in the checkpoint"):
        rope.load_state_dict({"inv_freq": torch.empty(4, device="meta")})
    assert torch.equal(rope.inv_freq, before)
    meta = mh.RotaryEmbedding(8).to("meta")
    meta.load_state_dict({"inv_freq": torch.rand(4)})       # shapes only, as torch's copy
    assert meta.inv_freq.is_meta

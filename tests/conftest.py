"""Shared helpers: the fp64 oracle, the "plain PyTorch" baseline of the error rule, masks."""

from __future__ import annotations

import contextlib
import random
import sys

import os

import pytest
import torch

if not torch.cuda.is_available():          # Triton kernels run on the CPU, interpreted
    os.environ.setdefault("TRITON_INTERPRET", "1")
from hypothesis import settings

# CI must be reproducible: the same examples every run (explore locally with --hypothesis-seed)
settings.register_profile("repeatable", derandomize=True)
settings.load_profile("repeatable")

import multihead as mh
from multihead.functional.backend import _tiles

#: the backends that run every mask (most tests use these)
BACKENDS = ["reference", "sdpa", "blocksparse"]
#: every registered backend: a new one meets the oracle without editing a test
ALL_BACKENDS = sorted(mh.backends())


def skip_unless_runs(backend: str, q, k, v, **kw) -> None:
    """Skip the test when ``backend`` cannot run this call, after checking it says so."""
    try:
        mh.explain(q, k, v, backend=backend, **kw)
    except ValueError as e:
        assert f"backend={backend!r} cannot run this call: it " in str(e)
        pytest.skip(f"{backend} does not run this call")


def pytest_collection_modifyitems(config, items):
    """Tests marked ``cuda`` skip cleanly on a machine without a GPU (CI has none)."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (none on this machine)")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


@contextlib.contextmanager
def small_tiles(tile: int = 8, budget: int = 2048):
    """Shrink the blocksparse tiles so small tests cross many tiles, chunks and steps."""
    saved = _tiles.TILE, _tiles.TILE_Q, _tiles.BUDGET
    _tiles.TILE, _tiles.TILE_Q, _tiles.BUDGET = tile, tile, budget
    try:
        yield
    finally:
        _tiles.TILE, _tiles.TILE_Q, _tiles.BUDGET = saved


@pytest.fixture
def tiny_tiles():
    with small_tiles():
        yield


@pytest.fixture
def triton_on_this_device(monkeypatch):
    """The triton backend runs through ``mh.attention`` on this machine's device (under the
    interpreter on a CPU); plans made meanwhile are forgotten after."""
    import dataclasses
    pytest.importorskip("triton")
    from multihead.functional.backend import triton as tb
    caps = tb.TritonFlash.capabilities
    monkeypatch.setattr(tb.TritonFlash, "capabilities", dataclasses.replace(caps, devices=None))
    mh.functional.dispatch.clear_cache()
    yield
    mh.functional.dispatch.clear_cache()


def oracle(q, k, v, mask=None, scale=None):
    """The reference backend in float64: the oracle of every test."""
    m = mask.to(q.device) if mask is not None else None
    if isinstance(m, mh.masks.Bias):
        m = mh.masks.bias(m.raw.double())
    return mh.attention(q.double(), k.double(), v.double(), mask=m, scale=scale,
                        backend="reference")


def assert_kernel_matches_oracle(out, lse, q, k, v, mask=None, scale=None):
    """A kernel's ``(out, lse)`` against the fp64 oracle: the output within the error rule
    (twice the error of an fp32 run rounded to the inputs' dtype, plus 2 ulp), the lse to
    1e-4, and rows with nothing to attend to exactly zero with an lse of ``-inf``."""
    ref, ref_lse = mh.attention(q.double(), k.double(), v.double(), mask=mask, scale=scale,
                                backend="reference", return_lse=True)
    plain = mh.attention(q.float(), k.float(), v.float(), mask=mask, scale=scale,
                         backend="reference")
    err = (out.double() - ref).abs().max()
    base = (plain.to(q.dtype).double() - ref).abs().max()
    assert err <= 2 * base + 2 * torch.finfo(q.dtype).eps, (err, base)
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))          # empty rows: -inf
    fin = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse[fin].double(), ref_lse[fin], atol=1e-4, rtol=1e-4)
    assert (out[~fin] == 0).all()                                       # ... and zeros


def plain_torch(q, k, v, mask=None):
    """Attention written the plain way, every op in the inputs' dtype (the error-rule baseline)."""
    sq, sk, g = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (q @ k.transpose(-1, -2)) * (q.shape[-1] ** -0.5)
    if mask is not None:
        s = s + mask.additive(sq, sk, dtype=s.dtype, device=q.device)
    empty = torch.isneginf(s).all(dim=-1, keepdim=True)     # rows with nothing to attend to
    w = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    return w @ v


def make_masks(B: int, H: int, sq: int, sk: int, seed: int = 0) -> dict[str, mh.masks.Mask | None]:
    """One of every mask kind, and compositions, for a call of these sizes."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, sk + 1, (B,), generator=g)
    lengths[0] = sk
    left = torch.arange(sk).unsqueeze(0) >= torch.randint(0, sk, (B,), generator=g).unsqueeze(1)
    ids = torch.sort(torch.randint(0, 4, (B, sk), generator=g), dim=1).values
    q_ids = torch.sort(torch.randint(0, 4, (B, sq), generator=g), dim=1).values
    doc = (mh.masks.document(ids) if sq <= sk else mh.masks.document(q_ids, kv_ids=ids))
    dense = torch.rand(B, 1, sq, sk, generator=g) > 0.4
    b = torch.randn(1, H, sq, sk, generator=g)
    b[torch.rand(1, H, sq, sk, generator=g) > 0.8] = float("-inf")
    qlen = torch.randint(0, sq + 1, (B,), generator=g)
    k_pos = left.cumsum(-1) - 1               # a left-padded row: -1 first, repeats at gaps
    q_pos = torch.sort(torch.randint(-1, sk + 1, (B, sq), generator=g), dim=1).values
    M = mh.masks
    return {
        "none": None,
        "causal": M.causal(),
        "causal_upper_left": M.causal(align="upper_left"),
        "sliding_window": M.sliding_window(max(2, sk // 5)),
        "padding_lengths": M.padding(lengths),
        "padding_left_bool": M.padding(left),
        "padding_query": M.padding(qlen, side="query"),
        "document": doc,
        "dense": M.dense(dense),
        "bias": M.bias(b),
        "alibi": M.alibi(H),
        "causal&padding": M.causal() & M.padding(lengths),
        "window&document": M.sliding_window(max(2, sk // 3)) & doc,
        "causal|dense": M.causal() | M.dense(dense),
        "~dense&alibi": ~M.dense(dense) & M.alibi(H),
        "causal&alibi": M.causal() & M.alibi(H),
        "positions(window&alibi)&padding": M.at_positions(
            M.sliding_window(max(2, sk // 4)) & M.alibi(H), q_pos, k_pos) & M.padding(left),
    }


MASK_NAMES = list(make_masks(1, 1, 4, 4))


# -- texts shared by the inspection tests ------------------------------------------------
WORDS = ("the animal didn't cross the street because it was too tired and the river ran fast "
         "under an old bridge while children played near houses, dogs barked; she said he left "
         "early: they watched birds fly over hills, trees and fields.").split()


@pytest.fixture
def stdout_reader_gone(monkeypatch):
    """A context in which stdout is a pipe whose reader has left (``multihead ... | head -1``
    after its line); entered inside the test, as pytest's capture sets sys.stdout again when
    the test starts."""
    @contextlib.contextmanager
    def gone():
        r, w = os.pipe()
        os.close(r)
        out = os.fdopen(w, "w")
        monkeypatch.setattr(sys, "stdout", out)
        try:
            yield
        finally:
            monkeypatch.undo()
            with contextlib.suppress(OSError):
                out.close()
    return gone


@pytest.fixture(scope="session")
def long_text() -> str:
    """A text (for tests/inspection) of ~870 tokens: MiniLM keeps its first 512 (its positions)."""
    rng = random.Random(0)
    return " ".join(rng.choice(WORDS) for _ in range(700))

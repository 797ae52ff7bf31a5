"""The benchmark cases of each suite: what runs for us, what runs for each peer, and the work.

FLOPs are counted the FlashAttention way: ``4·B·H·Sq·Sk·D`` for a forward, 2.5x that for
the backward (3.5x for forward + backward), times the fraction of (query, key) pairs the
mask leaves (only the unmasked work counts for sparse masks). Decoding is memory-bound and
is reported in bytes of K/V cache read per second instead.

Notation used for tensor shapes: B batch, H heads, Hkv K/V heads, S length, D head dim.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn.functional as F

import multihead as mh
from . import peers as P

@dataclass
class Built:
    """A case made concrete on a device: callables to time, and the work they do."""

    ours: Callable
    peers: dict = field(default_factory=dict)      # name -> callable, or a str: why skipped
    flops: float | None = None
    bytes: float | None = None
    items: float | None = None                     # things done per call (texts), unit "texts/s"
    naive_bytes: int = 0
    unit: str = "FLOP/s"
    compile: dict = field(default_factory=dict)    # peer -> compile-and-check step (see flex)
    naive: set = field(default_factory=set)        # peers that materialize O(H·S²) scores
    overhead_vs: str | None = None                 # report ours - this peer's time per call


@dataclass
class Case:
    """A row of a suite; ``build`` makes its inputs only when it runs."""

    family: str
    name: str
    seq: int | None
    mode: str
    build: Callable[[torch.device, torch.dtype], Built]


def _doc_lengths(S: int, seed: int = 0, longest: int = 512) -> list[int]:
    rng, out = random.Random(seed), []
    while sum(out) < S:
        out.append(min(rng.randint(64, longest), S - sum(out)))
    return out


def _with_backward(fn, inputs, train: bool):
    """``fn`` for a forward, or forward + backward of a fixed upstream gradient."""
    if not train:
        def run():
            with torch.no_grad():
                return fn()
        return run
    grad = None

    def run_train():
        nonlocal grad
        out = fn()
        grad = torch.ones_like(out) if grad is None else grad
        torch.autograd.backward(out, grad)
        for t in inputs:
            t.grad = None
    return run_train


LABELS = {"dense": "dense", "causal": "causal", "window": "sliding window {window}",
          "documents": "packed documents 64-{longest}", "padding": "key padding, random lengths",
          "causal&padding": "causal & key padding, random lengths", "alibi": "ALiBi bias"}


def _mask(kind: str, S: int, B: int, H: int, window: int, longest: int = 512):
    """The case's mask (None for dense), its document lengths (64 to ``longest``) and its
    key lengths (random, seeded, between S/4 and S: one per sequence)."""
    docs = _doc_lengths(S, longest=longest) if kind == "documents" else []
    rng = random.Random(0)
    keys = torch.tensor([rng.randint(S // 4, S) for _ in range(B)]) if "padding" in kind else None
    M = mh.masks
    mask = {"dense": lambda: None, "causal": M.causal,
            "window": lambda: M.sliding_window(window),
            "documents": lambda: M.document(cu_seqlens=torch.tensor([0] + docs).cumsum(0)),
            "padding": lambda: M.padding(keys),
            "causal&padding": lambda: M.causal() & M.padding(keys),
            "alibi": lambda: M.alibi(H)}[kind]()
    return mask, docs, keys


def attention_case(kind: str, S: int, *, B=1, H=12, D=64, window=256, train=False,
                   flex=False, family: str | None = None, longest: int = 512,
                   dropout: float = 0.0) -> Case:
    """Attention at length S under one mask kind (a key of :data:`LABELS`), against SDPA
    (plain, ``is_causal``, or with the mask materialized), the seeds' tutorial, and compiled
    flex_attention (with ``flex``, and on CUDA for every masked kind). With ``dropout``,
    every call drops weights at that rate: SDPA's too, the tutorial and flex_attention
    (which have none) are left out."""
    if kind not in LABELS:
        raise ValueError(f"unknown mask kind {kind!r}: choose one of {', '.join(LABELS)}")
    mode = "fwd+bwd" if train else "fwd"
    label = LABELS[kind].format(window=window, longest=longest) + (
        f", dropout {dropout}" if dropout else "")
    drop = {"dropout_p": dropout} if dropout else {}

    def build(device, dtype) -> Built:
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(B, H, S, D, generator=g).to(device, dtype).requires_grad_(train)
                   for _ in range(3))
        mask, docs, keys = _mask(kind, S, B, H, window, longest)
        mask = mask.to(device) if mask is not None else None
        allowed = (mask.materialize(S, S, device)                               # (B', 1, S, S)
                   if mask is not None and mask.has_predicate else None)
        density = (1.0 if allowed is None
                   else allowed.sum(dtype=torch.int64).item() / allowed.numel())
        item = torch.empty((), dtype=dtype).element_size()
        ours = lambda: mh.attention(q, k, v, mask=mask, **drop)
        b = Built(_with_backward(ours, (q, k, v), train),
                  flops=4 * B * H * S * S * D * density * (3.5 if train else 1.0),
                  naive_bytes=B * H * S * S * item, naive={"seed tutorial"})
        peer = lambda f: _with_backward(f, (q, k, v), train)
        if device.type == "cuda" and kind in ("dense", "causal"):
            _add_gpu_sdpa(b, peer, q, k, v, kind == "causal", dropout)
        if kind == "dense":
            b.peers["sdpa"] = peer(lambda: F.scaled_dot_product_attention(q, k, v, **drop))
            if not dropout:
                b.peers["seed tutorial"] = peer(lambda: P.tutorial_attention(q, k, v))
        else:
            if kind == "causal":
                b.peers["sdpa is_causal"] = peer(lambda: F.scaled_dot_product_attention(
                    q, k, v, is_causal=True, **drop))
            dense = allowed if allowed is not None else mask.additive(S, S, device, dtype)
            b.peers["sdpa + dense mask"] = peer(lambda: F.scaled_dot_product_attention(
                q, k, v, attn_mask=dense, **drop))
            if allowed is not None:     # (SDPA with a bool mask holds only the S x S mask)
                if not dropout:
                    b.peers["seed tutorial"] = peer(lambda: P.tutorial_attention(q, k, v,
                                                                                 allowed))
            else:                       # the tutorial has no additive bias; SDPA's is H·S²
                b.naive = {"sdpa + dense mask"}
        if dropout:
            return b                    # (flex_attention has no dropout)
        if flex or (device.type == "cuda" and kind != "dense"):
            from . import flex as FX
            mods = FX.mods(kind, heads=H, device=device, window=window, doc_lengths=docs,
                           key_lengths=keys)
            FX.add_peer(b, peer, q, k, v, *mods, reference=None if train else ours)
        return b

    return Case(family or kind, f"{label}, B={B} H={H} S={S} D={D}", S, mode, build)


def _add_gpu_sdpa(b: Built, peer, q, k, v, causal: bool, dropout: float = 0.0) -> None:
    """On CUDA: SDPA pinned to its flash and cuDNN backends, as separate peers (a backend that
    cannot run the call is reported as failed in the row), at the case's ``dropout``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for label, backend in (("flash", "FLASH_ATTENTION"), ("cuDNN", "CUDNN_ATTENTION")):
        if not hasattr(SDPBackend, backend):
            b.peers[f"sdpa ({label} backend)"] = f"SDPBackend.{backend} is not in this torch"
            continue

        def run(kind=getattr(SDPBackend, backend)):
            with sdpa_kernel(kind):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                      dropout_p=dropout)
        b.peers[f"sdpa ({label} backend)"] = peer(run)


def paged_decode_case(L: int, *, B=1, H=32, Hkv=8, D=128, page_size=64) -> Case:
    """One GQA decode step of B sequences of L tokens read from a PagedKVCache through its
    block table (the Triton kernel; pages written in turn, so they interleave), against our
    kernel on a static KVCache of the same tokens and SDPA on it (CUDA with Triton only)."""
    def build(device, dtype) -> Built:
        from ..kernels.decode import paged_decode_forward
        g = torch.Generator(device="cpu").manual_seed(0)
        pool = mh.PagedKVCache(B * -(-L // page_size), page_size, Hkv, D, dtype=dtype,
                               device=device)
        ids = [pool.add_sequence() for _ in range(B)]
        k, v = (torch.randn(B, Hkv, L, D, generator=g).to(device, dtype) for _ in "kv")
        for start in range(0, L, page_size):          # one page of every sequence in turn
            for b, sid in enumerate(ids):                 # (written in place: no gather)
                pool.batch([sid]).update_in_place(k[b:b + 1, :, start:start + page_size],
                                                  v[b:b + 1, :, start:start + page_size])
        view = pool.batch(ids).update_in_place(k[:, :, :0], v[:, :, :0])    # no new tokens
        q = torch.randn(B, H, 1, D, generator=g).to(device, dtype)
        causal = mh.masks.causal()
        nograd = lambda f: _with_backward(f, (), False)
        scale = D ** -0.5
        return Built(nograd(lambda: paged_decode_forward(
                         q, view.k, view.v, view.table, view.lengths, max_len=L,
                         page_size=page_size, scale=scale, causal=True)[0]),
                     {"ours, static cache": nograd(lambda: mh.attention(
                         q, k, v, mask=causal, backend="triton")),
                      "sdpa enable_gqa": nograd(lambda: F.scaled_dot_product_attention(
                          q, k, v, enable_gqa=True))},
                     bytes=k.nbytes + v.nbytes, unit="B/s")
    batch = f"B={B} " if B > 1 else ""
    return Case("paged decode", f"GQA decode step from pages of {page_size}, {batch}H={H} "
                f"Hkv={Hkv} D={D}, cache {L}", L, "fwd", build)


def decode_case(L: int, *, B=1, H=32, Hkv=8, D=128) -> Case:
    """One GQA decode step (Sq=1) of B sequences against a KVCache holding L tokens each:
    memory-bound (the name shows B when it is above 1)."""
    def build(device, dtype) -> Built:
        cache = mh.KVCache(B, L, Hkv, D, dtype=dtype, device=device)
        g = torch.Generator(device="cpu").manual_seed(0)
        cache.update(torch.randn(B, Hkv, L, D, generator=g).to(device, dtype),
                     torch.randn(B, Hkv, L, D, generator=g).to(device, dtype))
        k, v = cache.k[:, :, :cache.seen], cache.v[:, :, :cache.seen]          # (B, Hkv, L, D)
        q = torch.randn(B, H, 1, D, generator=g).to(device, dtype)
        causal = mh.masks.causal()
        nograd = lambda f: _with_backward(f, (), False)
        return Built(nograd(lambda: mh.attention(q, k, v, mask=causal)),
                     {"sdpa enable_gqa": nograd(lambda: F.scaled_dot_product_attention(
                         q, k, v, enable_gqa=True)),
                      "HF repeat-K/V (eager)": nograd(lambda: P.hf_gqa_eager(q, k, v))},
                     bytes=k.nbytes + v.nbytes, unit="B/s", naive={"HF repeat-K/V (eager)"},
                     # the scores and the K and V it repeats to H heads: (B, H, L) + 2 (B, H, L, D)
                     naive_bytes=B * H * L * (1 + 2 * D) * torch.empty((), dtype=dtype).element_size())
    batch = f"B={B} " if B > 1 else ""
    return Case("decode", f"GQA decode step, {batch}H={H} Hkv={Hkv} D={D}, cache {L}", L, "fwd",
                build)


def overhead_case(kind: str, *, B=1, H=8, S=128, D=64) -> Case:
    """Per-call overhead: a call so small that launching it is most of its cost, ours vs
    SDPA (``is_causal`` for causal; for padding, the same bool key padding tensor, made
    afresh at each call as each batch brings its own, row b keeping ``S - 8 b`` keys); the
    row reports ours - SDPA per call as well."""
    if kind not in ("dense", "causal", "padding"):
        raise ValueError(f"overhead_case: kind must be 'dense', 'causal' or 'padding', "
                         f"got {kind!r}")

    def build(device, dtype) -> Built:
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(B, H, S, D, generator=g).to(device, dtype) for _ in range(3))
        causal = kind == "causal"
        mask = mh.masks.causal() if causal else None
        nograd = lambda f: _with_backward(f, (), False)
        name = {"causal": "sdpa is_causal", "padding": "sdpa (bool mask)"}.get(kind, "sdpa")
        density = (S + 1) / (2 * S) if causal else 1.0
        if kind == "padding":
            kept = torch.tensor([S - 8 * b for b in range(B)], device=device)   # (B,)
            keys = torch.arange(S, device=device)
            padding = lambda: (keys < kept[:, None])[:, None, None, :]     # (B, 1, 1, S) fresh
            density = float(kept.sum()) / (B * S)
            return Built(nograd(lambda: mh.attention(q, k, v, mask=padding())),
                         {name: nograd(lambda: F.scaled_dot_product_attention(
                             q, k, v, attn_mask=padding()))},
                         flops=4 * B * H * S * S * D * density, overhead_vs=name)
        return Built(nograd(lambda: mh.attention(q, k, v, mask=mask)),
                     {name: nograd(lambda: F.scaled_dot_product_attention(
                         q, k, v, is_causal=causal))},
                     flops=4 * B * H * S * S * D * density, overhead_vs=name)
    return Case("overhead", f"per-call overhead, {kind}, B={B} H={H} S={S} D={D}", S, "fwd",
                build)


def mha_flops(B: int, S: int, E: int, train: bool) -> float:
    """FLOPs of the MHA layer on ``(B, S, E)``: four ``E x E`` projections (a backward
    computes the input's and the weight's gradients, 2x the forward each: 3x in all) and the
    attention core (3.5x, the FlashAttention count).

    Example:
        >>> mha_flops(8, 512, 768, True) / 1e9
        80.530636...
    """
    projections = 2 * B * S * 4 * E * E
    core = 4 * B * S * S * E
    return projections * (3.0 if train else 1.0) + core * (3.5 if train else 1.0)


def mha_case(B: int, S: int, E: int, H: int, *, train=False) -> Case:
    """The MHA layer: ours (copied weights) vs torch.nn.MultiheadAttention and the tutorial."""
    def build(device, dtype) -> Built:
        torch.manual_seed(0)
        ref = torch.nn.MultiheadAttention(E, H, batch_first=True).to(device, dtype)
        ours = mh.MultiHeadAttention.from_torch(ref).to(device, dtype)
        tut = P.SeedTutorialMHA(E, H).to(device, dtype)
        x = torch.randn(B, S, E, device=device).to(dtype).requires_grad_(train)
        first = lambda f: (lambda: f()[0])                               # (out, weights) -> out
        flops = mha_flops(B, S, E, train)
        wrap = lambda f: _with_backward(f, (x,), train)
        return Built(wrap(lambda: ours(x)),
                     {"torch MHA (need_weights=True, default)": wrap(first(lambda: ref(x, x, x))),
                      "torch MHA (need_weights=False)": wrap(first(
                          lambda: ref(x, x, x, need_weights=False))),
                      "seed tutorial class": wrap(first(lambda: tut(x)))},
                     flops=flops, naive_bytes=B * H * S * S * torch.empty((), dtype=dtype).element_size(),
                     naive={"torch MHA (need_weights=True, default)", "seed tutorial class"})
    return Case("mha", f"MHA layer, B={B} S={S} E={E} H={H}", S, "fwd+bwd" if train else "fwd", build)


def dropin_case(B: int, S: int, E: int, H: int, *, train=False, need_weights=True,
                padding=False) -> Case:
    """The drop-in ``multihead.nn.MultiheadAttention`` (copied weights) against
    ``torch.nn.MultiheadAttention`` on the same call: self-attention as written for torch
    (its default ``need_weights=True``, or not), and a ``key_padding_mask`` (a quarter of one
    sequence padded) where ``padding``."""
    def build(device, dtype) -> Built:
        torch.manual_seed(0)
        ref = torch.nn.MultiheadAttention(E, H, batch_first=True).to(device, dtype)
        ours = mh.nn.MultiheadAttention(E, H, batch_first=True).to(device, dtype)
        ours.load_state_dict(ref.state_dict())
        x = torch.randn(B, S, E, device=device).to(dtype).requires_grad_(train)
        kw = dict(need_weights=need_weights)
        if padding:
            kpm = torch.zeros(B, S, dtype=torch.bool, device=device)
            kpm[0, S - S // 4:] = True
            kw["key_padding_mask"] = kpm
        call = lambda m: _with_backward(lambda: m(x, x, x, **kw)[0], (x,), train)  # noqa: E731
        scores = B * H * S * S * torch.empty((), dtype=dtype).element_size()
        return Built(call(ours), {"torch MHA (the same call)": call(ref)},
                     flops=mha_flops(B, S, E, train), naive_bytes=scores if need_weights else 0,
                     naive={"torch MHA (the same call)"} if need_weights else set())
    what = ("need_weights=True (default)" if need_weights else "need_weights=False") + (
        ", key_padding_mask" if padding else "")
    return Case("drop-in", f"drop-in MHA, {what}, B={B} S={S} E={E} H={H}", S,
                "fwd+bwd" if train else "fwd", build)


def minilm_case(n: int = 256) -> Case:
    """Sentence embedding with the embedded MiniLM: packed (ours) vs HF padded batches of 32."""
    def build(device, dtype) -> Built:
        from ..models import default_model_dir, load
        from .corpus import corpus
        model = load(dtype=dtype, device=device)
        texts = corpus(model, n)
        b = Built(lambda: model.embed(texts), unit="texts/s", items=float(len(texts)))
        try:
            from transformers import AutoTokenizer, BertModel
        except ImportError:
            b.peers["HF BertModel (sdpa), batches of 32"] = "transformers is not installed"
            return b
        from transformers.utils import logging as hf_logging
        hf_logging.disable_progress_bar()                  # (a bar on stderr mid-table)
        hf = BertModel.from_pretrained(str(default_model_dir()), attn_implementation="sdpa")
        hf = hf.to(device, dtype).eval()
        tok = AutoTokenizer.from_pretrained(str(default_model_dir()))

        def peer():
            with torch.inference_mode():
                return P.hf_embed(hf, tok, texts)
        b.peers["HF BertModel (sdpa), batches of 32"] = peer
        return b
    return Case("minilm", f"MiniLM sentence embedding, {n} texts of 8-128 tokens", None, "fwd",
                build)

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

SUITES = ("quick", "standard", "full")


@dataclass
class Built:
    """A case made concrete on a device: callables to time, and the work they do."""

    ours: Callable
    peers: dict = field(default_factory=dict)      # name -> callable, or a str: why skipped
    flops: float | None = None
    bytes: float | None = None
    naive_bytes: int = 0
    unit: str = "FLOP/s"
    compile: dict = field(default_factory=dict)    # peer -> callable whose first call compiles
    naive: set = field(default_factory=set)        # peers that materialize O(H·S²) scores


@dataclass
class Case:
    """A row of a suite; ``build`` makes its inputs only when it runs."""

    family: str
    name: str
    seq: int | None
    mode: str
    build: Callable[[torch.device, torch.dtype], Built]


def _density(kind: str, S: int, window: int, lengths: list[int]) -> float:
    """Fraction of the S x S pairs the mask allows (exact)."""
    if kind == "dense":
        return 1.0
    if kind == "causal":
        return (S + 1) / (2 * S)
    if kind == "window":
        w = min(window, S)
        return (w * (w + 1) / 2 + (S - w) * w) / S ** 2
    return sum(n * n for n in lengths) / S ** 2


def _doc_lengths(S: int, seed: int = 0) -> list[int]:
    rng, out = random.Random(seed), []
    while sum(out) < S:
        out.append(min(rng.randint(64, 512), S - sum(out)))
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


def attention_case(kind: str, S: int, *, B=1, H=12, D=64, window=256, train=False,
                   flex=False) -> Case:
    """Dense, causal, sliding-window or packed-document attention at length S."""
    mode = "fwd+bwd" if train else "fwd"
    label = {"dense": "dense", "causal": "causal", "window": f"sliding window {window}",
             "documents": "packed documents 64-512"}[kind]

    def build(device, dtype) -> Built:
        g = torch.Generator(device="cpu").manual_seed(0)
        q, k, v = (torch.randn(B, H, S, D, generator=g).to(device, dtype).requires_grad_(train)
                   for _ in range(3))
        lengths = _doc_lengths(S) if kind == "documents" else []
        mask = {"dense": None, "causal": mh.masks.causal(),
                "window": mh.masks.sliding_window(window),
                "documents": mh.masks.document(
                    cu_seqlens=torch.tensor([0] + lengths).cumsum(0))}[kind]
        mask = mask.to(device) if mask is not None else None
        item = torch.empty((), dtype=dtype).element_size()
        b = Built(_with_backward(lambda: mh.attention(q, k, v, mask=mask), (q, k, v), train),
                  flops=4 * B * H * S * S * D * _density(kind, S, window, lengths)
                  * (3.5 if train else 1.0), naive_bytes=B * H * S * S * item)
        peer = lambda f: _with_backward(f, (q, k, v), train)
        if device.type == "cuda" and kind in ("dense", "causal"):
            _add_gpu_sdpa(b, peer, q, k, v, kind == "causal")
        if kind == "dense":
            b.peers["sdpa"] = peer(lambda: F.scaled_dot_product_attention(q, k, v))
            b.peers["seed tutorial"] = peer(lambda: P.tutorial_attention(q, k, v))
            b.naive = {"seed tutorial"}
            return b
        allowed = mask.materialize(S, S).to(device)                           # (S, S) bool
        if kind == "causal":
            b.peers["sdpa is_causal"] = peer(lambda: F.scaled_dot_product_attention(
                q, k, v, is_causal=True))
        b.peers["sdpa + dense mask"] = peer(lambda: F.scaled_dot_product_attention(
            q, k, v, attn_mask=allowed))
        b.peers["seed tutorial"] = peer(lambda: P.tutorial_attention(q, k, v, allowed))
        b.naive = {"seed tutorial"}         # (SDPA with a mask holds only the S x S mask)
        if flex or (device.type == "cuda" and kind != "dense"):
            _add_flex(b, q, k, v, kind, window, lengths, device, train)
        return b

    return Case(kind, f"{label}, B={B} H={H} S={S} D={D}", S, mode, build)


def _add_gpu_sdpa(b: Built, peer, q, k, v, causal: bool) -> None:
    """On CUDA: SDPA pinned to its flash and cuDNN backends, as separate peers (a backend that
    cannot run the call is reported as failed in the row)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    for label, backend in (("flash", "FLASH_ATTENTION"), ("cuDNN", "CUDNN_ATTENTION")):
        if not hasattr(SDPBackend, backend):
            b.peers[f"sdpa ({label} backend)"] = f"SDPBackend.{backend} is not in this torch"
            continue

        def run(kind=getattr(SDPBackend, backend)):
            with sdpa_kernel(kind):
                return F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        b.peers[f"sdpa ({label} backend)"] = peer(run)


def _add_flex(b: Built, q, k, v, kind, window, lengths, device, train) -> None:
    """FlexAttention compiled with the same block mask (its compile time reported apart)."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        b.peers["flex_attention (compiled)"] = "not available in this torch"
        return
    S = q.shape[2]
    if kind == "window":
        fn = lambda bb, h, qi, ki: (qi >= ki) & (qi - ki < window)
    elif kind == "causal":
        fn = lambda bb, h, qi, ki: qi >= ki
    else:
        doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(device)
        fn = lambda bb, h, qi, ki: doc[qi] == doc[ki]
    block = create_block_mask(fn, None, None, S, S, device=str(device))
    compiled = torch.compile(flex_attention)
    run = _with_backward(lambda: compiled(q, k, v, block_mask=block), (q, k, v), train)
    b.peers["flex_attention (compiled)"] = run
    b.compile["flex_attention (compiled)"] = run


def decode_case(L: int, *, H=32, Hkv=8, D=128) -> Case:
    """One GQA decode step (Sq=1) against a KVCache holding L tokens: memory-bound."""
    def build(device, dtype) -> Built:
        cache = mh.KVCache(1, L, Hkv, D, dtype=dtype, device=device)
        g = torch.Generator(device="cpu").manual_seed(0)
        cache.update(torch.randn(1, Hkv, L, D, generator=g).to(device, dtype),
                     torch.randn(1, Hkv, L, D, generator=g).to(device, dtype))
        k, v = cache.k[:, :, :cache.seen], cache.v[:, :, :cache.seen]          # (1, Hkv, L, D)
        q = torch.randn(1, H, 1, D, generator=g).to(device, dtype)
        causal = mh.masks.causal()
        nograd = lambda f: _with_backward(f, (), False)
        return Built(nograd(lambda: mh.attention(q, k, v, mask=causal)),
                     {"sdpa enable_gqa": nograd(lambda: F.scaled_dot_product_attention(
                         q, k, v, enable_gqa=True)),
                      "HF repeat-K/V (eager)": nograd(lambda: P.hf_gqa_eager(q, k, v))},
                     bytes=k.nbytes + v.nbytes, unit="B/s", naive={"HF repeat-K/V (eager)"},
                     naive_bytes=H * L * torch.empty((), dtype=dtype).element_size())
    return Case("decode", f"GQA decode step, H={H} Hkv={Hkv} D={D}, cache {L}", L, "fwd", build)


def mha_case(B: int, S: int, E: int, H: int, *, train=False) -> Case:
    """The MHA layer: ours (copied weights) vs torch.nn.MultiheadAttention and the tutorial."""
    def build(device, dtype) -> Built:
        torch.manual_seed(0)
        ref = torch.nn.MultiheadAttention(E, H, batch_first=True).to(device, dtype)
        ours = mh.MultiHeadAttention.from_torch(ref).to(device, dtype)
        tut = P.SeedTutorialMHA(E, H).to(device, dtype)
        x = torch.randn(B, S, E, device=device).to(dtype).requires_grad_(train)
        first = lambda f: (lambda: f()[0])                               # (out, weights) -> out
        flops = (2 * B * S * 4 * E * E + 4 * B * S * S * E) * (3.5 if train else 1.0)
        wrap = lambda f: _with_backward(f, (x,), train)
        return Built(wrap(lambda: ours(x)),
                     {"torch MHA (need_weights=True, default)": wrap(first(lambda: ref(x, x, x))),
                      "torch MHA (need_weights=False)": wrap(first(
                          lambda: ref(x, x, x, need_weights=False))),
                      "seed tutorial class": wrap(first(lambda: tut(x)))},
                     flops=flops, naive_bytes=B * H * S * S * torch.empty((), dtype=dtype).element_size(),
                     naive={"torch MHA (need_weights=True, default)", "seed tutorial class"})
    return Case("mha", f"MHA layer, B={B} S={S} E={E} H={H}", S, "fwd+bwd" if train else "fwd", build)


def minilm_case(n: int = 256) -> Case:
    """Sentence embedding with the embedded MiniLM: packed (ours) vs HF padded batches of 32."""
    def build(device, dtype) -> Built:
        from ..models import default_model_dir, load
        from .corpus import corpus
        model = load(dtype=dtype, device=device)
        texts = corpus(model, n)
        b = Built(lambda: model.embed(texts), unit="texts/s", bytes=float(len(texts)))
        try:
            from transformers import AutoTokenizer, BertModel
        except ImportError:
            b.peers["HF BertModel (sdpa), batches of 32"] = "transformers is not installed"
            return b
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


def suite_cases(suite: str) -> list[Case]:
    """The cases of ``quick`` (< 1 min on 2 CPU cores), ``standard`` or ``full``.

    Example:
        >>> [c.name for c in suite_cases("quick")][:2]
        ['dense, B=1 H=8 S=256 D=64', 'dense, B=1 H=8 S=512 D=64']
    """
    if suite not in SUITES:
        raise ValueError(f"unknown suite {suite!r}: choose one of {', '.join(SUITES)}")
    if suite == "quick":
        return ([attention_case(k, S, H=8) for k in ("dense", "causal") for S in (256, 512)]
                + [attention_case("causal", 512, H=8, train=True),
                   attention_case("window", 1024, H=8, window=64),
                   attention_case("documents", 1024, H=8),
                   decode_case(2048), mha_case(2, 256, 256, 4)])
    lengths = (1024, 2048, 4096) + ((8192, 16384) if suite == "full" else ())
    cases = [attention_case(k, S) for k in ("dense", "causal") for S in lengths]
    cases += [attention_case("causal", 2048, train=True),
              attention_case("window", 4096, flex=True),
              attention_case("window", 4096, train=True),
              attention_case("documents", 4096, flex=True),
              decode_case(4096), decode_case(32768),
              mha_case(8, 512, 768, 12), minilm_case()]
    if suite == "full":
        cases += [attention_case("window", 16384, flex=True),
                  attention_case("documents", 16384), mha_case(8, 512, 768, 12, train=True)]
    return cases

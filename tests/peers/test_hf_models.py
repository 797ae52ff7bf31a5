"""``attn_implementation="multihead"`` equals Hugging Face's own attention across architectures.

Tiny random models (2 layers, hidden 32-64, vocab 100), built in the test from configs (no
downloads), one instance per attention implementation with identical weights:

* BERT (``BertModel``), a BERT decoder with cross-attention (``BertLMHeadModel``), GPT-2,
  Llama (GQA 4:2), Mistral (sliding window 4, sequences of 10), Qwen2 (GQA) and Qwen2 with
  its last layer sliding (``layer_types``), BART (encoder-decoder, cross-attention).
* Forward outputs equal transformers' ``sdpa`` and ``eager`` at real positions, right- and
  left-padded batches; parameter gradients equal ``sdpa``'s.
* Greedy ``generate()`` (left-padded prompts, dynamic and static KV caches) gives the same
  tokens as ``sdpa``.
* Packed rows (``position_ids`` restarting at 0, no attention mask, no cache) equal the
  sequences run one by one.
* ``output_attentions=True`` weights (self, and BART's encoder/decoder/cross) equal ``eager``'s.
* bf16 under the error rule against an fp64 run of the same bf16 weights.
* Every mask reaching our attention is structured (padding, causal, sliding window,
  document), never a dense 4-D tensor; the other implementations never call ours.
* Options we do not run (Gemma2's logit softcapping, GPT-OSS's attention sinks) raise a
  ValueError naming them.
"""

from __future__ import annotations

import copy
import functools
import re
from dataclasses import dataclass

import pytest
import torch

transformers = pytest.importorskip("transformers")

import multihead.interop.hf as hf  # noqa: E402  (registers "multihead")
from multihead.interop.hf_masks import HFMask  # noqa: E402
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS  # noqa: E402

transformers.logging.set_verbosity_error()

VOCAB, PAD, S, S_ENC, WINDOW = 100, 0, 10, 8, 4
#: padding per row: none, several tokens, one, and so much that a sliding window still
#: sees padding while decoding
CUTS = [0, 4, 1, 8]
ENC_CUTS = [0, 3, 1, 5]            # the encoder's (of S_ENC tokens)
ATOL = 1e-5


@dataclass(frozen=True)
class Arch:
    cls: str                 # transformers class name
    config: str              # config class name
    kwargs: dict
    kind: str                # "encoder", "decoder" (causal LM), "cross" (BERT decoder), "seq2seq"
    calls: int               # attention calls per forward (self + cross, every layer)
    expect: tuple = ()       # words the masks of a padded forward must show


_SMALL = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
              pad_token_id=PAD, initializer_range=0.2)
_BERT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
             num_attention_heads=4, max_position_embeddings=64, pad_token_id=PAD,
             initializer_range=0.2)

ARCHS = {
    "bert": Arch("BertModel", "BertConfig", _BERT, "encoder", 2, ("padding",)),
    "bert_cross": Arch("BertLMHeadModel", "BertConfig",
                       dict(_BERT, is_decoder=True, add_cross_attention=True), "cross", 4,
                       ("causal", "padding")),
    "gpt2": Arch("GPT2LMHeadModel", "GPT2Config",
                 dict(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                      pad_token_id=PAD, bos_token_id=1, eos_token_id=2, initializer_range=0.2),
                 "decoder", 2, ("causal", "padding")),
    "llama": Arch("LlamaForCausalLM", "LlamaConfig", _SMALL, "decoder", 2, ("causal", "padding")),
    "mistral": Arch("MistralForCausalLM", "MistralConfig", dict(_SMALL, sliding_window=WINDOW),
                    "decoder", 2, (f"sliding_window({WINDOW}", "padding")),
    "qwen2": Arch("Qwen2ForCausalLM", "Qwen2Config", _SMALL, "decoder", 2, ("causal", "padding")),
    "qwen2_swa": Arch("Qwen2ForCausalLM", "Qwen2Config",
                      dict(_SMALL, use_sliding_window=True, sliding_window=WINDOW,
                           max_window_layers=1), "decoder", 2,
                      ("causal", f"sliding_window({WINDOW}", "padding")),
    "bart": Arch("BartForConditionalGeneration", "BartConfig",
                 dict(vocab_size=VOCAB, d_model=32, encoder_layers=2, decoder_layers=2,
                      encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                      decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=PAD,
                      bos_token_id=1, eos_token_id=2, decoder_start_token_id=2,
                      forced_eos_token_id=None, init_std=0.2), "seq2seq", 6,
                 ("causal", "padding")),
}
DECODERS = [n for n, a in ARCHS.items() if a.kind == "decoder"]
#: models with an attention option we do not run: (model, the option the error must name)
REFUSED = {
    "gemma2": (Arch("Gemma2ForCausalLM", "Gemma2Config",
                    dict(_SMALL, head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=30.0),
                    "decoder", 2), "softcapping.*attn_logit_softcapping"),
    "gpt_oss": (Arch("GptOssForCausalLM", "GptOssConfig",
                     dict(_SMALL, head_dim=8, sliding_window=WINDOW, num_local_experts=2,
                          num_experts_per_tok=1), "decoder", 2), "attention sinks"),
    "granite_swa": (Arch("GraniteSWAForCausalLM", "GraniteSWAConfig",
                         dict(_SMALL, sliding_window=WINDOW), "decoder", 2), "attention sinks"),
}
IMPLS = ["multihead", "sdpa", "eager"]


@functools.lru_cache(maxsize=None)
def model(name: str, impl: str, dtype: torch.dtype = torch.float32):
    """The model of ``name`` on ``impl``; every call with the same name has the same weights.

    Each model gets a config of its own: the constructor and ``_from_config`` keep the config
    object they are given, and the implementation is read from it at every forward, so two
    models sharing one config would both run the implementation set last.
    """
    arch = ARCHS[name] if name in ARCHS else REFUSED[name][0]
    cfg = getattr(transformers, arch.config)(**arch.kwargs)
    cfg._attn_implementation = impl
    with torch.inference_mode(False):              # normal tensors: the gradient test needs them
        torch.manual_seed(0)
        m = getattr(transformers, arch.cls)(cfg).eval().to(dtype)
    assert m.config._attn_implementation == impl
    return m


def _pad_mask(lengths, width: int, side: str) -> torch.Tensor:
    """(B, width) bool, True = real token, the real tokens on the left or right."""
    pos = torch.arange(width)[None, :]                               # (1, width)
    n = torch.tensor(lengths)[:, None]                               # (B, 1)
    return pos < n if side == "right" else pos >= width - n


def batch(name: str, side: str, seed: int = 1):
    """Model inputs for a padded batch and the (B, S) real positions of its output."""
    g = torch.Generator().manual_seed(seed)
    real = _pad_mask([S - c for c in CUTS], S, side)                 # (B, S)
    ids = torch.randint(3, VOCAB, real.shape, generator=g).masked_fill(~real, PAD)
    kind = ARCHS[name].kind
    if kind == "seq2seq":                                            # encoder padded too
        enc = _pad_mask([S_ENC - c for c in ENC_CUTS], S_ENC, side)  # (B, S_ENC)
        enc_ids = torch.randint(3, VOCAB, enc.shape, generator=g).masked_fill(~enc, PAD)
        return dict(input_ids=enc_ids, attention_mask=enc.long(), decoder_input_ids=ids,
                    decoder_attention_mask=real.long()), real
    inputs = dict(input_ids=ids, attention_mask=real.long())
    if kind == "cross":
        enc = _pad_mask([S_ENC - c for c in ENC_CUTS], S_ENC, side)  # (B, S_ENC)
        inputs.update(encoder_hidden_states=torch.randn(len(CUTS), S_ENC, 32, generator=g),
                      encoder_attention_mask=enc.long())
    return inputs, real


def output(out) -> torch.Tensor:
    return out.logits if hasattr(out, "logits") else out.last_hidden_state


def assert_close_at(got, want, real, atol=ATOL, what="outputs"):
    """``got`` equals ``want`` (B, S, ...) at the real positions ``real`` (B, S)."""
    torch.testing.assert_close(got[real], want[real], atol=atol, rtol=1e-5,
                               msg=lambda m: f"{what}: {m}")


@pytest.fixture
def spy(monkeypatch):
    """Records every mask our attention receives and every HFMask our mask builder returns."""
    seen = {"masks": [], "built": []}
    inner_attention = hf.attention                    # the name attention_forward calls
    inner_builder = ALL_MASK_ATTENTION_FUNCTIONS["multihead"]

    def attention(*args, **kwargs):
        seen["masks"].append(kwargs.get("mask"))
        return inner_attention(*args, **kwargs)

    def builder(*args, **kwargs):
        out = inner_builder(*args, **kwargs)
        seen["built"].append(out)
        return out

    monkeypatch.setattr(hf, "attention", attention)
    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._local_mapping, "multihead", builder)
    return seen


def _structured(seen, expect=()):
    """No dense 4-D mask reached our attention, and the masks show every word of ``expect``."""
    assert seen["built"], "our mask builder was never called"
    for b in seen["built"]:
        assert isinstance(b, HFMask) and not b.dense, f"dense mask built: {b.describe()}"
    text = " | ".join("all keys" if m is None else m.describe() for m in seen["masks"])
    assert "dense(" not in text and "bias(" not in text, text
    for word in expect:
        assert word in text, f"{word!r} not in the masks our attention got: {text}"


# --- forward equal to sdpa and eager at real positions; only structured masks reach us ----

@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", list(ARCHS))
@torch.inference_mode()
def test_forward_equals_sdpa_and_eager(name, side, spy):
    inputs, real = batch(name, side)
    got = output(model(name, "multihead")(**inputs))
    seen = spy["masks"]
    assert len(seen) == ARCHS[name].calls, "not every attention layer ran on multihead"
    _structured(spy, ARCHS[name].expect)
    for impl in ("sdpa", "eager"):
        seen.clear()
        want = output(model(name, impl)(**inputs))
        assert not seen, f"the {impl} model called our attention"
        # padded positions are not compared: transformers gives them arbitrary values
        # (fully masked query rows), and they never reach a real position
        assert_close_at(got, want, real, what=f"{name} {side}-padded vs {impl}")


# --- greedy generation equals sdpa's --------------------------------------------------------

@pytest.mark.parametrize("cache", ["dynamic", "static"])
@pytest.mark.parametrize("name", DECODERS + ["bart"])
@torch.inference_mode()
def test_greedy_generate_equals_sdpa(name, cache, spy):
    """Left-padded prompts longer than Mistral's window; decoding with a sliding-window cache
    (transformers keeps window - 1 old keys) or a static cache (unused slots skipped)."""
    inputs, _ = batch(name, "left", seed=2)
    inputs = {k: v for k, v in inputs.items() if not k.startswith("decoder_")}
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=PAD, eos_token_id=None,
              cache_implementation=cache)
    got = model(name, "multihead").generate(**inputs, **kw)
    want = model(name, "sdpa").generate(**inputs, **kw)
    assert spy["masks"], "generate did not run on multihead"
    _structured(spy)
    assert got.shape == want.shape and torch.equal(got, want), f"{got}\n!=\n{want}"


# --- packed sequences equal the sequences run one by one ------------------------------------

PACKS = [[5, 3, 6], [9, 5]]           # lengths per row: two rows of 14 tokens each


@pytest.mark.parametrize("name", DECODERS)
@torch.inference_mode()
def test_packed_rows_equal_sequences_one_by_one(name, spy):
    g = torch.Generator().manual_seed(3)
    width = sum(PACKS[0])
    ids = torch.randint(3, VOCAB, (len(PACKS), width), generator=g)              # (B, W)
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in PACKS])  # (B, W)
    # no attention mask and no cache: transformers reads packing from position_ids only then
    got = model(name, "multihead")(input_ids=ids, position_ids=pos, use_cache=False).logits
    _structured(spy, ("document",) + tuple(w for w in ARCHS[name].expect if w != "padding"))
    ref = model(name, "sdpa")
    for b, row in enumerate(PACKS):
        start = 0
        for n in row:
            want = ref(input_ids=ids[b:b + 1, start:start + n]).logits[0]          # (n, V)
            torch.testing.assert_close(got[b, start:start + n], want, atol=ATOL, rtol=1e-5,
                                       msg=lambda m: f"{name} row {b} doc at {start}: {m}")
            start += n


def test_t5s_relative_position_bias_is_added_as_eager_adds_it():
    """T5 passes a learned (1, H, Sq, Sk) bias to every attention call; it used to be
    refused. Forward with a padded encoder batch, gradients, and greedy generation."""
    cfg = dict(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
               relative_attention_num_buckets=8, decoder_start_token_id=0, pad_token_id=0)
    models = {}
    for impl in ("multihead", "eager"):
        torch.manual_seed(0)
        models[impl] = transformers.T5ForConditionalGeneration(transformers.T5Config(
            **cfg, attn_implementation=impl)).eval()
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(3, VOCAB, (2, 7), generator=g)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0                                               # a padded second text
    labels = torch.randint(3, VOCAB, (2, 4), generator=g)
    outs = {impl: m(input_ids=ids, attention_mask=mask, labels=labels)
            for impl, m in models.items()}
    torch.testing.assert_close(outs["multihead"].logits, outs["eager"].logits, atol=ATOL, rtol=1e-5)
    for out in outs.values():
        out.loss.backward()
    bias = {impl: m.encoder.block[0].layer[0].SelfAttention.relative_attention_bias.weight.grad
            for impl, m in models.items()}
    assert bias["multihead"].abs().sum() > 0                      # the bias learns through us
    torch.testing.assert_close(bias["multihead"], bias["eager"], atol=1e-5, rtol=1e-4)
    with torch.no_grad():
        made = [m.generate(input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False)
                for m in models.values()]
    assert torch.equal(made[0], made[1])


def test_flash_attention_packing_arguments_keep_documents_apart():
    """``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` without position_ids:
    only cu_seq_lens_q/k say where documents end. They used to be dropped, so documents
    attended to each other (off by 4.2); FlashAttention keeps them apart, and so do we.
    (RoPE is relative, so positions running on across documents change nothing.)"""
    from transformers import DataCollatorWithFlattening
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in (5, 4, 6)]
    packed = DataCollatorWithFlattening(return_position_ids=False, return_flash_attn_kwargs=True)(
        [{"input_ids": d} for d in docs])
    packed.pop("labels")
    assert "position_ids" not in packed and "cu_seq_lens_k" in packed
    ours, ref = model("llama", "multihead"), model("llama", "eager")
    with torch.no_grad():
        got = ours(**packed, use_cache=False).logits[0]                         # (15, V)
        want = torch.cat([ref(input_ids=torch.tensor([d])).logits[0] for d in docs])
    torch.testing.assert_close(got, want, atol=ATOL, rtol=1e-5)
    two_rows = {**packed, "input_ids": packed["input_ids"].expand(2, -1)}
    with pytest.raises(ValueError, match=r"does not support packed sequences other than one row "
                                         r"of self-attention .* batch 2"):
        ours(**two_rows, use_cache=False)
    short = torch.tensor([0, 5, 14], dtype=torch.int32)                 # the row has 15 tokens
    with pytest.raises(ValueError, match=r"cu_seq_lens_k ends at 14, but the packed row has 15 "
                                         r"tokens: its last offset must be the row's length") as e:
        ours(**{**packed, "cu_seq_lens_q": short, "cu_seq_lens_k": short}, use_cache=False)
    assert "eager" not in str(e.value)        # (eager ignores the offsets: not the fix)
    with torch.inference_mode():                 # (no version counter: one read per forward too)
        cu = torch.tensor([0, 5, 9, 15], dtype=torch.int32)
        made = [hf._flash_packing({"cu_seq_lens_q": cu, "cu_seq_lens_k": cu}, None, 1, 15, 15)
                for _ in range(2)]
    assert made[0] is made[1] and made[0].kind == "document"
    row = packed["input_ids"]                                              # (1, 15)
    buf = packed["cu_seq_lens_k"].numpy().copy()                           # [0, 5, 9, 15]
    cu = torch.from_numpy(buf)                    # values written through numpy: no version bump
    with torch.no_grad():
        for cuts in ([0, 5, 9, 15], [0, 3, 9, 15]):
            buf[:] = cuts
            got = ours(input_ids=row, cu_seq_lens_q=cu, cu_seq_lens_k=cu, use_cache=False)
            want = torch.cat([ref(input_ids=row[:, a:b]).logits[0]
                              for a, b in zip(cuts, cuts[1:])])
            torch.testing.assert_close(got.logits[0], want, atol=ATOL, rtol=1e-5)


def test_flash_attention_packing_arguments_trace_under_fullgraph_compile():
    """Compiled, the offsets hold no values: reading them on the host failed with Dynamo's
    data-dependent guard error. The graph now builds the ids from them, and checks host
    offsets when it runs."""
    g = torch.Generator().manual_seed(1)
    row = torch.randint(3, VOCAB, (1, 12), generator=g)
    ours, ref = model("llama", "multihead"), model("llama", "eager")
    torch._dynamo.reset()
    compiled = torch.compile(ours, fullgraph=True, backend="aot_eager", dynamic=True)
    with torch.no_grad():
        for cuts in ([0, 4, 7, 12], [0, 2, 12]):
            cu = torch.tensor(cuts, dtype=torch.int32)
            got = compiled(input_ids=row, cu_seq_lens_q=cu, cu_seq_lens_k=cu, use_cache=False)
            want = torch.cat([ref(input_ids=row[:, a:b]).logits[0]
                              for a, b in zip(cuts, cuts[1:])])
            torch.testing.assert_close(got.logits[0], want, atol=ATOL, rtol=1e-5)
        for bad in ([0, 4, 11], [0, 7, 4, 12], [1, 4, 12]):
            cu = torch.tensor(bad, dtype=torch.int32)
            with pytest.raises(RuntimeError, match="cu_seq_lens_k must start at 0, never "
                                                   "decrease and end at the row's length"):
                compiled(input_ids=row, cu_seq_lens_q=cu, cu_seq_lens_k=cu, use_cache=False)


@pytest.mark.parametrize("mode", ["fake", "symbolic"])
def test_flash_attention_packing_arguments_hold_in_a_make_fx_graph(mode):
    """Traced on tensors without values, transformers gives a document mask of its own
    position_ids (arange: one document); it was taken as the packing, and a make_fx graph
    let every document of the row attend to the others (off by 0.2)."""
    from torch.fx.experimental.proxy_tensor import make_fx
    g = torch.Generator().manual_seed(2)
    rows = [torch.randint(3, VOCAB, (1, 15), generator=g) for _ in range(2)]
    ours, ref = model("llama", "multihead"), model("llama", "eager")
    params = {**dict(ours.named_parameters()), **dict(ours.named_buffers())}

    def logits(p, row, cu):
        return torch.func.functional_call(ours, p, (), dict(
            input_ids=row, cu_seq_lens_q=cu, cu_seq_lens_k=cu, use_cache=False)).logits

    with torch.no_grad():
        graph = make_fx(logits, tracing_mode=mode)(
            params, rows[0], torch.tensor([0, 5, 9, 15], dtype=torch.int32))
        cuts = [0, 2, 11, 15]                                   # another packing, another row
        got = graph(params, rows[1], torch.tensor(cuts, dtype=torch.int32))
        want = torch.cat([ref(input_ids=rows[1][:, a:b]).logits[0]
                          for a, b in zip(cuts, cuts[1:])])
    torch.testing.assert_close(got[0], want, atol=ATOL, rtol=1e-5)


def test_a_layer_marked_causal_given_a_bidirectional_mask_stays_bidirectional():
    """Phi4-multimodal's vision layers set is_causal=True but build a bidirectional mask.
    Where nothing is masked, sdpa's builder gives None and the layer then runs causal (off
    by 2.8 from eager); ours always gives the mask, so the layer runs as eager does."""
    from transformers.masking_utils import bidirectional_mask_function
    layer = torch.nn.Module()
    layer.is_causal = True
    q = torch.randn(1, 2, 5, 8, generator=torch.Generator().manual_seed(0))
    m = ALL_MASK_ATTENTION_FUNCTIONS["multihead"](1, 5, 5, 0, 0, bidirectional_mask_function,
                                                   torch.ones(1, 5, dtype=torch.bool),
                                                   allow_is_bidirectional_skip=True)
    assert isinstance(m, HFMask)
    out, _ = hf.attention_forward(layer, q, q, q, m)
    want = torch.softmax(q @ q.transpose(-1, -2) / 8 ** 0.5, -1) @ q              # (1, 2, 5, 8)
    torch.testing.assert_close(out, want.transpose(1, 2), atol=1e-6, rtol=1e-5)


# --- attention weights equal eager's; gradients equal sdpa's --------------------------------

@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name", ["gpt2", "llama", "mistral", "bart"])
@torch.inference_mode()
def test_output_attentions_equal_eager(name, side):
    inputs, real = batch(name, side)
    got = model(name, "multihead")(**inputs, output_attentions=True)
    want = model(name, "eager")(**inputs, output_attentions=True)
    enc_real = inputs["attention_mask"].bool()
    kinds = {"attentions": real} if name != "bart" else {
        "encoder_attentions": enc_real, "decoder_attentions": real, "cross_attentions": real}
    for kind, rows in kinds.items():
        g, w = getattr(got, kind), getattr(want, kind)
        assert len(g) == len(w) == 2 and all(t is not None for t in g), kind
        for layer, (a, b) in enumerate(zip(g, w)):                # (B, H, Sq, Sk)
            assert a.shape == b.shape, (kind, a.shape, b.shape)
            # real query rows, every key: padded keys weigh exactly 0 in both
            assert_close_at(a.transpose(1, 2), b.transpose(1, 2), rows,
                            what=f"{name} {kind} layer {layer}")


def test_models_share_weights():
    for name in ARCHS:
        sds = [model(name, impl).state_dict() for impl in IMPLS]
        for k, v in sds[0].items():
            assert all(torch.equal(v, sd[k]) for sd in sds[1:]), f"{name}: {k} differs"


@pytest.mark.parametrize("name", list(ARCHS))
def test_gradients_equal_sdpa(name):
    """Parameter gradients of a loss over the real positions of a left-padded batch."""
    inputs, real = batch(name, "left")
    grads = []
    for impl in ("multihead", "sdpa"):
        m = model(name, impl)
        m.zero_grad(set_to_none=True)
        output(m(**inputs))[real].square().mean().backward()
        grads.append({k: p.grad for k, p in m.named_parameters() if p.grad is not None})
        m.zero_grad(set_to_none=True)
    assert grads[0].keys() == grads[1].keys() and grads[0]
    for k in grads[1]:
        torch.testing.assert_close(grads[0][k], grads[1][k], atol=ATOL, rtol=1e-4,
                                   msg=lambda m: f"{name} grad of {k}: {m}")


# --- bf16 under the error rule --------------------------------------------------------------

@pytest.mark.parametrize("side", ["right", "left"])
@torch.inference_mode()
def test_bf16_error_within_twice_sdpa(side, spy):
    """The error rule: with ``ref`` the same bf16 weights run in fp64 (transformers' sdpa),
    ``max|multihead_bf16 - ref| <= 2 * max|sdpa_bf16 - ref| + 1e-3`` over real positions.

    The reference upcasts the bf16 weights, so both errors are arithmetic only (weight rounding
    would add the same error to both and hide ours). Not fp64 eager: transformers' eager in
    fp64 turns left padding's fully masked query rows into NaN, and the next layer spreads
    them to every position (0 * NaN)."""
    inputs, real = batch("llama", side)
    ref = output(copy.deepcopy(model("llama", "sdpa", torch.bfloat16)).double()(**inputs))
    err = {}
    for impl in ("multihead", "sdpa"):
        out = output(model("llama", impl, torch.bfloat16)(**inputs)).double()
        err[impl] = (out - ref)[real].abs().max().item()
    assert spy["masks"], "the bf16 model did not run on multihead"
    assert err["sdpa"] > 0, "bf16 model ran in a wider dtype"
    assert err["multihead"] <= 2 * err["sdpa"] + 1e-3, err


# --- options we refuse ----------------------------------------------------------------------

@pytest.mark.parametrize("name", list(REFUSED))
@torch.inference_mode()
def test_models_with_options_we_do_not_run_are_refused(name):
    """Gemma2's logit softcapping, GPT-OSS's attention sinks: an error, never ignored, and
    raised by the mask builder, before any layer has written to the cache."""
    m = model(name, "multihead")
    cache = transformers.DynamicCache(config=m.config)
    with pytest.raises(ValueError, match=REFUSED[name][1]):
        m(input_ids=torch.randint(3, VOCAB, (1, 6)), past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 0
    model(name, "eager")(input_ids=torch.randint(3, VOCAB, (1, 6)))   # the config runs


@pytest.mark.parametrize("kwargs, words", [
    (dict(softcap=30.0), "softcapping.*attn_logit_softcapping"),
    (dict(s_aux=torch.zeros(4)), "attention sinks"),
    (dict(position_bias=torch.zeros(1, 4, 3, 7)),                    # 3 keys: cut, silently
     r"a position_bias of another width than the keys \(position_bias tensor of shape "
     r"\(1, 4, 3, 7\), 3 keys\)"),
])
def test_attention_forward_refuses(kwargs, words):
    q = torch.randn(1, 4, 3, 8)                                      # (B, H, S, D)
    module = torch.nn.Module()
    with pytest.raises(ValueError, match=words):
        hf.attention_forward(module, q, q, q, None, **kwargs)


def test_training_applies_attention_dropout_and_evaluation_does_not():
    """``attention_dropout`` reaches our attention in training (two calls differ, gradients
    flow) and is off in evaluation (two calls are equal and match sdpa's)."""
    inputs, real = batch("llama", "right")
    m = model("llama", "multihead")
    m.config.attention_dropout = 0.5
    for layer in m.model.layers:
        layer.self_attn.attention_dropout = 0.5
    m.train()
    a, b = output(m(**inputs)), output(m(**inputs))
    assert not torch.equal(a[real], b[real])
    a[real].square().mean().backward()
    assert m.model.layers[0].self_attn.q_proj.weight.grad.abs().sum() > 0
    m.eval()
    with torch.no_grad():
        e = output(m(**inputs))
        assert torch.equal(e, output(m(**inputs)))
        torch.testing.assert_close(e[real], output(model("llama", "sdpa")(**inputs))[real],
                                   atol=1e-5, rtol=0)


def test_training_arguments_that_reach_attention_through_kwargs_are_run_not_refused():
    """Trainer passes num_items_in_batch with labels, padding-free collators shift_labels,
    a mixture of experts output_router_logits: all reach the attention layer through the
    model's **kwargs, none changes attention; the losses equal eager's."""
    inputs, real = batch("llama", "right")
    labels = inputs["input_ids"].masked_fill(~real, -100)
    extras = [dict(num_items_in_batch=torch.tensor(int(real.sum()))),
              dict(shift_labels=torch.nn.functional.pad(labels[:, 1:], (0, 1), value=-100))]
    for extra in extras:
        ours, theirs = (model("llama", impl)(**inputs, labels=labels, **extra).loss
                        for impl in ("multihead", "eager"))
        torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=0)
    cfg = dict(_SMALL, num_local_experts=2, num_experts_per_tok=1, output_router_logits=True)
    losses = []
    for impl in ("multihead", "eager"):
        torch.manual_seed(0)
        m = transformers.MixtralForCausalLM(transformers.MixtralConfig(
            **cfg, attn_implementation=impl)).eval()
        out = m(**inputs, labels=labels)
        losses.append((out.loss, out.aux_loss))
    torch.testing.assert_close(losses[0], losses[1], atol=1e-5, rtol=0)


def test_a_model_passing_its_mask_to_a_torch_function_gets_the_clear_error():
    """MPT masks its scores with ``scores.masked_fill(mask, ...)``: a torch function, not an
    operator; the error says to load it with sdpa or eager, not torch's argument parser's."""
    torch.manual_seed(0)
    m = transformers.MptForCausalLM(transformers.MptConfig(
        vocab_size=VOCAB, d_model=32, n_heads=4, n_layers=2, attn_implementation="multihead"))
    with pytest.raises(TypeError, match=r"uses its attention mask as a tensor outside "
                                        r"transformers' AttentionInterface.*'eager' \(or "
                                        r"'sdpa', where the model supports it\)"):
        m(input_ids=torch.randint(3, VOCAB, (2, 6)))


@pytest.mark.parametrize("cls, config", [
    ("BloomForCausalLM", dict(vocab_size=VOCAB, hidden_size=32, n_layer=2, n_head=4)),
    ("XGLMForCausalLM", dict(vocab_size=VOCAB, d_model=32, num_layers=2, attention_heads=4,
                             ffn_dim=64, max_position_embeddings=64)),
    ("Gemma4ForCausalLM", dict(_SMALL, head_dim=8, sliding_window=4, num_hidden_layers=4,
                               layer_types=["sliding_attention", "full_attention"] * 2,
                               vocab_size_per_layer_input=VOCAB, hidden_size_per_layer_input=8,
                               num_kv_shared_layers=2, max_position_embeddings=128)),
], ids=["bloom", "xglm", "gemma4-kv-shared"])
def test_a_model_that_uses_its_mask_as_a_tensor_is_refused_before_a_layer_writes_its_cache(
        cls, config):
    """These models fail on every forward (Bloom adds ALiBi to the mask, XGLM reads its
    size, Gemma4's KV-sharing layers slice it), but they failed in a layer, after the layers
    before it had appended this call's keys to the cache: the cache no longer matched the
    text. Refused now where the mask is built, before any layer runs."""
    from transformers import DynamicCache
    name = cls.replace("ForCausalLM", "") + ("TextConfig" if "Gemma4" in cls else "Config")
    cfg = getattr(transformers, name)(**config, attn_implementation="multihead")
    torch.manual_seed(0)
    m = getattr(transformers, cls)(cfg).eval()
    cache = DynamicCache(config=cfg)
    with torch.no_grad(), pytest.raises(TypeError, match=r"uses its attention mask as a tensor "
                                                         r".*refused before any layer runs"):
        m(input_ids=torch.randint(3, VOCAB, (2, 6)), past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 0
    assert all(getattr(layer, "keys", None) is None or layer.keys.numel() == 0
               for layer in cache.layers)


@pytest.mark.parametrize("name, side", [("llama", "right"), ("llama", "left"),
                                        ("mistral", "left")])
def test_compiled_fullgraph_with_a_padding_mask_equals_eager_mode(name, side):
    """The mask builder traces: no read of the padding mask's values, no code object as a
    guard's constant (transformers' mask pieces are recognized by where their code is); a
    mask function made inside the trace (Mistral's sliding window: its cells cannot be read
    there) is evaluated as a dense mask instead of failing inside dynamo."""
    inputs, real = batch(name, side)
    m = model(name, "multihead")
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            got = output(torch.compile(m, backend="eager", fullgraph=True)(**inputs))
            want = output(m(**inputs))
    finally:
        torch._dynamo.reset()
    assert_close_at(got, want, real)


@pytest.mark.parametrize("cls,config,kwargs", [
    ("GPTNeoForCausalLM", "GPTNeoConfig", dict(hidden_size=32, num_layers=1, num_heads=4,
                                               attention_types=[[["global"], 1]])),
    ("FalconForCausalLM", "FalconConfig", dict(hidden_size=32, num_hidden_layers=1,
                                               num_attention_heads=4))])
def test_models_that_look_their_attention_class_up_by_name_fail_as_the_readme_says(
        cls, config, kwargs):
    """README: these fail while they are built, with transformers' own KeyError, before any
    of our code runs (if transformers changes that, the README must change too)."""
    cfg = getattr(transformers, config)(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2,
                                        **kwargs, attn_implementation="multihead")
    with pytest.raises(KeyError, match="multihead"):
        getattr(transformers, cls)(cfg)


def test_gpt_j_runs_on_our_attention_as_on_its_eager_one():
    """transformers 5.24 moved GPT-J onto AttentionInterface (it looked its attention class
    up by name before, and failed there with KeyError: 'multihead')."""
    from unittest import mock
    import multihead.interop.hf as H
    ids = torch.randint(3, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    am = torch.ones(2, 9, dtype=torch.long)
    am[1, :3] = 0                                                  # left padding
    logits, calls = {}, []
    for impl in ("multihead", "eager"):
        cfg = transformers.GPTJConfig(vocab_size=VOCAB, bos_token_id=1, eos_token_id=2, n_embd=32,
                                      n_layer=2, n_head=4, rotary_dim=4, attn_implementation=impl)
        torch.manual_seed(0)
        m = transformers.GPTJForCausalLM(cfg).eval()
        real = H.attention
        with torch.no_grad(), mock.patch.object(H, "attention", side_effect=lambda *a, **k: (
                calls.append(1), real(*a, **k))[1]):
            logits[impl] = m(input_ids=ids, attention_mask=am).logits
    assert len(calls) == 2                                         # both layers ran on ours
    assert_close_at(logits["multihead"], logits["eager"], am.bool(), what="logits")


@torch.inference_mode()
def test_an_attention_mask_of_other_rows_is_refused_before_the_cache_is_written():
    m = model("llama", "multihead")
    cache = transformers.DynamicCache(config=m.config)
    ids = torch.randint(3, VOCAB, (2, 6))
    with pytest.raises(ValueError, match=r"attention_mask has 3 rows \(shape \(3, 6\)\) but the "
                                         r"batch has 2 sequences"):
        m(input_ids=ids, attention_mask=torch.ones(3, 6, dtype=torch.long),
          past_key_values=cache, use_cache=True)
    assert cache.get_seq_length() == 0


@torch.inference_mode()
def test_a_sliding_window_of_zero_no_layer_uses_runs_as_sdpa():
    """Qwen2-MoE without use_sliding_window has sliding_window=0 and still builds a
    "sliding_attention" mask, which none of its layers reads."""
    kwargs = dict(_SMALL, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16,
                  shared_expert_intermediate_size=16)
    outs = {}
    for impl in ("multihead", "sdpa"):
        cfg = transformers.Qwen2MoeConfig(**kwargs)
        cfg._attn_implementation = impl
        torch.manual_seed(0)
        outs[impl] = transformers.Qwen2MoeForCausalLM(cfg).eval()
    assert outs["sdpa"].config.sliding_window == 0
    inputs, real = batch("llama", "left")
    want = outs["sdpa"](**inputs).logits
    assert_close_at(outs["multihead"](**inputs).logits, want, real)


@torch.inference_mode()
def test_a_4d_mask_wider_than_the_keys_is_refused_not_cut():
    """Its first columns would be read as this call's keys: a prefix's become the future's."""
    m = model("llama", "multihead")
    ids = torch.randint(3, VOCAB, (2, 6))
    prefix_and_causal = torch.cat([torch.ones(6, 3, dtype=torch.bool),
                                   torch.ones(6, 6, dtype=torch.bool).tril()], 1)    # (6, 9)
    with pytest.raises(ValueError, match=re.escape(
            "attention_mask has 9 key columns (shape (2, 1, 6, 9)) but the layer has 6 keys")):
        m(input_ids=ids, attention_mask=prefix_and_causal.expand(2, 1, 6, 9))
    fits = prefix_and_causal[:, 3:].expand(2, 1, 6, 6)                  # one column per key
    assert torch.allclose(m(input_ids=ids, attention_mask=fits).logits,
                          model("llama", "sdpa")(input_ids=ids, attention_mask=fits).logits,
                          atol=ATOL)


def test_a_models_own_4d_mask_is_decided_once_for_all_its_layers(monkeypatch):
    """Each layer gets the same 4-D tensor: one mask object (by its contents), one decision
    of the backend, not one per layer; the logits are still sdpa's."""
    from multihead.functional import dispatch
    m = model("llama", "multihead")
    ids = torch.randint(3, VOCAB, (2, 6))
    causal = torch.ones(6, 6, dtype=torch.bool).tril()
    causal[:, 4] = False                        # a pattern no earlier test built
    mask = causal.expand(2, 1, 6, 6)
    made, real = [], dispatch._new_decision
    monkeypatch.setattr(dispatch, "_new_decision", lambda *a: made.append(1) or real(*a))
    got = m(input_ids=ids, attention_mask=mask).logits
    assert len(made) == 1 and m.config.num_hidden_layers == 2
    torch.testing.assert_close(got, model("llama", "sdpa")(input_ids=ids,
                                                           attention_mask=mask).logits,
                               atol=ATOL, rtol=1e-5)


def test_a_4d_integer_mask_is_refused_with_what_to_pass():
    """eager adds a 0/1 integer mask as a bias (1 for a token it should attend, which
    masks nothing) and sdpa refuses its dtype; ours refused it with a message about
    multihead.masks, which a model's caller never calls."""
    m = model("llama", "multihead")
    ids = torch.randint(3, VOCAB, (2, 6))
    causal = torch.ones(6, 6, dtype=torch.long).tril().expand(2, 1, 6, 6)
    with pytest.raises(TypeError, match=re.escape(
            "attention_mask is a 4-D torch.int64 tensor (shape (2, 1, 6, 6)): a 4-D mask is bool "
            "(True = attend) or additive float") + ".*pass mask.bool"):
        m(input_ids=ids, attention_mask=causal)
    torch.testing.assert_close(m(input_ids=ids, attention_mask=causal.bool()).logits,
                               model("llama", "sdpa")(input_ids=ids,
                                                      attention_mask=causal.bool()).logits,
                               atol=ATOL, rtol=1e-5)


@torch.inference_mode()
def test_a_softcapping_field_the_model_never_reads_is_not_refused():
    """attn_logit_softcapping set on a config whose class has no such field (Llama's): its
    model never reads it, so it runs, as on eager; Gemma2's declares it and is refused."""
    cfg = transformers.LlamaConfig(**_SMALL, attn_logit_softcapping=30.0)
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).eval()
    ours = copy.deepcopy(ref)
    ours.config._attn_implementation = "multihead"
    ids = torch.randint(3, VOCAB, (2, 6))
    torch.testing.assert_close(ours(input_ids=ids).logits, ref(input_ids=ids).logits,
                               atol=ATOL, rtol=1e-5)


def test_decreasing_packing_offsets_name_the_argument():
    with pytest.raises(ValueError, match=r"^cu_seq_lens_k: .*never decrease, got \[0, 5, 3, 6\]"):
        hf._flash_packing({"cu_seq_lens_q": (cu := torch.tensor([0, 5, 3, 6])),
                           "cu_seq_lens_k": cu}, None, 1, 6, 6)


@torch.inference_mode()
def test_a_hybrid_models_mask_sized_by_a_linear_layer_is_refused_naming_the_cause():
    """MiniMax sizes its decoding mask from its first layer's cache, a linear-attention one
    (one key): the error names that, not the user's attention_mask, which is right."""
    cfg = transformers.MiniMaxConfig(**dict(_SMALL, head_dim=8), num_local_experts=2,
                                     num_experts_per_tok=1, block_size=4,
                                     layer_types=["linear_attention", "full_attention"])
    cfg._attn_implementation = "multihead"
    torch.manual_seed(0)
    m = transformers.MiniMaxForCausalLM(cfg).eval()
    ids = torch.randint(3, VOCAB, (2, 6))
    hint = r"MiniMaxConfig.layer_types mixes in 'linear_attention': transformers sizes"
    for attention_mask in (torch.ones_like(ids), torch.tensor([[1] * 6, [0, 0] + [1] * 4])):
        with pytest.raises(ValueError, match=hint):
            m.generate(ids, attention_mask=attention_mask, max_new_tokens=2, do_sample=False,
                       pad_token_id=PAD)

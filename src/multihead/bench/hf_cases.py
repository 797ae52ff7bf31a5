"""Hugging Face models on ``attn_implementation="multihead"`` against Hugging Face's own paths.

One Llama-like decoder (``LlamaModel``: 8 layers, d=512, 8 heads, 2 K/V heads, random
weights; no LM head, whose vocabulary-sized matmul is not attention's business) reads 32
texts of 16..512 tokens (random token ids; lengths drawn uniformly with a fixed seed). A
user can run them as a padded batch (``attention_mask``) or packed in one row
(``position_ids`` restarting per text, as ``DataCollatorWithFlattening`` makes them);
Hugging Face's ``sdpa`` path builds a 4-D mask for both, ours a padding or document mask.
The rate is texts per second.
"""

from __future__ import annotations

import random

import torch

from .cases import Built, Case

N_TEXTS, LO, HI = 32, 16, 512


def _texts(vocab: int, seed: int = 0) -> list[torch.Tensor]:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(1, vocab, (rng.randint(LO, HI),), generator=gen) for _ in range(N_TEXTS)]


def _batches(texts: list[torch.Tensor], device):
    """The padded batch ``(ids, attention_mask)`` and the packed row ``(ids, position_ids)``."""
    S = max(len(t) for t in texts)
    ids = torch.zeros(len(texts), S, dtype=torch.long)                  # (N, S), right padded
    am = torch.zeros(len(texts), S, dtype=torch.long)                   # (N, S), 1 = real
    for i, t in enumerate(texts):
        ids[i, :len(t)], am[i, :len(t)] = t, 1
    packed = torch.cat(texts)[None]                                     # (1, total)
    pos = torch.cat([torch.arange(len(t)) for t in texts])[None]        # (1, total)
    return (ids.to(device), am.to(device)), (packed.to(device), pos.to(device))


def _model(impl: str, device, dtype):
    from transformers import LlamaConfig, LlamaModel
    import multihead.interop.hf  # noqa: F401 (registers "multihead")
    cfg = LlamaConfig(vocab_size=32000, hidden_size=512, intermediate_size=1376,
                      num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                      max_position_embeddings=1024)
    cfg._attn_implementation = impl
    torch.manual_seed(0)
    return LlamaModel(cfg).to(device, dtype).eval()


def _runner(model, **inputs):
    def run():
        with torch.inference_mode():
            return model(**inputs, use_cache=False).last_hidden_state
    return run


def hf_model_case(layout: str, *, weights: bool = False) -> Case:
    """Ours on the ``layout`` ("packed" or "padded") batch vs Hugging Face's paths.

    With ``weights``, every call returns the attention weights (``output_attentions=True``),
    against Hugging Face's ``eager`` path (the only one of theirs that returns them).
    """
    def build(device, dtype) -> Built:
        try:
            import transformers  # noqa: F401
        except ImportError as e:
            raise ImportError("transformers is not installed") from e
        ours = _model("multihead", device, dtype)
        (ids, am), (packed, pos) = _batches(_texts(ours.config.vocab_size), device)
        padded_in = dict(input_ids=ids, attention_mask=am)
        packed_in = dict(input_ids=packed, position_ids=pos)
        extra = dict(output_attentions=True) if weights else {}
        b = Built(_runner(ours, **(packed_in if layout == "packed" else padded_in), **extra),
                  unit="texts/s", items=float(N_TEXTS))
        peers = ["eager"] if weights else ["sdpa"] + (["flex_attention"] if device.type == "cuda"
                                                      else [])
        for impl in peers:
            hf = _model(impl, device, dtype)
            b.peers[f"HF {impl}, padded batch"] = _runner(hf, **padded_in, **extra)
            if layout == "packed" and not weights:
                b.peers[f"HF {impl}, packed (position_ids)"] = _runner(hf, **packed_in)
        return b
    what = "attention weights, " if weights else ""
    name = (f"Llama-like 8x512 (GQA 8/2), {N_TEXTS} texts of {LO}-{HI} tokens, "
            f"{what}ours {layout}")
    return Case("hf model", name, None, "fwd", build)


def hf_model_cases() -> list[Case]:
    """Ours packed (vs HF padded and packed), ours padded, and with attention weights."""
    return [hf_model_case("packed"), hf_model_case("padded"),
            hf_model_case("padded", weights=True)]

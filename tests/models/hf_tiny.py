"""Tiny random checkpoints of the decoders and the encoder-decoder multihead loads through
``transformers`` (GPT-2, Llama with GQA, Mistral with MQA and a sliding window, BART), saved
as transformers saves them (safetensors, config.json) with a tokenizer trained here on a few
sentences: no download."""

from __future__ import annotations

from pathlib import Path

import torch
import transformers

TEXT = "The animal didn't cross the street because it was too tired."
CORPUS = [TEXT, "The dog chased the cat because it was hungry.", "She said he left."] * 4
#: BART's special tokens, at the ids BartConfig expects (bos 0, pad 1, eos 2)
BART_SPECIALS = ["<s>", "<pad>", "</s>", "<unk>", "<mask>"]


def _gpt2_tokenizer(specials=("<|endoftext|>",)):
    """Byte-level BPE as GPT-2's: tokens like 'Ġanimal', no special token added; with
    BART_SPECIALS, BART's: '<s>' ... '</s>' around the text (RoBERTa's post-processor)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=400, special_tokens=list(specials), show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if "<s>" in specials:
        tok.post_processor = processors.RobertaProcessing(
            ("</s>", tok.token_to_id("</s>")), ("<s>", tok.token_to_id("<s>")))
    return tok


def _llama_tokenizer():
    """SentencePiece-style BPE as Llama 2's: tokens like '▁animal', and '<s>' first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="first")
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=200, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False))
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", tok.token_to_id("<s>"))])
    return tok


def hf_checkpoint(path: Path, kind: str) -> Path:
    """A random 2-layer checkpoint saved as transformers saves one (safetensors)."""
    torch.manual_seed(0)
    tok = {"gpt2": _gpt2_tokenizer, "bart": lambda: _gpt2_tokenizer(BART_SPECIALS)}.get(
        kind, _llama_tokenizer)()
    vocab = tok.get_vocab_size()                # (the embedding has a row for each token)
    if kind == "gpt2":
        config = transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4,
                                         n_positions=64, initializer_range=0.3,
                                         bos_token_id=0, eos_token_id=0)
        model = transformers.GPT2LMHeadModel(config)
    elif kind == "llama":
        config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                          num_hidden_layers=2, num_attention_heads=4,
                                          num_key_value_heads=2, max_position_embeddings=64,
                                          initializer_range=0.3)
        model = transformers.LlamaForCausalLM(config)
    elif kind == "bart":                                   # a smaller decoder: never shown
        config = transformers.BartConfig(vocab_size=vocab, d_model=32, encoder_layers=2,
                                         encoder_attention_heads=4, encoder_ffn_dim=64,
                                         decoder_layers=1, decoder_attention_heads=2,
                                         decoder_ffn_dim=64, max_position_embeddings=64,
                                         init_std=0.3)
        model = transformers.BartForConditionalGeneration(config)
    else:                                                  # MQA and a sliding window of 4
        config = transformers.MistralConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                            num_hidden_layers=2, num_attention_heads=4,
                                            num_key_value_heads=1, max_position_embeddings=64,
                                            sliding_window=4, initializer_range=0.3)
        model = transformers.MistralForCausalLM(config)
    model.save_pretrained(path, safe_serialization=True)
    tok.save(str(path / "tokenizer.json"))
    return path


def rewrite_weights(d: Path, change) -> dict:
    """Apply ``change(w)`` to the tensors ``w`` of ``d``'s model.safetensors (a dict, edited
    in place) and save them back; returns them."""
    from safetensors.torch import load_file, save_file
    w = load_file(str(d / "model.safetensors"))
    change(w)
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    return w


def refused_cheaply(call, match: str, limit: int) -> None:
    """``call()`` raises :class:`multihead.models.ModelLoadError` matching ``match`` before
    allocating ``limit`` bytes (as Python's tracemalloc counts them, torch's CPU tensors too)."""
    import tracemalloc

    import pytest

    from multihead.models import ModelLoadError
    tracemalloc.start()
    try:
        with pytest.raises(ModelLoadError, match=match):
            call()
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < limit, f"{peak / 2**20:.0f} MiB"

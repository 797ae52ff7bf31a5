"""Loading fails cleanly and says why: missing files or tensors, wrong shapes, corrupt files,
unsupported architectures, pickles. Nothing half-loaded comes back."""

from __future__ import annotations

import collections
import json
import re
import threading
import types

import pytest
import torch
from safetensors.torch import load_file, save_file

from multihead.models import ModelLoadError, load
from tiny import tiny_checkpoint


def test_tiny_checkpoint_loads_and_matches_shapes(tmp_path):
    m = load(tiny_checkpoint(tmp_path / "m"))
    assert m.config.hidden_size == 32 and len(m.encoder.layers) == 2
    assert not m.encoder.training
    assert m.encoder.layers[0].attention.in_proj_weight.shape == (96, 32)


@pytest.mark.parametrize("missing", ["config.json", "tokenizer.json", "model.safetensors"])
def test_missing_file(tmp_path, missing):
    d = tiny_checkpoint(tmp_path / "m")
    (d / missing).unlink()
    with pytest.raises(ModelLoadError, match=f"has no {missing}"):
        load(d)


def test_pickled_weights_are_refused_not_loaded(tmp_path):
    d = tiny_checkpoint(tmp_path / "m")
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04 not even a real pickle")
    with pytest.raises(ModelLoadError, match="never loaded"):
        load(d)


def test_missing_tensor_is_named(tmp_path):
    d = tiny_checkpoint(tmp_path / "m")
    w = load_file(str(d / "model.safetensors"))
    del w["encoder.layer.1.attention.self.key.weight"]
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"missing.*encoder\.layer\.1\.attention\.self\.key\.weight"):
        load(d)


@pytest.mark.parametrize("extra", ["encoder.layer.0.attention.self.adapter.weight",
                                   "encoder.layer.5.output.dense.weight"],
                         ids=["in a layer", "a layer after a gap"])
def test_a_tensor_in_the_encoder_the_layers_have_not_is_refused(tmp_path, extra):
    """BertModel-shaped checkpoints keep heads and buffers outside the encoder (accepted);
    a tensor inside it that no layer uses was ignored, and the model computed something
    else than the network it belongs to."""
    d = tiny_checkpoint(tmp_path / "m")
    w = load_file(str(d / "model.safetensors"))
    save_file(w | {extra: torch.zeros(32, 32), "pooler.dense.weight": torch.zeros(32, 32)},
              str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError, match=r"holds 1 tensor\(s\) in its encoder that "
                       r"config.json's 2-layer BERT encoder has not, e.g. \['" + re.escape(extra)):
        load(d)


def test_a_tokenizer_without_its_unknown_token_is_refused_when_loaded(tmp_path):
    """A WordPiece vocabulary without [UNK] loaded, then failed inside the tokenizer on the
    first text holding a word it lacks."""
    d = tiny_checkpoint(tmp_path / "m")
    spec = json.loads((d / "tokenizer.json").read_text())
    del spec["model"]["vocab"]["[UNK]"]
    (d / "tokenizer.json").write_text(json.dumps(spec))
    with pytest.raises(ModelLoadError, match=r"tokenizer.json is not a usable tokenizer.json "
                                             r"\(WordPiece error: Missing \[UNK\] token from "
                                             r"the vocabulary\): copy it from the original"):
        load(d)


def test_misshaped_tensor_is_named(tmp_path):
    d = tiny_checkpoint(tmp_path / "m")
    w = load_file(str(d / "model.safetensors"))
    w["encoder.layer.0.intermediate.dense.weight"] = torch.zeros(63, 32)
    save_file(w, str(d / "model.safetensors"))
    with pytest.raises(ModelLoadError,
                       match=r"intermediate_size is 64.*intermediate\.dense\.weight of shape \(63, 32\)"):
        load(d)


def test_corrupt_file(tmp_path):
    d = tiny_checkpoint(tmp_path / "m")
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors: .*data_offsets.*corrupt"):
        load(d)
    (d / "model.safetensors").write_bytes(b"garbage")
    with pytest.raises(ModelLoadError, match=r"model\.safetensors is 7 bytes, too short"):
        load(d)


@pytest.mark.parametrize("change,message", [
    (dict(model_type="t5"), "model_type is 't5'"),
    (dict(position_embedding_type="relative_key"), "position_embedding_type"),
    (dict(hidden_act="swish"), "hidden_act 'swish'"),
    (dict(num_attention_heads=5), "not divisible"),
])
def test_unsupported_architecture(tmp_path, change, message):
    d = tiny_checkpoint(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(change)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match=message):
        load(d)


def test_bad_json_and_not_a_directory(tmp_path):
    d = tiny_checkpoint(tmp_path / "m")
    (d / "config.json").write_text("{oops")
    with pytest.raises(ModelLoadError, match="not valid JSON"):
        load(d)
    with pytest.raises(ModelLoadError, match="does not exist"):
        load(tmp_path / "nowhere")


def test_bert_prefixed_checkpoint(tmp_path):
    """BertForMaskedLM-style checkpoints name tensors 'bert.embeddings...': same weights."""
    d = tiny_checkpoint(tmp_path / "m")
    w = load_file(str(d / "model.safetensors"))
    plain = load(d)
    save_file({"bert." + k: v for k, v in w.items()} | {"cls.predictions.bias": torch.zeros(3)},
              str(d / "model.safetensors"))
    prefixed = load(d)
    ids = torch.tensor([[101, 2009, 102]])
    torch.testing.assert_close(plain.encoder(ids).hidden, prefixed.encoder(ids).hidden)


def test_encoder_and_embed_bad_input(tmp_path):
    m = load(tiny_checkpoint(tmp_path / "m"))
    enc = m.encoder
    with pytest.raises(TypeError, match=r"input_ids must be an integer tensor \(B, S\)"):
        enc(torch.zeros(1, 3))
    with pytest.raises(ValueError, match=r"input_ids must be \(B, S\), got shape \(3,\)"):
        enc(torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match=r"must lie in \[0, 30522\).*\[-1, 5\]"):
        enc(torch.tensor([[5, -1]]))
    with pytest.raises(ValueError, match="70 tokens but the model has 64 positions"):
        enc(torch.ones(1, 70, dtype=torch.long))
    with pytest.raises(ValueError, match=r"cu_seqlens must be \[0, \.\.\., N=4\]"):
        enc.forward_packed(torch.ones(4, dtype=torch.long), torch.tensor([0, 3]))
    with pytest.raises(ValueError, match="strictly increasing"):
        enc.forward_packed(torch.ones(4, dtype=torch.long), torch.tensor([0, 0, 4]))
    with pytest.raises(TypeError, match=r"texts must be a list of str, got str: wrap one text "
                                        r"in a list \(\['one text'\]\)"):
        m.embed("one text")
    for bad, said in ((None, "NoneType"), (b"x", r"bytes: decode it first"), (3, "int")):
        with pytest.raises(TypeError, match=rf"texts\[1\] must be a str, got {said}"):
            m.embed(["ok", bad])
        with pytest.raises(TypeError, match=rf"^text must be a str, got {said}"):
            m.tokenize(bad)
    with pytest.raises(TypeError, match="text must be a str, got list: tokenize_batch takes"):
        m.tokenize(["a", "b"])
    with pytest.raises(ValueError, match=r"texts\[1\] holds a lone surrogate '\\udc80' at "
                                         r"character 4, .* errors='replace'"):
        m.embed(["ok", "bad \udc80"])
    assert m.embed([]).shape == (0, 32)
    m.sentence.pooling = "max"                        # (used to pool by the mean, silently)
    with pytest.raises(ValueError, match="sentence.pooling must be 'mean' or 'cls', got 'max'"):
        m.embed(["a text"])
    m.sentence.pooling = "mean"
    for bad in (0, 2.5, True, "512", None):          # (0 and 2.5 ran every text alone)
        with pytest.raises(ValueError, match=rf"pack_tokens must be a positive int, got "
                                             rf"{re.escape(repr(bad))}: the most tokens"):
            m.embed(["a text"], pack_tokens=bad)


@pytest.mark.parametrize("post_processor", ["bert", None])
def test_truncation_keeps_the_first_tokens_and_an_end_marker_if_any(tmp_path, post_processor):
    """64 positions: [CLS], 62 words and [SEP] with MiniLM's tokenizer; without its
    post-processor (no markers: a decoder's, as GPT-2's; a BERT tokenizer.json without one is
    refused) the first 64 words, as the tokenizer's own truncation."""
    m = load(tiny_checkpoint(tmp_path / "m"))
    if post_processor is None:
        m.tokenizer.post_processor = None
    words = [f"w{i}" for i in range(100)]
    text = " ".join(words)
    full = m.tokenizer.encode(text)
    m.tokenizer.enable_truncation(64)
    want = m.tokenizer.encode(text)
    m.tokenizer.no_truncation()
    tok = m.tokenize(text)
    assert tok.truncated and tok.original_length == len(full.ids) > 64
    assert tok.ids.tolist() == want.ids and tok.tokens == want.tokens
    assert (tok.tokens[-1] == "[SEP]") == (post_processor is not None)


def test_embed_and_weights_run_in_eval_mode_and_leave_the_callers_mode(tmp_path):
    """A caller's encoder.train() (dropout 0.1 in the tiny config) used to make every embed
    differ; sentence-transformers encodes in eval mode, and so do we, restoring the mode."""
    m = load(tiny_checkpoint(tmp_path / "m", hidden_dropout_prob=0.1,
                             attention_probs_dropout_prob=0.1))
    texts = ["a cat sat on the mat", "dogs"]
    want, weights = m.embed(texts), m.attention_weights(m.tokenize(texts[0]).ids[None])
    m.encoder.train()
    for _ in range(2):
        torch.testing.assert_close(m.embed(texts), want, rtol=0, atol=0)
        again = m.attention_weights(m.tokenize(texts[0]).ids[None])
        assert all(torch.equal(a, b) for a, b in zip(again.weights, weights.weights))
    assert m.encoder.training and all(x.training for x in m.encoder.modules())


@pytest.mark.parametrize("types, error, message", [
    (lambda ids: torch.full_like(ids, 2), ValueError,
     r"token_type_ids must lie in \[0, 2\) \(the segment types\), got values in \[2, 2\]"),
    (lambda ids: torch.zeros(ids.shape), TypeError,
     r"token_type_ids must be an integer tensor of input_ids' shape \(1, \d+\), got torch.float32"),
    (lambda ids: torch.zeros(1, 2, dtype=torch.long), ValueError,
     r"token_type_ids must have input_ids' shape \(1, \d+\), got \(1, 2\)"),
], ids=["out-of-range", "float", "shape"])
def test_token_type_ids_are_checked_as_input_ids_are(tmp_path, types, error, message):
    m = load(tiny_checkpoint(tmp_path / "m"))
    ids = m.tokenize("a cat sat").ids[None]
    with pytest.raises(error, match=message):
        m.encoder(ids, token_type_ids=types(ids))
    ones = m.encoder(ids, token_type_ids=torch.ones_like(ids)).hidden
    assert not torch.equal(ones, m.encoder(ids).hidden)      # type 1 is read, not ignored


@pytest.mark.parametrize("ids, cu, error, message", [
    (torch.arange(6), [0.0, 2.7, 6.0], TypeError, "cu_seqlens must be an integer tensor, got dtype torch.float32 \\[0, 2.7, 6\\]: pass a list of ints"),
    (torch.arange(6), torch.tensor([0.0, 3.0, 6.0]), TypeError, "cu_seqlens must be an integer tensor"),
    (torch.zeros(0, dtype=torch.long), [0], ValueError, "there is no token to encode"),
    (torch.arange(6), [0, 6, 6], ValueError, "strictly increasing, got \\[0, 6, 6\\]"),
    (torch.arange(6), 6, ValueError, r"cu_seqlens must be \[0, \.\.\., N=6\].* got \[6\] \(shape \(\)\)"),
    (torch.arange(6), None, TypeError, r"cu_seqlens must be integers .* got None \(NoneType\)"),
    (torch.arange(6), "abc", TypeError, r"cu_seqlens must be integers .* got 'abc' \(str\)"),
    (torch.arange(6), [0, 2**64], ValueError, r"cu_seqlens \[0, 1844.* cannot be a tensor \(.*\): "
     r"pass a list of ints \(or rows of one length\), each below 2\*\*63"),
], ids=["float-list", "float-tensor", "empty", "empty-text", "scalar", "none", "str", "overflow"])
def test_forward_packed_refuses_offsets_it_would_round_or_fail_on(tmp_path, ids, cu, error,
                                                                   message):
    m = load(tiny_checkpoint(tmp_path / "m"))
    with pytest.raises(error, match=message):
        m.encoder.forward_packed(ids, cu)


def test_overlapping_eval_blocks_share_one_eval_period():
    """Two callers (threads) inside ``evaluating`` at once: the first to leave used to put
    the module back in train mode under the other's forward (dropout on, silently)."""
    from multihead.models.pretrained import evaluating
    m = torch.nn.Sequential(torch.nn.Dropout(), torch.nn.Dropout().eval()).train()
    m[1].eval()
    a, b = evaluating(m), evaluating(m)
    a.__enter__()
    b.__enter__()
    a.__exit__(None, None, None)
    assert not m.training and not m[0].training                   # b is still inside
    b.__exit__(None, None, None)
    assert (m.training, m[0].training, m[1].training) == (True, True, False)
    outer, inner = evaluating(m), evaluating(m[0])                # a model and a layer of it
    outer.__enter__()
    inner.__enter__()
    outer.__exit__(None, None, None)
    assert not m[0].training and m.training                       # the layer's block goes on
    inner.__exit__(None, None, None)
    assert (m.training, m[0].training, m[1].training) == (True, True, False)


def test_embed_in_threads_gives_eval_mode_embeddings_and_keeps_train_mode(tmp_path):
    m = load(tiny_checkpoint(tmp_path / "m", hidden_dropout_prob=0.5,
                             attention_probs_dropout_prob=0.5))
    texts = ["a cat sat on the mat", "the dog ran", "it rains"]
    want = m.embed(texts)
    m.encoder.train()
    got, errors = [], []

    def run():
        try:
            for _ in range(4):
                got.append(m.embed(texts))
        except Exception as e:                                       # (reported below)
            errors.append(e)
    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(got) == 12
    assert all(torch.equal(g, want) for g in got)
    assert m.encoder.training and all(x.training for x in m.encoder.modules())


def test_tokenize_refuses_a_max_length_that_would_cut_the_special_tokens(tmp_path):
    """max_length=1 used to keep only [SEP]: no [CLS] and no text."""
    m = load(tiny_checkpoint(tmp_path / "m"))
    with pytest.raises(ValueError, match=r"max_length=1 is shorter than the 2 special tokens .* "
                                         r"pass max_length=2 or more"):
        m.tokenize("a cat sat", max_length=1)
    assert m.tokenize("a cat sat", max_length=2).tokens == ["[CLS]", "[SEP]"]


@pytest.mark.parametrize("positions", [1, 2])
def test_a_model_with_no_room_for_a_word_says_so_not_that_the_text_is_empty(tmp_path, positions):
    """With 2 positions, inspect said the text had no token but markers ("give some words");
    with 1, only [SEP] was kept. The checkpoint is what cannot read text."""
    m = load(tiny_checkpoint(tmp_path / "m", max_position_embeddings=positions))
    with pytest.raises(ValueError, match=rf"the model has {positions} position.* "
                                         r"max_position_embeddings.* adds 2 special tokens"):
        m.tokenize("a cat sat")
    assert len(load(tiny_checkpoint(tmp_path / "m3", max_position_embeddings=3)).tokenize(
        "a cat sat").tokens) == 3


def test_tokenizing_a_long_text_reads_each_property_of_its_encoding_once(tmp_path):
    """Each read of an encoding's ``ids`` (or tokens, offsets...) copies all of it: one read
    per kept token made a 100k-word text take seconds."""
    m = load(tiny_checkpoint(tmp_path / "m"))
    reads = collections.Counter()

    class Counting:
        def __init__(self, enc):
            self.enc = enc

        def __getattr__(self, name):
            reads[name] += 1
            return getattr(self.enc, name)

    real = m.tokenizer
    fake = types.SimpleNamespace(encode_batch=lambda texts: [Counting(e) for e in real.encode_batch(texts)],
                                 post_processor=real.post_processor)
    m.tokenizer = fake
    t = m.tokenize("word " * 300)
    m.tokenizer = real
    assert len(t.ids) == 64 and t.truncated and t.tokens == m.tokenize("word " * 300).tokens
    assert max(reads.values()) == 1, reads


@pytest.mark.parametrize("max_length", [0, -1, 2.5, "8", True])
def test_tokenize_refuses_a_max_length_that_is_not_a_positive_integer(tmp_path, max_length):
    """0 used to mean "no limit" and -1 an IndexError."""
    m = load(tiny_checkpoint(tmp_path / "m"))
    with pytest.raises(ValueError, match=f"max_length must be a positive integer .* got "
                                         f"{max_length!r}"):
        m.tokenize("a cat sat", max_length=max_length)
    assert len(m.tokenize("a cat sat on the mat", max_length=3).ids) == 3


def test_a_max_length_past_the_models_positions_is_refused_naming_where_it_came_from(tmp_path):
    """It kept every token, and the encoder then refused the text ("a sequence has 102
    tokens but the model has 64 positions"), naming neither."""
    m = load(tiny_checkpoint(tmp_path / "m"))                   # 64 positions
    with pytest.raises(ValueError, match=r"^max_length=100 is more than the model's 64 "
                                         r"positions \(config.json max_position_embeddings\)"):
        m.tokenize("word " * 100, max_length=100)
    assert len(m.tokenize("word " * 100, max_length=64).ids) == 64
    m.sentence.max_seq_length = 100
    with pytest.raises(ValueError, match=r"^sentence.max_seq_length=100 is more than the "
                                         r"model's 64 positions"):
        m.embed(["word " * 100])


def test_a_model_loaded_from_dot_is_named_after_its_folder(tmp_path, monkeypatch):
    d = tiny_checkpoint(tmp_path / "tiny-bert")
    monkeypatch.chdir(d)
    assert load(".").name == "tiny-bert"
    monkeypatch.chdir(d / "..")
    assert load("tiny-bert/").name == "tiny-bert"


def test_a_sharded_bert_checkpoint_is_refused_saying_so(tmp_path):
    d = tiny_checkpoint(tmp_path / "m")
    (d / "model.safetensors").rename(d / "model-00001-of-00001.safetensors")
    (d / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"embeddings.word_embeddings.weight": "model-00001-of-00001.safetensors"}}))
    with pytest.raises(ModelLoadError, match=r"has no model.safetensors: it holds shards "
                                             r"\(model.safetensors.index.json\), which the BERT "
                                             r"loader does not read"):
        load(d)

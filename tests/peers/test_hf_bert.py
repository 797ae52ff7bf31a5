"""The embedded all-MiniLM-L6-v2 on our attention equals Hugging Face transformers' BertModel
and sentence-transformers on the same weights; packed batches equal texts run one by one."""

from __future__ import annotations

import pytest
import torch

from multihead.models import default_model_dir, load

transformers = pytest.importorskip("transformers")

TEXTS = ["The animal didn't cross the street because it was too tired.",
         "Hi.",
         "Multi-head attention lets the model jointly attend to information from different "
         "representation subspaces at different positions.",
         "Packed sequences: each text attends only to its own tokens, padding costs nothing."]


@pytest.fixture(scope="module")
def ours():
    return load()


@pytest.fixture(scope="module")
def hf():
    return transformers.BertModel.from_pretrained(str(default_model_dir()),
                                                  attn_implementation="eager").eval()


def _padded(model, texts):
    toks = model.tokenize_batch(texts)
    lengths = torch.tensor([len(t.ids) for t in toks])
    ids = torch.zeros(len(texts), int(lengths.max()), dtype=torch.long)   # (B, S), 0 = [PAD]
    for i, t in enumerate(toks):
        ids[i, : len(t.ids)] = t.ids
    return ids, lengths


@torch.inference_mode()
def test_hidden_states_equal_transformers_bertmodel(ours, hf):
    ids, lengths = _padded(ours, TEXTS)
    attn = (torch.arange(ids.shape[1])[None, :] < lengths[:, None]).long()
    want = hf(input_ids=ids, attention_mask=attn, output_attentions=True)
    got = ours.encoder(ids, lengths=lengths, return_weights=True)
    for i, n in enumerate(lengths.tolist()):
        torch.testing.assert_close(got.hidden[i, :n], want.last_hidden_state[i, :n],
                                   atol=1e-5, rtol=1e-5)
        for layer, (a, b) in enumerate(zip(got.weights, want.attentions)):   # (B, H, S, S)
            torch.testing.assert_close(a[i, :, :n, :n], b[i, :, :n, :n], atol=1e-5, rtol=1e-4,
                                       msg=f"layer {layer} weights differ")


@torch.inference_mode()
def test_token_ids_equal_transformers_tokenizer(ours):
    tok = transformers.AutoTokenizer.from_pretrained(str(default_model_dir()))
    for text in TEXTS:
        assert ours.tokenize(text).ids.tolist() == tok(text)["input_ids"]


def test_sentence_embeddings_equal_sentence_transformers(ours):
    st = pytest.importorskip("sentence_transformers")
    model = st.SentenceTransformer(str(default_model_dir()), device="cpu")
    long_text = " ".join(["attention"] * 400)           # truncated at 256 by both
    texts = TEXTS + [long_text]
    want = model.encode(texts, convert_to_tensor=True)
    got = ours.embed(texts)
    torch.testing.assert_close(got, want.cpu(), atol=2e-6, rtol=1e-5)


@torch.inference_mode()
def test_packed_batch_equals_one_by_one(ours):
    texts = TEXTS * 3 + ["a b c", "x"]
    packed = ours.embed(texts, pack_tokens=64)            # several packs, lengths shuffled
    single = torch.cat([ours.embed([t]) for t in texts])
    torch.testing.assert_close(packed, single, atol=1e-6, rtol=1e-5)
    toks = ours.tokenize_batch(TEXTS)
    ids = torch.cat([t.ids for t in toks])                # packed in the given order
    cu = torch.tensor([0] + [len(t.ids) for t in toks]).cumsum(0)
    h = ours.encoder.forward_packed(ids, cu)               # (N, E)
    for i, t in enumerate(toks):
        alone = ours.encoder(t.ids[None]).hidden[0]
        torch.testing.assert_close(h[cu[i]:cu[i + 1]], alone, atol=1e-5, rtol=1e-5)


def test_do_lower_case_is_followed_as_sentence_transformers_does(tmp_path):
    """A cased tokenizer with sentence_bert_config's do_lower_case: texts are lower-cased
    before tokenizing (MiniLM's own tokenizer lower-cases, so its copy here does not), for
    embeddings and for what inspect shows (its tokens were [UNK] for every capital)."""
    import json
    import shutil
    st = pytest.importorskip("sentence_transformers")
    src, d = default_model_dir(), tmp_path / "cased"
    shutil.copytree(src, d, ignore=shutil.ignore_patterns("model.safetensors"))
    (d / "model.safetensors").symlink_to(src / "model.safetensors")
    spec = json.loads((src / "tokenizer.json").read_text())
    spec["normalizer"]["lowercase"] = False
    (d / "tokenizer.json").write_text(json.dumps(spec))
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256,
                                                              "do_lower_case": True}))
    texts = ["The Animal Didn't Cross The Street", "HELLO World"]
    want = st.SentenceTransformer(str(d), device="cpu").encode(texts, convert_to_tensor=True)
    ours = load(d)
    assert ours.sentence.lower_case
    assert ours.tokenize(texts[1]).tokens == ["[CLS]", "hello", "world", "[SEP]"]
    assert ours._read(texts) != texts and ours.tokenizer.encode(texts[1]).tokens[1] == "[UNK]"
    torch.testing.assert_close(ours.embed(texts), want.cpu(), atol=2e-6, rtol=1e-5)
    from multihead.inspect.capture import capture, find_query
    cap = capture(ours, texts[0])
    assert "[UNK]" not in cap.tokens
    assert cap.tokens[find_query(ours, cap.tokens, "Animal", cap.words, text=cap.text,
                                 spans=cap.spans)] == "animal"


def _copy_of_the_model(d):
    """The embedded model's folder at ``d``, its weights linked (not copied)."""
    import shutil
    src = default_model_dir()
    shutil.copytree(src, d, ignore=shutil.ignore_patterns("model.safetensors"))
    (d / "model.safetensors").symlink_to(src / "model.safetensors")
    return d


def _modules(*entries):
    kinds = {"Transformer": "", "Pooling": "1_Pooling", "Normalize": "2_Normalize"}
    return [{"idx": i, "name": str(i), "path": path if path is not None else kinds[kind],
             "type": f"sentence_transformers.models.{kind}"}
            for i, (kind, path) in enumerate(entries)]


@pytest.mark.parametrize("change", ["pooling-folder", "no-sentence-config", "no-normalize"])
def test_the_side_files_are_read_as_sentence_transformers_reads_them(tmp_path, change):
    """The Pooling folder modules.json names (its own config, [CLS] here), the tokenizer's
    model_max_length when sentence_bert_config.json is missing, and a pipeline without
    Normalize: each gives sentence-transformers' embeddings (the first two used to give
    1_Pooling's mean pooling, and 512 tokens)."""
    import json
    st = pytest.importorskip("sentence_transformers")
    d = _copy_of_the_model(tmp_path / change)
    if change == "pooling-folder":
        (d / "1_Pooling").rename(d / "pool")
        cfg = json.loads((d / "pool" / "config.json").read_text())
        cfg.update(pooling_mode_cls_token=True, pooling_mode_mean_tokens=False)
        (d / "pool" / "config.json").write_text(json.dumps(cfg))
        modules = _modules(("Transformer", None), ("Pooling", "pool"), ("Normalize", None))
    elif change == "no-sentence-config":
        (d / "sentence_bert_config.json").unlink()
        cfg = json.loads((d / "tokenizer_config.json").read_text())
        (d / "tokenizer_config.json").write_text(json.dumps({**cfg, "model_max_length": 128}))
        modules = _modules(("Transformer", None), ("Pooling", None), ("Normalize", None))
    else:
        modules = _modules(("Transformer", None), ("Pooling", None))
    (d / "modules.json").write_text(json.dumps(modules))
    texts = TEXTS + [" ".join(["attention"] * 300)]
    want = st.SentenceTransformer(str(d), device="cpu").encode(texts, convert_to_tensor=True)
    ours = load(d)
    assert ours.sentence.max_seq_length == (128 if change == "no-sentence-config" else 256)
    torch.testing.assert_close(ours.embed(texts), want.cpu(), atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("entries, message", [
    ([("Transformer", None), ("Normalize", None), ("Pooling", None)],
     "runs Transformer -> Normalize -> Pooling, but multihead runs Transformer -> Pooling"),
    ([("Transformer", None), ("Normalize", None)], "runs Transformer -> Normalize, but"),
    ([], "runs no module, but"),
    ([("Transformer", None), ("Pooling", "missing"), ("Normalize", None)],
     "names the Pooling module's folder 'missing', but .* does not exist"),
    ([("Transformer", None), ("Pooling", "../elsewhere")],
     "the Pooling module's path is '../elsewhere', but it must name a folder inside"),
], ids=["normalize-first", "no-pooling", "empty", "missing-folder", "outside"])
def test_a_pipeline_multihead_would_run_differently_is_refused(tmp_path, entries, message):
    """sentence-transformers pools after normalizing here (or fails without Pooling): we
    would pool and then normalize, so the load is refused, naming the file."""
    import json
    from multihead.models import ModelLoadError
    d = _copy_of_the_model(tmp_path / "m")
    (d / "modules.json").write_text(json.dumps(_modules(*entries)))
    with pytest.raises(ModelLoadError, match="modules.json " + message
                       if not message.startswith("the") else "modules.json: " + message):
        load(d)

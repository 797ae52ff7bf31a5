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
    """A cased tokenizer with sentence_bert_config's do_lower_case: the tokenizer lower-cases
    texts (MiniLM's own tokenizer does, so its copy here does not), for embeddings and for
    what inspect shows (its tokens were [UNK] for every capital). As in sentence-transformers
    6, after special tokens are found (a literal [MASK] stays one; lower-casing the text
    first broke it into pieces), and a word's characters are those of the text as given."""
    import json
    import shutil
    st = pytest.importorskip("sentence_transformers")
    src, d = default_model_dir(), tmp_path / "cased"
    shutil.copytree(src, d, ignore=shutil.ignore_patterns("model.safetensors"))
    (d / "model.safetensors").symlink_to(src / "model.safetensors")
    spec = json.loads((src / "tokenizer.json").read_text())
    spec["normalizer"]["lowercase"] = False
    (d / "tokenizer.json").write_text(json.dumps(spec))
    config = json.loads((src / "tokenizer_config.json").read_text())    # (transformers 5 builds
    config["do_lower_case"] = False                                      # its tokenizer from it)
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    (d / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 256,
                                                              "do_lower_case": True}))
    texts = ["The Animal Didn't Cross The Street", "HELLO World", "Hello [MASK] WORLD",
             "ΣΊΣΥΦΟΣ", "İİİ big cat"]
    want = st.SentenceTransformer(str(d), device="cpu").encode(texts, convert_to_tensor=True)
    ours = load(d)
    assert ours.sentence.lower_case
    assert ours.tokenize(texts[1]).tokens == ["[CLS]", "hello", "world", "[SEP]"]
    from tokenizers import Tokenizer
    assert Tokenizer.from_file(str(d / "tokenizer.json")).encode(texts[1]).tokens[1] == "[UNK]"
    assert ours.tokenize(texts[2]).tokens[1:4] == ["hello", "[MASK]", "world"]
    ours.sentence.lower_case = False                     # (followed when set after loading)
    assert ours.tokenize(texts[1]).tokens[1] == "[UNK]"
    ours.sentence.lower_case = True
    t = ours.tokenize(texts[4])
    assert [texts[4][a:b] for a, b in t.spans[-3:-1]] == ["big", "cat"]
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


@pytest.mark.parametrize("mode", ["mean", "cls"])
@pytest.mark.parametrize("include_prompt", [True, False])
def test_prompts_and_sentence_transformers_6_pooling_files_embed_as_it_does(tmp_path, mode,
                                                                            include_prompt):
    """sentence-transformers 6 writes the Pooling config as one pooling_mode (with
    include_prompt), and puts the default prompt before every text: both were ignored (a
    [CLS] model ran mean pooling, and no prompt was added)."""
    import json
    st = pytest.importorskip("sentence_transformers")
    d = _copy_of_the_model(tmp_path / "m")
    (d / "1_Pooling" / "config.json").write_text(json.dumps(
        {"embedding_dimension": 384, "pooling_mode": mode, "include_prompt": include_prompt}))
    (d / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": {"query": "query: ", "passage": "passage of text: ", "none": None},
         "default_prompt_name": "query", "similarity_fn_name": "cosine"}))
    texts = TEXTS + ["", " ".join(["attention"] * 300)]       # (an empty text; a cut one)
    theirs = st.SentenceTransformer(str(d), device="cpu")
    ours = load(d)
    assert (ours.sentence.pooling, ours.sentence.include_prompt) == (mode, include_prompt)
    for kwargs in ({}, {"prompt_name": "passage"}, {"prompt_name": "none"}, {"prompt": ""},
                   {"prompt": "Represent this: "}):
        want = theirs.encode(texts, convert_to_tensor=True, **kwargs)
        torch.testing.assert_close(ours.embed(texts, **kwargs), want.cpu(), atol=2e-6,
                                   rtol=1e-5, msg=str(kwargs))
    assert not torch.allclose(ours.embed(texts[:1]), ours.embed(texts[:1], prompt=""))
    with pytest.raises(ValueError, match=r"prompt_name 'doc' is not one of this model's "
                                         r"prompts \(\['none', 'passage', 'query'\]"):
        ours.embed(texts, prompt_name="doc")
    with pytest.raises(ValueError, match=r"pass prompt or prompt_name, not both"):
        ours.embed(texts, prompt="a", prompt_name="query")
    with pytest.raises(TypeError, match=r"^prompt must be a str, got int"):
        ours.embed(texts, prompt=3)
    ours.sentence.default_prompt_name = "gone"              # (set after loading)
    with pytest.raises(ValueError, match=r"^sentence.default_prompt_name 'gone' is not one of "
                                         r"this model's prompts"):
        ours.embed(texts)


@pytest.mark.parametrize("pool, message", [
    ({"embedding_dimension": 384, "pooling_mode": "max"}, r"pools with max, which multihead "
                                                          r"does not compute: only mean or cls"),
    ({"pooling_mode": ["mean", "cls"]}, r"pools with mean \+ cls, which multihead"),
    ({"pooling_mode": "average"}, r"pooling_mode is 'average', but it must be a pooling's name"),
    ({"embedding_dimension": 768, "pooling_mode": "mean"}, r"embedding_dimension is 768, but "
                                                           r"config.json's hidden_size is 384"),
    ({"pooling_mode": "mean", "include_prompt": "no"}, r"include_prompt is 'no', but it must be"),
], ids=["max", "two", "unknown", "dimension", "include_prompt"])
def test_a_sentence_transformers_6_pooling_multihead_does_not_run_is_refused(tmp_path, pool,
                                                                              message):
    import json
    from multihead.models import ModelLoadError
    d = _copy_of_the_model(tmp_path / "m")
    (d / "1_Pooling" / "config.json").write_text(json.dumps(pool))
    with pytest.raises(ModelLoadError, match=message):
        load(d)


@pytest.mark.parametrize("settings, message", [
    ({"prompts": {"q": "q: "}, "default_prompt_name": "query"},
     r"default_prompt_name is 'query', but it must be one of the prompts' names \['q'\]"),
    ({"prompts": ["q: "]}, r"prompts is an array \['q: '\], but it must be an object"),
    ({"prompts": {"q": 3}}, r"prompts is an object \{'q': 3\}, but it must be an object"),
])
def test_prompts_that_cannot_be_read_are_refused(tmp_path, settings, message):
    import json
    from multihead.models import ModelLoadError
    d = _copy_of_the_model(tmp_path / "m")
    (d / "config_sentence_transformers.json").write_text(json.dumps(settings))
    with pytest.raises(ModelLoadError, match=r"config_sentence_transformers.json: " + message):
        load(d)

"""Hostile model directories: every one fails fast with one ModelLoadError line that names the
file and the field (or tensor), before any model is built. Nothing crashes, hangs, exhausts
memory or comes back half-loaded."""

from __future__ import annotations

import json
import math
import re
import struct
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import multihead.models.loading as loading
from multihead.models import ModelLoadError, load
from tiny import tiny_checkpoint

WEIGHTS = "model.safetensors"


# --- ways to break a tiny checkpoint directory ---------------------------------------------

def config(**change):
    """Change fields of config.json."""
    def apply(d: Path):
        cfg = json.loads((d / "config.json").read_text())
        cfg.update(change)
        (d / "config.json").write_text(json.dumps(cfg))   # NaN/Infinity are written as such
    return apply


def write(rel: str, content):
    """Write a file: bytes as they are, anything else as JSON."""
    def apply(d: Path):
        p = d / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    return apply


def weights(change):
    """Change the checkpoint's tensors (``change`` edits the name -> tensor dict in place)."""
    def apply(d: Path):
        w = load_file(str(d / WEIGHTS))
        change(w)
        save_file(w, str(d / WEIGHTS))
    return apply


def set_value(name: str, value: float):
    return weights(lambda w: w[name].view(-1).__setitem__(7, value))


def retype(name: str, dtype: torch.dtype):
    return weights(lambda w: w.__setitem__(name, w[name].to(dtype)))


def _split(d: Path) -> tuple[dict, bytes]:
    data = (d / WEIGHTS).read_bytes()
    n = struct.unpack("<Q", data[:8])[0]
    return json.loads(data[8:8 + n]), data[8 + n:]


def header(change):
    """Rewrite the safetensors header: ``change(header)`` returns the new header, as a dict
    or as raw bytes; the tensor data stays as it is."""
    def apply(d: Path):
        h, data = _split(d)
        new = change(h)
        raw = new if isinstance(new, bytes) else json.dumps(new).encode()
        (d / WEIGHTS).write_bytes(struct.pack("<Q", len(raw)) + raw + data)
    return apply


def entry(name: str, **fields):
    """Change fields of one tensor's header entry."""
    return header(lambda h: h | {name: h[name] | fields})


def duplicate(h: dict) -> bytes:
    """The header with its first tensor's entry written twice (json would keep the last)."""
    name = next(n for n in h if n != "__metadata__")
    text = json.dumps(h)
    return (text[:-1] + ", " + json.dumps(name) + ": " + json.dumps(h[name]) + "}").encode()


def file_bytes(change):
    """Rewrite model.safetensors' bytes."""
    def apply(d: Path):
        (d / WEIGHTS).write_bytes(change((d / WEIGHTS).read_bytes()))
    return apply


LN = "embeddings.LayerNorm.weight"
DENSE = "encoder.layer.1.output.dense.weight"
POOL = "1_Pooling/config.json"
ST = "sentence_bert_config.json"
MODULES = "modules.json"


# --- the table: (how the directory is broken, what the message must contain) ---------------

HOSTILE = [
    # 1. sizes that disagree with the checkpoint fail on its header, before anything is built
    pytest.param(config(num_hidden_layers=10**9), ["config.json", "num_hidden_layers", "1000000000"],
                 id="layers-1e9"),
    pytest.param(config(num_hidden_layers=3), ["config.json", "num_hidden_layers", "3", WEIGHTS,
                                               "holds 2 layer"], id="layers-one-too-many"),
    pytest.param(config(num_hidden_layers=1), ["config.json", "num_hidden_layers is 1", WEIGHTS,
                                               "holds 2 layer", "set num_hidden_layers to 2"],
                 id="layers-one-too-few"),
    pytest.param(config(hidden_size=2**40), ["config.json", "hidden_size", "1099511627776", WEIGHTS,
                                             "embeddings.word_embeddings.weight"], id="hidden-huge"),
    pytest.param(config(intermediate_size=10**9), ["config.json", "intermediate_size", "1000000000",
                                                   "intermediate.dense.weight"], id="intermediate-huge"),
    pytest.param(config(vocab_size=10**12), ["config.json", "vocab_size", "1000000000000"],
                 id="vocab-huge"),
    pytest.param(config(max_position_embeddings=10**9),
                 ["config.json", "max_position_embeddings", "1000000000",
                  "position_embeddings.weight"], id="positions-huge"),
    pytest.param(config(type_vocab_size=10**6), ["config.json", "type_vocab_size", "1000000"],
                 id="type-vocab-huge"),
    pytest.param(config(num_attention_heads=10**6), ["config.json", "num_attention_heads", "1000000"],
                 id="heads-huge"),
    pytest.param(config(num_attention_heads=0), ["config.json", "num_attention_heads", "0"],
                 id="heads-zero"),
    pytest.param(config(vocab_size="30522"), ["config.json", "vocab_size", "'30522'"], id="vocab-str"),
    # 3. config.json values that ended in a traceback, a bare message or silent NaN
    pytest.param(config(pad_token_id=10**6), ["config.json", "pad_token_id", "1000000"], id="pad-huge"),
    pytest.param(config(pad_token_id=-1), ["config.json", "pad_token_id", "-1"], id="pad-negative"),
    pytest.param(config(pad_token_id="0"), ["config.json", "pad_token_id", "'0'"], id="pad-str"),
    pytest.param(config(hidden_dropout_prob="0.1"), ["config.json", "hidden_dropout_prob", "'0.1'"],
                 id="dropout-str"),
    pytest.param(config(hidden_dropout_prob=1.5), ["config.json", "hidden_dropout_prob", "1.5"],
                 id="dropout-big"),
    pytest.param(config(attention_probs_dropout_prob=-0.1),
                 ["config.json", "attention_probs_dropout_prob", "-0.1"], id="attn-dropout-negative"),
    pytest.param(config(attention_probs_dropout_prob=math.nan),
                 ["config.json", "attention_probs_dropout_prob", "nan"], id="attn-dropout-nan"),
    pytest.param(config(layer_norm_eps="1e-12"), ["config.json", "layer_norm_eps", "'1e-12'"],
                 id="eps-str"),
    pytest.param(config(layer_norm_eps=-1e-5), ["config.json", "layer_norm_eps", "-1e-05"],
                 id="eps-negative"),
    pytest.param(config(layer_norm_eps=0), ["config.json", "layer_norm_eps", "0"], id="eps-zero"),
    pytest.param(config(layer_norm_eps=math.nan), ["config.json", "layer_norm_eps", "nan"],
                 id="eps-nan"),
    pytest.param(config(layer_norm_eps=math.inf), ["config.json", "layer_norm_eps", "inf"],
                 id="eps-inf"),
    pytest.param(config(hidden_act=["gelu"]), ["config.json", "hidden_act", "['gelu']"],
                 id="act-list"),
    pytest.param(write("config.json", b'{"model_type": "bert", "name": "caf\xe9"}'),
                 ["config.json", "not UTF-8", "xe9"], id="config-latin1"),
    pytest.param(write("config.json", [1, 2]), ["config.json", "JSON object", "[1, 2]"],
                 id="config-list"),
    pytest.param(write("config.json", b"[" * 100_000 + b"]" * 100_000), ["config.json", "deeply"],
                 id="config-deep"),
    pytest.param(write("config.json", b'{"vocab_size": 1' + b"0" * 5000 + b"}"),
                 ["config.json", "too long"], id="config-long-number"),
    pytest.param(write(ST, {"max_seq_length": -5}), [ST, "max_seq_length", "-5"], id="seq-negative"),
    pytest.param(write(ST, {"max_seq_length": "256"}), [ST, "max_seq_length", "'256'"], id="seq-str"),
    pytest.param(write(ST, {"max_seq_length": 0}), [ST, "max_seq_length", "0"], id="seq-zero"),
    pytest.param(write("tokenizer_config.json", {"model_max_length": 0.5}),     # (int() is 0)
                 ["tokenizer_config.json", "model_max_length is 0.5", "a number >= 1"],
                 id="tokenizer-max-length-fraction"),
    pytest.param(write(ST, {"do_lower_case": "yes"}), [ST, "do_lower_case", "'yes'", "true or false"],
                 id="lower-case-str"),
    # 2. side files of the wrong JSON type, or with fields of the wrong type
    pytest.param(write(MODULES, {"type": "x"}), [MODULES, "JSON array", "an object"], id="modules-object"),
    pytest.param(write(MODULES, "x"), [MODULES, "JSON array", "a string 'x'"], id="modules-str"),
    pytest.param(write(MODULES, 3), [MODULES, "JSON array", "a number 3"], id="modules-number"),
    pytest.param(write(MODULES, None), [MODULES, "JSON array", "null"], id="modules-null"),
    pytest.param(write(MODULES, [1, 2]), [MODULES, "module 0", "type"], id="modules-items"),
    pytest.param(write(MODULES, [{"type": 5}]), [MODULES, "module 0", "type", "5"],
                 id="modules-type-number"),
    pytest.param(write(MODULES, [{"type": "sentence_transformers.models.Dense"}]),
                 [MODULES, "module 0", "sentence_transformers.models.Dense"], id="modules-dense"),
    pytest.param(write(POOL, []), [POOL, "JSON object", "an array"], id="pooling-list"),
    pytest.param(write(POOL, "cls"), [POOL, "JSON object", "a string 'cls'"], id="pooling-str"),
    pytest.param(write(POOL, None), [POOL, "JSON object", "null"], id="pooling-null"),
    pytest.param(write(POOL, 1), [POOL, "JSON object", "a number 1"], id="pooling-number"),
    pytest.param(write(POOL, {"pooling_mode_cls_token": "yes"}), [POOL, "pooling_mode_cls_token", "'yes'"],
                 id="pooling-flag-str"),
    pytest.param(write(POOL, {"pooling_mode_max_tokens": True}), [POOL, "pooling_mode_max_tokens"],
                 id="pooling-max"),
    pytest.param(write(POOL, {"word_embedding_dimension": 384}), [POOL, "word_embedding_dimension", "384"],
                 id="pooling-dimension"),
    pytest.param(write(ST, [1]), [ST, "JSON object", "an array"], id="st-list"),
    pytest.param(write(ST, None), [ST, "JSON object", "null"], id="st-null"),
    pytest.param(write(ST, 256), [ST, "JSON object", "a number 256"], id="st-number"),
    # 4. weights that are not finite
    pytest.param(set_value(DENSE, math.nan), [WEIGHTS, DENSE, "nan"], id="weight-nan"),
    pytest.param(set_value(LN, math.inf), [WEIGHTS, LN, "inf"], id="weight-inf"),
    pytest.param(set_value("embeddings.word_embeddings.weight", -math.inf),
                 [WEIGHTS, "embeddings.word_embeddings.weight", "-inf"], id="weight-minus-inf"),
    # 5. safetensors files that are broken, ambiguous or of the wrong dtype
    pytest.param(file_bytes(lambda b: b[:-100]), [WEIGHTS, "data_offsets", "corrupt"], id="truncated"),
    pytest.param(file_bytes(lambda b: struct.pack("<Q", 2**40) + b[8:]),
                 [WEIGHTS, "header length", "1,099,511,627,776"], id="header-length-huge"),
    pytest.param(file_bytes(lambda b: b"\xff" * 8 + b[8:]), [WEIGHTS, "header length"],
                 id="header-length-max"),
    pytest.param(file_bytes(lambda b: b[:5]), [WEIGHTS, "5 bytes", "too short"], id="five-bytes"),
    pytest.param(file_bytes(lambda b: b""), [WEIGHTS, "0 bytes", "too short"], id="empty"),
    pytest.param(header(lambda h: b"[]"), [WEIGHTS, "header", "JSON object"], id="header-list"),
    pytest.param(header(lambda h: b"\xff\xfe{}"), [WEIGHTS, "header", "UTF-8"], id="header-binary"),
    pytest.param(header(duplicate), [WEIGHTS, "twice"], id="duplicate-tensor"),
    pytest.param(weights(lambda w: w.update({"bert." + k: v.clone() for k, v in list(w.items())})),
                 [WEIGHTS, "both", "bert.embeddings"], id="prefixed-and-plain"),
    pytest.param(retype(LN, torch.int32), [WEIGHTS, LN, "I32"], id="int-weights"),
    pytest.param(retype(LN, torch.bool), [WEIGHTS, LN, "BOOL"], id="bool-weights"),
    pytest.param(retype(LN, torch.float8_e4m3fn), [WEIGHTS, LN, "F8_E4M3"], id="float8-weights"),
    pytest.param(entry(LN, shape=[-32]), [WEIGHTS, LN, "shape", "-32"], id="negative-shape"),
    pytest.param(entry(LN, shape="32"), [WEIGHTS, LN, "shape", "'32'"], id="shape-str"),
    pytest.param(entry(LN, dtype=7), [WEIGHTS, LN, "dtype", "7"], id="dtype-number"),
    pytest.param(entry(LN, data_offsets=[0, 10**12]), [WEIGHTS, LN, "data_offsets"],
                 id="offsets-outside"),
    pytest.param(entry(LN, shape=[64]), [WEIGHTS, LN, "data_offsets"], id="shape-bigger-than-data"),
    pytest.param(entry(LN, shape=[2] * 10**5), [WEIGHTS, LN, "data_offsets"], id="shape-list-long"),
    pytest.param(entry(LN, data_offsets=[0, 128]), [WEIGHTS, "embeddings.LayerNorm"],
                 id="overlapping-tensors"),
    pytest.param(header(lambda h: h | {LN: 5}), [WEIGHTS, LN, "a number"], id="entry-number"),
    pytest.param(header(lambda h: h | {"__metadata__": {"format": 1}}), [WEIGHTS, "__metadata__"],
                 id="metadata-number"),
    pytest.param(weights(lambda w: w.pop(DENSE)), [WEIGHTS, "missing", DENSE], id="missing-tensor"),
    # 5. tokenizer.json that is empty, binary, of the wrong shape, or of another model
    pytest.param(write("tokenizer.json", b""), ["tokenizer.json", "empty"], id="tokenizer-empty"),
    pytest.param(write("tokenizer.json", bytes(range(256)) * 4), ["tokenizer.json", "UTF-8"],
                 id="tokenizer-binary"),
    pytest.param(write("tokenizer.json", []), ["tokenizer.json", "not a usable"], id="tokenizer-list"),
    pytest.param(write("tokenizer.json", {}), ["tokenizer.json", "not a usable"], id="tokenizer-object"),
    pytest.param(write("tokenizer.json", b"\x80\x04\x95 a pickle"), ["tokenizer.json", "not a usable"],
                 id="tokenizer-pickle"),
]


@pytest.fixture
def built(monkeypatch):
    """Counts the encoders built while loading: a hostile directory must fail before any."""
    count = []

    class Spy(loading.BertEncoder):
        def __init__(self, *a, **k):
            count.append(1)
            super().__init__(*a, **k)

    monkeypatch.setattr(loading, "BertEncoder", Spy)
    return count


@pytest.mark.parametrize("breaks, names", HOSTILE)
def test_hostile_directory_fails_with_one_clear_line(tmp_path, built, breaks, names):
    d = tiny_checkpoint(tmp_path / "m")
    breaks(d)
    start = time.perf_counter()
    with pytest.raises(ModelLoadError) as e:
        load(d)
    message = str(e.value)
    assert "\n" not in message and len(message) < 500, message
    for name in names:
        assert name in message, f"{name!r} not in: {message}"
    assert not built, "an encoder was built before the directory was found broken"
    assert time.perf_counter() - start < 2


def test_absurd_layer_count_costs_no_memory(tmp_path):
    """It cost 67 s and 5.8 GB for 10**6 layers: a list of every expected tensor was built
    before the checkpoint was looked at."""
    d = tiny_checkpoint(tmp_path / "m")
    config(num_hidden_layers=10**5)(d)
    tracemalloc.start()
    try:
        with pytest.raises(ModelLoadError, match="num_hidden_layers is 100000, but .* holds 2 layer"):
            load(d)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 10 * 2**20, f"{peak / 2**20:.0f} MiB"


def test_header_with_a_far_layer_index_builds_no_list(tmp_path):
    """One fake 'encoder.layer.999999999' tensor does not make a billion layers plausible."""
    d = tiny_checkpoint(tmp_path / "m")
    weights(lambda w: w.update({"encoder.layer.999999999.x": torch.zeros(1)}))(d)
    config(num_hidden_layers=10**9)(d)
    with pytest.raises(ModelLoadError, match="num_hidden_layers is 1000000000"):
        load(d)


def test_more_layers_than_any_bert_are_refused(tmp_path):
    """Even when the header does declare them (tiny fake layers)."""
    d = tiny_checkpoint(tmp_path / "m")
    weights(lambda w: w.update({f"encoder.layer.{i}.x": torch.zeros(1) for i in range(5000)}))(d)
    config(num_hidden_layers=5000)(d)
    with pytest.raises(ModelLoadError, match=r"config\.json: num_hidden_layers is 5000, more than the 1024"):
        load(d)


def test_fp16_overflow_is_refused_naming_the_tensor(tmp_path):
    d = tiny_checkpoint(tmp_path / "m")
    set_value(DENSE, 1e6)(d)
    assert load(d).encoder.layers[1].output.weight.isfinite().all()     # fine in float32
    with pytest.raises(ModelLoadError, match=rf"{WEIGHTS}: tensor {DENSE} .* inf .*dtype=torch\.float32"):
        load(d, dtype=torch.float16)


def test_tokenizer_ids_beyond_the_vocabulary(tmp_path):
    d = tiny_checkpoint(tmp_path / "m", vocab_size=1000)     # MiniLM's tokenizer has 30522 ids
    with pytest.raises(ModelLoadError,
                       match=r"tokenizer\.json has token ids up to 30521 .*vocab_size is 1000"):
        load(d)


def test_another_models_smaller_tokenizer_is_refused(tmp_path):
    """MiniLM's 30,522 tokens under GPT-2's vocab_size all fit, but cover 61% of it: another
    model's tokenizer; a checkpoint's few padded rows (Phi-2's 98%) still load."""
    d = tiny_checkpoint(tmp_path / "m", vocab_size=50257)
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json has 30,522 tokens but config\.json's "
                                             r"vocab_size is 50,257 \(61%.*belongs to another"):
        load(d)
    assert load(tiny_checkpoint(tmp_path / "padded", vocab_size=31104)).config.vocab_size == 31104


def test_a_bert_tokenizer_without_its_markers_is_refused(tmp_path):
    """Without its post_processor the tokenizer writes no [CLS]/[SEP]: BERT would read a text
    as it was never trained to, and every head's weights would be wrong, silently."""
    d = tiny_checkpoint(tmp_path / "m")
    tok = json.loads((d / "tokenizer.json").read_text())
    tok["post_processor"] = None
    (d / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ModelLoadError, match=re.escape(
            "writes no special token at both ends of a text (\"hello world\" is ['hello', "
            "'world']): a BERT encoder reads [CLS] ... [SEP]")):
        load(d)


def test_vocab_txt_alone_is_not_read(tmp_path):
    d = tiny_checkpoint(tmp_path / "m")
    (d / "tokenizer.json").unlink()
    (d / "vocab.txt").write_text("[PAD]\n[UNK]\n")
    with pytest.raises(ModelLoadError, match="has no tokenizer.json: only tokenizer.json is read"):
        load(d)


@pytest.mark.parametrize("dtype", [torch.int64, "float32", None, torch.float8_e4m3fn])
def test_dtype_must_be_a_float_dtype(tmp_path, dtype):
    with pytest.raises(TypeError, match=r"dtype must be torch.float16, torch.bfloat16, "
                                        r"torch.float32 or torch.float64, got"):
        load(tmp_path, dtype=dtype)


def test_device_must_be_a_device(tmp_path):
    with pytest.raises(ValueError, match="device must be a torch.device or a name such as 'cpu'"):
        load(tmp_path, device="gpu")


def test_the_meta_device_is_refused_before_any_file_is_read(tmp_path):
    """A model on "meta" has no values: its first text would fail deep inside torch."""
    with pytest.raises(ValueError, match=r"device 'meta' holds shapes, not values: .* pass "
                                         r"device='cpu'"):
        load(tmp_path / "nothing here", device="meta")


def test_a_device_this_machine_lacks_is_refused_before_reading(tmp_path, monkeypatch):
    d = tiny_checkpoint(tmp_path / "m")
    monkeypatch.setattr(loading, "read_header", lambda *a: pytest.fail("a file was read"))
    with pytest.raises(ValueError, match=r"device 'cuda:99' cannot be used here \(.+\): pass "
                                         r"device='cpu'"):
        load(d, device="cuda:99")


def test_valid_side_files_and_config_values_still_load(tmp_path):
    """What the checks accept: null pad_token_id, integer eps, [CLS] pooling, no Normalize,
    a null max_seq_length, float16 weights."""
    d = tiny_checkpoint(tmp_path / "m")
    config(pad_token_id=None, layer_norm_eps=1, hidden_dropout_prob=0)(d)
    write(POOL, {"word_embedding_dimension": 32, "pooling_mode_cls_token": True,
                 "pooling_mode_mean_tokens": False, "pooling_mode_max_tokens": False})(d)
    write(MODULES, [{"idx": 0, "type": "sentence_transformers.models.Transformer"},
                    {"idx": 1, "type": "sentence_transformers.models.Pooling"}])(d)
    write(ST, {"max_seq_length": None})(d)
    weights(lambda w: w.update({k: v.half() for k, v in w.items()}))(d)
    m = load(d)
    assert (m.sentence.pooling, m.sentence.normalize, m.sentence.max_seq_length) == ("cls", False, 64)
    assert m.config.layer_norm_eps == 1.0 and m.config.pad_token_id is None
    assert m.embed(["a cat sat"]).isfinite().all()


def test_embedded_model_side_files():
    m = load()
    assert (m.sentence.pooling, m.sentence.normalize, m.sentence.max_seq_length) == ("mean", True, 256)

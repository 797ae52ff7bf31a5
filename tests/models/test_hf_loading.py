"""Loading a ``transformers`` checkpoint (GPT-2, Llama, Mistral, Qwen2, BART) refuses, with
one message naming config.json's field or the tensor, what would otherwise run wrong or
slowly: sizes that are not positive integers, an activation transformers lacks, a norm's
epsilon, a RoPE base or scaling that makes every output NaN, a sliding window no layer can use, a
layer count far beyond the checkpoint's (refused before anything is built), integer weights,
shards named outside the directory, and values float16 cannot hold. What transformers
loads (old GPT-2 checkpoints with their mask buffers) loads here too."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from multihead.models import ModelLoadError, load  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from hf_tiny import hf_checkpoint, refused_cheaply, rewrite_weights  # noqa: E402


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("hf")
    return {kind: hf_checkpoint(root / kind, kind) for kind in ("gpt2", "llama", "mistral")}


def _edited(dirs, kind: str, tmp_path: Path, **config) -> Path:
    """A copy of ``kind``'s checkpoint with ``config`` merged into its config.json."""
    d = Path(shutil.copytree(dirs[kind], tmp_path / kind))
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, **config}))
    return d


@pytest.mark.parametrize("kind,config,words", [
    ("llama", {"num_attention_heads": 0}, "num_attention_heads is 0, but it must be a positive "
                                          "integer"),
    ("llama", {"num_attention_heads": "4"}, "num_attention_heads is '4', but it must be a "
                                            "positive integer"),
    ("llama", {"head_dim": 0}, "head_dim is 0, but it must be a positive integer"),
    ("gpt2", {"n_head": True}, "n_head is True, but it must be a positive integer"),
    ("llama", {"hidden_act": "nope"}, "hidden_act is 'nope', which transformers does not know: "
                                      "use one of gelu"),
    ("llama", {"num_attention_heads": 5}, "hidden size (32) is not a multiple of the number of "
                                          "attention heads (5)"),    # (transformers' 2nd line)
    ("llama", {"rms_norm_eps": -1.0}, "rms_norm_eps is -1.0, but it must be a finite number "
                                      "above 0"),
    ("llama", {"rope_parameters": {"rope_theta": 0.0, "rope_type": "default"}},
     "rope_theta is 0.0, but it must be a finite number above 0"),
    ("gpt2", {"layer_norm_epsilon": 0.0}, "layer_norm_epsilon is 0.0, but it must be a finite number"),
    ("llama", {"rope_parameters": {"rope_theta": 1e4, "rope_type": "linear", "factor": 0.0}},
     "rope_parameters.factor is 0.0, but it must be a finite number above 0"),
    ("llama", {"rope_parameters": {"rope_theta": 1e4, "rope_type": "yarn", "factor": 2.0,
                                   "attention_factor": float("nan")}},
     "rope_parameters.attention_factor is nan, but it must be a finite number above 0"),
    ("llama", {"rope_parameters": {"rope_theta": 1e4, "rope_type": "longrope",     # (d_k 8)
                                   "short_factor": [0.0] * 4, "long_factor": [0.0] * 4,
                                   "original_max_position_embeddings": 16}},
     "give rotary_emb's RoPE frequencies (inv_freq) that are not all finite and above 0"),
    ("mistral", {"sliding_window": 0}, "sliding_window is 0, but it must be a positive integer"),
    ("mistral", {"sliding_window": -3}, "sliding_window is -3, but it must be a positive integer"),
])
def test_a_config_value_that_cannot_run_is_named(dirs, tmp_path, kind, config, words):
    d = _edited(dirs, kind, tmp_path, **config)
    with pytest.raises(ModelLoadError, match=re.escape(words)) as e:
        load(d)
    assert str(d / "config.json") in str(e.value) and "\n" not in str(e.value)


def test_qwen2_sliding_layers_without_a_window_are_refused(dirs, tmp_path):
    d = _edited(dirs, "llama", tmp_path, model_type="qwen2", use_sliding_window=False,
                layer_types=["full_attention", "sliding_attention"])
    with pytest.raises(ModelLoadError, match=re.escape(
            "layer_types makes layers [1] sliding_attention, but there is no sliding_window")):
        load(d)


def test_a_mistral_config_with_layer_types_keeps_its_window(dirs, tmp_path):
    """transformers reads it as Ministral's, which windows the sliding layers."""
    d = _edited(dirs, "mistral", tmp_path, sliding_window=2,
                layer_types=["sliding_attention", "full_attention"])
    model = load(d)
    assert model.windows == {0: 2} and "sliding window in 1 of 2 layers" in model.attention_note
    w = model.attention_weights(torch.tensor([[1, 5, 9, 12, 7, 3]])).weights   # (1, H, S, S)
    assert float(w[0][0, :, -1, :4].abs().max()) == 0            # layer 0: the last 2 only
    assert float(w[1][0, :, -1, :4].sum(-1).min()) > 0            # layer 1: every key


def test_a_window_only_windowed_models_use_is_not_reported(dirs, tmp_path):
    """LlamaModel ignores a sliding_window in its config: every key stays visible."""
    d = _edited(dirs, "llama", tmp_path, sliding_window=3)
    model = load(d)
    assert model.config.window is None and model.windows == {}
    assert "sliding window" not in model.attention_note
    w = model.attention_weights(torch.tensor([[1, 5, 9, 12, 7, 3]])).weights[0]   # (1, H, S, S)
    assert float(w[0, :, -1, :3].sum(-1).min()) > 0         # the last query sees the first keys


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_a_layer_count_far_beyond_the_checkpoint_is_refused_before_building(dirs, tmp_path, kind):
    """Building 10**9 layers on the meta device would take weeks, and Qwen2's config lists
    every layer's kind when it is read; the checkpoint's header says at once that it holds 2."""
    d = _edited(dirs, "llama", tmp_path, model_type=kind, num_hidden_layers=10**9)
    refused_cheaply(lambda: load(d), re.escape("num_hidden_layers is 1000000000, but ")
                    + r".*model\.safetensors holds the tensors of 2 layer\(s\)", 16 * 2**20)


def test_a_stack_with_more_layers_than_its_config_is_refused(tmp_path):
    """BART's encoder has 2 layers and its decoder 1: a second decoder layer in the file is
    one config.json has not, though the encoder has a layer 1."""
    d = hf_checkpoint(tmp_path / "bart", "bart")
    rewrite_weights(d, lambda w: w.update({
        k.replace("decoder.layers.0.", "decoder.layers.1."): t.clone()
        for k, t in list(w.items()) if "decoder.layers.0." in k}))
    with pytest.raises(ModelLoadError, match=r"tensor\(s\) of layers that config\.json's bart "
                                             r"model has not, e\.g\. .*decoder\.layers\.1\."):
        load(d)


@pytest.mark.parametrize("kind, name", [("gpt2", "transformer.h.1.ln_2.bias"),
                                        ("llama", "model.layers.1.post_attention_layernorm.weight"),
                                        ("gpt2", "h.1.ln_2.bias")],
                         ids=["gpt2", "llama", "gpt2 without its prefix"])
def test_a_missing_tensor_is_named_not_counted(dirs, tmp_path, kind, name):
    """One missing tensor was reported as the network needing more values than the
    checkpoint holds (is model_type right? are its sizes?), never naming it (Llama's file
    also holds its lm_head, so there transformers' list of missing tensors names it)."""
    d = _edited(dirs, kind, tmp_path)
    bare = not name.startswith(("transformer.", "model."))
    rewrite_weights(d, lambda w: [w.update({k.split(".", 1)[1] if bare else k: w.pop(k)
                                            for k in list(w) if k.startswith("transformer.")}),
                                  w.pop(name)])
    with pytest.raises(ModelLoadError, match=r"model\.safetensors(:| lacks) 1 (missing )?tensor"
                       r"\(s\) (of|for) config\.json's " + kind) as e:   # (llama: transformers'
        load(d)                                             # list, its lm_head making up the count)
    assert name.split(".", 1)[-1 if kind == "llama" else 0] in str(e.value)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64])
def test_weights_that_are_not_floats_are_refused(dirs, tmp_path, dtype):
    d = _edited(dirs, "llama", tmp_path)
    name = "model.layers.0.self_attn.q_proj.weight"
    rewrite_weights(d, lambda w: w.update({name: w[name].to(dtype)}))
    with pytest.raises(ModelLoadError, match=re.escape(f"tensor {name!r} has dtype ")
                       + r"(I32|BOOL|C64), but weights must be floats"):
        load(d)


def _shard(d: Path, name: str) -> None:
    """Move the checkpoint into one shard called ``name`` (relative to ``d``), with an index."""
    from safetensors.torch import load_file
    w = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").rename(d / Path(name).name)
    index = {"metadata": {}, "weight_map": {n: name for n in w}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))


def test_a_shard_named_with_its_directory_is_checked_as_any(dirs, tmp_path):
    d = _edited(dirs, "llama", tmp_path)
    _shard(d, "./a.safetensors")
    assert len(load(d).attention_weights(torch.tensor([[1, 5, 9]])).weights) == 2
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "intermediate_size": 4_000_000}))
    with pytest.raises(ModelLoadError, match=r"a\.safetensors: tensor 'model\.layers\.0\.mlp\."
                                             r"\w+_proj\.weight' is \((64, 32|32, 64)\) there"):
        load(d)                        # (not 2.9 GB built before transformers' own error)


@pytest.mark.parametrize("name", ["../outside.safetensors", "/tmp/outside.safetensors", "."])
def test_a_shard_outside_the_directory_is_refused(dirs, tmp_path, name):
    d = _edited(dirs, "llama", tmp_path)
    _shard(d, "model-00001-of-00001.safetensors")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"] = {n: name for n in index["weight_map"]}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelLoadError, match=re.escape(f"its weight_map names the shard {name!r}, "
                                                       f"outside the model's directory")):
        load(d)


def test_old_gpt2_mask_buffers_of_existing_layers_load(dirs, tmp_path):
    """transformers 3.x-4.2x saved each layer's causal mask (attn.bias, attn.masked_bias):
    transformers skips them, and so do we; a layer the config has not is still refused."""
    d = _edited(dirs, "gpt2", tmp_path)
    ids = torch.tensor([[1, 5, 9]])
    want = load(d).attention_weights(ids).weights

    def old_buffers(w, layers):
        for i in layers:
            w[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
            w[f"transformer.h.{i}.attn.bias"] = torch.ones(1, 1, 64, 64).tril()

    rewrite_weights(d, lambda w: old_buffers(w, (0, 1)))
    got = load(d).attention_weights(ids).weights
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    rewrite_weights(d, lambda w: w.update({"transformer.h.0.attn.scale": torch.ones(1)}))
    with pytest.raises(ModelLoadError, match=r"1 tensor\(s\) that config\.json's gpt2 model's "
                                             r"layers have not, e\.g\. .*h\.0\.attn\.scale.*is "
                                             r"model_type right"):
        load(d)                          # (a tensor of a layer it has, not an old buffer)
    rewrite_weights(d, lambda w: old_buffers(w, (2,)))
    with pytest.raises(ModelLoadError, match=r"\d tensor\(s\) of layers that config\.json's gpt2 "
                                             r"model has not, e\.g\. .*h\.2\.attn\.(masked_)?bias"):
        load(d)


def test_values_float16_cannot_hold_are_named_as_such(dirs, tmp_path):
    d = _edited(dirs, "llama", tmp_path)
    rewrite_weights(d, lambda w: w["model.norm.weight"].__setitem__(0, 1e5))      # > 65504
    assert load(d).network.norm.weight[0] == 1e5                       # fine in float32
    with pytest.raises(ModelLoadError, match=re.escape(
            "tensor model.norm.weight holds 1 non-finite value(s), e.g. inf at index (0,): "
            "torch.float16 cannot hold the checkpoint's values (F32 there): load with "
            "dtype=torch.float32")):
        load(d, dtype=torch.float16)


def test_a_decoder_loaded_from_dot_is_named_after_its_folder(dirs, tmp_path, monkeypatch):
    d = _edited(dirs, "gpt2", tmp_path)
    monkeypatch.chdir(d)
    assert load(".").name == "gpt2"

"""`multihead params`: the formula equals a real module's parameter count for many
configurations, the presets reproduce seed 003's table, and bad input gets one-line errors."""

from __future__ import annotations

import json
import random

import pytest

import multihead as mh
from multihead.analysis.params import (AttentionShape, PRESETS, formula_params, module_params,
                                       preset, report)
from multihead.cli.main import main

# seed 003, "Typical Configurations": model, hidden dim H, heads h, per-head d_k, layers
SEED_003 = [("Transformer (base)", 512, 8, 64, 6), ("GPT-2 (Small)", 768, 12, 64, 12),
            ("GPT-2 (Medium)", 1024, 16, 64, 24), ("GPT-3 (175B)", 12288, 96, 128, 96),
            ("LLaMA-7B", 4096, 32, 128, 32), ("LLaMA-65B", 8192, 64, 128, 80)]


def test_formula_equals_real_module_for_random_configs():
    rng = random.Random(0)
    for _ in range(200):
        hkv = rng.choice([1, 2, 3, 4])
        h = hkv * rng.randint(1, 6)
        dk = rng.randint(1, 24)
        d = rng.randint(1, 96)
        s = AttentionShape(d, h, kv_heads=hkv, head_dim=dk, bias=rng.random() < 0.5)
        real = mh.MultiHeadAttention(d, h, num_kv_heads=hkv, head_dim=dk, bias=s.bias)
        assert formula_params(s) == sum(p.numel() for p in real.parameters()) == module_params(s)


def test_presets_reproduce_seed_table_and_four_d_squared():
    rows = {s.name: s for s in PRESETS.values()}
    for name, d, h, dk, layers in SEED_003:
        s = rows[name]
        assert (s.d_model, s.heads, s.dk, s.layers) == (d, h, dk, layers)
        assert d == h * dk
        weights = formula_params(AttentionShape(d, h))  - 4 * d   # biases removed
        assert weights == 4 * d * d                               # 4H², independent of h
    llama2 = preset("LLAMA2-70B")
    assert (llama2.d_model, llama2.heads, llama2.hkv, llama2.dk) == (8192, 64, 8, 128)


def test_memory_and_flops_numbers():
    r = report(preset("llama2-70b"), seq=4096, batch=2, dtype="bf16")
    assert r["kv_cache_bytes_per_token"] == 2 * 8 * 128 * 2 * 80           # K and V, 80 layers
    assert r["kv_cache_bytes_batch"] == r["kv_cache_bytes_per_token"] * 4096 * 2
    assert r["naive_scores_bytes_per_layer_per_sequence"] == 64 * 4096 ** 2 * 2
    mha = report(preset("llama2-70b").with_kv_heads(64), seq=4096)
    assert mha["kv_cache_bytes_per_token"] == 8 * r["kv_cache_bytes_per_token"]
    small = report(AttentionShape(8, 2, bias=False), seq=4, dtype="fp32", causal=False)
    assert small["flops_per_sequence"] == 2 * 4 * 8 * 8 * 4 + 4 * 2 * 4 * 4 * 4


def test_cli_json_and_table(capsys):
    assert main(["params", "--preset", "gpt2-small", "--seq", "1024", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["params_per_layer"] == 4 * 768 ** 2 + 4 * 768 and d["params_match_module"]
    assert main(["params", "--d-model", "512", "--heads", "8", "--kv-heads", "2", "--no-bias"]) == 0
    assert "GQA-2" in capsys.readouterr().out
    assert main(["params", "--table"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name, *_ in SEED_003) and "MQA" in out and "0.125x" in out


def test_a_changed_preset_says_so(capsys):
    assert main(["params", "--preset", "llama2-70b", "--d-model", "4096", "--layers", "2",
                 "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["config"]["name"] == "LLaMA-2-70B (changed: d_model=4096, layers=2)"
    assert d["config"]["source"].endswith("changed here (d_model=4096, layers=2)")
    assert main(["params", "--preset", "llama2-70b", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["name"] == "LLaMA-2-70B"
    assert main(["params", "--preset", "llama2-70b", "--d-model", "8192", "--no-bias",
                 "--json"]) == 0                        # its own values: nothing changed
    assert json.loads(capsys.readouterr().out)["config"]["name"] == "LLaMA-2-70B"
    for argv, want in ((["--heads", "24", "--kv-heads", "12"], dict(heads=24, kv_heads=12)),
                       (["--d-model", "1536", "--head-dim", "64"], dict(d_model=1536, head_dim=64))):
        assert main(["params", "--preset", "gpt2-small", *argv, "--json"]) == 0   # 12 heads of 64
        config = json.loads(capsys.readouterr().out)["config"]
        assert {k: config[k] for k in want} == want        # every size given, changed or not


def test_the_table_has_one_row_per_kind_of_kv_heads(capsys):
    assert main(["params", "--table", "--d-model", "64", "--heads", "1", "--json"]) == 0
    kinds = [r["config"]["kind"] for r in json.loads(capsys.readouterr().out)["kv_variants"]]
    assert kinds == ["MHA"]
    assert main(["params", "--table", "--d-model", "512", "--heads", "16", "--kv-heads", "4",
                 "--json"]) == 0
    kv = [r["config"]["kv_heads"] for r in json.loads(capsys.readouterr().out)["kv_variants"]]
    assert kv == [16, 8, 4, 1]                             # (most K/V heads first)
    for heads, kinds in ((8, "MHA, GQA-4, MQA"), (12, "MHA, GQA-6, MQA"), (7, "MHA, MQA")):
        argv = ["params", "--table", "--d-model", str(64 * heads), "--heads", str(heads)]
        assert main([*argv, "--json"]) == 0                  # (BERT-base's 12 had no GQA row)
        out = json.loads(capsys.readouterr().out)["kv_variants"]
        assert ", ".join(r["config"]["kind"] for r in out) == kinds
        assert main(argv) == 0
        named = kinds.replace("-4", "").replace("-6", "").rsplit(", ", 1)
        assert f"the KV cache as {' and '.join(named)} (n=" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--preset", "gpt5"], "unknown preset 'gpt5': choose one of transformer-base"),
    (["--d-model", "770", "--heads", "12"], "--d-model (770) must be divisible by --heads (12) "
                                            "when --head-dim is not given: try --heads in"),
    (["--d-model", "-4", "--heads", "2"],
     "argument --d-model: -4 is out of range: give an integer from 1 to 1048576"),
    (["--d-model", "512", "--heads", "8", "--kv-heads", "3"], "multiple of --kv-heads (3)"),
    (["--d-model", "512", "--heads", "7", "--kv-heads", "4"],      # (suggestions that fit h_kv)
     "try --heads in [4, 8, 16, 32, 64, 128, 256, 512], or pass --head-dim"),
    (["--d-model", "512", "--heads", "7", "--kv-heads", "3"],
     "no multiple of --kv-heads (3) divides it, so pass --head-dim"),
    (["--d-model", "512"], "give --preset NAME, or --d-model and --heads"),
    (["--table", "--heads", "16"], "give --preset NAME, or --d-model and --heads\n"),  # (no
    #                                                        "see --table": it was given)
    (["--heads", "16"], "give --preset NAME, or --d-model and --heads (see --table for presets)"),
    (["--preset", "gpt2-small", "--d-model", "512"],            # 12 heads: the preset's, not given
     "--d-model (512) must be divisible by --heads (12, the gpt2-small preset's) when "
     "--head-dim is not given: try --heads in [1, 2, 4, 8,"),
    (["--preset", "gpt2-small", "--kv-heads", "5"],
     "--heads (12, the gpt2-small preset's) must be a multiple of --kv-heads (5): try"),
    (["--table", "--layers", "4"], "give --preset NAME, or --d-model and --heads"),
    (["--table", "--no-bias"], "--no-bias is not enough to describe a configuration: give "
                               "--preset NAME, or --d-model and --heads"),
    (["--preset", "gpt2-small", "--dtype", "int3"], "argument --dtype: invalid choice: 'int3' "
                                                    "(choose from 'fp32', 'float32', 'bf16'"),
    (["--preset", "gpt2-small", "--seq", "0"], "argument --seq: 0 is out of range"),
])
def test_bad_input(argv, message, capsys):
    assert main(["params", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_library_arguments_are_named_without_cli_spelling_and_numpy_sizes_work():
    np = pytest.importorskip("numpy")
    from multihead.analysis.params import preset, report
    assert AttentionShape(np.int64(512), np.int32(8)) == AttentionShape(512, 8)
    with pytest.raises(ValueError, match=r"^seq must be a positive int, got 0"):
        report(preset("gpt2-small"), seq=0)
    with pytest.raises(TypeError, match=r"preset name must be a str, one of transformer-base"):
        preset(None)

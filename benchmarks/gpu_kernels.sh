#!/usr/bin/env bash
# The streams' kernels on one CUDA GPU, in one command of about 8 minutes: what a CPU machine cannot measure.
#
#   bash benchmarks/gpu_kernels.sh [OUT]       # OUT: where the logs and JSON go (default runs/gpu_kernels)
#
# 1. the Triton kernel tests, compiled for this card (on a CPU they run in Triton's interpreter)
# 2. one connection, forward and backward, with fp32 and with bf16 streams, at the public row's shapes
#    (32k tokens, width 4096, n 4; benchmarks/bench_connection.py)
# 3. the trainer's baseline and mHC (triton) steps at width 2048, depth 8, bf16, compiled, without and with activation
#    checkpointing (benchmarks/bench_step.py): what the torch.library operators and the checkpointing rule buy
# Each part has its own time limit, so a hang in one leaves the others their time; the exit status is the number of
# parts that failed. docs/benchmarks.md says where each figure goes.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
PY=.venv/bin/python
[[ -x $PY ]] || PY=python
OUT=${1:-runs/gpu_kernels}
mkdir -p "$OUT"
if ! "$PY" -c 'import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)'; then
    echo "gpu_kernels.sh: no CUDA GPU visible: nothing was measured; run it on the GPU node" >&2
    exit 1
fi
failed=0
part() {   # part NAME SECONDS COMMAND...: one line of PASS/FAIL, the output in OUT/NAME.log
    local name=$1 limit=$2
    shift 2
    if timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; then
        echo "PASS  $name"
    else
        echo "FAIL  $name (exit $?, $OUT/$name.log)"
        failed=$((failed + 1))
    fi
}
part kernel_tests 180 "$PY" -m pytest -q -x tests/kernels/test_triton_ops.py tests/kernels/test_paths.py tests/kernels/test_stream_dtype.py \
    tests/kernels/test_triton_library.py
for dtype in fp32 bf16; do
    part "connection_$dtype" 90 "$PY" benchmarks/bench_connection.py --stream-dtype "$dtype" \
        --json "$OUT/connection_$dtype.json"
done
for checkpointing in "" --activation-checkpointing; do
    part "step${checkpointing:+_checkpointed}" 110 "$PY" benchmarks/bench_step.py --device cuda --dtype bf16 \
        --width 2048 --depth 8 --seq 1024 --micro-batch 8 --tokenizer gpt2 --variants baseline,mhc --compile \
        --rounds 3 --no-probe $checkpointing     # --kernels auto: triton on CUDA once its self-check passes
done
tail -n 20 "$OUT"/connection_*.log "$OUT"/step*.log
exit "$failed"

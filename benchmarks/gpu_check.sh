#!/usr/bin/env bash
# The GPU path in one run of about 8 minutes on one H100/H200: what a CPU machine cannot check.
#
#   bash benchmarks/gpu_check.sh [OUT_DIR]     # logs in OUT_DIR (default gpu_check/); PY=python3 by default
#
# Run folders and checkpoints (GBs) go to $RUNS (default /tmp/gpu_check_runs), not OUT_DIR.
#
# 1 env      torch, CUDA, the card, bf16, flash-attn or SDPA
# 2 memory   the --estimate plan's allocated peak against the measured one, mHC at depths 8/16/32/48
# 3 step     bf16 step time, tokens/s and MFU of baseline/HC/mHC at width 2048, depth 8, seq 1024, eager
# 4 compile  the same with torch.compile per block
# 5 trainer  a real run: GPT-2 BPE on the bundled sample, --micro-batch-size auto confirmed on the card,
#            one loader process, bf16, metrics (mem_peak_gb, mfu, data_wait_share), a checkpoint
# 6 fsdp     the same trainer under torchrun --parallel fsdp (one process): DCP checkpoint, resume
#
# Every part runs under its own time limit and the next one runs whatever happened; each writes
# OUT_DIR/NAME.log and the summary goes to OUT_DIR/summary.txt. Results are copied into docs/benchmarks.md
# by hand with the machine and the date.
set -u
OUT_DIR=${1:-gpu_check}
PY=${PY:-python3}
mkdir -p "$OUT_DIR"
RUNS=${RUNS:-/tmp/gpu_check_runs}
SUMMARY="$OUT_DIR/summary.txt"
: >"$SUMMARY"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 WANDB_MODE=disabled
export HF_HOME="$RUNS/.hf_home"

part() {     # part NAME SECONDS COMMAND...: run, keep its log, note its exit code and duration
    local name=$1 limit=$2 started rc
    shift 2
    started=$(date +%s)
    timeout "$limit" "$@" >"$OUT_DIR/$name.log" 2>&1
    rc=$?
    echo "$name: exit $rc after $(($(date +%s) - started)) s (limit $limit s)" | tee -a "$SUMMARY"
    tail -n 12 "$OUT_DIR/$name.log" | sed 's/^/    /' | tee -a "$SUMMARY"
}

part env 60 "$PY" -c '
import importlib.util, torch, torch.nn.functional as F
print("torch", torch.__version__, "cuda", torch.version.cuda, "device", torch.cuda.get_device_name(),
      f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.1f} GiB", "bf16", torch.cuda.is_bf16_supported())
print("flash_attn installed:", importlib.util.find_spec("flash_attn") is not None)
for name in ("datasets", "tiktoken", "tqdm", "numpy"):
    print(name, "installed:", importlib.util.find_spec(name) is not None)
q = torch.randn(2, 16, 1024, 128, device="cuda", dtype=torch.bfloat16)
from torch.nn.attention import SDPBackend, sdpa_kernel
with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
    F.scaled_dot_product_attention(q, q, q, is_causal=True)
print("SDPA flash backend: ran")
'
part memory 150 "$PY" benchmarks/bench_memory.py --depths 8,16,32,48 --residual mhc --micro-batch 4 \
    --json "$OUT_DIR/memory.json"
STEP=(benchmarks/bench_step.py --device cuda --dtype bf16 --width 2048 --depth 8 --seq 1024 --micro-batch 8
      --tokenizer gpt2 --rounds 3 --steps 3)
part step 120 "$PY" "${STEP[@]}"
part compile 180 "$PY" "${STEP[@]}" --compile --warmup 2
TRAIN=(train_c4.py --data sample --tokenizer gpt2 --residual mhc --depth 8 --batch-size 32 --seq-len 1024
       --steps 30 --eval-every 30 --eval-batches 2 --metrics-every 10 --ckpt-every 15 --wandb disabled)
part trainer 150 "$PY" "${TRAIN[@]}" --micro-batch-size auto --data-workers 1 --out "$RUNS/trainer"
part fsdp 150 bash -c "$PY -m torch.distributed.run --standalone --nproc_per_node=1 ${TRAIN[*]} --parallel fsdp \
    --micro-batch-size 8 --steps 15 --out $RUNS/fsdp && $PY -m torch.distributed.run --standalone \
    --nproc_per_node=1 ${TRAIN[*]} --parallel fsdp --micro-batch-size 8 --out $RUNS/fsdp"
"$PY" - "$RUNS" <<'EOF' | tee -a "$SUMMARY"
import json, sys
from pathlib import Path
for run in sorted(Path(sys.argv[1]).glob("*/mhc_d8_s42")):
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in lines if "tokens_per_s" in r][2:]          # past compile and warm-up
    status = json.loads((run / "status.json").read_text())
    print(f"{run.parent.name}: {status['state']} at step {status['step']}; "
          + (f"median tokens/s {sorted(r['tokens_per_s'] for r in steps)[len(steps) // 2]:,.0f}, "
             f"mfu {max(r['mfu'] or 0 for r in steps):.1%}, mem_peak_gb {max(r['mem_peak_gb'] or 0 for r in steps):.1f}, "
             f"data_wait_share {max(r['data_wait_share'] for r in steps):.3f}" if steps else "no timed steps"))
EOF

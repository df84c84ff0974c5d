#!/usr/bin/env bash
# run_experiments.sh: fans the method x depth x seed matrix over the GPUs of one node.
#
#   bash run_experiments.sh [--full|--quick|--stress|--demo] [options] [-- extra train_c4.py flags]
#   bash run_experiments.sh --help          (all options, exit statuses, files written)
#
# One job per run `{method}_d{depth}_s{seed}`, each on its own slot of --gpus-per-run GPUs, started
# from a queue as slots free up (launches at least --stagger seconds apart). Re-running the same
# command continues the matrix: completed and diverged runs are skipped, the others resume from
# their newest checkpoint (the trainer's `--resume auto`). Decisions go to {out}/matrix.log; each
# job's output is appended to {out}/{run}/train.log.
#
# Environment, to inject stand-ins (tests) or adapt to an unusual node:
#   RUN_EXPERIMENTS_TRAINER       trainer command, split on whitespace; the launcher appends the run's
#                                 flags. Default: "$PY train_c4.py", or with --gpus-per-run K > 1
#                                 "$PY -m torch.distributed.run --standalone --nproc_per_node=K train_c4.py".
#                                 An override is used as-is for every K (it must start the ranks itself).
#   RUN_EXPERIMENTS_PROBE         GPU health probe, split on whitespace; gets the GPU index as its last
#                                 argument; exit 0 = healthy. Default: a CUDA allocation, matmul and a
#                                 check against the CPU result, with CUDA_VISIBLE_DEVICES=index, under `timeout 60`.
#   RUN_EXPERIMENTS_NVIDIA_SMI    GPU discovery command (default nvidia-smi); `false` simulates no GPU.
#   RUN_EXPERIMENTS_PYTHON        python for the helpers and the default trainer
#                                 (default .venv/bin/python next to this script, else python3).
#   RUN_EXPERIMENTS_REPORT        report script run as `$PY SCRIPT OUT` (default report.py next to this script).
#   RUN_EXPERIMENTS_POLL          seconds between polls of the running jobs (default 1).
#   RUN_EXPERIMENTS_DATA_BACKOFF  seconds before the first retry of a job whose data was unreachable
#                                 (exit 6); doubles on each further retry (default 300).
#   RUN_EXPERIMENTS_MAX_REQUEUES  most requeues of one job after exit 75 or a device error (default 10).
#   RUN_EXPERIMENTS_STOP_TIMEOUT  seconds jobs get to save a checkpoint after Ctrl-C/SIGTERM before
#                                 they are killed (default 600; a second Ctrl-C kills at once).
#   RUN_EXPERIMENTS_CALIBRATE_STEPS  steps of each calibration run of --calibrate (default 10, at least 4);
#                                 the first third is warm-up (compilation, allocator) and not timed.
#
# Kept in bash for process control; JSON is read by a few lines of Python (json_get, scan_runs).

set -uo pipefail   # no -e: a failing job is an event the queue handles, not a reason to stop

if ((BASH_VERSINFO[0] < 4 || (BASH_VERSINFO[0] == 4 && BASH_VERSINFO[1] < 4))); then
    echo "run_experiments.sh needs bash >= 4.4 (this is $BASH_VERSION)" >&2
    exit 2
fi

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PROG="run_experiments.sh"

# Exit statuses of this launcher.
EXIT_OK=0; EXIT_FAILED=1; EXIT_USAGE=2; EXIT_SIGINT=130; EXIT_SIGTERM=143

# ---------------------------------------------------------------------------------------------
# Usage and command line
# ---------------------------------------------------------------------------------------------
usage() {
    cat <<EOF
Usage: bash $PROG [--full|--quick|--stress|--demo] [options] [-- extra train_c4.py flags]

Matrix (default --full):
  --full               baseline,hc,mhc x depths 32,48 x seeds 42,123,456 (18 runs, trainer's default steps)
  --quick              hc,mhc x depths 32,48 x seed 42 at 10000 steps (4 runs)
  --stress             the stress arm: hc,mhc x depths 32,48,64 x seed 42 with --preset stress (lr 3e-4,
                       3000 steps); its runs are named {method}_d{depth}_s{seed}_stress, so it shares an
                       --out folder with the main matrix and the report keeps the two arms apart
  --demo               baseline,hc,mhc with --preset demo (bundled corpus, CPU minutes), depth 4, seed 42,
                       then the results table
  --methods LIST       override the methods (from baseline,hc,mhc), e.g. hc,mhc
  --depths LIST        override the depths, e.g. 32,48
  --seeds LIST         override the seeds, e.g. 42,123
  --steps N            pass --steps N to every run
  --vary-data-seed     pass --data-seed SEED with each run's seed: seeds then vary the data order as well as
                       the initialisation (default: one data order, the trainer's --data-seed, for every seed)

Placement:
  --gpus LIST          GPU indices to use (default: all that nvidia-smi lists; none found -> one CPU slot)
  --exclude-gpus LIST  GPU indices never to use
  --gpus-per-run K     GPUs per run (default 1); K > 1 runs torchrun with --parallel fsdp
                       (override with: -- --parallel ddp)
  --stagger SEC        at least SEC seconds between two launches (default 15)

Failures:
  --max-retries N      retries of a job that failed for an unknown reason or lost its data source (default 2)

Output and modes:
  --out DIR            run folders, matrix.log (default runs)
  --dry-run            print the plan (every job, slot, micro-batch, global batch, time, command), the wall
                       time of the queue and its cost; run and write nothing. Times come from the FLOP count
                       at 40% of the GPU's bf16 peak unless --calibrate
  --calibrate          with --dry-run: first time a few steps of each distinct method x depth on the slots
                       (RUN_EXPERIMENTS_CALIBRATE_STEPS, in a temporary folder) and estimate from those
  --price-per-gpu-hour USD  for the cost of the dry run's estimate and of the matrix view (default 2.49)
  --summary            print the matrix view and the results table (report.py) from the live files of --out;
                       run nothing else (from any shell, while the matrix runs or after)
  --watch-every SEC    print the matrix view every SEC seconds while jobs run (default 60; 0: never): per GPU
                       the run, step, loss, amax, tokens/s and ETA; done/running/queued/failed, wall ETA, dollars
  -h, --help           this help

Everything after -- goes to every train_c4.py run, e.g. -- --data '/data/c4/*.json.gz' --wandb offline

Re-running the same command continues the matrix: completed and diverged runs are skipped, the
others resume from their newest checkpoint. Failures, by the trainer's exit code: 2 bad arguments
(not retried), 3 diverged (a result), 4 out of memory (one retry at half the micro-batch, same global
batch), 5 device error (the GPU is re-probed; one that fails the probe or fails two different jobs is
quarantined; the job moves to another GPU), 6 data unreachable (retried after a backoff), 75
interrupted (requeued), anything else (retried up to --max-retries).

Files: {out}/matrix.log (every decision, timestamped), {out}/{run}/train.log (the job's output),
{out}/{run}/launcher.json (a micro-batch halved after an out-of-memory exit; kept for later runs
of the matrix; delete it to forget), {out}/.launcher.lock (one launcher per out folder).

Exit status: 0 every job completed or diverged (a divergence is a result); 1 some job failed or could
not run (listed at the end); 2 bad arguments; 130 stopped by Ctrl-C, 143 by SIGTERM (jobs saved a
checkpoint; the same command resumes the matrix).
Environment overrides (RUN_EXPERIMENTS_TRAINER, _PROBE, ...) are listed at the top of this script.
EOF
}

die_usage() {
    echo "$PROG: error: $1" >&2
    echo "Usage: bash $PROG [--full|--quick|--stress|--demo] [--vary-data-seed] [--methods L] [--depths L] [--seeds L] [--steps N] [--gpus L]" >&2
    echo "       [--exclude-gpus L] [--gpus-per-run K] [--stagger S] [--max-retries N] [--out DIR] [--dry-run [--calibrate] [--price-per-gpu-hour USD]] [--summary] [-- flags]" >&2
    echo "Try 'bash $PROG --help' for more." >&2
    exit "$EXIT_USAGE"
}

MODE=""; METHODS=""; DEPTHS=""; SEEDS=""; STEPS=""; GPU_LIST=""; EXCLUDE=""; GPUS_PER_RUN=1
STAGGER=15; MAX_RETRIES=2; OUT="runs"; DRY_RUN=0; SUMMARY_ONLY=0; EXTRA=(); CALIBRATE=0; PRICE=2.49
VARY_DATA_SEED=0; WATCH_EVERY=60

set_mode() {
    [[ -z $MODE || $MODE == "$1" ]] || die_usage "choose one of --full, --quick, --stress, --demo"
    MODE=$1
}

while (($#)); do
    arg=$1
    if [[ $arg == --*=* ]]; then   # --flag=value -> --flag value
        set -- "${arg%%=*}" "${arg#*=}" "${@:2}"
        arg=$1
    fi
    case $arg in
        -h|--help) usage; exit "$EXIT_OK" ;;
        --full|--quick|--stress|--demo) set_mode "${arg#--}"; shift ;;
        --vary-data-seed) VARY_DATA_SEED=1; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        --calibrate) CALIBRATE=1; shift ;;
        --summary) SUMMARY_ONLY=1; shift ;;
        --methods|--depths|--seeds|--steps|--gpus|--exclude-gpus|--gpus-per-run|--stagger|--max-retries|--out|--price-per-gpu-hour|--watch-every)
            (($# >= 2)) || die_usage "$arg needs a value"
            [[ -n $2 ]] || die_usage "$arg must not be empty"   # else --methods '' would mean the full matrix
            case $arg in
                --methods) METHODS=$2 ;;        --depths) DEPTHS=$2 ;;
                --seeds) SEEDS=$2 ;;            --steps) STEPS=$2 ;;
                --gpus) GPU_LIST=$2 ;;          --exclude-gpus) EXCLUDE=$2 ;;
                --gpus-per-run) GPUS_PER_RUN=$2 ;;  --stagger) STAGGER=$2 ;;
                --max-retries) MAX_RETRIES=$2 ;;    --out) OUT=$2 ;;
                --price-per-gpu-hour) PRICE=$2 ;;   --watch-every) WATCH_EVERY=$2 ;;
            esac
            shift 2 ;;
        --) shift; EXTRA=("$@"); break ;;
        *) die_usage "unknown argument '$arg'" ;;
    esac
done

MODE=${MODE:-full}
case $MODE in
    full)  : "${METHODS:=baseline,hc,mhc}" "${DEPTHS:=32,48}" "${SEEDS:=42,123,456}" ;;
    quick) : "${METHODS:=hc,mhc}" "${DEPTHS:=32,48}" "${SEEDS:=42}" "${STEPS:=10000}" ;;
    stress) : "${METHODS:=hc,mhc}" "${DEPTHS:=32,48,64}" "${SEEDS:=42}" ;;
    # The demo preset fixes its own model; --depth 4 (its depth) is passed so the run name is exact.
    demo)  : "${METHODS:=baseline,hc,mhc}" "${DEPTHS:=4}" "${SEEDS:=42}" ;;
esac
# The modes that are a preset of the trainer, and the stress arm's run-name suffix (the trainer's default too)
MODE_PRESET=""; RUN_SUFFIX=""
case $MODE in
    demo) MODE_PRESET=demo ;;
    stress) MODE_PRESET=stress; RUN_SUFFIX=_stress ;;
esac

# Validate a comma list: split_list NAME VALUE REGEX WHAT -> array NAME
split_list() {
    local -n _into=$1
    local item
    IFS=, read -ra _into <<<"$2"
    ((${#_into[@]})) || die_usage "$4 is empty"
    for item in "${_into[@]}"; do
        [[ $item =~ ^($3)$ ]] || die_usage "'$item' is not a valid entry of $4"
    done
}
split_list METHOD_ARR "$METHODS" 'baseline|hc|mhc' "--methods (baseline,hc,mhc)"
split_list DEPTH_ARR "$DEPTHS" '[1-9][0-9]*' "--depths (positive integers)"
split_list SEED_ARR "$SEEDS" '[0-9]+' "--seeds (non-negative integers)"
[[ -z $STEPS || $STEPS =~ ^[1-9][0-9]*$ ]] || die_usage "--steps must be a positive integer, not '$STEPS'"
[[ $GPUS_PER_RUN =~ ^[1-9][0-9]*$ ]] || die_usage "--gpus-per-run must be a positive integer, not '$GPUS_PER_RUN'"
[[ $MAX_RETRIES =~ ^[0-9]+$ ]] || die_usage "--max-retries must be a non-negative integer, not '$MAX_RETRIES'"
# --out must be a folder this user can write in, or one it can create; dry runs are checked too. A probe folder
# is made and removed where it would go: as root, test -w passes on folders where mkdir then fails (/proc).
check_out() {
    local dir=$OUT probe
    while [[ ! -e $dir && $dir != / && $dir != . ]]; do dir=$(dirname -- "$dir"); done
    [[ -d $dir ]] || die_usage "--out $OUT: $dir is a file, not a folder"
    probe=$(mktemp -d "$dir/.run_experiments-probe.XXXXXX" 2>/dev/null) || die_usage "--out $OUT: cannot create a folder in $dir"
    rmdir -- "$probe"
}
((SUMMARY_ONLY)) || check_out
[[ $PRICE =~ ^[0-9]+(\.[0-9]+)?$ ]] || die_usage "--price-per-gpu-hour must be a number of dollars, not '$PRICE'"
[[ $WATCH_EVERY =~ ^[0-9]+$ ]] || die_usage "--watch-every must be whole seconds >= 0, not '$WATCH_EVERY'"
((!CALIBRATE || DRY_RUN)) || die_usage "--calibrate goes with --dry-run (it times the matrix before you start it)"
CALIBRATE_STEPS=${RUN_EXPERIMENTS_CALIBRATE_STEPS:-10}
if [[ ! $CALIBRATE_STEPS =~ ^[0-9]+$ ]] || ((CALIBRATE_STEPS < 4)); then
    die_usage "RUN_EXPERIMENTS_CALIBRATE_STEPS must be an integer >= 4, not '$CALIBRATE_STEPS'"
fi
GPU_ARG=(); EXCLUDE_ARR=()
if [[ -n $GPU_LIST ]]; then
    split_list GPU_ARG "$GPU_LIST" '[0-9]+' "--gpus (GPU indices)"
    mapfile -t GPU_ARG < <(printf '%s\n' "${GPU_ARG[@]}" | awk '!seen[$0]++')   # drop repeats, keep order
fi
[[ -z $EXCLUDE ]] || split_list EXCLUDE_ARR "$EXCLUDE" '[0-9]+' "--exclude-gpus (GPU indices)"

# Times in integer milliseconds, so spacing and deadlines are exact without floating point in bash.
seconds_to_ms() {   # seconds_to_ms VALUE -> MS, or status 1 when VALUE is not seconds >= 0
    [[ $1 =~ ^([0-9]+)(\.([0-9]{1,3}))?$ ]] || return 1
    local frac=${BASH_REMATCH[3]}000
    MS=$((10#${BASH_REMATCH[1]} * 1000 + 10#${frac:0:3}))
}
seconds_to_ms "$STAGGER" || die_usage "--stagger must be seconds >= 0 (at most 3 decimals), not '$STAGGER'"
STAGGER_MS=$MS
if ! seconds_to_ms "${RUN_EXPERIMENTS_POLL:-1}" || ((MS < 10)); then
    die_usage "RUN_EXPERIMENTS_POLL must be seconds >= 0.01, not '${RUN_EXPERIMENTS_POLL:-}'"
fi
POLL_MS=$MS
for name in RUN_EXPERIMENTS_DATA_BACKOFF RUN_EXPERIMENTS_MAX_REQUEUES RUN_EXPERIMENTS_STOP_TIMEOUT; do
    [[ ${!name:-0} =~ ^[0-9]+$ ]] || die_usage "$name must be a non-negative integer, not '${!name}'"
done
DATA_BACKOFF=${RUN_EXPERIMENTS_DATA_BACKOFF:-300}
MAX_REQUEUES=${RUN_EXPERIMENTS_MAX_REQUEUES:-10}
STOP_TIMEOUT=${RUN_EXPERIMENTS_STOP_TIMEOUT:-600}

# The launcher owns these trainer flags: the run's identity and where it lives.
for arg in "${EXTRA[@]}"; do
    case $arg in
        --residual|--residual=*|--depth|--depth=*|--seed|--seed=*|--run-name|--run-name=*|--out|--out=*|--steps|--steps=*)
            die_usage "${arg%%=*} is set by the launcher for each run (use --methods, --depths, --seeds, --steps, --out), not after --" ;;
        --data-seed|--data-seed=*)
            ((!VARY_DATA_SEED)) || die_usage "--vary-data-seed sets --data-seed for each run; do not pass it after --" ;;
        --preset|--preset=*)
            [[ -z $MODE_PRESET ]] || die_usage "--$MODE sets --preset $MODE_PRESET; do not pass --preset after --" ;;
    esac
done

# Value of a flag among the extra trainer flags (last one wins, as in argparse), or empty.
extra_value() {
    local i value=""
    for ((i = 0; i < ${#EXTRA[@]}; i++)); do
        case ${EXTRA[i]} in
            "$1") ((i + 1 < ${#EXTRA[@]})) && value=${EXTRA[i + 1]} ;;
            "$1"=*) value=${EXTRA[i]#*=} ;;
        esac
    done
    printf '%s' "$value"
}

# ---------------------------------------------------------------------------------------------
# Logging and time
# ---------------------------------------------------------------------------------------------
now_ms() {   # sets NOW_MS (bash 5 has EPOCHREALTIME; its decimal point follows the locale)
    if [[ -n ${EPOCHREALTIME:-} ]]; then
        local t=${EPOCHREALTIME//[.,]/}
        NOW_MS=$((10#$t / 1000))
    else
        NOW_MS=$(date +%s%3N)
    fi
}

MATRIX_LOG=""   # set once {out} exists; dry runs and --summary only print
log() {   # log EVENT details...: timestamped, to the terminal and {out}/matrix.log
    local ts line
    now_ms
    printf -v ts '%(%Y-%m-%dT%H:%M:%S)T.%03d%(%z)T' $((NOW_MS / 1000)) $((NOW_MS % 1000)) $((NOW_MS / 1000))
    line="$ts $*"
    printf '%s\n' "$line"
    [[ -z $MATRIX_LOG ]] || printf '%s\n' "$line" >>"$MATRIX_LOG"
}
warn() { echo "$PROG: warning: $*" >&2; [[ -z $MATRIX_LOG ]] || log "WARN $*"; }

# ---------------------------------------------------------------------------------------------
# Set-up checks: python, trainer, data
# ---------------------------------------------------------------------------------------------
if [[ -n ${RUN_EXPERIMENTS_PYTHON:-} ]]; then
    PY=$RUN_EXPERIMENTS_PYTHON
elif [[ -x $ROOT/.venv/bin/python ]]; then
    PY=$ROOT/.venv/bin/python
else
    PY=python3
    echo "$PROG: no .venv found in $ROOT: run 'bash setup.sh' first (using $PY for now)" >&2
    if [[ -z ${RUN_EXPERIMENTS_TRAINER:-} ]] && ((!DRY_RUN && !SUMMARY_ONLY)) \
        && ! "$PY" -c 'import torch' 2>/dev/null; then
        echo "$PROG: error: $PY cannot import torch; run 'bash setup.sh' to create .venv" >&2
        exit "$EXIT_FAILED"
    fi
fi
command -v "$PY" >/dev/null 2>&1 || { echo "$PROG: error: python '$PY' not found; run 'bash setup.sh'" >&2; exit "$EXIT_FAILED"; }

if [[ -n ${RUN_EXPERIMENTS_TRAINER:-} ]]; then
    read -ra TRAINER_BASE <<<"$RUN_EXPERIMENTS_TRAINER"
elif ((GPUS_PER_RUN > 1)); then
    TRAINER_BASE=("$PY" -m torch.distributed.run --standalone "--nproc_per_node=$GPUS_PER_RUN" "$ROOT/train_c4.py")
else
    TRAINER_BASE=("$PY" "$ROOT/train_c4.py")
fi
if [[ -z ${RUN_EXPERIMENTS_TRAINER:-} && ! -f $ROOT/train_c4.py ]] && ((!SUMMARY_ONLY)); then
    if ((DRY_RUN)); then
        warn "$ROOT/train_c4.py not found (the plan is printed anyway)"
    else
        echo "$PROG: error: $ROOT/train_c4.py not found" >&2
        exit "$EXIT_FAILED"
    fi
fi

PRESET=$(extra_value --preset); [[ -z $MODE_PRESET ]] || PRESET=$MODE_PRESET
DATA=$(extra_value --data)
if ((!SUMMARY_ONLY)) && [[ $DATA == c4 || (-z $DATA && ${PRESET:-c4} == c4) ]]; then
    warn "these runs stream C4 (--data c4) from the Hugging Face Hub: this node must reach huggingface.co" \
        "for the whole run, or prefetch shards and pass -- --data '/path/c4/*.json.gz'" \
        "${HF_HUB_OFFLINE:+(HF_HUB_OFFLINE is set: only what is in the HF cache can be read)}"
fi

# ---------------------------------------------------------------------------------------------
# The matrix: jobs in queue order
# ---------------------------------------------------------------------------------------------
# Seed-major (every comparison of seed 42 finishes before seed 123 starts, so a node lost mid-day
# still leaves complete comparisons), then deeper models first (longest jobs first packs the GPUs).
mapfile -t DEPTH_ARR < <(printf '%s\n' "${DEPTH_ARR[@]}" | sort -rn | uniq)
JOBS=()
declare -A J_METHOD J_DEPTH J_SEED J_STATE J_REASON J_ATTEMPTS J_RETRIES J_DATA_RETRIES J_REQUEUES \
    J_OOM_RETRIED J_MICRO J_BATCH J_NOT_BEFORE J_AVOID J_GPUS J_LAUNCH_S
for seed in "${SEED_ARR[@]}"; do
    for depth in "${DEPTH_ARR[@]}"; do
        for method in "${METHOD_ARR[@]}"; do
            run="${method}_d${depth}_s${seed}${RUN_SUFFIX}"
            [[ -n ${J_METHOD[$run]:-} ]] && continue   # a list given twice
            JOBS+=("$run")
            J_METHOD[$run]=$method; J_DEPTH[$run]=$depth; J_SEED[$run]=$seed
            J_STATE[$run]=pending; J_REASON[$run]=""; J_ATTEMPTS[$run]=0; J_RETRIES[$run]=0
            J_DATA_RETRIES[$run]=0; J_REQUEUES[$run]=0; J_OOM_RETRIED[$run]=0; J_MICRO[$run]=""
            J_BATCH[$run]=""; J_NOT_BEFORE[$run]=0; J_AVOID[$run]=" "; J_GPUS[$run]=""
        done
    done
done

# One line per run: name, status.json state, the micro-batch chosen by an earlier OOM retry
# ({run}/launcher.json), status.json step ("-" when unknown).
scan_runs() {
    "$PY" - "$OUT" "${JOBS[@]}" <<'PYEOF'
import json, os, sys
def load(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}
out = sys.argv[1]
for run in sys.argv[2:]:
    status = load(os.path.join(out, run, "status.json"))
    launcher = load(os.path.join(out, run, "launcher.json"))
    fields = [status.get("state"), launcher.get("micro_batch_size"), status.get("step")]
    words = ["-" if v is None or str(v).strip() == "" else str(v).split()[0] for v in fields]
    print(run, *words)
PYEOF
}

# json_get FILE KEY.PATH [NEWER_THAN_EPOCH_S]: prints the value ("" if missing, or if the file was
# last modified before the given time, i.e. is left over from an earlier attempt).
json_get() {
    "$PY" - "$@" <<'PYEOF'
import json, os, sys
path, keys = sys.argv[1], sys.argv[2].split(".")
try:
    if len(sys.argv) > 3 and os.path.getmtime(path) < float(sys.argv[3]):
        raise OSError("stale")
    with open(path) as f:
        value = json.load(f)
    for key in keys:
        value = value[key]
except (OSError, ValueError, KeyError, TypeError):
    value = None
print("" if value is None else value)
PYEOF
}

declare -A PREV_STATE=() PREV_MICRO=() PREV_STEP=()
while read -r run state micro step; do
    PREV_STATE[$run]=$state; PREV_MICRO[$run]=${micro#-}; PREV_STEP[$run]=$step
done < <(scan_runs)
for run in "${JOBS[@]}"; do
    case ${PREV_STATE[$run]:--} in
        completed) J_STATE[$run]=skipped_completed ;;
        diverged) J_STATE[$run]=skipped_diverged ;;
    esac
    # A micro-batch halved after an OOM in an earlier invocation stays halved (delete
    # {out}/{run}/launcher.json to forget it).
    [[ ${PREV_MICRO[$run]:-} =~ ^[0-9]+$ ]] && J_MICRO[$run]=${PREV_MICRO[$run]}
done

# ---------------------------------------------------------------------------------------------
# Trainer command of one job
# ---------------------------------------------------------------------------------------------
build_cmd() {   # build_cmd RUN -> CMD array
    local run=$1
    CMD=("${TRAINER_BASE[@]}" --residual "${J_METHOD[$run]}" --depth "${J_DEPTH[$run]}"
        --seed "${J_SEED[$run]}" --run-name "$run" --out "$OUT")
    [[ -z $STEPS ]] || CMD+=(--steps "$STEPS")
    [[ -z $MODE_PRESET ]] || CMD+=(--preset "$MODE_PRESET")
    ((!VARY_DATA_SEED)) || CMD+=(--data-seed "${J_SEED[$run]}")
    CMD+=(--resume auto)
    # FSDP shards parameters and optimizer state, so a 2.5B model leaves room for activations.
    ((GPUS_PER_RUN == 1)) || CMD+=(--parallel fsdp)
    CMD+=("${EXTRA[@]}")
    # Last, so that they win over the extra flags (argparse keeps the last value).
    [[ -z ${J_MICRO[$run]} ]] || CMD+=(--micro-batch-size "${J_MICRO[$run]}")
    [[ -z ${J_BATCH[$run]} ]] || CMD+=(--batch-size "${J_BATCH[$run]}")
}

# The micro-batch and global batch a job will use, as far as the launcher knows.
DEFAULT_MICRO="trainer default"; DEFAULT_BATCH="trainer default"   # resolved for --dry-run
known_micro() {
    local run=$1 v
    if [[ -n ${J_MICRO[$run]} ]]; then printf '%s' "${J_MICRO[$run]}"; return; fi
    v=$(extra_value --micro-batch-size)
    printf '%s' "${v:-$DEFAULT_MICRO}"
}
known_batch() {
    local run=$1 v
    if [[ -n ${J_BATCH[$run]} ]]; then printf '%s' "${J_BATCH[$run]}"; return; fi
    v=$(extra_value --batch-size)
    printf '%s' "${v:-$DEFAULT_BATCH}"
}

quote_cmd() { local q; printf -v q '%q ' "$@"; printf '%s' "${q% }"; }

# ---------------------------------------------------------------------------------------------
# GPUs: discovery and slots
# ---------------------------------------------------------------------------------------------
GPUS=()
CPU_MODE=0
if ((${#GPU_ARG[@]})); then
    GPUS=("${GPU_ARG[@]}")
else
    read -ra SMI <<<"${RUN_EXPERIMENTS_NVIDIA_SMI:-nvidia-smi}"
    if command -v "${SMI[0]}" >/dev/null 2>&1; then
        mapfile -t GPUS < <("${SMI[@]}" --query-gpu=index --format=csv,noheader 2>/dev/null | tr -dc '0-9\n' | grep .)
    fi
fi
if ((${#EXCLUDE_ARR[@]})); then
    kept=()
    for g in "${GPUS[@]}"; do
        [[ " ${EXCLUDE_ARR[*]} " == *" $g "* ]] || kept+=("$g")
    done
    GPUS=("${kept[@]}")
    ((${#GPUS[@]})) || { echo "$PROG: error: --exclude-gpus leaves no GPU to use" >&2; exit "$EXIT_FAILED"; }
fi
if ((${#GPUS[@]} == 0)); then
    CPU_MODE=1
    GPUS=(cpu)   # one slot; its jobs get CUDA_VISIBLE_DEVICES="" and see no GPU
    if ((GPUS_PER_RUN > 1)); then
        echo "$PROG: warning: no GPU found: --gpus-per-run $GPUS_PER_RUN ignored, one CPU slot" >&2
        GPUS_PER_RUN=1
        [[ -n ${RUN_EXPERIMENTS_TRAINER:-} ]] || TRAINER_BASE=("$PY" "$ROOT/train_c4.py")
    fi
fi
if ((!CPU_MODE && ${#GPUS[@]} < GPUS_PER_RUN)); then
    echo "$PROG: error: --gpus-per-run $GPUS_PER_RUN but only ${#GPUS[@]} GPU(s): ${GPUS[*]}" >&2
    exit "$EXIT_FAILED"
fi
declare -A GPU_STATE=() GPU_FAILED_RUNS=()   # state: free|busy|quarantined; runs that exited 5 on it
for g in "${GPUS[@]}"; do GPU_STATE[$g]=free; GPU_FAILED_RUNS[$g]=" "; done

# ---------------------------------------------------------------------------------------------
# --summary and the end-of-matrix report
# ---------------------------------------------------------------------------------------------
print_report() {
    local script=${RUN_EXPERIMENTS_REPORT:-$ROOT/report.py} rc
    echo
    if [[ ! -f $script ]]; then
        echo "No results table: $script does not exist yet. Raw results: $OUT/*/metrics.jsonl, $OUT/*/status.json"
        return 0
    fi
    echo "Results ($PY $script $OUT):"
    "$PY" "$script" "$OUT"
    rc=$?
    ((rc == 0)) || echo "$PROG: warning: $script exited $rc; the runs themselves are not affected" >&2
    # report.py writes results.md, CSVs and plots to {out}/report unless told otherwise.
    local plots=()
    [[ ! -d $OUT ]] || mapfile -t plots < <(find "$OUT" -maxdepth 2 \( -name '*.png' -o -name '*.pdf' -o -name '*.svg' \) 2>/dev/null | sort)
    if ((${#plots[@]})); then
        echo "Plots (${#plots[@]}):"
        printf '  %s\n' "${plots[@]}"
        [[ ! -f $OUT/report/results.md ]] || echo "Table, verdict and plots together: $OUT/report/results.md"
    else
        echo "No plot files found under $OUT (report.py writes them; see its output above)."
    fi
}

show_matrix() {   # the matrix view (report.py --watch) from matrix.log and the runs' status.json
    "$PY" "$ROOT/report.py" "$OUT" --watch 2>&1 || true
}

if ((SUMMARY_ONLY)); then
    if [[ ! -f $OUT/matrix.log ]] && ! compgen -G "$OUT/*/status.json" >/dev/null; then
        echo "$PROG: error: --summary: no matrix has run in '$OUT' (no matrix.log, no run folder); check --out" >&2
        exit "$EXIT_USAGE"
    fi
    # the matrix as the folder's launcher ran it (matrix.log), not as this command's flags would make it
    show_matrix
    print_report
    exit "$EXIT_OK"
fi

# ---------------------------------------------------------------------------------------------
# --dry-run: the plan, nothing run, nothing written
# ---------------------------------------------------------------------------------------------
slot_label() {   # the GPUs of the i-th slot in the initial layout
    local i=$1 start=$(($1 * GPUS_PER_RUN))
    if ((CPU_MODE)); then printf 'cpu'; return; fi
    local IFS=,
    printf '%s' "${GPUS[*]:start:GPUS_PER_RUN}"
}

# The trainer's own resolution of its flags (preset, then explicit flags) gives the micro-batch and
# global batch a job will use; it also catches a mistyped extra flag before any GPU time is spent.
# Best effort: only for the real trainer, and "trainer default" when it cannot be asked.
trainer_defaults() {   # trainer_defaults TRAINER-ARGS... -> DEFAULT_MICRO DEFAULT_BATCH (status 1: unknown)
    local answer
    answer=$(PYTHONDONTWRITEBYTECODE=1 "$PY" - "$ROOT" "$@" 2>&1 <<'PYEOF'
import contextlib, io, sys
sys.path.insert(0, sys.argv[1])
err = io.StringIO()
try:
    import train_c4
    with contextlib.redirect_stderr(err):
        cfg = train_c4.parse_config(sys.argv[2:])
    print("ok", cfg.micro_batch_size, cfg.batch_size)
except BaseException as error:
    lines = (err.getvalue().strip() or str(error) or repr(error)).splitlines()
    print("error", lines[-1] if lines else repr(error))
PYEOF
)
    case $answer in
        "ok "*) read -r _ DEFAULT_MICRO DEFAULT_BATCH <<<"$answer"
                DEFAULT_MICRO+=" (trainer default)"; DEFAULT_BATCH+=" (trainer default)" ;;
        *) echo "$PROG: warning: train_c4.py rejects these flags: ${answer#error }" >&2; return 1 ;;
    esac
}
real_trainer() { [[ -z ${RUN_EXPERIMENTS_TRAINER:-} && -f $ROOT/train_c4.py ]]; }

# --calibrate: CALIBRATE_STEPS steps of each distinct method x depth into a temporary folder, side by side on
# the slots as in the matrix; the trainer times its own steps (tokens_per_s in metrics.jsonl).
calibrate() {   # calibrate DIR -> DIR/{method}_d{depth}/metrics.jsonl, DIR/{method}_d{depth}.log
    local dir=$1 run key slot i=0 k rc pids=() keys=()
    local -A started=()
    for run in "${JOBS[@]}" ""; do
        if [[ -n $run && ${J_STATE[$run]} != skipped_* ]]; then
            key="${J_METHOD[$run]}_d${J_DEPTH[$run]}"
            [[ -z ${started[$key]:-} ]] || continue
            started[$key]=1
            build_cmd "$run"
            # last, so that they win: a throw-away run, no W&B, evaluation and checkpoint only at its end
            CMD+=(--out "$dir" --run-name "$key" --steps "$CALIBRATE_STEPS" --resume never --wandb disabled
                --eval-every "$CALIBRATE_STEPS" --metrics-every "$CALIBRATE_STEPS" --ckpt-every "$CALIBRATE_STEPS")
            slot=$(slot_label $((i % nslots)))
            [[ $slot != cpu ]] || slot=""
            echo "Calibrating $key on ${slot:+GPU }${slot:-the CPU}: $CALIBRATE_STEPS steps"
            CUDA_VISIBLE_DEVICES=$slot "${CMD[@]}" >"$dir/$key.log" 2>&1 </dev/null &
            pids+=($!); keys+=("$key"); i=$((i + 1))
        fi
        # a wave fills every slot once; the last one may be partial
        if ((${#pids[@]} == nslots)) || [[ -z $run && ${#pids[@]} -gt 0 ]]; then
            for k in "${!pids[@]}"; do
                wait "${pids[k]}"; rc=$?
                ((rc == 0)) || echo "  calibration of ${keys[k]} exited $rc: $(tail -n 2 "$dir/${keys[k]}.log" | tr '\n' ' ')"
            done
            pids=(); keys=()
        fi
    done
}

# Time and cost of the matrix for the dry run, in one Python call: per job the micro-batch the trainer will use
# ('auto' resolved by its memory plan) and the time of its remaining steps; then the wall time of the queue
# (list scheduling, the way the launcher starts jobs) and what the node costs for it.
declare -A PLAN_MICRO=() PLAN_TIME=()
PLAN_SUMMARY=()
plan_matrix() {   # plan_matrix CALIBRATION_DIR_OR_EMPTY GPU_MODEL -> PLAN_MICRO, PLAN_TIME, PLAN_SUMMARY
    local args=() run kind name micro time line
    for run in "${JOBS[@]}"; do
        [[ ${J_STATE[$run]} == skipped_* ]] && continue
        build_cmd "$run"
        args+=(::job "$run" "${PREV_STEP[$run]:--}" "${CMD[@]:${#TRAINER_BASE[@]}}")
    done
    while IFS= read -r line; do
        read -r kind name micro time <<<"$line"
        if [[ $kind == job ]]; then
            PLAN_MICRO[$name]=$micro; PLAN_TIME[$name]=$time
        else
            PLAN_SUMMARY+=("${line#text }")
        fi
    done < <(PYTHONDONTWRITEBYTECODE=1 "$PY" - "$ROOT" "$nslots" "$GPUS_PER_RUN" "$STAGGER" "$PRICE" \
        "$((CPU_MODE ? 0 : ${#GPUS[@]}))" "$2" "$1" "$CALIBRATE_STEPS" "${args[@]}" 2>&1 <<'PYEOF'
import json, statistics, sys, warnings
warnings.simplefilter("ignore")
root, slots, per_run, stagger, price, ngpus, gpu, calibration, steps = sys.argv[1:10]
slots, per_run, stagger, price, ngpus, steps = int(slots), int(per_run), float(stagger), float(price), int(ngpus), int(steps)
warmup = steps // 3                   # not timed: compilation, autotuning, the allocator growing
sys.path.insert(0, root)
import train_c4 as T
jobs = []
for word in sys.argv[10:]:
    jobs.append([]) if word == "::job" else jobs[-1].append(word)


def human(seconds):
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else f"{seconds / 3600:.1f} h"


def measured(key):   # the median tokens/s of the timed steps of the calibration run, or None
    try:
        with open(f"{calibration}/{key}/metrics.jsonl") as f:
            rates = [r["tokens_per_s"] for r in map(json.loads, f) if r.get("tokens_per_s") and r["step"] > warmup]
    except (OSError, ValueError):
        rates = []
    return statistics.median(rates) if rates else None


peak = None if gpu == "cpu" else next((p for k, p in T.GPU_PEAK_BF16_FLOPS.items() if k in gpu), None)
guessed = gpu != "cpu" and peak is None
peak = T.GPU_PEAK_BF16_FLOPS["H100"] if guessed else peak
micros, rates, durations = {}, {}, []
for run, done, *args in jobs:
    try:
        cfg = T.parse_config(args)
    except T.TrainerError as error:
        print(f"text {run}: train_c4.py rejects its flags: {error}")
        continue
    key, micro = f"{cfg.residual}_d{cfg.depth}", cfg.micro_batch_size
    if (key, micro) not in micros:      # auto: resolved as the trainer will, by the memory plan on a GPU
        try:
            micros[key, micro] = (micro if micro != "auto" else T.cpu_auto_micro_batch(cfg, per_run) if gpu == "cpu"
                                  else T.auto_micro_batch(cfg, per_run)[0])
        except T.ConfigError:
            micros[key, micro] = "none-fits"
    if key not in rates:
        rate = measured(key) if calibration else None
        if rate is None and peak:
            numels = T.parameter_numels(cfg)      # the meta model auto_micro_batch already built
            flops = T.flops_per_token(cfg, numels["total"] - numels["wte.weight"] - numels["wpe.weight"])
        rates[key] = (rate, True) if rate else (T.ASSUMED_MFU * peak * per_run / flops if peak else None, False)
    rate = rates[key][0]
    tokens = max(0, cfg.steps - (int(done) if done.isdigit() else 0)) * cfg.batch_size * cfg.seq_len
    durations.append(tokens / rate if rate else None)
    print("job", run, micros[key, micro], human(durations[-1]) if rate else "-")
if calibration:
    print(f"text Times from --calibrate: the median tokens/s of steps {warmup + 1}-{steps} of each configuration, "
          f"measured just now on {'the CPU' if gpu == 'cpu' else gpu or 'the GPUs'} (start-up, compilation and warm-up "
          "excluded):")
    for key, (rate, calibrated) in rates.items():
        print(f"text   {key}: " + (f"{rate:,.0f} tokens/s" if calibrated else "no timed step (see above)"))
if peak and not all(calibrated for _, calibrated in rates.values()):
    print(f"text Times from the FLOP count: {T.ASSUMED_MFU:.0%} MFU of the {peak / 1e12:.0f} TFLOP/s dense bf16 peak of "
          + ("an H100, assumed (nvidia-smi names no GPU)" if guessed else gpu) + f", {per_run} GPU(s) per run. HC and "
          "mHC also mix their n streams, work the FLOP count leaves out: expect them slower (--calibrate measures)")
if None in durations:
    print("text Wall time: unknown without --calibrate (no GPU peak to assume for jobs on the CPU)")
    sys.exit()
wall, total = T.queue_schedule(durations, slots, stagger), sum(durations)
print(f"text Wall time: {len(durations)} job(s) on {slots} slot(s), each started in queue order on the first free "
      f"slot, launches {stagger:g} s apart: {human(wall)} (the jobs add up to {human(total)}; evaluation, probes, "
      "checkpoints, start-up and retries not included)")
if ngpus:
    print(f"text Cost at ${price:.2f} per GPU-hour: {ngpus} GPU(s) x {wall / 3600:.1f} h = "
          f"${ngpus * wall / 3600 * price:,.0f} for the node; the jobs themselves use "
          f"{per_run * total / 3600:,.0f} GPU-hours (${per_run * total / 3600 * price:,.0f})")
else:
    print("text Cost: no GPU-hours, the jobs run on the CPU")
PYEOF
)
}

if ((DRY_RUN)); then
    if real_trainer; then
        build_cmd "${JOBS[0]}"
        trainer_defaults "${CMD[@]:${#TRAINER_BASE[@]}}"
    fi
    nslots=$((CPU_MODE ? 1 : ${#GPUS[@]} / GPUS_PER_RUN))
    if real_trainer; then
        calibration=""
        if ((CALIBRATE)); then
            calibration=$(mktemp -d "${TMPDIR:-/tmp}/run_experiments_calibrate.XXXXXX")
            trap 'rm -rf "$calibration"' EXIT
            calibrate "$calibration"
        fi
        gpu_model=cpu
        if ((!CPU_MODE)); then
            read -ra SMI <<<"${RUN_EXPERIMENTS_NVIDIA_SMI:-nvidia-smi}"
            gpu_model=$("${SMI[@]}" --query-gpu=name --format=csv,noheader -i "${GPUS[0]}" 2>/dev/null | head -n 1)
        fi
        plan_matrix "$calibration" "$gpu_model"
    elif ((CALIBRATE)); then
        warn "--calibrate needs the real train_c4.py (RUN_EXPERIMENTS_TRAINER is set): no time estimate"
    fi
    if ((CPU_MODE)); then
        echo "Plan ($MODE): ${#JOBS[@]} runs; no GPU found: one CPU slot, jobs run one at a time; out: $OUT"
    else
        echo "Plan ($MODE): ${#JOBS[@]} runs on $nslots slot(s) of $GPUS_PER_RUN GPU(s) [GPUs: ${GPUS[*]}]," \
            "launches >= ${STAGGER}s apart; out: $OUT"
        echo "Every GPU is probed before the first launch; an unhealthy one is left out."
    fi
    i=0
    for run in "${JOBS[@]}"; do
        if [[ ${J_STATE[$run]} == skipped_* ]]; then
            printf '%-16s skip (%s)\n' "$run" "${J_STATE[$run]#skipped_}"
            continue
        fi
        if ((i < nslots)); then slot="GPU $(slot_label "$i")"; else slot="next free slot"; fi
        [[ $slot != "GPU cpu" ]] || slot="CPU"
        i=$((i + 1))
        build_cmd "$run"
        micro=$(known_micro "$run"); batch=$(known_batch "$run")
        if [[ $micro == auto* && -n ${PLAN_MICRO[$run]:-} ]]; then   # resolved as the trainer will
            rest=${micro#auto}; micro="${PLAN_MICRO[$run]}${rest:- (auto)}"; auto_planned=1
        fi
        state=${PREV_STATE[$run]:--}
        printf '%-16s %-18s micro-batch %s, global batch %s%s%s\n' "$run" "$slot" "$micro" "$batch" \
            "$([[ ${PLAN_TIME[$run]:--} == - ]] || printf ', %s' "${PLAN_TIME[$run]}")" \
            "$([[ $state == - ]] || printf ', resumes (status: %s)' "$state")"
        if ((CPU_MODE)); then
            printf '    CUDA_VISIBLE_DEVICES= %s\n' "$(quote_cmd "${CMD[@]}")"
        elif [[ $slot == GPU* ]]; then
            printf '    CUDA_VISIBLE_DEVICES=%s %s\n' "${slot#GPU }" "$(quote_cmd "${CMD[@]}")"
        else
            printf '    CUDA_VISIBLE_DEVICES=<slot> %s\n' "$(quote_cmd "${CMD[@]}")"
        fi
    done
    if ((${auto_planned:-0})); then
        echo "micro-batch auto: the most the trainer's memory plan fits on one ${gpu_model:-GPU} (80 GiB when this" \
            "machine sees no CUDA device) at 95% of its memory; a job confirms it with one real step (not under" \
            "FSDP); see python train_c4.py --estimate"
    fi
    ((${#PLAN_SUMMARY[@]} == 0)) || printf '%s\n' "${PLAN_SUMMARY[@]}"
    if ((CALIBRATE)); then
        echo "Dry run: no job was launched and nothing was written to $OUT (the calibration ran in a temporary folder)."
    else
        echo "Dry run: nothing was launched or written."
    fi
    exit "$EXIT_OK"
fi

# ---------------------------------------------------------------------------------------------
# From here on the matrix runs: the out folder, the lock, the log
# ---------------------------------------------------------------------------------------------
mkdir -p "$OUT" || { echo "$PROG: error: cannot create $OUT" >&2; exit "$EXIT_FAILED"; }
# One launcher per out folder. The lock file descriptor is inherited by the jobs, so if this
# launcher is killed hard (kill -9) while its trainers live on, a new launcher still refuses to
# start a second copy of the same runs until they are gone.
if command -v flock >/dev/null 2>&1; then
    exec 9>>"$OUT/.launcher.lock"
    if ! flock -n 9; then
        echo "$PROG: error: another launcher, or jobs of a killed one, are still running on $OUT" \
            "(see: fuser -v $OUT/.launcher.lock); stop them or wait, then run this again" >&2
        exit "$EXIT_FAILED"
    fi
fi
MATRIX_LOG=$OUT/matrix.log
log "START $PROG pid=$$ mode=$MODE runs=${#JOBS[@]} gpus=${GPUS[*]} gpus_per_run=$GPUS_PER_RUN" \
    "stagger=${STAGGER}s max_retries=$MAX_RETRIES data=${DATA:-preset ${PRESET:-c4} default} extra=$(quote_cmd "${EXTRA[@]}")"
# the line report.py --watch reads the matrix from (queue order, slots, price)
gpu_list=cpu
((CPU_MODE)) || gpu_list=$(IFS=,; echo "${GPUS[*]}")
log "QUEUE slots=$((CPU_MODE ? 1 : ${#GPUS[@]} / GPUS_PER_RUN)) gpus_per_run=$GPUS_PER_RUN gpus=$gpu_list" \
    "price_per_gpu_hour=$PRICE runs=$(IFS=,; echo "${JOBS[*]}")"

TMPDIR_LAUNCHER=$(mktemp -d "${TMPDIR:-/tmp}/run_experiments.XXXXXX")
trap 'rm -rf "$TMPDIR_LAUNCHER"' EXIT

# New process group per job, so SIGTERM reaches every process of a job (torchrun and its ranks)
# and a Ctrl-C in the terminal reaches only the launcher, which then stops the jobs in order.
if command -v setsid >/dev/null 2>&1; then
    NEW_GROUP=(setsid)
else
    NEW_GROUP=("$PY" -c 'import os, sys; os.setsid(); os.execvp(sys.argv[1], sys.argv[1:])')
fi

# ---------------------------------------------------------------------------------------------
# Stopping: Ctrl-C / SIGTERM
# ---------------------------------------------------------------------------------------------
STOPPING=0; STOP_STATUS=0; STOP_DEADLINE_MS=0
declare -A RUNNING=()   # pid -> run
# shellcheck disable=SC2329   # called from the traps below
on_signal() {   # on_signal NAME STATUS
    local pid
    if ((STOPPING)); then
        log "STOP second $1: killing the remaining jobs without waiting for their checkpoints"
        for pid in "${!RUNNING[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
        return
    fi
    STOPPING=1; STOP_STATUS=$2
    now_ms; STOP_DEADLINE_MS=$((NOW_MS + STOP_TIMEOUT * 1000))
    log "STOP $1 received: sending SIGTERM to ${#RUNNING[@]} job(s); each saves a checkpoint and exits;" \
        "run the same command again to resume"
    for pid in "${!RUNNING[@]}"; do kill -TERM -- "-$pid" 2>/dev/null; done
}
trap 'on_signal SIGINT "$EXIT_SIGINT"' INT
trap 'on_signal SIGTERM "$EXIT_SIGTERM"' TERM

# ---------------------------------------------------------------------------------------------
# The queue
# ---------------------------------------------------------------------------------------------
QUEUE=()
for run in "${JOBS[@]}"; do
    case ${J_STATE[$run]} in
        skipped_*) log "SKIP $run already ${J_STATE[$run]#skipped_} (status.json)" ;;
        *) QUEUE+=("$run") ;;
    esac
done

# ---------------------------------------------------------------------------------------------
# Health probe
# ---------------------------------------------------------------------------------------------
# shellcheck disable=SC2016   # the $ in the Python snippet is not a shell expansion
PROBE_PY='import torch
assert torch.cuda.is_available(), "CUDA is not available"
a = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
got = (a.cuda() @ a.cuda()).cpu()
torch.cuda.synchronize()
assert torch.allclose(got, a @ a, rtol=1e-3, atol=1e-2), "matmul result differs from the CPU"
print("ok", torch.cuda.get_device_name(0))'

probe_gpu() {   # probe_gpu ID LOGFILE: exit 0 when healthy
    local gpu=$1
    if [[ -n ${RUN_EXPERIMENTS_PROBE:-} ]]; then
        local probe
        read -ra probe <<<"$RUN_EXPERIMENTS_PROBE"
        "${probe[@]}" "$gpu" >"$2" 2>&1 </dev/null
    else
        CUDA_VISIBLE_DEVICES=$gpu NVIDIA_TF32_OVERRIDE=0 timeout -k 10 60 "$PY" -c "$PROBE_PY" >"$2" 2>&1 </dev/null
    fi
}

last_line() { [[ -s $1 ]] && tail -n 1 "$1" | tr -d '\r' | cut -c1-300; }

probe_reason() {   # probe_reason STATUS LOGFILE: the probe's last line, else what its exit status says
    local line
    line=$(last_line "$2")
    if [[ -n $line ]]; then echo "$line"
    elif (($1 == 124)); then echo "timed out, no output"
    elif (($1 > 128)); then echo "killed by signal $(($1 - 128)), no output"
    else echo "exit status $1, no output"
    fi
}

quarantine() {   # quarantine GPU REASON
    GPU_STATE[$1]=quarantined
    log "QUARANTINE gpu=$1 $2; it is not used again in this matrix"
}

if ((!CPU_MODE && ${#QUEUE[@]})); then   # nothing to run, nothing to probe
    declare -A PROBE_PID=()
    for g in "${GPUS[@]}"; do
        probe_gpu "$g" "$TMPDIR_LAUNCHER/probe$g.log" &
        PROBE_PID[$g]=$!
    done
    for g in "${GPUS[@]}"; do
        ((!STOPPING)) || break   # a Ctrl-C during the probes: nothing was launched, just stop
        if wait "${PROBE_PID[$g]}"; then
            log "PROBE gpu=$g healthy"
        else
            quarantine "$g" "failed the start-up probe: $(probe_reason $? "$TMPDIR_LAUNCHER/probe$g.log")"
        fi
    done
fi

healthy_count() {
    local g n=0
    for g in "${GPUS[@]}"; do [[ ${GPU_STATE[$g]} == quarantined ]] || n=$((n + 1)); done
    printf '%s' "$n"
}
if ((!CPU_MODE && ${#QUEUE[@]} && !STOPPING)) && (($(healthy_count) < GPUS_PER_RUN)); then
    log "ERROR too few GPUs passed the health probe ($(healthy_count) healthy, $GPUS_PER_RUN needed per run);" \
        "see the QUARANTINE lines above (on a machine without GPUs, leave out --gpus)"
fi

# ---------------------------------------------------------------------------------------------
# The scheduler: a queue, slots that free up, and what each exit code means
# ---------------------------------------------------------------------------------------------
queue_remove() { local r kept=(); for r in "${QUEUE[@]}"; do [[ $r == "$1" ]] || kept+=("$r"); done; QUEUE=("${kept[@]}"); }
requeue() { QUEUE=("$1" "${QUEUE[@]}"); J_STATE[$1]=pending; }   # to the front: it has a checkpoint

# pick_gpus RUN -> PICKED (comma list) or status 1. A job avoids the GPUs it had a device error
# on, as long as enough other healthy GPUs exist (then it waits for them to free up).
pick_gpus() {
    local run=$1 g free=() preferred=() others=0
    for g in "${GPUS[@]}"; do
        [[ ${GPU_STATE[$g]} == quarantined ]] && continue
        if [[ ${J_AVOID[$run]} != *" $g "* ]]; then
            others=$((others + 1))
            [[ ${GPU_STATE[$g]} == free ]] && preferred+=("$g")
        fi
        [[ ${GPU_STATE[$g]} == free ]] && free+=("$g")
    done
    local IFS=,
    if ((${#preferred[@]} >= GPUS_PER_RUN)); then
        PICKED="${preferred[*]:0:GPUS_PER_RUN}"
    elif ((others < GPUS_PER_RUN && ${#free[@]} >= GPUS_PER_RUN)); then
        PICKED="${free[*]:0:GPUS_PER_RUN}"
    else
        return 1
    fi
}

LAST_LAUNCH_MS=-1
launch() {   # launch RUN GPUS
    local run=$1 gpus=$2 g pid cvd=""
    J_ATTEMPTS[$run]=$((J_ATTEMPTS[$run] + 1))
    build_cmd "$run"
    mkdir -p "$OUT/$run"
    for g in ${gpus//,/ }; do GPU_STATE[$g]=busy; done
    [[ $gpus == cpu ]] || cvd=$gpus
    log "LAUNCH $run gpus=$gpus attempt=${J_ATTEMPTS[$run]} micro_batch=$(known_micro "$run")" \
        "global_batch=$(known_batch "$run") cmd: CUDA_VISIBLE_DEVICES=$cvd $(quote_cmd "${CMD[@]}")"
    LAST_LAUNCH_MS=$NOW_MS   # the time log() stamped, so the logged launches show the true spacing
    J_LAUNCH_S[$run]=$((NOW_MS / 1000 - 1))   # a status.json older than this is left from before
    printf '\n===== %s: launcher attempt %s on %s: %s\n' "$(date '+%F %T')" "${J_ATTEMPTS[$run]}" \
        "${gpus/#cpu/CPU}" "$(quote_cmd "${CMD[@]}")" >>"$OUT/$run/train.log"
    CUDA_VISIBLE_DEVICES=$cvd "${NEW_GROUP[@]}" "${CMD[@]}" >>"$OUT/$run/train.log" 2>&1 </dev/null &
    pid=$!
    RUNNING[$pid]=$run; J_GPUS[$run]=$gpus; J_STATE[$run]=running
}

try_launch() {   # launch the first ready job that fits a free slot; status 1 when none
    local run
    now_ms
    ((LAST_LAUNCH_MS < 0 || NOW_MS - LAST_LAUNCH_MS >= STAGGER_MS)) || return 1
    for run in "${QUEUE[@]}"; do
        ((J_NOT_BEFORE[$run] <= NOW_MS)) || continue
        if pick_gpus "$run"; then
            queue_remove "$run"
            launch "$run" "$PICKED"
            return 0
        fi
    done
    return 1
}

fail_job() {   # fail_job RUN REASON
    J_STATE[$1]=failed; J_REASON[$1]=$2
    log "FAILED $1 $2"
}

retry_or_fail() {   # retry_or_fail RUN WHY: a retry within --max-retries, else failed
    local run=$1
    if ((J_RETRIES[$run] < MAX_RETRIES)); then
        J_RETRIES[$run]=$((J_RETRIES[$run] + 1))
        log "RETRY $run ($2) retry ${J_RETRIES[$run]}/$MAX_RETRIES; resumes from its checkpoint"
        requeue "$run"
    else
        fail_job "$run" "$2; gave up after $MAX_RETRIES retries"
    fi
}

# The OOM retry: halve the micro-batch the run used, keep its global batch.
oom_retry() {
    local run=$1 cfg="$OUT/$1/config.json" micro batch
    if ((J_OOM_RETRIED[$run])); then
        fail_job "$run" "out of memory again at micro-batch $(known_micro "$run") (after one halving); pass a smaller -- --micro-batch-size or use --gpus-per-run"
        return
    fi
    # What this attempt used: its config.json, else what the launcher passed, else the trainer's
    # default for these flags (the OOM may come before config.json is written).
    micro=$(json_get "$cfg" config.micro_batch_size "${J_LAUNCH_S[$run]}")
    [[ $micro =~ ^[0-9]+$ ]] || micro=${J_MICRO[$run]:-$(extra_value --micro-batch-size)}
    if [[ ! $micro =~ ^[0-9]+$ ]] && real_trainer; then
        build_cmd "$run"
        trainer_defaults "${CMD[@]:${#TRAINER_BASE[@]}}" && micro=${DEFAULT_MICRO%% *}
    fi
    if [[ ! $micro =~ ^[0-9]+$ ]]; then
        fail_job "$run" "out of memory, and its micro-batch is unknown (no config.json from this attempt, micro-batch ${micro:-not given}); pass -- --micro-batch-size N"
        return
    fi
    if ((micro <= 1)); then
        fail_job "$run" "out of memory at micro-batch 1; a GPU cannot hold this run alone: use --gpus-per-run 2 or more"
        return
    fi
    batch=$(json_get "$cfg" config.batch_size "${J_LAUNCH_S[$run]}")
    [[ $batch =~ ^[0-9]+$ ]] || batch=${J_BATCH[$run]:-$(extra_value --batch-size)}
    J_OOM_RETRIED[$run]=1
    J_MICRO[$run]=$((micro / 2))
    [[ ! $batch =~ ^[0-9]+$ ]] || J_BATCH[$run]=$batch
    printf '{"micro_batch_size": %d, "reason": "halved from %d after an out-of-memory exit"}\n' \
        "${J_MICRO[$run]}" "$micro" >"$OUT/$run/launcher.json"
    log "RETRY $run out of memory at micro-batch $micro: retrying once with micro-batch ${J_MICRO[$run]}," \
        "global batch ${batch:-unchanged (trainer default)}"
    requeue "$run"
}

# Exit 5: probe the job's GPUs; a GPU that fails the probe, or has now failed two different jobs,
# is quarantined. The job is requeued and avoids these GPUs.
device_error() {
    local run=$1 g failed_runs n probed
    if [[ ${J_GPUS[$run]} == cpu ]]; then
        retry_or_fail "$run" "device error on the CPU slot"
        return
    fi
    for g in ${J_GPUS[$run]//,/ }; do
        [[ ${GPU_FAILED_RUNS[$g]} == *" $run "* ]] || GPU_FAILED_RUNS[$g]+="$run "
        J_AVOID[$run]+="$g "
        read -ra failed_runs <<<"${GPU_FAILED_RUNS[$g]}"
        n=${#failed_runs[@]}
        probed=0
        probe_gpu "$g" "$TMPDIR_LAUNCHER/probe$g.log" || probed=$?
        if ((probed)); then
            quarantine "$g" "failed the probe after a device error in $run: $(probe_reason "$probed" "$TMPDIR_LAUNCHER/probe$g.log")"
        elif ((n >= 2)); then
            quarantine "$g" "passed the probe but failed two different jobs (${failed_runs[*]})"
        else
            log "PROBE gpu=$g healthy after a device error in $run; kept (a second failing job quarantines it)"
        fi
    done
    if ((J_REQUEUES[$run] >= MAX_REQUEUES)); then
        fail_job "$run" "device errors on $((J_REQUEUES[$run] + 1)) attempts; probably not the hardware: see $OUT/$run/train.log"
        return
    fi
    J_REQUEUES[$run]=$((J_REQUEUES[$run] + 1))
    log "REQUEUE $run after a device error on gpu ${J_GPUS[$run]}; it will run on other GPUs if any are healthy"
    requeue "$run"
}

# An exit status the launcher does not know (torchrun reports 1 for any failed rank) is replaced
# by the exit_code rank 0 wrote to status.json during this attempt, when there is one.
trainer_code() {   # trainer_code RUN RC -> prints the code to act on
    local run=$1 rc=$2 code
    case $rc in 0|2|3|4|5|6|75) printf '%s' "$rc"; return ;; esac
    code=$(json_get "$OUT/$run/status.json" exit_code "${J_LAUNCH_S[$run]}")
    case $code in 2|3|4|5|6|75) printf '%s' "$code" ;; *) printf '%s' "$rc" ;; esac
}

job_reason() {   # the trainer's own reason for its exit: status.json, else the last line of train.log
    local reason
    reason=$(json_get "$OUT/$1/status.json" reason "${J_LAUNCH_S[$1]}")
    [[ -n $reason ]] || reason=$(last_line "$OUT/$1/train.log")
    printf '%s' "$reason"
}

on_exit_of() {   # on_exit_of RUN RC
    local run=$1 rc=$2 code g delay
    for g in ${J_GPUS[$run]//,/ }; do
        [[ ${GPU_STATE[$g]} == quarantined ]] || GPU_STATE[$g]=free
    done
    code=$(trainer_code "$run" "$rc")
    log "EXIT $run code=$rc$([[ $code == "$rc" ]] || printf ' (trainer code %s from status.json)' "$code") gpus=${J_GPUS[$run]}"
    if ((STOPPING)) && [[ $code != 0 && $code != 3 ]]; then
        J_STATE[$run]=interrupted; J_REASON[$run]="stopped by the launcher (exit $rc); resumes on the next run"
        return
    fi
    case $code in
        0) J_STATE[$run]=completed; log "DONE $run completed" ;;
        3) J_STATE[$run]=diverged; J_REASON[$run]=$(job_reason "$run")
           log "DIVERGED $run recorded as a result, not retried: ${J_REASON[$run]}" ;;
        2) fail_job "$run" "bad arguments or config, not retried: $(job_reason "$run")"
           echo "---- last lines of $OUT/$run/train.log ----" >&2
           tail -n 5 "$OUT/$run/train.log" >&2 ;;
        4) oom_retry "$run" ;;
        5) device_error "$run" ;;
        6) if ((J_DATA_RETRIES[$run] < MAX_RETRIES)); then
               delay=$((DATA_BACKOFF << J_DATA_RETRIES[$run]))
               J_DATA_RETRIES[$run]=$((J_DATA_RETRIES[$run] + 1))
               now_ms; J_NOT_BEFORE[$run]=$((NOW_MS + delay * 1000))
               log "RETRY $run data source unreachable: retry ${J_DATA_RETRIES[$run]}/$MAX_RETRIES in ${delay}s: $(job_reason "$run")"
               requeue "$run"
           else
               fail_job "$run" "data source unreachable after $MAX_RETRIES retries: $(job_reason "$run")"
           fi ;;
        75) if ((J_REQUEUES[$run] < MAX_REQUEUES)); then
                J_REQUEUES[$run]=$((J_REQUEUES[$run] + 1))
                log "REQUEUE $run interrupted (exit 75) but the launcher is not stopping: resuming from its checkpoint"
                requeue "$run"
            else
                fail_job "$run" "interrupted $((MAX_REQUEUES + 1)) times; not requeued again"
            fi ;;
        *) retry_or_fail "$run" "exit $rc: $(job_reason "$run")" ;;
    esac
}

reap() {   # handle every job that has exited since the last poll
    local pid run rc
    for pid in "${!RUNNING[@]}"; do
        kill -0 "$pid" 2>/dev/null && continue
        wait "$pid"; rc=$?
        run=${RUNNING[$pid]}
        unset "RUNNING[$pid]"
        on_exit_of "$run" "$rc"
    done
}

now_ms; LAST_VIEW_MS=$NOW_MS   # the first view a period after the start
while :; do
    reap
    if ((STOPPING)); then
        ((${#RUNNING[@]})) || break
        now_ms
        if ((NOW_MS > STOP_DEADLINE_MS)); then
            log "STOP jobs still running ${STOP_TIMEOUT}s after SIGTERM: killing them"
            for pid in "${!RUNNING[@]}"; do kill -KILL -- "-$pid" 2>/dev/null; done
            STOP_DEADLINE_MS=$((NOW_MS + 3600 * 1000))
        fi
    else
        ((${#RUNNING[@]} || ${#QUEUE[@]})) || break
        if (($(healthy_count) < GPUS_PER_RUN)); then
            for run in "${QUEUE[@]}"; do fail_job "$run" "no healthy GPU left to run it"; done
            QUEUE=()
            continue
        fi
        # Start at once when a slot is free and the stagger allows; poll again right away after a launch.
        try_launch && continue
    fi
    # Sleep one poll, or less when the stagger ends sooner, so launches are not late by a poll.
    wait_ms=$POLL_MS
    if ((!STOPPING && ${#QUEUE[@]} && LAST_LAUNCH_MS >= 0)); then
        now_ms
        left=$((LAST_LAUNCH_MS + STAGGER_MS - NOW_MS))
        ((left <= 0 || left >= wait_ms)) || wait_ms=$left
    fi
    printf -v wait_s '%d.%03d' $((wait_ms / 1000)) $((wait_ms % 1000))
    sleep "$wait_s"
    now_ms
    if ((WATCH_EVERY && ${#RUNNING[@]} && NOW_MS - LAST_VIEW_MS >= WATCH_EVERY * 1000)); then
        LAST_VIEW_MS=$NOW_MS
        show_matrix
    fi
done

# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------
ok=0; bad=()
for run in "${JOBS[@]}"; do
    case ${J_STATE[$run]} in
        completed|diverged|skipped_completed|skipped_diverged) ok=$((ok + 1)) ;;
        *) bad+=("$run") ;;
    esac
done
echo
echo "Matrix in $OUT (log: $MATRIX_LOG):"
for run in "${JOBS[@]}"; do
    state=${J_STATE[$run]/#skipped_/already }
    [[ $state != pending ]] || state="not started"
    printf '  %-16s %-18s %s\n' "$run" "$state" "${J_REASON[$run]}"
done
quarantined=()
for g in "${GPUS[@]}"; do [[ ${GPU_STATE[$g]} != quarantined ]] || quarantined+=("$g"); done
if ((${#quarantined[@]})); then
    # Not remembered across invocations: the next start-up probe checks them again.
    log "END quarantined GPU(s): ${quarantined[*]}; to keep them out next time: --exclude-gpus $(IFS=,; echo "${quarantined[*]}")"
fi
if ((STOPPING)); then
    log "END stopped: $ok of ${#JOBS[@]} runs finished; run the same command to resume the rest"
    exit "$STOP_STATUS"
fi
print_report
if ((${#bad[@]})); then
    log "END $ok of ${#JOBS[@]} runs finished; ${#bad[@]} failed:"
    for run in "${bad[@]}"; do
        log "END failed $run: ${J_REASON[$run]:-${J_STATE[$run]}}"
    done
    exit "$EXIT_FAILED"
fi
log "END all ${#JOBS[@]} runs finished (completed or diverged)"
exit "$EXIT_OK"

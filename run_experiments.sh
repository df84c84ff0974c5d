#!/usr/bin/env bash
# run_experiments.sh: fans the method x depth x seed matrix over the GPUs of one node.
#
#   bash run_experiments.sh [--full|--quick|--stress|--demo] [options] [-- extra train_c4.py flags]
#   bash run_experiments.sh --help          (all options, exit statuses, files written, environment)
#   bash run_experiments.sh --check [--out DIR] [--dry-run]   (the GPU path on this node's first GPU: hcstudy/gpu_check.py)
#
# This file is process control only: it starts hcstudy.launcher, which parses the flags, plans the matrix and
# decides (which job next, on which GPUs, what an exit code means), and carries out its requests: take
# the lock, probe GPUs, launch a job in its own process group, wait for exits and signals, signal the
# jobs. The requests and their answers are listed in hcstudy.launcher's docstring. --help, --dry-run and
# --summary are answered by hcstudy.launcher alone.
#
# A dropped SSH session does not stop a matrix: SIGHUP is ignored, and when the output goes to a terminal it
# is relayed, so that writes to a terminal that has gone away fail in the relay, not in hcstudy.launcher.
#
# Environment: RUN_EXPERIMENTS_PYTHON (python for hcstudy.launcher and the default trainer; default .venv/bin/python
# next to this script, else python3), RUN_EXPERIMENTS_PROBE (GPU health probe command; gets the GPU index
# as its last argument; exit 0 = healthy). The others are hcstudy.launcher's (see --help).

set -uo pipefail   # no -e: a failing job is an event hcstudy.launcher handles, not a reason to stop

if ((BASH_VERSINFO[0] < 4 || (BASH_VERSINFO[0] == 4 && BASH_VERSINFO[1] < 4))); then
    echo "run_experiments.sh needs bash >= 4.4 (this is $BASH_VERSION)" >&2
    exit 2
fi
PROG=run_experiments.sh
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

if [[ -n ${RUN_EXPERIMENTS_PYTHON:-} ]]; then
    PY=$RUN_EXPERIMENTS_PYTHON
elif [[ -x $ROOT/.venv/bin/python ]]; then
    PY=$ROOT/.venv/bin/python
else
    PY=python3
    echo "$PROG: no .venv found in $ROOT: run 'bash setup.sh' first (using $PY for now)" >&2
fi
command -v "$PY" >/dev/null 2>&1 || { echo "$PROG: error: python '$PY' not found; run 'bash setup.sh'" >&2; exit 1; }
CHECK=0 CHECK_ARGS=()    # --check: the rest goes to the check, which refuses what it does not take
for arg in "$@"; do
    if [[ $arg == --check ]]; then CHECK=1; else CHECK_ARGS+=("$arg"); fi
done
# the package beside this script, wherever it is started from
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
((CHECK)) && exec "$PY" -m hcstudy.gpu_check "${CHECK_ARGS[@]}"
if ! command -v setsid >/dev/null 2>&1; then
    echo "$PROG: error: setsid not found (util-linux): it puts each job in its own process group" >&2
    exit 1
fi

# ---------------------------------------------------------------------------------------------
# Time and waiting
# ---------------------------------------------------------------------------------------------
now_ms() {   # sets NOW_MS (bash 5 has EPOCHREALTIME; its decimal point follows the locale)
    if [[ -n ${EPOCHREALTIME:-} ]]; then
        local t=${EPOCHREALTIME//[.,]/}
        NOW_MS=$((10#$t / 1000))
    else
        NOW_MS=$(date +%s%3N)
    fi
}

exit_status_of() {   # exit_status_of PID: waits for a child, through the signals that interrupt `wait`
    local status
    while :; do
        wait "$1"; status=$?
        ((status > 128)) && kill -0 "$1" 2>/dev/null || return "$status"
    done
}

# ---------------------------------------------------------------------------------------------
# The requests of hcstudy.launcher
# ---------------------------------------------------------------------------------------------
declare -A RUNNING=()   # pid -> run
SIGNALS=()              # received since the last answer: INT, TERM

take_lock() {   # take_lock FILE: one launcher per out folder. The lock descriptor is inherited by the jobs, so
    # if this launcher is killed hard (kill -9) while its trainers live on, a new launcher still refuses to
    # start a second copy of the same runs until they are gone.
    if command -v flock >/dev/null 2>&1 && ! { exec 9>>"$1" && flock -n 9; }; then
        echo busy
    else
        echo ok
    fi
}

probe_gpu() {   # probe_gpu ID LOGFILE: exit 0 when healthy
    if [[ -n ${RUN_EXPERIMENTS_PROBE:-} ]]; then
        local probe
        read -ra probe <<<"$RUN_EXPERIMENTS_PROBE"
        "${probe[@]}" "$1" >"$2" 2>&1 </dev/null
    else
        CUDA_VISIBLE_DEVICES=$1 NVIDIA_TF32_OVERRIDE=0 timeout -k 10 60 "$PY" -m hcstudy.launcher --probe-gpu \
            >"$2" 2>&1 </dev/null
    fi
}

probe_gpus() {   # probe_gpus LOGDIR GPU...: all at once; answers "GPU STATUS" per GPU
    local dir=$1 gpu i pids=()
    shift
    for gpu in "$@"; do
        probe_gpu "$gpu" "$dir/probe$gpu.log" {REQUESTS}<&- {REPLIES}>&- &
        pids+=($!)
    done
    for i in "${!pids[@]}"; do
        exit_status_of "${pids[i]}"
        echo "${*:i+1:1} $?"
    done
}

launch() {   # launch RUN GPUS LOG CMD...: in a new process group, so that a Ctrl-C in the terminal reaches only
    # the launcher; every process of the job inherits the tag RUN_EXPERIMENTS_JOB (job_processes)
    local run=$1 gpus=$2 log=$3
    shift 3
    [[ $gpus != cpu ]] || gpus=""   # the CPU slot: its job sees no GPU
    CUDA_VISIBLE_DEVICES=$gpus RUN_EXPERIMENTS_JOB="$$/$run" setsid "$@" >>"$log" 2>&1 </dev/null \
        {REQUESTS}<&- {REPLIES}>&- &
    RUNNING[$!]=$run
}

job_processes() {   # job_processes RUN: every live process of the job, by its tag. torchrun starts each rank in a
    # session of its own, outside the job's process group, and a rank outlives a torchrun killed outright
    local file
    grep -lzx "RUN_EXPERIMENTS_JOB=$$/$1" /proc/[0-9]*/environ 2>/dev/null | while IFS= read -r file; do
        file=${file#/proc/}
        echo "${file%/environ}"
    done
}

session_of() {   # session_of PID: its session id (/proc/PID/stat's sixth field, after the parenthesised name)
    local stat
    read -r stat <"/proc/$1/stat" 2>/dev/null || return
    read -r _ _ _ stat _ <<<"${stat##*) }"
    echo "$stat"
}

end_leftovers() {   # end_leftovers RUN: SIGKILL to what a job left running (ranks of a torchrun that died)
    local pid
    for pid in $(job_processes "$1"); do kill -KILL "$pid" 2>/dev/null; done
}

wait_for_jobs() {   # wait_for_jobs MS POLL_MS: until a job exits, a signal arrives or MS pass; "exited RUN STATUS"
    local pid status exited=0 deadline left
    now_ms; deadline=$((NOW_MS + $1))
    while :; do
        for pid in "${!RUNNING[@]}"; do
            kill -0 "$pid" 2>/dev/null && continue
            exit_status_of "$pid"; status=$?
            end_leftovers "${RUNNING[$pid]}"
            echo "exited ${RUNNING[$pid]} $status"
            unset "RUNNING[$pid]"
            exited=1
        done
        now_ms; left=$((deadline - NOW_MS))
        ((exited || ${#SIGNALS[@]} || left <= 0)) && return
        ((left < $2)) || left=$2
        sleep "$((left / 1000)).$(printf '%03d' $((left % 1000)))"
    done
}

signal_jobs() {   # signal_jobs SIGNAL: every running job's process group and torchrun's ranks (each a session
    # leader); SIGKILL to all of a job's processes, SIGTERM not to the loader processes (the trainer ends them)
    local pid rank
    for pid in "${!RUNNING[@]}"; do
        kill "-$1" -- "-$pid" 2>/dev/null
        for rank in $(job_processes "${RUNNING[$pid]}"); do
            [[ $rank != "$pid" ]] || continue           # the job's leader: signalled once, with its group
            [[ $1 == KILL || $(session_of "$rank") == "$rank" ]] && kill "-$1" "$rank" 2>/dev/null
        done
    done
}

answer() {   # answer REQUEST...: its lines, the signals received meanwhile, then "end"
    case $1 in
        lock) take_lock "$2" ;;
        probe) probe_gpus "${@:2}" ;;
        launch) launch "${@:2}" ;;
        wait) wait_for_jobs "$2" "$3" ;;
        kill) signal_jobs "$2" ;;
        *) echo "$PROG: unknown request from hcstudy.launcher: $*" >&"$STDERR" ;;
    esac
    local n=${#SIGNALS[@]}
    ((n == 0)) || printf 'signal %s\n' "${SIGNALS[@]:0:n}"
    SIGNALS=("${SIGNALS[@]:n}")
    echo end
}

relay() {   # copies lines to stdout while it can; a write to a hung-up terminal fails here and reading goes on,
    # so hcstudy.launcher never blocks on a full pipe or dies of a broken one. Ctrl-C is for the launcher, not for this.
    trap '' INT HUP
    local line
    while IFS= read -r line || [[ -n $line ]]; do printf '%s\n' "$line" 2>/dev/null; done
}

# ---------------------------------------------------------------------------------------------
# The conversation: two named pipes to hcstudy.launcher, requests one per line in shell-quoted words
# ---------------------------------------------------------------------------------------------
trap '' HUP              # inherited by hcstudy.launcher and the jobs: a dropped SSH session stops nothing
[[ ! -t 1 ]] || exec 1> >(relay)
[[ ! -t 2 ]] || exec 2> >(relay >&2)
PIPES=$(mktemp -d "${TMPDIR:-/tmp}/run_experiments.XXXXXX") || exit 1
trap 'rm -rf "$PIPES"' EXIT
mkfifo "$PIPES/requests" "$PIPES/replies" || exit 1
"$PY" -m hcstudy.launcher --requests 3 --replies 4 "$@" 3>"$PIPES/requests" 4<"$PIPES/replies" &
MATRIX=$!
exec {REQUESTS}<"$PIPES/requests" {REPLIES}>"$PIPES/replies"
trap 'SIGNALS+=(INT)' INT
trap 'SIGNALS+=(TERM)' TERM
trap '' PIPE             # an answer to a hcstudy.launcher that died fails quietly; the next read sees the end
exec {STDERR}>&2

request=()
while :; do
    IFS= read -r -u "$REQUESTS" line
    status=$?
    ((status > 128)) && continue   # a signal interrupted the read; its trap recorded it
    ((status == 0)) || break       # hcstudy.launcher has finished
    eval "request=($line)"         # words quoted by Python's shlex.join
    answer "${request[@]}" 2>/dev/null 1>&"$REPLIES"
done
exec {REQUESTS}<&- {REPLIES}>&-
exit_status_of "$MATRIX"
status=$?
if ((${#RUNNING[@]})); then   # hcstudy.launcher died with jobs running: they save a checkpoint and stop
    echo "$PROG: error: hcstudy.launcher exited ($status) with ${#RUNNING[@]} job(s) running; stopping them" \
        "(each saves a checkpoint); the same command resumes" >&2
    signal_jobs TERM
    for pid in "${!RUNNING[@]}"; do exit_status_of "$pid"; end_leftovers "${RUNNING[$pid]}"; done
    ((status)) || status=1
fi
exit "$status"

"""hcstudy/launcher: the decisions of run_experiments.sh: the matrix, its plan, and what each job's exit means.

run_experiments.sh keeps process control (starting jobs in their own process groups, probing GPUs, signals,
waiting); everything that parses, validates, plans or decides is here, in one process that lives as long as the
launcher. Read top to bottom:

    command line -> the matrix (jobs in queue order, what earlier invocations left) -> GPUs and trainer command
    -> --summary -> --dry-run (plan, calibration, time and cost) -> the run: the queue, exit codes, stopping

The conversation with the bash side (`--requests FD --replies FD`, two pipes): this process writes one request
per line, shell-quoted words; bash answers with zero or more lines and then `end`.

    lock FILE                       take the launcher lock (flock), inherited by every job -> `ok` | `busy`
    probe LOGDIR GPU...             probe the GPUs in parallel, output in LOGDIR/probe{GPU}.log -> `GPU STATUS`...
    launch RUN GPUS LOG CMD...      start CMD in its own process group with CUDA_VISIBLE_DEVICES=GPUS
                                    (`cpu`: none), appending to LOG
    wait MS POLL_MS                 until a job exits, a signal arrives or MS pass -> `exited RUN STATUS`...,
                                    `signal INT|TERM`...
    kill SIGNAL                     send SIGNAL to every running job's process group

Without those two flags (tests, a plain `python hcstudy/launcher --dry-run`) only --help, --summary and --dry-run work.
It imports only the standard library: every job's flags, memory and time are judged by the trainer itself, in a
subprocess (`train_c4.py --plan-jobs`, hcstudy/planner's planner), before the first launch and in the dry run.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from hcstudy import ROOT
from hcstudy.config_flags import OneLineErrorParser
from hcstudy.contract import (
    CHECKPOINT_MARKER,
    COEFFICIENT_METHODS,
    EXIT_BAD_CONFIG,
    EXIT_DATA,
    EXIT_DEVICE,
    EXIT_DIVERGED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_OOM,
    METHODS,
    SINKHORN_METHODS,
    TRAINER_EXIT_CODES,
    launcher_settings,
    run_name,
)

PROG = "run_experiments.sh"
# the launcher's own exit statuses
EXIT_FAILED, EXIT_USAGE, EXIT_SIGINT, EXIT_SIGTERM = 1, 2, 130, 143

# ----------------------------------------------------------------------------------------------
# Command line

MODES = {   # methods, depths, seeds, steps, trainer preset
    "full": ("baseline,hc,mhc", "32,48", "42,123,456", None, None),
    "quick": ("hc,mhc", "32,48", "42", 10000, None),
    "stress": ("hc,mhc", "32,48,64", "42", None, "stress"),
    # the demo preset fixes its own model; --depth 4 (its depth) is passed so the run name is exact
    "demo": ("baseline,hc,mhc", "4", "42", None, "demo"),
    "demo-all": (",".join(METHODS), "4", "42", None, "demo"),
}
# The trainer flags the launcher sets for each run: the run's identity and where it lives.
OWN_TRAINER_FLAGS = ("--residual", "--depth", "--seed", "--run-name", "--out", "--steps", "--sinkhorn-iters",
                     "--coefficients")

DESCRIPTION = """\
Fans the method x depth x seed matrix over the GPUs of one node (or a share of it over several nodes).

One job per run `{method}_d{depth}_s{seed}` (other arms add `_it{N}`, `_seq` or a preset's suffix:
mhc_d32_s42_it100, hc_d32_s42_seq, hc_d32_s42_seed-study), each on its own slot of --gpus-per-run GPUs,
started from a queue as slots free up, launches at least --stagger seconds apart. Re-running the same command
continues the matrix: completed and diverged runs are skipped, the others resume from their newest checkpoint."""

EPILOG = f"""\
Everything after -- goes to every train_c4.py run, e.g. -- --data '/data/c4/*.json.gz' --wandb offline;
a --preset there also names the runs (-- --preset seed-study: hc_d32_s42_seed-study)

Failures, by the trainer's exit code: {EXIT_BAD_CONFIG} bad arguments (not retried), {EXIT_DIVERGED} diverged (a
result), {EXIT_OOM} out of memory (one retry at half the micro-batch, same global batch), {EXIT_DEVICE} device
error (the GPU is re-probed; one that fails the probe or fails two different jobs is quarantined; the job moves
to another GPU), {EXIT_DATA} data unreachable (retried after a backoff), {EXIT_INTERRUPTED} interrupted
(requeued), anything else (retried up to --max-retries).

Files: {{out}}/matrix.log (every decision, timestamped; matrix.node{{i}}.log with --nodes), {{out}}/{{run}}/train.log
(the job's output), {{out}}/{{run}}/launcher.json (a micro-batch halved after an out-of-memory exit; kept for
later runs of the matrix; delete it to forget), {{out}}/.launcher.lock (one launcher per out folder and node).

Exit status: {EXIT_OK} every job completed or diverged (a divergence is a result); {EXIT_FAILED} some job failed
or could not run (listed at the end); {EXIT_USAGE} bad arguments; {EXIT_SIGINT} stopped by Ctrl-C,
{EXIT_SIGTERM} by SIGTERM (jobs saved a checkpoint; the same command resumes the matrix).

Environment: RUN_EXPERIMENTS_TRAINER (trainer command, split on whitespace; the launcher appends each run's
flags, and asks it `--plan-jobs` before the first launch, as train_c4.py answers it), RUN_EXPERIMENTS_PROBE
(GPU health probe; gets the GPU index; exit 0 = healthy),
RUN_EXPERIMENTS_NVIDIA_SMI (GPU discovery, default nvidia-smi; `false`: no GPU), RUN_EXPERIMENTS_PYTHON,
RUN_EXPERIMENTS_REPORT (report script, default report.py), RUN_EXPERIMENTS_POLL (seconds between polls, 1),
RUN_EXPERIMENTS_DATA_BACKOFF (seconds before the first retry after exit {EXIT_DATA}, doubling; 300),
RUN_EXPERIMENTS_MAX_REQUEUES (10), RUN_EXPERIMENTS_STOP_TIMEOUT (seconds jobs get to checkpoint after Ctrl-C;
600), RUN_EXPERIMENTS_CALIBRATE_STEPS (steps of each --calibrate run, 10, at least 4)."""

USAGE = (f"bash {PROG} [--full|--quick|--stress|--demo|--demo-all] [--residual L] [--depth L] [--seed L]\n"
         "       [--sinkhorn-iters L] [--coefficients L] [--steps N]\n"
         "       [--gpus L] [--exclude-gpus L] [--gpus-per-run K] [--nodes N --node-rank I] [--stagger S]\n"
         "       [--max-retries N] [--out DIR] [--dry-run [--calibrate] [--gpu-type NAME]] [--summary] [--slurm [--dry-run]]\n"
         "       [-- train_c4.py flags]\n"
         f"       bash {PROG} --check [--out DIR]     (the GPU path on this node: PASS/FAIL per part, about 10 min)")


class UsageError(Exception):
    """A bad flag, environment knob or placement: one line (with the usage for a flag or knob), exit 2."""


def listed(pattern, what):
    """An argparse type: a comma list whose every entry matches `pattern`; names in any case (HC is hc)."""
    def parse(text):
        items = text.lower().split(",") if text else []
        if not items:
            raise argparse.ArgumentTypeError(f"{what} must not be empty")
        for item in items:
            if not re.fullmatch(pattern, item):
                raise argparse.ArgumentTypeError(f"'{item}' is not a valid entry of {what}")
        return list(dict.fromkeys(items))        # a repeat is dropped, the order kept
    return parse


def number(pattern, what, convert=int):
    def parse(text):
        if not re.fullmatch(pattern, text):
            raise argparse.ArgumentTypeError(f"{what}, not '{text}'")
        return convert(text)
    return parse


def hms_seconds(text):
    hours, minutes, seconds = map(int, text.split(":"))
    return hours * 3600 + minutes * 60 + seconds


WHOLE = r"[0-9]+"
POSITIVE = r"[1-9][0-9]*"
SECONDS = r"[0-9]+(\.[0-9]{1,3})?"


def build_parser():
    p = OneLineErrorParser(error_type=UsageError, hint="", usage_title="Usage: ",
                           prog=f"bash {PROG}", usage=USAGE, description=DESCRIPTION, epilog=EPILOG,
                           formatter_class=lambda prog: argparse.RawDescriptionHelpFormatter(prog, max_help_position=26,
                                                                                              width=110))
    m = p.add_argument_group("matrix (default --full)")
    for mode, help_text in (
            ("full", "baseline,hc,mhc x depths 32,48 x seeds 42,123,456 (18 runs, the trainer's default steps)"),
            ("quick", "hc,mhc x depths 32,48 x seed 42 at 10000 steps (4 runs)"),
            ("stress", "the stress arm: hc,mhc x depths 32,48,64 x seed 42 with --preset stress (lr 3e-4, 3000 "
                       "steps), runs named {method}_d{depth}_s{seed}_stress: it shares --out with the main matrix"),
            ("demo", "baseline,hc,mhc with --preset demo (bundled corpus, CPU minutes), depth 4, then the table"),
            ("demo-all", "every residual arm (baseline,hc,mhc,mhc-lite,identity-hc) as --demo does")):
        m.add_argument(f"--{mode}", dest="mode", action="append_const", const=mode, help=help_text)
    # the trainer's names, each taking a list (the plural names are the same flags)
    m.add_argument("--residual", "--methods", dest="methods", metavar="LIST",
                   type=listed("|".join(METHODS), f"--residual ({','.join(METHODS)})"),
                   help=f"override the methods, e.g. hc,mhc (of {','.join(METHODS)})")
    m.add_argument("--depth", "--depths", dest="depths", metavar="LIST",
                   type=listed(POSITIVE, "--depth (positive integers)"), help="override the depths, e.g. 32,48")
    m.add_argument("--seed", "--seeds", dest="seeds", metavar="LIST",
                   type=listed(WHOLE, "--seed (non-negative integers)"), help="override the seeds, e.g. 42,123")
    m.add_argument("--sinkhorn-iters", metavar="LIST", type=listed(POSITIVE, "--sinkhorn-iters (positive integers)"),
                   help="Sinkhorn iterations of mHC, e.g. 5,20,100 (other methods run once; runs named _it{N} "
                        "unless 20)")
    m.add_argument("--coefficients", metavar="LIST", type=listed("token|sequence", "--coefficients (token,sequence)"),
                   help="mixing coefficients per token or per sequence, e.g. token,sequence (the baseline runs "
                        "once; runs named _seq unless the preset's default)")
    m.add_argument("--steps", type=number(POSITIVE, "--steps must be a positive integer"),
                   help="pass --steps N to every run")
    m.add_argument("--vary-data-seed", action="store_true",
                   help="pass --data-seed SEED with each run's seed: seeds then vary the data order as well as the "
                        "initialisation (default: one data order for every seed)")
    g = p.add_argument_group("placement")
    g.add_argument("--gpus", type=listed(WHOLE, "--gpus (GPU indices)"),
                   help="GPU indices to use (default: all that nvidia-smi lists; none found: one CPU slot)")
    g.add_argument("--exclude-gpus", type=listed(WHOLE, "--exclude-gpus (GPU indices)"), default=[],
                   help="GPU indices never to use")
    g.add_argument("--gpus-per-run", type=number(POSITIVE, "--gpus-per-run must be a positive integer"),
                   help="GPUs per run (default 1; --quick: enough to fill the node); K > 1 runs torchrun with "
                        "--parallel fsdp (-- --parallel ddp overrides)")
    g.add_argument("--gpu-type", metavar="NAME",
                   help="the GPU model a plan is for, as nvidia-smi names it (e.g. 'NVIDIA H200'; default: this "
                        "node's, else the documented node's 'NVIDIA H100 80GB HBM3')")
    g.add_argument("--nodes", type=number(POSITIVE, "--nodes must be a positive integer"), default=1,
                   help="nodes sharing the matrix (default 1): each runs every N-th job of the queue")
    g.add_argument("--node-rank", type=number(WHOLE, "--node-rank must be a non-negative integer"), default=0,
                   help="this node's share, 0 to N-1 (default 0)")
    g.add_argument("--stagger", type=number(SECONDS, "--stagger must be seconds >= 0 (at most 3 decimals)", float),
                   default=15.0, help="at least SEC seconds between two launches (default 15)")
    f = p.add_argument_group("failures")
    f.add_argument("--max-retries", type=number(WHOLE, "--max-retries must be a non-negative integer"), default=2,
                   help="retries of a job that failed for an unknown reason or lost its data source (default 2)")
    o = p.add_argument_group("output and modes")
    o.add_argument("--out", default="runs", help="run folders and matrix.log (default runs)")
    o.add_argument("--dry-run", action="store_true",
                   help="print the plan (every job, node, slot, micro-batch, global batch, memory, time, command), "
                        "the wall time and the cost, as ranges with their assumptions; run and write nothing. For "
                        "this node's GPUs, else the documented node (8 x H100 SXM); times from the GPU check's "
                        "result in --out, else the FLOP count, unless --calibrate")
    o.add_argument("--calibrate", action="store_true",
                   help="with --dry-run: first time a few steps of each method x depth on the slots, in a temporary "
                        "folder, and estimate from those")
    o.add_argument("--price-per-gpu-hour", type=number(r"[0-9]+(\.[0-9]+)?", "--price-per-gpu-hour must be a number "
                                                       "of dollars", float), default=2.49, metavar="USD",
                   help="for the dry run's cost and the matrix view (default 2.49)")
    o.add_argument("--summary", action="store_true",
                   help="print the matrix view and the results table from the live files of --out, and rewrite "
                        "--out/report (results.md, the CSV files, the plots); launch nothing")
    o.add_argument("--watch-every", type=number(WHOLE, "--watch-every must be whole seconds >= 0"), default=60,
                   metavar="SEC", help="print the matrix view every SEC seconds while jobs run (default 60; 0: never)")
    s = p.add_argument_group("SLURM")
    s.add_argument("--slurm", action="store_true",
                   help="submit the matrix as a SLURM job array instead (one run per task on one node with "
                        "--gpus-per-run GPUs, requeued at the time limit) and a report job that runs after it; with "
                        "--dry-run: print the sbatch commands and each task's flags, submit and write nothing")
    s.add_argument("--slurm-time", type=number(r"[0-9]+:[0-5][0-9]:[0-5][0-9]", "--slurm-time must be H:MM:SS",
                                               hms_seconds), default=hms_seconds("24:00:00"), metavar="H:MM:SS",
                   help="the partition's time limit (default 24:00:00): each task asks for its planned time plus a "
                        "margin, at most this; a run that needs longer is requeued at the limit and resumes")
    p.add_argument("--requests", type=int, help=argparse.SUPPRESS)
    p.add_argument("--replies", type=int, help=argparse.SUPPRESS)
    return p


@dataclass
class Options:
    """The launcher's settings, validated."""
    mode: str
    methods: list
    depths: list
    seeds: list
    steps: int | None
    preset: str | None                 # the trainer preset the mode sets, or the one after --
    sinkhorn_iters: list | None        # None: the trainer's default
    coefficients: list | None
    vary_data_seed: bool
    gpus: list | None
    exclude_gpus: list
    gpus_per_run: int
    gpus_per_run_given: bool
    gpu_type: str | None
    nodes: int
    node_rank: int
    stagger: float
    max_retries: int
    out: Path
    dry_run: bool
    calibrate: bool
    price: float
    summary: bool
    watch_every: int
    slurm: bool
    slurm_time: int
    extra: list                        # flags for every train_c4.py run
    poll: float = 1.0
    data_backoff: int = 300
    max_requeues: int = 10
    stop_timeout: int = 600
    calibrate_steps: int = 10
    requests: int | None = None
    replies: int | None = None


def environment_knob(name, default, pattern=WHOLE, what="a non-negative integer", convert=int):
    text = os.environ.get(name, "")
    if not text:
        return default
    if not re.fullmatch(pattern, text):
        raise UsageError(f"{name} must be {what}, not '{text}'")
    return convert(text)


def parse_options(argv):
    argv = list(argv)
    split = argv.index("--") if "--" in argv else len(argv)
    args, extra = build_parser().parse_args(argv[:split]), argv[split + 1:]
    if not args.out:                  # before Path(): Path("") is "." and would run the matrix in this folder
        raise UsageError("--out must not be empty")
    modes = set(args.mode or [])
    if len(modes) > 1:
        raise UsageError("choose one of --full, --quick, --stress, --demo, --demo-all")
    mode = modes.pop() if modes else "full"
    methods, depths, seeds, steps, preset = MODES[mode]
    if not preset and extra_value(extra, "--preset"):    # -- --preset seed-study: its runs are named after it
        preset, extra = ",".join(extra_values(extra, "--preset")), without_flag(extra, "--preset")
    opt = Options(
        mode=mode, methods=args.methods or methods.split(","),
        depths=sorted({int(d) for d in (args.depths or depths.split(","))}, reverse=True),
        seeds=[int(s) for s in (args.seeds or seeds.split(","))], steps=args.steps or steps, preset=preset,
        sinkhorn_iters=args.sinkhorn_iters and [int(i) for i in args.sinkhorn_iters], coefficients=args.coefficients,
        vary_data_seed=args.vary_data_seed, gpus=args.gpus, exclude_gpus=args.exclude_gpus,
        gpus_per_run=args.gpus_per_run or 1, gpus_per_run_given=args.gpus_per_run is not None,
        gpu_type=args.gpu_type, nodes=args.nodes, node_rank=args.node_rank, stagger=args.stagger,
        max_retries=args.max_retries, out=Path(args.out), dry_run=args.dry_run, calibrate=args.calibrate,
        price=args.price_per_gpu_hour, summary=args.summary, watch_every=args.watch_every, slurm=args.slurm,
        slurm_time=args.slurm_time, extra=extra,
        requests=args.requests, replies=args.replies)
    opt.poll = environment_knob("RUN_EXPERIMENTS_POLL", 1.0, SECONDS, "seconds >= 0.01", float)
    if opt.poll < 0.01:
        raise UsageError(f"RUN_EXPERIMENTS_POLL must be seconds >= 0.01, not '{opt.poll}'")
    opt.data_backoff = environment_knob("RUN_EXPERIMENTS_DATA_BACKOFF", 300)
    opt.max_requeues = environment_knob("RUN_EXPERIMENTS_MAX_REQUEUES", 10)
    opt.stop_timeout = environment_knob("RUN_EXPERIMENTS_STOP_TIMEOUT", 600)
    opt.calibrate_steps = environment_knob("RUN_EXPERIMENTS_CALIBRATE_STEPS", 10)
    check_options(opt)
    return opt


def check_options(opt):
    if opt.slurm and (opt.calibrate or opt.summary or opt.nodes > 1):
        raise UsageError("--slurm submits the whole matrix: not with --calibrate, --summary or --nodes")
    if opt.calibrate and not opt.dry_run:
        raise UsageError("--calibrate goes with --dry-run (it times the matrix before you start it)")
    if opt.calibrate_steps < 4:
        raise UsageError(f"RUN_EXPERIMENTS_CALIBRATE_STEPS must be an integer >= 4, not '{opt.calibrate_steps}'")
    if opt.node_rank >= opt.nodes:
        raise UsageError(f"--node-rank {opt.node_rank} must be below --nodes {opt.nodes}")
    for arg in opt.extra:
        flag = arg.split("=", 1)[0]
        if flag in OWN_TRAINER_FLAGS:
            raise UsageError(f"{flag} is set by the launcher for each run: give it before -- (a list for --residual, "
                             "--depth, --seed, --sinkhorn-iters, --coefficients)")
        if flag == "--resume":      # never on every launch would start a retried or requeued job over
            raise UsageError("--resume is the launcher's: every job resumes, so that a retry continues from its "
                             "checkpoint; to start runs over, use another --out")
        if flag == "--data-seed" and opt.vary_data_seed:
            raise UsageError("--vary-data-seed sets --data-seed for each run; do not pass it after --")
        if flag == "--preset":
            raise UsageError(f"--{opt.mode} sets --preset {opt.preset}; do not pass --preset after --")
    if not opt.summary:
        check_out(opt.out)


def check_out(out):
    """--out must be a folder this user can write in, or one it can create. A probe folder is made and removed
    where it would go: as root, os.access passes on folders where mkdir then fails (/proc)."""
    where = out
    while not where.exists() and where.parent != where and str(where) != ".":
        where = where.parent
    if not where.is_dir():
        raise UsageError(f"--out {out}: {where} is a file, not a folder")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".run_experiments-probe.", dir=where))
    except OSError:
        raise UsageError(f"--out {out}: cannot create a folder in {where}") from None


def extra_values(extra, flag):
    """Every value of a trainer flag among the extra flags, in order."""
    return [extra[i + 1] if arg == flag else arg.split("=", 1)[1] for i, arg in enumerate(extra)
            if arg == flag and i + 1 < len(extra) or arg.startswith(flag + "=")]


def extra_value(extra, flag):
    """The value of a trainer flag among the extra flags (the last one wins, as in argparse), or None."""
    values = extra_values(extra, flag)
    return values[-1] if values else None


def without_flag(extra, flag):
    """The extra flags less every `flag VALUE` and `flag=VALUE`."""
    kept, skip = [], False
    for arg in extra:
        if not skip and arg != flag and not arg.startswith(flag + "="):
            kept.append(arg)
        skip = arg == flag and not skip
    return kept


# ----------------------------------------------------------------------------------------------
# The matrix: jobs in queue order, and what earlier invocations left

@dataclass
class Job:
    name: str
    method: str
    depth: int
    seed: int
    node: int
    sinkhorn_iters: int | None = None   # None: the trainer's default (and always for a method without Sinkhorn)
    coefficients: str | None = None
    state: str = "pending"     # pending|running|completed|diverged|failed|interrupted|skipped_completed|...
    reason: str = ""
    step: int | None = None    # status.json's step before this invocation: the plan's remaining steps
    attempts: int = 0
    retries: int = 0
    data_retries: int = 0
    requeues: int = 0
    oom_retried: bool = False
    micro: int | None = None   # set after an out-of-memory exit (here or in an earlier invocation)
    batch: int | None = None
    not_before: float = 0.0
    avoid: set = field(default_factory=set)     # GPUs it had a device error on
    gpus: str = ""
    launched_at: float = 0.0
    planned: dict = field(default_factory=dict)     # the trainer's answer before the first launch (plan_jobs)

    @property
    def skipped_as(self) -> str | None:
        """'completed' or 'diverged' for a run an earlier invocation finished (its status.json), else None."""
        return self.state.removeprefix("skipped_") if self.state.startswith("skipped_") else None


def write_json(path, obj):
    """Atomically: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(obj) + "\n")
    os.replace(tmp, path)


def read_json(path, newer_than=None):
    """A JSON file's content, or {} when missing, unreadable, or older than `newer_than` (left from before)."""
    try:
        if newer_than is not None and os.path.getmtime(path) < newer_than:
            return {}
        with open(path) as f:
            value = json.load(f)
        return value if isinstance(value, dict) else {}
    except (OSError, ValueError):
        return {}


def arms(opt):
    """(method, Sinkhorn iterations, coefficients) of each arm: a list multiplies only the methods it applies to,
    so hc under --sinkhorn-iters 5,20,100 is one arm, not three of one model."""
    found = []
    for method in opt.methods:
        for iters in (opt.sinkhorn_iters or [None]) if method in SINKHORN_METHODS else [None]:
            for coefficients in (opt.coefficients or [None]) if method in COEFFICIENT_METHODS else [None]:
                found.append((method, iters, coefficients))
    return found


def matrix_jobs(opt):
    """Seed-major (every comparison of seed 42 finishes before seed 123 starts, so a node lost mid-day still
    leaves complete comparisons), then deeper models first (longest jobs first packs the GPUs). With --nodes N,
    node i runs the jobs i, i+N, i+2N, ... of that order: every node gets a mix of long and short jobs."""
    jobs = []
    for seed in opt.seeds:
        for depth in opt.depths:
            for method, iters, coefficients in arms(opt):
                name = run_name(method, depth, seed, opt.preset, iters, coefficients,
                                launcher_settings(method, opt.preset, opt.extra))
                jobs.append(Job(name, method, depth, seed, len(jobs) % opt.nodes, iters, coefficients))
    for job in jobs:
        status = read_json(opt.out / job.name / "status.json")
        if status.get("state") in ("completed", "diverged"):
            job.state = "skipped_" + status["state"]
        if isinstance(status.get("step"), int):
            job.step = status["step"]
        micro = read_json(opt.out / job.name / "launcher.json").get("micro_batch_size")
        if isinstance(micro, int) and micro > 0:      # halved after an OOM in an earlier invocation: stays halved
            job.micro = micro
    return jobs


# ----------------------------------------------------------------------------------------------
# GPUs and the trainer command

class RunError(Exception):
    """The matrix cannot run as asked (no GPU left, another launcher on --out): one line, exit 1."""


def warn(message):
    print(f"{PROG}: warning: {message}", file=sys.stderr, flush=True)


def discover_gpus(opt):
    """The GPU indices to use; ['cpu'] (one slot, its jobs see no GPU) when none is found. --gpus may name only
    GPUs of this node (with none found: of the documented 8-GPU node, the one a plan is then for)."""
    listed = nvidia_smi("index")
    node = listed or [str(i) for i in range(DOCUMENTED_NODE_GPUS)]
    unknown = [g for g in opt.gpus or [] if g not in node]
    if unknown:
        raise UsageError(f"--gpus {','.join(unknown)}: this node has GPU(s) {','.join(node)}"
                         + ("" if listed else " (none found here: the documented node's)"))
    found = opt.gpus if opt.gpus is not None else listed
    gpus = [g for g in found if g not in opt.exclude_gpus]
    if found and not gpus:
        raise RunError("--exclude-gpus leaves no GPU to use")
    if not gpus:
        if opt.gpus_per_run > 1:
            warn(f"no GPU found: --gpus-per-run {opt.gpus_per_run} ignored, one CPU slot")
            opt.gpus_per_run = 1
        return ["cpu"]
    if len(gpus) < opt.gpus_per_run:
        raise UsageError(f"--gpus-per-run {opt.gpus_per_run} but only {len(gpus)} GPU(s): {' '.join(gpus)}")
    return gpus


def nvidia_smi(query, gpu=None):
    """One nvidia-smi field per GPU (RUN_EXPERIMENTS_NVIDIA_SMI stands in for it); [] when there is none."""
    command = shlex.split(os.environ.get("RUN_EXPERIMENTS_NVIDIA_SMI", "nvidia-smi"))
    command += [f"--query-gpu={query}", "--format=csv,noheader"] + (["-i", gpu] if gpu else [])
    try:
        listing = subprocess.run(command, capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    values = [line.strip() for line in listing.splitlines() if line.strip()]
    return [v for v in values if v.isdigit()] if query == "index" else values


def trainer_script():
    """The trainer as one process: RUN_EXPERIMENTS_TRAINER, else train_c4.py with this python."""
    if os.environ.get("RUN_EXPERIMENTS_TRAINER"):
        return shlex.split(os.environ["RUN_EXPERIMENTS_TRAINER"])     # used as-is for every --gpus-per-run
    return [sys.executable, str(ROOT / "train_c4.py")]


def trainer_base(opt):
    """The trainer command the run's flags are appended to."""
    if opt.gpus_per_run > 1 and not os.environ.get("RUN_EXPERIMENTS_TRAINER"):
        return [sys.executable, str(ROOT / "torchrun.py"), "--standalone",       # torchrun without its traceback
                f"--nproc_per_node={opt.gpus_per_run}", str(ROOT / "train_c4.py")]
    return trainer_script()


def trainer_flags(opt, job):
    flags = ["--residual", job.method, "--depth", str(job.depth), "--seed", str(job.seed), "--run-name", job.name,
             "--out", str(opt.out)]
    flags += ["--steps", str(opt.steps)] if opt.steps else []
    flags += ["--preset", opt.preset] if opt.preset else []
    flags += ["--sinkhorn-iters", str(job.sinkhorn_iters)] if job.sinkhorn_iters else []
    flags += ["--coefficients", job.coefficients] if job.coefficients else []
    flags += ["--data-seed", str(job.seed)] if opt.vary_data_seed else []
    flags += ["--resume", "auto"]
    # FSDP shards parameters and optimizer state, so a 2.5B model leaves room for activations
    flags += ["--parallel", "fsdp"] if opt.gpus_per_run > 1 else []
    flags += opt.extra
    # last, so that they win over the extra flags (argparse keeps the last value)
    flags += ["--micro-batch-size", str(job.micro)] if job.micro else []
    flags += ["--batch-size", str(job.batch)] if job.batch else []
    return flags


def slot_label(opt, gpus, i):
    """The GPUs of the i-th slot in the initial layout."""
    return "cpu" if gpus == ["cpu"] else ",".join(gpus[i * opt.gpus_per_run:(i + 1) * opt.gpus_per_run])


def slot_count(opt, gpus):
    return 1 if gpus == ["cpu"] else len(gpus) // opt.gpus_per_run


def log_name(opt):
    return "matrix.log" if opt.nodes == 1 else f"matrix.node{opt.node_rank}.log"


def lock_name(opt):
    return ".launcher.lock" if opt.nodes == 1 else f".launcher.node{opt.node_rank}.lock"


# ----------------------------------------------------------------------------------------------
# --summary and the end-of-matrix report

def show_matrix(opt, whole=False):
    """The matrix view (report.py --watch) from this launcher's matrix log, or (whole) from every node's, and
    the runs' status.json."""
    from hcstudy.report.live import watch_view  # numpy: only for the view
    from hcstudy.report.runs import ReportError
    try:
        print(watch_view(opt.out, log=None if whole else log_name(opt)), flush=True)
    except (ReportError, OSError) as error:
        print(f"report: {error}", flush=True)


def print_report(opt):
    script = Path(os.environ.get("RUN_EXPERIMENTS_REPORT") or ROOT / "report.py")
    print(flush=True)
    if not script.is_file():
        print(f"No results table: {script} does not exist yet. Raw results: {opt.out}/*/metrics.jsonl, "
              f"{opt.out}/*/status.json", flush=True)
        return
    print(f"Results ({sys.executable} {script} {opt.out}):", flush=True)
    code = subprocess.run([sys.executable, str(script), str(opt.out)]).returncode
    if code:
        warn(f"{script} exited {code}; the runs themselves are not affected")
    plots = sorted(p for pattern in ("*.png", "*/*.png", "*.pdf", "*/*.pdf", "*.svg", "*/*.svg")
                   for p in opt.out.glob(pattern))
    if plots:
        print(f"Plots ({len(plots)}):", *(f"  {p}" for p in plots), sep="\n")
        if (opt.out / "report" / "results.md").is_file():
            print(f"Table, verdict and plots together: {opt.out / 'report' / 'results.md'}")
    else:
        print(f"No plot files found under {opt.out} (report.py writes them; see its output above).")


def summary(opt):
    if not any(opt.out.glob("matrix*.log")) and not any(opt.out.glob("*/status.json")):
        print(f"{PROG}: error: --summary: no matrix has run in '{opt.out}' (no matrix.log, no run folder); "
              "check --out", file=sys.stderr)
        return EXIT_USAGE
    show_matrix(opt, whole=True)    # the matrix as the folder's launchers ran it, not as these flags make it
    print_report(opt)
    return EXIT_OK


# ----------------------------------------------------------------------------------------------
# --dry-run: the plan, nothing run, nothing written

def human(seconds):
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min" if seconds < 7200 else \
        f"{seconds / 3600:.1f} h"


def queue_schedule(durations, slots, stagger=0.0):
    """Wall time of jobs started in queue order, each on the first slot to become free, launches at least
    `stagger` seconds apart: what the launcher does (list scheduling, not the sum over slots)."""
    free, last_launch = [0.0] * slots, -math.inf
    for duration in durations:
        slot = min(range(slots), key=free.__getitem__)
        last_launch = max(free[slot], last_launch + stagger)
        free[slot] = last_launch + duration
    return max(free, default=0.0)


# ----------------------------------------------------------------------------------------------
# Before the first launch, and --dry-run: every job checked and planned by the trainer itself

DOCUMENTED_NODE_GPUS = 8       # the node README documents: 8 x plan.ASSUMED_GPU (H100 SXM)


class JobsRefused(Exception):
    """The trainer refuses some job's flags or memory: nothing is launched (exit 2)."""


@dataclass
class Node:
    """What a plan is for: the GPU indices (['cpu']: one CPU slot), their model as nvidia-smi names it ('': not
    known here, the trainer's planner assumes the documented node's), one card's memory in GiB (None: the named
    card's), and whether no GPU was found here (the plan is then for the documented node)."""
    gpus: list
    gpu: str
    card_gib: float | None = None
    documented: bool = False


def this_node(opt, gpus):
    """The node a plan is for. Without a GPU: the CPU when the jobs are to run (or be calibrated) here, else the
    documented node (8 x H100 SXM, or --gpu-type); --gpus and --gpu-type say otherwise."""
    if gpus == ["cpu"]:
        if not opt.dry_run or opt.calibrate:
            return Node(["cpu"], "cpu")
        return Node([str(i) for i in range(DOCUMENTED_NODE_GPUS)], opt.gpu_type or "", documented=True)
    memory = (nvidia_smi("memory.total", gpus[0]) or [""])[0].split()
    card_gib = int(memory[0]) / 1024 if memory and memory[0].isdigit() else None      # MiB
    return Node(gpus, opt.gpu_type or (nvidia_smi("name", gpus[0]) or [""])[0], card_gib)


def plan_jobs(opt, jobs, node, measured=None):
    """The trainer's answer for `jobs` on `node`: train_c4.py --plan-jobs judges each job's flags with its own checks
    and plans its micro-batch, memory and time (hcstudy/planner), in one process for the whole matrix (hcstudy/launcher never
    imports the trainer). {"gpu", "assumptions", "jobs": {name: answer}}."""
    check = read_json(opt.out / "gpu_check" / "result.json")        # `run_experiments.sh --check`'s timings
    request = {"gpu": node.gpu, "world": opt.gpus_per_run, "card_gib": node.card_gib,
               "jobs": [{"flags": trainer_flags(opt, job), "done_steps": job.step or 0, "check": check,
                         "finished": bool(job.skipped_as),
                         "tokens_per_s": (measured or {}).get(f"{job.method}_d{job.depth}")} for job in jobs]}
    command = trainer_script() + ["--plan-jobs"]
    try:
        # in this folder, as the jobs will run: a relative --out or --data means the same to the check and to them
        done = subprocess.run(command, input=json.dumps(request), capture_output=True, text=True, timeout=900)
        answer = json.loads(done.stdout.strip().splitlines()[-1])
        answer["jobs"] = dict(zip((job.name for job in jobs), answer["jobs"], strict=True))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, KeyError, TypeError):
        tail = " ".join((locals().get("done") and done.stderr or "no output").strip().splitlines()[-2:])
        raise RunError(f"the trainer could not check the jobs ({shlex.join(command)}: {tail})") from None
    refused = {}
    for name, job_answer in answer["jobs"].items():
        if "error" in job_answer:
            refused.setdefault(job_answer["error"], []).append(name)
    if refused:
        raise JobsRefused("\n".join(f"train_c4.py refuses {names[0]}" + (f" and {len(names) - 1} more job(s)"
                                     if len(names) > 1 else "") + f": {error}" for error, names in refused.items()))
    return answer


def check_before_launch(opt, jobs, node):
    """Every job of this node checked by the trainer before the first launch; the planned micro-batches kept
    (an out-of-memory exit before config.json is written halves what the trainer planned). A finished run is
    checked too, so that changed settings never pass for its results: the trainer refuses them, or with
    --allow-changed-settings answers with the changes and the run is launched for the trainer to continue."""
    mine = [j for j in jobs if j.node == opt.node_rank]
    answers = plan_jobs(opt, mine, node)["jobs"] if mine else {}
    relaunch_changed(mine, answers)
    for job in mine:
        if not job.skipped_as:
            job.planned = answers[job.name]


def relaunch_changed(jobs, answers):
    """A finished run the trainer answered with changed settings (--allow-changed-settings) is launched again, for
    the trainer to continue it under the new ones."""
    for job in jobs:
        if job.skipped_as and answers[job.name].get("changes"):
            job.state = "pending"


def fill_node(opt, jobs, gpus):
    """--quick runs fewer jobs than an 8-GPU node has GPUs: give each run more GPUs (FSDP), or say why not."""
    todo = [j for j in jobs if j.node == opt.node_rank and not j.skipped_as]
    if opt.mode != "quick" or not todo or len(todo) * opt.gpus_per_run >= len(gpus):
        return
    if gpus == ["cpu"]:
        print(f"--quick: no GPU found, the {len(todo)} run(s) go one at a time on the CPU")
        return
    if opt.gpus_per_run_given:
        idle = len(gpus) - len(todo) * opt.gpus_per_run
        print(f"--quick: {len(todo)} run(s) x {opt.gpus_per_run} GPU(s) leave {idle} of {len(gpus)} GPUs idle: "
              f"--gpus-per-run {opt.gpus_per_run} was given")
        return
    opt.gpus_per_run = max(k for k in (1, 2, 4, 8) if len(todo) * k <= len(gpus))
    print(f"--quick: {len(todo)} run(s) on {len(gpus)} GPUs: {opt.gpus_per_run} GPUs per run (FSDP), so that every "
          "GPU works; --gpus-per-run 1 keeps one each")


def calibrate(opt, jobs, node, folder):
    """opt.calibrate_steps steps of each distinct method x depth into `folder`, side by side on the slots as in
    the matrix, a wave at a time; the trainer times its own steps (tokens_per_s in metrics.jsonl). Returns
    {method_d{depth}: tokens/s}; a run that fails or times no step ends the dry run (exit 1, its log's tail)."""
    plan_jobs(opt, jobs, node)               # flags and memory first: a refused job would only fail here
    keys, wave, slots, steps = {}, [], slot_count(opt, node.gpus), str(opt.calibrate_steps)
    for job in jobs + [None]:
        if job is not None and f"{job.method}_d{job.depth}" not in keys:
            key = keys[f"{job.method}_d{job.depth}"] = f"{job.method}_d{job.depth}"
            # last, so that they win: a throw-away run, no W&B, evaluation and checkpoint only at its end
            cmd = trainer_base(opt) + trainer_flags(opt, job) + [
                "--out", str(folder), "--run-name", key, "--steps", steps, "--resume", "never", "--wandb", "disabled",
                "--eval-every", steps, "--metrics-every", steps, "--ckpt-every", steps]
            slot = slot_label(opt, node.gpus, len(wave))
            print(f"Calibrating {key} on {'the CPU' if slot == 'cpu' else 'GPU ' + slot}: {steps} steps", flush=True)
            with open(folder / f"{key}.log", "w") as log:
                env = dict(os.environ, CUDA_VISIBLE_DEVICES="" if slot == "cpu" else slot)
                wave.append((key, subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, env=env)))
        if len(wave) == slots or (job is None and wave):      # a wave fills every slot once; the last may not
            for key, process in wave:
                rate = measured_rate(folder, key, opt.calibrate_steps) if process.wait() == 0 else None
                if rate is None:
                    tail = (folder / f"{key}.log").read_text(errors="replace").strip().splitlines()[-2:]
                    raise RunError(f"--calibrate: {key} exited {process.returncode} without a timed step: "
                                   f"{' '.join(tail)}")
                keys[key] = rate
            wave = []
    return keys


def measured_rate(folder, key, steps):
    """The median tokens/s of the calibration run's timed steps (the first third is warm-up), or None."""
    warmup = steps // 3
    try:
        with open(folder / key / "metrics.jsonl") as f:
            rates = [r["tokens_per_s"] for r in map(json.loads, f) if r.get("tokens_per_s") and r["step"] > warmup]
    except (OSError, ValueError):
        rates = []
    return statistics.median(rates) if rates else None


def hours_range(seconds):
    return f"{seconds[0] / 3600:.1f}-{seconds[1] / 3600:.1f} h" if seconds[1] >= 7200 else \
        f"{seconds[0] / 60:.0f}-{seconds[1] / 60:.0f} min"


def wall_and_cost(opt, jobs, answers, node):
    """The lines on the wall time of the queue (per node with --nodes) and what the nodes cost, as (low, high)."""
    slots = slot_count(opt, node.gpus)
    seconds = {node_rank: [answers[j.name]["seconds"] for j in jobs if j.node == node_rank]
               for node_rank in range(opt.nodes)}
    if any(None in s for s in seconds.values()):
        return ["Wall time: unknown: no step time for this GPU (--calibrate measures one)"]
    walls = {n: [queue_schedule([d[i] for d in s], slots, opt.stagger) for i in (0, 1)] for n, s in seconds.items()}
    wall = [max(w[i] for w in walls.values()) for i in (0, 1)]
    total = [sum(d[i] for s in seconds.values() for d in s) for i in (0, 1)]
    where = f"{slots} slot(s)" + (f" on each of {opt.nodes} nodes" if opt.nodes > 1 else "")
    lines = [f"Wall time: {sum(map(len, seconds.values()))} job(s) on {where}, each started in queue order on the "
             f"first free slot, launches {opt.stagger:g} s apart: {hours_range(wall)} (the jobs add up to "
             f"{hours_range(total)}; retries and waits for data not included)"]
    if opt.nodes > 1:
        lines.append("  per node: " + ", ".join(f"node {n} {hours_range(w)}" for n, w in walls.items()))
    if node.gpus == ["cpu"]:
        return lines + ["Cost: no GPU-hours, the jobs run on the CPU"]
    node_gpus, dollars = len(node.gpus) * opt.nodes, [w / 3600 * opt.price for w in wall]
    return lines + [f"Cost at ${opt.price:.2f} per GPU-hour: {node_gpus} GPU(s) x {hours_range(wall)} = "
                    f"${node_gpus * dollars[0]:,.0f}-${node_gpus * dollars[1]:,.0f} for the node"
                    f"{'s' if opt.nodes > 1 else ''}; the jobs themselves use "
                    f"{opt.gpus_per_run * total[0] / 3600:,.0f}-{opt.gpus_per_run * total[1] / 3600:,.0f} GPU-hours"]


def name_width(jobs):
    """The run-name column: as wide as the longest name, so that the columns stay aligned for a long arm's name."""
    return max([17, *(len(job.name) for job in jobs)])


def job_line(opt, job, slot, answer, width):
    where = f"node {job.node} " if opt.nodes > 1 else ""
    return (f"{job.name:<{width}} {where + slot:<18} micro-batch {job.micro or answer['micro']}"
            + (" (auto)" if answer.get("auto") and not job.micro else "") + f", global batch {answer['batch']}"
            + (f", {answer['memory']}" if answer.get("memory") else "")
            + (f", {answer['path']} path" if answer.get("path") else "")
            + (f", {hours_range(answer['seconds'])} ({answer['basis'].split(',')[0].split(': ')[-1]})"
               if answer.get("seconds") else "")
            + (f", resumes (step {job.step})" if job.step is not None else ""))


def dry_run(opt, jobs, node):
    with tempfile.TemporaryDirectory(prefix="run_experiments_calibrate.") as folder:
        mine = [j for j in jobs if j.node == opt.node_rank and not j.skipped_as]
        measured = calibrate(opt, mine, node, Path(folder)) if opt.calibrate and mine else None
    answer = plan_jobs(opt, jobs, node, measured)       # finished runs too: changed settings show here as well
    relaunch_changed(jobs, answer["jobs"])
    todo = [j for j in jobs if not j.skipped_as]
    print(plan_header(opt, jobs, node, answer["gpu"]))
    started, width = dict.fromkeys(range(opt.nodes), 0), name_width(jobs)
    for job in jobs:
        if job.skipped_as:
            print(f"{job.name:<{width}} skip ({job.skipped_as})")
            continue
        slot = slot_label(opt, node.gpus, started[job.node]) if started[job.node] < slot_count(opt, node.gpus) else None
        started[job.node] += 1
        label = "CPU" if slot == "cpu" else f"GPU {slot}" if slot else "next free slot"
        print(job_line(opt, job, label, answer["jobs"][job.name], width))
        print(f"    CUDA_VISIBLE_DEVICES={'' if slot == 'cpu' else slot or '<slot>'} "
              f"{shlex.join(trainer_base(opt) + trainer_flags(opt, job))}")
    if measured:
        print(f"Times from --calibrate: the median tokens/s of steps {opt.calibrate_steps // 3 + 1}-"
              f"{opt.calibrate_steps} of each configuration, measured just now (start-up and warm-up excluded): "
              + ", ".join(f"{key} {rate:,.0f}" for key, rate in measured.items()))
    for line in answer["assumptions"] + (wall_and_cost(opt, todo, answer["jobs"], node) if todo else []):
        print(line)
    print(f"Dry run: no job was launched and nothing was written to {opt.out} (the calibration ran in a temporary "
          "folder)." if opt.calibrate else "Dry run: nothing was launched or written.")
    return EXIT_OK


def plan_header(opt, jobs, node, gpu):
    nodes = f" x {opt.nodes} nodes (this is node {opt.node_rank})" if opt.nodes > 1 else ""
    if node.gpus == ["cpu"]:
        return (f"Plan ({opt.mode}): {len(jobs)} runs; no GPU found: one CPU slot{nodes}, jobs run one at a time; "
                f"out: {opt.out}")
    probed = "\nEvery GPU is probed before the first launch; an unhealthy one is left out."
    if node.documented:
        where, probed = (f"the documented node, {len(node.gpus)} x {gpu} (no GPU found here: --gpus and --gpu-type "
                         "plan another)"), ""
    else:
        assumed = "" if node.gpu else " (assumed: nvidia-smi names no GPU)"
        where = f"{len(node.gpus)} x {gpu}{assumed} [GPUs: {' '.join(node.gpus)}]"
    return (f"Plan ({opt.mode}): {len(jobs)} runs for {where}{nodes}: {slot_count(opt, node.gpus)} slot(s) of "
            f"{opt.gpus_per_run} GPU(s), launches >= {opt.stagger:g}s apart; out: {opt.out}{probed}")


# ----------------------------------------------------------------------------------------------
# --slurm: the matrix as a SLURM job array, one run per task, and a report job after it

SLURM_MARGIN = 1.25, 600       # a task asks for its planned time x 1.25 + 10 minutes (start-up, evaluation, probes)


def hms(seconds):
    seconds = int(math.ceil(seconds))
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


def submit(command):
    """sbatch --parsable ...: the job id."""
    try:
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300)
    except (OSError, subprocess.SubprocessError) as error:
        raise RunError(f"cannot run sbatch ({error}); --slurm needs a SLURM login node") from None
    if done.returncode:
        raise RunError(f"sbatch refused the job: {(done.stderr or done.stdout).strip().splitlines()[-1:]}")
    return done.stdout.strip().split(";")[0]


def task_time(opt, jobs):
    """One --time for every task of the array: the longest planned run plus the margin, at most --slurm-time.
    The GPUs are on the compute nodes: the plan assumes the GPU nvidia-smi names here, else the documented node's."""
    seconds = [answer["seconds"] for answer in plan_jobs(opt, jobs, Node([], (nvidia_smi("name") or [""])[0]))
               ["jobs"].values()]
    if not seconds or None in seconds:
        return opt.slurm_time, "no time estimate"
    longest = max(high for _, high in seconds)      # the slow end of the range: a task cut short is requeued
    return min(longest * SLURM_MARGIN[0] + SLURM_MARGIN[1], opt.slurm_time), f"the longest planned run {human(longest)}"


def submit_slurm(opt, jobs):
    todo, width = [j for j in jobs if not j.skipped_as], name_width(jobs)
    for job in jobs:
        if job.skipped_as:
            print(f"{job.name:<{width}} skip ({job.skipped_as})")
    if not todo:
        print(f"Nothing to submit: every run in {opt.out} completed or diverged.")
        return EXIT_OK
    if not opt.dry_run and shutil.which("sbatch") is None:
        raise RunError("sbatch not found: --slurm submits from a SLURM login node (preview: --slurm --dry-run)")
    opt.out = opt.out.resolve()          # the tasks start in the repository, not in this shell's folder
    # one file per submission: a task of an earlier array still reads its own line
    tasks = opt.out / f"slurm-matrix-{time.strftime('%Y%m%d-%H%M%S')}.txt"
    lines = [shlex.join(trainer_flags(opt, job)) for job in todo]
    seconds, why = task_time(opt, todo)
    array_command = ["sbatch", "--parsable", f"--array=0-{len(todo) - 1}", "--nodes=1",
                     f"--gpus-per-node={opt.gpus_per_run}", f"--time={hms(seconds)}",
                     f"--job-name=matrix-{opt.out.name}", str(ROOT / "slurm" / "run.sbatch"), "--matrix", str(tasks)]
    report_command = ["sbatch", "--parsable", "--dependency=afterany:ARRAY_JOB_ID",
                      f"--job-name=report-{opt.out.name}", str(ROOT / "slurm" / "report.sbatch"), str(opt.out)]
    if opt.dry_run:
        print(*(f"{job.name:<{width}} task {i}: {line}" for i, (job, line) in enumerate(zip(todo, lines))), sep="\n")
        print(f"Dry run: would write {tasks} (the lines above) and submit, with --time from {why}:\n  "
              f"{shlex.join(array_command)}\n  {shlex.join(report_command)}\nNothing was submitted or written.")
        return EXIT_OK
    opt.out.mkdir(parents=True, exist_ok=True)
    tasks.write_text("".join(line + "\n" for line in lines))
    try:
        array = submit(array_command)
    except RunError:
        tasks.unlink()                   # no task will read it
        raise
    report_command[2] = f"--dependency=afterany:{array}"
    report = submit(report_command)
    for i, job in enumerate(todo):
        print(f"{job.name:<{width}} task {array}_{i}")
    print(f"Submitted job array {array}: {len(todo)} run(s), each on one node with {opt.gpus_per_run} GPU(s), "
          f"--time {hms(seconds)} ({why}, x{SLURM_MARGIN[0]:g} + {SLURM_MARGIN[1] // 60} min, at most --slurm-time "
          f"{hms(opt.slurm_time)}); a run still going at the limit saves, is requeued and resumes. The report: job "
          f"{report}, after the array. The runs' flags: {tasks}. Watch: squeue -j {array},{report}")
    return EXIT_OK


# ----------------------------------------------------------------------------------------------
# The run: the queue, slots that free up, and what each exit code means

class LauncherGone(Exception):
    """The bash side closed the conversation (it was killed): nothing left to decide."""


class Bash:
    """The process-control side: one request per line, its answer lines up to `end`. Every answer may carry
    `signal NAME` lines: a Ctrl-C or SIGTERM the launcher received since its last answer."""

    def __init__(self, requests, replies):
        self.requests, self.replies = os.fdopen(requests, "w"), os.fdopen(replies)
        self.signals = []

    def ask(self, *words):
        try:
            self.requests.write(shlex.join(map(str, words)) + "\n")
            self.requests.flush()
        except BrokenPipeError:
            raise LauncherGone from None
        answer = []
        for line in self.replies:
            words = line.split(maxsplit=2)
            if words == ["end"]:
                return answer
            if words[:1] == ["signal"]:
                self.signals.append(words[1])
            else:
                answer.append(words)
        raise LauncherGone


class Log:
    """Timestamped decisions, to the terminal and to the matrix log."""

    def __init__(self, path):
        self.path = path

    def __call__(self, event, text):
        now = time.time()
        stamp = time.strftime("%Y-%m-%dT%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}" \
            + time.strftime("%z", time.localtime(now))
        line = f"{stamp} {event} {text}"
        print(line, flush=True)
        with open(self.path, "a") as f:
            f.write(line + "\n")


def tail_lines(path, count):
    """The last `count` lines of a log, read from its last 64 KiB: a train.log grows with every attempt."""
    try:
        with open(path, "rb") as f:
            f.seek(max(0, f.seek(0, os.SEEK_END) - 65536))
            text = f.read().decode(errors="replace")
    except OSError:
        return []
    return text.replace("\r", "").splitlines()[-count:]


def newest_checkpoint(folder):
    """`step-N` of the run's newest complete checkpoint (one with its marker), None without one: where its trainer
    resumes, unless the checksums fail (train.log then says which one it took)."""
    steps = [int(d.name[5:]) for d in Path(folder, "checkpoints").glob("step-*")
             if d.name[5:].isascii() and d.name[5:].isdigit() and (d / CHECKPOINT_MARKER).is_file()]
    return f"step-{max(steps)}" if steps else None


def last_line(path):
    return "".join(tail_lines(path, 1))[:300]


class Matrix:
    def __init__(self, opt, jobs, gpus, bash):
        self.opt, self.bash, self.gpus = opt, bash, gpus
        self.jobs = [j for j in jobs if j.node == opt.node_rank]
        self.base = trainer_base(opt)
        self.cpu = gpus == ["cpu"]
        self.gpu_state = dict.fromkeys(gpus, "free")           # free|busy|quarantined
        self.failed_runs = {g: [] for g in gpus}               # the runs that had a device error on a GPU
        self.queue, self.running = [], {}
        self.stopping, self.stop_status, self.stop_deadline = False, EXIT_OK, 0.0
        self.last_launch = None
        self.probes = Path(tempfile.mkdtemp(prefix="run_experiments."))
        self.log = Log(opt.out / log_name(opt))

    # -- start-up -------------------------------------------------------------------------------
    def start(self):
        o = self.opt
        if self.bash.ask("lock", o.out / lock_name(o)) != [["ok"]]:
            raise RunError(f"another launcher, or jobs of a killed one, are still running on {o.out} (see: fuser -v "
                           f"{o.out / lock_name(o)}); stop them or wait, then run this again")
        preset = o.preset or "c4"
        data = extra_value(o.extra, "--data") or f"preset {preset} default"
        self.log("START", f"{PROG} pid={os.getppid()} mode={o.mode} runs={len(self.jobs)} gpus={' '.join(self.gpus)} "
                          f"gpus_per_run={o.gpus_per_run} stagger={o.stagger:g}s max_retries={o.max_retries} "
                          f"data={data}"
                          + (f" node={o.node_rank}/{o.nodes}" if o.nodes > 1 else "")
                          + f" extra={shlex.join(o.extra)}")
        # the line report.py --watch reads the matrix from (queue order, slots, price, and the trainer's planned
        # seconds, the middle of its range: the view's ETA until steps are timed)
        planned = ",".join(f"{j.name}:{sum(j.planned['seconds']) / 2:.0f}" for j in self.jobs
                           if j.planned.get("seconds"))
        self.log("QUEUE", f"slots={slot_count(o, self.gpus)} gpus_per_run={o.gpus_per_run} gpus={','.join(self.gpus)} "
                          f"price_per_gpu_hour={o.price:g} runs={','.join(j.name for j in self.jobs)} "
                          f"planned_s={planned}")
        for job in self.jobs:
            if job.skipped_as:
                self.log("SKIP", f"{job.name} already {job.skipped_as} (status.json)")
            else:
                self.queue.append(job)
        if not self.cpu and self.queue:
            for gpu, status in self.bash.ask("probe", self.probes, *self.gpus):
                if status == "0":
                    self.log("PROBE", f"gpu={gpu} healthy")
                else:
                    self.quarantine(gpu, f"failed the start-up probe: {self.probe_reason(gpu, int(status))}")
            if self.healthy() < o.gpus_per_run:
                self.log("ERROR", f"too few GPUs passed the health probe ({self.healthy()} healthy, {o.gpus_per_run} "
                                  "needed per run); see the QUARANTINE lines above (on a machine without GPUs, leave "
                                  "out --gpus)")

    def probe_reason(self, gpu, status):
        """A failed probe's last line, else what its exit status says."""
        return (last_line(self.probes / f"probe{gpu}.log") or (
            "timed out, no output" if status == 124 else f"killed by signal {status - 128}, no output" if status > 128
            else f"exit status {status}, no output"))

    def quarantine(self, gpu, reason):
        self.gpu_state[gpu] = "quarantined"
        self.log("QUARANTINE", f"gpu={gpu} {reason}; it is not used again in this matrix")

    def healthy(self):
        return sum(state != "quarantined" for state in self.gpu_state.values())

    # -- the loop -------------------------------------------------------------------------------
    def run(self):
        self.start()
        last_view = time.time()        # the first view a period after the start
        while self.running or not self.stopping and self.queue:
            self.handle_signals()
            if self.stopping:
                if time.time() > self.stop_deadline:
                    self.log("STOP", f"jobs still running {self.opt.stop_timeout}s after SIGTERM: killing them")
                    self.bash.ask("kill", "KILL")
                    self.stop_deadline = time.time() + 3600
            elif self.healthy() < self.opt.gpus_per_run and not self.cpu:
                for job in self.queue:
                    self.fail(job, "no healthy GPU left to run it")
                self.queue = []
                continue
            elif self.try_launch():
                continue           # poll again right away: another slot may be free
            for _, name, status in self.bash.ask("wait", int(self.wait_seconds() * 1000), int(self.opt.poll * 1000)):
                self.on_exit(self.running.pop(name), int(status))
            if self.opt.watch_every and self.running and time.time() - last_view >= self.opt.watch_every:
                last_view = time.time()
                show_matrix(self.opt)
        self.handle_signals()
        return self.finish()

    def wait_seconds(self):
        """One poll, or less when the stagger ends sooner, so launches are not late by a poll."""
        wait = self.opt.poll
        if not self.stopping and self.queue and self.last_launch is not None:
            left = self.last_launch + self.opt.stagger - time.time()
            wait = left if 0 < left < wait else wait
        return wait

    def handle_signals(self):
        while self.bash.signals:
            name = self.bash.signals.pop(0)
            if self.stopping:
                self.log("STOP", f"second SIG{name}: killing the remaining jobs without waiting for their checkpoints")
                self.bash.ask("kill", "KILL")
                continue
            self.stopping, self.stop_status = True, EXIT_SIGINT if name == "INT" else EXIT_SIGTERM
            self.stop_deadline = time.time() + self.opt.stop_timeout
            self.log("STOP", f"SIG{name} received: sending SIGTERM to {len(self.running)} job(s); each saves a "
                             "checkpoint and exits; run the same command again to resume")
            self.bash.ask("kill", "TERM")

    # -- launching ------------------------------------------------------------------------------
    def pick_gpus(self, job):
        """The GPUs for a job, or None. A job avoids the GPUs it had a device error on, as long as enough other
        healthy GPUs exist (then it waits for them to free up)."""
        if self.cpu:
            return "cpu" if self.gpu_state["cpu"] == "free" else None
        k = self.opt.gpus_per_run
        usable = [g for g, state in self.gpu_state.items() if state != "quarantined"]
        free = [g for g in usable if self.gpu_state[g] == "free"]
        preferred = [g for g in free if g not in job.avoid]
        if len(preferred) >= k:
            return ",".join(preferred[:k])
        if len([g for g in usable if g not in job.avoid]) < k and len(free) >= k:
            return ",".join(free[:k])
        return None

    def try_launch(self):
        """Launch the first ready job that fits a free slot; False when none."""
        now = time.time()
        if self.last_launch is not None and now - self.last_launch < self.opt.stagger:
            return False
        for job in self.queue:
            gpus = job.not_before <= now and self.pick_gpus(job)
            if gpus:
                self.queue.remove(job)
                self.launch(job, gpus)
                return True
        return False

    def launch(self, job, gpus):
        job.attempts += 1
        command = self.base + trainer_flags(self.opt, job)
        folder = self.opt.out / job.name
        folder.mkdir(parents=True, exist_ok=True)
        for g in gpus.split(","):
            self.gpu_state[g] = "busy"
        micro, batch = job.micro or job.planned.get("micro"), job.batch or job.planned.get("batch")
        resume = newest_checkpoint(folder)
        self.log("LAUNCH", f"{job.name} gpus={gpus} attempt={job.attempts}" + (f" resume={resume}" if resume else "")
                           + f" micro_batch={micro} global_batch={batch} "
                           f"cmd: CUDA_VISIBLE_DEVICES={'' if gpus == 'cpu' else gpus} {shlex.join(command)}")
        self.last_launch = time.time()
        job.launched_at = self.last_launch - 1      # a status.json older than this is left from before
        with open(folder / "train.log", "a") as f:
            f.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')}: launcher attempt {job.attempts} on "
                    f"{'CPU' if gpus == 'cpu' else gpus}: {shlex.join(command)}\n")
        self.bash.ask("launch", job.name, gpus, folder / "train.log", *command)
        self.running[job.name] = job
        job.gpus, job.state = gpus, "running"

    def requeue(self, job):
        """To the front of the queue: it has a checkpoint."""
        self.queue.insert(0, job)
        job.state = "pending"

    # -- exits ----------------------------------------------------------------------------------
    def status(self, job):
        """status.json as this attempt left it ({} when it is from an earlier attempt)."""
        return read_json(self.opt.out / job.name / "status.json", newer_than=job.launched_at)

    def trainer_code(self, job, status):
        """A status the trainer does not use (torchrun reports 1 for any failed rank) is replaced by the
        exit_code rank 0 wrote to status.json during this attempt, when there is one."""
        if status in TRAINER_EXIT_CODES:
            return status
        code = self.status(job).get("exit_code")
        return code if code in TRAINER_EXIT_CODES - {EXIT_OK} else status

    def reason(self, job):
        """The trainer's own reason for its exit: status.json, else the last line of train.log."""
        return self.status(job).get("reason") or last_line(self.opt.out / job.name / "train.log")

    def record_death(self, job, code):
        """A trainer that died without recording its end (SIGKILL, rank 0 killed under torchrun) leaves status.json
        `running`: the launcher, which saw the exit, records it as failed."""
        path = self.opt.out / job.name / "status.json"
        status = read_json(path)
        if code in TRAINER_EXIT_CODES or status.get("state") != "running":
            return
        died = f"killed by signal {code - 128}" if code > 128 else f"exit {code}"
        write_json(path, {**status, "state": "failed", "exit_code": code, "updated": time.time(),
                          "reason": f"the trainer ended ({died}) without recording its state; seen by the launcher"})

    def on_exit(self, job, status):
        for g in job.gpus.split(","):
            if self.gpu_state[g] != "quarantined":
                self.gpu_state[g] = "free"
        code = self.trainer_code(job, status)
        self.log("EXIT", f"{job.name} code={status}"
                         + (f" (trainer code {code} from status.json)" if code != status else "") + f" gpus={job.gpus}")
        self.record_death(job, code)
        if self.stopping and code not in (EXIT_OK, EXIT_DIVERGED):
            job.state, job.reason = "interrupted", f"stopped by the launcher (exit {status}); resumes on the next run"
            return
        if code == EXIT_OK:
            job.state = "completed"
            self.log("DONE", f"{job.name} completed")
        elif code == EXIT_DIVERGED:
            job.state, job.reason = "diverged", self.reason(job)
            self.log("DIVERGED", f"{job.name} recorded as a result, not retried: {job.reason}")
        elif code == EXIT_BAD_CONFIG:
            self.fail(job, f"bad arguments or config, not retried: {self.reason(job)}")
            train_log = self.opt.out / job.name / "train.log"
            print(f"---- last lines of {train_log} ----", *tail_lines(train_log, 5), sep="\n", file=sys.stderr,
                  flush=True)
        elif code == EXIT_OOM:
            self.oom_retry(job)
        elif code == EXIT_DEVICE:
            self.device_error(job)
        elif code == EXIT_DATA:
            self.data_retry(job)
        elif code == EXIT_INTERRUPTED:
            self.requeue_or_fail(job, "interrupted (exit 75) but the launcher is not stopping: resuming from its "
                                      "checkpoint",
                                 f"interrupted {self.opt.max_requeues + 1} times; not requeued again")
        else:
            self.retry_or_fail(job, f"exit {status}: {self.reason(job)}")

    def fail(self, job, reason):
        job.state, job.reason = "failed", reason
        self.log("FAILED", f"{job.name} {reason}")

    def retry_or_fail(self, job, why):
        """A retry within --max-retries, else failed."""
        if job.retries < self.opt.max_retries:
            job.retries += 1
            self.log("RETRY", f"{job.name} ({why}) retry {job.retries}/{self.opt.max_retries}; resumes from its "
                              "checkpoint")
            self.requeue(job)
        else:
            self.fail(job, f"{why}; gave up after {self.opt.max_retries} retries")

    def requeue_or_fail(self, job, why, given_up):
        """Requeues (exit 75, device errors) are bounded by RUN_EXPERIMENTS_MAX_REQUEUES."""
        if job.requeues < self.opt.max_requeues:
            job.requeues += 1
            self.log("REQUEUE", f"{job.name} {why}")
            self.requeue(job)
        else:
            self.fail(job, given_up)

    def data_retry(self, job):
        if job.data_retries >= self.opt.max_retries:
            self.fail(job, f"data source unreachable after {self.opt.max_retries} retries: {self.reason(job)}")
            return
        delay = self.opt.data_backoff << job.data_retries
        job.data_retries += 1
        job.not_before = time.time() + delay
        self.log("RETRY", f"{job.name} data source unreachable: retry {job.data_retries}/{self.opt.max_retries} in "
                          f"{delay}s: {self.reason(job)}")
        self.requeue(job)

    def oom_retry(self, job):
        """Halve the micro-batch the run used, keep its global batch; once."""
        micro, batch = self.used_batches(job)
        if job.oom_retried:
            return self.fail(job, f"out of memory again at micro-batch {micro} (after one halving); pass a smaller -- "
                                  "--micro-batch-size or use --gpus-per-run")
        if not isinstance(micro, int):
            return self.fail(job, "out of memory, and its micro-batch is unknown (no config.json from this attempt, "
                                  f"micro-batch {micro or 'not given'}); pass -- --micro-batch-size N")
        if micro <= 1:
            return self.fail(job, "out of memory at micro-batch 1; a GPU cannot hold this run alone: use "
                                  "--gpus-per-run 2 or more")
        batch = batch if isinstance(batch, int) else None
        job.oom_retried, job.micro, job.batch = True, micro // 2, batch or job.batch
        write_json(self.opt.out / job.name / "launcher.json",
                   {"micro_batch_size": job.micro, "reason": f"halved from {micro} after an out-of-memory exit"})
        self.log("RETRY", f"{job.name} out of memory at micro-batch {micro}: retrying once with micro-batch "
                          f"{job.micro}, global batch {batch or 'unchanged (trainer default)'}")
        self.requeue(job)

    def used_batches(self, job):
        """(micro-batch, global batch) this attempt used: its config.json, else what the launcher passed, else what
        the trainer planned before the first launch (the OOM may come before config.json is written)."""
        config = read_json(self.opt.out / job.name / "config.json", newer_than=job.launched_at).get("config", {})
        known = {"micro_batch_size": job.micro or job.planned.get("micro"),
                 "batch_size": job.batch or job.planned.get("batch")}
        return [config[key] if isinstance(config.get(key), int) else value for key, value in known.items()]

    def device_error(self, job):
        """Exit 5: probe the job's GPUs; a GPU that fails the probe, or has now failed two different jobs, is
        quarantined. The job is requeued and avoids these GPUs."""
        if job.gpus == "cpu":
            return self.retry_or_fail(job, "device error on the CPU slot")
        gpus = job.gpus.split(",")
        for g in gpus:
            if job.name not in self.failed_runs[g]:
                self.failed_runs[g].append(job.name)
            job.avoid.add(g)
        for gpu, status in self.bash.ask("probe", self.probes, *gpus):
            if status != "0":
                self.quarantine(gpu, f"failed the probe after a device error in {job.name}: "
                                     f"{self.probe_reason(gpu, int(status))}")
            elif len(self.failed_runs[gpu]) >= 2:
                runs = " ".join(self.failed_runs[gpu])
                self.quarantine(gpu, f"passed the probe but failed two different jobs ({runs})")
            else:
                self.log("PROBE", f"gpu={gpu} healthy after a device error in {job.name}; kept (a second failing job "
                                  "quarantines it)")
        self.requeue_or_fail(job, f"after a device error on gpu {job.gpus}; it will run on other GPUs if any are "
                                  "healthy",
                             f"device errors on {job.requeues + 1} attempts; probably not the hardware: see "
                             f"{self.opt.out / job.name / 'train.log'}")

    # -- the end --------------------------------------------------------------------------------
    def finish(self):
        finished = ("completed", "diverged", "skipped_completed", "skipped_diverged")
        bad = [j for j in self.jobs if j.state not in finished]
        print(f"\nMatrix in {self.opt.out} (log: {self.log.path}):")
        for job in self.jobs:
            state = {"pending": "not started"}.get(job.state, job.state.replace("skipped_", "already "))
            print(f"  {job.name:<16} {state:<18} {job.reason}".rstrip())
        quarantined = [g for g, state in self.gpu_state.items() if state == "quarantined"]
        if quarantined:      # not remembered across invocations: the next start-up probe checks them again
            self.log("END", f"quarantined GPU(s): {' '.join(quarantined)}; to keep them out next time: --exclude-gpus "
                            f"{','.join(quarantined)}")
        ok = len(self.jobs) - len(bad)
        if self.stopping:
            self.log("END", f"stopped: {ok} of {len(self.jobs)} runs finished; run the same command to resume the rest")
            return self.stop_status
        print_report(self.opt)
        if bad:
            self.log("END", f"{ok} of {len(self.jobs)} runs finished; {len(bad)} failed:")
            for job in bad:
                self.log("END", f"failed {job.name}: {job.reason or job.state}")
            return EXIT_FAILED
        self.log("END", f"all {len(self.jobs)} runs finished (completed or diverged)")
        return EXIT_OK


# ----------------------------------------------------------------------------------------------
# main

def probe_gpu():
    """The default GPU health probe (run with CUDA_VISIBLE_DEVICES=one GPU): an allocation, a matmul, and its
    result checked against the CPU's. The last line printed is the reason the launcher logs."""
    import torch
    if not torch.cuda.is_available():
        print("CUDA is not available")
        return 1
    a = torch.randn(1024, 1024, generator=torch.Generator().manual_seed(0))
    got = (a.cuda() @ a.cuda()).cpu()
    torch.cuda.synchronize()
    if not torch.allclose(got, a @ a, rtol=1e-3, atol=1e-2):
        print("matmul result differs from the CPU")
        return 1
    print("ok", torch.cuda.get_device_name(0))
    return 0


def check_setup(opt):
    data, preset = extra_value(opt.extra, "--data"), opt.preset
    if data == "c4" or not data and (preset or "c4") == "c4":
        warn("these runs stream C4 (--data c4) from the Hugging Face Hub: this node must reach huggingface.co for the "
             "whole run, or prefetch shards and pass -- --data '/path/c4/*.json.gz'"
             + (" (HF_HUB_OFFLINE is set: only what is in the HF cache can be read)"
                if os.environ.get("HF_HUB_OFFLINE") else ""))
    if os.environ.get("RUN_EXPERIMENTS_TRAINER"):
        return
    if not (ROOT / "train_c4.py").is_file():
        raise RunError(f"{ROOT / 'train_c4.py'} not found")
    if importlib.util.find_spec("torch") is None:
        raise RunError(f"{sys.executable} cannot import torch; run 'bash setup.sh' to create .venv")


def main(argv):
    if argv[:1] == ["--probe-gpu"]:
        return probe_gpu()
    try:
        opt = parse_options(argv)
    except (UsageError, argparse.ArgumentTypeError) as error:
        print(f"{PROG}: error: {error}\nUsage: {USAGE}\nTry 'bash {PROG} --help' for more.", file=sys.stderr)
        return EXIT_USAGE
    try:
        if opt.summary:
            return summary(opt)
        check_setup(opt)
        jobs = matrix_jobs(opt)
        if opt.slurm:
            return submit_slurm(opt, jobs)
        gpus = discover_gpus(opt)
        node = this_node(opt, gpus)
        fill_node(opt, jobs, node.gpus)
        if opt.gpus_per_run == 1 and extra_value(opt.extra, "--parallel") == "fsdp":
            raise UsageError("-- --parallel fsdp shards a run over its GPUs under torchrun: give --gpus-per-run 2 "
                             "or more")
        if opt.dry_run:
            return dry_run(opt, jobs, node)
        if opt.requests is None:
            raise RunError("the matrix runs through run_experiments.sh (this process only decides): bash "
                           "run_experiments.sh " + shlex.join(argv))
        # the check imports torch and counts each arm's work: seconds with nothing on the screen otherwise
        print(f"{PROG}: planning {sum(j.node == opt.node_rank for j in jobs)} job(s): train_c4.py checks each one's "
              "flags and memory and estimates its time before the first launch", flush=True)
        check_before_launch(opt, jobs, node)
        try:
            opt.out.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            raise RunError(f"cannot create {opt.out}: {error.strerror}") from None
        # Ctrl-C reaches this process with the launcher (one process group): the launcher relays it, in order
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return Matrix(opt, jobs, gpus, Bash(opt.requests, opt.replies)).run()
    except RunError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return EXIT_FAILED
    except UsageError as error:      # what only the node or the matrix shows is wrong: nothing was launched
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except JobsRefused as error:
        for line in str(error).splitlines():
            print(f"{PROG}: error: {line}", file=sys.stderr)
        print(f"{PROG}: nothing was launched", file=sys.stderr)
        return EXIT_USAGE
    except LauncherGone:
        return EXIT_FAILED
    except KeyboardInterrupt:        # Ctrl-C during a dry run or its calibration
        return EXIT_SIGINT


"""The launcher's command line (run_experiments.sh's flags, their help and usage), its settings validated into
Options, the RUN_EXPERIMENTS_* environment knobs, and its two one-line errors."""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hcstudy import arms
from hcstudy.config_flags import OneLineErrorParser
from hcstudy.contract import (EXIT_BAD_CONFIG, EXIT_DATA, EXIT_DEVICE, EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_OK,
                              EXIT_OOM, METHODS)

PILOT = ",".join(arms.in_pilot())

PROG = "run_experiments.sh"
# the launcher's own exit statuses
EXIT_FAILED, EXIT_USAGE, EXIT_SIGINT, EXIT_SIGTERM = 1, 2, 130, 143

MODES = {   # methods, depths, seeds, steps, trainer preset
    "full": ("baseline,hc,mhc", "32,48", "42,123,456", None, None),
    "quick": ("hc,mhc", "32,48", "42", 10000, None),
    "stress": ("hc,mhc", "32,48,64", "42", None, "stress"),
    # the demo preset fixes its own model; --depth 4 (its depth) is passed so the run name is exact
    "demo": ("baseline,hc,mhc", "4", "42", None, "demo"),
    "demo-all": (",".join(METHODS), "4", "42", None, "demo"),
    # the streams' readings against depth on a CPU, under an hour on 2 cores (docs/pilot.md)
    "pilot": (PILOT, "2,4,8", "42,123", None, "demo"),
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

USAGE = (f"bash {PROG} [--full|--quick|--stress|--demo|--demo-all|--pilot] [--residual L] [--depth L] [--seed L]\n"
         "       [--sinkhorn-iters L] [--coefficients L] [--steps N]\n"
         "       [--gpus L] [--exclude-gpus L] [--gpus-per-run K] [--nodes N --node-rank I] [--stagger S]\n"
         "       [--max-retries N] [--out DIR] [--dry-run [--calibrate] [--gpu-type NAME]] [--summary] [--slurm [--dry-run]]\n"
         "       [-- train_c4.py flags]\n"
         f"       bash {PROG} --check [--out DIR] [--dry-run]     (the GPU path on this node: PASS/FAIL per part, "
         "at most 570 s)")


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
            ("demo-all", f"every residual arm ({','.join(METHODS)}) as --demo does"),
            ("pilot", f"{PILOT} x depths 2,4,8 x seeds 42,123 as --demo does ({len(arms.in_pilot()) * 6} CPU runs, "
                      "about an hour on 2 cores; docs/pilot.md), then the table and the depth trend")):
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
        raise UsageError("choose one of --full, --quick, --stress, --demo, --demo-all, --pilot")
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


class RunError(Exception):
    """The matrix cannot run as asked (no GPU left, another launcher on --out): one line, exit 1."""


def warn(message):
    print(f"{PROG}: warning: {message}", file=sys.stderr, flush=True)

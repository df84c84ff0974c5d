"""--slurm: the matrix as a SLURM job array, one run per task, and a report job after it."""
from __future__ import annotations

import shlex
import shutil
import subprocess
import time

from hcstudy import ROOT
from hcstudy.contract import EXIT_OK
from hcstudy.durations import clock, duration
from hcstudy.launcher.dry_run import Node, name_width, plan_jobs
from hcstudy.launcher.jobs import nvidia_smi, trainer_flags
from hcstudy.launcher.options import RunError

SLURM_MARGIN = 1.25, 600       # a task asks for its planned time x 1.25 + 10 minutes (start-up, evaluation, probes)


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
    limit = min(longest * SLURM_MARGIN[0] + SLURM_MARGIN[1], opt.slurm_time)
    return limit, f"the longest planned run {duration(longest)}"


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
                     f"--gpus-per-node={opt.gpus_per_run}", f"--time={clock(seconds)}",
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
          f"--time {clock(seconds)} ({why}, x{SLURM_MARGIN[0]:g} + {SLURM_MARGIN[1] // 60} min, at most --slurm-time "
          f"{clock(opt.slurm_time)}); a run still going at the limit saves, is requeued and resumes. The report: job "
          f"{report}, after the array. The runs' flags: {tasks}. Watch: squeue -j {array},{report}")
    return EXIT_OK

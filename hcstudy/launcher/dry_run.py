"""Every job checked and planned by the trainer itself (`train_c4.py --plan-jobs`), before the first launch and in
--dry-run: the node a plan is for, --calibrate's timings, the wall time and the cost, the dry run's text."""
from __future__ import annotations

import json
import math
import os
import shlex
import statistics
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from hcstudy.contract import EXIT_OK, METRICS_FILE, PLAN_JOBS, PlanJob, PlanRequest, load_check, read_plan_answer
from hcstudy.durations import duration
from hcstudy.launcher.jobs import (DOCUMENTED_NODE_GPUS, nvidia_smi, slot_count, slot_label, trainer_base,
                                   trainer_flags, trainer_script)
from hcstudy.launcher.options import RunError


def queue_schedule(durations, slots, stagger=0.0):
    """Wall time of jobs started in queue order, each on the first slot to become free, launches at least
    `stagger` seconds apart: what the launcher does (list scheduling, not the sum over slots)."""
    free, last_launch = [0.0] * slots, -math.inf
    for seconds in durations:
        slot = min(range(slots), key=free.__getitem__)
        last_launch = max(free[slot], last_launch + stagger)
        free[slot] = last_launch + seconds
    return max(free, default=0.0)


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
    and plans its micro-batch, memory and time (hcstudy.planner), in one process for the whole matrix (the launcher
    never imports the trainer). {"gpu", "assumptions", "jobs": {name: JobAnswer as a dict}}."""
    check = load_check(opt.out)        # `run_experiments.sh --check`'s timings
    request = PlanRequest(node.gpu, opt.gpus_per_run, node.card_gib, [
        PlanJob(trainer_flags(opt, job), job.step or 0, bool(job.skipped_as), check,
                (measured or {}).get(f"{job.method}_d{job.depth}")) for job in jobs])
    command = trainer_script() + [PLAN_JOBS]
    try:
        # in this folder, as the jobs will run: a relative --out or --data means the same to the check and to them
        done = subprocess.run(command, input=request.to_json(), capture_output=True, text=True, timeout=900)
        answer = read_plan_answer(done.stdout, [job.name for job in jobs])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, KeyError, TypeError):
        tail = " ".join((locals().get("done") and done.stderr or "no output").strip().splitlines()[-2:])
        raise RunError(f"the trainer could not check the jobs ({shlex.join(command)}: {tail})") from None
    refused = {}
    for name, job_answer in answer["jobs"].items():
        if job_answer["error"]:
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
                rate = calibrated_tokens_per_s(folder, key, opt.calibrate_steps) if process.wait() == 0 else None
                if rate is None:
                    tail = (folder / f"{key}.log").read_text(errors="replace").strip().splitlines()[-2:]
                    raise RunError(f"--calibrate: {key} exited {process.returncode} without a timed step: "
                                   f"{' '.join(tail)}")
                keys[key] = rate
            wave = []
    return keys


def calibrated_tokens_per_s(folder, key, steps):
    """The median tokens/s of the calibration run's timed steps (the first third is warm-up), or None."""
    warmup = steps // 3
    try:
        with open(folder / key / METRICS_FILE) as f:
            rates = [r["tokens_per_s"] for r in map(json.loads, f) if r.get("tokens_per_s") and r["step"] > warmup]
    except (OSError, ValueError):
        rates = []
    return statistics.median(rates) if rates else None


def matrix_time(opt, jobs, answers, node):
    """`jobs` queued on the slots of `node` (each of opt.nodes): ({node rank: wall}, the wall, the jobs' sum, what the
    nodes cost in dollars), each a [low, high] of seconds (no dollars on the CPU); None where a job has no time."""
    slots = slot_count(opt, node.gpus)
    seconds = {node_rank: [answers[j.name]["seconds"] for j in jobs if j.node == node_rank]
               for node_rank in range(opt.nodes)}
    if any(None in s for s in seconds.values()):
        return None
    walls = {n: [queue_schedule([d[i] for d in s], slots, opt.stagger) for i in (0, 1)] for n, s in seconds.items()}
    wall = [max(w[i] for w in walls.values()) for i in (0, 1)]
    total = [sum(d[i] for s in seconds.values() for d in s) for i in (0, 1)]
    gpus = 0 if node.gpus == ["cpu"] else len(node.gpus) * opt.nodes
    return walls, wall, total, [gpus * w / 3600 * opt.price for w in wall]


def wall_and_cost(opt, jobs, answers, node):
    """The lines on the wall time of the queue (per node with --nodes) and what the nodes cost, as (low, high)."""
    timed = matrix_time(opt, jobs, answers, node)
    if timed is None:
        return ["Wall time: unknown: no step time for this GPU (--calibrate measures one)"]
    walls, wall, total, dollars = timed
    where = f"{slot_count(opt, node.gpus)} slot(s)" + (f" on each of {opt.nodes} nodes" if opt.nodes > 1 else "")
    lines = [f"Wall time: {len(jobs)} job(s) on {where}, each started in queue order on the "
             f"first free slot, launches {opt.stagger:g} s apart: {duration(*wall)} (the jobs add up to "
             f"{duration(*total)}; retries and waits for data not included)"]
    if opt.nodes > 1:
        lines.append("  per node: " + ", ".join(f"node {n} {duration(*w)}" for n, w in walls.items()))
    if node.gpus == ["cpu"]:
        return lines + ["Cost: no GPU-hours, the jobs run on the CPU"]
    return lines + [f"Cost at ${opt.price:.2f} per GPU-hour: {len(node.gpus) * opt.nodes} GPU(s) x {duration(*wall)} = "
                    f"${dollars[0]:,.0f}-${dollars[1]:,.0f} for the node"
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
            + (f", {duration(*answer['seconds'])} ({time_basis(answer)})" if answer.get("seconds") else "")
            + (f", resumes (step {job.step})" if job.step is not None else ""))


def time_basis(answer):
    """What a job's time rests on, in a word: measured (with its step: the median and the spread of its timed steps),
    scaled, calibrated or modelled."""
    word = answer["basis"].split(":")[0].split(",")[0]
    if answer.get("step_point") is None:
        return word
    low, high = answer["step_seconds"]
    return f"{word}: {answer['step_point']:.3g} s a step, {low:.3g}-{high:.3g}"


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

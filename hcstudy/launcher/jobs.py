"""The matrix as jobs in queue order (arms, run names, what earlier invocations left in --out), the GPUs of this
node, and each job's trainer command line."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from dataclasses import dataclass, field

from hcstudy import ROOT
from hcstudy.contract import (COEFFICIENT_METHODS, LAUNCHER_FILE, SINKHORN_METHODS, STATUS_FILE, launcher_settings,
                              matrix_log_name, read_json, run_name)
from hcstudy.launcher.options import RunError, UsageError, warn


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
        status = read_json(opt.out / job.name / STATUS_FILE, {})
        if status.get("state") in ("completed", "diverged"):
            job.state = "skipped_" + status["state"]
        if isinstance(status.get("step"), int):
            job.step = status["step"]
        micro = read_json(opt.out / job.name / LAUNCHER_FILE, {}).get("micro_batch_size")
        if isinstance(micro, int) and micro > 0:      # halved after an OOM in an earlier invocation: stays halved
            job.micro = micro
    return jobs


def discover_gpus(opt):
    """The GPU indices to use; ['cpu'] (one slot, its jobs see no GPU) when none is found. --gpus may name only
    GPUs of this node (with none found: of the documented 8-GPU node, the one a plan is then for)."""
    here = nvidia_smi("index")
    node = here or [str(i) for i in range(DOCUMENTED_NODE_GPUS)]
    unknown = [g for g in opt.gpus or [] if g not in node]
    if unknown:
        raise UsageError(f"--gpus {','.join(unknown)}: this node has GPU(s) {','.join(node)}"
                         + ("" if here else " (none found here: the documented node's)"))
    found = opt.gpus if opt.gpus is not None else here
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
    return matrix_log_name(opt.nodes, opt.node_rank)


def lock_name(opt):
    return ".launcher.lock" if opt.nodes == 1 else f".launcher.node{opt.node_rank}.lock"


def probe_folder_name(opt):
    """Where this node's GPU probe logs go, beside its matrix log: gpu-probes, or with --nodes gpu-probes.node{i}."""
    return "gpu-probes" if opt.nodes == 1 else f"gpu-probes.node{opt.node_rank}"


DOCUMENTED_NODE_GPUS = 8       # the node docs/planning.md documents: 8 x plan.ASSUMED_GPU (H100 SXM)

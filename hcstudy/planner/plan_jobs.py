"""The launcher's check of every job before its first launch: `train_c4.py --plan-jobs` answers with these (memory fit,
micro-batch, kernel path, time) for the node the launcher describes."""
from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

import torch

from hcstudy.config import parse_config
from hcstudy.contract import JobAnswer, PlanJob, TrainerError, plan_answer
from hcstudy.data import resolve_data_files
from hcstudy.model import GPT, count_parameters, embedding_rows
from hcstudy.planner.gpus import ASSUMED_GPU, GPU_MEMORY_GIB, flops_per_token
from hcstudy.planner.memory import (DEFAULT_GPU_MEMORY_GIB, GiB, PlanError, batch_plan, check_memory, memory_plan,
                                    shape_key)
from hcstudy.planner.run_time import (CHECKPOINT_GBPS, FORWARD_SHARE, MEASURED_BASIS, STARTUP_S, gpu_rates,
                                      measured_step, planned_path, rates_text, run_time)
from hcstudy.run_folder import changes_text, check_resumable


def card_bytes(cfg: Config, gpu: str, card_gib: float | None = None) -> float:
    """The memory of one GPU of the launcher's node: --gpu-memory-gb, else what nvidia-smi said (card_gib), else
    the named card's (a card the table lacks is refused), else, for a CPU plan, DEFAULT_GPU_MEMORY_GIB."""
    if cfg.gpu_memory_gb > 0:
        return cfg.gpu_memory_gb * GiB
    if not card_gib and gpu not in (*GPU_MEMORY_GIB, "cpu"):    # a plan for a card of unknown size is a guess
        raise PlanError(f"GPU type {gpu!r} is not in the planner's table ({', '.join(GPU_MEMORY_GIB)}): give its "
                        "memory with -- --gpu-memory-gb N")
    return (card_gib or GPU_MEMORY_GIB.get(gpu, DEFAULT_GPU_MEMORY_GIB)) * GiB


def job_plan(gpt: type, cfg: Config, params: dict, micro: int, world: int, gpu: str, card: float,
             job: PlanJob) -> JobAnswer:
    """One job as the launcher plans it: micro-batch, memory (on a GPU: the plan must fit the card, else PlanError),
    time (None where unknown). `job`: done_steps, and the launcher's calibration (tokens_per_s) or the GPU check's
    result.json (check) if any: its rehearsal of this shape, else its timing of the arm scaled (measured_step)."""
    memory = None
    if gpu != "cpu":
        plan = memory_plan(gpt, cfg, micro, world, card)
        if plan.total > plan.card:
            raise PlanError(f"{cfg.run_name} at micro-batch {micro} plans {plan.total / GiB:.1f} GiB per GPU, more "
                            f"than the {plan.card / GiB:.0f} GiB of one {gpu}: pass a smaller -- --micro-batch-size, "
                            "-- --activation-checkpointing, or --gpus-per-run 2 or more (python train_c4.py "
                            "--estimate shows the plan)")
        memory = f"{plan.total / GiB:.1f} of {plan.card / GiB:.0f} GiB"
    check, flops = job.check or {}, flops_per_token(cfg, params)
    path = planned_path(cfg, gpu, check)
    if job.tokens_per_s:
        measured = {"flops_per_s": job.tokens_per_s * flops, "gpus": world, "basis": "calibrated just now"}
    else:
        measured = measured_step(check, cfg, micro, path, gpu, world)
    estimate = run_time(gpt, cfg, params, micro, world, gpu, path, measured, job.done_steps)
    timed = dict(seconds=list(estimate.total), step_seconds=list(estimate.step), basis=estimate.basis,
                 step_point=estimate.point) if estimate is not None else {}
    return JobAnswer(micro=micro, auto=cfg.micro_batch_size == "auto", batch=cfg.batch_size, memory=memory, path=path,
                     **timed)


def node_answer(gpu: str, jobs: list[JobAnswer]) -> dict:
    """--plan-jobs' answer (contract.plan_answer): the GPU planned for, the assumptions behind every time (printed by
    the dry run), and the jobs' answers."""
    rehearsed = any(job.basis == MEASURED_BASIS for job in jobs)
    measured = sorted({job.basis for job in jobs if job.basis and not job.basis.startswith(("modelled", "measured"))})
    rates = gpu_rates(gpu)
    modelled = ("this CPU's rates, timed on one thread on each run's shapes and scaled to the trainer's threads at "
                "the share of a core the other work leaves" if gpu == "cpu" else rates_text(rates) if rates
                else f"none: the bf16 peak or bandwidth of {gpu or 'this GPU'} is not known")
    startup = STARTUP_S["cpu" if gpu == "cpu" else "gpu"]
    return plan_answer(gpu, jobs=jobs, assumptions=[
        "Step times, modelled: each job's kernels counted on its model (every launch, the bytes each moves, the "
        f"matmuls' FLOPs) on its kernel path, at {modelled}",
        *([f"Step times, {MEASURED_BASIS}"] if rehearsed else []),
        *(["Step times, " + "; ".join(measured)] if measured else []),
        f"Each time includes evaluation and probes (forward passes at {FORWARD_SHARE:.2f} of a step per sequence), "
        f"checkpoint writes (fp32 weights and AdamW states at {CHECKPOINT_GBPS[1]:g}-{CHECKPOINT_GBPS[0]:g} GB/s) and "
        f"start-up ({startup[0]:.0f}-{startup[1]:.0f} s); low end: the fast assumptions together, "
        "high end: the slow ones (docs/planning.md)"])


def answer_jobs(request) -> dict:
    """--plan-jobs, run_experiments.sh's check before its first launch (JSON in and out, docs/planning.md): each
    job's flags judged by the trainer's own checks (config.parse_config), then planned for the launcher's node by
    job_plan."""
    gpu, world, answers = request.gpu or ASSUMED_GPU, request.world, []
    parameters = functools.cache(count_parameters)      # one build per model shape, not one per job
    for job in request.jobs:
        try:
            cfg = parse_config(job.flags)
            # a run the launcher would skip as finished is compared as a resume would be: refused when its settings
            # changed, or with --allow-changed-settings planned and launched, so that the trainer continues it
            changes = check_resumable(Path(cfg.out) / cfg.run_name, cfg) if job.finished else {}
            if job.finished and not changes:
                answers.append(JobAnswer(finished=True))
                continue
            card = card_bytes(cfg, gpu, request.card_gib)
            micro, _, _ = batch_plan(cfg, world, on_gpu=gpu != "cpu", card=card, gpu=gpu)
            if gpu == "cpu":
                check_memory(cfg, embedding_rows(cfg), micro, world, torch.device("cpu"))
            resolve_data_files(cfg.data, cfg.val_data)
            plan = job_plan(GPT, cfg, parameters(shape_key(cfg)), micro, world, gpu, card, job)
            answers.append(dataclasses.replace(plan, changes=changes_text(changes)))
        except (TrainerError, PlanError) as error:
            answers.append(JobAnswer(error=str(error)))
    return node_answer(gpu, answers)

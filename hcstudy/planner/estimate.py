"""`python train_c4.py --estimate`: the size, the memory plan of one GPU and the time of one run, as text."""
from __future__ import annotations

import os

import torch

from hcstudy.contract import load_check
from hcstudy.durations import duration
from hcstudy.kernels import choice
from hcstudy.planner.gpus import ASSUMED_GPU, flops_per_token, gpu_peak_flops
from hcstudy.planner import rehearsed
from hcstudy.planner.memory import (AUTO_MARGIN, GiB, MemoryPlan, PlanError, activation_profile, auto_micro_batch,
                                    check_batch_split, memory_plan, planned_loss, profile_key,
                                    profiled_path, rehearsed_failure, this_gpu)
from hcstudy.planner.run_time import (TERMS, device_config, device_rates, measured_step, planned_path,
                                      rates_text, run_time, step_cost)
from hcstudy.planner.step_work import step_work, work_key


def print_memory_plan(plan: MemoryPlan) -> None:
    width = max(map(len, plan.terms)) + 2
    for key, value in plan.terms.items():
        print(f"  {key:<{width}}{value / GiB:7.2f} GiB  {plan.notes[key]}")
    short = plan.total - plan.card
    verdict = f"does NOT fit, {short / GiB:.1f} GiB short" if short > 0 else f"fits, {-short / GiB:.1f} GiB to spare"
    print(f"  {'allocated peak':<{width}}{plan.allocated / GiB:7.2f} GiB  = {plan.allocated / 1e9:.1f} GB: "
          "compare mem_peak_gb in metrics.jsonl")
    print(f"  {'total':<{width}}{plan.total / GiB:7.2f} GiB  of {plan.card / GiB:.1f} GiB: {verdict}")


def parameter_summary(params: dict) -> str:
    """count_parameters' counts in words, as --estimate and a run's log show them."""
    return (f"{params['total']:,} parameters ({params['embedding']:,} embedding, {params['non_embedding']:,} "
            f"non-embedding, {params['streams']:,} in the residual connections)")



def print_estimate(gpt: type, cfg: Config, params: dict) -> None:
    """Model size, work per token, the memory plan of one GPU and the time of the run: the model is built on the
    meta device and the activations are measured on tiny copies on the CPU, so nothing of the real size is
    allocated. `params`: train_c4.count_parameters(cfg)."""
    print(f"{cfg.residual} depth {cfg.depth} width {cfg.width}: {parameter_summary(params)}")
    flops = flops_per_token(cfg, params)
    print(f"{flops:.4g} training FLOPs per token; {cfg.tokens_per_step:,} tokens per step; "
          f"{cfg.steps * cfg.tokens_per_step:,} tokens in {cfg.steps:,} steps")
    world = cfg.estimate_world_size or int(os.environ.get("WORLD_SIZE", "1"))
    micro, auto_line = _estimate_micro_batch(gpt, cfg, world)
    strategy = f"{world} processes, {cfg.parallel.upper()}" if world > 1 else "1 process"
    print(f"memory of one GPU at micro-batch {micro} ({cfg.batch_size // (micro * world)} accumulation steps), "
          f"{'fp32' if cfg.dtype == 'fp32' else 'bf16 autocast'}, {cfg.stream_dtype} streams, {strategy}, "
          f"activation checkpointing {'on' if cfg.activation_checkpointing else 'off'}:")
    print_memory_plan(memory_plan(gpt, cfg, micro, world))
    if cfg.residual != "baseline":
        fit = activation_profile(gpt, profile_key(cfg, False))["streams"]
        streams = micro * cfg.seq_len * cfg.depth * (fit[0] * cfg.width + fit[1])
        print(f"the {cfg.expansion} streams add {params['streams']:,} parameters and, without checkpointing, "
              f"{streams / GiB:.1f} GiB of activations (stream states, mixing coefficients, written sublayer outputs)")
    if cfg.stream_dtype == "bf16":
        print(f"bf16 streams: activations measured on the {profiled_path(cfg)} path, the states it holds in bf16")
    print(auto_line)
    print(levers_line(cfg))
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    print_time(gpt, cfg, params, micro, world, name or ASSUMED_GPU,
               f"{world} x {name or ASSUMED_GPU + ' (assumed: no CUDA device here)'}")
    if name is None:
        print_time(gpt, cfg, params, micro, world, "cpu", "this CPU")


def print_time(gpt: type, cfg: Config, params: dict, micro: int, world: int, gpu: str, where: str) -> None:
    """The step on every kernel path the arm has, counted and priced term by term, and the run on its own path; on
    the CPU, the run's line alone."""
    cfg = device_config(cfg, gpu)
    rates = device_rates(cfg, micro, gpu)
    if rates is None:
        print(f"time on {where}: no estimate, its bf16 peak or bandwidth is not known (GPU_PEAK_BF16_FLOPS, "
              "GPU_BANDWIDTH)")
        return
    check = load_check(cfg.out)
    path = planned_path(cfg, gpu, check)
    if gpu != "cpu":
        print(f"time on {where}: one step of {cfg.tokens_per_step:,} tokens, counted on the model, at "
              f"{rates_text(rates)}")
        print(f"  {'path':<10}{'kernels':>9}{'MB/token':>10}  " + "".join(f"{t:<14}" for t in TERMS) + "step")
        print(f"  {'':<10}{'a block':>9}{'a block':>10}")
        for other in (p for p in ("reference", "fused", "triton") if choice.supports(cfg, p)):
            cost = step_cost(gpt, cfg, params, other, micro, world, rates)
            work = step_work(gpt, work_key(cfg), other)
            print(f"  {other:<10}{work.launches[0]:>9,}{work.block_bytes_per_token(cfg.width) / 1e6:>10.2f}  "
                  + "".join(f"{duration(*cost.terms[t]):<14}" for t in TERMS) + f"{duration(*cost.seconds)}, "
                  f"{cost.dominant}-bound" + ("  <- this run's path" if other == path else ""))
    measured = measured_step(check, cfg, micro, path, gpu, world)
    estimate = run_time(gpt, cfg, params, micro, world, gpu, path, measured)
    step = rehearsed.step_text(measured) if estimate.point is not None else f"{duration(*estimate.step)} a step"
    print(f"  the run on {where if gpu == 'cpu' else 'it'}, {path} path ({estimate.basis}): "
          f"{step}{mfu_text(cfg, params, estimate.step, gpu, world)}, {duration(*estimate.total)} for {cfg.steps:,} "
          "steps with evaluation, probes, checkpoints and start-up")


def mfu_text(cfg: Config, params: dict, step: tuple, gpu: str, world: int) -> str:
    """', MFU lo-hi %' of a step lasting `step` (fast, slow) seconds on `world` of `gpu`: FLOPs per token (the head's
    included) over the card's dense bf16 peak; '' where the peak is not known (the CPU)."""
    peak = gpu_peak_flops(gpu)
    if not peak:
        return ""
    work = cfg.tokens_per_step * flops_per_token(cfg, params) / (peak * world)
    low, high = (100 * work / seconds for seconds in (max(step), min(step)))
    return f", MFU {low:.0f}%" if round(low) == round(high) else f", MFU {low:.0f}-{high:.0f}%"


def levers_line(cfg: Config) -> str:
    """The loss and the compilation the plan is for: the memory plan's and the step's."""
    loss, why = planned_loss(cfg)
    compiled = {"blocks": "torch.compile of each block", "model": "torch.compile of the whole model"}
    return (f"planned for: the {loss} cross-entropy ({why}); " + (f"{compiled[cfg.compile_scope]} (its step priced as "
            "eager until --check times it)" if cfg.compile else "no torch.compile (eager)"))


def _estimate_micro_batch(gpt: type, cfg: Config, world: int) -> tuple[int, str]:
    """The micro-batch the plan is printed for (the given one, else auto's) and what auto would choose: below any the
    GPU check's rehearsal saw run out of memory on this GPU type (the given one at or above it is refused)."""
    check_batch_split(cfg, world)
    failed_at = rehearsed_failure(cfg, world)
    if cfg.micro_batch_size != "auto" and failed_at and int(cfg.micro_batch_size) >= failed_at:
        raise PlanError(rehearsed.refusal(cfg, int(cfg.micro_batch_size), failed_at, this_gpu()))
    try:
        auto, _ = auto_micro_batch(gpt, cfg, world, below=failed_at)
        auto_line = (f"--micro-batch-size auto: {auto} (the largest whose plan fills at most {1 - AUTO_MARGIN:.0%} "
                     "of the card" + (f", below the {failed_at} the GPU check saw run out of memory" if failed_at
                                      else "") + ")")
    except PlanError as error:
        auto, auto_line = None, f"--micro-batch-size auto: none fits; {error}"
    micro = int(cfg.micro_batch_size) if cfg.micro_batch_size != "auto" else auto or 1
    check_batch_split(cfg, world, micro)
    return micro, auto_line

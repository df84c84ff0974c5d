"""The GPU check's parts that run in one process with the trainer: the Triton kernels' tests and self-checks on the
card (hcstudy/check_kernels.py), the card's environment, every arm's step on every kernel path at a small size, and
the study's real sizes rehearsed, each at the micro-batch and path the planner picks for this card.
`run_experiments.sh --check` (hcstudy/gpu_check.py) starts this process as `python -m hcstudy.check_parts`.

One process builds each model once and times every path on it, with no data, tokenizer, probe set or run folder:
each step is the trainer's own optimizer step (hcstudy/optim.py's gradients: every micro-batch's forward and
backward, the clip; then AdamW) on a fixed batch of random tokens, bracketed by device synchronisations. Each part has a
time budget, derived below from the planner's modelled step and the constants' estimates; the plan of the parts
(plan_parts) is what `--check --dry-run` prints, and what the check runs. Results go to an events file, one JSON
line each, so that a part that crashed the process loses only itself (gpu_check.py restarts the rest).
"""
from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib.util
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch
import torch.nn.functional as F

from hcstudy import arms, check_kernels, optim
from hcstudy.config import parse_config
from hcstudy.contract import METHODS, error_line, rehearsal_row
from hcstudy.distributed import Dist, compute_dtype, wrap_model
from hcstudy.kernels import choice, cross_entropy
from hcstudy.model import GPT, count_parameters, kernel_path, padded_vocab_size
from hcstudy.planner import gpus, memory, rehearsed, run_time

# ---------------------------------------------------------------------------------------------
# budgets: how long each thing takes on one H100 or H200, and how each figure was arrived at

BUDGET_S = 570          # the whole check: ten minutes with the machine's own start-up
CHECK_START_S = 5       # the check's own process: python, hcstudy, and torch imported to ask for a CUDA device (2-4 s)
WORKER_START_S = 15     # this process: python, torch, the model's modules, the CUDA context. A trainer run paid 20-35 s before its
#                         first step on one H200 (docs/benchmarks.md), of which the tokenizer, the data streams and
#                         their loader processes, the probe set, the micro-batch trial and the run folder are not here
PLAN_S_PER_ARM = 7      # the planner's activation profile and counted step work of one arm, on the CPU: 6.2-7.5 s an
#                         arm at its first depth, 0.4-0.5 s at the next, measured on this project's 2-core CPU (shared,
#                         niced); a node's CPU is assumed no faster
FSDP_RUN_S = 45         # one trainer run under torchrun (gpu_check.fsdp, two of them): the trainer's 20-35 s of
#                         start-up above, 3 steps at width 1024 and a checkpoint
RESULT_S = 2            # the verdicts and result.json
ENVIRONMENT_S = 5       # a bf16 query and one SDPA flash-attention call
BUILD_S, BUILD_S_PER_BILLION = 2.0, 2.0     # a model built on the card with its optimizer (the constructor's Python,
#                         the weights' normal_; the meta-device build takes a second at depth 48): assumed
FIRST_STEP_S = 2.0      # a process's first step: cuBLAS handles and the attention kernels loaded (assumed)
TRITON_JIT_S = 5.0      # an arm's Triton kernels compiled at their first launch: all of them compile for sm_90 in 4.7 s
#                         on this project's 2-core CPU (benchmarks/triton_compile.py, imports included)
COMPILE_S = 45.0        # torch.compile of the blocks in the first steps: the first compile of an mHC block took
#                         20-25 s on the 2-core CPU (docs/benchmarks.md); on a GPU Inductor also compiles its Triton
#                         kernels: doubled
STEP_MARGIN = 1.5       # a step budgeted at the planner's slow end x 1.5: the only public steps at these sizes (the
#                         seed study's) lay above its range (docs/planning.md); ours have never been timed there
UNKNOWN_CARD_FLOPS = 100e12     # a card the planner has no rates for: its steps budgeted at 100 TFLOP/s
FREE_S = 1.0            # a shape's memory freed before the next

# ---------------------------------------------------------------------------------------------
# sizes: what is timed and rehearsed

SMALL = ["--width", "2048", "--depth", "4", "--seq-len", "1024", "--batch-size", "8", "--micro-batch-size", "8",
         "--tokenizer", "gpt2", "--dtype", "bf16"]          # every arm on every path: one micro-batch a step
SMALL_WARM, SMALL_TIMED = 2, 5                              # steps per path: untimed, then timed
SMALL_STEP_S = 0.15     # a step at the small size: 0.040-0.094 s measured on one H200 (docs/benchmarks.md), of which
#                         an H100 has 70% of the bandwidth these steps are bound by; budgeted at 0.15 s
DEPTHS = (32, 48)                                           # the study's, at the trainer's defaults (the --full jobs)
WARM_STEPS, TIMED_STEPS = 1, 3                              # optimizer steps per rehearsal
REQUIRED_ARMS = ("baseline", "hc", "mhc")                   # the default matrix's; the other arms if time allows
OVER_PLAN_ARM = "mhc"                                       # once, deepest: the micro-batch one above the planned one
# Levers timed on the baseline at depth 32, each a list of trainer flags added to its shape (a row each, its
# `variant`), in priority order: the fused cross-entropy first (auto takes it where it timed faster: loss_timings),
# then the compile of each block and of the whole model
FUSED_LOSS = ("--cross-entropy", "fused")
VARIANTS = (FUSED_LOSS, ("--compile",), ("--compile", "--compile-scope", "model"))
# --cpu-tiny: the same parts on the CPU at a few thousand parameters (tests); depths 2 and 3 stand for 32 and 48, the
# planner's 1 GiB CUDA context dominates their plans, so on this pretend card auto takes the whole batch
TINY_SHAPE = ["--width", "32", "--heads", "2", "--seq-len", "32", "--batch-size", "4", "--tokenizer", "byte"]
TINY_SMALL = [*TINY_SHAPE, "--depth", "2", "--micro-batch-size", "4"]
TINY_DEPTHS, TINY_CARD_GIB = (2, 3), 2.0


# FSDP (run by gpu_check.py under torchrun, not here): the trainer itself, checkpointed at step 3, then resumed to 6
FSDP_FLAGS = ["--data", "sample", "--tokenizer", "gpt2", "--dtype", "bf16", "--width", "1024", "--depth", "4",
              "--seq-len", "1024", "--batch-size", "8", "--micro-batch-size", "8", "--warmup", "2", "--eval-every", "1000",
              "--eval-batches", "1", "--metrics-every", "1000", "--layer-metrics-every", "1000", "--log-every", "1",
              "--ckpt-every", "3", "--data-workers", "1", "--wandb", "disabled", "--resume", "never",
              "--residual", "mhc", "--parallel", "fsdp"]
TINY_FSDP_FLAGS = ["--preset", "tiny", "--ckpt-every", "3", "--eval-every", "1000", "--metrics-every", "1000",
                   "--layer-metrics-every", "1000", "--resume", "never", "--residual", "mhc", "--parallel", "fsdp"]


@dataclasses.dataclass
class Part:
    """One thing the check does, with its budget in seconds. `kind`: overhead (start-up, planning: no code of its
    own), environment, timings or rehearsal; a rehearsal's shape is its trainer flags, micro-batch and path."""
    name: str
    kind: str
    budget_s: float
    sizes: str
    required: bool = True
    included: bool = True           # left out by the plan when an optional part does not fit the budget
    flags: list = dataclasses.field(default_factory=list)
    micro: int = 0
    path: str = ""
    variant: list = dataclasses.field(default_factory=list)
    over_plan: bool = False
    planned_alloc_gib: float | None = None
    modelled_step_s: list | None = None
    error: str = ""                 # a rehearsal the planner could not plan (no micro-batch fits): recorded, not run


class Context:
    """What every part needs: the device, the GPU's name the rows and plans are for, one card's bytes, --cpu-tiny,
    the folder for the parts' own files (the kernel tests' log and report; None: a temporary one)."""

    def __init__(self, tiny: bool, plan_only: bool, folder: Path | None = None):
        self.tiny, self.folder = tiny, folder
        cuda = torch.cuda.is_available() and not tiny
        self.device = torch.device("cuda" if cuda else "cpu")
        if cuda:
            self.gpu = torch.cuda.get_device_name()
            self.card = float(torch.cuda.get_device_properties(0).total_memory)
        elif tiny:
            self.gpu, self.card = "cpu", TINY_CARD_GIB * memory.GiB
        elif plan_only:                 # the dry run without a GPU: the documented node's card
            self.gpu, self.card = gpus.ASSUMED_GPU, gpus.GPU_MEMORY_GIB[gpus.ASSUMED_GPU] * memory.GiB
        else:
            raise SystemExit("hcstudy.check_parts: no CUDA GPU visible")
        self.parameters = functools.cache(count_parameters)

    def config(self, flags: list):
        return parse_config([*(TINY_SHAPE if self.tiny else []), *flags])

    def small_config(self, method: str):
        return parse_config([*(TINY_SMALL if self.tiny else SMALL), "--residual", method])

    def paths(self, cfg) -> list:
        """Every path the arm has on the card (the baseline's one stream has one): triton on a GPU only (its
        interpreter on the CPU is for the kernels' own tests)."""
        return [p for p in arms.ARMS[cfg.residual].paths if choice.supports(cfg, p) and (p != "triton" or not self.tiny)]

    def modelled(self, cfg, micro: int, path: str) -> list | None:
        """The planner's [low, high] seconds of one optimizer step on this card's rates, None where it has none."""
        step = run_time.step_seconds(GPT, cfg, self.parameters(memory.shape_key(cfg)), micro, 1,
                                     self.gpu, path)
        return list(step[0]) if step else None

    def step_budget(self, cfg, modelled: list | None) -> float:
        """Seconds budgeted for one optimizer step: the modelled slow end x STEP_MARGIN, or for a card the planner
        cannot price, the step's FLOPs at UNKNOWN_CARD_FLOPS."""
        if modelled:
            return modelled[1] * STEP_MARGIN
        flops = gpus.flops_per_token(cfg, self.parameters(memory.shape_key(cfg)))
        return cfg.tokens_per_step * flops / UNKNOWN_CARD_FLOPS * STEP_MARGIN

    def build_s(self, cfg) -> float:
        return BUILD_S + BUILD_S_PER_BILLION * self.parameters(memory.shape_key(cfg))["total"] / 1e9


# ---------------------------------------------------------------------------------------------
# the plan: every part in the order it runs, its sizes and budget, the optional ones kept while they fit


def loss_timings(rows: list) -> dict:
    """result.json's "cross_entropy" (contract.timed_losses, what auto reads): the baseline's step with FUSED_LOSS and
    with the plain loss at the same depth (the levers' rehearsal), each where it trained; {} where either did not."""
    trained = {(row["depth"], tuple(row["variant"])): row["step_s"] for row in rows
               if row["method"] == "baseline" and row["status"] == "ok"}
    for (depth, variant), fused in trained.items():
        if variant == FUSED_LOSS and trained.get((depth, ())):
            return {"plain": {"step_s": trained[(depth, ())]}, "fused": {"step_s": fused}}
    return {}


def plan_parts(ctx: Context, budget_s: float, check: dict | None = None) -> list[Part]:
    """The worker's parts in run order, for `budget_s` seconds (its share of BUDGET_S, start-up included): the
    required ones always, then the optional ones in priority order (the levers, then the other arms at depth 32,
    then at 48) while the total stays within it; the others are kept, marked left out. `check`: the timings so far
    ({"gpu", "timings"}), from which the planner takes each arm's path."""
    depths = TINY_DEPTHS if ctx.tiny else DEPTHS
    other_arms = [m for m in METHODS if m not in REQUIRED_ARMS]
    order = [kernels_part(ctx), environment_part(), timings_part(ctx)]
    for depth in depths:
        order += [plan_rehearsal(ctx, m, depth, check=check, required=m in REQUIRED_ARMS)
                  for m in (*REQUIRED_ARMS, *other_arms)]
        if depth == depths[0]:
            order += [plan_rehearsal(ctx, "baseline", depth, list(v), check=check, required=False) for v in VARIANTS]
    order.append(plan_rehearsal(ctx, OVER_PLAN_ARM, depths[-1], check=check, over_plan=True))
    arms = len(METHODS)
    overhead = [Part("start-up: this process", "overhead", WORKER_START_S, "python, torch, the model's modules, the CUDA context"),
                Part("planning", "overhead", PLAN_S_PER_ARM * arms, f"the memory plan and step model of {arms} arms "
                     "on the CPU")]
    left = budget_s - sum(p.budget_s for p in overhead + order if p.required)
    for part in sorted((p for p in order if not p.required), key=optional_priority):
        part.included = part.budget_s <= left
        left -= part.budget_s if part.included else 0
    return overhead + order


def check_parts_around(tiny: bool) -> tuple[list[Part], list[Part]]:
    """The parts the check's own process runs before this process and after it."""
    size = "the tiny preset" if tiny else "width 1024, depth 4"
    return ([Part("start-up: the check", "overhead", CHECK_START_S, "python, hcstudy, torch (is there a CUDA GPU?)")],
            [Part("FSDP", "fsdp", 2 * FSDP_RUN_S, f"torchrun, one process, mhc at {size}: a run checkpointed at step "
                  "3, then its resume to step 6 (two trainer runs)"),
             Part("result.json", "overhead", RESULT_S, "the verdicts, result.json")])


def worker_budget(budget_s: float, tiny: bool) -> float:
    """This process's share of the check's budget: what the parts around it leave."""
    return budget_s - sum(part.budget_s for part in sum(check_parts_around(tiny), []))


def plan_lines(parts: list[Part], budget_s: float) -> list[str]:
    """The plan as printed: each part run, its budget and sizes, in order; the ones left out; `total: N s`."""
    lines = [f"{'budget':>7}  {'part':<36} sizes"]
    lines += [f"{part.budget_s:>5.0f} s  {part.name:<36} {part.sizes}" for part in parts if part.included]
    left_out = [part.name for part in parts if not part.included]
    if left_out:
        lines.append(f"left out, over the {budget_s:.0f} s budget: {', '.join(left_out)}")
    return lines + [f"total: {sum(part.budget_s for part in parts if part.included):.0f} s"]


def optional_priority(part: Part) -> tuple:
    """The levers first (the baseline's MFU, on which every arm's cost rests), then the other arms, shallow first."""
    return not part.variant, int(part.flags[3])


def kernels_part(ctx: Context) -> Part:
    """The first timed part: nothing is timed on a kernel before it is proven on the card (check_kernels.py)."""
    return Part("kernel tests", "kernels", check_kernels.budget_s(METHODS, ctx.tiny),
                check_kernels.sizes(METHODS, ctx.tiny))


def environment_part() -> Part:
    return Part("environment", "environment", ENVIRONMENT_S, "bf16, attention (flash-attn or SDPA's flash backend)")


def timings_part(ctx: Context) -> Part:
    """Every arm on every path it has at the small size: per arm a build, per path its steps, the first step's
    set-up, and each arm's Triton kernels compiled at their first launch. Not modelled step by step: the planner's
    count of every arm's every path costs 4-7 s of CPU each, for steps of a tenth of a second."""
    seconds, count = FIRST_STEP_S, 0
    for method in METHODS:
        cfg = ctx.small_config(method)
        seconds += ctx.build_s(cfg) + FREE_S
        for path in ctx.paths(cfg):
            seconds += (SMALL_WARM + SMALL_TIMED) * SMALL_STEP_S + (TRITON_JIT_S if path == "triton" else 0)
            count += 1
    cfg = ctx.small_config("mhc")
    return Part("timings", "timings", round(seconds, 1), f"{len(METHODS)} arms on every path they have ({count} "
                f"timings), width {cfg.width}, depth {cfg.depth}, micro-batch {cfg.batch_size} x {cfg.seq_len} tokens")


def plan_rehearsal(ctx: Context, method: str, depth: int, variant: list = (), check: dict | None = None,
                   required: bool = True, over_plan: bool = False) -> Part:
    """One job shape at its planned micro-batch (auto's for this card; with activation checkpointing where no
    micro-batch fits without), or the one above it (over_plan, the global batch rounded down to a multiple of it),
    on the planner's path for this card, with its plan's allocated peak, modelled step and budget."""
    name = f"{'over the plan' if over_plan else 'variant' if variant else 'rehearsal'} {method} d{depth}" \
        + "".join(f" {flag}" for flag in variant)
    flags = ["--residual", method, "--depth", str(depth), *variant]
    part = Part(name, "rehearsal", 0.0, "", required, flags=flags, variant=list(variant), over_plan=over_plan)
    try:
        cfg, micro = planned_micro_batch(ctx, flags)
    except memory.PlanError as error:
        part.error, part.sizes = str(error), f"depth {depth}, {method}: no micro-batch fits this card"
        return part
    if over_plan:
        micro += 1
        batch = max(micro, cfg.batch_size // micro * micro)
        flags += ["--batch-size", str(batch)]
    checkpointing = cfg.activation_checkpointing and "--activation-checkpointing" not in flags
    part.flags = flags + ["--activation-checkpointing"] * checkpointing + ["--micro-batch-size", str(micro)]
    cfg = ctx.config(part.flags)
    part.micro, part.path = micro, run_time.planned_path(cfg, ctx.gpu, check)
    part.planned_alloc_gib = memory.memory_plan(GPT, cfg, micro, 1, ctx.card).allocated / memory.GiB
    part.modelled_step_s = ctx.modelled(cfg, micro, part.path)
    steps = (WARM_STEPS + TIMED_STEPS) * ctx.step_budget(cfg, part.modelled_step_s)
    part.budget_s = round(ctx.build_s(cfg) + steps + (COMPILE_S if cfg.compile else 0) + FREE_S, 1)
    part.sizes = (f"depth {depth}, {method}, micro-batch {micro}{f' (planned {micro - 1})' if over_plan else ''} "
                  f"x {cfg.batch_size // micro}, {part.path} path, {cfg.stream_dtype} streams"
                  f"{', checkpointing' if cfg.activation_checkpointing else ''}{', compiled' if cfg.compile else ''}; "
                  f"planned {part.planned_alloc_gib:.1f} GiB")
    return part


def planned_micro_batch(ctx: Context, flags: list) -> tuple:
    """(config, micro-batch) as auto plans them for this card, straight from the memory plan (not lowered by an earlier
    check's rehearsals: this check measures anew); with activation checkpointing where nothing fits without."""
    cfg = ctx.config(flags)
    try:
        return cfg, memory.auto_micro_batch(GPT, cfg, 1, ctx.card)[0]
    except memory.PlanError:
        if cfg.activation_checkpointing:
            raise
        cfg = ctx.config([*flags, "--activation-checkpointing"])
        return cfg, memory.auto_micro_batch(GPT, cfg, 1, ctx.card)[0]


# ---------------------------------------------------------------------------------------------
# the steps: one model, the trainer's optimizer step, timed


class Stepper:
    """One model of `cfg` built on the device with the trainer's wrapping (compile per block) and optimizer, stepped
    as the trainer steps it (optim.gradients, then AdamW) on a fixed batch of random token ids of the real
    vocabulary."""

    def __init__(self, ctx: Context, cfg, micro: int, path: str, simulate_oom: bool = False):
        device = ctx.device
        self.cfg, self.device, self.simulate_oom, self.tokens = cfg, device, simulate_oom, cfg.batch_size * cfg.seq_len
        self.dist, self.dtype = Dist(0, 1, device), compute_dtype(cfg, device)
        torch.manual_seed(cfg.seed)
        if cfg.compile:     # the blocks of every compiled model here share Block.forward's code object, which dynamo
            #                 allows 8 graphs: a trainer process holds one model (3 graphs), this one several in turn
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        with torch.device(device):      # built where it runs: a 2.5B-parameter model on the host takes minutes
            model = GPT(cfg, choice.use_flash_attention(cfg, device, self.dtype), path,
                          cross_entropy.choose(cfg, ctx.gpu, None)[0])       # auto: plain until a check timed both
        self.model = wrap_model(model, cfg, self.dist, self.dtype)
        self.optimizer, self.accum = optim.make_optimizer(model, cfg), cfg.batch_size // micro
        ids = torch.randint(0, padded_vocab_size(cfg.tokenizer, exact=True), (micro, cfg.seq_len + 1), device=device)
        self.batches = types.SimpleNamespace(next_batch=lambda: (ids[:, :-1], ids[:, 1:]))
        params = ctx.parameters(memory.shape_key(cfg))
        self.flops_per_token = gpus.flops_per_token(cfg, params)
        self.peak = gpus.gpu_peak_flops(ctx.gpu)

    def step(self) -> float:
        """One optimizer step's seconds, between two synchronisations of the device."""
        if self.simulate_oom:           # --cpu-tiny: the CPU has no device memory to run out of
            raise torch.OutOfMemoryError("simulated by --cpu-tiny above the planned micro-batch")
        sync(self.device)
        start = time.perf_counter()
        optim.gradients(self.model, self.optimizer, self.batches, self.accum, self.dist, self.dtype,
                        self.cfg.grad_clip, optim.lr_at(self.cfg, 0), NO_STOP)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        sync(self.device)
        return time.perf_counter() - start

    def time_steps(self, warm: int, timed: int, until: float) -> dict | None:
        """Stats of up to `timed` steps after `warm` untimed ones, while another step fits before `until` (epoch
        seconds); None where none did, or the time was up before the warm-up."""
        if time.time() >= until:
            return None
        for _ in range(warm):
            self.step()
        times = []
        while len(times) < timed and time.time() + (times[-1] if times else 0.0) <= until:
            times.append(self.step())
        if not times:
            return None
        median = statistics.median(times)
        return {"step_s": median, "step_s_spread": [min(times), max(times)], "steps_timed": len(times),
                "tokens_per_s": self.tokens / median, "flops_per_token": self.flops_per_token,
                "mfu": self.tokens / median * self.flops_per_token / self.peak if self.peak else None}


NO_STOP = types.SimpleNamespace(requested=False)      # the trainer's StopRequest, never set


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def take_path(model, path: str) -> None:
    """Switch a built model's streams to another kernel path: the paths share every parameter and differ only in
    the code each connection runs (tests/kernels hold them equal), so one model serves every path."""
    for module in model.modules():
        if hasattr(module, "kernels"):
            module.kernels = path


def peak_gib(device: torch.device) -> float | None:
    return torch.cuda.max_memory_allocated(device) / memory.GiB if device.type == "cuda" else None


def free_memory(device: torch.device) -> None:
    """What the last shape held, returned to the card (its references dropped by the caller first), with any graphs
    compiled for it."""
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def first_line(error: BaseException) -> str:
    return error_line(error)[:300]


# ---------------------------------------------------------------------------------------------
# the parts


def environment(ctx: Context) -> dict:
    """bf16 on this card; flash-attn installed; SDPA's flash backend runs a causal attention."""
    if ctx.device.type != "cuda":
        return {"bf16": None, "flash_attn": None, "sdpa_flash": None, "error": "not checked on the CPU"}
    found = {"bf16": torch.cuda.is_bf16_supported(), "flash_attn": importlib.util.find_spec("flash_attn") is not None,
             "sdpa_flash": False, "error": ""}
    from torch.nn.attention import SDPBackend, sdpa_kernel
    try:
        q = torch.randn(2, 16, 1024, 128, device=ctx.device, dtype=torch.bfloat16)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, q, q, is_causal=True)
        sync(ctx.device)
        found["sdpa_flash"] = True
    except RuntimeError as error:
        found["error"] = first_line(error)
    return found


def timings(ctx: Context, until: float, emit) -> None:
    """Every arm built once at the small size and timed on each path it has (a triton path only where its self-check
    on this card agrees with the formulas): one event per arm and path, stats None where it did not run."""
    for method in METHODS:
        cfg = ctx.small_config(method)
        if time.time() >= until:         # not even built
            for path in ctx.paths(cfg):
                emit({"event": "timing", "method": method, "path": path, "stats": None, "why": "out of time"})
            continue
        stepper = None
        try:
            stepper = Stepper(ctx, cfg, cfg.batch_size, "reference")
            for path in ctx.paths(cfg):
                emit(time_path(ctx, stepper, cfg, path, until))
        except Exception as error:       # a failing arm is recorded and the check goes on
            emit({"event": "timing", "method": method, "path": "reference", "stats": None, "why": first_line(error)})
        stepper = None
        free_memory(ctx.device)


def time_path(ctx: Context, stepper: Stepper, cfg, path: str, until: float) -> dict:
    event = {"event": "timing", "method": cfg.residual, "path": path, "stats": None, "why": ""}
    if path == "triton":                 # whatever chose it, triton runs only where it equals the formulas here
        taken, why = kernel_path(dataclasses.replace(cfg, kernels="triton"), ctx.device)
        if taken != "triton":
            return {**event, "why": why}
    take_path(stepper.model, path)
    if ctx.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(ctx.device)
    stats = stepper.time_steps(SMALL_WARM, SMALL_TIMED, until)
    if stats:
        stats["mem_peak_gb"] = (peak_gib(ctx.device) or 0.0) * memory.GiB / 1e9
    return {**event, "stats": stats, "why": "" if stats else "out of time"}


NOT_RUN = dict(step_s=None, step_s_spread=None, steps_timed=0, tokens_per_s=None, mfu=None, peak_alloc_gib=None)


def rehearse(ctx: Context, part: Part, until: float) -> dict:
    """One job shape trained for a few steps: its row (contract.rehearsal_row). An out-of-memory error is its result
    (the memory is freed and the check goes on); any other error is recorded as failed."""
    if part.error:
        return shape_row(ctx, part, dict(NOT_RUN, status="failed", reason=part.error))
    result, stepper = dict(NOT_RUN), None
    free_memory(ctx.device)
    try:
        stepper = Stepper(ctx, ctx.config(part.flags), part.micro, part.path, simulate_oom=ctx.tiny and part.over_plan)
        stats = stepper.time_steps(WARM_STEPS, TIMED_STEPS, until)
        result.update(status="ok" if stats else "out-of-time", reason="" if stats else "no step fitted in its time",
                      **{k: v for k, v in (stats or {}).items() if k != "flops_per_token"})
    except torch.OutOfMemoryError as error:
        result.update(status="oom", reason=first_line(error))
    except Exception as error:          # a CUDA error, a compile failure: recorded, and the next part runs
        result.update(status="failed", reason=first_line(error))
    result["peak_alloc_gib"] = peak_gib(ctx.device)      # after an error: what was reached before it
    stepper = None
    free_memory(ctx.device)
    return shape_row(ctx, part, result)


def shape_row(ctx: Context, part: Part, result: dict) -> dict:
    """The row of `part` with the result of its steps (a part the planner could not plan: unshaped_row's)."""
    if part.error:
        return unshaped_row(ctx.gpu, part, result["status"], result["reason"])
    cfg = ctx.config(part.flags)
    return rehearsal_row(gpu=ctx.gpu, method=cfg.residual, depth=cfg.depth, width=cfg.width, seq_len=cfg.seq_len,
                         batch_size=cfg.batch_size, activation_checkpointing=cfg.activation_checkpointing,
                         stream_dtype=cfg.stream_dtype, compile=cfg.compile, config=rehearsed.step_config(cfg),
                         micro_batch=part.micro, kernels=part.path, variant=part.variant, over_plan=part.over_plan,
                         planned_alloc_gib=part.planned_alloc_gib, modelled_step_s=part.modelled_step_s, **result)


def unshaped_row(gpu: str, part: Part, status: str, reason: str) -> dict:
    """The row of a part whose settings are not at hand (not planned, or its process died in it): its arm, depth,
    micro-batch and path as planned, no config (it prices no job)."""
    return rehearsal_row(gpu=gpu, method=part.flags[1], depth=int(part.flags[3]), width=None, seq_len=None,
                         batch_size=None, activation_checkpointing=None, stream_dtype=None, compile=None, config={},
                         micro_batch=part.micro or None, kernels=part.path or None, variant=part.variant,
                         over_plan=part.over_plan, planned_alloc_gib=part.planned_alloc_gib,
                         modelled_step_s=part.modelled_step_s, **dict(NOT_RUN, status=status, reason=reason))


# ---------------------------------------------------------------------------------------------
# the process: the plan, then every included part while its budget fits


def run_parts(ctx: Context, parts: list[Part], deadline: float, emit, skip: set) -> None:
    """Each included part in order, started only if its budget fits before `deadline` with the later required parts'
    budgets kept free; after the timings the rehearsals' paths are planned anew from them (as --kernels auto takes
    the fastest path timed, passing over a triton path whose kernel tests failed). A part not started for time is
    recorded out of time."""
    check = {"gpu": ctx.gpu, "timings": {}, "kernels": {}}       # what result.json will say, so far
    for i, part in enumerate(parts):
        if part.kind == "overhead" or not part.included or part.name in skip:
            continue
        reserve = sum(p.budget_s for p in parts[i + 1:] if p.required and p.included and p.kind != "overhead"
                      and p.name not in skip)
        until = deadline - reserve
        if time.time() + part.budget_s > until:
            print(f"out of time  {part.name}", flush=True)
            emit({"event": "skipped", "part": part.name})
            if part.kind == "rehearsal":
                emit({"event": "rehearsal", "row": shape_row(ctx, part, dict(NOT_RUN, status="out-of-time",
                                                                              reason="no time left for its budget"))})
            continue
        if part.kind == "rehearsal" and check["timings"]:
            replan_path(ctx, part, check)
        print(f"part  {part.name:<34} {part.budget_s:6.0f} s  {part.sizes}", flush=True)
        emit({"event": "start", "part": part.name, "budget_s": part.budget_s})
        run_part(ctx, part, until, emit, check)
        emit({"event": "end", "part": part.name})


def run_part(ctx: Context, part: Part, until: float, emit, check: dict) -> None:
    if part.kind == "kernels":
        check["kernels"] = check_kernels.prove(ctx, METHODS, until)
        emit({"event": "kernels", "arms": check["kernels"]})
    elif part.kind == "environment":
        emit({"event": "environment", **environment(ctx)})
    elif part.kind == "timings":
        def record(event):
            if event["stats"]:
                check["timings"].setdefault(event["method"], {})[f"{event['path']}/eager"] = event["stats"]
            say_timing(event)
            emit(event)
        timings(ctx, until, record)
    else:
        row = rehearse(ctx, part, until)
        say_row(row)
        emit({"event": "rehearsal", "row": row})


def replan_path(ctx: Context, part: Part, check: dict) -> None:
    """The planner's path for the rehearsal once the timings exist (its fastest timed path, as a run takes it)."""
    if part.error:
        return
    cfg = ctx.config(part.flags)
    path = run_time.planned_path(cfg, ctx.gpu, check)
    if path != part.path:
        print(f"      {part.name}: the {path} path, timed fastest, instead of {part.path}", flush=True)
        part.path, part.modelled_step_s = path, ctx.modelled(cfg, part.micro, path)


def say_timing(event: dict) -> None:
    stats, label = event["stats"], f"{event['method']} {event['path']}"
    shown = f"{stats['step_s']:.4f} s/step, {stats['tokens_per_s']:,.0f} tok/s" if stats else event["why"]
    print(f"      {label:<24} {shown}", flush=True)


def say_row(row: dict) -> None:
    if row["status"] != "ok":
        print(f"      {row['status']}: {row['reason']}", flush=True)
        return
    low, high = row["step_s_spread"]
    modelled = "{:.3g}-{:.3g} s".format(*row["modelled_step_s"]) if row["modelled_step_s"] else "none"
    peak = f"{row['peak_alloc_gib']:.1f}" if row["peak_alloc_gib"] is not None else "-"
    mfu = f"{row['mfu']:.1%}" if row["mfu"] is not None else "-"
    print(f"      {row['step_s']:.3f} s/step ({low:.3f}-{high:.3f}; modelled {modelled}), "
          f"{row['tokens_per_s']:,.0f} tok/s, MFU {mfu}, peak {peak} of the planned {row['planned_alloc_gib']:.1f} GiB",
          flush=True)


def worker_main(argv: list) -> int:
    """python -m hcstudy.check_parts: --plan-only prints the plan as one JSON line; else the parts run, their
    results appended to --events."""
    p = argparse.ArgumentParser(prog="python -m hcstudy.check_parts")
    p.add_argument("--budget", type=float, required=True, help="seconds for this process's share, start-up included")
    p.add_argument("--deadline", type=float, default=0.0, help="epoch seconds by which its parts must end")
    p.add_argument("--events", type=Path, help="the file its results are appended to, one JSON line each")
    p.add_argument("--skip", action="append", default=[], help="a part done by an earlier process")
    p.add_argument("--plan-only", action="store_true")
    p.add_argument("--cpu-tiny", action="store_true")
    args = p.parse_args(argv)
    ctx = Context(args.cpu_tiny, args.plan_only, args.events and args.events.parent)
    parts = plan_parts(ctx, args.budget)
    if args.plan_only:
        print(json.dumps({"gpu": ctx.gpu, "card_gib": ctx.card / memory.GiB, "assumed": ctx.device.type != "cuda"
                          and not ctx.tiny,
                          "parts": [dataclasses.asdict(part) for part in parts]}))
        return 0
    with open(args.events, "a") as events:
        def emit(event: dict) -> None:
            events.write(json.dumps(event) + "\n")
            events.flush()
        emit({"event": "plan", "gpu": ctx.gpu, "torch": torch.__version__, "cuda": torch.version.cuda,
              "parts": [dataclasses.asdict(part) for part in parts]})
        before, after = check_parts_around(ctx.tiny)
        whole = args.budget + sum(part.budget_s for part in before + after)
        print(f"the parts on one {ctx.gpu}, {ctx.card / memory.GiB:.1f} GiB, in {whole:.0f} s:", flush=True)
        print("\n".join(plan_lines(before + parts + after, whole)), flush=True)
        run_parts(ctx, parts, args.deadline, emit, set(args.skip))
    return 0


if __name__ == "__main__":
    raise SystemExit(worker_main(sys.argv[1:]))

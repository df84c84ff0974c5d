"""The time of a run as a range (low, high): the counted step work priced at a card's rates (or this CPU's, timed),
or a step --check measured; evaluation, probes, checkpoint writes and start-up added."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time

import torch

from hcstudy.contract import timed_steps, timed_work
from hcstudy.kernels import choice
from hcstudy.planner.gpus import GPU_BANDWIDTH, GPU_PEAK_BF16_FLOPS, flops_per_token
from hcstudy.planner import rehearsed
from hcstudy.planner.memory import parameter_numels, planned_loss
from hcstudy.planner.step_work import OPTIMIZER_BYTES, step_work, work_key

# The rates a step is priced at, (fast, slow). A GPU: its GEMMs (cuBLAS bf16 at a 1-3B model's shapes, FlashAttention
# forward and backward) at a share of the dense bf16 peak; every other kernel's bytes at a share of the memory
# bandwidth (large elementwise kernels reach about 90% of it, small and strided ones less); the idle gap between two
# queued kernels; and eager PyTorch's host time to issue one op (Python, the dispatcher, the launch), which runs
# beside the device: the step waits for the host when the kernels are shorter than that. Public figures for these
# cards, not measurements of this trainer: --check's timings replace them (docs/planning.md).
GEMM_SHARE = (0.65, 0.45)
BANDWIDTH_SHARE = (0.85, 0.40)
LAUNCH_GAP_S = (1e-6, 3e-6)
HOST_OP_S = (5e-6, 12e-6)
CPU_SLOW_SHARE = 2 / 3          # slow end: one thread at two thirds of its rates (plan.cpu_rates_at)
CPU_TIMED_WIDTH, CPU_TIMED_TOKENS = 512, 2048     # the largest shape the CPU's rates are timed on (16 MiB at n = 4)
MEASURED_SPREAD = (0.9, 1.2)     # around a measured step time: another depth or micro-batch moves it
CHECKPOINT_GBPS = (2.0, 0.5)     # a checkpoint's files written at local NVMe speed, down to a network disk's
# imports, model build, the data streams' first batches, the first step's kernels: minutes for a 2.5B model on a
# GPU node (assumed), seconds for the CPU's small presets
STARTUP_S = {"gpu": (60.0, 300.0), "cpu": (5.0, 30.0)}
# an evaluation or probe sequence costs a forward: about a third of a training step's forward and backward
FORWARD_SHARE = 1 / 3


@dataclasses.dataclass(frozen=True)
class Rates:
    """What one device does per second, (fast, slow): its GEMMs' FLOPs and its other kernels' bytes; the seconds of
    a launch gap on the device and of one op on the host; whether host and device overlap (a GPU) or not (a CPU)."""
    name: str
    flops: tuple[float, float]
    bandwidth: tuple[float, float]
    gap: tuple[float, float]
    host: tuple[float, float]
    overlapped: bool


def gpu_rates(gpu: str) -> Rates | None:
    peak, bandwidth = GPU_PEAK_BF16_FLOPS.get(gpu), GPU_BANDWIDTH.get(gpu)
    if not (peak and bandwidth):
        return None
    return Rates(gpu, tuple(share * peak for share in GEMM_SHARE),
                 tuple(share * bandwidth for share in BANDWIDTH_SHARE), LAUNCH_GAP_S, HOST_OP_S, True)


TERMS = ("matmuls", "memory", "launch gaps", "host")


def rates_text(rates: Rates) -> str:
    if not rates.overlapped:
        return (f"this CPU timed at {rates.flops[1] / 1e9:.0f}-{rates.flops[0] / 1e9:.0f} GFLOP/s, "
                f"{rates.bandwidth[1] / 1e9:.0f}-{rates.bandwidth[0] / 1e9:.0f} GB/s, {rates.host[0] * 1e6:.1f}-"
                f"{rates.host[1] * 1e6:.1f} us an op (plan.cpu_rates_at)")
    peak, bandwidth = GPU_PEAK_BF16_FLOPS[rates.name], GPU_BANDWIDTH[rates.name]
    return (f"matmuls at {GEMM_SHARE[1]:.0%}-{GEMM_SHARE[0]:.0%} of {peak / 1e12:.0f} TFLOP/s, other kernels' bytes "
            f"at {BANDWIDTH_SHARE[1]:.0%}-{BANDWIDTH_SHARE[0]:.0%} of {bandwidth / 1e12:.2f} TB/s, "
            f"{LAUNCH_GAP_S[0] * 1e6:.0f}-{LAUNCH_GAP_S[1] * 1e6:.0f} us between kernels, {HOST_OP_S[0] * 1e6:.0f}-"
            f"{HOST_OP_S[1] * 1e6:.0f} us of host time an op, host and device side by side (docs/planning.md)")


def device_config(cfg: Config, gpu: str) -> Config:
    """dtype auto is bf16 on a GPU, fp32 on the CPU (train_c4.compute_dtype): the counts differ."""
    return dataclasses.replace(cfg, dtype="fp32") if gpu == "cpu" and cfg.dtype == "auto" else cfg


def device_rates(cfg: Config, micro: int, gpu: str) -> Rates | None:
    """The rates of one device: the GPU table's, or this CPU's timed on the run's shapes."""
    streams = 1 if cfg.residual == "baseline" else cfg.expansion
    return cpu_rates(micro * cfg.seq_len, cfg.width, streams) if gpu == "cpu" else gpu_rates(gpu)


def _best_seconds(run, repeats: int = 5, at_least_s: float = 0.1) -> float:
    """The fastest of `repeats` or more runs after a warm-up, repeated for at_least_s: a short kernel gets enough
    tries that one of them runs undisturbed on a shared CPU."""
    run()
    times, began = [], time.perf_counter()
    while len(times) < repeats or time.perf_counter() - began < at_least_s:
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


@contextlib.contextmanager
def _one_thread():
    """torch on one thread inside, the caller's thread count yielded and restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield threads
    finally:
        torch.set_num_threads(threads)


@functools.cache
def cpu_rates(tokens: int, width: int, streams: int) -> Rates:
    """This CPU's rates on a run's own shapes (a micro-batch's tokens; a slice of at most CPU_TIMED_TOKENS x
    CPU_TIMED_WIDTH where the run's is larger: the rates are per FLOP and per byte), timed once in under a second:
    the MLP's first matmul in fp32; an add of two n-stream states (a small model's fit in the caches, and that is the
    bandwidth its kernels get); a forward and backward of 100 multiplications of 8 numbers, per op. Timed on one
    thread, where the fastest of many runs is this core's own speed: two threads on a shared CPU wait on each other
    at every kernel, and timed that way the rates moved 10x from one run to the next (docs/benchmarks.md). The share of
    a core that thread got meanwhile (its CPU time over the wall time) is the load of the other work; cpu_rates_at
    turns the three into the trainer's rates."""
    tokens, width = min(tokens, CPU_TIMED_TOKENS), min(width, CPU_TIMED_WIDTH)
    with _one_thread() as threads:
        wall, cpu = time.perf_counter(), time.process_time()
        a, w = torch.randn(tokens, width), torch.randn(width, 4 * width)
        flops = 2 * a.numel() * w.shape[1] / _best_seconds(lambda: a @ w)
        x = torch.randn(tokens, streams, width)
        bandwidth = 3 * x.nbytes / _best_seconds(lambda: x + x)
        v = torch.ones(8, requires_grad=True)

        def chain():
            y = v
            for _ in range(100):
                y = y * 1.0
            y.sum().backward()
        op = _best_seconds(chain) / 202                  # 100 multiplications and the sum, forward and backward
        share = (time.process_time() - cpu) / (time.perf_counter() - wall)
    return cpu_rates_at(flops, bandwidth, op, min(threads, os.cpu_count() or 1), share)


def cpu_rates_at(flops: float, bandwidth: float, op_s: float, cores: int, share: float) -> Rates:
    """The trainer's CPU rates from one thread's (FLOP/s, bytes/s, seconds an op) and the share of a core a thread
    gets beside the other work: fast, its threads (one a core) in parallel, each at that share; slow, one thread's
    share at CPU_SLOW_SHARE (under load the threads wait on each other, and two have run slower than one). The host's
    ops run on one thread at that share either way."""
    share = min(1.0, max(share, 0.05))              # a thread that got less than 5% could not have timed anything
    fast, slow = cores * share, share * CPU_SLOW_SHARE
    return Rates("cpu", (flops * fast, flops * slow), (bandwidth * fast, bandwidth * slow), (0.0, 0.0),
                 (op_s / share, op_s / slow), False)


@dataclasses.dataclass(frozen=True)
class StepCost:
    """Work on one device (a step's, or any code's counted by `counting`) and its seconds at `rates`, (fast, slow)."""
    path: str
    flops: float            # of the matmuls of the width and attention
    bytes: float            # every other kernel's
    launches: float
    rates: Rates

    @property
    def terms(self) -> dict:
        r = self.rates
        return {"matmuls": tuple(self.flops / f for f in r.flops), "memory": tuple(self.bytes / b for b in r.bandwidth),
                "launch gaps": tuple(self.launches * g for g in r.gap), "host": tuple(self.launches * h for h in r.host)}

    @property
    def seconds(self) -> tuple[float, float]:
        terms = self.terms
        device = [sum(terms[k][i] for k in ("matmuls", "memory", "launch gaps")) for i in (0, 1)]
        return tuple(max(d, h) if self.rates.overlapped else d + h for d, h in zip(device, terms["host"]))

    @property
    def dominant(self) -> str:
        terms = self.terms
        return max(terms, key=lambda k: terms[k][1])


def step_cost(gpt: type, cfg: Config, params: dict, path: str, micro: int, world: int, rates: Rates) -> StepCost:
    """One step of `cfg` on one of `world` devices, counted on the model (step_work) and priced at `rates`. With the
    fused cross-entropy (planned_loss), the head's logits computed again in its backward, 2 x vocabulary x width FLOPs a
    token, are added; its other kernels are priced as the plain loss's, counted: on the CPU torch's op runs another
    policy than on CUDA (a weight-gradient scratch per chunk), so counting it here would not count CUDA's work
    (docs/planning.md)."""
    loss = planned_loss(cfg, rates.name)[0]
    work, numels = step_work(gpt, work_key(cfg), path), parameter_numels(gpt, cfg)
    tokens, micro_steps = cfg.tokens_per_step / world, cfg.batch_size / (micro * world)
    blocks, shards = cfg.depth * numels["block"], world if world > 1 and cfg.parallel == "fsdp" else 1
    recomputed_logits = 2 * numels["wte.weight"] if loss == "fused" else 0
    flops = tokens * (flops_per_token(cfg, params) + recomputed_logits)
    nbytes = (tokens * work.bytes_per_token(cfg.width, cfg.depth) + OPTIMIZER_BYTES * numels["total"] / shards
              + micro_steps * (work.per_parameter[0] * blocks + work.per_parameter[1] * (numels["total"] - blocks)))
    return StepCost(path, flops, nbytes, micro_steps * work.micro_launches(cfg.depth), rates)


@dataclasses.dataclass(frozen=True)
class RunTime:
    step: tuple[float, float]       # seconds per optimizer step
    total: tuple[float, float]      # seconds of the run's remaining steps with everything else it does
    basis: str                      # where the step time comes from; its first word: measured, scaled, modelled...
    path: str                       # the streams' kernel path it was priced for
    point: float | None = None      # a measured step's median (step: the spread of its timed steps)


def planned_path(cfg: Config, gpu: str, check: dict | None) -> str:
    """The streams' path a run of `cfg` will take on this device (choice.kernel_path's choice, but for its
    self-check, which only the device can run): --check's fastest timing where auto has one, else what is asked."""
    timed = choice.fastest_timed(cfg, check or {}, gpu) if cfg.kernels == "auto" and gpu != "cpu" else None
    wanted = timed[0] if timed else choice.asked_path(cfg, on_gpu=gpu != "cpu")
    return wanted if choice.supports(cfg, wanted) else "reference"


MEASURED_BASIS = "measured: the GPU check's rehearsal of the job's very shape on this GPU type (the median step, " \
                 "with the fastest and slowest of its timed steps)"


def step_seconds(gpt: type, cfg: Config, params: dict, micro: int, world: int, gpu: str, path: str,
                 measured: dict | None = None) -> tuple[tuple[float, float], str] | None:
    """(low, high) seconds of one optimizer step and their basis: `measured` if given, a rehearsal row of this very
    shape (rehearsed.measured_row: the spread of its timed steps), or a rate (the launcher's calibration, or the GPU
    check's timing of this arm and path on this GPU scaled by FLOPs, docs/planning.md); else the step counted on the
    model and priced at the device's rates. None on a GPU whose peak or bandwidth is not known."""
    if measured and measured.get("step_s_spread"):
        return tuple(measured["step_s_spread"]), MEASURED_BASIS
    if measured and measured.get("flops_per_s"):
        seconds = cfg.tokens_per_step * flops_per_token(cfg, params) / (
            measured["flops_per_s"] * world / measured.get("gpus", 1))
        return (seconds * MEASURED_SPREAD[0], seconds * MEASURED_SPREAD[1]), measured["basis"]
    cfg = device_config(cfg, gpu)
    rates = device_rates(cfg, micro, gpu)
    if rates is None:
        return None
    cost = step_cost(gpt, cfg, params, path, micro, world, rates)
    # Inductor fuses the small ops into kernels that cannot be counted without compiling: priced as eager, which
    # the compiled step should not exceed, until --check times it (the blocks or the whole model alike)
    compiled = f", as eager (compile of the {cfg.compile_scope} not modelled)" if cfg.compile else ""
    return cost.seconds, f"modelled, {cost.dominant}-bound{compiled}"


def run_time(gpt: type, cfg: Config, params: dict, micro: int, world: int, gpu: str, path: str,
             measured: dict | None = None, done_steps: int = 0) -> RunTime | None:
    """The remaining steps of a run and what else it does on the way, in seconds, as (low, high)."""
    step = step_seconds(gpt, cfg, params, micro, world, gpu, path, measured)
    if step is None:
        return None
    (low, high), basis = step
    steps, point = max(0, cfg.steps - done_steps), (measured or {}).get("step_s")
    # forward-only work, in optimizer steps: the validation set at every evaluation, the probe batch at every probe
    forward_steps = FORWARD_SHARE * (steps // cfg.eval_every * cfg.eval_batches
                                     + steps // cfg.metrics_every * cfg.probe_sequences / cfg.batch_size)
    checkpoint_bytes = steps // cfg.ckpt_every * 12 * params["total"]      # fp32 weights and AdamW's two states
    startup = STARTUP_S["cpu" if gpu == "cpu" else "gpu"]
    total = tuple((steps + forward_steps) * s + checkpoint_bytes / (gbps * 1e9) + start
                  for s, gbps, start in zip((low, high), CHECKPOINT_GBPS, startup))
    return RunTime((low, high), total, basis, path, point if basis == MEASURED_BASIS else None)


def measured_rate(check: dict, cfg: Config, path: str, gpu: str) -> dict | None:
    """The GPU check's timing of this arm on this path and mode (its result.json, contract.timed_steps) as work per
    second, if it was measured on this GPU: the planner scales it to the job's FLOPs."""
    method, mode = cfg.residual, choice.timed_mode(cfg)
    seconds, work = timed_steps(check, method, gpu).get((path, mode)), timed_work(check, method)
    if not seconds or work is None or not work[0] > 0:
        return None
    return {"flops_per_s": work[0] / seconds, "gpus": work[1],
            "basis": f"scaled: {method} on the {path} path ({mode}) timed by the GPU check at its small size, "
                     "scaled by FLOPs per token"}


def measured_step(check: dict, cfg: Config, micro: int, path: str, gpu: str, world: int) -> dict | None:
    """What a job's step is priced from when the GPU check measured it: its rehearsal of this very shape, else its
    timing of the arm and path at the small size scaled by FLOPs; None where it measured neither."""
    return rehearsed.measured_row(check, cfg, micro, path, gpu, world) or measured_rate(check, cfg, path, gpu)

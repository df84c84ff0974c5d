"""What produced a run, recorded beside its metrics: config.json's record (settings, precision, versions, device, git
commit) and train.log's opening lines."""
from __future__ import annotations

import dataclasses
import importlib.metadata
import subprocess
import sys

import torch

from hcstudy import ROOT, arms
from hcstudy.planner import gpus
from hcstudy.planner.estimate import parameter_summary


def announce(cfg, log, record: dict, params: dict, streams_read: int, held_out: str, warning_lines: list[str]) -> None:
    """train.log's opening (`log`: the run's RunLog): what runs where (`record`: run_record's), the model, the batch,
    the data (`streams_read`: the data streams this process reads), and what seldom means what was meant."""
    world, micro = record["world_size"], record["config"]["micro_batch_size"]
    log.info(f"run {cfg.run_name}: {cfg.residual} depth {cfg.depth} width {cfg.width} streams "
             f"{cfg.expansion if arms.ARMS[cfg.residual].streams else 1} on {world} x {record['device_name']} "
             f"({record['dtype']}, {record['attention']} attention)")
    log.info(f"streams' kernels: {record['kernels']} ({record['kernels_reason']})")
    log.info(f"cross-entropy: {record['cross_entropy']} ({record['cross_entropy_reason']})")
    log.info(f"model: {parameter_summary(params)}")
    log.info(f"tokens per step: {cfg.tokens_per_step:,} = {cfg.batch_size} sequences x {cfg.seq_len}; micro-batch "
             f"{micro} x {cfg.batch_size // (micro * world)} accumulation steps x {world} process(es)")
    log.info(f"run: {cfg.steps:,} steps, {cfg.steps * cfg.tokens_per_step:,} tokens, "
             f"{gpus.flops_per_token(cfg, params):.3g} FLOPs per token")
    loader = f"{cfg.data_workers} loader process(es)" if cfg.data_workers else "a loader thread"
    shared = ", shared between processes" if cfg.data_streams % world else ""
    log.info(f"data: {cfg.data}, {cfg.data_streams} streams ({streams_read} read by this process{shared}, {loader} "
             "each), "
             f"data seed {cfg.data_seed}")
    log.info(f"held out for validation and the probe: {held_out}")
    for line in warning_lines:
        log.info(f"warning: {line}")


def precision_policy(dtype: torch.dtype, stream_dtype: str = "fp32") -> dict:
    """What runs in which precision: the same under one process, DDP and FSDP (the streams' dtype is a choice,
    --stream-dtype: fp32 by default, so that a gain is never a bf16 rounding artefact; docs/model.md's table).
    Recorded in config.json; the report marks a table whose runs differ in it."""
    return {"matmuls": "bf16" if dtype == torch.bfloat16 else "fp32", "residual_streams": stream_dtype,
            "mixing_parameters": "fp32", "coefficients": "fp32", "probe": "fp32 H_res, fp64 products"}


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10)
        return head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "") if head.returncode == 0 else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_record(cfg, micro: int, dist, dtype: torch.dtype, use_flash: bool, kernels: tuple[str, str],
               params: dict, loss: tuple[str, str]) -> dict:
    """config.json's record; kernels: the streams' path and why it was taken (choice.kernel_path); loss: the
    cross-entropy's and why (cross_entropy.choose)."""
    return {"config": {**dataclasses.asdict(cfg), "micro_batch_size": micro}, "n_params": params["total"],
            "params": params, "world_size": dist.world, "device": dist.device.type,
            "device_name": device_name(dist.device),
            "dtype": str(dtype).removeprefix("torch."), "precision": precision_policy(dtype, cfg.stream_dtype),
            "attention": "flash" if use_flash else "sdpa", "kernels": kernels[0],
            "kernels_reason": kernels[1], "cross_entropy": loss[0], "cross_entropy_reason": loss[1],
            "versions": {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                         "datasets": importlib.metadata.version("datasets"),
                         "tiktoken": importlib.metadata.version("tiktoken")},
            "git_commit": git_commit()}

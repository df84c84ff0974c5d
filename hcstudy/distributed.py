"""Distribution: the process group from torchrun's environment, one device per rank, the autocast dtype, and the
model wrapped in the fixed order: activation checkpointing (in the blocks), compile, then DDP or FSDP2."""
from __future__ import annotations

import dataclasses
import os
from datetime import timedelta

import torch
import torch.nn as nn
from torch.distributed.distributed_c10d import _set_pg_timeout
from torch.nn.parallel import DistributedDataParallel

from hcstudy import arms

@dataclasses.dataclass(frozen=True)
class Dist:
    """This process's place in the job, and the collectives every rank calls together (no-ops for one process)."""
    rank: int
    world: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            torch.distributed.barrier()

    def sum(self, values: torch.Tensor) -> torch.Tensor:
        if self.world > 1:
            torch.distributed.all_reduce(values)
        return values

    def gather(self, obj) -> list:
        """Every rank's `obj` (small picklable values), in rank order."""
        gathered = [obj] * self.world
        if self.world > 1:
            torch.distributed.all_gather_object(gathered, obj)
        return gathered


# start-up waits for every rank's first documents, a checkpoint's verification and compilation; once steps run,
# ten minutes without progress means a hung rank, better failed and requeued (TRAIN_C4_STEP_TIMEOUT_S: tests)
START_TIMEOUT_S, STEP_TIMEOUT_S = 30 * 60, 10 * 60


def setup_distributed() -> Dist:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}") if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if world > 1:
        torch.distributed.init_process_group("nccl" if device.type == "cuda" else "gloo",
                                             timeout=timedelta(seconds=START_TIMEOUT_S))
    return Dist(rank, world, device)


def shorten_timeout(dist: Dist, data_timeout: float) -> None:
    """After the first step (as torchtitan does). 2 minutes above --data-timeout, so that a rank starved of data
    gives up first and says why, instead of its peers timing out without knowing the cause."""
    if dist.world > 1:
        seconds = float(os.environ.get("TRAIN_C4_STEP_TIMEOUT_S", max(STEP_TIMEOUT_S, data_timeout + 120)))
        _set_pg_timeout(timedelta(seconds=seconds))


def end_distributed() -> None:
    """Only when every rank ends together: tearing down a group whose peer is gone can block."""
    if torch.distributed.is_initialized():
        # every rank past its last collective first: gloo aborts a rank whose peer tears its sockets down under it
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


def wrap_model(model: nn.Module, cfg, dist: Dist, dtype: torch.dtype) -> nn.Module:
    """Activation checkpointing lives in the blocks; then compile per block (or the whole model); then DDP or FSDP2.
    Build the optimizer after this: FSDP2 replaces every parameter by its sharded DTensor."""
    if cfg.compile:
        for module in [model] if cfg.compile_scope == "model" else model.blocks:
            module.compile()
    if dist.world == 1:
        return model
    if cfg.parallel == "ddp":
        return DistributedDataParallel(model, device_ids=[dist.device.index] if dist.device.type == "cuda" else None)
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    # FSDP2 shards dim 0 and refuses 0-d parameters (HC's s_a, s_b; mHC's gates): 1-element vectors broadcast alike
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if param.dim() == 0:
                setattr(module, name, nn.Parameter(param.detach().reshape(1), requires_grad=param.requires_grad))
    # Matmul weights gathered in the compute dtype, gradients reduced in fp32; the connections sharded on their own in
    # fp32, so coefficients come from unrounded weights as under DDP. No input cast: the streams stay fp32.
    policy, mixing_policy = (MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32,
                                                  cast_forward_inputs=False) for param_dtype in (dtype, torch.float32))
    for block in model.blocks:
        if arms.ARMS[cfg.residual].streams:
            for conn in (block.attn_conn, block.mlp_conn):
                fully_shard(conn, mp_policy=mixing_policy)
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def is_sharded(model: nn.Module) -> bool:
    from torch.distributed.fsdp import FSDPModule
    return isinstance(model, FSDPModule)


def unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


def compute_dtype(cfg, device: torch.device) -> torch.dtype:
    if cfg.dtype == "bf16" or (cfg.dtype == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32

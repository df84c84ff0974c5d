"""The GPU check's rehearsals read back (result.json's `rehearsals`, contract.py): the step a job shape took on this
GPU type, and the micro-batches it saw run out of memory. The planner prices a rehearsed job from its measured step
(run_time.step_seconds), and refuses or lowers a micro-batch at or above one that failed (memory.resolve_micro_batch,
estimate.py)."""
from __future__ import annotations

import dataclasses

from hcstudy import arms

from hcstudy.contract import rehearsals_on

# Config's "model" group holds every setting of the model's maths and kernels; beyond it these move a step's time
# or memory (the optimizer step's micro-batches, compile, recompute). A lever added to the trainer outside the model
# group (e.g. a compile scope) is added here, so that a row timed with it prices only jobs that use it.
STEP_FIELDS_BEYOND_MODEL = ("batch_size", "compile", "compile_scope", "activation_checkpointing")
# in the model group but not the step's: a preset's effects are its settings; `kernels` asks, the row says the path
NOT_THE_STEP = ("preset", "kernels")


def step_config(cfg) -> dict:
    """Every setting of `cfg` (config.Config) a step's time and memory depend on, as JSON values: what a job must
    share with a rehearsal row (its `config`) to be priced from it: the model's (its arm's own among them)."""
    also = (*arms.declared_settings(), *STEP_FIELDS_BEYOND_MODEL)
    return {field.name: getattr(cfg, field.name) for field in dataclasses.fields(cfg)
            if field.name not in NOT_THE_STEP and (field.metadata.get("group") == "model" or field.name in also)}


def measured_row(check: dict, cfg, micro: int, path: str, gpu: str, world: int = 1) -> dict | None:
    """The rehearsal of exactly this job's shape on this GPU type that trained (status ok): its config, micro-batch
    and path; None for any other, and for a job of several GPUs (a rehearsal runs on one)."""
    if world != 1:
        return None
    config = step_config(cfg)
    for row in rehearsals_on(check, gpu):
        if row["status"] == "ok" and row["config"] == config and row["micro_batch"] == micro \
                and row["kernels"] == path and isinstance(row["step_s"], (int, float)):
            return row
    return None


def out_of_memory_at(check: dict, cfg, gpu: str, world: int = 1) -> int | None:
    """The smallest micro-batch that ran out of memory in a rehearsal of this shape on this GPU type (its config but
    the global batch, whatever the path: the plan's memory does not depend on either), None if none did."""
    if world != 1:
        return None
    config = {k: v for k, v in step_config(cfg).items() if k != "batch_size"}
    failed = [row["micro_batch"] for row in rehearsals_on(check, gpu) if row["status"] == "oom"
              and {k: v for k, v in row["config"].items() if k != "batch_size"} == config]
    return min(failed, default=None)


def refusal(cfg, micro: int, failed_at: int, gpu: str) -> str:
    """The one line for an explicit micro-batch at or above one the rehearsal saw run out of memory."""
    return (f"--micro-batch-size {micro}: the GPU check's rehearsal of {cfg.residual} at depth {cfg.depth} ran out of "
            f"memory at micro-batch {failed_at} on this {gpu} (result.json in {cfg.out}/gpu_check): use a smaller one, "
            "or auto")


def step_text(row: dict) -> str:
    """'1.17 s a step (1.15-1.19 s over 3 steps)': a measured step as the dry run and --estimate show it."""
    low, high = row["step_s_spread"]
    return f"{row['step_s']:.3g} s a step ({low:.3g}-{high:.3g} s over {row['steps_timed']} steps)"

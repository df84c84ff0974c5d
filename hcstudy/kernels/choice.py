"""Which path runs the streams (--kernels): reference (the arm's formulas, hcstudy/arms/), or a kernel path the arm
registers (fused: hand-written backwards, fused.py; triton: GPU kernels, triton_ops.py): what the flag asks, what
the GPU check timed fastest on this card, and the self-check that must agree before the triton path is taken."""

import dataclasses

import torch

from hcstudy import arms
from hcstudy.contract import ConfigError, error_line, load_check, timed_steps

# the public study's settings of the streams every arm shares that change their maths, not only their initial values
STUDY_VARIANTS = ("mixing_norm", "mixing_precision")


def study_variants(cfg) -> list[str]:
    """The study's variants a config asks for, away from their defaults: the kernels implement the papers' maths."""
    defaults = {field.name: field.default for field in dataclasses.fields(cfg)}
    return [key for key in STUDY_VARIANTS if getattr(cfg, key) != defaults[key]]


def supports(cfg, path: str = "fused") -> bool:
    """Whether a path has the run's arm: the formulas (reference) always; a kernel path where the arm's file
    registers it (its declaration's `kernels`; the study's arms register none) and the run asks for the papers'
    per-token coefficients. The public study's variants of the streams run the formulas (config.json's "kernels");
    config.validate refuses an explicit --kernels fused or triton for them (study_variants)."""
    papers = cfg.coefficients == "token" and cfg.collapse == "sum" and not study_variants(cfg)
    return path == "reference" or (path in arms.ARMS[cfg.residual].kernels and papers)


def triton_kernels():
    """triton_ops.py, imported when first used (triton itself at its first launch: only that path needs it), with
    triton_library.py, which defines the operators its autograd Functions call."""
    from hcstudy.kernels import triton_library, triton_ops as module  # noqa: F401 (the first registers the operators)
    return module


def asked_path(cfg, on_gpu: bool) -> str:
    """The path --kernels asks for, before any timing or self-check: auto means fused on the CPU (docs/benchmarks.md
    times it faster than the formulas there) and triton on a GPU; the baseline has only its one stream."""
    if not arms.ARMS[cfg.residual].streams or cfg.kernels == "reference":
        return "reference"
    return "fused" if cfg.kernels == "fused" or not on_gpu and cfg.kernels == "auto" else "triton"


def kernel_path(cfg, device: torch.device, make_connection) -> tuple[str, str]:
    """The streams' path a run takes and why, for config.json and train.log. --kernels reference / fused / triton
    where the path has the arm; auto: on CUDA the path --check timed fastest for this arm on this GPU (its
    result.json in --out), else asked_path's. A triton path, however chosen, that fails to import, compile or agree
    with the formulas (make_connection(path) builds one connection to compare) falls back to the formulas."""
    if not arms.ARMS[cfg.residual].streams or cfg.kernels == "reference":
        return "reference", "--kernels reference" if arms.ARMS[cfg.residual].streams else "the baseline's one stream"
    timed = measured_path(cfg, device) if cfg.kernels == "auto" and device.type == "cuda" else None
    path, why = timed or asked_reason(cfg, device)
    if not supports(cfg, path):
        return "reference", f"{path} has no {cfg.residual} with these settings: the formulas"
    if path != "triton":
        return path, why
    # whatever chose it (the flag, auto, or --check's timing on another day and driver), triton runs only once
    # one connection on it equals the formulas' on this device
    problem = triton_problem(device, make_connection)
    if problem:
        return "reference", f"warning: the triton kernels {problem}; the formulas instead"
    return "triton", f"{why}; self-check passed"


def asked_reason(cfg, device: torch.device) -> tuple[str, str]:
    """asked_path's choice and why, before the self-check."""
    path = asked_path(cfg, device.type == "cuda")
    if path == "fused":
        return path, "--kernels fused" if cfg.kernels == "fused" else "auto on the CPU: fused, timed faster there"
    how = "compiled for this GPU" if device.type == "cuda" else "in Triton's interpreter on the CPU: slow, for tests"
    return path, f"{'--kernels triton' if cfg.kernels == 'triton' else 'auto, not timed by --check on this GPU'}; {how}"


def timed_mode(cfg) -> str:
    """How a run's step is timed by --check (result.json's "path/mode" keys): eager, compile (the blocks, what --compile
    has always compiled) or compile-model (--compile-scope model), each timed apart."""
    return "eager" if not cfg.compile else "compile" if cfg.compile_scope == "blocks" else "compile-model"


def fastest_timed(cfg, check: dict, gpu: str) -> tuple[str, float] | None:
    """(path, seconds per step) of the fastest path --check timed for this arm and mode (timed_mode) on this GPU, from
    its result.json (`check`); None where it timed none."""
    mode = timed_mode(cfg)
    timed = {path: seconds for (path, timed_mode), seconds in timed_steps(check, cfg.residual, gpu).items()
             if timed_mode == mode and supports(cfg, path)}
    if not timed:
        return None
    path = min(timed, key=timed.get)
    return path, timed[path]


def measured_path(cfg, device: torch.device) -> tuple[str, str] | None:
    """fastest_timed for this device, from {out}/gpu_check/result.json, with the reason."""
    check = load_check(cfg.out)
    gpu = torch.cuda.get_device_name(device) if check else None
    timed = fastest_timed(cfg, check, gpu) if check else None
    if timed is None:
        return None
    return timed[0], (f"auto: --check timed it fastest for {cfg.residual} ({timed_mode(cfg)}) on this {gpu}, "
                      f"{timed[1]:.3f} s/step")


def triton_problem(device: torch.device, make_connection) -> str | None:
    """None when triton imports and one connection on its path equals the formulas' on this device; else what failed."""
    try:
        return triton_kernels().self_check(make_connection, device)
    except Exception as error:          # an import, compile or launch failure: each of them means the formulas
        return f"failed ({error_line(error)})"


def use_flash_attention(cfg, device: torch.device, dtype: torch.dtype) -> bool:
    """--attn: flash-attn 2 where asked (refused where it cannot run) or, for auto, where it is installed on CUDA with
    bf16; else PyTorch's SDPA. The planner prices either alike: attention by its FLOPs, its saved tensors measured with
    SDPA's CPU kernel, which keeps what flash-attn keeps (q, k, v, the output and the log-sum-exp)."""
    try:
        import flash_attn  # noqa: F401
        installed = True
    except ImportError:
        installed = False
    if cfg.attn == "flash" and not (installed and device.type == "cuda" and dtype == torch.bfloat16):
        raise ConfigError("--attn flash needs flash-attn installed (bash setup.sh on a CUDA machine), a CUDA "
                          "device and bf16; use --attn sdpa")
    return cfg.attn == "flash" or (cfg.attn == "auto" and installed and device.type == "cuda"
                                   and dtype == torch.bfloat16)

"""monitor.py: what a run says about itself beside its metrics: its record, its pace, and W&B.

Beside train_c4.py, which decides what a step records (metrics.jsonl, through run_folder.RunLog). Here: config.json's
record of what produced the run (settings, precision, versions, git commit), the pace shown while it trains (a
progress bar or plain log lines, status.json's live fields) and, on rank 0, Weights & Biases (README, "Weights &
Biases"), which never stops training.
"""
from __future__ import annotations

import dataclasses, functools, importlib.metadata, os, secrets, subprocess, sys
from datetime import timedelta
from pathlib import Path

import torch
from tqdm import tqdm

from hcstudy import ROOT
from hcstudy.planner.memory import parameter_summary
from hcstudy.run_folder import write_atomically

WANDB_MODES = ("auto", "online", "offline", "disabled")


# ----------------------------------------------------------------------------------------------
# the run's record: config.json, and W&B's config; train.log's opening

def announce(trainer, params: dict, record: dict, held_out: str, warning_lines: list[str]) -> None:
    """train.log's opening: what runs where, the model, the batch, the data, and what seldom means what was meant."""
    cfg, log = trainer.cfg, trainer.log
    log.info(f"run {cfg.run_name}: {cfg.residual} depth {cfg.depth} width {cfg.width} streams "
             f"{1 if cfg.residual == 'baseline' else cfg.expansion} on {trainer.dist.world} x {record['device_name']} "
             f"({record['dtype']}, {record['attention']} attention)")
    log.info(f"streams' kernels: {record['kernels']} ({record['kernels_reason']})")
    log.info(f"model: {parameter_summary(params)}")
    log.info(f"tokens per step: {cfg.tokens_per_step:,} = {cfg.batch_size} sequences x {cfg.seq_len}; micro-batch "
             f"{trainer.micro} x {trainer.accum} accumulation steps x {trainer.dist.world} process(es)")
    log.info(f"run: {cfg.steps:,} steps, {cfg.steps * cfg.tokens_per_step:,} tokens, "
             f"{trainer.flops_per_token:.3g} FLOPs per token")
    loader = f"{cfg.data_workers} loader process(es)" if cfg.data_workers else "a loader thread"
    read = len(set(trainer.loader.batches.owners))
    shared = ", shared between processes" if cfg.data_streams % trainer.dist.world else ""
    log.info(f"data: {cfg.data}, {cfg.data_streams} streams ({read} read by this process{shared}, {loader} each), "
             f"data seed {cfg.data_seed}")
    log.info(f"held out for validation and the probe: {held_out}")
    for line in warning_lines:
        log.info(f"warning: {line}")


def precision_policy(dtype: torch.dtype) -> dict:
    """What runs in which precision: the same under one process, DDP and FSDP (the streams' dtype is a choice:
    fp32, so that a gain is never a bf16 rounding artefact). Recorded in config.json; the report marks a table
    whose runs differ in it."""
    return {"matmuls": "bf16" if dtype == torch.bfloat16 else "fp32", "residual_streams": "fp32",
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
               params: dict) -> dict:
    """config.json's record; kernels: the streams' path and why it was taken (fused.kernel_path)."""
    return {"config": {**dataclasses.asdict(cfg), "micro_batch_size": micro}, "n_params": params["total"],
            "params": params, "world_size": dist.world, "device": dist.device.type,
            "device_name": device_name(dist.device),
            "dtype": str(dtype).removeprefix("torch."), "precision": precision_policy(dtype),
            "attention": "flash" if use_flash else "sdpa", "kernels": kernels[0],
            "kernels_reason": kernels[1],
            "versions": {"python": sys.version.split()[0], "torch": torch.__version__, "cuda": torch.version.cuda,
                         "datasets": importlib.metadata.version("datasets"),
                         "tiktoken": importlib.metadata.version("tiktoken")},
            "git_commit": git_commit()}


# ----------------------------------------------------------------------------------------------
# the pace: a progress bar or plain log lines, and status.json's live fields

class Progress:
    """A tqdm bar on an interactive terminal, a plain log line every --log-every steps otherwise. Both carry the
    run's pace (tokens/s, MFU, memory, ETA); status.json shows the same, rewritten at every log step."""

    LIVE_KEYS = ("loss", "lr", "grad_norm", "tokens", "step_time_s", "tokens_per_s", "mfu", "mem_peak_gb",
                 "val_loss", "amax_fwd", "amax_bwd")

    def __init__(self, trainer):
        self.trainer, self.step_seconds = trainer, None
        interactive = trainer.dist.is_main and sys.stderr.isatty()
        self.bar = tqdm(total=trainer.cfg.steps, initial=trainer.step, dynamic_ncols=True) if interactive else None
        trainer.log.bar = self.bar
        trainer.log.live["steps"] = trainer.cfg.steps

    def update(self, record: dict) -> None:
        cfg, log, step = self.trainer.cfg, self.trainer.log, record["step"]
        # a moving average: the ETA follows the recent pace, not the first step's compilation or an evaluation
        seconds = record["step_time_s"]
        self.step_seconds = seconds if self.step_seconds is None else 0.9 * self.step_seconds + 0.1 * seconds
        log.live.update({key: record[key] for key in self.LIVE_KEYS if key in record},
                        eta_s=self.step_seconds * (cfg.steps - step))
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:,.0f}",
                                 amax=self._amax())
            self.bar.update(1)
        if step % cfg.log_every == 0 or step == cfg.steps:
            log.info(self.line(record), terminal=self.bar is None)     # the bar shows the pace; train.log keeps it
            log.status("running", step)

    def _amax(self) -> str:
        amax = self.trainer.log.live.get("amax_fwd")
        return f"{amax:.3g}" if amax is not None else "-"

    def line(self, record: dict) -> str:
        live = self.trainer.log.live
        val = f" val {record['val_loss']:.4f}" if "val_loss" in record else ""
        mfu = f" mfu {live['mfu']:.0%}" if live.get("mfu") is not None else ""
        mem = f" mem {live['mem_peak_gb']:.1f}GB" if live.get("mem_peak_gb") is not None else ""
        return (f"step {record['step']}/{self.trainer.cfg.steps} loss {record['loss']:.4f}{val} lr {record['lr']:.3g} "
                f"grad_norm {record['grad_norm']:.3g} amax_fwd {self._amax()} tok/s {record['tokens_per_s']:,.0f}"
                f"{mfu}{mem} eta {timedelta(seconds=round(live['eta_s']))}")

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.trainer.log.bar = None


# ----------------------------------------------------------------------------------------------
# Weights & Biases, rank 0 only

def _wandb_credentials() -> bool:
    netrc = Path.home() / ".netrc"
    return bool(os.environ.get("WANDB_API_KEY")) or (netrc.exists() and "api.wandb.ai" in netrc.read_text())


def wandb_mode(cfg) -> str:
    """--wandb beats $WANDB_MODE; auto is $WANDB_MODE when set, else online with credentials, offline without."""
    if cfg.wandb != "auto":
        return cfg.wandb
    env = os.environ.get("WANDB_MODE", "").strip().lower()
    if env in WANDB_MODES[1:]:
        return env
    return "offline" if env == "dryrun" or not _wandb_credentials() else "online"


def wandb_run_id(run_dir: Path) -> str:
    """Made once at random and kept in the run folder: every resume of the folder continues its W&B run, and a new
    folder is a new run even at the same path on another node (a hash of the path would collide)."""
    path = run_dir / "wandb_id.txt"
    if path.exists():
        return path.read_text().strip()
    run_id = secrets.token_hex(8)
    write_atomically(path, lambda tmp: tmp.write_text(run_id + "\n"))
    return run_id


def start_wandb(cfg, run_dir: Path, config_record: dict, log):
    """W&B on rank 0 only. Group: the matrix (the runs folder, or $WANDB_RUN_GROUP), job type: the method, name: the
    run folder. An online init that fails falls back to offline with one warning; training never stops for W&B."""
    mode = wandb_mode(cfg)
    if mode == "disabled" or not log.enabled:
        return None
    # wandb-core, the service wandb.init starts, leads a session of its own: with the launcher's job tag it would
    # be signalled as if it were a torchrun rank, and a trainer saving its checkpoint would lose its W&B connection
    os.environ.pop("RUN_EXPERIMENTS_JOB", None)
    import wandb            # about a second to import: only when W&B is on
    init = functools.partial(
        wandb.init, project=cfg.wandb_project or os.environ.get("WANDB_PROJECT") or "hc-mhc-c4",
        id=wandb_run_id(run_dir), name=run_dir.name, resume="allow", job_type=cfg.residual, config=config_record,
        group=os.environ.get("WANDB_RUN_GROUP") or Path(cfg.out).resolve().name,
        dir=os.environ.get("WANDB_DIR") or str(run_dir), settings=wandb.Settings(init_timeout=120))
    for attempt in dict.fromkeys((mode, "offline")):
        try:
            run = init(mode=attempt)
        except Exception as error:
            log.info(f"warning: W&B {attempt} init failed ({type(error).__name__}: {str(error).splitlines()[0][:200]}"
                     f"); {'logging offline instead' if attempt == 'online' else 'continuing without W&B'}")
            continue
        if attempt == "offline":
            sync = f"wandb sync {Path(run.dir).parent.resolve()}"
            log.info(f"W&B is offline; upload this run later with: {sync}")
            (run_dir / "wandb_sync.txt").write_text(sync + "\n")
        return run
    return None


def wandb_record(record: dict) -> dict:
    """A metrics line as W&B can plot it: each per-sublayer list becomes one scalar per sublayer under its key."""
    flat = {}
    for key, value in record.items():
        if isinstance(value, list):
            flat |= {f"{key}/{index:03d}": v for index, v in enumerate(value)}
        elif key not in ("step", "time"):
            flat[key] = value
    return flat

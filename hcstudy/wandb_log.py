"""Weights & Biases on rank 0 (docs/reliability.md, "Long matrices"): online with credentials, else offline; a failed
start falls back to offline with a warning and never stops training; a resumed run continues its W&B run."""
from __future__ import annotations

import functools
import os
import secrets
from pathlib import Path

from hcstudy.run_folder import write_atomically

WANDB_MODES = ("auto", "online", "offline", "disabled")


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
    import wandb  # about a second to import: only when W&B is on
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

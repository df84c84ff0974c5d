"""Train a GPT-style transformer on C4 with one residual arm (the plain residual, Hyper-Connections, mHC, and the
arms since: hcstudy/arms/), and measure whether the residual streams amplify.

    python train_c4.py --depth 48 --seed 123                 # one full C4 run (mHC by default)
    python train_c4.py --preset demo --residual hc           # CPU minutes, bundled Shakespeare
    torchrun --nproc_per_node=8 train_c4.py --parallel fsdp  # one run over a whole node

This file is the trainer: the loop, checkpointing and main. It reads in the order a run happens: the settings
(hcstudy/config.py: every flag, the presets, the checks), the model (hcstudy/model.py, the spec, composing the arm
of --residual), the data (hcstudy/data.py), the wrapping (hcstudy/distributed.py), the optimizer and its step
(hcstudy/optim.py), then the loop below. The maths and the metrics are in docs/model.md; the run folder, the exit
codes and the reliability rules in docs/reliability.md; the package's map in docs/architecture.md.
"""

from __future__ import annotations

import dataclasses, json, math, os, signal, sys, time
from pathlib import Path

from hcstudy import contract
from hcstudy.contract import (EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_OK, PLAN_JOBS, ConfigError, Diverged,
                              Interrupted, PlanRequest, RunFailed, TrainerError)

if __name__ == "__main__":  # a stop while torch loads (a second or more) is a stop before any step: 75, not 143
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(EXIT_INTERRUPTED))
    contract.exit_without_packages("train_c4.py", "torch", "tiktoken", "tqdm")

import torch
import torch.nn as nn
from tqdm import tqdm

from hcstudy import optim
from hcstudy.config import Config, odd_settings, parse_config, validate  # noqa: F401 (validate: the tests')
from hcstudy.data import (DataFiles, RankBatches, fixed_sequences, held_out_source, make_loader, make_tokenizer,
                          resolve_data_files)
from hcstudy.distributed import (Dist, compute_dtype, end_distributed, is_sharded, setup_distributed,
                                 shorten_timeout, unwrap, wrap_model)
from hcstudy.failures import classify_failure, exit_process, failure
from hcstudy.kernels import choice, cross_entropy
from hcstudy.metrics import instability_probe
from hcstudy.model import GPT, count_parameters, embedding_rows, kernel_path
from hcstudy.optim import lr_at, make_optimizer
from hcstudy.planner import gpus, memory
from hcstudy.planner.estimate import print_estimate
from hcstudy.planner.memory import batch_plan
from hcstudy.planner.plan_jobs import answer_jobs
from hcstudy.progress import Progress
from hcstudy.readahead import Loader
from hcstudy.run_folder import (NonFiniteState, RunLog, check_resumable, check_writable_folder, dcp_load, first_cause,
                                history_on, resume_from, rng_state, set_rng_state, write_checkpoint, write_json_atomic)
from hcstudy.run_record import announce, device_name, run_record
from hcstudy.wandb_log import start_wandb, wandb_record

# Imported where they are used, on purpose (`python -X importtime -c 'import train_c4'`): datasets and torch's
# fsdp and checkpoint packages (a second each, which --help and most tests never need), flash_attn, wandb.


# ----------------------------------------------------------------------------------------------
# training loop: the Trainer holds what the loop needs; its step is hcstudy/optim.py's, its measurements the probe
# (hcstudy/metrics.py) and the validation loss; checkpointing is its save and restore

class StopRequest:
    """SIGTERM/SIGINT only set a flag: the step in flight finishes, then a checkpoint is saved."""

    def __init__(self):
        self.requested = False
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame):
        self.requested = True


@dataclasses.dataclass
class Trainer:
    """What the loop needs, built once; the loop itself is the method `run`."""
    cfg: Config
    dist: Dist
    model: nn.Module
    optimizer: torch.optim.Optimizer
    loader: Loader
    val: tuple[torch.Tensor, torch.Tensor]
    micro: int
    accum: int
    dtype: torch.dtype
    log: RunLog
    run_dir: Path
    peak_flops: float | None
    flops_per_token: float
    step: int = 0
    tokens: int = 0
    history: dict = dataclasses.field(default_factory=dict)     # the batch sizes of its steps (history_on)
    wandb_run: object = None
    steady: bool = False        # past the first step: the short collective time-out applies

    def autocast(self):
        return optim.autocast(self.dist.device, self.dtype)

    def optimizer_step(self, stop: StopRequest) -> tuple[float, float, bool, float]:
        lr = lr_at(self.cfg, self.step)
        loss, stop_votes, study, norm = optim.gradients(self.model, self.optimizer, self.loader, self.accum, self.dist,
                                                        self.dtype, self.cfg.grad_clip, lr, stop)
        if not self.steady:
            shorten_timeout(self.dist, self.cfg.data_timeout)   # every rank has data, compiled code, communicators
            self.steady = True
        if not (math.isfinite(loss) and math.isfinite(norm)):
            self.optimizer.zero_grad(set_to_none=True)
            self.log.metrics({"step": self.step + 1, "time": time.time(), "loss": loss, "lr": lr, "grad_norm": norm})
            raise Diverged(f"non-finite {'loss' if not math.isfinite(loss) else 'gradient norm'} at step "
                           f"{self.step + 1} (loss {loss}, pre-clip gradient norm {norm})")
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return loss, norm, stop_votes > 0, study

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean loss over the fixed validation set; each rank takes every world-th sequence."""
        was_training = self.model.training
        self.model.eval()
        x_all, y_all = (t[self.dist.rank::self.dist.world] for t in self.val)
        total = torch.zeros(2, device=self.dist.device)
        # under the run's progress bar (an interactive terminal), a bar of its own: at C4 scale an evaluation
        # takes minutes, and a still bar would look like a hang
        for start in tqdm(range(0, len(x_all), self.micro), desc="evaluation", leave=False,
                          disable=self.log.bar is None):
            x, y = (t[start:start + self.micro].to(self.dist.device) for t in (x_all, y_all))
            with self.autocast():
                _, loss = self.model(x, y)
            total += torch.stack([loss.float() * len(x), torch.tensor(float(len(x)), device=self.dist.device)])
        self.model.train(was_training)
        loss_sum, count = self.dist.sum(total).tolist()
        return loss_sum / count

    def probe(self, with_layers: bool) -> dict:
        probe_idx = self.val[0][:self.cfg.probe_sequences].to(self.dist.device)
        return instability_probe(self.model, probe_idx, self.autocast, with_layers)

    # ------------------------------------------------------------------------------------------
    # checkpointing: what a checkpoint holds; how the ranks write, verify and fall back: hcstudy/run_folder.py

    def save(self) -> None:
        """Every rank: its data-loader and RNG state. Model and optimizer: rank 0 writes them whole
        (one process, DDP), or every rank writes its shards with torch.distributed.checkpoint (FSDP)."""
        files = {f"rank{self.dist.rank}.pt": {"data": self.loader.state_dict(), "rng": rng_state()}}
        sharded = None
        if is_sharded(self.model):
            from torch.distributed.checkpoint.state_dict import get_state_dict
            model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
            sharded = {"model": model_state, "optimizer": optimizer_state}
        if self.dist.is_main:
            files["train_state.pt"] = {"step": self.step, "tokens": self.tokens, **self.history,
                                       "config": dataclasses.asdict(self.cfg)}     # config.json may be rewritten
            if sharded is None:
                files |= {"model.pt": unwrap(self.model).state_dict(), "optimizer.pt": self.optimizer.state_dict()}
        write_checkpoint(self.run_dir, self.step, files, self.dist, self.cfg.keep_checkpoints, sharded,
                         self.log.folder)
        self.log.live["last_checkpoint_step"] = self.step
        if self.loader.skipped:
            self.log.info(f"data: {self.loader.skipped} malformed or empty lines skipped so far")

    def restore(self, changed: bool) -> dict:
        """Called after wrapping (FSDP loads its shards in place); returns the settings changed since the checkpoint."""
        found = resume_from(self.run_dir, self.dist, self._load, self.log, self.cfg, changed)
        state = found[1]["train_state.pt"] if found else {"step": 0, "tokens": 0, "batch_sizes": []}
        self.step, self.tokens = state["step"], state["tokens"]
        self.history = history_on(state, self.step, self.cfg.batch_size)
        if found is None:
            return {}
        if self.step > self.cfg.steps:
            raise ConfigError(f"{self.run_dir} has done {self.step} steps, more than --steps {self.cfg.steps}; "
                              f"pass --steps {self.step} or more, or choose another --run-name to start over")
        self.log.live["last_checkpoint_step"] = self.step
        self.log.info(f"resumed from {found[0]} (step {self.step}, {self.tokens:,} tokens)")
        return found[2]

    def _load(self, folder: Path, files: dict, marker: dict) -> str | None:
        """Load a verified checkpoint into the model, optimizer, loader and RNG; what did not fit, or None."""
        sharded = marker.get("format") == "sharded"
        self._check_format(folder, sharded)             # the command's, not the checkpoint's, problem
        try:
            self._load_model_and_optimizer(folder, files, sharded)
            self._load_data_and_rng(files)
        except (torch.OutOfMemoryError, torch.distributed.DistError):
            raise
        except NonFiniteState as damaged:           # DCP's shards: every rank found it together (dcp_load)
            return str(damaged)
        except (TrainerError, RuntimeError, ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
            return f"does not fit this run ({first_cause(error)})"
        return None

    def _check_format(self, folder: Path, sharded: bool) -> None:
        if sharded != is_sharded(self.model):
            fix = ("resume it under torchrun with --parallel fsdp (any number of processes), or export the "
                   "weights with `python train_c4.py --consolidate CHECKPOINT OUT.pt`" if sharded else
                   "resume it with one process or --parallel ddp")
            this_run = "FSDP" if is_sharded(self.model) else "not FSDP"
            raise ConfigError(f"checkpoint {folder} holds {'sharded (FSDP)' if sharded else 'whole'} model "
                              f"and optimizer state, this run is {this_run}; {fix}")

    def _load_model_and_optimizer(self, folder: Path, files: dict, sharded: bool) -> None:
        if not sharded:
            unwrap(self.model).load_state_dict(files["model.pt"])
            self.optimizer.load_state_dict(files["optimizer.pt"])
            return
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        model_state, optimizer_state = get_state_dict(self.model, self.optimizer)
        state = {"model": model_state, "optimizer": optimizer_state}
        dcp_load(state, folder)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])

    def _load_data_and_rng(self, files: dict) -> None:
        ranks = [state for name, state in sorted(files.items()) if name.startswith("rank")]
        self.loader.load_state_dict([state["data"] for state in ranks])
        if len(ranks) != self.dist.world:
            self.log.info(f"data: the checkpoint was written by {len(ranks)} process(es), this run has "
                          f"{self.dist.world}; every data stream continues where it stopped, so the batches are "
                          "those of an uninterrupted run")
        own = files.get(f"rank{self.dist.rank}.pt")
        if own is not None:
            set_rng_state(own["rng"])

    def record(self, loss: float, norm: float, lr: float, seconds: float, data_wait: float) -> dict:
        tokens_per_s = self.cfg.tokens_per_step / seconds
        mem = torch.cuda.max_memory_allocated(self.dist.device) / 1e9 if self.dist.device.type == "cuda" else None
        mfu = tokens_per_s * self.flops_per_token / (self.peak_flops * self.dist.world) if self.peak_flops else None
        return {"step": self.step, "time": time.time(), "loss": loss, "lr": lr, "grad_norm": norm,
                "clipped": bool(self.cfg.grad_clip and norm > self.cfg.grad_clip), "tokens": self.tokens,
                "step_time_s": seconds, "tokens_per_s": tokens_per_s, "mfu": mfu, "mem_peak_gb": mem,
                "data_wait_share": data_wait / seconds}

    def measurements(self) -> dict:
        """The probe and the validation loss, at their own intervals (and always at the last step)."""
        cfg, step, last = self.cfg, self.step, self.step == self.cfg.steps
        out = {}
        if step % cfg.metrics_every == 0 or last:
            out |= self.probe(with_layers=step % cfg.layer_metrics_every == 0 or last)
        if step % cfg.eval_every == 0 or last:
            out["val_loss"] = self.evaluate()
        return out

    def run(self, stop: StopRequest) -> None:
        progress = Progress(self.cfg, self.dist.is_main, self.log, self.step)
        if self.step == 0:
            self.log.metrics({"step": 0, "time": time.time(), **self.probe(with_layers=True)})
        while self.step < self.cfg.steps:
            started, lr, waited = time.perf_counter(), lr_at(self.cfg, self.step), self.loader.waited
            loss, norm, stopping, study = self.optimizer_step(stop)
            self.step += 1
            self.tokens += self.cfg.tokens_per_step
            seconds = time.perf_counter() - started
            measured = self.measurements()
            record = self.record(loss, norm, lr, seconds, self.loader.waited - waited) | measured
            record[contract.STUDY_TRAIN_KEY] = study
            self.log.metrics(record)
            if self.wandb_run is not None and (measured or self.step % self.cfg.log_every == 0):
                # not every step: W&B allows a run about 2 requests a second, and a matrix shares one project
                self.wandb_run.log(wandb_record(record), step=self.step)
            progress.update(record)
            if stopping or self.step % self.cfg.ckpt_every == 0 or self.step == self.cfg.steps:
                self.save()
            if stopping:
                raise Interrupted(f"stopped by a signal at step {self.step}; checkpoint saved, rerun to resume")
        progress.close()


# ----------------------------------------------------------------------------------------------
# a run: the checks before anything is allocated, the parts built in order, the loop, its end recorded

def preflight(cfg: Config, dist: Dist) -> tuple[int, int, DataFiles]:
    """Every check of a run that needs no model and no data read: (micro-batch, accumulation steps, the files).
    A bad setting ends here with one line, before anything is allocated; only --out is created."""
    if cfg.parallel == "fsdp" and "WORLD_SIZE" not in os.environ:
        raise ConfigError("--parallel fsdp shards over torchrun's processes: start it with torchrun (or plan with "
                          "--estimate --estimate-world-size N)")
    micro, accum, why = batch_plan(cfg, dist.world)
    if why and dist.is_main:
        print(f"micro-batch auto: {micro} ({why})", flush=True)
    memory.check_memory(cfg, embedding_rows(cfg), micro, dist.world, dist.device)
    data = resolve_data_files(cfg.data, cfg.val_data)
    check_writable_folder(Path(cfg.out), "--out")
    return micro, accum, data


def build_trainer(cfg: Config, dist: Dist) -> Trainer:
    micro, accum, data = preflight(cfg, dist)
    run_dir = Path(cfg.out) / cfg.run_name
    log = RunLog(run_dir, dist.is_main)                 # locks the run folder before anything of it is read
    with log.recording_start_failure(lambda error: classify_failure(error, micro)):
        changes = check_resumable(run_dir, cfg, log)
        dtype = compute_dtype(cfg, dist.device)
        use_flash = choice.use_flash_attention(cfg, dist.device, dtype)
        tokenizer = make_tokenizer(cfg.tokenizer)
        val = fixed_sequences(data, tokenizer, cfg.seq_len, cfg.eval_batches * cfg.batch_size, cfg.doc_separator)
        torch.manual_seed(cfg.seed)
        kernels, kernels_reason = kernel_path(cfg, dist.device)
        loss_path = cross_entropy.choose(cfg, device_name(dist.device), contract.load_check(cfg.out))
        model = GPT(cfg, use_flash, kernels, loss_path[0]).to(dist.device)
        wrapped = wrap_model(model, cfg, dist, dtype)        # before the optimizer: FSDP2 replaces the parameters
        optimizer = make_optimizer(model, cfg)
        micro = memory.confirm_micro_batch(cfg, dist, unwrap(wrapped), dtype, micro)     # auto on CUDA: one real step
        accum = cfg.batch_size // (micro * dist.world)
        batches = RankBatches(data.train, tokenizer, cfg, dist.rank, dist.world, micro, data.held_out_slice)
        loader = make_loader(batches, cfg, pin_memory=dist.device.type == "cuda")
        params = count_parameters(cfg)
        peak, flops = gpus.gpu_peak_flops(device_name(dist.device)), gpus.flops_per_token(cfg, params)
        trainer = Trainer(cfg, dist, wrapped, optimizer, loader, val, micro, accum, dtype, log, run_dir, peak, flops)
        trainer.log.record_changes(changes | trainer.restore(changed=bool(changes)), trainer.step)
        record = run_record(cfg, micro, dist, dtype, use_flash, (kernels, kernels_reason), params, loss_path)
        log.write_config(record)
        trainer.wandb_run = start_wandb(cfg, run_dir, record, trainer.log)
        announce(cfg, log, record, params, len(set(batches.owners)), held_out_source(data, cfg.val_data),
                 odd_settings(cfg))
        return trainer


def train(cfg: Config) -> None:
    dist = setup_distributed()
    trainer = build_trainer(cfg, dist)
    log, stop = trainer.log, StopRequest()
    try:        # from here every failure is recorded: a full disk may already refuse the first `running` state
        # a fresh start logs its own step-0 probe again, so nothing of an earlier attempt is kept
        log.open_metrics(keep_through_step=trainer.step if trainer.step else -1)
        log.count_restart()
        log.status("running", trainer.step)
        trainer.run(stop)
    except Diverged as error:
        log.status("diverged", trainer.step, EXIT_DIVERGED, str(error))
        raise
    except Interrupted as error:
        log.status("interrupted", trainer.step, EXIT_INTERRUPTED, str(error))
        log.info(str(error), terminal=False)           # main prints it; a run started by hand keeps it in train.log
        raise
    except BaseException as error:
        code, reason, own = failure(error, dist, trainer.micro)
        status = reason if dist.world == 1 or reason.startswith("rank ") else f"rank {dist.rank}: {reason}"
        if dist.world > 1 and not dist.is_main and own:
            # this rank failed first; rank 0 may be killed by torchrun before it can record why
            write_json_atomic(trainer.run_dir / "status.json", {"state": "failed", "step": trainer.step,
                              "exit_code": code, "reason": status, "updated": time.time()})
        reason += log.record_failure(trainer.step, code, status)
        raise RunFailed(code, reason) from error
    finally:
        trainer.loader.close()
    log.status("completed", trainer.step, EXIT_OK)
    log.info(f"completed {trainer.step} steps; run folder {trainer.run_dir}")
    if trainer.wandb_run is not None:
        trainer.wandb_run.finish()


# ----------------------------------------------------------------------------------------------
# main: one line and an exit code for every expected failure (failures classifies; the codes: contract)

def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    dist = Dist(int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), torch.device("cpu"))
    try:
        if "--consolidate" in argv:
            from hcstudy import consolidate     # imported here: torch's checkpoint packages cost a second
            print(consolidate.consolidate(*consolidate.arguments(argv)))
            return EXIT_OK
        if argv == [PLAN_JOBS]:
            request = PlanRequest.from_json(json.load(sys.stdin))     # the planner judges with the trainer's checks
            print(json.dumps(answer_jobs(request)))
            return EXIT_OK
        cfg = parse_config(argv)
        if cfg.estimate:
            print_estimate(GPT, cfg, count_parameters(cfg))
        else:
            train(cfg)
        end_distributed()
        return EXIT_OK
    except SystemExit as done:               # --help
        return done.code if isinstance(done.code, int) else EXIT_OK
    except BaseException as error:
        code, reason, _ = failure(error, dist)
        if isinstance(error, (Diverged, Interrupted)):
            end_distributed()                # every rank stops at the same step: a clean shutdown
        cause = error.__cause__ if isinstance(error, RunFailed) else error
        if code == 1 and not isinstance(cause, (TrainerError, OSError)):
            raise                            # a bug, not an expected failure: its traceback is what helps
        label = "" if isinstance(error, Interrupted) else "error: "     # a Ctrl-C or SIGTERM was asked for
        # one write: ranks leave end_distributed's barrier together, and print's text and newline would interleave
        sys.stderr.write(f"{label}{'' if dist.world == 1 else f'rank {dist.rank}: '}{reason}\n")
        if dist.world > 1:
            # torchrun sends SIGTERM to every other rank as soon as one exits non-zero, and Python restores
            # the default handler while it shuts down: a rank a few ms behind would be reported as killed
            # (-15) instead of with its own exit code
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        return code


if __name__ == "__main__":
    exit_process(main())
"""A run's folder on disk (docs/reliability.md, "A run's folder"), whole after any crash, kill or full disk.

Beside train_c4.py, which decides what a run logs and what a checkpoint holds; here is how those files are
written and read back: atomic writes, the folder's lock, train.log, metrics.jsonl and status.json, checkpoint
folders sealed by a marker with checksums and verified before anything in them is loaded, and DCP's files read
without unpickling arbitrary objects (docs/reliability.md).
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import io
import json
import os
import pickle
import random
import shutil
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from hcstudy.contract import (CHECKPOINT_MARKER as MARKER, CHECKPOINTS, CONFIG_FILE, EXIT_BAD_CONFIG,
                              LOCK_PROBE_GRACE_S, METRICS_FILE, MODEL_KEYS, RUN_LOCK, STATUS_FILE, TRAIN_LOG,
                              TRAINING_KEYS, ConfigError, TrainerError, this_host, upgraded_config,
                              write_atomically, write_json_atomic)
from hcstudy.finite_state import NonFiniteState, non_finite_problem

# ----------------------------------------------------------------------------------------------
# files written whole or not at all

def first_cause(error: BaseException) -> str:
    """One line for an error; DCP's CheckpointException holds each rank's error with its traceback."""
    failures = getattr(error, "failures", None)
    if isinstance(failures, dict) and failures:
        error = next(iter(failures.values()))[0]
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    lines = str(error).strip().splitlines()
    if isinstance(error, pickle.UnpicklingError) and lines and lines[0].startswith("Weights only load failed"):
        # torch's first line advises weights_only=False, the one thing never to do with a file of unknown origin
        refused = next((line for line in lines[1:] if "GLOBAL" in line or "global" in line), "")
        return f"UnpicklingError: it holds objects besides tensors and plain data, refused unread ({refused.strip()})"
    return f"{type(error).__name__}: {lines[0]}" if lines else type(error).__name__


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_path(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def save_file(obj, path: Path) -> None:
    """torch.save, then fsync. torch.save reports a failed write (full disk, quota, file size limit) as a
    RuntimeError without an errno ("unexpected pos 704 vs 598"): raised again as the OSError it is."""
    try:
        torch.save(obj, path)
    except RuntimeError as error:
        raise OSError(errno.EIO, f"writing {path.name} failed ({first_cause(error)}): a full disk, a quota or a "
                      "file size limit") from error
    fsync_path(path)


def open_own(path: Path, mode: str):
    """open(path, mode) for a file of the run folder, never through a symbolic link (O_NOFOLLOW): a link there
    would point the write at a file outside the folder."""
    flags = {"a": os.O_WRONLY | os.O_CREAT | os.O_APPEND, "wb": os.O_WRONLY | os.O_CREAT | os.O_TRUNC}[mode]
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as error:
        if error.errno != errno.ELOOP:
            raise
        raise ConfigError(f"{path} is a symbolic link; a run folder's files are never written through one: "
                          "remove it") from None
    return os.fdopen(fd, mode, buffering=1 if "b" not in mode else -1)


class WriteFailed(TrainerError):
    """A write of the run folder that the file system refused, as one line naming the file and what is intact."""


@contextlib.contextmanager
def naming_the_file(path: Path, what: str, intact: str):
    """An OSError inside becomes WriteFailed: "could not `what` `path` (cause); `intact`". A full disk's error from
    write() names no file ("No space left on device" alone)."""
    try:
        yield
    except OSError as error:
        raise WriteFailed(f"could not {what} {path} ({first_cause(error)}); {intact}; free disk space (or fix the "
                          "permission) and rerun to resume") from error


INTACT = "metrics.jsonl and the checkpoints are intact"


def check_writable_folder(folder: Path, what: str) -> None:
    """Create `folder` if needed and prove that it takes a file, before anything is computed: a bad path is a
    one-line config error (exit 2) instead of a failure at the first write."""
    if folder.exists() and not folder.is_dir():
        raise ConfigError(f"{what} {folder} is a file, not a folder")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise ConfigError(f"{what} {folder} cannot be written to ({first_cause(error)})") from None


# ----------------------------------------------------------------------------------------------
# the lock and the logs: train.log, metrics.jsonl (append + flush), status.json (atomic, with a reserve)

def refuse_links(run_dir: Path) -> None:
    """A symbolic link among the run folder's own entries would take its writes outside --out: refused unread."""
    links = sorted(entry.name for entry in os.scandir(run_dir) if entry.is_symlink())
    if links:
        raise ConfigError(f"{run_dir / links[0]} is a symbolic link; a run folder's files are never written through "
                          "one: replace it with the file itself, or choose another --run-name")


def lock_run_folder(run_dir: Path):
    """An exclusive flock on RUN/.lock, held while the process lives (the kernel drops it when the process dies,
    so a dead holder never blocks): two trainers on one folder would interleave metrics and checkpoints."""
    lock = run_dir / RUN_LOCK
    handle = open_own(lock, "a")
    try:
        take_lock(handle)
    except OSError:
        handle.close()
        holder = lock_holder(lock)
        # a PID written into the file could be a dead trainer's, since reused: only the kernel's own record is named
        holder = f"process {holder}" if holder else f"another process (`fuser {lock}` names it)"
        raise ConfigError(f"{run_dir} is in use by {holder}; wait for it to end (or stop it), or choose another "
                          "--run-name or --out") from None
    return handle


def take_lock(handle) -> None:
    """The exclusive flock, tried again for LOCK_PROBE_GRACE_S: report.py's look at whether a run is alive
    (contract.run_lock_free) holds a shared lock for an instant, which must not turn a start away."""
    deadline = time.monotonic() + LOCK_PROBE_GRACE_S
    while True:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def lock_holder(lock: Path) -> int | None:
    """The live process holding the flock on `lock`, from the kernel's table of locks (/proc/locks: "1: FLOCK
    ADVISORY WRITE PID MAJOR:MINOR:INODE 0 EOF"); None where the table does not name one (a holder on another node
    of a network file system, or in another PID namespace, a system without /proc)."""
    try:
        info, table = os.stat(lock), Path("/proc/locks").read_text()
    except OSError:
        return None
    inode = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    for fields in map(str.split, table.splitlines()):
        if fields[1:2] == ["FLOCK"] and fields[5:6] == [inode] and fields[4].isdigit() and \
                Path(f"/proc/{fields[4]}").exists():
            return int(fields[4])
    return None


def _same_file(stream, path: Path) -> bool:
    try:
        return path.exists() and os.path.samestat(os.fstat(stream.fileno()), os.stat(path))
    except (OSError, ValueError):
        return False


STATUS_RESERVE = ".status-reserve"
STATUS_RESERVE_BYTES = 1 << 20     # far more than any status.json; random bytes, which no file system compresses


class RunLog:
    """The run folder's human and machine logs; only rank 0 writes them. Every rank holds the run folder as opened at
    the start (`folder`: held_run_folder), which its checkpoint files are written relative to."""

    def __init__(self, run_dir: Path, enabled: bool):
        self.run_dir, self.enabled = run_dir, enabled
        self.bar = None
        # what status.json shows of a running run besides its state (docs/reliability.md); its host tells the
        # report where the run's lock can show whether it is alive (contract.run_lock_free)
        self.live = {"host": this_host()}
        # freed when the final status.json finds the disk full, so that the final state is still recorded
        self.reserve = run_dir / STATUS_RESERVE
        if enabled:
            run_dir.mkdir(parents=True, exist_ok=True)
            refuse_links(run_dir)
            if (run_dir / ".lock").is_dir():        # no process can hold it, so none is writing this folder
                raise self.refuse(f"{run_dir / '.lock'} is a folder, not the run's lock file; remove it and rerun")
            self.lock = lock_run_folder(run_dir)
            with contextlib.suppress(OSError), open_own(self.reserve, "wb") as reserve:
                reserve.write(os.urandom(STATUS_RESERVE_BYTES))
            # the launcher already appends our stdout to train.log; writing it twice would double every line
            tee = not _same_file(sys.stdout, run_dir / TRAIN_LOG)
            self.log_file = open_own(run_dir / TRAIN_LOG, "a") if tee else None
            self.metrics_file = None
        self.folder = held_run_folder(run_dir)

    def info(self, message: str, terminal: bool = True) -> None:
        """A line for train.log, and for the terminal unless it already shows the same (the progress bar, the
        trainer's last line on stderr)."""
        if not self.enabled:
            return
        line = f"[{time.strftime('%Y-%m-%d %H:%M:%S')}] {message}"
        if terminal:
            (self.bar.write if self.bar else print)(line)
            sys.stdout.flush()
        if self.log_file:
            with naming_the_file(self.run_dir / TRAIN_LOG, "append to", INTACT):
                self.log_file.write(line + "\n")

    def open_metrics(self, keep_through_step: int) -> None:
        """Drop lines after the checkpoint being resumed (they are recomputed identically), then append. A line
        missing up to its step (cut, deleted) cannot be recomputed from it: the gap is said and marked."""
        if not self.enabled:
            return
        path = self.run_dir / METRICS_FILE
        records = _metrics_records(path) if path.exists() else []
        kept = [(step, line) for line, step in records if step is not None and step <= keep_through_step]
        unusable = sum(step is None for _, step in records)
        if unusable:
            self.info(f"warning: {path}: {unusable} line(s) that are not metrics records (no whole-number step) "
                      "dropped")
        missing = sorted(set(range(keep_through_step + 1)) - {step for step, _ in kept})
        if missing:
            self.keep_damaged_metrics(path, missing, keep_through_step)
        # a lost step keeps a line saying so: the steps stay consecutive, and a later resume finds no gap again
        kept = sorted(kept + [(step, json.dumps({"step": step, "lost": True})) for step in missing], key=lambda k: k[0])
        with naming_the_file(path, "rewrite", "it is unchanged and the checkpoints are intact"):
            write_atomically(path, lambda tmp: tmp.write_text("".join(line + "\n" for _, line in kept)))
        with naming_the_file(path, "open", INTACT):
            self.metrics_file = open_own(path, "a")

    def keep_damaged_metrics(self, path: Path, missing: list[int], checkpoint_step: int) -> None:
        """A resume whose metrics.jsonl lacks lines up to its checkpoint: a history shortened for good, so said on
        the console and in train.log, with the file as found kept beside it (metrics.damaged-N.jsonl)."""
        found = "no metrics.jsonl was there"
        if path.exists():
            aside = self.first_free("metrics.damaged-{n}.jsonl")
            shutil.copyfile(path, aside)
            found = f"the file as found is kept as {aside}"
        self.info(f"warning: {path} lacks the lines of step(s) {step_ranges(missing)} (cut or deleted); the run "
                  f"resumes from checkpoint step-{checkpoint_step}, which cannot recompute them, so each is marked "
                  f"\"lost\": true; {found}")

    def metrics(self, record: dict) -> None:
        if self.enabled:
            with naming_the_file(self.run_dir / METRICS_FILE, f"append step {record['step']} to",
                                 "the lines before it and the checkpoints are intact"):
                self.metrics_file.write(json.dumps(record) + "\n")
                self.metrics_file.flush()

    def status(self, state: str, step: int, exit_code: int | None = None, reason: str = "") -> None:
        """status.json, rewritten atomically on every change of state and at every log step; only a final state
        may spend the reserve (a `running` one that finds the disk full fails the run, which is then recorded)."""
        if not self.enabled:
            return
        record = {"state": state, "step": step, "exit_code": exit_code, "reason": reason, "updated": time.time(),
                  **self.live}
        with naming_the_file(self.run_dir / STATUS_FILE, f"record the state {state} in", INTACT):
            try:
                write_json_atomic(self.run_dir / STATUS_FILE, record)
            except OSError as error:
                if error.errno not in (errno.ENOSPC, errno.EDQUOT) or state == "running" or not self.reserve.exists():
                    raise
                self.reserve.unlink()
                write_json_atomic(self.run_dir / STATUS_FILE, record)

    def record_failure(self, step: int, code: int, reason: str) -> str:
        """Records `failed`; returns what the printed line must add when status.json cannot take it (it keeps
        the state before)."""
        try:
            self.status("failed", step, code, reason)
            return ""
        except WriteFailed as unrecorded:
            return f"; status.json could not record the failure either ({first_cause(unrecorded.__cause__)})"

    def write_config(self, record: dict) -> None:
        """config.json: the run's record (train_c4.run_record)."""
        if self.enabled:
            with naming_the_file(self.run_dir / CONFIG_FILE, "write", INTACT):
                write_json_atomic(self.run_dir / CONFIG_FILE, record)

    def refuse(self, reason: str) -> ConfigError:
        """A resume that cannot go on, recorded as failed (exit 2) at the step status.json had, and returned."""
        step = self.previous_status().get("step")
        with contextlib.suppress(WriteFailed):
            self.status("failed", step if type(step) is int else 0, EXIT_BAD_CONFIG, reason)
        return ConfigError(reason)

    @contextlib.contextmanager
    def recording_start_failure(self, classify):
        """A run that fails while it is built (no model, no data, no memory) leaves a new folder saying why, as
        `failed` with classify(error)'s exit code and reason; an earlier run's record stays as it was."""
        try:
            yield
        except BaseException as error:
            if not self.previous_status():
                code, reason = classify(error)
                with contextlib.suppress(WriteFailed):      # a full disk: the printed line still says why
                    self.status("failed", 0, code, reason)
            raise

    def previous_status(self) -> dict:
        try:
            previous = json.loads((self.run_dir / STATUS_FILE).read_text())
        except (OSError, ValueError, RecursionError):
            return {}
        return previous if isinstance(previous, dict) else {}

    def previous_config(self) -> dict | None:
        """recorded_config, an unreadable one refused through this log (its status.json records why)."""
        return recorded_config(self.run_dir, self.refuse)

    def lost_progress(self, changed: bool) -> str | None:
        """Why this folder, with no checkpoint left, must not start over: status.json names a checkpoint, or
        metrics.jsonl goes past the lines a restart recomputes (restart_recomputes). None for a new folder, or
        one whose run ended before its first checkpoint (it starts again and recomputes the same lines)."""
        if not self.enabled:
            return None
        metrics = self.run_dir / METRICS_FILE
        steps = [step for _, step in _metrics_records(metrics) if step is not None] if metrics.is_file() else []
        saved = self.previous_status().get("last_checkpoint_step")
        if not (type(saved) is int and saved > 0 or max(steps, default=0) > self.restart_recomputes(changed)):
            return None
        return (f"{self.run_dir} holds a run's history (metrics to step {max(steps, default=0)}) but no checkpoint "
                "to resume from; choose another --run-name, or pass --resume never to start over (its files are "
                "moved aside, not deleted)")

    def restart_recomputes(self, changed: bool) -> int:
        """The last step whose line a restart writes again identically: the first checkpoint step of the settings
        config.json recorded (a later line means a checkpoint was written). Under changed settings a restart
        computes other lines, and without config.json when a checkpoint was due is unknown: then step 0 only."""
        recorded = None if changed else self.previous_config()
        due = [recorded.get("ckpt_every"), recorded.get("steps")] if recorded else []
        return min(due) if due and all(type(step) is int and step > 0 for step in due) else 0

    def set_aside_history(self) -> None:
        """--resume never: every file of an earlier run moves to RUN/previous-N/ (never deleted); the lock, the
        reserve and train.log, which this run holds open, stay."""
        if not self.enabled:
            return
        kept = {".lock", STATUS_RESERVE, TRAIN_LOG}
        entries = [e for e in self.run_dir.iterdir() if e.name not in kept and not e.name.startswith("previous-")]
        if not entries:
            return
        aside = self.first_free("previous-{n}")
        aside.mkdir()
        for entry in entries:
            os.replace(entry, aside / entry.name)
        self.info(f"--resume never: the earlier run's files moved to {aside}; starting over")

    def first_free(self, pattern: str) -> Path:
        """RUN/pattern with {n} the first number not taken: what an earlier move aside kept is never replaced."""
        return next(path for n in range(1, 1 << 30) if not (path := self.run_dir / pattern.format(n=n)).exists())

    def record_changes(self, changes: dict, step: int) -> None:
        """A resume under changed training settings (--allow-changed-settings), said in the log and kept in
        settings_changes.jsonl."""
        if not changes:
            return
        self.info(f"continuing at step {step} under changed settings (--allow-changed-settings): "
                  f"{changes_text(changes)}")
        if self.enabled:
            path = self.run_dir / "settings_changes.jsonl"
            with naming_the_file(path, "append to", INTACT), open_own(path, "a") as f:
                f.write(json.dumps({"time": time.time(), "step": step, "changes": changes}) + "\n")

    def count_restart(self) -> None:
        """restarts: how often this run folder was started again after its first start."""
        restarts = self.previous_status().get("restarts", -1)
        self.live["restarts"] = restarts + 1 if type(restarts) is int and restarts >= -1 else 0


def recorded_config(run_dir: Path, refuse=ConfigError) -> dict | None:
    """config.json's "config" record of the run in this folder; None without one; refused (refuse(line): an
    exception to raise) when unreadable: what made the run cannot be known."""
    path = run_dir / CONFIG_FILE
    if not path.exists():
        return None
    try:
        old = json.loads(path.read_text())["config"]
    except (OSError, ValueError, KeyError, TypeError, IndexError, RecursionError):
        old = None
    if not isinstance(old, dict):
        raise refuse(f"{path} is unreadable (no \"config\" record); move that run folder away or choose another "
                     "--run-name")
    return old


def changes_text(changes: dict) -> str:
    return ", ".join(f"{key} {was!r} -> {now!r}" for key, (was, now) in changes.items())


def check_resumable(run_dir: Path, cfg, log: RunLog | None = None) -> dict:
    """Whether the trainer's Config `cfg` may continue the run in `run_dir` (settings_changes of its config.json).
    Under --resume never the trainer (`log`) moves an earlier run's files aside. Without the run's log (the
    launcher's check of a finished run) nothing is recorded or moved."""
    if cfg.resume == "never":
        if log:
            log.set_aside_history()
        return {}
    old = log.previous_config() if log else recorded_config(run_dir)
    return {} if old is None else settings_changes(old, cfg, str(run_dir))


def settings_changes(old: dict, cfg, source: str) -> dict:
    """The training settings `cfg` changes from those `source` (a run folder, a checkpoint) recorded in `old`
    ({key: [old, new]}); a different model refused, changed training settings unless --allow-changed-settings."""
    old = upgraded_config(old)                                           # as this version names the settings
    recorded = {key: old.get(key, field.default) for key, field in type(cfg).__dataclass_fields__.items()}
    for key in MODEL_KEYS:                                               # a key newer than the run: its default
        if recorded[key] != getattr(cfg, key):
            raise ConfigError(f"{source} was trained with {key}={recorded[key]!r} but this command has "
                              f"{key}={getattr(cfg, key)!r}; choose another --run-name or --out")
    changes = {key: [recorded[key], getattr(cfg, key)] for key in TRAINING_KEYS if recorded[key] != getattr(cfg, key)}
    if changes and not cfg.allow_changed_settings:
        raise ConfigError(f"{source} was trained with other settings ({changes_text(changes)}); rerun with its "
                          "settings, choose another --run-name, or pass --allow-changed-settings to continue under "
                          "the new ones")
    return changes


def history_on(state: dict, step: int, batch_size: int) -> dict:
    """What a checkpoint records of the batch sizes of its steps (trained_tokens): those of the train_state.pt
    resumed, `state`, continued from `step` with `batch_size`, a part of its own where a resume changes it
    (--allow-changed-settings); the unverified_tokens of the steps before a history that begins past step 0."""
    history = state["batch_sizes"]
    continued = history if history and history[-1][1] == batch_size else [*history, [step, batch_size]]
    return {key: state[key] for key in ["unverified_tokens"] if key in state} | {"batch_sizes": continued}


def step_ranges(steps: list[int]) -> str:
    """Sorted steps as runs: [0, 1, 2, 5, 7, 8] -> "0-2, 5, 7-8"."""
    runs = []
    for step in steps:
        if runs and runs[-1][1] == step - 1:
            runs[-1][1] = step
        else:
            runs.append([step, step])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def _metrics_records(path: Path) -> list[tuple[str, int | None]]:
    """(line, its step) of every line; the step is None where the line is no record: cut by a kill mid-write,
    not a JSON object, too deeply nested to parse, or without a whole-number step."""
    records = []
    for line in filter(str.strip, path.read_text(errors="replace").splitlines()):
        try:
            step = json.loads(line).get("step")
        except (ValueError, AttributeError, RecursionError):
            step = None
        records.append((line, step if type(step) is int else None))
    return records


# ----------------------------------------------------------------------------------------------
# checkpoint folders: temp folder + marker with checksums + rename; verified before anything is loaded

SHARDED = "sharded"     # an FSDP checkpoint's model and optimizer: torch.distributed.checkpoint files


def rng_state() -> dict:
    """The random states a checkpoint holds per rank, so that a resumed run draws what an uninterrupted one would."""
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def checkpoint_dirs(run_dir: Path) -> list[Path]:
    """Checkpoint folders `step-N`, oldest first (temp and set-aside folders are never listed)."""
    return step_folders(run_dir / CHECKPOINTS)


def step_folders(root: Path) -> list[Path]:
    found = [d for d in root.glob("step-*") if d.name[5:].isascii() and d.name[5:].isdigit()] if root.is_dir() else []
    return sorted(found, key=lambda d: int(d.name[5:]))


def prune(root: Path, keep: int) -> None:
    """Only the newest `keep` checkpoints of the folder `root` stay (also on a resume: a kill may land between a seal
    and its prune)."""
    for old in step_folders(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)


def held_run_folder(run_dir: Path) -> int:
    """The run folder opened once, at the start, and held for the run's life (every rank): checkpoints are written
    relative to it, so that a folder or a link put in its place later never receives them."""
    run_dir.mkdir(parents=True, exist_ok=True)
    return os.open(run_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)


@contextlib.contextmanager
def checkpoints_folder(run_dir: Path, held: int):
    """RUN/checkpoints, created if needed and opened inside the held run folder without following a link, as a path
    that reaches the folder opened whatever is renamed or linked later (/proc/self/fd/N: torch.save and DCP take
    paths). refuse_links checks the start; a link put in its place during the run is refused here (exit 2)."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(CHECKPOINTS, dir_fd=held)
    try:
        fd = os.open(CHECKPOINTS, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=held)
    except OSError as error:
        if error.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise ConfigError(f"{run_dir / 'checkpoints'} was replaced during the run by a symbolic link or a file; a "
                          "checkpoint is never written through one: put the folder itself back and rerun to resume "
                          "(metrics.jsonl is intact)") from None
    try:
        opened = Path(f"/proc/self/fd/{fd}")
        yield opened if opened.is_dir() else run_dir / CHECKPOINTS     # no /proc (not Linux): its checked path
    finally:
        os.close(fd)


def set_aside(folder: Path) -> Path:
    """Rename a checkpoint that failed verification or loading to `rejected-step-N` (never listed, never loaded,
    kept for inspection), so that the run writes that step again; an older rejected copy of it is replaced."""
    aside = folder.with_name(f"rejected-{folder.name}")
    if aside.is_symlink() or aside.is_file():
        aside.unlink()
    shutil.rmtree(aside, ignore_errors=True)
    os.replace(folder, aside)
    return aside


def seal(tmp: Path, final: Path, marker: dict) -> None:
    """The marker, then the rename: a checkpoint folder under its final name is always complete. One already
    there under that name was not resumed from, so it failed to verify or load: it is set aside, not kept."""
    (tmp / MARKER).write_text(json.dumps(marker))
    fsync_path(tmp / MARKER)
    if final.exists() or final.is_symlink():
        set_aside(final)
    os.replace(tmp, final)
    fsync_path(final.parent)


def read_marker(folder: Path) -> dict | None:
    """The marker, when it names plain files inside the folder with their sha256 digests."""
    try:
        marker = json.loads((folder / MARKER).read_text())
        files = marker.get("files")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    plain = isinstance(files, dict) and all(isinstance(d, str) and not name.startswith("/") and ".." not in name
                                            for name, d in files.items())
    return marker if plain else None


def checkpoint_problem(folder: Path, marker: dict | None, dist) -> str | None:
    """What is wrong with this rank's share of the files (the ranks share the hashing), or None."""
    if folder.is_symlink():
        return "is a symbolic link, not a folder this run wrote"
    if marker is None:
        return "has no valid completion marker"
    if folder.name.startswith("step-") and folder.name != f"step-{marker.get('step')}":
        return f"holds step {marker.get('step')!r} under the name {folder.name}"
    for name, digest in list(marker["files"].items())[dist.rank::dist.world]:
        if not (folder / name).is_file():
            return f"is missing {name}"
        if sha256(folder / name) != digest:
            return f"has a corrupted {name} (checksum mismatch)"
    return None


def load_verified(folder: Path, marker: dict) -> dict:
    """The top-level .pt files of a verified checkpoint, loaded with weights_only=True; a sharded one's DCP
    metadata is read through the restricted unpickler too, so a crafted file is refused before DCP sees it."""
    if marker.get("format") == "sharded":
        safe_dcp()[0](folder / SHARDED).read_metadata()
    return {name: torch.load(folder / name, map_location="cpu", weights_only=True)
            for name in marker["files"] if "/" not in name}


def load_checked(folder: Path, marker: dict) -> tuple[dict, str | None]:
    """The top-level .pt files of a checkpoint whose checksums verified, and what they lack for a resume (None:
    nothing); a crafted or damaged pickle is a problem, not an exception."""
    try:
        files = load_verified(folder, marker)
        if "train_state.pt" in files:
            files["train_state.pt"] = completed_state(files["train_state.pt"], folder.parent.parent)
        return files, contents_problem(files, marker) or non_finite_problem(files)
    except Exception as error:
        return {}, f"cannot be loaded safely ({first_cause(error)})"


def completed_state(state, run_dir: Path):
    """A train_state.pt written before checkpoints recorded their settings and batch sizes (it holds neither) as
    checkpoints hold them now, from what its run folder recorded: config.json's settings (None without one:
    nothing to compare, as then); where those held for all its steps (no settings_changes.jsonl), one batch size
    from step 0, which its tokens must add up to; otherwise no history, its tokens taken unverified (the resume
    says so). Any other state is returned as it is."""
    if not (isinstance(state, dict) and "config" not in state and "batch_sizes" not in state):
        return state
    try:
        recorded = recorded_config(run_dir)
    except ConfigError:                                 # unreadable: a resume refuses it before any checkpoint
        recorded = None
    if recorded is not None and not (run_dir / "settings_changes.jsonl").exists():
        return state | {"config": recorded, "batch_sizes": [[0, recorded.get("batch_size")]]}
    return state | {"config": recorded, "batch_sizes": [], "unverified_tokens": state.get("tokens")}


def trained_tokens(state: dict) -> int | None:
    """The tokens of a checkpoint's steps: batch size x seq_len each, at the batch size of its part of the run
    (state["batch_sizes"]: [first step, batch size] pairs, a new one where a resume changed it under
    --allow-changed-settings), after the unverified_tokens of the steps before a history that begins past step 0
    (a run continued from a checkpoint that recorded none: completed_state); None when that does not fit the state."""
    history, unverified = state.get("batch_sizes"), state.get("unverified_tokens", 0)
    if not (isinstance(history, list) and all(isinstance(pair, list) and len(pair) == 2 and
                                              all(type(n) is int and n >= 0 for n in pair) for pair in history)):
        return None
    starts, settings = [start for start, _ in history], state.get("config") or {}
    seq_len = settings.get("seq_len")
    sizes_fit = not history or type(seq_len) is int and seq_len > 0 and history[-1][1] == settings.get("batch_size")
    begins_later = (starts[0] if history else state["step"]) > 0
    if not (sizes_fit and starts == sorted(set(starts)) and max(starts, default=0) <= state["step"]
            and begins_later == ("unverified_tokens" in state) and type(unverified) is int and unverified >= 0):
        return None
    return unverified + sum((end - start) * size * seq_len
                            for (start, size), end in zip(history, starts[1:] + [state["step"]]))


def contents_problem(files: dict, marker: dict) -> str | None:
    """What a verified checkpoint lacks for a resume: its step, settings (None: unknown, completed_state) and
    tokens (as many as its steps took), every rank's data state, and (unless DCP holds them) the model and
    optimizer; None when complete."""
    state = files.get("train_state.pt")
    if not (isinstance(state, dict) and type(state.get("step")) is int and type(state.get("tokens")) is int
            and state["step"] == marker["step"] and "config" in state and isinstance(state["config"], dict | None)):
        return "holds no valid train_state.pt (its step, tokens and settings)"
    expected = trained_tokens(state)
    if expected is None:
        return "holds no valid train_state.pt (the batch sizes of its steps)"
    if state["tokens"] != expected:
        return (f"holds {state['tokens']:,} tokens in train_state.pt, not the {expected:,} of its {state['step']} "
                "steps (batch size x seq_len each)")
    ranks = sorted(name for name in files if name.startswith("rank"))
    if marker.get("world_size") != len(ranks) or set(ranks) != {f"rank{r}.pt" for r in range(len(ranks))}:
        return f"holds the data states of {len(ranks)} rank(s), its marker says {marker.get('world_size')!r}"
    needed = ["model.pt", "optimizer.pt"] if marker.get("format") != "sharded" else []
    missing = [name for name in ranks + needed if not isinstance(files.get(name), dict)]
    if not missing and needed and not all(isinstance(t, torch.Tensor) for t in files["model.pt"].values()):
        missing = ["model.pt's tensors"]
    return f"is missing {missing[0]}" if missing else None


# ----------------------------------------------------------------------------------------------
# the protocol every rank runs together: write, verify, fall back (`dist`: train_c4.Dist's rank, world and
# collectives)

def write_checkpoint(run_dir: Path, step: int, files: dict, dist, keep: int, sharded: dict | None = None,
                     held: int | None = None) -> None:
    """Every rank passes the files it owns and, under FSDP, its shards of the model and optimizer
    (`sharded`, written with torch.distributed.checkpoint into SHARDED/). The folder appears under its
    final name only when complete, sealed by a marker holding the sha256 of every file, DCP's included. Written
    into checkpoints_folder of `held`, the run folder as opened at the start (held_run_folder; None: opened now)."""
    from torch.distributed.checkpoint import CheckpointException
    refuse_non_finite(step, files, sharded, dist)
    with checkpoints_folder(run_dir, held_run_folder(run_dir) if held is None else held) as root:
        final, tmp = root / f"step-{step}", root / f".tmp-step-{step}"
        try:
            if dist.is_main:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir()
            dist.barrier()
            for name, obj in files.items():
                save_file(obj, tmp / name)
            written = list(files) + (_write_shards(sharded, tmp, dist) if sharded is not None else [])
            dist.barrier()
            # each rank hashes its own files and a share of DCP's: tens of GB at 2.5B parameters
            digests = dist.gather({name: sha256(tmp / name) for name in written})
            if dist.is_main:
                if (run_dir / METRICS_FILE).is_file():   # a crash may drop a file's unsynced end, and the lines up
                    fsync_path(run_dir / METRICS_FILE)   # to a checkpoint's step cannot be recomputed from it
                marker = {"step": step, "world_size": dist.world, "format": "sharded" if sharded else "full",
                          "files": dict(sorted(item for part in digests for item in part.items()))}
                seal(tmp, final, marker)
                prune(root, keep)
        except (OSError, CheckpointException) as error:
            shutil.rmtree(tmp, ignore_errors=True)
            kept = step_folders(root)
            intact = (f"the previous checkpoint {kept[-1].name} and metrics.jsonl are intact" if kept else
                      "metrics.jsonl is intact (no earlier checkpoint exists)")
            raise TrainerError(f"could not write checkpoint step-{step} ({first_cause(error)}); {intact}; free disk "
                               "space (or fix the permission) and rerun to resume") from error
    dist.barrier()


def refuse_non_finite(step: int, files: dict, sharded: dict | None, dist) -> None:
    """A checkpoint is never sealed with a NaN or an infinity in what it holds (this rank's files and its shards):
    the loss and gradient were finite, so it is no divergence; every rank raises NonFiniteState together, nothing
    written."""
    shards = {f"{SHARDED}/{name}": state for name, state in (sharded or {}).items()}
    problem = agreed_problem(dist, non_finite_problem(files | shards))
    if problem:
        raise NonFiniteState(f"checkpoint step-{step} not written: the run's state {problem}, though the loss and "
                             "gradient were finite; the earlier checkpoints and metrics.jsonl are intact")


def _write_shards(sharded: dict, tmp: Path, dist) -> list[str]:
    """Collective: DCP writes every rank's shards (and fsyncs them); returns this rank's share of DCP's
    files to hash. DCP's metadata names every file of every rank, so the marker does not depend on a
    directory listing (stale on network file systems)."""
    import torch.distributed.checkpoint as dcp
    metadata = dcp.save(sharded, checkpoint_id=tmp / SHARDED)
    shards = sorted({info.relative_path for info in metadata.storage_data.values()})
    return [f"{SHARDED}/{name}" for name in [".metadata", *shards][dist.rank::dist.world]]


def agreed_problem(dist, problem: str | None) -> str | None:
    """Every rank takes the same decision: the first rank's problem, or None when none has one."""
    return next((p for p in dist.gather(problem) if p), None)


def verified_checkpoints(folders: list[Path], dist, log):
    """In the order given, (folder, its top-level .pt files loaded safely (weights_only), its marker) of each
    checkpoint that verifies; each one that does not is logged. DCP's files (format "sharded") are verified
    here and loaded by the caller, which falls back to the next one when its load fails."""
    for folder in folders:
        marker = read_marker(folder)
        problem = agreed_problem(dist, checkpoint_problem(folder, marker, dist))
        files = {}
        if problem is None:
            files, problem = load_checked(folder, marker)
            problem = agreed_problem(dist, problem)
        if problem is None:
            yield folder, files, marker
        else:
            log(f"checkpoint {folder.name} {problem}; falling back to the previous one")


def newest_first(run_dir: Path, dist) -> list[Path]:
    """The run's checkpoint folders as rank 0 lists them, newest first: every rank takes the same decisions."""
    return [run_dir / CHECKPOINTS / name for name in dist.gather([
        d.name for d in checkpoint_dirs(run_dir)[::-1]])[0]]


def read_checkpoint(run_dir: Path, dist, log) -> tuple[Path, dict, dict] | None:
    """The newest checkpoint that verifies (verified_checkpoints), or None."""
    return next(verified_checkpoints(newest_first(run_dir, dist), dist, log), None)


def resume_from(run_dir: Path, dist, load, log, cfg, changed: bool) -> tuple[Path, dict, dict] | None:
    """(folder, files, the settings changes) of the newest checkpoint that verifies and that `load(folder, files,
    marker)` takes (it returns a problem or None); the newer ones are then set aside, to be written again. The
    training settings of the trainer's Config `cfg` are compared with the checkpoint's own (settings_changes:
    config.json may be gone or rewritten). None without checkpoints in a folder without progress; when every one
    fails, or none is left of a run that made progress, refused and recorded (log.refuse): starting over would
    overwrite a run's history (changed: this command changes the training settings config.json recorded)."""
    problems = []

    def fall_back(line: str) -> None:
        problems.append(line.removeprefix("checkpoint "))
        log.info(line)

    for folder, files, marker in verified_checkpoints(newest_first(run_dir, dist), dist, fall_back):
        state = files["train_state.pt"]
        changes = {} if state["config"] is None else settings_changes(state["config"], cfg, f"checkpoint {folder}")
        problem = agreed_problem(dist, load(folder, files, marker))
        if problem is None:
            if not state["batch_sizes"]:
                log.info(unverified_tokens_warning(folder, state))
            dist.barrier()                                  # every rank has read what it needs of the newer ones
            for newer in checkpoint_dirs(run_dir)[::-1] if dist.is_main else []:
                if newer == folder:
                    break
                log.info(f"checkpoint {newer.name} set aside as {set_aside(newer).name}")
            if dist.is_main:
                prune(run_dir / CHECKPOINTS, cfg.keep_checkpoints)
            return folder, files, changes
        fall_back(f"checkpoint {folder.name} {problem}; falling back to the previous one")
    if problems:
        raise log.refuse(f"no checkpoint of {run_dir} is usable (newest: {problems[0].split(';')[0]}); move that "
                         "folder away or choose another --run-name to start over")
    lost = agreed_problem(dist, log.lost_progress(changed))
    if lost:
        raise log.refuse(lost)
    return None


def unverified_tokens_warning(folder: Path, state: dict) -> str:
    """The line a resume from a checkpoint without a batch size history (completed_state) writes."""
    why = "config.json is gone" if state["config"] is None else "settings_changes.jsonl records changed settings"
    return (f"warning: the token count of checkpoint {folder.name} ({state['tokens']:,}) cannot be verified: it was "
            f"written before checkpoints recorded their batch sizes, and {why}; it is taken as it is")


# ----------------------------------------------------------------------------------------------
# DCP (FSDP's sharded checkpoints) read without unpickling arbitrary objects

# what DCP's Metadata pickle is made of (torch 2.13); torch's dtypes are allowed by type
DCP_METADATA_GLOBALS = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
                        *(("torch.distributed.checkpoint.metadata", name) for name in (
                            "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
                            "BytesStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING"))}


class _DcpMetadataUnpickler(pickle.Unpickler):
    """DCP's FileSystemReader unpickles sharded/.metadata with plain pickle, where a crafted file runs code
    (checkpoints are copied between nodes): only the classes the metadata is made of are resolved."""

    def find_class(self, module: str, name: str):
        if (module, name) in DCP_METADATA_GLOBALS or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                        torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of DCP's metadata")


@functools.cache
def safe_dcp() -> tuple[type, type]:
    """(reader, planner) for dcp.load that never unpickle arbitrary objects: the metadata through the
    restricted unpickler, and the non-tensor entries (the optimizer's param_groups), which DCP's planner loads
    with weights_only=False, checked with weights_only=True first. Built on first use: importing
    torch.distributed.checkpoint takes about a second."""
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with self.fs.create_stream(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                metadata = _DcpMetadataUnpickler(f).load()
            metadata.storage_meta = getattr(metadata, "storage_meta", None) or StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            plain = io.BytesIO()                          # what DCP unpickles is then our own plain data
            torch.save(torch.load(value, weights_only=True), plain)
            plain.seek(0)
            super().load_bytes(read_item, plain)

    return SafeReader, SafePlanner


def dcp_load(state: dict, folder: Path, no_dist: bool = False) -> None:
    """dcp.load of a checkpoint's SHARDED/ into `state`, in place, through safe_dcp's reader and planner; NonFiniteState
    when a shard holds a NaN or an infinity."""
    import torch.distributed.checkpoint as dcp
    reader, planner = safe_dcp()
    try:
        with warnings.catch_warnings():      # "assuming the intent is to load in a single process": with no_dist it is
            warnings.filterwarnings("ignore", "torch.distributed is disabled")
            dcp.load(state, storage_reader=reader(folder / SHARDED), planner=planner(), no_dist=no_dist)
    except dcp.CheckpointException as error:
        raise ConfigError(f"checkpoint {folder} cannot be loaded safely ({first_cause(error)})") from None
    # each rank checks the shards it loaded; the all-reduce makes every rank refuse together
    problem = non_finite_problem(state, across_ranks=not no_dist and torch.distributed.is_initialized(),
                                 where=f"{SHARDED}/")
    if problem:
        raise NonFiniteState(problem)


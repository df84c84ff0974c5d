"""Reading run folders for the report: one streaming pass over each metrics.jsonl keeping what is reported,
status.json and config.json read defensively (a half-written last line, a FIFO, a crafted file: a warning, never a
traceback), each run's arm named from its settings."""
from __future__ import annotations

import bisect
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import NamedTuple

import numpy as np

from hcstudy import arms
from hcstudy.contract import (ARM_DEFAULTS, COEFFICIENT_SUFFIX, CONFIG_FILE, METHODS, METRICS_FILE, RUN_NAME,
                              RUN_NAME_SUFFIX, SEED_STUDY_MODEL, STATUS_FILE, STREAM_KEYS, STREAM_LAYER_KEYS,
                              STUDY_TRAIN_KEY, ConfigError, arm_settings, named_arm, open_regular, read_json,
                              run_lock_free, this_host, upgraded_config, with_arm_preset)

CORE_METHODS = METHODS[:3]         # the verdict says when one of these is missing at a depth
METHOD_LABEL = {name: arm.label for name, arm in arms.ARMS.items()}     # each arm's declaration


PRESET_OF_SUFFIX = {suffix: preset for preset, suffix in RUN_NAME_SUFFIX.items()}
COEFFICIENTS_OF_SUFFIX = {suffix[1:]: kind for kind, suffix in COEFFICIENT_SUFFIX.items()}


GAP_S = 900.0                   # a longer pause between two log lines is downtime, not wall time


SCALAR_KEYS = ("loss", "grad_norm", "clipped", "val_loss",
               "amax_fwd", "amax_bwd", "amax_l0_fwd", "amax_l0_bwd", "amax_fwd_abs", "amax_bwd_abs", "amax_study",
               "amax_fwd_converged", "amax_bwd_converged", "sinkhorn_converged_err", "sinkhorn_col_err",
               "sinkhorn_bwd_bound", STUDY_TRAIN_KEY, *STREAM_KEYS)
LAYER_KEYS = ("layer_gain_fwd", "layer_gain_bwd")


class ReportError(Exception):
    """An expected problem (no runs, unknown run name): one line for the user, exit 2."""


def warn(msg):
    print(f"report: warning: {msg}", file=sys.stderr)


# --- reading: one streaming pass over each metrics.jsonl, keeping only what is reported ---------

class Series:
    """Steps and values of one metric in log order (steps ascending)."""
    __slots__ = ("steps", "values")

    def __init__(self):
        self.steps, self.values = [], []

    def add(self, step, value):
        self.steps.append(step)
        self.values.append(value)

    def rewind(self, step):
        """Forget everything logged at or after `step` (a resumed run logs those steps again)."""
        i = bisect.bisect_left(self.steps, step)
        del self.steps[i:], self.values[i:]

    def arrays(self):
        return np.asarray(self.steps, dtype=np.int64), np.asarray(self.values, dtype=np.float64)

    def __len__(self):
        return len(self.steps)


class WallClock:
    """Active wall time: the sum of spans between consecutive log lines, leaving out restarts
    (the step went backwards) and pauses longer than GAP_S (a job waiting in the queue)."""

    def __init__(self):
        self.total, self.last = 0.0, None

    def tick(self, t):
        if t is None or not math.isfinite(t):
            return
        if self.last is not None and 0.0 < t - self.last <= GAP_S:
            self.total += t - self.last
        self.last = t if self.last is None else max(t, self.last)

    def restart(self):
        self.last = None


@dataclass
class Run:
    """One run folder as read from disk: identity, settings, status and the kept series."""
    name: str
    path: Path
    method: str
    depth: int
    seed: int | None
    config: dict
    status: dict
    series: dict                 # SCALAR_KEYS -> Series of floats (NaN where null/NaN was logged)
    layers: dict                 # LAYER_KEYS + STREAM_LAYER_KEYS -> Series of float32 arrays, one value per sublayer
    preset: str = ""
    sinkhorn_iters: int | None = None      # None: the method has no Sinkhorn projection
    coefficients: str | None = None        # token|sequence; None: the method has no mixing coefficients
    tokens: float = math.nan
    wall_s: float = 0.0
    last_step: int | None = None
    bad_lines: int = 0           # unreadable lines other than a half-written last one
    first_bad_line: int = 0
    state_detail: str = ""       # a state known better than status.json's (stopped_state): the step, checkpoint, why

    @property
    def arm(self):
        return Arm(self.method, self.coefficients, self.sinkhorn_iters, self.preset)


class Arm(NamedTuple):
    """What sets a row, a plotted line and its colour apart: runs of two arms are never averaged together."""
    method: str
    coefficients: str | None
    sinkhorn_iters: int | None
    preset: str

    def sort_key(self):
        return self.preset, method_key(self.method), self.coefficients == "sequence", self.sinkhorn_iters or 0

    def label(self, with_preset=False):
        """'HC', 'mHC (100 it)', 'HC (per-sequence) [seed-study]': the method and what sets the arm apart."""
        default_iters = self.sinkhorn_iters in (None, ARM_DEFAULTS["sinkhorn_iters"])
        tags = [] if default_iters else [f"{self.sinkhorn_iters} it"]
        own = arm_settings(self.method)[1]          # the arm's own coefficients (the study's arms: per sequence)
        tags += [f"per-{self.coefficients}"] if self.coefficients not in (None, own) else []
        name = METHOD_LABEL.get(self.method, self.method) + (f" ({', '.join(tags)})" if tags else "")
        return f"{name} [{self.preset}]" if with_preset and self.preset else name


def settings(config):
    """The resolved settings inside config.json, as this version names them ({} when missing, malformed or a model
    this version cannot build: contract.upgraded_config)."""
    cfg = (config or {}).get("config")
    try:
        return upgraded_config(cfg) if isinstance(cfg, dict) else {}
    except ConfigError as error:
        warn(f"config.json: {error}")
        return {}


def _num(v):
    """A metrics value as float: null, strings and other junk become NaN; bools become 0/1."""
    if isinstance(v, (int, float)):
        return float(v)
    return math.nan


def _timestamp(v):
    """status.json's `updated`: unix seconds or an ISO-8601 string."""
    if isinstance(v, str):
        try:
            return datetime.fromisoformat(v).timestamp()
        except ValueError:
            return None
    return _num(v)


class LineProblems:
    """Malformed lines of one metrics file: each kind is warned about once, with its first line and its count."""

    def __init__(self, path):
        self.path, self.kinds = path, {}

    def add(self, kind, lineno):
        first, count = self.kinds.get(kind, (lineno, 0))
        self.kinds[kind] = (first, count + 1)

    def warn_all(self):
        for kind, (first, count) in self.kinds.items():
            warn(f"{self.path}:{first}: {kind}" + (f" ({count} lines like it)" if count > 1 else ""))


def whole_number(value):
    """A step as the trainer writes it: a whole number (1e400 parses as inf, 2.5 is no step): else ValueError."""
    if type(value) is int or (type(value) is float and value.is_integer()):
        return int(value)
    raise ValueError(f"not a whole number: {value!r}")


def read_metrics(path, run):
    """Parse metrics.jsonl once, line by line, into run.series / run.layers / run.tokens."""
    clock, problems = WallClock(), LineProblems(path)
    last_step, bad, cut, lineno = -1, 0, False, 0
    with open_regular(path) as f:
        for lineno, line in enumerate(f, 1):
            try:
                rec = json.loads(line)
                step = whole_number(rec["step"])
            except (ValueError, KeyError, TypeError, IndexError, RecursionError):
                if line.strip():        # only a last line without its newline was cut by a kill mid-write
                    bad, cut = bad + 1, not line.endswith(b"\n")
                    run.first_bad_line = run.first_bad_line or lineno
                continue
            if not 0 <= step < 2 ** 63:     # the trainer's steps are int64
                problems.add(f"{'negative step' if step < 0 else 'step beyond 2**63 - 1'}, line skipped", lineno)
                continue
            if step < last_step:            # resumed from an earlier checkpoint: newer log wins
                for s in run.series.values():
                    s.rewind(step)
                for s in run.layers.values():
                    s.rewind(step)
                clock.restart()
            last_step = step
            clock.tick(_num(rec.get("time")))
            _keep(rec, step, run, problems, lineno)
    run.bad_lines = bad - cut
    run.last_step = last_step if last_step >= 0 else None
    if lineno == 0:
        warn(f"{path}: empty, no step logged yet")
    for key, series in run.series.items():
        if key != "clipped" and len(series) and not np.isfinite(series.arrays()[1]).any():
            warn(f"{path}: every {key} value ({len(series)}) is NaN, infinite or missing")
    problems.warn_all()
    return clock


def _keep(rec, step, run, problems, lineno):
    """Copy the reported keys of one metrics line (any mix of training/eval/probe keys)."""
    for key in SCALAR_KEYS:
        if key in rec:
            value, series = rec[key], run.series[key]
            if not (value is None or isinstance(value, (int, float))):
                problems.add(f"{key} is not a number ({str(value)[:20]!r}), read as missing", lineno)
            if len(series) and series.steps[-1] == step:     # the same key twice for one step: the later wins
                problems.add(f"step {step} logs {key} a second time; the later value is kept", lineno)
                series.rewind(step)
            series.add(step, _num(value))
    for key in run.layers:
        v = rec.get(key)
        if isinstance(v, list) and v:
            try:
                values = np.asarray(v, dtype=np.float32)
            except (TypeError, ValueError):
                continue
            if values.ndim == 1:        # a list of lists is no per-sublayer list (the heatmap failed on one)
                run.layers[key].add(step, values)
    if "tokens" in rec:
        run.tokens = _num(rec["tokens"])


def identify(folder, config):
    """(method, depth, seed) from config.json, else from a run name like hc_d48_s123."""
    cfg = settings(config)
    m = RUN_NAME.match(folder.name)
    method = cfg.get("residual") or (m and m["method"])
    depth = cfg.get("depth") if cfg.get("depth") is not None else (m and m["depth"])
    seed = cfg.get("seed") if cfg.get("seed") is not None else (m and m["seed"])
    if not method:
        return None
    try:
        return str(method).lower(), int(depth), (None if seed is None else int(seed))
    except (TypeError, ValueError, OverflowError):      # OverflowError: a depth of 1e400 (infinity)
        return None


def arm_of(folder, config, method):
    """(preset, Sinkhorn iterations, coefficients) from config.json, else from the run name (hc_d32_s42_seq)."""
    cfg = settings(config)
    m = RUN_NAME.match(folder.name)
    named = m.groupdict() if m else {}
    preset = cfg.get("preset") if isinstance(cfg.get("preset"), str) else PRESET_OF_SUFFIX.get(named.get("suffix"), "")
    if all(key in cfg for key in SEED_STUDY_MODEL):      # the study's body where its settings are, however asked
        preset = named_arm(method, preset, cfg) or ",".join(name for name in preset.split(",") if name != "seed-study") or "c4"
    preset = with_arm_preset(method, preset)             # the study's arms: their own preset, however recorded
    iters = cfg.get("sinkhorn_iters") if isinstance(cfg.get("sinkhorn_iters"), int) else named.get("sinkhorn_iters")
    coefficients = cfg.get("coefficients") if isinstance(cfg.get("coefficients"), str) \
        else COEFFICIENTS_OF_SUFFIX.get(named.get("coefficients"))
    return (preset, *arm_settings(method, preset, int(iters) if iters else None, coefficients))


RUN_STATES = ("running", "completed", "diverged", "failed", "interrupted")


def read_status(path):
    """status.json, its state dropped (with a warning) when it is none the trainer writes."""
    status = read_json(path, {}, warn)
    if "state" in status and status["state"] not in RUN_STATES:
        warn(f"{path}: state {str(status['state'])[:40]!r} is none of {', '.join(RUN_STATES)}; read as unknown")
        del status["state"]
    return status


STALE_AFTER_MIN = 15.0      # report.py --stale-after: a status.json older than this, of a run elsewhere, reads stale


def stopped_state(folder, status, now, stale_after_min=STALE_AFTER_MIN):
    """(state, what is known) of a run whose status.json says `running` but that is not running after all, killed
    without recording its end (kill -9, a node lost); None while it reads as running. On its own host (status.json's
    `host`) the run's lock tells at once: held by no process, "stopped (killed?)"; elsewhere only status.json's age
    can: unchanged for more than stale_after_min, "stale (killed?)". A run whose lock is held stays running, however
    long its status.json has been still (the watch view flags it)."""
    if status.get("state") != "running":
        return None
    here = status.get("host") == this_host()
    free = run_lock_free(folder) if here else None
    updated = _timestamp(status.get("updated"))
    age_min = (now - updated) / 60 if updated is not None and math.isfinite(updated) else 0.0
    if free:
        state, why = "stopped (killed?)", "no process holds its lock on this host"
    elif free is None and age_min > stale_after_min:
        where = f" (written on {status['host']})" if isinstance(status.get("host"), str) and not here else ""
        state, why = "stale (killed?)", f"status.json unchanged for {age_min:.0f} min{where}"
    else:
        return None
    checkpoint = status.get("last_checkpoint_step")
    resumes = f"last checkpoint step-{checkpoint}" if type(checkpoint) is int else "no checkpoint yet"
    return state, f"{state} at step {status.get('step', '?')}, {resumes}: {why}"


def load_run(folder, now=None, stale_after_min=STALE_AFTER_MIN):
    """Read one run folder; None (with a warning) when its method or depth cannot be told. A `running` state that is
    known to be stale or dead (stopped_state) is replaced by what is known."""
    config = read_json(folder / CONFIG_FILE, None, warn)
    ident = identify(folder, config)
    if ident is None:
        warn(f"{folder}: no residual/depth in config.json and the name is not like hc_d48_s123; skipped")
        return None
    if ident[0] not in METHODS:
        warn(f"{folder}: residual {ident[0][:40]!r} is none of {', '.join(METHODS)}; skipped")
        return None
    run = Run(folder.name, folder, *ident, config=config or {}, status=read_status(folder / STATUS_FILE),
              series={k: Series() for k in SCALAR_KEYS},
              layers={k: Series() for k in LAYER_KEYS + STREAM_LAYER_KEYS})
    run.preset, run.sinkhorn_iters, run.coefficients = arm_of(folder, config, run.method)
    judged = stopped_state(folder, run.status, time.time() if now is None else now, stale_after_min)
    if judged:
        run.status["state"], run.state_detail = judged
    clock = WallClock()
    try:
        clock = read_metrics(folder / METRICS_FILE, run)
    except FileNotFoundError:
        pass                                     # not started logging yet
    except OSError as e:
        warn(f"cannot read {folder / 'metrics.jsonl'}: {e}")
    clock.tick(_timestamp(run.status.get("updated")))
    run.wall_s = clock.total
    if run.bad_lines:
        warn(f"{folder / 'metrics.jsonl'}:{run.first_bad_line}: skipped {run.bad_lines} unreadable metrics line(s), "
             "the first here")
    return run


def find_run_dirs(root):
    """Run folders under root (root included), sorted; a run folder's own subfolders are not searched."""
    found = []
    for here, dirs, files in os.walk(root):
        if "config.json" in files or {"metrics.jsonl", "status.json"} <= set(files):
            found.append(Path(here))
            dirs[:] = []
        else:
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
    return sorted(found)


def load_runs(*roots, stale_after_min=STALE_AFTER_MIN):
    """The runs under every root, each folder read once (roots may overlap); two copies of one run are refused."""
    folders = {}
    for root in roots:
        found = find_run_dirs(Path(root))
        if not found and len(roots) > 1:
            warn(f"no runs found under {root}")
        for folder in found:
            folders.setdefault(folder.resolve(), folder)
    now = time.time()
    runs = [r for r in (load_run(folder, now, stale_after_min) for folder in folders.values()) if r is not None]
    refuse_copies(runs)
    return runs


def refuse_copies(runs):
    """Two folders of one run (its name, or its arm, depth and seed) would count it twice: copies from two nodes,
    or runs that differ in a setting the table does not separate. Raises ReportError naming both."""
    seen = {}
    for run in runs:
        keys = [run.name] + ([] if run.seed is None else [(run.arm, run.depth, run.seed)])
        for key in keys:
            other = seen.setdefault(key, run)
            if other is not run:
                raise ReportError(f"one run found twice: {_where(other)} and {_where(run)}; keep one of them "
                                  "(copies from two nodes?) or report them separately")


def _where(run):
    return f"{run.path} ({run.status.get('state', 'unknown')} at step {run.status.get('step', '?')})"


def method_key(method):
    return (METHODS.index(method), "") if method in METHODS else (len(METHODS), method)

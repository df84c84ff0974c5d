#!/usr/bin/env python3
"""Results table, verdict and plots for a matrix of train_c4.py runs.

    python report.py [RUNS_DIR ...] [--report-dir RUNS_DIR/report] [--heatmap-run NAME] [--no-plots]

Reads every run folder under each RUNS_DIR (a folder with config.json, or with metrics.jsonl and
status.json), tolerating the half-written last line of a running job, and merges them: several runs
folders (e.g. one per node, or a parent holding them) give one report, and two copies of one run are
refused. Writes to --report-dir:
results.md (table, published figures, verdict, per-run table, plots), results.csv (one row per arm x depth),
runs.csv (one row per run) and four PNG plots. The table and the verdict are printed too.
Exit 0 on success, 2 when no runs are found, a run is found twice or the arguments are wrong.

Sections, in order: config/CLI -> reading -> aggregation -> table -> verdict -> plots -> main.
Importing this module has no side effects (matplotlib is imported only when plotting).
"""
from __future__ import annotations

import argparse
import bisect
import csv
import errno
import io
import json
import math
import os
import stat
import sys
import time
import warnings
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import NamedTuple

import numpy as np

from contract import (ARM_DEFAULTS, COEFFICIENT_SUFFIX, METHODS, RUN_NAME, RUN_NAME_SUFFIX, SEED_STUDY_MODEL,
                      STUDY_TRAIN_KEY, arm_settings, named_arm)

# --- config / CLI: constants every later section reads ------------------------------------------

METHOD_ORDER = ("baseline", "hc", "mhc", "mhc-lite", "identity-hc")
CORE_METHODS = METHOD_ORDER[:3]         # the verdict says when one of these is missing at a depth
METHOD_LABEL = {"baseline": "baseline", "hc": "HC", "mhc": "mHC", "mhc-lite": "mHC-lite", "identity-hc": "identity-HC"}
# One line width for all, and a marker shape each at staggered points: baseline and mHC coincide at a gain of 1
# and their losses lie within 1 %, so neither colour nor width alone keeps both lines visible.
METHOD_STYLE = {"baseline": {"color": "0.15", "ls": (0, (4, 3)), "marker": "o", "zorder": 4},
                "hc": {"color": "tab:red", "ls": "-", "marker": "^", "zorder": 3},
                "mhc": {"color": "tab:blue", "ls": "-", "marker": "s", "zorder": 2},
                "mhc-lite": {"color": "tab:green", "ls": "-", "marker": "D", "zorder": 2},
                "identity-hc": {"color": "tab:purple", "ls": (0, (1, 2)), "marker": "v", "zorder": 4}}
LINE_WIDTH, MARKS = 1.5, 8      # markers per line
# a method's further arms (other coefficients, iterations or preset) take these colours in turn, dashed when
# their coefficients are per sequence
ARM_COLORS = ("tab:orange", "tab:cyan", "tab:brown", "tab:pink", "tab:olive", "tab:gray", "gold", "navy", "lime")
PRESET_OF_SUFFIX = {suffix: preset for preset, suffix in RUN_NAME_SUFFIX.items()}
COEFFICIENTS_OF_SUFFIX = {suffix[1:]: kind for kind, suffix in COEFFICIENT_SUFFIX.items()}
THRESHOLDS = (10.0, 100.0, 1000.0)      # composite gain levels whose first crossing step is reported
FLAT = 0.05                     # the verdict calls gains within 1 ± FLAT "stayed within", else peaks
GAP_S = 900.0                   # a longer pause between two log lines is downtime, not wall time
PLOT_POINTS = 400               # gain curves with more logged steps are averaged over windows down to this many
LOSS_POINTS = 60                # step-to-step noise of the loss hides a 1 % gap: averaged down to this many points
GRAD_POINTS = 60                # the gradient norm too, whose spikes would otherwise crowd the methods apart
SCALAR_KEYS = ("loss", "grad_norm", "clipped", "val_loss",
               "amax_fwd", "amax_bwd", "amax_l0_fwd", "amax_l0_bwd", "amax_fwd_abs", "amax_bwd_abs", "amax_study",
               "amax_fwd_converged", "amax_bwd_converged", "sinkhorn_converged_err", "sinkhorn_col_err",
               "sinkhorn_bwd_bound", STUDY_TRAIN_KEY)
LAYER_KEYS = ("layer_gain_fwd", "layer_gain_bwd")
# The published figures beside ours (results.md's reference block and the verdict), in one place: where from,
# the method, the depth of the model (None: not ours to match), the figure, and which of our readings and arms
# compares: the papers measure per token (our amax_fwd/amax_bwd, token coefficients), the study with its own
# recipe on its own training batch at every step (our amax_study_train) on its model (--preset seed-study).
PAPERS_27B = "mHC paper (arXiv 2512.24880), 27B"
STUDY = "public 1.7B study"
PUBLISHED = (
    (PAPERS_27B, "hc", None, "up to about 3000", ("peak_fwd", "peak_bwd"), "token"),
    (PAPERS_27B, "mhc", None, "at most about 1.6", ("peak_fwd", "peak_bwd"), "token"),
    (f"{STUDY}, 3 seeds", "hc", 32, "10,924 ± 3,247", ("peak_study_train",), "sequence"),
    (STUDY, "hc", 48, "3,721", ("peak_study_train",), "sequence"),
    (f"{STUDY}, stress arm (3x lr)", "hc", 64, "14,765", ("peak_study_train",), "sequence"),
    (STUDY, "mhc", 32, "1.00", ("peak_study_train",), "sequence"),
)
READING = {("peak_fwd", "peak_bwd"): "amax_fwd / amax_bwd", ("peak_study_train",): STUDY_TRAIN_KEY}


class ReportError(Exception):
    """An expected problem (no runs, unknown run name): one line for the user, exit 2."""


def parse_args(argv):
    p = argparse.ArgumentParser(
        description="Summarize folders of train_c4.py runs: results table, verdict and plots.")
    p.add_argument("runs_dirs", nargs="*", default=[Path("runs")], type=Path, metavar="RUNS_DIR",
                   help="folders holding the run folders, searched recursively and merged into one report, e.g. "
                        "the runs folders of several nodes or one folder holding their copies; a run found "
                        "twice is refused (default: runs)")
    # not --out, which names the runs folder for train_c4.py and run_experiments.sh (--out still works here)
    p.add_argument("--report-dir", "--out", dest="out", type=Path, default=None, metavar="DIR",
                   help="where results.md, the CSV files and the plots go (default: RUNS_DIR/report; with "
                        "several folders, report/ in the folder that holds them all)")
    p.add_argument("--heatmap-run", default=None, metavar="NAME",
                   help="run folder name for the single-layer gain heatmap "
                        "(default: the HC run with the largest peak amax_fwd)")
    p.add_argument("--no-plots", action="store_true",
                   help="write the table and verdict only (a quick look while jobs run)")
    p.add_argument("--watch", action="store_true",
                   help="print the matrix view from the live files of one RUNS_DIR (matrix.log, each run's "
                        "status.json) and write nothing: per GPU the run, step, loss, amax, tokens/s and ETA; "
                        "done/running/queued/failed, the wall ETA and the dollars spent and to spend")
    p.add_argument("--stale-after", type=float, default=15.0, metavar="MIN",
                   help="with --watch: flag a running job whose status.json has not moved for MIN minutes")
    return p.parse_args(argv)


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
    layers: dict                 # LAYER_KEYS -> Series of float32 arrays, one value per sublayer
    preset: str = ""
    sinkhorn_iters: int | None = None      # None: the method has no Sinkhorn projection
    coefficients: str | None = None        # token|sequence; None: the method has no mixing coefficients
    tokens: float = math.nan
    wall_s: float = 0.0
    last_step: int | None = None
    bad_lines: int = 0           # unreadable lines other than a half-written last one
    first_bad_line: int = 0

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
        tags += ["per-sequence"] if self.coefficients == "sequence" else []
        name = METHOD_LABEL.get(self.method, self.method) + (f" ({', '.join(tags)})" if tags else "")
        return f"{name} [{self.preset}]" if with_preset and self.preset else name


def settings(config):
    """The resolved settings inside config.json ({} when missing or malformed)."""
    cfg = (config or {}).get("config")
    return cfg if isinstance(cfg, dict) else {}


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


def open_regular(path):
    """`path` opened for reading when it is a regular file: a FIFO would block (O_NONBLOCK: not even the open
    waits), a device may never end."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file")
    return os.fdopen(fd, "rb")


def read_json(path):
    """A JSON object from a small file, or None (missing, half-written, not an object)."""
    try:
        with open_regular(path) as f:
            obj = json.loads(f.read())
    except FileNotFoundError:
        return None
    except (OSError, ValueError, RecursionError) as e:     # RecursionError: nested too deeply to parse
        warn(f"cannot read {path}: {type(e).__name__ if isinstance(e, RecursionError) else e}")
        return None
    return obj if isinstance(obj, dict) else None


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
    for key in LAYER_KEYS:
        v = rec.get(key)
        if isinstance(v, list) and v:
            try:
                run.layers[key].add(step, np.asarray(v, dtype=np.float32))
            except (TypeError, ValueError):
                pass
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
    if all(key in cfg for key in SEED_STUDY_MODEL):      # the study's arm where its settings are, however asked
        preset = named_arm(preset, cfg) or ",".join(name for name in preset.split(",") if name != "seed-study") or "c4"
    iters = cfg.get("sinkhorn_iters") if isinstance(cfg.get("sinkhorn_iters"), int) else named.get("sinkhorn_iters")
    coefficients = cfg.get("coefficients") if isinstance(cfg.get("coefficients"), str) \
        else COEFFICIENTS_OF_SUFFIX.get(named.get("coefficients"))
    return (preset, *arm_settings(method, preset, int(iters) if iters else None, coefficients))


RUN_STATES = ("running", "completed", "diverged", "failed", "interrupted")


def read_status(path):
    """status.json, its state dropped (with a warning) when it is none the trainer writes."""
    status = read_json(path) or {}
    if "state" in status and status["state"] not in RUN_STATES:
        warn(f"{path}: state {str(status['state'])[:40]!r} is none of {', '.join(RUN_STATES)}; read as unknown")
        del status["state"]
    return status


def load_run(folder):
    """Read one run folder; None (with a warning) when its method or depth cannot be told."""
    config = read_json(folder / "config.json")
    ident = identify(folder, config)
    if ident is None:
        warn(f"{folder}: no residual/depth in config.json and the name is not like hc_d48_s123; skipped")
        return None
    if ident[0] not in METHODS:
        warn(f"{folder}: residual {ident[0][:40]!r} is none of {', '.join(METHODS)}; skipped")
        return None
    run = Run(folder.name, folder, *ident, config=config or {}, status=read_status(folder / "status.json"),
              series={k: Series() for k in SCALAR_KEYS}, layers={k: Series() for k in LAYER_KEYS})
    run.preset, run.sinkhorn_iters, run.coefficients = arm_of(folder, config, run.method)
    clock = WallClock()
    try:
        clock = read_metrics(folder / "metrics.jsonl", run)
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


def load_runs(*roots):
    """The runs under every root, each folder read once (roots may overlap); two copies of one run are refused."""
    folders = {}
    for root in roots:
        found = find_run_dirs(Path(root))
        if not found and len(roots) > 1:
            warn(f"no runs found under {root}")
        for folder in found:
            folders.setdefault(folder.resolve(), folder)
    runs = [r for r in map(load_run, folders.values()) if r is not None]
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


# --- aggregation: one summary per run, then one row per method x depth ---------------------------

@dataclass
class RunSummary:
    """The per-run numbers of the table. NaN = not logged; first_above[t] None = never reached."""
    name: str
    method: str
    depth: int
    seed: int | None
    state: str
    step: int | None
    final_loss: float
    best_val: float
    final_val: float
    peak_fwd: float
    peak_bwd: float
    peak_l0_fwd: float
    peak_l0_bwd: float
    peak_abs: float              # the |.| upper bound: max of amax_fwd_abs and amax_bwd_abs
    peak_study: float            # the public study's recipe (amax_study)
    peak_study_train: float      # the same recipe at full depth on every training batch: the study's own scope
    peak_converged: float        # mHC: max of the converged forward and backward composite gains
    converged_err: float         # mHC: how far from doubly stochastic the "converged" projection still was
    peak_col_err: float          # mHC: largest Sinkhorn column error of the H_res used
    peak_bwd_bound: float        # mHC: largest truncation bound prod(1 + column error) of the as-used amax_bwd
    arm: str                     # the preset it ran under: the matrix's main arm, a stress arm, the demo
    sinkhorn_iters: int | None   # with the method and the preset: the arm (Arm) the run belongs to
    coefficients: str | None
    data_seed: int | None
    precision: str               # config.json's precision policy, "unrecorded" for older runs
    max_dev: float               # largest |amax - 1| over both composites and all probe steps
    first_above: dict            # threshold -> first probe step with max(amax_fwd, amax_bwd) > it
    peak_grad_norm: float
    clip_share: float            # clipped steps / training steps with a `clipped` value
    tokens: float
    wall_s: float
    n_gpus: int
    gpu_hours: float
    has_probe: bool
    has_layers: bool


def _peak(values):
    """Largest non-NaN value (inf counts: a diverged probe is a finding), NaN when none."""
    v = values[~np.isnan(values)]
    return float(v.max()) if v.size else math.nan


def _last(values):
    return float(values[-1]) if values.size else math.nan


def first_above(steps, values, threshold):
    """First step whose value exceeds threshold (strictly; NaN never does), None if never."""
    hit = np.flatnonzero(values > threshold)
    return int(steps[hit[0]]) if hit.size else None


def first_above_either(fwd, bwd, threshold):
    """First step where amax_fwd or amax_bwd exceeded threshold, None if neither did."""
    hits = [h for h in (first_above(*fwd, threshold), first_above(*bwd, threshold)) if h is not None]
    return min(hits, default=None)


def gpu_count(config):
    """GPUs a run held: config world_size, or 0 for a CPU run (device 'cpu', in config.json's top
    level as train_c4.py writes it, or among the settings)."""
    cfg = settings(config)
    if str(config.get("device") or cfg.get("device") or "").lower().startswith("cpu"):
        return 0
    ws = config.get("world_size", cfg.get("world_size", 1))
    return int(ws) if isinstance(ws, (int, float)) and 0 < ws < math.inf else 1


def summarize(run):
    s = {k: run.series[k].arrays() for k in SCALAR_KEYS}
    fwd, bwd = s["amax_fwd"][1], s["amax_bwd"][1]
    dev = np.abs(np.concatenate([fwd, bwd]) - 1.0)
    clipped = s["clipped"][1]
    clipped = clipped[~np.isnan(clipped)]
    val = s["val_loss"][1]
    n_gpus = gpu_count(run.config)
    status_step = run.status.get("step")
    step = max([x for x in (run.last_step, status_step) if isinstance(x, (int, float)) and math.isfinite(x)],
               default=None)
    return RunSummary(
        name=run.name, method=run.method, depth=run.depth, seed=run.seed,
        state=str(run.status.get("state", "unknown")), step=None if step is None else int(step),
        final_loss=_last(s["loss"][1]),
        best_val=float(np.nanmin(val)) if np.isfinite(val).any() else math.nan,
        final_val=_last(val),
        peak_fwd=_peak(fwd), peak_bwd=_peak(bwd),
        peak_l0_fwd=_peak(s["amax_l0_fwd"][1]), peak_l0_bwd=_peak(s["amax_l0_bwd"][1]),
        peak_abs=_peak(np.concatenate([s["amax_fwd_abs"][1], s["amax_bwd_abs"][1]])),
        peak_study=_peak(s["amax_study"][1]), peak_study_train=_peak(s[STUDY_TRAIN_KEY][1]),
        peak_converged=_peak(np.concatenate([s["amax_fwd_converged"][1], s["amax_bwd_converged"][1]])),
        converged_err=_peak(s["sinkhorn_converged_err"][1]), peak_col_err=_peak(s["sinkhorn_col_err"][1]),
        peak_bwd_bound=_peak(s["sinkhorn_bwd_bound"][1]),
        arm=run.preset, sinkhorn_iters=run.sinkhorn_iters, coefficients=run.coefficients,
        data_seed=settings(run.config).get("data_seed"),
        precision=json.dumps(run.config.get("precision"), sort_keys=True) if run.config.get("precision")
        else "unrecorded",
        max_dev=_peak(dev),
        first_above={t: first_above_either(s["amax_fwd"], s["amax_bwd"], t) for t in THRESHOLDS},
        peak_grad_norm=_peak(s["grad_norm"][1]),
        clip_share=float(clipped.mean()) if clipped.size else math.nan,
        tokens=run.tokens, wall_s=run.wall_s, n_gpus=n_gpus, gpu_hours=run.wall_s / 3600 * n_gpus,
        has_probe=fwd.size > 0, has_layers=len(run.layers["layer_gain_fwd"]) > 0)


@dataclass(frozen=True)
class Stat:
    """Mean and sample standard deviation (ddof=1) over seeds; std is NaN with one seed."""
    mean: float
    std: float
    n: int

    @classmethod
    def of(cls, values, finite_only=False):
        v = np.asarray(values, dtype=np.float64)
        v = v[np.isfinite(v)] if finite_only else v[~np.isnan(v)]
        if v.size == 0:
            return cls(math.nan, math.nan, 0)
        with np.errstate(invalid="ignore"):
            std = float(np.std(v, ddof=1)) if v.size > 1 else math.nan
        return cls(float(np.mean(v)), std, int(v.size))


FINAL_FIELDS = ("final_loss", "final_val")    # a diverged run has no final loss: left out of the mean
STAT_FIELDS = {  # RunSummary field -> finite_only (losses drop a diverged run's NaN/inf)
    "final_loss": True, "best_val": True, "final_val": True, "peak_fwd": False, "peak_bwd": False,
    "peak_l0_fwd": False, "peak_l0_bwd": False, "peak_abs": False, "peak_study": False, "peak_converged": False,
    "peak_study_train": False, "peak_col_err": False, "peak_bwd_bound": False, "peak_grad_norm": False,
    "clip_share": True, "tokens": True}


@dataclass
class Row:
    """One arm x method x depth: its runs (sorted by seed) and the statistics over them."""
    method: str
    depth: int
    runs: list
    stats: dict = field(default_factory=dict)     # STAT_FIELDS name -> Stat, plus "wall_h"
    arm: str = ""                                 # the preset
    label_arm: bool = False                       # more than one preset in the table: the label names it
    sinkhorn_iters: int | None = None
    coefficients: str | None = None

    @property
    def label(self):
        return Arm(self.method, self.coefficients, self.sinkhorn_iters, self.arm).label(self.label_arm)

    @property
    def done(self):
        return sum(r.state == "completed" for r in self.runs)

    @property
    def diverged(self):
        return [r for r in self.runs if r.state == "diverged"]

    @property
    def gpu_hours(self):
        return sum(r.gpu_hours for r in self.runs)

    @property
    def cpu_only(self):
        return all(r.n_gpus == 0 for r in self.runs)


def method_key(method):
    return (METHOD_ORDER.index(method), "") if method in METHOD_ORDER else (len(METHOD_ORDER), method)


def summary_arm(s):
    return Arm(s.method, s.coefficients, s.sinkhorn_iters, s.arm)


def aggregate(summaries):
    """Rows sorted by preset, depth, then arm (baseline, HC, mHC, others; token before sequence coefficients,
    fewer Sinkhorn iterations first): arms (a preset such as the stress arm, other coefficients or iterations)
    are never averaged together."""
    groups = {}
    for s in summaries:
        groups.setdefault((summary_arm(s), s.depth), []).append(s)
    several_presets = len({arm.preset for arm, _ in groups}) > 1
    rows = []
    for arm, depth in sorted(groups, key=lambda k: (k[0].preset, k[1], k[0].sort_key())):
        runs = sorted(groups[arm, depth], key=lambda r: (r.seed is None, r.seed or 0, r.name))
        stats = {f: Stat.of([math.nan if f in FINAL_FIELDS and r.state == "diverged" else getattr(r, f)
                             for r in runs], fin) for f, fin in STAT_FIELDS.items()}
        stats["wall_h"] = Stat.of([r.wall_s / 3600 for r in runs])
        rows.append(Row(arm.method, depth, runs, stats, arm.preset, several_presets, arm.sinkhorn_iters,
                        arm.coefficients))
    return rows


def collect(*runs_dirs):
    """The aggregated rows of one or more runs folders (for tests and notebooks)."""
    return aggregate([summarize(r) for r in load_runs(*runs_dirs)])


# --- table: markdown for results.md and the terminal, CSV for machines ---------------------------

def fmt_gain(x, ref=None):
    """Gains and gradient norms: 3,721 / 412 / 12.3 / 1.000; decimals follow `ref` when given
    (a std is printed to the decimals of its mean: 1,489 ± 57)."""
    if x is None or math.isnan(x):
        return "–"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    a = abs(x if ref is None or not math.isfinite(ref) else ref)
    return f"{x:,.0f}" if a >= 100 else f"{x:.1f}" if a >= 10 else f"{x:.3f}"


def fmt_loss(x, ref=None):
    return "–" if math.isnan(x) else "inf" if math.isinf(x) else f"{x:.3f}"


def fmt_pct(x, ref=None):
    return "–" if math.isnan(x) else f"{100 * x:.1f}%"


def fmt_tokens(x, ref=None):
    if math.isnan(x):
        return "–"
    for unit, scale in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.2f}{unit}"
    return f"{x:.0f}"


def fmt_hours(x, ref=None):
    return "–" if math.isnan(x) else f"{x:.2f}"


def fmt_step(step):
    return "never" if step is None else f"{step:,}"


def fmt_stat(stat, fmt, total, with_std=True):
    """'mean ± std', 'value (1 seed)' for one seed (no std to give), '(n=k)' when fewer than all seeds
    had a value; just 'inf' when a seed's value was infinite (the per-run table says which)."""
    if stat.n == 0:
        return "–"
    if stat.n == 1:
        return f"{fmt(stat.mean)} (1 seed)"
    with_std = with_std and not math.isinf(stat.mean)
    text = f"{fmt(stat.mean)} ± {fmt(stat.std, stat.mean)}" if with_std else fmt(stat.mean)
    return text if stat.n == total else f"{text} (n={stat.n})"


def per_seed(row, fn):
    return " / ".join(fn(r) for r in row.runs)


def crossing(threshold):
    return lambda r: fmt_step(r.first_above[threshold]) if r.has_probe else "–"


def fmt_diverged(row):
    d = row.diverged
    return "0" if not d else f"{len(d)}: " + ", ".join(f"s{r.seed}@{fmt_step(r.step)}" for r in d)


def main_columns():
    """(header, cell(row) -> str) for the table read first: at most 8 columns, the question's numbers."""
    def st(name, fmt):
        return lambda row: fmt_stat(row.stats[name], fmt, len(row.runs))
    return [
        ("method", lambda row: row.label), ("depth", lambda row: str(row.depth)),
        ("seeds done/total", lambda row: f"{row.done}/{len(row.runs)}"),
        ("final val loss", st("final_val", fmt_loss)),
        ("peak amax_fwd", st("peak_fwd", fmt_gain)), ("peak amax_bwd", st("peak_bwd", fmt_gain)),
        (f"first >{THRESHOLDS[0]:g}× step (per seed)", lambda row: per_seed(row, crossing(THRESHOLDS[0]))),
        ("diverged", fmt_diverged),
    ]


def table_columns():
    """(header, cell(row) -> str) for the wide table with every statistic, in display order."""
    def st(name, fmt, with_std=True):
        return lambda row: fmt_stat(row.stats[name], fmt, len(row.runs), with_std)
    return [
        ("method", lambda row: row.label),
        ("depth", lambda row: str(row.depth)),
        ("seeds done/total", lambda row: f"{row.done}/{len(row.runs)}"),
        ("final train loss", st("final_loss", fmt_loss)),
        ("best val loss", st("best_val", fmt_loss)),
        ("final val loss", st("final_val", fmt_loss)),
        ("peak amax_fwd", st("peak_fwd", fmt_gain)),
        ("peak amax_bwd", st("peak_bwd", fmt_gain)),
        ("amax_fwd per seed", lambda row: per_seed(row, lambda r: fmt_gain(r.peak_fwd))),
        ("amax_bwd per seed", lambda row: per_seed(row, lambda r: fmt_gain(r.peak_bwd))),
        *[(f"first >{t:g}× step (per seed)", lambda row, t=t: per_seed(row, crossing(t)))
          for t in THRESHOLDS],
        ("peak amax_l0_fwd", st("peak_l0_fwd", fmt_gain)),
        ("peak amax_l0_bwd", st("peak_l0_bwd", fmt_gain)),
        ("peak grad norm (pre-clip)", st("peak_grad_norm", fmt_gain)),
        ("clipped steps", st("clip_share", fmt_pct)),
        ("diverged", fmt_diverged),
        ("tokens/run", st("tokens", fmt_tokens, with_std=False)),
        ("wall h/run", st("wall_h", fmt_hours)),
        ("GPU-h total", lambda row: "cpu" if row.cpu_only else f"{row.gpu_hours:.2f}"),
    ]


def gain_columns():
    """(header, cell(row) -> str) for the amplification table: the three readings side by side."""
    def st(name):
        return lambda row: fmt_stat(row.stats[name], fmt_gain, len(row.runs))
    return [
        ("method", lambda row: row.label), ("depth", lambda row: str(row.depth)),
        ("amax_fwd (paper)", st("peak_fwd")), ("amax_bwd (paper)", st("peak_bwd")),
        ("abs-value bound", st("peak_abs")), ("study recipe", st("peak_study")),
        *[(f"first >{t:g}× (per seed)", lambda row, t=t: per_seed(row, crossing(t))) for t in THRESHOLDS],
        ("mHC converged", st("peak_converged")),
        ("mHC Sinkhorn column error", lambda row: fmt_stat(row.stats["peak_col_err"], fmt_dev, len(row.runs))),
        ("mHC truncation bound", st("peak_bwd_bound")),
    ]


GAIN_NOTES = """- Peaks over all probe steps of each run, mean ± sample std over seeds. Three readings of one quantity:
  **paper** (HC/mHC papers: per-token composites H_k...H_1 for the forward, H_L...H_k for the backward, largest
  |row sum| / |column sum|, mean over the probe tokens; the headline), **abs-value bound** (the same with absolute
  values: induced norms, an upper bound of the amplification) and **study recipe** (the public 1.7B study:
  H averaged over the batch, multiplied H_1 H_2 ... H_k, the larger of the largest absolute row and column
  sums; compare with that study's figures, and the paper reading with the papers'). All on the probe batch.
- mHC columns: "converged" = the composite gains of the same mixing logits projected to convergence (fp64,
  iterated until every row and column sum is within 1e-6 of 1 or for 20,000 iterations; the verdict says how
  close it got), what the manifold guarantees; "Sinkhorn column error" = the
  largest |column sum - 1| of the H_res the model used (its iterations are truncated); "truncation bound" =
  prod over sublayers of (1 + that layer's column error), the largest backward gain truncation alone can
  give. An as-used gain above 1 but under that bound, with converged gains at 1, is truncation."""


def run_columns():
    """(header, cell(summary) -> str) for the per-run table."""
    return [
        ("run", lambda r: r.name), ("state", lambda r: r.state), ("step", lambda r: fmt_step(r.step)),
        ("final loss", lambda r: fmt_loss(r.final_loss)), ("best val", lambda r: fmt_loss(r.best_val)),
        ("final val", lambda r: fmt_loss(r.final_val)),
        ("peak amax_fwd", lambda r: fmt_gain(r.peak_fwd)), ("peak amax_bwd", lambda r: fmt_gain(r.peak_bwd)),
        *[(f"first >{t:g}×", crossing(t)) for t in THRESHOLDS],
        ("amax_l0 fwd", lambda r: fmt_gain(r.peak_l0_fwd)),
        ("amax_l0 bwd", lambda r: fmt_gain(r.peak_l0_bwd)),
        ("peak grad norm", lambda r: fmt_gain(r.peak_grad_norm)),
        ("clipped", lambda r: fmt_pct(r.clip_share)),
        ("tokens", lambda r: fmt_tokens(r.tokens)), ("wall h", lambda r: fmt_hours(r.wall_s / 3600)),
        ("GPU-h", lambda r: "cpu" if r.n_gpus == 0 else f"{r.gpu_hours:.2f}"),
    ]


def markdown(columns, items):
    head = [h for h, _ in columns]
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(cell(it) for _, cell in columns) + " |" for it in items]
    return "\n".join(lines)


TABLE_NOTES = f"""\
- mean ± std over seeds; std is the sample standard deviation (ddof=1); "(1 seed)": one value, no spread.
  "(n=k)": only k seeds had a (finite) value. Final = the last value logged (a running run
  contributes its latest); diverged runs are left out of the final losses but not of best val loss.
- seeds done/total: runs with status "completed" / run folders found.
- amax = composite Amax gain (paper definition, max over sublayers); peaks are over all probe steps.
  "per seed" lists are in seed order. first >10× / >100× step: the first probe step where
  max(amax_fwd, amax_bwd) exceeded the level, per seed; "never" = not reached in the steps logged so far.
- peak grad norm and clipped steps (the share of training lines with `clipped` true) are over
  the training steps logged (every step, or every --metrics-every).
- tokens/run (mean) and wall h/run (mean ± std) are per run; GPU-h total = sum over runs of
  wall time × GPUs (config world_size; "cpu" for runs with device cpu, counted as 0).
  Wall time = time between metrics lines, leaving out restarts and pauses over {GAP_S / 60:g} min,
  extended to status.json `updated`."""


def csv_rows(rows):
    """Numeric columns for results.csv: *_mean, *_std, *_n per statistic, per-seed lists joined by ';'."""
    out = []
    for row in rows:
        d = {"method": row.method, "depth": row.depth, "coefficients": row.coefficients or "",
             "sinkhorn_iters": row.sinkhorn_iters or "", "preset": row.arm, "seeds_done": row.done,
             "seeds_total": len(row.runs),
             "seeds": ";".join(str(r.seed) for r in row.runs)}
        for name, st in row.stats.items():
            d.update({f"{name}_mean": st.mean, f"{name}_std": st.std, f"{name}_n": st.n})
        d["peak_fwd_per_seed"] = ";".join(repr(r.peak_fwd) for r in row.runs)
        d["peak_bwd_per_seed"] = ";".join(repr(r.peak_bwd) for r in row.runs)
        for t in THRESHOLDS:
            d[f"first_above_{t:g}_per_seed"] = ";".join(
                "never" if r.first_above[t] is None else str(r.first_above[t]) for r in row.runs)
        d.update(diverged=len(row.diverged), gpu_hours=row.gpu_hours, cpu_only=row.cpu_only)
        out.append(d)
    return out


def run_csv_rows(summaries):
    out = []
    for s in summaries:
        d = {k: v for k, v in vars(s).items() if k != "first_above"}
        d.update({f"first_above_{t:g}": v for t, v in s.first_above.items()})
        out.append(d)
    return out


def write_csv(path, dicts):
    if not dicts:
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(dicts[0]))
        w.writeheader()
        w.writerows(dicts)


# --- verdict: one paragraph per depth, stated only from the numbers above ------------------------

def _spread(stat):
    """How a mean over seeds was formed, for the verdict."""
    if math.isinf(stat.mean):
        return f"non-finite in at least one of {_seeds(stat.n)}"
    if stat.n == 1:
        return "1 seed"
    return f"mean of {_seeds(stat.n)}, ± {fmt_gain(stat.std, stat.mean)} sample std"


def _seeds(n):
    return f"{n} seed{'s' if n != 1 else ''}"


def _progress(row):
    states = {}
    for r in row.runs:
        states[r.state] = states.get(r.state, 0) + 1
    return ", ".join(f"{n} {s}" for s, n in sorted(states.items()))


def fmt_dev(x):
    """A small deviation from 1 with two significant digits: 0.0012, 3.4e-07, 0."""
    return "0" if x == 0 else f"{x:.2g}"


def _crossed(row, threshold):
    if all(r.first_above[threshold] is None for r in row.runs if r.has_probe):
        return f"never above {threshold:g}×"
    return f"first above {threshold:g}× at step {per_seed(row, crossing(threshold))} (per seed)"


def truncation_evidence(converged):
    """mHC runs with converged gains: (distance of the converged gains from 1, whether every as-used backward
    gain stays under its truncation bound). Both small/true: the as-used distance from 1 is truncation."""
    conv_dev = max(abs(r.peak_converged - 1) for r in converged)
    return conv_dev, all(r.peak_bwd <= r.peak_bwd_bound * (1 + 1e-9) for r in converged)


def truncation(row, probed):
    """mHC: whether the as-used gains' distance from 1 is Sinkhorn truncation (words), or ''."""
    converged = [r for r in probed if not math.isnan(r.peak_converged)]
    if not converged:
        return ""
    conv_dev, within = truncation_evidence(converged)
    left = max((r.converged_err for r in converged if not math.isnan(r.converged_err)), default=math.nan)
    reached = "" if math.isnan(left) else f" (every row and column sum within {fmt_dev(left)} of 1)"
    bound, err = max(r.peak_bwd_bound for r in converged), max(r.peak_col_err for r in converged)
    if conv_dev < 1e-3 and within:
        return (f" Projected to convergence{reached} the same mixing logits give 1 ± {fmt_dev(conv_dev)}; the as-used "
                f"backward gain (up to {fmt_gain(max(r.peak_bwd for r in converged))}) stays under the bound "
                f"{fmt_gain(bound)} that Sinkhorn column errors of up to {fmt_dev(err)} allow: its distance from "
                "1 is truncation of the projection (--sinkhorn-iters), not amplification.")
    return (f" Projected to convergence the same mixing logits give up to 1 ± {fmt_dev(conv_dev)}"
            f"{'' if within else ', and the as-used backward gain exceeds the truncation bound'}: more than "
            "Sinkhorn truncation explains; check the probe.")


def published_matches(rows, method, depth, fields, coefficients):
    """'amax_fwd 43.6 / amax_bwd 42.7 (label, depth d)' of each of our rows that compares with one published figure,
    each reading named (a forward and a backward figure are never read as one); the study's figures with its own
    model only (the seed-study arm)."""
    found = []
    for row in rows:
        if (row.method, row.coefficients) != (method, coefficients) or depth not in (None, row.depth) or \
                coefficients == "sequence" and "seed-study" not in row.arm:
            continue
        values = [f"{f.replace('peak_', 'amax_')} {fmt_gain(row.stats[f].mean)}" for f in fields
                  if not math.isnan(row.stats[f].mean)]
        if values:
            found.append(f"{' / '.join(values)} ({row.label}, depth {row.depth})")
    return found


def reference_block(rows):
    """results.md's reference block: the published figures, the reading and arm of ours each compares with,
    and our figure where this report has that arm."""
    columns = [("published", lambda p: p[0]), ("method", lambda p: METHOD_LABEL[p[1]]),
               ("depth", lambda p: "–" if p[2] is None else str(p[2])), ("peak composite gain", lambda p: p[3]),
               ("our reading", lambda p: READING[p[4]]),
               ("our arm", lambda p: "token coefficients (default)" if p[5] == "token" else
                "--preset seed-study"),
               ("ours here", lambda p: "; ".join(published_matches(rows, p[1], p[2], p[4], p[5])) or "no such run")]
    return [markdown(columns, PUBLISHED), "",
            "The papers' figures are per token, on a 27B model: compare them with amax_fwd and amax_bwd of our "
            "token-coefficient arms. The public study's figures are the peak over training steps of its own recipe "
            f"(H averaged over the training batch, multiplied in reverse order over the full depth, the larger of "
            f"the largest absolute row and column sums: our {STUDY_TRAIN_KEY}, logged every step) on its own model: "
            f"compare them with {STUDY_TRAIN_KEY} of our seed-study arm (--preset seed-study), not with our "
            "per-token readings nor the probe's amax_study (held-out batch, every --metrics-every steps)."]


def reference_verdict(rows):
    """One verdict line: our figures beside the published ones they compare with."""
    pairs = [f"{METHOD_LABEL[method]} {', '.join(ours)} against {figure} ({source}"
             + (f", depth {depth})" if depth else ")")
             for source, method, depth, figure, fields, coefficients in PUBLISHED
             for ours in [published_matches(rows, method, depth, fields, coefficients)] if ours]
    if not pairs:
        return ("**published figures**: no arm here compares directly (per-token amax_fwd/amax_bwd of HC or mHC "
                f"for the papers, {STUDY_TRAIN_KEY} of the seed-study arm for the public study); see the reference "
                "block.")
    return "**published figures**: " + "; ".join(pairs) + "."


def verdict_gain(row):
    """One sentence about a method's composite gains at one depth."""
    name = row.label
    probed = [r for r in row.runs if r.has_probe]
    if not probed:
        return f"{name}: {_seeds(len(row.runs))} ({_progress(row)}) but no probe lines yet."
    dev = max(r.max_dev for r in probed)
    if row.method == "baseline" and dev < 1e-6:
        return (f"baseline: 1 by definition (logged composite gains within 1 ± {fmt_dev(dev)}, "
                f"{_seeds(len(probed))}).")
    if row.method == "baseline":
        return (f"baseline: logged composite gains up to {fmt_dev(dev)} away from 1 "
                "(expected exactly 1; check the probe).")
    fwd, bwd = row.stats["peak_fwd"], row.stats["peak_bwd"]
    if dev < FLAT:
        return (f"{name}: composite gains stayed within 1 ± {fmt_dev(dev)} (forward and backward, "
                f"all probe steps, {_seeds(len(probed))}; {_progress(row)})." + truncation(row, probed))
    cross = "; ".join(_crossed(row, t) for t in THRESHOLDS)
    top = max(probed, key=lambda r: -math.inf if math.isnan(r.peak_fwd) else r.peak_fwd)
    return (f"{name}: composite forward gain peaked at {fmt_gain(fwd.mean)}× ({_spread(fwd)}; "
            f"highest {fmt_gain(top.peak_fwd)}× in seed {top.seed}), backward {fmt_gain(bwd.mean)}× "
            f"({_spread(bwd)}); {cross}; {_progress(row)}." + truncation(row, probed))


def verdict_loss(rows):
    parts = [f"{r.label} {fmt_stat(r.stats['final_val'], fmt_loss, len(r.runs))}"
             for r in rows if r.stats["final_val"].n]
    return f"Final val loss (mean ± sample std): {', '.join(parts)}." if parts else "No val loss logged yet."


def arm_depths(rows):
    """(where, rows) per arm and depth, in table order: 'depth 48', or 'stress arm, depth 48' with several arms."""
    for arm, depth in sorted({(r.arm, r.depth) for r in rows}):
        at = [r for r in rows if (r.arm, r.depth) == (arm, depth)]
        yield (f"{arm} arm, depth {depth}" if at[0].label_arm else f"depth {depth}"), at


def headline_gain(row):
    """A few words on one method's composite gain: 'HC amplifies 45× (above 10× at step 140)', 'mHC 1.000
    (backward 1.150 from Sinkhorn truncation)'; '' for a baseline at exactly 1 (nothing to say)."""
    probed = [r for r in row.runs if r.has_probe]
    if not probed:
        return f"{row.label} not probed yet"
    if row.method == "baseline" and max(r.max_dev for r in probed) < 1e-6:
        return ""
    fwd, bwd = row.stats["peak_fwd"].mean, row.stats["peak_bwd"].mean
    converged = [r for r in probed if not math.isnan(r.peak_converged)]
    conv_dev, within = truncation_evidence(converged) if converged else (math.nan, False)
    truncated = conv_dev < 1e-3 and within
    if max(fwd, bwd) >= 1 + FLAT and not truncated:
        level = THRESHOLDS[0]
        when = (f"never above {level:g}×" if all(r.first_above[level] is None for r in probed)
                else f"above {level:g}× at step {per_seed(row, crossing(level))}")
        return f"{row.label} amplifies {fmt_gain(max(fwd, bwd))}× ({when})"
    text = f"{row.label} {fmt_gain(fwd)}"
    if fmt_gain(bwd) == fmt_gain(fwd):
        return text
    return f"{text} (backward {fmt_gain(bwd)}{' from Sinkhorn truncation' if truncated else ''})"


def headline(rows):
    """The first lines of results.md: per arm and depth, the gains in one line and the losses in another."""
    lines = []
    for where, at in arm_depths(rows):
        fewest, most = min(len(r.runs) for r in at), max(len(r.runs) for r in at)
        seeds = f"{most} seed{'s' if most > 1 else ''}" if fewest == most else f"{fewest} to {most} seeds"
        gains = [g for g in map(headline_gain, at) if g] or ["baseline only"]
        div = [f"{len(r.diverged)} of {len(r.runs)} {r.label} runs diverged" for r in at if r.diverged]
        losses = [f"{r.label} {fmt_loss(r.stats['final_val'].mean)}" for r in at if r.stats["final_val"].n]
        lines.append(f"**{where}** ({seeds}): "
                     + "; ".join(gains + div) + ".  ")
        lines.append(f"Final val loss: {', '.join(losses)}." if losses else "No val loss logged yet.")
        lines.append("")
    return lines[:-1]


def verdict(rows):
    """Markdown lines, one paragraph per arm and depth; missing methods are said, not guessed."""
    lines = []
    for where, at in arm_depths(rows):
        have = {r.method for r in at}
        parts = [verdict_gain(r) for r in at]
        parts += [f"No {METHOD_LABEL[m]} runs at depth {at[0].depth}." for m in CORE_METHODS if m not in have]
        div = [f"{len(r.diverged)} of {len(r.runs)} {r.label} runs diverged"
               for r in at if r.diverged]
        if div:
            parts.append("; ".join(div) + ".")
        parts.append(verdict_loss(at))
        lines.append(f"**{where}**: " + " ".join(parts))
    return lines


# --- plots: matplotlib's object API on the Agg canvas (no pyplot, no global state) --------------

@dataclass
class Band:
    """Seeds' curves on one step grid: line = mean over seeds of each seed's bin mean;
    seed band = min/max over seeds of those bin means; full band = min/max of every value in the bin."""
    x: np.ndarray
    line: np.ndarray
    seed_lo: np.ndarray
    seed_hi: np.ndarray
    full_lo: np.ndarray
    full_hi: np.ndarray


def smoothing_window(curves, points):
    """Steps per averaging window so that the curves keep about `points` points: 1 (every logged step)
    when they have no more distinct steps than that."""
    steps = np.unique(np.concatenate([s for s, _ in curves] or [np.array([])]))
    return 1 if steps.size <= points else math.ceil((steps[-1] - steps[0] + 1) / points)


def window_words(window):
    return "every logged step" if window == 1 else f"mean over {window}-step windows"


def bin_curves(curves, window=1, geometric=False):
    """Band of seeds' (steps, values), or None. Window 1: every distinct step is its own bin; else
    `window` consecutive steps from the first logged one share a bin. Non-finite values are skipped; `geometric`
    averages in log space (for values spanning decades)."""
    curves = [(s, np.log(np.where(v > 0, v, np.nan)) if geometric else v) for s, v in curves if s.size]
    if not curves:
        return None
    steps = np.unique(np.concatenate([s for s, _ in curves]))
    if window == 1:
        x, locate = steps.astype(np.float64), (lambda s: np.searchsorted(steps, s))
    else:
        first = int(steps[0])
        x = first + np.arange((int(steps[-1]) - first) // window + 1) * window + (window - 1) / 2
        locate = lambda s: (np.asarray(s, dtype=np.int64) - first) // window  # noqa: E731
    mean, lo, hi = (np.stack(a) for a in zip(*[_reduce_bins(locate(s), v, x.size) for s, v in curves]))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)          # bins that no seed reached
        stats = [np.nanmean(mean, 0), np.nanmin(mean, 0), np.nanmax(mean, 0),
                 np.nanmin(lo, 0), np.nanmax(hi, 0)]
    return Band(x, *(np.exp(a) if geometric else a for a in stats))


def _reduce_bins(bins, values, n):
    """Per-bin mean, min and max of one seed (NaN for empty bins)."""
    ok = np.isfinite(values)
    bins, values = bins[ok], values[ok]
    count = np.bincount(bins, minlength=n).astype(np.float64)
    count[count == 0] = np.nan
    lo, hi = np.full(n, np.inf), np.full(n, -np.inf)
    np.minimum.at(lo, bins, values)
    np.maximum.at(hi, bins, values)
    lo[np.isinf(lo)], hi[np.isinf(hi)] = np.nan, np.nan
    return np.bincount(bins, weights=values, minlength=n) / count, lo, hi


class Look(NamedTuple):
    """How one arm is drawn: its legend label and matplotlib line style."""
    label: str
    color: str
    ls: object
    marker: str
    zorder: int
    index: int          # its place among the arms: staggers its markers against the others'

    @property
    def style(self):
        return {k: v for k, v in self._asdict().items() if k not in ("label", "index")}


def arm_looks(arms):
    """{arm: Look}: the first plain arm of a method (token coefficients, default iterations) keeps the method's
    colour; every other arm takes the next of ARM_COLORS, dashed with per-sequence coefficients."""
    looks, spare = {}, iter(ARM_COLORS * (1 + len(arms) // len(ARM_COLORS)))
    several_presets = len({a.preset for a in arms}) > 1
    for arm in sorted(arms, key=Arm.sort_key):
        plain = arm.coefficients != "sequence" and arm.sinkhorn_iters in (None, ARM_DEFAULTS["sinkhorn_iters"])
        if plain and arm.method not in {a.method for a in looks}:
            style = METHOD_STYLE.get(arm.method, {"color": next(spare), "ls": "-", "marker": "P", "zorder": 2})
        else:
            style = {"color": next(spare), "ls": "--" if arm.coefficients == "sequence" else "-",
                     "marker": METHOD_STYLE.get(arm.method, {}).get("marker", "P"), "zorder": 3}
        looks[arm] = Look(arm.label(several_presets), **style, index=len(looks))
    return looks


def group_runs(runs):
    """{depth: {Look: [runs]}}, one Look per arm, in display order."""
    looks, out = arm_looks({r.arm for r in runs}), {}
    for r in sorted(runs, key=lambda r: (r.depth, r.arm.sort_key(), r.seed or 0)):
        out.setdefault(r.depth, {}).setdefault(looks[r.arm], []).append(r)
    return out


def new_figure(n_rows, n_cols, height=3.3, width=6.2):
    from matplotlib.figure import Figure
    fig = Figure(figsize=(width * n_cols, height * n_rows + 0.5), layout="constrained", dpi=110)
    return fig, fig.subplots(n_rows, n_cols, squeeze=False)


def line_style(look, n_points):
    """Matplotlib keywords of an arm's line of n_points: markers spaced evenly, shifted per arm so that
    coinciding lines show their markers side by side."""
    every = max(MARKS, n_points // MARKS)
    shift = look.index * every // MARKS % every
    return {**look.style, "lw": LINE_WIDTH, "ms": 5, "mfc": "white", "markevery": (shift, every)}


def draw_method(ax, look, runs, key, window=1, geometric=False, envelope=False):
    """One arm's mean line on ax with its seed min–max band, or with a thin line through the
    largest value of each bin (`envelope`, for spikes); an X where a run diverged.
    Returns the plotted arrays (for axis scaling)."""
    band = bin_curves([r.series[key].arrays() for r in runs], window, geometric)
    if band is None or not np.isfinite(band.line).any():
        return []
    ok = np.isfinite(band.line)
    style = line_style(look, int(ok.sum()))
    label = f"{look.label} ({_seeds(len(runs))})"
    ax.plot(band.x[ok], band.line[ok], label=label, **style)
    if envelope:
        ax.plot(band.x[ok], band.full_hi[ok], color=style["color"], lw=0.7, alpha=0.75, zorder=1)
        plotted = [band.line[ok], band.full_lo[ok], band.full_hi[ok]]
    else:
        plotted = [band.line[ok], band.seed_lo[ok], band.seed_hi[ok]]
        if len(runs) > 1:
            ax.fill_between(band.x[ok], plotted[1], plotted[2], color=style["color"], alpha=0.18, lw=0,
                            zorder=style["zorder"] - 1)
    mark_diverged(ax, look, runs, key)
    return plotted


def mark_diverged(ax, look, runs, key):
    """An X at the last finite value of each diverged run, so a stopped line is not misread."""
    pts = []
    for r in runs:
        s, v = r.series[key].arrays()
        ok = np.flatnonzero(np.isfinite(v))
        if r.status.get("state") == "diverged" and ok.size:
            pts.append((s[ok[-1]], v[ok[-1]], r.seed))
    if pts:
        xs, ys, seeds = zip(*pts)
        label = f"{look.label} diverged (seed {', '.join(map(str, seeds))})"
        ax.plot(xs, ys, ls="none", marker="X", ms=9, mec="black", mew=0.8, color=look.color,
                zorder=5, label=label)


def plot_panel(ax, by_method, key, title, points=PLOT_POINTS, legend_outside=False, **kw):
    """All arms of one depth on one axis, averaged over one window of steps (named in the title) that
    leaves about `points` points; returns the plotted arrays (empty if none)."""
    window = smoothing_window([r.series[key].arrays() for runs in by_method.values() for r in runs], points)
    plotted = []
    for look, runs in by_method.items():
        plotted += draw_method(ax, look, runs, key, window, **kw)
    ax.set_title(f"{title} ({window_words(window)})", fontsize=10)
    ax.set_xlabel("step")
    ax.grid(True, which="major", alpha=0.3)
    if plotted and legend_outside:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    elif plotted:
        ax.legend(fontsize=8, loc="best")
    else:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", color="0.5")
    return plotted


def scale_y(ax, values, spread):
    """Log y when the plotted values span more than `spread`×; else linear, at least ±2 % tall."""
    v = np.concatenate([np.ravel(a) for a in values]) if values else np.array([])
    v = v[np.isfinite(v)]
    if v.size and v.min() > 0 and v.max() / v.min() > spread:
        ax.set_yscale("log")
        return True
    ax.ticklabel_format(axis="y", useOffset=False, style="plain")
    if v.size and v.max() - v.min() < 0.04 * abs(v.mean()):
        mid = (v.max() + v.min()) / 2
        ax.set_ylim(mid - 0.02 * abs(mid) - 1e-9, mid + 0.02 * abs(mid) + 1e-9)
    return False


def mark_level(ax, y, text, values):
    """A dotted horizontal reference line (threshold, clip value) when it lies inside the data."""
    top = max((float(np.nanmax(v)) for v in values if v.size), default=0.0)
    if y < top:
        ax.axhline(y, color="0.45", lw=0.8, ls=":", zorder=1)
        ax.annotate(text, (0.005, y), xycoords=("axes fraction", "data"), fontsize=8, color="0.35",
                    va="bottom")


def name_arms_at_one(ax, by_method, key):
    """Arms whose gain stays at 1 draw one line over another, told apart by sparse markers only: name them, in the
    legend's title (written by the line at 1, it sat on the x axis, where the line at 1 often is)."""
    flat = [look.label for look, runs in by_method.items()
            if all(np.isfinite(v := r.series[key].arrays()[1]).any() and np.allclose(v[np.isfinite(v)], 1, atol=5e-3)
                   for r in runs)]
    if len(flat) > 1:
        legend = ax.get_legend()
        legend.set_title(f"at 1, one over another: {', '.join(flat)}", prop={"size": 8})
        legend.set_alignment("left")


def plot_amax(runs, path):
    from matplotlib.ticker import FuncFormatter, LogLocator
    groups = group_runs(runs)
    fig, axes = new_figure(len(groups), 2)
    for (depth, by_method), row in zip(groups.items(), axes):
        for ax, key, what in zip(row, ("amax_fwd", "amax_bwd"), ("forward", "backward")):
            vals = plot_panel(ax, by_method, key, f"depth {depth}: composite {what} gain ({key})")
            ax.set_ylabel(f"{key} (×)")
            if scale_y(ax, vals, spread=5.0):
                for t in THRESHOLDS:
                    mark_level(ax, t, f"{t:g}×", vals)
                # decades alone leave 3 and 40 to be guessed between ticks
                ax.yaxis.set_minor_locator(LogLocator(subs=(2, 5)))
                ax.yaxis.set_minor_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
            name_arms_at_one(ax, by_method, key)
    fig.suptitle("Composite Amax gain: line = mean over seeds, band = seed min–max "
                 "(baseline is 1 by definition)", fontsize=11)
    return save(fig, path)


def plot_loss(runs, path):
    groups = group_runs(runs)
    fig, axes = new_figure(len(groups), 2)
    for (depth, by_method), (ax_t, ax_v) in zip(groups.items(), axes):
        focus_loss(ax_t, plot_panel(ax_t, by_method, "loss", f"depth {depth}: train loss", LOSS_POINTS))
        focus_loss(ax_v, plot_panel(ax_v, by_method, "val_loss", f"depth {depth}: validation loss", LOSS_POINTS))
        for ax in (ax_t, ax_v):
            ax.set_ylabel("loss (nats/token)")
    fig.suptitle("Loss: line = mean over seeds of each window's mean (window in each title), "
                 "band = seed min–max; y axis zoomed past the first 10% of steps", fontsize=11)
    return save(fig, path)


def focus_loss(ax, values):
    """Linear y zoomed on the part after the initial drop, where the methods differ."""
    ax.ticklabel_format(axis="y", useOffset=False, style="plain")
    lows = [float(np.min(v)) for v in values[1::3] if v.size]             # band minima
    tails = [float(np.max(v[len(v) // 10:])) for v in values[2::3] if v.size > 10]
    if lows and tails and max(tails) > min(lows):
        pad = 0.05 * (max(tails) - min(lows))
        ax.set_ylim(min(lows) - pad, max(tails) + pad)


def plot_grad_norm(runs, path):
    groups = group_runs(runs)
    fig, axes = new_figure(len(groups), 1, width=11.5)
    for (depth, by_method), (ax,) in zip(groups.items(), axes):
        vals = plot_panel(ax, by_method, "grad_norm", f"depth {depth}: pre-clip gradient norm",
                          GRAD_POINTS, geometric=True, envelope=True, legend_outside=True)
        ax.set_ylabel("grad norm (pre-clip)")
        scale_y(ax, vals, spread=10.0)
        clip = clip_value(by_method)
        if clip:
            mark_level(ax, clip, f"clip {clip:g}", vals)
    fig.suptitle("Pre-clip gradient norm: line = geometric mean per window (mean over seeds), "
                 "thin line = largest value of any seed in the window (spikes)", fontsize=11)
    return save(fig, path)


def clip_value(by_method):
    clips = {settings(r.config).get("grad_clip") for rs in by_method.values() for r in rs}
    clips = [c for c in clips if isinstance(c, (int, float)) and c > 0]
    return clips[0] if len(clips) == 1 else None


def pick_heatmap_run(runs, name=None):
    """The named run, else the HC run with the largest peak amax_fwd that has layer lists,
    else any run with layer lists (largest peak first); None when no run has them."""
    if name is not None:
        match = [r for r in runs if name in (r.name, settings(r.config).get("run_name"))]
        if not match:
            raise ReportError(f"--heatmap-run {name}: no such run (have: {', '.join(r.name for r in runs)})")
        return match[0]
    with_layers = [r for r in runs if any(len(s) for s in r.layers.values())]

    def peak(r):
        p = _peak(r.series["amax_fwd"].arrays()[1])
        return -math.inf if math.isnan(p) else p
    hc = [r for r in with_layers if r.method == "hc"]
    return max(hc or with_layers, key=peak, default=None)


def layer_matrix(series):
    """(steps, matrix sublayer × step) of a layer-gain series, or None; rows of an odd length are dropped."""
    if not len(series):
        return None
    lengths = [v.size for v in series.values]
    n = max(set(lengths), key=lengths.count)
    keep = [i for i, k in enumerate(lengths) if k == n]
    steps = np.asarray([series.steps[i] for i in keep], dtype=np.float64)
    return steps, np.stack([series.values[i] for i in keep], axis=1).astype(np.float64)


def step_edges(steps):
    if steps.size == 1:
        return np.array([steps[0] - 0.5, steps[0] + 0.5])
    mid = (steps[:-1] + steps[1:]) / 2
    return np.concatenate([[2 * steps[0] - mid[0]], mid, [2 * steps[-1] - mid[-1]]])


def gain_ticks(r):
    """Colour-bar ticks for a log scale from 1/r to r: 1, then nice values and their reciprocals."""
    nice = [t for t in (1.05, 1.1, 1.25, 1.5, 2, 3, 5, 10, 20, 50, 100, 1e3, 1e4, 1e5, 1e6) if t <= r]
    up = {min(nice, key=lambda t: abs(math.log(t / r ** f))) for f in (1 / 3, 2 / 3, 1)} if nice else {r}
    return sorted({1.0, *up, *(1 / t for t in up)})


def plot_heatmap(run, path):
    from matplotlib.colors import LogNorm
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
    mats = {k: layer_matrix(run.layers[k]) for k in LAYER_KEYS}
    vals = np.concatenate([m[1].ravel() for m in mats.values() if m is not None])
    vals = vals[np.isfinite(vals) & (vals > 0)]
    r = max(vals.max(), 1 / vals.min(), 1.01) if vals.size else 1.01
    norm = LogNorm(vmin=1 / r, vmax=r)          # symmetric around 1, so 1 is the white midpoint
    fig, axes = new_figure(1, 2, height=min(8.0, 3.0 + 0.045 * 2 * run.depth), width=6.0)
    mesh = None
    for ax, key, what in zip(axes[0], LAYER_KEYS, ("forward: g_fwd(H_res_k)", "backward: g_bwd(H_res_k)")):
        ax.set_title(what, fontsize=10)
        ax.set_xlabel("step")
        ax.set_ylabel("sublayer k (even: attention, odd: MLP)")
        if mats[key] is None:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", color="0.5")
            continue
        steps, m = mats[key]
        m = np.ma.masked_invalid(np.clip(m, 1 / r, r))
        mesh = ax.pcolormesh(step_edges(steps), np.arange(m.shape[0] + 1) - 0.5, m, norm=norm, cmap="RdBu_r")
    if mesh is not None:
        bar = fig.colorbar(mesh, ax=axes[0].tolist(), shrink=0.9, aspect=30, pad=0.02,
                           label="single-layer gain (×), log scale; 1 = neutral")
        bar.ax.yaxis.set_major_locator(FixedLocator(gain_ticks(r)))
        bar.ax.yaxis.set_minor_locator(NullLocator())
        bar.ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:.4g}"))
    fig.suptitle(f"Single-layer gains of {run.name} ({METHOD_LABEL.get(run.method, run.method)}, "
                 f"depth {run.depth}, seed {run.seed}): red amplifies, blue attenuates", fontsize=11)
    return save(fig, path)


def save(fig, path):
    fig.savefig(path)
    return path


PLOT_NAMES = ("amax.png", "loss.png", "grad_norm.png", "layer_gains.png")


def write_plots(runs, heat, out):
    """Write every plot that has data; returns (written paths, notes about skipped ones)."""
    written, notes = [], []
    for name, key, plot in (("amax.png", "amax_fwd", plot_amax), ("loss.png", "loss", plot_loss),
                            ("grad_norm.png", "grad_norm", plot_grad_norm)):
        if any(len(r.series[key]) for r in runs):
            written.append(plot(runs, out / name))
        else:
            notes.append(f"{name} not written: no run logged `{key}` yet.")
    if heat is None:
        notes.append("layer_gains.png not written: no run logged layer_gain_fwd/bwd lists yet.")
    elif not any(len(s) for s in heat.layers.values()):
        notes.append(f"layer_gains.png not written: run {heat.name} has no layer_gain lists.")
    else:
        written.append(plot_heatmap(heat, out / "layer_gains.png"))
    return written, notes


# --- watch: the launcher's live view of a matrix, from matrix.log and each run's status.json ------

LAUNCHER_STATES = {"LAUNCH": "running", "DONE": "done", "DIVERGED": "done", "SKIP": "done", "FAILED": "failed",
                   "RETRY": "queued", "REQUEUE": "queued"}


@dataclass
class Matrix:
    """The launcher's last invocation in a runs folder, as matrix.log tells it."""
    started: float
    slots: int
    gpus_per_run: int
    price: float
    cpu: bool
    runs: dict                   # run -> [state, gpus]: in queue order
    planned: dict = field(default_factory=dict)     # run -> the trainer's planned seconds, before steps are timed
    ended: float | None = None   # when the invocation ended (its END line): the elapsed clock stops there


def read_matrix(root, log="matrix.log"):
    """The last invocation's QUEUE line and every job event after it; None without one."""
    try:
        with open_regular(root / log) as f:
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    starts = [i for i, line in enumerate(lines) if " QUEUE " in line]
    if not starts:
        return None
    stamp, _, rest = lines[starts[-1]].split(" ", 2)
    fields = dict(item.split("=", 1) for item in rest.split() if "=" in item)
    runs = {name: ["queued", ""] for name in fields.get("runs", "").split(",") if name}
    ended = None
    for line in lines[starts[-1] + 1:]:
        parts = line.split(" ")
        if len(parts) >= 3 and parts[1] in LAUNCHER_STATES and parts[2] in runs:
            gpus = next((p[5:] for p in parts if p.startswith("gpus=")), runs[parts[2]][1])
            runs[parts[2]] = [LAUNCHER_STATES[parts[1]], gpus]
        ended = parts[0] if parts[1:2] == ["END"] else ended
    try:
        planned = {name: float(s) for name, s in (item.split(":") for item in fields.get("planned_s", "").split(",")
                                                   if item.count(":") == 1)}
        return Matrix(log_time(stamp), int(fields.get("slots", 1)), int(fields.get("gpus_per_run", 1)),
                      float(fields.get("price_per_gpu_hour", 0)), fields.get("gpus") == "cpu", runs, planned,
                      ended and log_time(ended))
    except ValueError as e:
        warn(f"{root / log}: its last QUEUE line is unreadable ({e}); the matrix's progress is left out")
        return None


def log_time(stamp):
    return datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%f%z").timestamp()


def job_seconds(status):
    """A whole run's time at its latest pace (steps x step time), NaN when not known yet."""
    steps, step_time = status.get("steps"), status.get("step_time_s")
    return steps * step_time if isinstance(steps, int) and isinstance(step_time, (int, float)) else math.nan


def wall_eta(matrix, statuses):
    """Seconds until the queue is empty: running jobs hold their slots for their ETA, queued ones start in order
    on the first free slot and take the time of runs of the same method and depth at their pace. Until such steps
    are timed a job takes the trainer's planned time (its plan knows an HC step from a baseline one), and only
    without one the time of any run."""
    def kind(name):
        return name.split("_s")[0]
    durations = {}
    for name, status in statuses.items():
        if math.isfinite(job_seconds(status)):
            durations.setdefault(kind(name), []).append(job_seconds(status))
    anything = [d for ds in durations.values() for d in ds]
    free = sorted(statuses[name].get("eta_s") or matrix.planned.get(name) or 0.0
                  for name, (state, _) in matrix.runs.items() if state == "running")
    free += [0.0] * max(0, matrix.slots - len(free))
    for name, (state, _) in matrix.runs.items():
        if state == "queued":
            guess = durations.get(kind(name)) or ([matrix.planned[name]] if name in matrix.planned else anything)
            if not guess:
                return math.nan
            free[0] += sum(guess) / len(guess)
            free.sort()
    return max(free, default=0.0)


def fmt_clock(seconds):
    return "–" if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) else \
        str(timedelta(seconds=round(seconds)))


def read_matrices(root, log=None):
    """One launcher's matrix (`log`), else the folder's: matrix.log, or the nodes' shares (matrix.node{i}.log,
    run_experiments.sh --nodes) as one matrix: their slots added up, their queues one after another."""
    names = [log] if log else ["matrix.log"] if (root / "matrix.log").exists() else \
        sorted(p.name for p in root.glob("matrix.node*.log"))
    shares = [m for m in (read_matrix(root, name) for name in names) if m is not None]
    if not shares:
        return None
    ends = [m.ended for m in shares]
    return Matrix(min(m.started for m in shares), sum(m.slots for m in shares), shares[0].gpus_per_run,
                  shares[0].price, all(m.cpu for m in shares), {k: v for m in shares for k, v in m.runs.items()},
                  {k: v for m in shares for k, v in m.planned.items()}, None if None in ends else max(ends))


def watch_view(root, stale_after_min=15.0, now=None, log=None):
    """The matrix view as text (raises ReportError when no launcher has run in root); `log` is one launcher's
    matrix log (default: the folder's, every node's share of it together)."""
    root, now = Path(root), time.time() if now is None else now
    matrix = read_matrices(root, log)
    if matrix is None:
        raise ReportError(f"no matrix in {root} (no {log or 'matrix.log'} with a QUEUE line): start one with "
                          "run_experiments.sh")
    statuses = {name: read_json(root / name / "status.json") or {} for name in matrix.runs}
    counts = {state: sum(s == state for s, _ in matrix.runs.values())
              for state in ("done", "running", "queued", "failed")}
    eta, gpus = wall_eta(matrix, statuses), 0 if matrix.cpu else matrix.slots * matrix.gpus_per_run
    elapsed = (matrix.ended or now) - matrix.started
    elapsed_h = elapsed / 3600
    money = (f"${elapsed_h * gpus * matrix.price:,.0f} spent, ${eta / 3600 * gpus * matrix.price:,.0f} to go "
             f"({gpus} GPU(s) at ${matrix.price:g} per GPU-hour)" if gpus and math.isfinite(eta) else
             "no GPU-hours (CPU)" if not gpus else f"${elapsed_h * gpus * matrix.price:,.0f} spent")
    width = max([22] + [len(name) for name, (state, _) in matrix.runs.items() if state == "running"])
    lines = [f"Matrix {root} at {time.strftime('%H:%M:%S', time.localtime(now))}: "
             + ", ".join(f"{n} {state}" for state, n in counts.items())
             + f"; {fmt_clock(elapsed)} elapsed{'' if matrix.ended is None else ' (ended)'}, {fmt_clock(eta)} to go; "
             f"{money}",
             f"{'GPU':<8} {'run':<{width}} {'step':>14} {'loss':>8} {'amax_fwd':>9} {'tok/s':>9} {'ETA':>9}"]
    for name, (state, where) in matrix.runs.items():
        if state != "running":
            continue
        st = statuses[name]
        step = f"{st.get('step', 0):,}/{st.get('steps', 0):,}" if st.get("steps") else "starting"
        stale = now - (st.get("updated") or now) > stale_after_min * 60
        speed = _num(st.get("tokens_per_s"))
        lines.append(f"{where or '-':<8} {name:<{width}} {step:>14} {fmt_loss(_num(st.get('loss'))):>8} "
                     f"{fmt_gain(_num(st.get('amax_fwd'))):>9} {f'{speed:,.0f}' if math.isfinite(speed) else '–':>9} "
                     f"{fmt_clock(st.get('eta_s')):>9}"
                     + (f"  STALE: status.json unchanged for {(now - st['updated']) / 60:.0f} min" if stale else ""))
    for group in ("done", "queued", "failed"):
        names = [name for name, (state, _) in matrix.runs.items() if state == group]
        if names:
            lines.append(f"{group}: " + ", ".join(
                f"{name} {statuses[name].get('state', '')}".rstrip() for name in names)
                + (" (matrix.log says why)" if group == "failed" else ""))
    return "\n".join(lines)


# --- main: read, aggregate, write, print ---------------------------------------------------------

def matrix_notes(summaries):
    """What varied with the seed, and a warning when the runs do not share one precision policy."""
    lines = []
    data_seeds = {s.data_seed for s in summaries}
    if len({s.seed for s in summaries}) > 1:
        lines.append("- Seeds varied the initialisation and the data order (--data-seed varied with --seed)."
                     if len(data_seeds) > 1 else
                     f"- Seeds varied the initialisation only; every run read the data in one order "
                     f"(--data-seed {next(iter(data_seeds))}).")
    policies = {s.precision for s in summaries}
    if len(policies) > 1:
        lines.append("- **Warning: these runs do not share one precision policy** (config.json `precision`): "
                     + "; ".join(f"{p}: {', '.join(s.name for s in summaries if s.precision == p)}"
                                 for p in sorted(policies)) + ". Compare their gains with care.")
    return lines


def results_markdown(roots, rows, summaries, verdict_lines, plots, notes):
    n = len(summaries)
    parts = [f"# Results: {', '.join(map(str, roots))}", "", *headline(rows), "",
             "## Table", "", markdown(main_columns(), rows), "",
             f"{n} run{'s' if n != 1 else ''}, {len(rows)} method × depth rows; "
             f"generated {time.strftime('%Y-%m-%d %H:%M:%S')} by report.py. Notes under the full table.", "",
             "## Published figures", "", *reference_block(rows), "",
             "## Verdict", "", *[f"- {v}" for v in verdict_lines], "",
             "## Amplification: three readings", "", markdown(gain_columns(), rows), "", GAIN_NOTES, "",
             "## Full table", "", markdown(table_columns(), rows), "", TABLE_NOTES, *matrix_notes(summaries), "",
             "## Runs", "", markdown(run_columns(), summaries), "", "## Plots", ""]
    parts += [f"![{p.stem}]({p.name})" for p in plots] + [f"- {note}" for note in notes]
    return "\n".join(parts) + "\n"


def report(roots, out=None, heatmap_run=None, with_plots=True):
    """Everything main does after parsing the arguments; raises ReportError for expected problems."""
    roots = [Path(root) for root in roots]
    for root in roots:
        if not root.is_dir():
            raise ReportError(f"{root} is not a folder; pass the folder that holds the run folders (e.g. runs)")
    runs = load_runs(*roots)
    if not runs:
        raise ReportError(f"no runs found under {', '.join(map(str, roots))} (a run folder holds config.json, "
                          "or metrics.jsonl and status.json)")
    heat = pick_heatmap_run(runs, heatmap_run)
    summaries = sorted((summarize(r) for r in runs),
                       key=lambda s: (s.arm, s.depth, summary_arm(s).sort_key(), s.seed or 0, s.name))
    rows = aggregate(summaries)
    verdict_lines = verdict(rows) + [reference_verdict(rows)]
    out = Path(out) if out is not None else default_out(roots)
    out.mkdir(parents=True, exist_ok=True)
    for name in PLOT_NAMES:             # an earlier report's plot would contradict this results.md
        (out / name).unlink(missing_ok=True)
    plots, notes = write_plots(runs, heat, out) if with_plots else ([], ["plots skipped (--no-plots)."])
    (out / "results.md").write_text(results_markdown(roots, rows, summaries, verdict_lines, plots, notes))
    write_csv(out / "results.csv", csv_rows(rows))
    write_csv(out / "runs.csv", run_csv_rows(summaries))
    buf = io.StringIO()
    print(*headline(rows), "", markdown(main_columns(), rows), "", markdown(gain_columns(), rows),
          *matrix_notes(summaries), "", "\n\n".join(verdict_lines), *notes, sep="\n", file=buf)
    names = ", ".join(["results.csv", "runs.csv", *(p.name for p in plots)])
    print(f"\nwrote {out / 'results.md'}, {names}", file=buf)
    return rows, buf.getvalue()


def default_out(roots):
    """RUNS_DIR/report; for several folders, report/ in the one that holds them all (all/ for all/node0, all/node1)."""
    if len(roots) == 1:
        return roots[0] / "report"
    return Path(os.path.commonpath([os.path.abspath(root) for root in roots])) / "report"


def main(argv=None) -> int:
    """The command line; returns the exit code (0 ok, 2 no runs or bad arguments, 1 write error)."""
    try:
        args = parse_args(argv)
    except SystemExit as e:          # argparse already printed the usage error (or --help)
        return e.code if isinstance(e.code, int) else 2
    try:
        if args.watch:
            if len(args.runs_dirs) != 1:
                raise ReportError("--watch reads one matrix folder (its matrix.log); pass one RUNS_DIR")
            print(watch_view(args.runs_dirs[0], args.stale_after))
            return 0
        _, text = report(args.runs_dirs, args.out, args.heatmap_run, with_plots=not args.no_plots)
    except ReportError as e:
        print(f"report: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"report: cannot write the report: {e}", file=sys.stderr)
        return 1
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())

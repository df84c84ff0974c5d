"""One summary per run, then one row per arm x depth: mean and sample std over seeds of every reported figure."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field

import numpy as np

from hcstudy.contract import STUDY_TRAIN_KEY
from hcstudy.report.runs import SCALAR_KEYS, STREAM_KEYS, Arm, load_runs, settings

THRESHOLDS = (10.0, 100.0, 1000.0)      # composite gain levels whose first crossing step is reported
FLAT = 0.05                     # the verdict calls gains within 1 ± FLAT "stayed within", else peaks


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
    # the stream readings (STREAM_KEYS) at the run's last probe: how the trained model ended, not a peak
    stream_dominance: float
    stream_dominance_mean: float
    effective_streams: float
    effective_streams_min: float
    effective_rank: float
    effective_rank_min: float
    res_to_identity: float
    res_to_identity_mean: float
    composite_to_uniform: float
    composite_to_permutation: float
    state_detail: str = ""       # what is known of a run that status.json calls running but is not (runs.stopped_state)

    @property
    def peak_gain(self):
        """The larger of the peak forward and backward composite gains (NaN only when neither was logged)."""
        return float(np.fmax(self.peak_fwd, self.peak_bwd))


def peak_of(values):
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
        state=str(run.status.get("state", "unknown")), state_detail=run.state_detail,
        step=None if step is None else int(step),
        final_loss=_last(s["loss"][1]),
        best_val=float(np.nanmin(val)) if np.isfinite(val).any() else math.nan,
        final_val=_last(val),
        peak_fwd=peak_of(fwd), peak_bwd=peak_of(bwd),
        peak_l0_fwd=peak_of(s["amax_l0_fwd"][1]), peak_l0_bwd=peak_of(s["amax_l0_bwd"][1]),
        peak_abs=peak_of(np.concatenate([s["amax_fwd_abs"][1], s["amax_bwd_abs"][1]])),
        peak_study=peak_of(s["amax_study"][1]), peak_study_train=peak_of(s[STUDY_TRAIN_KEY][1]),
        peak_converged=peak_of(np.concatenate([s["amax_fwd_converged"][1], s["amax_bwd_converged"][1]])),
        converged_err=peak_of(s["sinkhorn_converged_err"][1]), peak_col_err=peak_of(s["sinkhorn_col_err"][1]),
        peak_bwd_bound=peak_of(s["sinkhorn_bwd_bound"][1]),
        arm=run.preset, sinkhorn_iters=run.sinkhorn_iters, coefficients=run.coefficients,
        data_seed=settings(run.config).get("data_seed"),
        precision=json.dumps(run.config.get("precision"), sort_keys=True) if run.config.get("precision")
        else "unrecorded",
        max_dev=peak_of(dev),
        first_above={t: first_above_either(s["amax_fwd"], s["amax_bwd"], t) for t in THRESHOLDS},
        peak_grad_norm=peak_of(s["grad_norm"][1]),
        clip_share=float(clipped.mean()) if clipped.size else math.nan,
        tokens=run.tokens, wall_s=run.wall_s, n_gpus=n_gpus, gpu_hours=run.wall_s / 3600 * n_gpus,
        has_probe=fwd.size > 0, has_layers=len(run.layers["layer_gain_fwd"]) > 0,
        **{k: _last(s[k][1]) for k in STREAM_KEYS})


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
    "clip_share": True, "tokens": True, **dict.fromkeys(STREAM_KEYS, False)}


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

"""The report's figures: matplotlib's object API on the Agg canvas (no pyplot, no global state); matplotlib is
imported only when plotting."""
from __future__ import annotations

import itertools
import math
import warnings
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from hcstudy import arms
from hcstudy.contract import ARM_DEFAULTS
from hcstudy.report.aggregate import THRESHOLDS, peak_of, summary_arm
from hcstudy.report.published import PUBLISHED
from hcstudy.report.runs import LAYER_KEYS, METHOD_LABEL, STREAM_LAYER_KEYS, Arm, ReportError, settings
from hcstudy.report.tables import seeds_text

# One line width for all, and a marker shape each at staggered points: baseline and mHC coincide at a gain of 1
# and their losses lie within 1 %, so neither colour nor width alone keeps both lines visible.
METHOD_STYLE = {name: arm.style for name, arm in arms.ARMS.items()}        # each arm's declaration
LINE_WIDTH, MARKS = 1.5, 8      # markers per line
# a method's further arms (other coefficients, iterations or preset) take these colours in turn, dashed when
# their coefficients are per sequence
ARM_COLORS = ("tab:orange", "tab:cyan", "tab:brown", "tab:pink", "tab:olive", "tab:gray", "gold", "navy", "lime")


PLOT_POINTS = 400               # gain curves with more logged steps are averaged over windows down to this many
LOSS_POINTS = 60                # step-to-step noise of the loss hides a 1 % gap: averaged down to this many points
GRAD_POINTS = 60                # the gradient norm too, whose spikes would otherwise crowd the methods apart


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


def group_runs(runs, looks=None):
    """{depth: {Look: [runs]}}, one Look per arm, in display order; `looks` (arm_looks of every run) keeps a subset's
    colours those of the other figures."""
    looks, out = looks or arm_looks({r.arm for r in runs}), {}
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
    """One arm's line of `key` over the steps (draw_curves), with an X where a run diverged."""
    plotted = draw_curves(ax, look, [r.series[key].arrays() for r in runs], window, geometric, envelope)
    if plotted:
        mark_diverged(ax, look, runs, key)
    return plotted


def draw_curves(ax, look, curves, window=1, geometric=False, envelope=False, label=None, every_point=False):
    """One arm's mean line over its seeds' curves ((x, values) each) with the seed min–max band, or with a thin
    line through the largest value of each bin (`envelope`, for spikes); `every_point` marks each point, not a
    staggered few. Returns the plotted arrays (for axis scaling)."""
    band = bin_curves(curves, window, geometric)
    if band is None or not np.isfinite(band.line).any():
        return []
    ok = np.isfinite(band.line)
    style = line_style(look, int(ok.sum())) | ({"markevery": 1} if every_point else {})
    ax.plot(band.x[ok], band.line[ok], label=label or f"{look.label} ({seeds_text(len(curves))})", **style)
    if envelope:
        ax.plot(band.x[ok], band.full_hi[ok], color=style["color"], lw=0.7, alpha=0.75, zorder=1)
        return [band.line[ok], band.full_lo[ok], band.full_hi[ok]]
    plotted = [band.line[ok], band.seed_lo[ok], band.seed_hi[ok]]
    if len(curves) > 1:
        ax.fill_between(band.x[ok], plotted[1], plotted[2], color=style["color"], alpha=0.18, lw=0,
                        zorder=style["zorder"] - 1)
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
    finish_panel(ax, plotted, f"{title} ({window_words(window)})", "step", legend_outside)
    return plotted


def finish_panel(ax, plotted, title, xlabel, legend_outside=False):
    """Title, x label, grid and legend of a panel; 'no data' on a panel with nothing plotted."""
    ax.set_title(title, fontsize=10)
    ax.set_xlabel(xlabel)
    ax.grid(True, which="major", alpha=0.3)
    if plotted and legend_outside:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    elif plotted:
        ax.legend(fontsize=8, loc="best")
    else:
        ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", color="0.5")


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
        draw_level(ax, y, text)


def draw_level(ax, y, text, color="0.45", text_color="0.35"):
    """A dotted horizontal line at y, named at the left edge of the axis."""
    ax.axhline(y, color=color, lw=0.8, ls=":", zorder=1)
    ax.annotate(text, (0.005, y), xycoords=("axes fraction", "data"), fontsize=8, color=text_color, va="bottom")


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


STREAM_PANELS = (("layer_stream_dominance", "stream dominance", "largest stream's energy share (1/n to 1)"),
                 ("layer_effective_streams", "effective streams", "exp(entropy of the shares) (1 to n)"),
                 ("layer_effective_rank", "effective rank", "effective rank of the streams (1 to n)"),
                 ("layer_res_to_identity", "H_res to I", "distance of H_res from I (J/n at 1)"))


def has_lists(run, keys):
    return any(len(run.layers[k]) for k in keys)


def last_list(run, key):
    """(sublayer index, value) of the run's last `key` list (its final checkpoint's), or None when it logged none."""
    series = run.layers[key]
    if not len(series):
        return None
    return np.arange(series.values[-1].size), series.values[-1].astype(np.float64)


def plot_streams(runs, path):
    """The stream readings per sublayer at each run's last layer-metric line: a row of panels per depth, a line per
    arm (mean over seeds, band = seed min–max)."""
    looks = arm_looks({r.arm for r in runs})         # the colours of the other figures, whichever runs have lists
    groups = group_runs([r for r in runs if has_lists(r, STREAM_LAYER_KEYS)], looks)
    fig, axes = new_figure(len(groups), len(STREAM_PANELS), width=4.8)
    for (depth, by_method), row in zip(groups.items(), axes):
        for ax, (key, title, ylabel) in zip(row, STREAM_PANELS):
            plotted = []
            for look, arm_runs in by_method.items():
                plotted += draw_curves(ax, look, [c for r in arm_runs if (c := last_list(r, key)) is not None])
            finish_panel(ax, plotted, f"depth {depth}: {title}", "sublayer k (even: attention, odd: MLP)")
            ax.set_ylabel(ylabel, fontsize=9)
    fig.suptitle("The streams per sublayer at each run's last layer-metric step: line = mean over seeds, "
                 "band = seed min–max", fontsize=11)
    return save(fig, path)


# large and hollow, shapes no arm of ours draws: a published figure is never read as one of our points
PUBLISHED_MARKERS = ("p", "*", "<", ">", "h", "8")


def plot_depth_trend(summaries, path):
    """Peak composite gain against model depth: per arm the mean over seeds at each depth with the seeds' min–max
    band, beside the published figures."""
    looks, by_arm = arm_looks({summary_arm(s) for s in summaries}), {}
    for s in sorted((s for s in summaries if math.isfinite(s.peak_gain)), key=lambda s: s.depth):
        by_arm.setdefault(looks[summary_arm(s)], []).append((np.array([s.depth]), np.array([s.peak_gain])))
    fig, ((ax,),) = new_figure(1, 1, height=5.0, width=11.0)
    plotted = []
    for look in sorted(by_arm, key=lambda look: look.index):
        points = by_arm[look]
        plotted += draw_curves(ax, look, points, label=f"{look.label}, ours ({len(points)} runs)", every_point=True)
    draw_published(ax)
    ax.set_yscale("log")
    ax.set_xticks(sorted({s.depth for s in summaries} | {p.depth for p in PUBLISHED if p.depth}))
    finish_panel(ax, plotted, "ours beside the published figures", "model depth (layers)", legend_outside=True)
    ax.set_ylabel("peak composite gain (×)")
    fig.suptitle("Peak composite gain against model depth. Ours: per run the larger of peak amax_fwd and amax_bwd "
                 "(per token);\nline = mean over seeds, band = seed min–max. Published (large hollow shapes): the "
                 "public study's own reading\n(H averaged over its batch, on its own model), not our per-token one; "
                 "dotted lines: the mHC paper's 27B model.", fontsize=10)
    return save(fig, path)


def draw_published(ax):
    """The published figures: those of a depth as large hollow markers (± the spread over seeds where published),
    the mHC paper's (27B, no depth of ours) as dotted lines named at the left edge."""
    shapes = itertools.cycle(PUBLISHED_MARKERS)
    for p in PUBLISHED:
        color, label = METHOD_STYLE[p.method]["color"], f"{p.source}: {METHOD_LABEL[p.method]} {p.figure}"
        if p.depth is None:
            draw_level(ax, p.value, f"{label} (no depth of ours)", color, color)
            continue
        ax.errorbar(p.depth, p.value, yerr=p.spread or None, ls="none", marker=next(shapes), ms=11, mfc="none",
                    mec=color, mew=1.4, ecolor=color, capsize=4, zorder=6, label=f"published: {label}")


def pick_heatmap_run(runs, name=None):
    """The named run, else the HC run with the largest peak amax_fwd that has layer lists,
    else any run with layer lists (largest peak first); None when no run has them."""
    if name is not None:
        match = [r for r in runs if name in (r.name, settings(r.config).get("run_name"))]
        if not match:
            raise ReportError(f"--heatmap-run {name}: no such run (have: {', '.join(r.name for r in runs)})")
        return match[0]
    with_layers = [r for r in runs if has_lists(r, LAYER_KEYS)]

    def peak(r):
        p = peak_of(r.series["amax_fwd"].arrays()[1])
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


PLOT_NAMES = ("amax.png", "loss.png", "grad_norm.png", "layer_gains.png", "streams.png", "depth_trend.png")


def write_plots(runs, summaries, heat, out):
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
    elif not has_lists(heat, LAYER_KEYS):
        notes.append(f"layer_gains.png not written: run {heat.name} has no layer_gain lists.")
    else:
        written.append(plot_heatmap(heat, out / "layer_gains.png"))
    if any(has_lists(r, STREAM_LAYER_KEYS) for r in runs):
        written.append(plot_streams(runs, out / "streams.png"))
    else:
        notes.append("streams.png not written: no run logged the per-sublayer stream lists (layer_stream_dominance, "
                     "...) yet.")
    depths = sorted({s.depth for s in summaries if math.isfinite(s.peak_gain)})
    if len(depths) > 1:
        written.append(plot_depth_trend(summaries, out / "depth_trend.png"))
    else:
        notes.append(f"depth_trend.png not written: it needs peak gains at two model depths or more; these runs have "
                     f"them at {', '.join(f'depth {d}' for d in depths) or 'none'}.")
    return written, notes

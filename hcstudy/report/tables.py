"""results.md's and the terminal's tables (markdown), and results.csv / runs.csv for machines."""
from __future__ import annotations

import csv
import math

from hcstudy.report.aggregate import THRESHOLDS
from hcstudy.report.runs import GAP_S, STREAM_KEYS


def fmt_gain(x, ref=None):
    """Gains, gradient norms and the stream readings: 3,721 / 412 / 12.3 / 1.000; decimals follow `ref` when given
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


def stream_columns():
    """(header, cell(row) -> str) for the streams table: each run's last probe, mean ± std over seeds."""
    def st(name):
        return lambda row: fmt_stat(row.stats[name], fmt_gain, len(row.runs))
    return [
        ("method", lambda row: row.label), ("depth", lambda row: str(row.depth)),
        ("stream dominance (max over sublayers)", st("stream_dominance")),
        ("effective streams", st("effective_streams")), ("effective rank", st("effective_rank")),
        ("H_res to I (max over sublayers)", st("res_to_identity")),
        ("composite to J/n", st("composite_to_uniform")),
        ("composite to permutation", st("composite_to_permutation")),
    ]


STREAM_NOTES = """- The n streams at each run's last probe (a finished run's trained model), mean ± sample std over seeds;
  – = not logged (the baseline has no streams; runs from before the trainer logged these readings have none).
  **Stream dominance**: the largest stream's share of the state's energy (token mean), at the sublayer where it is
  largest (every reading over sublayers leaves out the first, whose input is the embedding copied n times): 1/n = shared evenly, 1 = one stream holds everything. **Effective streams** (exp of the entropy of those
  shares, mean over sublayers): n = even shares, 1 = one stream. **Effective rank** (of a token's n streams, mean
  over sublayers): n = independent streams, 1 = copies of one vector.
- **H_res to I**: the farthest any sublayer's H_res lies from the identity, scaled so that J/n (every entry 1/n,
  the streams averaged into one) lies at 1; 0 = the streams pass through unmixed. **Composite to J/n** and
  **composite to permutation**: the product of every H_res over the full depth, on the same scale, where J/n and
  the permutations lie 1 apart, scaled to absolute entries summing to n (its shape; the gains give its size): near 0
  to J/n, the depth averaged the streams into one; near 0 to a permutation, it kept them apart (only reordered).
  HC's composite, with negative entries, can lie beyond 1 of both."""


def stream_block(rows):
    """results.md's streams section: the table and how to read it, or one line when no run logged the readings."""
    if not any(row.stats[key].n for row in rows for key in STREAM_KEYS):
        return ["No run here logged the stream readings (the baseline has no streams; runs from before the trainer "
                "logged them have none)."]
    return [markdown(stream_columns(), rows), "", STREAM_NOTES]


def run_columns():
    """(header, cell(summary) -> str) for the per-run table."""
    return [
        ("run", lambda r: r.name), ("state", lambda r: r.state_detail or r.state), ("step", lambda r: fmt_step(r.step)),
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


def seeds_text(n):
    return f"{n} seed{'s' if n != 1 else ''}"


def fmt_dev(x, ref=None):
    """A small deviation from 1 with two significant digits: 0.0012, 3.4e-07, 0 (a std too: fmt_stat's `ref`)."""
    return "0" if x == 0 else f"{x:.2g}"

"""The precision study: fp32 against bf16 residual streams, arm by arm, decided reading by reading against margins
fixed before the runs.

    bash benchmarks/precision_runs.sh runs/precision           # the runs: runs/precision/{fp32,bf16}
    python benchmarks/precision_study.py runs/precision/fp32 runs/precision/bf16 --plot docs/precision_study.png

The two dtypes are paired by seed: a seed gives both the same initial weights and the same batches, so the
difference bf16 - fp32 of one seed is rounding alone. For every arm x depth and reading: the mean of those paired
differences and its 90 % t-interval over the seeds (a two one-sided test at 5 % each side), then
  equivalent  the interval lies inside the reading's margin (+-m),
  different   the interval lies wholly outside it (the shift is surely larger than the margin),
  undecided   otherwise (too few seeds, or a shift near the margin).
Relative margins compare log(bf16 / fp32) with log(1 + m). The plot draws each arm's loss and amax_fwd / amax_bwd
curves, fp32 solid, bf16 dashed.
"""
import argparse
import math
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hcstudy.report.aggregate import collect                      # noqa: E402
from hcstudy.report.runs import load_runs                          # noqa: E402

# The margins, set before the runs (docs/benchmarks.md gives the reasons): (size, "abs" or "rel"), per reading, for
# every arm unless an arm is named. A reading inside its margin changes no conclusion the study draws from it.
MARGINS = {
    "final_val": (0.01, "abs"),            # nats: a third of the smallest gap between arms the pilot saw
    "final_loss": (0.01, "abs"),
    "peak_fwd": (0.10, "rel"),             # HC's gains span decades: a tenth of the value
    "peak_bwd": (0.10, "rel"),
    "peak_study": (0.10, "rel"),
    "stream_dominance": (0.05, "abs"),      # shares and distances between 0 and 1, ranks between 1 and n
    "effective_rank": (0.05, "abs"),
    "res_to_identity": (0.05, "abs"),
    "composite_to_uniform": (0.05, "abs"),
}
# The mHC family's gains sit at 1 (exactly for identity-HC, mHC-lite and KromHC, within Sinkhorn's truncation for
# mHC and the study's mHC): what bf16 may move there is set in absolute terms, and the converged projection's gain
# to 1e-4. The study's HC is HC's kind: its gains take HC's relative margins. (The study's arms were added after the
# first runs; their margins follow the same rule and were written before their runs were read.)
MHC_FAMILY = ("mHC", "mHC-lite", "identity-HC", "KromHC", "study's mHC")
ARM_MARGINS = ({(label, reading): (0.01, "abs") for label in MHC_FAMILY for reading in ("peak_fwd", "peak_bwd",
                                                                                          "peak_study")}
               | {(label, "peak_converged"): (1e-4, "abs") for label in ("mHC", "study's mHC")})
READINGS = ("final_val", "final_loss", "peak_fwd", "peak_bwd", "peak_study", "peak_converged", "stream_dominance",
            "effective_rank", "res_to_identity", "composite_to_uniform")
CURVES = ("loss", "amax_fwd", "amax_bwd")
# Student's t at 0.95 (one-sided) by degrees of freedom: the 90 % two-sided interval, what a TOST at 5 % uses
T95 = {1: 6.314, 2: 2.920, 3: 2.353, 4: 2.132, 5: 2.015, 6: 1.943, 7: 1.895, 8: 1.860, 9: 1.833, 10: 1.812,
       12: 1.782, 15: 1.753, 20: 1.725, 30: 1.697}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("fp32", type=Path, help="the runs folder of the fp32-stream runs")
    p.add_argument("bf16", type=Path, help="the runs folder of the bf16-stream runs (the same arms, depths, seeds)")
    p.add_argument("--plot", type=Path, help="write the curves' figure here (PNG)")
    return p.parse_args(argv)


def seed_values(row, reading) -> dict:
    """{seed: value} of one reading of the completed runs (a running one's last value is not its final), finite
    values only."""
    return {run.seed: getattr(run, reading) for run in row.runs
            if run.state == "completed" and np.isfinite(getattr(run, reading))}


def margin_of(label, reading):
    return ARM_MARGINS.get((label, reading)) or MARGINS.get(reading)


def compare(fp32_rows, bf16_rows):
    """(arm label, depth, reading, fp32 values, bf16 values) of the seeds both dtypes logged, in seed order, for each
    reading with a margin for that arm."""
    bf16 = {(row.label, row.depth): row for row in bf16_rows}
    for row in fp32_rows:
        other = bf16.get((row.label, row.depth))
        for reading in READINGS if other else ():
            a, b = seed_values(row, reading), seed_values(other, reading)
            seeds = sorted(set(a) & set(b))
            if seeds and margin_of(row.label, reading):
                yield row.label, row.depth, reading, np.array([a[s] for s in seeds]), np.array([b[s] for s in seeds])


def t_quantile(df: int) -> float:
    return T95[max(d for d in T95 if d <= df)]          # the next smaller tabled df: a slightly wider interval


def interval(a, b, kind):
    """The paired differences' mean and 90 % t-interval: bf16 - fp32, or log(bf16 / fp32) for a relative margin.
    None with one seed (no spread to set the mean against)."""
    d = np.log(b / a) if kind == "rel" else b - a
    if d.size < 2:
        return d.mean(), None
    half = t_quantile(d.size - 1) * d.std(ddof=1) / math.sqrt(d.size)
    return d.mean(), (d.mean() - half, d.mean() + half)


def verdict(a, b, margin) -> tuple[str, float, tuple | None]:
    size, kind = margin
    bound = math.log1p(size) if kind == "rel" else size
    mean, ci = interval(a, b, kind)
    if ci is None:
        return "undecided", mean, ci
    if -bound < ci[0] and ci[1] < bound:
        return "equivalent", mean, ci
    if ci[0] > bound or ci[1] < -bound:
        return "different", mean, ci
    return "undecided", mean, ci


def shown(value, kind):
    """A difference as the table shows it: relative ones as a percentage of fp32's value."""
    return f"{math.expm1(value) * 100:+.2g} %" if kind == "rel" else f"{value:+.3g}"


def table(comparisons) -> list[str]:
    lines = ["| arm | depth | reading | seeds | fp32 mean | bf16 mean | bf16 - fp32 (90 % interval) | margin | verdict |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, depth, reading, a, b in comparisons:
        margin = margin_of(label, reading)
        result, mean, ci = verdict(a, b, margin)
        spread = "" if ci is None else f" ({shown(ci[0], margin[1])} to {shown(ci[1], margin[1])})"
        bound = f"+-{margin[0] * 100:g} %" if margin[1] == "rel" else f"+-{margin[0]:g}"
        lines.append(f"| {label} | {depth} | {reading} | {a.size} | {a.mean():.4g} | {b.mean():.4g} | "
                     f"{shown(mean, margin[1])}{spread} | {bound} | {'**' + result + '**' if result != 'equivalent' else result} |")
    return lines


def plot(fp32_dir, bf16_dir, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    runs = {dtype: load_runs(folder) for dtype, folder in (("fp32", fp32_dir), ("bf16", bf16_dir))}
    labels = sorted({run.arm.label() for run in runs["fp32"]})
    fig, axes = plt.subplots(len(CURVES), len(labels), figsize=(4.2 * len(labels), 3.0 * len(CURVES)), squeeze=False)
    for column, label in enumerate(labels):
        for ax, key in zip(axes[:, column], CURVES):
            for (dtype, dtype_runs), style in zip(runs.items(), ("-", "--")):
                for run in (r for r in dtype_runs if r.arm.label() == label):
                    steps, values = run.series[key].arrays()
                    ax.plot(steps, values, style, lw=1, label=f"{dtype} s{run.seed}")
            ax.set_title(f"{label}: {key}", fontsize=10)
            ax.set_xlabel("step")
            ax.legend(fontsize=7)
            low, high = ax.get_ylim()
            if key != "loss" and low > 0 and high / low > 10:   # HC's gains span decades; mHC's and the baseline's not
                ax.set_yscale("log")
    fig.suptitle("fp32 (solid) against bf16 (dashed) residual streams, every seed", fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path


def main(argv=None) -> int:
    args = parse_args(argv)
    comparisons = list(compare(collect(args.fp32), collect(args.bf16)))
    if not comparisons:
        print(f"precision_study.py: no arm of {args.fp32} has a match in {args.bf16}", file=sys.stderr)
        return 1
    print("\n".join(table(comparisons)))
    verdicts = [(c, verdict(c[3], c[4], margin_of(c[0], c[2]))[0]) for c in comparisons]
    counts = {name: sum(v == name for _, v in verdicts) for name in ("equivalent", "different", "undecided")}
    print("\n" + ", ".join(f"{count} {name}" for name, count in counts.items()) + f" of {len(verdicts)} readings")
    for name in ("different", "undecided"):
        named = [f"{label} {reading}" for (label, _, reading, *_), v in verdicts if v == name]
        if named:
            print(f"{name}: {', '.join(named)}")
    print("bf16 streams can be the default" if counts["equivalent"] == len(verdicts) else
          "fp32 streams stay the default: not every reading is equivalent")
    if args.plot:
        print(f"plot: {plot(args.fp32, args.bf16, args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

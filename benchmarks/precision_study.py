"""The precision study: fp32 against bf16 residual streams, arm by arm, each difference set against the seeds' spread.

    bash run_experiments.sh --demo --seed 42,123 --out runs/precision/fp32 -- --stream-dtype fp32
    bash run_experiments.sh --demo --seed 42,123 --out runs/precision/bf16 -- --stream-dtype bf16
    python benchmarks/precision_study.py runs/precision/fp32 runs/precision/bf16 --plot docs/precision_study.png

For every arm x depth and reading: each dtype's mean over seeds and its seed range (largest minus smallest), the
difference of the two means, and "beyond" where that difference exceeds the larger of the two seed ranges: a change
the seeds alone do not make. The plot draws each arm's loss and amax_fwd / amax_bwd curves, fp32 solid, bf16 dashed.
"""
import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from hcstudy.report.aggregate import collect                      # noqa: E402
from hcstudy.report.runs import load_runs                          # noqa: E402

READINGS = ("final_val", "final_loss", "peak_fwd", "peak_bwd", "peak_study", "peak_converged", "stream_dominance",
            "effective_rank", "res_to_identity", "composite_to_uniform")
CURVES = ("loss", "amax_fwd", "amax_bwd")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("fp32", type=Path, help="the runs folder of the fp32-stream runs")
    p.add_argument("bf16", type=Path, help="the runs folder of the bf16-stream runs (the same arms, depths, seeds)")
    p.add_argument("--plot", type=Path, help="write the curves' figure here (PNG)")
    return p.parse_args(argv)


def seed_values(row, reading):
    values = np.array([getattr(run, reading) for run in row.runs], dtype=np.float64)
    return values[np.isfinite(values)]


def compare(fp32_rows, bf16_rows):
    """(arm label, depth, reading, fp32 values, bf16 values) for each reading both dtypes logged."""
    bf16 = {(row.label, row.depth): row for row in bf16_rows}
    for row in fp32_rows:
        other = bf16.get((row.label, row.depth))
        for reading in READINGS if other else ():
            a, b = seed_values(row, reading), seed_values(other, reading)
            if a.size and b.size:
                yield row.label, row.depth, reading, a, b


def beyond_spread(a, b):
    """Whether the means differ by more than the larger seed range; None with one seed (no spread to set against)."""
    return None if min(a.size, b.size) < 2 else bool(abs(b.mean() - a.mean()) > max(np.ptp(a), np.ptp(b)))


def table(comparisons) -> list[str]:
    lines = ["| arm | depth | reading | fp32 mean (seed range) | bf16 mean (seed range) | bf16 - fp32 | beyond the "
             "seeds' spread |", "|---|---|---|---|---|---|---|"]
    for label, depth, reading, a, b in comparisons:
        beyond = {None: "n/a (1 seed)", True: "**yes**", False: "no"}[beyond_spread(a, b)]
        lines.append(f"| {label} | {depth} | {reading} | {a.mean():.4g} ({np.ptp(a):.2g}) | {b.mean():.4g} "
                     f"({np.ptp(b):.2g}) | {b.mean() - a.mean():+.3g} | {beyond} |")
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
    beyond = [c for c in comparisons if beyond_spread(c[3], c[4])]
    print(f"\n{len(beyond)} of {len(comparisons)} readings differ by more than the seeds' spread"
          + (": " + ", ".join(f"{label} {reading}" for label, _, reading, *_ in beyond) if beyond else ""))
    if args.plot:
        print(f"plot: {plot(args.fp32, args.bf16, args.plot)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

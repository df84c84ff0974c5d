"""report.py's command line: read every run folder, aggregate, write results.md, the CSV files and the plots, print
the table and the verdict. Exit 0 on success, 2 when no runs are found, a run is found twice or the arguments are
wrong, 1 on a write error."""
from __future__ import annotations

import argparse
import io
import os
import sys
import time
from pathlib import Path

from hcstudy.report.aggregate import aggregate, summarize, summary_arm
from hcstudy.report.live import watch_view
from hcstudy.report.plots import PLOT_NAMES, pick_heatmap_run, write_plots
from hcstudy.report.published import reference_block, reference_verdict
from hcstudy.report.runs import STALE_AFTER_MIN, ReportError, load_runs
from hcstudy.report.tables import (GAIN_NOTES, TABLE_NOTES, csv_rows, gain_columns, main_columns, markdown, run_columns,
                                   run_csv_rows, stream_block, table_columns, write_csv)
from hcstudy.report.verdict import headline, verdict


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
    p.add_argument("--stale-after", type=float, default=STALE_AFTER_MIN, metavar="MIN",
                   help="a run whose status.json says running but has not moved for MIN minutes: on another host "
                        "(where its lock cannot be read) it reads 'stale (killed?)', not running; on this one a "
                        "live lock keeps it running, flagged STALE in --watch")
    return p.parse_args(argv)


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
             "## Streams", "", *stream_block(rows), "",
             "## Full table", "", markdown(table_columns(), rows), "", TABLE_NOTES, *matrix_notes(summaries), "",
             "## Runs", "", markdown(run_columns(), summaries), "", "## Plots", ""]
    parts += [f"![{p.stem}]({p.name})" for p in plots] + [f"- {note}" for note in notes]
    return "\n".join(parts) + "\n"


def report(roots, out=None, heatmap_run=None, with_plots=True, stale_after_min=STALE_AFTER_MIN):
    """Everything main does after parsing the arguments; raises ReportError for expected problems."""
    roots = [Path(root) for root in roots]
    for root in roots:
        if not root.is_dir():
            raise ReportError(f"{root} is not a folder; pass the folder that holds the run folders (e.g. runs)")
    runs = load_runs(*roots, stale_after_min=stale_after_min)
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
    plots, notes = write_plots(runs, summaries, heat, out) if with_plots else ([], ["plots skipped (--no-plots)."])
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
        _, text = report(args.runs_dirs, args.out, args.heatmap_run, with_plots=not args.no_plots,
                         stale_after_min=args.stale_after)
    except ReportError as e:
        print(f"report: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"report: cannot write the report: {e}", file=sys.stderr)
        return 1
    print(text, end="")
    return 0

#!/usr/bin/env python3
"""Results table, verdict and plots for a matrix of train_c4.py runs.

    python report.py [RUNS_DIR ...] [--report-dir RUNS_DIR/report] [--heatmap-run NAME] [--no-plots] [--watch]

Reads every run folder under each RUNS_DIR and writes RUNS_DIR/report/: results.md, results.csv, runs.csv and
the plots (`--help` says every option). The work is hcstudy.report's.
"""
import sys

from hcstudy.report.command import main

if __name__ == "__main__":
    sys.exit(main())

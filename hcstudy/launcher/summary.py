"""--summary and the end-of-matrix report: the matrix view and report.py's table."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from hcstudy import ROOT
from hcstudy.contract import EXIT_OK
from hcstudy.launcher.jobs import log_name
from hcstudy.launcher.options import EXIT_USAGE, PROG, warn


def show_matrix(opt, whole=False):
    """The matrix view (report.py --watch) from this launcher's matrix log, or (whole) from every node's, and
    the runs' status.json."""
    from hcstudy.report.live import watch_view  # numpy: only for the view
    from hcstudy.report.runs import ReportError
    try:
        print(watch_view(opt.out, log=None if whole else log_name(opt)), flush=True)
    except (ReportError, OSError) as error:
        print(f"report: {error}", flush=True)


def print_report(opt):
    script = Path(os.environ.get("RUN_EXPERIMENTS_REPORT") or ROOT / "report.py")
    print(flush=True)
    if not script.is_file():
        print(f"No results table: {script} does not exist yet. Raw results: {opt.out}/*/metrics.jsonl, "
              f"{opt.out}/*/status.json", flush=True)
        return
    print(f"Results ({sys.executable} {script} {opt.out}):", flush=True)
    code = subprocess.run([sys.executable, str(script), str(opt.out)]).returncode
    if code:
        warn(f"{script} exited {code}; the runs themselves are not affected")
    plots = sorted(p for pattern in ("*.png", "*/*.png", "*.pdf", "*/*.pdf", "*.svg", "*/*.svg")
                   for p in opt.out.glob(pattern))
    if plots:
        print(f"Plots ({len(plots)}):", *(f"  {p}" for p in plots), sep="\n")
        if (opt.out / "report" / "results.md").is_file():
            print(f"Table, verdict and plots together: {opt.out / 'report' / 'results.md'}")
    else:
        print(f"No plot files found under {opt.out} (report.py writes them; see its output above).")


def summary(opt):
    if not any(opt.out.glob("matrix*.log")) and not any(opt.out.glob("*/status.json")):
        print(f"{PROG}: error: --summary: no matrix has run in '{opt.out}' (no matrix.log, no run folder); "
              "check --out", file=sys.stderr)
        return EXIT_USAGE
    show_matrix(opt, whole=True)    # the matrix as the folder's launchers ran it, not as these flags make it
    print_report(opt)
    return EXIT_OK

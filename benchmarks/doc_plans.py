"""docs/planning.md's printed plans, regenerated from the commands they show, so that they cannot drift from
the planner.

    python benchmarks/doc_plans.py            # rewrite every block between <!-- doc_plans NAME --> markers
    python benchmarks/doc_plans.py --check    # exit 1 and name the stale blocks (tests/project/test_readme.py runs it)

Each marked block is a fenced block of `$ command` lines, each followed by its output. The commands run as a user
would run them on a machine without a GPU (no CUDA device, no nvidia-smi), in a temporary folder, so that
neither the machine nor the runs of this checkout change what is printed. The calibrated demo plan is a
measurement, not a plan: it stays as measured and has no marker.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "planning.md"
BLOCK = re.compile(r"(<!-- doc_plans (?P<name>[\w-]+) -->\n```\n)(?P<body>.*?)(```\n<!-- /doc_plans -->)", re.S)
# the --full dry run lists 18 jobs and a command line for each: the doc keeps these three, the header and the totals
DRY_RUN_JOBS = ("baseline_d48_s42 ", "hc_d48_s42 ", "mhc_d32_s456 ")
DRY_RUN_TOTALS = ("Plan (", "Step times", "Each time", "Wall time:", "Cost")


def run(command: list[str], folder: Path) -> str:
    """A command's stdout and stderr as a user sees them, on a machine without a GPU."""
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "RUN_EXPERIMENTS_NVIDIA_SMI": "false",
           "RUN_EXPERIMENTS_PYTHON": sys.executable}
    for knob in [k for k in env if k.startswith(("RUN_EXPERIMENTS_TRAINER", "RUN_EXPERIMENTS_PROBE"))]:
        del env[knob]
    done = subprocess.run(command, cwd=folder, env=env, capture_output=True, text=True, timeout=900)
    return done.stdout + done.stderr


def estimates(folder: Path) -> str:
    """Both depths' estimates, less the line of this CPU's time: timed on the machine, it is not the same twice."""
    text = ""
    for depth in (32, 48):
        shown = ["--estimate", "--depth", str(depth), "--micro-batch-size", "8"]
        text += ("\n" if text else "") + f"$ python train_c4.py {' '.join(shown)}      (this CPU's line left out)\n"
        text += "".join(line for line in run([sys.executable, str(ROOT / "train_c4.py"), *shown], folder)
                        .splitlines(keepends=True) if not line.startswith("  the run on this CPU"))
    return text


def dry_run(folder: Path) -> str:
    lines = run(["bash", str(ROOT / "run_experiments.sh"), "--dry-run"], folder).splitlines()
    kept = [line for line in lines if line.startswith(DRY_RUN_JOBS + DRY_RUN_TOTALS)]
    return "$ bash run_experiments.sh --dry-run                  (job lines shortened)\n" + "\n".join(kept) + "\n"


def dry_run_after_check(folder: Path) -> str:
    """The same dry run after a GPU check: tests/support/illustrative_check.py's result.json, made up, not measured."""
    sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "support")]
    import illustrative_check
    after = folder / "after-check"
    illustrative_check.write(after / "runs")
    lines = run(["bash", str(ROOT / "run_experiments.sh"), "--dry-run"], after).splitlines()
    kept = [line for line in lines if line.startswith(DRY_RUN_JOBS + DRY_RUN_TOTALS)]
    return ("$ bash run_experiments.sh --dry-run      (runs/gpu_check/result.json: tests/support/illustrative_check.py's, made "
            "up, NOT measured; job lines shortened)\n" + "\n".join(kept) + "\n")


def check_dry_run(folder: Path) -> str:
    return "$ bash run_experiments.sh --check --dry-run\n" + run(["bash", str(ROOT / "run_experiments.sh"), "--check",
                                                                 "--dry-run"], folder)


def refusal(folder: Path) -> str:
    shown = ["--demo", "--", "--lrr", "1"]
    return f"$ bash run_experiments.sh {' '.join(shown)}\n" + run(["bash", str(ROOT / "run_experiments.sh"), *shown],
                                                                  folder)


BLOCKS = {"estimate": estimates, "dry-run": dry_run, "refusal": refusal, "dry-run-after-check": dry_run_after_check,
          "check-dry-run": check_dry_run}


def regenerated(doc: str) -> str:
    with tempfile.TemporaryDirectory(prefix="doc_plans.") as folder:
        return BLOCK.sub(lambda m: m[1] + BLOCKS[m["name"]](Path(folder)) + m[4], doc)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 when a block is stale")
    args = parser.parse_args(argv)
    doc = DOC.read_text()
    names = [m["name"] for m in BLOCK.finditer(doc)]
    if sorted(names) != sorted(BLOCKS):
        sys.exit(f"doc_plans.py: {DOC} has the blocks {names}, this script writes {sorted(BLOCKS)}")
    fresh = regenerated(doc)
    if args.check:
        stale = [old["name"] for old, new in zip(BLOCK.finditer(doc), BLOCK.finditer(fresh)) if old[0] != new[0]]
        if stale:
            print(f"doc_plans.py: stale in {DOC}: {', '.join(stale)}; run python benchmarks/doc_plans.py",
                  file=sys.stderr)
            return 1
        return 0
    DOC.write_text(fresh)
    print(f"doc_plans.py: rewrote {', '.join(names)} in {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

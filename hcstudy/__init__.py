"""hcstudy: everything of the HC vs mHC study that a user does not run by hand (the entry points beside it:
train_c4.py, report.py, torchrun.py, run_experiments.sh, setup.sh)."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent        # the repository: the entry points the launcher starts

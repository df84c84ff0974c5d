"""hcstudy: everything of the HC vs mHC study that a user does not run by hand. The entry points live beside it:
train_c4.py (the trainer), report.py, torchrun.py, run_experiments.sh, setup.sh. The map of its modules, and how a
run flows through them, is docs/architecture.md."""
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent        # the repository: the entry points the launcher starts

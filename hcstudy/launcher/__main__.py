"""python -m hcstudy.launcher: the decisions behind run_experiments.sh (which starts it)."""
import sys

from hcstudy.launcher.main import main

sys.exit(main(sys.argv[1:]))

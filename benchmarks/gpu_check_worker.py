"""The GPU check's one process with the trainer (hcstudy/check_parts.py): run_experiments.sh --check starts it.

    python benchmarks/gpu_check_worker.py --plan-only --budget 548        # the parts, sizes and budgets, as JSON

The package never imports train_c4, so this script passes it in: the parts time the trainer's own model and
optimizer step in this one process (imports, the CUDA context and Triton's compiled kernels paid once), where
each timed run used to be a trainer process of its own with 20-35 s of start-up.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import train_c4  # noqa: E402
from hcstudy import check_parts  # noqa: E402

if __name__ == "__main__":
    sys.exit(check_parts.worker_main(sys.argv[1:], train_c4))

"""A 2-process gloo job for the launcher's tests. Run by the launcher, it answers --plan-jobs as
tests/support/fake_trainer.py does and otherwise becomes torchrun with two ranks of itself; each rank joins the process
group, records its pid in OUT/RUN/rank{N}.pid and then waits, ignoring SIGTERM, as a rank stuck in a collective."""
import argparse
import os
import signal
import sys
import time
from pathlib import Path

if "LOCAL_RANK" not in os.environ:                  # the launcher's command, not yet a rank
    if "--plan-jobs" in sys.argv:
        os.execv(sys.executable, [sys.executable, str(Path(__file__).with_name("fake_trainer.py")), *sys.argv[1:]])
    os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                              __file__, *sys.argv[1:]])

import torch.distributed as dist  # noqa: E402

parser = argparse.ArgumentParser()
parser.add_argument("--out")
parser.add_argument("--run-name")
args, _ = parser.parse_known_args()
signal.signal(signal.SIGTERM, signal.SIG_IGN)
dist.init_process_group("gloo")
run_dir = Path(args.out) / args.run_name
run_dir.mkdir(parents=True, exist_ok=True)
(run_dir / f"rank{dist.get_rank()}.pid").write_text(str(os.getpid()))
while True:
    time.sleep(1)

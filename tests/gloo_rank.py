"""A rank of a 2-process gloo job for the launcher's tests, run by torchrun: it joins the process group, records
its pid in OUT/RUN/rank{N}.pid and then waits, ignoring SIGTERM, as a rank stuck in a collective would."""
import argparse
import os
import signal
import time
from pathlib import Path

import torch.distributed as dist

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

"""A stand-in for the launcher's GPU health probe: `python fake_probe.py GPU_ID`, exit 0 = healthy.

  FAKE_DEAD_GPUS        comma list of GPU ids that fail the probe
  FAKE_PROBE_PASSES     how many probes of a dead GPU still pass before it fails (default 0), so a test
                        can let a GPU pass the start-up probe and die later
  FAKE_PROBE_STATE      folder for the per-GPU probe counters and probes.log (required with FAKE_PROBE_PASSES)
"""

import os
import sys

gpu = sys.argv[1]
dead = set(filter(None, os.environ.get("FAKE_DEAD_GPUS", "").split(",")))
passes = int(os.environ.get("FAKE_PROBE_PASSES", "0"))
state = os.environ.get("FAKE_PROBE_STATE")
calls = 0
if state:
    os.makedirs(state, exist_ok=True)
    counter = os.path.join(state, f"gpu{gpu}.count")
    calls = int(open(counter).read()) if os.path.exists(counter) else 0
    with open(counter, "w") as f:
        f.write(str(calls + 1))
    with open(os.path.join(state, "probes.log"), "a") as f:
        f.write(f"{gpu}\n")
if gpu in dead and calls >= passes:
    print(f"probe: GPU {gpu} failed the CUDA matmul check", file=sys.stderr)
    sys.exit(1)
print(f"probe: GPU {gpu} ok")

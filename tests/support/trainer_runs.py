"""train_c4.py run as a user runs it, in a subprocess, and what a run writes read back: the tests that stop,
resume and compare runs share these."""
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


# values that must be identical between an interrupted-and-resumed run and an uninterrupted one
DETERMINISTIC_KEYS = ("step", "loss", "grad_norm", "lr", "tokens", "val_loss", "amax_fwd", "amax_bwd",
                      "layer_gain_fwd", "stream_dominance", "effective_rank", "layer_effective_rank")


def trainer(out, *args, env=None, wait=True):
    # a fault is injected by tests/support/fault_trainer.py (train_c4.py with the fault patched in), never by train_c4.py
    script = "tests/support/fault_trainer.py" if "TRAIN_C4_INJECT_NAN" in (env or {}) else "train_c4.py"
    command = [sys.executable, str(ROOT / script), "--preset", "tiny", "--out", str(out), *args]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env={**os.environ, **(env or {})}, cwd=out)
    if not wait:
        return process
    stdout, stderr = process.communicate(timeout=300)
    return process.returncode, stdout, stderr


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def deterministic(records):
    return [{k: r[k] for k in DETERMINISTIC_KEYS if k in r} for r in records]

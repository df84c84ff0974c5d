"""run_experiments.sh driven by the tests: its environment with the fakes injected (tests/support/fake_trainer.py,
fake_probe.py), a run in the foreground or the background, and matrix.log's lines read back."""
import json
import os
import re
import shutil
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "run_experiments.sh"
FAKE_TRAINER = ROOT / "tests" / "support" / "fake_trainer.py"
FAKE_PROBE = ROOT / "tests" / "support" / "fake_probe.py"
PY = sys.executable
needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")


def launcher_env(tmp_path, **extra):
    """An environment with the fakes injected and no knob of a previous test left over."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FAKE_", "RUN_EXPERIMENTS_", "TRAIN_C4_"))}
    env.update(
        RUN_EXPERIMENTS_TRAINER=f"{PY} {FAKE_TRAINER}",
        RUN_EXPERIMENTS_PROBE=f"{PY} {FAKE_PROBE}",
        RUN_EXPERIMENTS_NVIDIA_SMI="false",            # no GPU unless a test passes --gpus
        RUN_EXPERIMENTS_POLL="0.05",
        RUN_EXPERIMENTS_REPORT=str(tmp_path / "no_report.py"),
        FAKE_PROBE_STATE=str(tmp_path / "probe_state"),
        FAKE_STEP_SLEEP="0.01",
    )
    env.update({k: str(v) for k, v in extra.items()})
    return env


def launch(tmp_path, *args, env=None, timeout=120, out=None):
    out = out or tmp_path / "runs"
    cmd = ["bash", str(SCRIPT), "--out", str(out), "--stagger", "0", *map(str, args)]
    return subprocess.run(cmd, env=env or launcher_env(tmp_path), capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def events(out, name=None, invocation=-1, log="matrix.log"):
    """(time, event, text) of one launcher invocation's matrix.log lines (default: the last)."""
    runs, current = [], None
    for line in (Path(out) / log).read_text().splitlines():
        stamp, event, text = (line.split(" ", 2) + ["", ""])[:3]
        if event == "START":
            current = []
            runs.append(current)
        current.append((datetime.strptime(stamp, "%Y-%m-%dT%H:%M:%S.%f%z"), event, text))
    return [e for e in runs[invocation] if name is None or e[1] == name]


def launches(out, invocation=-1, log="matrix.log"):
    """(time, run, gpus) of each LAUNCH line."""
    found = []
    for t, _, text in events(out, "LAUNCH", invocation, log):
        m = re.match(r"(\S+) gpus=(\S+)", text)
        found.append((t, m.group(1), m.group(2)))
    return found


def invocations(out, run):
    path = Path(out) / run / "invocations.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def status(out, run):
    return json.loads((Path(out) / run / "status.json").read_text())


def wait_for(predicate, timeout=60.0, what="condition"):
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if predicate():
                return
        except (OSError, ValueError):
            pass   # a file being replaced at this moment
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def start(tmp_path, *args, env, **popen):
    """The launcher in the background on pretend GPUs, its output together."""
    return subprocess.Popen(["bash", str(SCRIPT), "--out", str(tmp_path / "runs"), "--stagger", "0", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, **popen)

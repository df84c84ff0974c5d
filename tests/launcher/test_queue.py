"""hcstudy/launcher/queue.py: the matrix run: slots, what each exit code means (done, diverged, retry at half the
micro-batch, quarantine a GPU, requeue), resume. run_experiments.sh runs tests/support/fake_trainer.py and
fake_probe.py on pretend GPUs: no GPU, no torch."""
import json
import os
import re
import signal

from launcher_harness import (FAKE_TRAINER, PY, events, invocations, launch, launcher_env, launches, needs_bash, start,
                              status, wait_for)


pytestmark = needs_bash


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

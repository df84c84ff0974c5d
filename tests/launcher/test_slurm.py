"""hcstudy/launcher/slurm.py: --slurm: the task's time, the submission's preview."""
import os
from pathlib import Path

from launcher_harness import launch, launcher_env, needs_bash


pytestmark = needs_bash


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

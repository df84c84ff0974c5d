"""hcstudy/launcher/dry_run.py: every job planned by the trainer before a launch: the dry run's text, --quick's fill
of the node, --calibrate, the refusals of what the node cannot run."""
import random
import re

import pytest

from hcstudy.launcher import dry_run

from launcher_harness import launch, launcher_env, needs_bash


pytestmark = needs_bash


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


def test_queue_schedule_of_18_jobs_on_8_gpus_by_hand():
    # the --full queue order: seed-major, depth 48 before 32, baseline/hc/mhc; depth 48 takes 3 h, 32 takes 2 h
    hours = [3, 3, 3, 2, 2, 2] * 3
    # t=0: jobs 1-8 start (slots end at 3,3,3,2,2,2,3,3); t=2: jobs 9-11 on the three free slots (9 ends at 5,
    # 10-11 at 4); t=3: jobs 12-16 on the five slots freed (12 and 16 end at 5, 13-15 at 6); t=4: jobs 17-18 end
    # at 6. Wall time 6 h; the naive sum over 8 GPUs would say 45 / 8 = 5.6 h.
    assert dry_run.queue_schedule(hours, 8) == 6
    assert dry_run.queue_schedule([1.0] * 3, 8, stagger=0.25) == 1.5          # launches a quarter apart
    assert dry_run.queue_schedule([2, 1, 1, 1], 2) == 3 and dry_run.queue_schedule([], 8) == 0

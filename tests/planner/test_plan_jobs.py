"""hcstudy/planner/plan_jobs.py (train_c4.py --plan-jobs): the launcher's check of every job: the dry run's time and
cost ranges of the documented node, the GPU check's timings, refusals before any launch."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import illustrative_check
from hcstudy.config import parse_config
from hcstudy.planner import plan_jobs
from hcstudy.planner.gpus import GPU_MEMORY_GIB
from hcstudy.planner.memory import DEFAULT_GPU_MEMORY_GIB, GiB, PlanError


def hours(line: str) -> tuple[float, float]:
    low, high = re.search(r"([\d.]+)-([\d.]+) h", line).groups()
    return float(low), float(high)


ROOT = Path(__file__).resolve().parents[2]


def without_triton(tmp_path: Path) -> dict:
    """The environment of setup.sh without --dev, where the CPU torch brings no triton: a package named triton first
    on the path whose import fails as a missing module's does (this venv has the real one)."""
    (tmp_path / "no_triton" / "triton").mkdir(parents=True, exist_ok=True)
    (tmp_path / "no_triton" / "triton" / "__init__.py").write_text(
        "raise ModuleNotFoundError(\"No module named 'triton'\", name='triton')\n")
    return {"PYTHONPATH": str(tmp_path / "no_triton")}


@pytest.mark.slow
def test_the_plan_and_the_dry_run_need_no_triton(tmp_path):
    """The README's set-up installs the runtime alone: the planner counts the triton path's kernels by their own
    byte counts, and triton is imported only where its kernels run."""
    env = {**os.environ, **without_triton(tmp_path)}
    assert subprocess.run([sys.executable, "-c", "import triton"], env=env, capture_output=True).returncode == 1
    done = subprocess.run([sys.executable, str(ROOT / "train_c4.py"), "--estimate", "--depth", "48"], env=env,
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr[-2000:]
    assert "triton path" in done.stdout and "the run on this CPU" in done.stdout
    r = launcher(tmp_path, "--dry-run", "--full", **without_triton(tmp_path))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Wall time: 18 job(s)" in r.stdout and "triton path" in r.stdout


def launcher(tmp_path, *args, **env):
    environment = {k: v for k, v in os.environ.items() if not k.startswith(("RUN_EXPERIMENTS_", "FAKE_"))}
    environment.update(RUN_EXPERIMENTS_NVIDIA_SMI="false", **env)
    return subprocess.run(["bash", str(ROOT / "run_experiments.sh"), "--out", str(tmp_path / "runs"), *args],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path, env=environment)


@pytest.mark.slow
def test_dry_run_without_gpus_plans_the_documented_node_per_method_with_ranges(tmp_path):
    r = launcher(tmp_path, "--dry-run", "--methods", "baseline,mhc", "--seeds", "42,123,456",
                 "--price-per-gpu-hour", "3")
    assert r.returncode == 0, r.stderr
    assert "for the documented node, 8 x NVIDIA H100 80GB HBM3 (no GPU found here" in r.stdout
    lines = {line.split()[0]: line for line in r.stdout.splitlines() if line.startswith(("mhc_d", "baseline_d"))}
    assert "micro-batch 8 (auto), global batch 32, " in lines["mhc_d32_s42"]        # auto, planned for 80 GiB
    assert "micro-batch 2 (auto)" in lines["mhc_d48_s42"] and " of 80 GiB" in lines["mhc_d48_s42"]
    for depth in (32, 48):          # the stream mixing costs time: mHC's range lies above the baseline's
        baseline, mhc = hours(lines[f"baseline_d{depth}_s42"]), hours(lines[f"mhc_d{depth}_s42"])
        assert baseline[0] < baseline[1] and mhc[0] > baseline[0] and mhc[1] > baseline[1]
    assert "triton path" in lines["mhc_d32_s42"] and "reference path" in lines["baseline_d32_s42"]
    assert "(modelled)" in lines["mhc_d32_s42"] and "Step times, modelled: each job's kernels counted" in r.stdout
    assert "checkpoint writes" in r.stdout
    wall = re.search(r"Wall time: 12 job\(s\) on 8 slot\(s\).*", r.stdout).group()
    cost = re.search(r"Cost at \$3.00 per GPU-hour: 8 GPU\(s\) x .* = \$([\d,]+)-\$([\d,]+) for the node", r.stdout)
    assert hours(wall)[0] < hours(wall)[1] and cost and int(cost[1].replace(",", "")) < int(cost[2].replace(",", ""))
    assert not (tmp_path / "runs").exists()
    assert "goes with --dry-run" in launcher(tmp_path, "--calibrate").stderr


@pytest.mark.slow
def test_dry_run_takes_the_gpu_checks_timing_and_gpu_type(tmp_path):
    """{out}/gpu_check/result.json (docs/planning.md) replaces the model for the arm, path and GPU it timed."""
    check = tmp_path / "runs" / "gpu_check" / "result.json"
    check.parent.mkdir(parents=True)
    check.write_text(json.dumps({"gpu": "NVIDIA H200", "timings": {"mhc": {"triton/eager": {"step_s": 2.0}}},
                                 "methods": {"mhc": {"step_seconds": 2.0, "tokens_per_step": 32768,
                                                     "flops_per_token": 1.0e10, "gpus": 1}}}))
    r = launcher(tmp_path, "--dry-run", "--methods", "mhc", "--depths", "32", "--seeds", "1", "--gpu-type",
                 "NVIDIA H200")
    assert r.returncode == 0, r.stderr
    line = next(line for line in r.stdout.splitlines() if line.startswith("mhc_d32_s1"))
    assert "8 x NVIDIA H200" in r.stdout and "triton path" in line and "(scaled)" in line
    assert "Step times, scaled: mhc on the triton path (eager) timed by the GPU check at its small size, scaled by " \
           "FLOPs per token" in r.stdout
    # 10,000 steps of 2 s at 1e10 FLOPs per token, scaled to depth 32's 1.116e10 (the head's included) and spread
    # 0.9-1.2 (5.58-7.44 h), plus the rest
    low, high = hours(line)
    assert 5.58 < low < 5.9 and 7.44 < high < 8.0
    r = launcher(tmp_path, "--dry-run", "--methods", "mhc", "--depths", "32", "--seeds", "1")
    assert r.returncode == 0 and "GPU check" not in r.stdout          # measured on another GPU than planned
    r = launcher(tmp_path, "--dry-run", "--methods", "mhc", "--depths", "32", "--seeds", "1", "--gpu-type",
                 "NVIDIA H200", "--", "--kernels", "reference")
    assert r.returncode == 0 and "GPU check" not in r.stdout and "reference path" in r.stdout   # not the timed path


@pytest.mark.slow
def test_dry_run_prices_rehearsed_jobs_as_measured_and_refuses_a_micro_batch_that_ran_out_of_memory(tmp_path):
    """tests/support/illustrative_check.py's result.json (made up): the baseline at depth 48 and mHC at depth 32 trained,
    HC at depth 48 ran out of memory at its planned micro-batch 2."""
    illustrative_check.write(tmp_path / "runs")
    r = launcher(tmp_path, "--dry-run", "--seeds", "1")
    assert r.returncode == 0, r.stderr
    lines = {line.split()[0]: line for line in r.stdout.splitlines() if re.match(r"\w+_d\d+_s1 ", line)}
    assert "micro-batch 4 (auto)" in lines["baseline_d48_s1"] and "(measured: 1.41 s a step, 1.39-1.44)" in \
        lines["baseline_d48_s1"]
    assert "(measured: 1.58 s a step, 1.55-1.62)" in lines["mhc_d32_s1"]
    assert "micro-batch 1 (auto)" in lines["hc_d48_s1"] and "(modelled)" in lines["hc_d48_s1"]     # below the 2
    assert sum("(measured" in line for line in lines.values()) == 2 and len(lines) == 6
    low, high = hours(lines["mhc_d32_s1"])         # 10,000 steps of 1.55-1.62 s, and the rest
    assert 4.3 < low < 4.7 and 4.5 < high < 5.0
    assert "Step times, measured: the GPU check's rehearsal of the job's very shape" in r.stdout
    r = launcher(tmp_path, "--dry-run", "--methods", "hc", "--depths", "48", "--seeds", "1", "--",
                 "--micro-batch-size", "2")
    assert r.returncode == 2 and "nothing was launched" not in r.stdout
    assert re.search(r"refuses hc_d48_s1: --micro-batch-size 2: the GPU check's rehearsal of hc at depth 48 ran out "
                     r"of memory at micro-batch 2 on this NVIDIA H100 80GB HBM3 \(result\.json in .*\): use a "
                     r"smaller one, or auto", r.stderr), r.stderr


@pytest.mark.slow
def test_every_job_is_refused_before_any_launch_for_bad_flags_or_memory(tmp_path):
    r = launcher(tmp_path, "--demo", "--", "--lrr", "1")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "train_c4.py refuses baseline_d4_s42 and 2 more job(s): unrecognized arguments: --lrr 1" in r.stderr
    assert "nothing was launched" in r.stderr and not list((tmp_path / "runs").glob("*_d4_s42"))
    r = launcher(tmp_path, "--dry-run", "--methods", "mhc", "--depths", "48", "--seeds", "1", "--",
                 "--micro-batch-size", "16")
    assert r.returncode == 2
    assert re.search(r"refuses mhc_d48_s1: .* plans [\d.]+ GiB per GPU, more than the 80 GiB", r.stderr)


@pytest.mark.slow
def test_demo_dry_run_calibrates_on_the_cpu(tmp_path):
    r = launcher(tmp_path, "--demo", "--dry-run", "--calibrate", "--methods", "mhc", "--stagger", "0",
                 RUN_EXPERIMENTS_CALIBRATE_STEPS="4")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Calibrating mhc_d4 on the CPU: 4 steps" in r.stdout
    assert "Times from --calibrate" in r.stdout and "mhc_d4 " in r.stdout and "calibrated just now" in r.stdout
    assert "Wall time: 1 job(s) on 1 slot(s)" in r.stdout and "no GPU-hours" in r.stdout
    assert not (tmp_path / "runs").exists()


def test_a_gpus_memory_is_the_flag_then_what_nvidia_smi_said_then_the_cards_and_an_unknown_card_is_refused():
    cfg = parse_config(["--preset", "tiny"])
    h100 = "NVIDIA H100 80GB HBM3"
    assert plan_jobs.card_bytes(cfg, h100) == GPU_MEMORY_GIB[h100] * GiB
    assert plan_jobs.card_bytes(cfg, h100, card_gib=79.2) == 79.2 * GiB
    assert plan_jobs.card_bytes(cfg, "cpu") == DEFAULT_GPU_MEMORY_GIB * GiB
    assert plan_jobs.card_bytes(parse_config(["--preset", "tiny", "--gpu-memory-gb", "12"]), h100) == 12 * GiB
    with pytest.raises(PlanError, match="'NVIDIA Nope' is not in the planner's table"):
        plan_jobs.card_bytes(cfg, "NVIDIA Nope")
    assert plan_jobs.card_bytes(cfg, "NVIDIA Nope", card_gib=24) == 24 * GiB      # nvidia-smi said its size

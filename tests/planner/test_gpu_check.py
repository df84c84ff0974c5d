"""hcstudy/gpu_check.py (run_experiments.sh --check) off the GPU: how its timings become result.json, the
file the planner reads. The check itself needs a CUDA GPU; test_launcher.py holds its one line without one."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import train_c4  # noqa: E402
from hcstudy import contract, gpu_check  # noqa: E402
from hcstudy.kernels import choice  # noqa: E402
from hcstudy.planner import run_time  # noqa: E402

H100 = "NVIDIA H100 80GB HBM3"


def timed_run(folder, seconds, method="hc"):
    """A run folder whose first steps are slow (compile, warm-up) and whose later ones take `seconds`, with the
    config.json the trainer writes for the timed size (its settings and parameter counts)."""
    folder.mkdir(parents=True)
    cfg = train_c4.parse_config([*gpu_check.SIZE, "--residual", method])
    (folder / "config.json").write_text(json.dumps({"config": {"residual": method, "depth": 4, "width": 2048,
                                                               "seq_len": 1024},
                                                    "params": train_c4.count_parameters(cfg)}))
    lines = [{"step": 0, "time": 0.0, "amax_fwd": 1.0}]
    lines += [{"step": step, "time": float(step), "loss": 5.0,
               "step_time_s": 30.0 if step <= 2 else seconds + step / 1000,
               "tokens_per_s": 8192 / seconds, "mfu": 0.3, "mem_peak_gb": 10.0 + step} for step in range(1, 11)]
    (folder / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return folder


def test_step_stats_are_medians_past_the_warm_up(tmp_path):
    stats = gpu_check.step_stats(timed_run(tmp_path / "hc", 0.5))
    assert stats["step_s"] == pytest.approx(0.5 + 7.5 / 1000)       # steps 5..10: median of 0.505 .. 0.510
    assert stats["tokens_per_s"] == pytest.approx(8192 / 0.5) and stats["mfu"] == 0.3
    assert stats["mem_peak_gb"] == 20.0
    assert gpu_check.step_stats(tmp_path / "missing") is None


def test_result_json_gives_the_planner_each_methods_fastest_step_seconds(tmp_path):
    table = {"baseline": {"reference/eager": gpu_check.step_stats(timed_run(tmp_path / "b", 0.3, "baseline"))},
             "hc": {"reference/eager": gpu_check.step_stats(timed_run(tmp_path / "r", 0.5)),
                    "fused/eager": gpu_check.step_stats(timed_run(tmp_path / "f", 0.4)),
                    "fused/compile": None},                 # out of time: kept as null, not dropped
             "mhc": {"reference/eager": None}}
    gpu_check.write_result(tmp_path, {"gpu": H100}, {"bf16": "PASS"}, table, {})
    result = json.loads((tmp_path / "gpu_check" / "result.json").read_text())
    assert result["step_seconds"] == {"baseline": pytest.approx(0.3075), "hc": pytest.approx(0.4075)}
    assert result["paths"]["hc"] == "fused/eager" and "mhc" not in result["step_seconds"]
    assert result["tokens_per_step"] == 8 * 1024 and result["gpu"] == "NVIDIA H100 80GB HBM3"
    # what hcstudy/planner reads: the planner's rate from the check must be the timed run's own FLOPs per second
    timing = result["methods"]["hc"]
    assert timing["step_seconds"] == pytest.approx(0.4075) and timing["tokens_per_step"] == 8 * 1024
    assert 6 * 4 * 12 * 2048 ** 2 < timing["flops_per_token"] < 6 * 4 * 13 * 2048 ** 2 + 12 * 4 * 2048 * 1024
    assert result["timings"]["hc"]["fused/compile"] is None and result["parts"] == {"bf16": "PASS"}
    assert not list(tmp_path.glob("gpu_check/.*.tmp"))


def test_result_json_is_read_by_the_kernel_choice_and_the_planner(tmp_path):
    """One end writes {out}/gpu_check/result.json (gpu_check.write_result), the other ends read it: the kernel
    choice's load_check and fastest_timed, the planner's measured_rate."""
    table = {"hc": {"reference/eager": gpu_check.step_stats(timed_run(tmp_path / "r", 0.5)),
                    "fused/eager": gpu_check.step_stats(timed_run(tmp_path / "f", 0.4))}}
    gpu_check.write_result(tmp_path, {"gpu": H100}, {}, table, {"hc": {"fused": (0.3, 0.5)}})
    check = contract.load_check(tmp_path)
    assert check["modelled"] == {"hc": {"fused": [0.3, 0.5]}}
    cfg = train_c4.parse_config([*gpu_check.SIZE, "--residual", "hc"])
    assert choice.fastest_timed(cfg, check, H100) == ("fused", pytest.approx(0.4075))
    assert choice.fastest_timed(cfg, check, "NVIDIA H200") is None      # timed on another card
    rate = run_time.measured_rate(check, cfg, "fused", H100)
    assert rate["flops_per_s"] == pytest.approx(8192 * table["hc"]["fused/eager"]["flops_per_token"] / 0.4075)
    assert run_time.measured_rate(check, cfg, "triton", H100) is None
    assert contract.load_check(tmp_path / "elsewhere") == {}


@pytest.mark.slow
def test_run_as_a_script_it_finds_the_trainer_and_writes_result_json(tmp_path):
    """run_experiments.sh runs `python -m hcstudy.gpu_check` from any folder, the repository on PYTHONPATH."""
    timed_run(tmp_path / "b", 0.3)
    script = ("from hcstudy import gpu_check; import pathlib; "
              f"folder = pathlib.Path({str(tmp_path)!r}); "
              "stats = gpu_check.step_stats(folder / 'b'); "
              "gpu_check.write_result(folder, {}, {}, {'baseline': {'reference/eager': stats}}, {})")
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "gpu_check" / "result.json").read_text())["methods"]["baseline"]["flops_per_token"] > 0


def test_each_part_is_judged_against_the_plan(tmp_path, capsys):
    check = gpu_check.Check(tmp_path)
    timed = {"step_s": 0.04, "tokens_per_s": 205_000, "mfu": 0.25, "mem_peak_gb": 16.0}
    table = {"baseline": {"reference/eager": timed, "reference/compile": timed},
             "hc": {"reference/eager": timed, "reference/compile": None},          # a compiled run that failed
             "mhc": {"reference/eager": timed, "reference/compile": timed}}
    # the trainer models each timed arm's step (train_c4.py --plan-jobs, one subprocess)
    model = gpu_check.modelled_steps(table, "NVIDIA H200")
    assert set(model) == {"baseline", "hc", "mhc"} and all(low < high for low, high in model["hc"].values())
    gpu_check.judge(check, table, 15.8, model, "NVIDIA H200")
    assert check.parts == {"compile": "FAIL", "memory plan": "FAIL", "step model": "PASS", "MFU": "PASS"}
    out = capsys.readouterr().out
    assert "FAIL  compile      2 of 3 --compile runs timed" in out
    assert "mHC measured peak 16.0 GB against the planned 15.8 GB allocated" in out
    # the planner models the baseline's step at 0.028-0.048 s on an H200; hc and mhc are slower than 0.04 s there
    assert re.search(r"baseline 0.040 s/step against the planner's 0.02\d-0.04\d s; .* 1 of 3 eager timings", out)
    table["baseline"] = {"reference/eager": {**timed, "step_s": 0.3}}
    gpu_check.judge(gpu_check.Check(tmp_path), table, 15.8, model, "NVIDIA H200")
    assert "FAIL  step model" in capsys.readouterr().out
    model = gpu_check.modelled_steps(table, "NVIDIA RTX A6000")
    gpu_check.judge(check := gpu_check.Check(tmp_path), table, 15.8, model, "NVIDIA RTX A6000")
    assert check.parts["step model"] == "FAIL" and "no model for NVIDIA RTX A6000" in capsys.readouterr().out

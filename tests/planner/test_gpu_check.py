"""hcstudy/gpu_check.py (run_experiments.sh --check) on the CPU: the plan of the parts and their budgets, the parts
themselves at a few thousand parameters (the check's --cpu-tiny sizes), an out-of-memory error as a rehearsal's
result, and how the events become verdicts and result.json. The check itself needs a CUDA GPU;
tests/launcher/test_run_experiments.py holds its one line without one."""
import dataclasses
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import illustrative_check

from hcstudy.config import parse_config
from hcstudy.model import count_parameters
from hcstudy import check_kernels, check_parts, contract, gpu_check
from hcstudy.kernels import choice
from hcstudy.planner import gpus, run_time

from check_contexts import H100, by_name, tiny  # noqa: F401 (tiny: a fixture)


ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_kernel_tests_run_first_in_their_own_pytest_and_each_arms_record_reaches_result_json(tiny, tmp_path,
                                                                                                 monkeypatch, capsys):
    """--cpu-tiny's kernel tests: the first arm's one bf16 case in Triton's interpreter, then its self-check there,
    through the worker's events, the parent's verdict and result.json (the GPU runs the whole selection compiled)."""
    ctx, parts = tiny
    monkeypatch.setattr(ctx, "folder", tmp_path)
    part = by_name(parts)["kernel tests"]
    assert [p.kind for p in parts[:4]] == ["overhead", "overhead", "kernels", "environment"]
    events = []
    check_parts.run_parts(ctx, [part], time.time() + 300, events.append, skip=set())
    record = gpu_check.results(events)[4]
    assert list(record) == ["hc"] and record["hc"]["tests"] == "PASS" and record["hc"]["cases"] == 1
    assert record["hc"]["path"] == "triton" and record["hc"]["why"].endswith("self-check passed")
    assert record["hc"]["fallback"] == "" and "1 passed" in (tmp_path / "kernel_tests.log").read_text()
    check = gpu_check.Check(tmp_path)
    gpu_check.judge_kernels(check, record)
    assert check.parts == {"kernels": "PASS"} and "1 of 1 cases passed; self-check hc triton" in capsys.readouterr().out
    gpu_check.write_result(tmp_path, {"gpu": "cpu"}, check.parts, {}, [], tiny=True, kernels=record)
    assert contract.load_check(tmp_path)["kernels"] == record


def test_a_failed_kernel_test_says_which_arm_falls_back_to_which_path_and_auto_takes_it(tmp_path, monkeypatch,
                                                                                          capsys):
    """A faked failing case of hc and a faked failing self-check of mhc-lite: each arm's record, the one line of its
    fallback (priced by check_kernels.fallback_line, held by tests/planner/test_check_kernels.py), the FAIL verdict,
    and result.json's triton timing of hc no longer what auto or the planner take."""
    cases = [("test_widths_over_several_channel_chunks[hc-4-True]", "failure", "AssertionError: x: 3e-3 > 1e-5"),
             ("test_the_kernels_equal_the_formulas_at_bf16_streams[hc-triton]", "passed", ""),
             ("test_the_kernels_equal_the_formulas_at_bf16_streams[mhc-triton]", "passed", ""),
             ("test_the_kernels_equal_the_formulas_at_bf16_streams[mhc-lite-triton]", "passed", "")]
    monkeypatch.setattr(check_kernels, "run_tests", lambda ids, folder, limit: (cases, ""))
    monkeypatch.setattr(check_kernels, "kernel_path", lambda cfg, device: (
        ("reference", "warning: the triton kernels disagree; the formulas instead") if cfg.residual == "mhc-lite"
        else ("triton", "--kernels triton; compiled for this GPU; self-check passed")))
    monkeypatch.setattr(check_kernels, "fallback_line", lambda arm, path, gpu, card: f"{arm} falls back to {path}: $")
    ctx = SimpleNamespace(tiny=False, folder=tmp_path, device=torch.device("cpu"), gpu=H100, card=80 * 2 ** 30,
                          small_config=lambda arm: parse_config([*check_parts.SMALL, "--residual", arm]))
    record = check_kernels.prove(ctx, ("baseline", "hc", "mhc", "mhc-lite"), time.time() + 60)
    assert record["hc"]["tests"] == "FAIL" and record["hc"]["failed"] == 1 and record["hc"]["cases"] == 2
    assert record["hc"]["reason"] == "test_widths_over_several_channel_chunks[hc-4-True] failure: AssertionError: " \
                                     "x: 3e-3 > 1e-5"
    assert record["hc"]["fallback"] == "hc falls back to fused: $" and record["mhc"]["fallback"] == ""
    assert record["mhc-lite"]["tests"] == "PASS" and record["mhc-lite"]["fallback"] == "mhc-lite falls back to " \
                                                                                       "reference: $"
    capsys.readouterr()
    check = gpu_check.Check(tmp_path)
    gpu_check.judge_kernels(check, record)
    out = capsys.readouterr().out
    assert check.parts == {"kernels": "FAIL"} and "failed: hc, mhc-lite (kernel_tests.log)" in out
    assert "      hc falls back to fused: $\n" in out and "      mhc-lite: warning: the triton kernels disagree" in out
    table = {"hc": {"reference/eager": timing(0.5), "fused/eager": timing(0.4), "triton/eager": timing(0.1)}}
    gpu_check.write_result(tmp_path, {"gpu": H100}, check.parts, table, [], kernels=record)
    result = contract.load_check(tmp_path)
    cfg = parse_config([*check_parts.SMALL, "--residual", "hc"])
    assert choice.fastest_timed(cfg, result, H100) == ("fused", 0.4)
    assert run_time.planned_path(parse_config(["--residual", "hc"]), H100, result) == "fused"
    assert choice.fastest_timed(cfg, dict(result, kernels={}), H100) == ("triton", 0.1)     # format 2: no record
    # a worker that died in the part leaves no record: FAIL, not the SKIP of a part that never started
    part = check_parts.Part("kernel tests", "kernels", 74.0, "")
    died = [{"event": "start", "part": part.name}, {"event": "crashed", "part": part.name, "exit": -11}]
    for events, verdict in (([plan_event([part])], "SKIP"), ([plan_event([part]), *died], "FAIL")):
        gpu_check.judge_kernels(check := gpu_check.Check(tmp_path), gpu_check.results(events)[4])
        assert check.parts == {"kernels": verdict}


def timing(step_s, method="hc"):
    cfg = parse_config([*check_parts.SMALL, "--residual", method])
    flops = gpus.flops_per_token(cfg, count_parameters(cfg))
    return {"step_s": step_s, "step_s_spread": [step_s, step_s], "steps_timed": 5, "tokens_per_s": 8192 / step_s,
            "mfu": 0.3, "mem_peak_gb": 12.0, "flops_per_token": flops}


def test_result_json_gives_the_planner_each_methods_fastest_step_and_keeps_the_rehearsals(tmp_path):
    table = {"baseline": {"reference/eager": timing(0.3, "baseline")},
             "hc": {"reference/eager": timing(0.5), "fused/eager": timing(0.4), "triton/eager": None},
             "mhc": {"reference/eager": None}}
    rows = illustrative_check.write(tmp_path)
    result = json.loads((tmp_path / "gpu_check" / "result.json").read_text())
    assert result["rehearsals"] == json.loads(json.dumps(rows)) and result["format"] == 3
    gpu_check.write_result(tmp_path, {"gpu": H100}, {"bf16": "PASS"}, table, rows)
    result = json.loads((tmp_path / "gpu_check" / "result.json").read_text())
    assert result["step_seconds"] == {"baseline": 0.3, "hc": 0.4} and result["paths"]["hc"] == "fused/eager"
    assert result["tokens_per_step"] == 8 * 1024 and result["gpu"] == H100 and "mhc" not in result["methods"]
    assert result["methods"]["hc"]["flops_per_token"] == timing(0.4)["flops_per_token"]
    assert result["timings"]["hc"]["triton/eager"] is None and result["parts"] == {"bf16": "PASS"}
    assert [r["status"] for r in result["rehearsals"]] == ["ok", "oom", "ok", "oom"]
    assert not list(tmp_path.glob("gpu_check/.*.tmp"))


def test_result_json_is_read_by_the_kernel_choice_and_the_planner(tmp_path):
    """One end writes {out}/gpu_check/result.json (gpu_check.write_result), the other ends read it: the kernel
    choice's load_check and fastest_timed, the planner's measured_rate."""
    table = {"hc": {"reference/eager": timing(0.5), "fused/eager": timing(0.4)}}
    gpu_check.write_result(tmp_path, {"gpu": H100}, {}, table, [])
    check = contract.load_check(tmp_path)
    cfg = parse_config([*check_parts.SMALL, "--residual", "hc"])
    assert choice.fastest_timed(cfg, check, H100) == ("fused", 0.4)
    assert choice.fastest_timed(cfg, check, "NVIDIA H200") is None      # timed on another card
    rate = run_time.measured_rate(check, cfg, "fused", H100)
    assert rate["flops_per_s"] == pytest.approx(8192 * timing(0.4)["flops_per_token"] / 0.4)
    assert rate["basis"].startswith("scaled: hc on the fused path (eager)")
    assert run_time.measured_rate(check, cfg, "triton", H100) is None
    assert contract.load_check(tmp_path / "elsewhere") == {}


def plan_event(parts):
    return {"event": "plan", "gpu": H100, "torch": "2.x", "cuda": "12.x",
            "parts": [dataclasses.asdict(part) for part in parts]}


def test_the_events_become_verdicts_a_process_that_died_in_a_part_a_failed_row(tiny, capsys):
    ctx, parts = tiny
    rows = [illustrative_check.row(*values) for values in illustrative_check.ROWS]
    base = illustrative_check.row("baseline", 32, 8, 32, "reference", "ok", 0.98, [0.97, 1.0], 50.0, 51.5,
                                  [0.74, 1.22], False)
    compiled = dict(base, compile=True, status="failed", reason="BackendCompilerFailed: ...", variant=["--compile"])
    died = dataclasses.replace(by_name(parts)["rehearsal mhc d3"], name="rehearsal mhc d48",
                               flags=["--residual", "mhc", "--depth", "48", "--micro-batch-size", "2"])
    events = [plan_event([died]), {"event": "environment", "bf16": True, "flash_attn": False, "sdpa_flash": True,
                                   "error": ""},
              {"event": "timing", "method": "hc", "path": "fused", "stats": timing(0.4), "why": ""},
              *({"event": "rehearsal", "row": row} for row in [base, compiled, *rows]),
              {"event": "start", "part": died.name}, {"event": "crashed", "part": died.name, "exit": -11}]
    device, environment, table, found, kernels = gpu_check.results(events)
    assert device == {"gpu": H100, "torch": "2.x", "cuda": "12.x"} and table == {"hc": {"fused/eager": timing(0.4)}}
    assert found[-1]["status"] == "failed" and "the process died in it (exit -11" in found[-1]["reason"]
    assert found[-1]["micro_batch"] == died.micro and found[-1]["config"] == {}
    check = gpu_check.Check(Path("."))
    gpu_check.judge_kernels(check, kernels)
    gpu_check.judge(check, environment, table, found)
    out = capsys.readouterr().out
    # no kernels event: the kernel tests did not run, SKIP rather than PASS
    assert kernels == {} and check.parts == {"kernels": "SKIP", "bf16": "PASS", "attention": "PASS", "compile": "FAIL",
                                             "memory plan": "FAIL", "step model": "PASS", "MFU": "PASS"}
    assert "out of memory at the planned micro-batch: hc d48 x2" in out           # the plan let it through
    assert "baseline d32 0.980 s/step against the planner's 0.740-1.220 s" in out
    assert re.search(r"MFU +baseline d32 \d+\.\d%", out)
    assert "over the plan: mhc d48 at micro-batch 3: ran out of memory, as the plan expects" in out
    found = [row for row in found if row["status"] == "ok" and not row["compile"]]     # every planned shape fitted
    gpu_check.judge(check := gpu_check.Check(Path(".")), environment, table, found)
    assert check.parts["memory plan"] == "PASS" and "compile" not in check.parts
    found[0] = dict(found[0], peak_alloc_gib=found[0]["planned_alloc_gib"] + 0.1)
    gpu_check.judge(check := gpu_check.Check(Path(".")), environment, table, found)
    assert check.parts["memory plan"] == "FAIL"


@pytest.mark.slow
def test_check_dry_run_lists_every_part_at_depths_32_and_48_within_its_570_s(tmp_path):
    """No GPU needed: the worker plans the parts for the documented node's card (a minute or two on a 2-core CPU)."""
    done = subprocess.run(["bash", str(ROOT / "run_experiments.sh"), "--check", "--dry-run"], capture_output=True,
                          text=True, timeout=900, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("run_experiments.sh --check --dry-run: the parts on one NVIDIA H100 80GB HBM3 (assumed")
    timed = [line for line in lines[2:] if not re.match(r" *\d+ s  (start-up|planning)", line)]
    assert re.match(r" *\d+ s  kernel tests +\d+ pytest cases of tests/kernels compiled for this card", timed[0])
    total = int(re.fullmatch(r"total: (\d+) s", lines[-1]).group(1))
    budgets = [int(m.group(1)) for m in (re.match(r" *(\d+) s  ", line) for line in lines) if m]
    assert total <= 570 and abs(sum(budgets) - total) <= len(budgets)        # each rounded on its own
    for depth in (32, 48):
        for arm in ("baseline", "hc", "mhc"):
            line = next(line for line in lines if f"rehearsal {arm} d{depth} " in line)
            assert re.search(rf"depth {depth}, {arm}, micro-batch \d+ x \d+, \w+ path, fp32 streams", line), line
    assert re.search(r"over the plan mhc d48 +depth 48, mhc, micro-batch 3 \(planned 2\)", done.stdout)
    assert "variant baseline d32 --compile" in done.stdout and "FSDP" in done.stdout and "timings" in done.stdout
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_the_cpu_tiny_check_runs_every_part_in_one_worker_and_writes_result_json(tmp_path):
    """The whole check, parent and worker processes, at --cpu-tiny's sizes: what a lent GPU runs, run before."""
    done = subprocess.run([sys.executable, "-m", "hcstudy.gpu_check", "--cpu-tiny", "--out", str(tmp_path),
                           "--budget", "1500"], capture_output=True, text=True, timeout=1500, cwd=ROOT)
    assert "PASS  FSDP" in done.stdout and "PASS  compile" in done.stdout, done.stdout + done.stderr
    assert "PASS  kernels" in done.stdout and done.stdout.index("part  kernel tests") < done.stdout.index(
        "part  environment")
    result = contract.load_check(tmp_path)
    assert result["kernels"]["hc"]["tests"] == "PASS" and result["kernels"]["hc"]["path"] == "triton"
    rows = result["rehearsals"]
    assert {(r["method"], r["depth"]) for r in rows if not r["over_plan"] and not r["variant"]} == {
        (m, d) for m in contract.METHODS for d in check_parts.TINY_DEPTHS}
    assert [r["status"] for r in rows if r["over_plan"]] == ["oom"]
    assert all(r["status"] == "ok" for r in rows if not r["over_plan"]), rows
    assert result["timings"]["hc"]["fused/eager"]["step_s"] > 0 and result["gpu"] == "cpu"
    assert done.stdout.count("part  rehearsal") == len(contract.METHODS) * 2


def test_the_kernels_gpu_script_without_a_gpu_says_so_in_one_line_and_measures_nothing(tmp_path):
    """benchmarks/gpu_kernels.sh (the kernels' figures a lent GPU measures) on a CPU machine: exit 1, one line."""
    result = subprocess.run(["bash", str(ROOT / "benchmarks" / "gpu_kernels.sh"), str(tmp_path / "out")],
                            capture_output=True, text=True, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 1 and result.stderr.count("\n") == 1 and "no CUDA GPU" in result.stderr
    assert not list((tmp_path / "out").iterdir())

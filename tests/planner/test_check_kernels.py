"""hcstudy/check_kernels.py, the GPU check's kernel tests, on the CPU: the selection against what pytest collects, a
JUnit report read into each arm's verdict, and the fallback's price on the --full matrix (the planner faked: its own
prices are held by tests/planner/test_plan_jobs.py and the dry run's tests). tests/planner/test_gpu_check.py runs the
part itself (--cpu-tiny) and a faked failure through the check's verdict and result.json."""
import subprocess
import sys
from pathlib import Path

import pytest

from hcstudy import check_kernels
from hcstudy.contract import METHODS
from hcstudy.durations import duration
from hcstudy.launcher.dry_run import queue_schedule

ROOT = Path(__file__).resolve().parents[2]
H100 = "NVIDIA H100 80GB HBM3"


def collected(ids):
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", "--collect-only", *ids],
                          capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [line.split("::")[-1] for line in done.stdout.splitlines() if "::" in line]


@pytest.mark.slow
def test_the_selection_is_what_pytest_collects_every_triton_arm_at_both_stream_dtypes_and_its_budget_counts_it():
    proven = check_kernels.triton_arms(METHODS)
    assert proven == ["hc", "mhc", "mhc-lite", "identity-hc"]
    names = collected(check_kernels.selection(METHODS, tiny=False))
    assert len(names) == check_kernels.CHUNK_CASES + len(proven)          # what the budget counts
    chunks = [name for name in names if "several_channel_chunks" in name]
    assert {check_kernels.case_arm(name) for name in chunks if name.startswith("test_widths")} == set(proven)
    assert {check_kernels.case_arm(name) for name in names if "bf16" in name} == set(proven)
    assert check_kernels.budget_s(METHODS, tiny=False) == check_kernels.START_S + (len(names) + 4) * \
        check_kernels.CASE_S
    assert collected(check_kernels.selection(METHODS, tiny=True)) == [
        "test_each_path_equals_the_formulas_forward_and_every_gradient[hc-triton-bf16]"]


JUNIT = """<?xml version="1.0" encoding="utf-8"?><testsuites><testsuite name="pytest">
<testcase classname="t" name="test_widths_over_several_channel_chunks[mhc-4-True]" />
<testcase classname="t" name="test_widths_over_several_channel_chunks[mhc-lite-3-True]"><failure
 message="AssertionError: x: 3e-3 &gt; 1e-5&#10;assert 0.003 &lt;= 1e-05">trace</failure></testcase>
<testcase classname="t" name="test_the_kernels_equal_the_formulas_at_bf16_streams[mhc-lite-triton]"><error
 message="RuntimeError: CUDA error: an illegal memory access">trace</error></testcase>
<testcase classname="t" name="test_the_kernels_equal_the_formulas_at_bf16_streams[hc-triton]"><skipped
 message="triton is not installed" /></testcase>
</testsuite></testsuites>"""


def test_a_junit_report_becomes_each_arms_verdict_with_its_first_failures_line(tmp_path):
    (tmp_path / "report.xml").write_text(JUNIT)
    cases = check_kernels.read_junit(tmp_path / "report.xml")
    assert [case[1] for case in cases] == ["passed", "failure", "error", "skipped"]
    assert cases[1][2] == "AssertionError: x: 3e-3 > 1e-5"                  # one line
    assert check_kernels.verdict("mhc", cases, "") == {"tests": "PASS", "cases": 1, "failed": 0, "reason": ""}
    assert check_kernels.verdict("mhc-lite", cases, "") == {
        "tests": "FAIL", "cases": 2, "failed": 2,
        "reason": "test_widths_over_several_channel_chunks[mhc-lite-3-True] failure: AssertionError: x: 3e-3 > 1e-5"}
    assert check_kernels.verdict("hc", cases, "")["reason"].endswith("skipped: triton is not installed")
    # no case of the arm: how pytest ended, else the first case that did not pass
    assert check_kernels.verdict("identity-hc", [], "out of time: pytest stopped after 60 s")["reason"] == \
        "out of time: pytest stopped after 60 s"
    assert check_kernels.verdict("identity-hc", cases, "")["reason"].startswith(
        "test_widths_over_several_channel_chunks[mhc-lite-3-True] failure")
    assert check_kernels.case_arm("test_x[identity-hc-3-True]") == "identity-hc"
    assert check_kernels.case_arm("test_x") is None


def test_a_pytest_that_runs_no_case_or_runs_out_of_time_says_so_in_one_line(tmp_path):
    cases, note = check_kernels.run_tests(["tests/kernels/no_such_file.py"], tmp_path, 120)
    assert cases == [] and note.startswith("pytest exited 4 and ran no case: ERROR: file or directory not found")
    cases, note = check_kernels.run_tests(check_kernels.selection(METHODS, tiny=True), tmp_path, 0.5)
    assert cases == [] and note == "out of time: pytest stopped after 1 s (kernel_tests.log)"


def test_each_arm_falls_back_to_its_other_kernel_path_else_the_formulas():
    assert [check_kernels.fallback_path(arm) for arm in ("hc", "mhc", "mhc-lite", "identity-hc")] == [
        "fused", "fused", "reference", "reference"]


@pytest.fixture
def planner(monkeypatch):
    """answer_jobs faked: every job 1-2 h, a job on the fused path 2-3 h; the requests kept."""
    requests = []

    def answer(request):
        requests.append(request)
        hours = [[2, 3] if job.flags[-2:] == ["--kernels", "fused"] else [1, 2] for job in request.jobs]
        return {"jobs": [dict(error=None, seconds=[h * 3600 for h in span]) for span in hours]}
    monkeypatch.setattr(check_kernels, "answer_jobs", answer)
    return requests


def test_the_fallback_is_priced_on_the_full_matrix_against_triton_in_hours_and_dollars(planner):
    line = check_kernels.fallback_line("hc", "fused", H100, 80.0)
    assert [request.gpu for request in planner] == [H100, H100] and planner[0].card_gib == 80.0
    for request, path in zip(planner, ("triton", "fused")):
        assert len(request.jobs) == 18          # 3 arms x 2 depths x 3 seeds
        for job in request.jobs:
            hc = job.flags[job.flags.index("--residual") + 1] == "hc"
            assert (job.flags[-2:] == ["--kernels", path]) == hc and job.flags.count("--kernels") == hc
    # the queue as the launcher runs it: 8 slots in queue order, launches 15 s apart (hc is every third job)
    fast = [queue_schedule([hours[i] * 3600] * 18, 8, 15) for hours in ([1, 2],) for i in (0, 1)]
    slow = [queue_schedule([(hc if j % 3 == 1 else other) * 3600 for j in range(18)], 8, 15)
            for hc, other in ((2, 1), (3, 2))]
    usd = [8 * 2.49 * seconds / 3600 for seconds in fast + slow]
    assert line == (f"hc falls back to fused: the --full matrix on 8 x {H100} takes {duration(*slow)}, "
                    f"${usd[2]:,.0f}-${usd[3]:,.0f}, against {duration(*fast)}, ${usd[0]:,.0f}-${usd[1]:,.0f} on "
                    f"triton: {duration(slow[0] - fast[0], slow[1] - fast[1])} and ${usd[2] - usd[0]:,.0f}-"
                    f"${usd[3] - usd[1]:,.0f} more at $2.49 per GPU-hour")
    assert "against 3-6 h, $60-$120 on triton" in line


def test_a_fallback_the_planner_cannot_price_says_why_in_one_line(planner, monkeypatch):
    assert check_kernels.fallback_line("mhc-lite", "reference", H100, 80.0) == (
        "mhc-lite falls back to reference: not in the --full matrix (baseline, hc, mhc), no cost to it")
    assert planner == []
    monkeypatch.setattr(check_kernels, "answer_jobs", lambda request: {"jobs": [
        dict(error="--micro-batch-size 1 does not fit" if job.flags[-1] == "fused" else None, seconds=None)
        for job in request.jobs]})
    assert check_kernels.fallback_line("mhc", "fused", H100, 80.0) == (
        "mhc falls back to fused: not priced, the planner refuses a job on fused: --micro-batch-size 1 does not fit")
    assert check_kernels.fallback_line("mhc", "reference", "NVIDIA B300", 80.0) == (
        "mhc falls back to reference: not priced, the planner has no rates for NVIDIA B300")

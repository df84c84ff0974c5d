"""The GPU check's first timed part: the Triton kernels proven on the card before anything is timed on them. The kernel
tests of tests/kernels run in a pytest process of their own (on CUDA they compile for this card: their DEVICE is
cuda there), every arm with a triton path at fp32 and bf16 streams, forward and backward against the formulas, at
widths that run several channel chunks; then each arm's self-check (what a run checks before it takes the path).
An arm that fails either falls back to another path, and the check says which and what that costs the --full
matrix. hcstudy/check_parts.py runs this part in its worker; result.json keeps each arm's record (`kernels`).
"""
from __future__ import annotations

import dataclasses
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

from hcstudy import ROOT, arms
from hcstudy.contract import PlanJob, PlanRequest
from hcstudy.durations import duration
from hcstudy.launcher import dry_run, jobs, options
from hcstudy.model import kernel_path
from hcstudy.planner.memory import GiB
from hcstudy.planner.plan_jobs import answer_jobs

OPS, PATHS = "tests/kernels/test_triton_ops.py", "tests/kernels/test_paths.py"
# the widths of several channel chunks at forced small blocks, forward and every gradient against the fp64 formulas:
# every arm at fp32 streams, then HC, mHC (both projections) and identity-HC at bf16: CHUNK_CASES cases in all
CHUNK_TESTS = (f"{OPS}::test_widths_over_several_channel_chunks",
               f"{OPS}::test_bf16_streams_over_several_channel_chunks")
CHUNK_CASES = 9         # tests/planner/test_check_kernels.py holds it to what pytest collects
PATHS_TEST = f"{PATHS}::test_each_path_equals_the_formulas_forward_and_every_gradient"    # arm x path x stream dtype

# Budgets: estimates, no GPU has timed these tests. A case compiles one connection's forward and backward kernels
# (4 for HC, 5 for the mHC family) for its own n, block sizes, width and stream dtype, then runs them on a few dozen
# tokens (milliseconds on a card): the compile dominates. benchmarks/triton_compile.py --smoke compiled 15 kernel
# variants for sm_90 in 6.4 s of CPU time on this project's 2-core CPU (a cold cache, imports apart), 0.43 s each: 2.2 s
# a case, budgeted at about twice that (a node's CPU assumed no faster). A self-check is one more such case.
CASE_S = 4.0
# pytest's process: python, torch, triton and the tests' modules (the trainer's) imported and the cases collected, 8 s
# on the 2-core CPU (3.7 s of CPU time), and the CUDA context
START_S = 10.0


def triton_arms(methods) -> list:
    return [method for method in methods if "triton" in arms.ARMS[method].kernels]


def selection(methods, tiny: bool) -> list:
    """The pytest node ids the part runs: the multi-chunk widths and every triton arm's bf16 case; --cpu-tiny: the
    first arm's bf16 case alone, in Triton's interpreter (seconds, where the whole selection takes minutes)."""
    proven = triton_arms(methods)
    if tiny:
        return [f"{PATHS_TEST}[{proven[0]}-triton-bf16]"]
    return [*CHUNK_TESTS, *(f"{PATHS_TEST}[{arm}-triton-bf16]" for arm in proven)]


def checked_arms(methods, tiny: bool) -> list:
    """The arms whose tests and self-check the part records."""
    return triton_arms(methods)[:1] if tiny else triton_arms(methods)


def budget_s(methods, tiny: bool) -> float:
    cases = 1 if tiny else CHUNK_CASES + len(triton_arms(methods))
    return START_S + (cases + len(checked_arms(methods, tiny))) * CASE_S


def sizes(methods, tiny: bool) -> str:
    proven = checked_arms(methods, tiny)
    cases = 1 if tiny else CHUNK_CASES + len(proven)
    what = "one bf16 case in the interpreter" if tiny else ("fp32 and bf16 streams, forward and backward against the "
                                                            "formulas, widths of several channel chunks")
    return f"{cases} pytest cases of tests/kernels compiled for this card ({what}), then a self-check each: " \
        + ", ".join(proven)


# ---------------------------------------------------------------------------------------------
# the part


def prove(ctx, methods, until: float) -> dict:
    """{arm: its record}: the tests' verdict, the self-check's path and why, and for an arm that failed either the
    path it falls back to with what that costs the --full matrix (priced while time is left before `until`)."""
    with tempfile.TemporaryDirectory(prefix="check_kernels.") as scratch:     # where no folder is given (tests)
        cases, note = run_tests(selection(methods, ctx.tiny), ctx.folder or scratch, until - time.time())
    found = {}
    for arm in checked_arms(methods, ctx.tiny):
        path, why = kernel_path(dataclasses.replace(ctx.small_config(arm), kernels="triton"), ctx.device)
        found[arm] = {**verdict(arm, cases, note), "path": path, "why": why, "fallback": ""}
        if found[arm]["tests"] == "FAIL" or path != "triton":
            fallback = fallback_path(arm)
            found[arm]["fallback"] = fallback_line(arm, fallback, ctx.gpu, ctx.card / GiB) \
                if time.time() < until else f"{arm} falls back to {fallback}: not priced, no time left"
        say(arm, found[arm])
    return found


def run_tests(ids: list, folder, limit: float) -> tuple[list, str]:
    """The cases (name, outcome, message) pytest ran within `limit` seconds (its output in kernel_tests.log), and a
    note on how it ended where it reported none."""
    log, report, limit = Path(folder) / "kernel_tests.log", Path(folder) / "kernel_tests.xml", max(1.0, limit)
    report.unlink(missing_ok=True)          # an earlier check's, which a pytest that died would leave to be read
    command = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-q", f"--junitxml={report}", *ids]
    with open(log, "w") as out:
        try:
            code = subprocess.run(command, stdout=out, stderr=subprocess.STDOUT, cwd=ROOT,
                                  timeout=limit).returncode
        except subprocess.TimeoutExpired:
            return [], f"out of time: pytest stopped after {limit:.0f} s (kernel_tests.log)"
    try:
        cases = read_junit(report)
    except (OSError, ElementTree.ParseError):       # it died before writing one
        cases = []
    if cases:
        return cases, ""
    with open(log) as out:
        tail = ([line.strip() for line in out if line.strip()] or [""])[-1]
    return [], f"pytest exited {code} and ran no case: {tail[:200]} (kernel_tests.log)"


def read_junit(path) -> list:
    """(test name, passed / failure / error / skipped, the first line of its message) of each case in a JUnit XML (a
    module skipped whole says why in its text, not its message)."""
    cases = []
    for case in ElementTree.parse(path).iter("testcase"):
        outcome = next(((child.tag, (child.text if child.tag == "skipped" else None) or child.get("message") or "")
                        for child in case if child.tag in ("failure", "error", "skipped")), ("passed", ""))
        cases.append((case.get("name", ""), outcome[0], (outcome[1].strip().splitlines() or [""])[0][:300]))
    return cases


def case_arm(name: str) -> str | None:
    """The arm a case tests: its parameters' id starts with it (test_x[hc-4-True] is hc's)."""
    params = name.partition("[")[2].rstrip("]")
    return next((arm for arm in sorted(arms.METHODS, key=len, reverse=True)
                 if params == arm or params.startswith(f"{arm}-")), None)


def verdict(arm: str, cases: list, note: str) -> dict:
    """PASS where every case of the arm passed (a skipped one proves nothing), else FAIL with its first failure's
    line."""
    mine = [case for case in cases if case_arm(case[0]) == arm]
    failed = [case for case in mine if case[1] != "passed"]
    # no case of its own: how pytest ended, or what stopped every case (a module skipped: triton not installed)
    stray = next((f"{case[0]} {case[1]}: {case[2]}" for case in cases if case[1] != "passed"), "")
    reason = f"{failed[0][0]} {failed[0][1]}: {failed[0][2]}" if failed else "" if mine else \
        note or stray or "no case of it ran (kernel_tests.log)"
    return {"tests": "FAIL" if failed or not mine else "PASS", "cases": len(mine), "failed": len(failed),
            "reason": reason}


def fallback_path(arm: str) -> str:
    """The path a run of the arm takes without triton: the other kernel path it registers (fused), else the formulas."""
    return next((path for path in reversed(arms.ARMS[arm].kernels) if path != "triton"), "reference")


def fallback_line(arm: str, fallback: str, gpu: str, card_gib: float) -> str:
    """One line: the arm falls back to `fallback`, and the --full matrix's wall time and dollars with its jobs on
    triton against on the fallback, planned by the trainer's planner (as the dry run plans them) on the documented
    node of 8 of this card."""
    with tempfile.TemporaryDirectory(prefix="check_kernels.") as out:      # priced as if none of it had run
        opt = options.parse_options(["--full", "--dry-run", "--out", out])
        matrix = jobs.matrix_jobs(opt)
        if arm not in opt.methods:
            return f"{arm} falls back to {fallback}: not in the --full matrix ({', '.join(opt.methods)}), no cost to it"
        node = dry_run.Node([str(i) for i in range(jobs.DOCUMENTED_NODE_GPUS)], gpu, card_gib, documented=True)
        priced = {}
        for path in ("triton", fallback):
            request = PlanRequest(gpu, 1, card_gib, [PlanJob(jobs.trainer_flags(opt, job) + (
                ["--kernels", path] if job.method == arm else [])) for job in matrix])
            answers = answer_jobs(request)["jobs"]
            refused = next((answer["error"] for answer in answers if answer["error"]), None)
            if refused:
                return f"{arm} falls back to {fallback}: not priced, the planner refuses a job on {path}: {refused}"
            priced[path] = dry_run.matrix_time(opt, matrix, {job.name: a for job, a in zip(matrix, answers)}, node)
    if None in priced.values():
        return f"{arm} falls back to {fallback}: not priced, the planner has no rates for {gpu}"
    (_, fast, _, fast_usd), (_, slow, _, slow_usd) = priced["triton"], priced[fallback]
    more = [slow[i] - fast[i] for i in (0, 1)]
    return (f"{arm} falls back to {fallback}: the --full matrix on {len(node.gpus)} x {gpu} takes {duration(*slow)}, "
            f"${slow_usd[0]:,.0f}-${slow_usd[1]:,.0f}, against {duration(*fast)}, ${fast_usd[0]:,.0f}-"
            f"${fast_usd[1]:,.0f} on triton: {duration(*more)} and ${slow_usd[0] - fast_usd[0]:,.0f}-"
            f"${slow_usd[1] - fast_usd[1]:,.0f} more at ${opt.price:.2f} per GPU-hour")


def say(arm: str, record: dict) -> None:
    tests = f"{record['tests']} ({record['cases'] - record['failed']} of {record['cases']} cases)"
    print(f"      {arm:<12} kernel tests {tests}{': ' + record['reason'] if record['reason'] else ''}; "
          f"self-check: {record['path']} ({record['why']})", flush=True)
    if record["fallback"]:
        print(f"      {record['fallback']}", flush=True)

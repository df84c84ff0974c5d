"""The GPU path checked in one command of under 10 minutes on one GPU: what a CPU machine cannot check.

    bash run_experiments.sh --check [--out runs]      # this script, with the venv's python
    bash run_experiments.sh --check --dry-run         # no GPU needed: every part, its sizes and budget, the total

Parts, each with its time budget printed before it starts (hcstudy/check_parts.py runs all but FSDP in one process,
`python -m hcstudy.check_parts`):
  kernel tests  first: tests/kernels' Triton tests compiled for this card (every arm with a triton path, fp32 and bf16
                streams, forward and backward against the formulas, widths of several channel chunks) in a pytest
                process, then each arm's self-check; an arm that fails falls back to another path, and the check says
                which and what that costs the --full matrix in hours and dollars (hcstudy/check_kernels.py)
  environment   bf16 on the card; flash-attn installed, else PyTorch SDPA's flash backend run
  timings       every arm of the registry (hcstudy/arms/) built once at width 2048, depth 4, 8 x 1024 tokens
                a step and timed on every --kernels path it has (reference, fused, triton): the trainer's auto
                takes the fastest timed on this GPU (result.json's timings)
  rehearsals    the study's real sizes, every arm at depths 32 and 48 (baseline, hc, mhc always, the other two when
                the budget allows): the GPT-2 vocabulary, 1024 tokens, at the micro-batch, activation checkpointing,
                path and stream dtype the planner picks for this card, a few of the trainer's optimizer steps on random
                tokens; the baseline at depth 32 with each lever (check_parts.VARIANTS); mhc at depth 48 one
                micro-batch above the plan, where an out-of-memory error is the result and the check goes on
  FSDP          the trainer under torchrun --parallel fsdp (one process): a checkpoint, then a resume
Verdicts, one PASS/FAIL line each: kernels (every arm's tests and self-check), bf16, attention, compile (every
compiled rehearsal trained), memory plan (every rehearsal at its planned micro-batch within its plan's allocated
peak), step model (the baseline at depth 32 within half and twice its modelled range), MFU (the baseline's at depth
32), FSDP.

Writes {out}/gpu_check/: result.json (its format: contract.py and docs/planning.md; the planner prices a rehearsed
job shape from its row in `rehearsals`, other jobs from `methods`), events.jsonl (every result as it came),
worker.log, and FSDP's logs and run folder. Without a CUDA GPU it prints one line and exits 1: nothing was checked.
"""
import argparse
import json
import os
import subprocess
import sys
import time

from hcstudy import ROOT, check_parts
from hcstudy.config_flags import OneLineErrorParser
from hcstudy.contract import STATUS_FILE, ConfigError, check_path, check_result, write_json_atomic

PROG = "run_experiments.sh --check"
GRACE_S = 30            # past its deadline a worker is killed: its parts stop themselves at the deadline
RESTARTS = 2            # a worker that died (a crash, not a failed part) is started again for the parts not yet run


def parse_args(argv):
    p = OneLineErrorParser(prog=PROG, description=__doc__.splitlines()[0], error_type=ConfigError,
                           hint=" (it takes --out DIR, --budget SECONDS and --dry-run only)")
    p.add_argument("--out", default="runs", help="the runs folder; results go to OUT/gpu_check (default runs)")
    p.add_argument("--budget", type=float, default=check_parts.BUDGET_S, help="seconds for the whole check; the "
                   f"parts that do not fit are left out or reported out of time (default {check_parts.BUDGET_S})")
    p.add_argument("--dry-run", action="store_true", help="print every part, its sizes and time budget, and the "
                   "total; no GPU needed, nothing run")
    # the tests' CPU mode: every part at a few thousand parameters, an out-of-memory error simulated (check_parts.py)
    p.add_argument("--cpu-tiny", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.out:
        p.error("--out must not be empty")
    return args


class Check:
    """The verdicts so far, and the budget's clock."""

    def __init__(self, folder, budget=check_parts.BUDGET_S):
        self.folder, self.started, self.parts, self.budget = folder, time.monotonic(), {}, budget
        self.deadline = time.time() + budget - check_parts.CHECK_START_S     # the clock ran before this process did

    def left(self):
        return self.deadline - time.time()

    def run(self, name, command, limit):
        """Run one command to name.log; its exit status (124: out of time, or no time left to start it)."""
        limit = min(limit, self.left())
        if limit < 10:
            return 124
        with open(self.folder / f"{name}.log", "w") as log:
            try:
                return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=quiet_env(),
                                      timeout=limit).returncode
            except subprocess.TimeoutExpired:
                return 124

    def verdict(self, part, ok, detail):
        """PASS or FAIL; None: not judged (SKIP), e.g. on the CPU."""
        self.parts[part] = "SKIP" if ok is None else "PASS" if ok else "FAIL"
        print(f"{self.parts[part]}  {part:<12} {detail}", flush=True)


def quiet_env():
    return {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}


def worker_command(args, budget, deadline=0.0, events=None, skip=(), plan_only=False):
    return [sys.executable, "-m", "hcstudy.check_parts", "--budget", f"{budget:.1f}", "--deadline", f"{deadline:.1f}",
            *(["--events", str(events)] if events else []), *(f"--skip={name}" for name in skip),
            *(["--plan-only"] if plan_only else []), *(["--cpu-tiny"] if args.cpu_tiny else [])]


def dry_run(args):
    """Every part the check would run, its sizes and budget, in order, and `total: N s`: planned by the worker for
    this GPU, else for the documented node's card, on the CPU."""
    done = subprocess.run(worker_command(args, check_parts.worker_budget(args.budget, args.cpu_tiny), plan_only=True),
                          capture_output=True, text=True, cwd=ROOT, env=quiet_env())
    try:
        plan = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = " ".join(done.stderr.strip().splitlines()[-1:]) or f"exit {done.returncode}"
        print(f"{PROG} --dry-run: the parts could not be planned ({tail})", file=sys.stderr)
        return 1
    before, after = check_parts.check_parts_around(args.cpu_tiny)
    parts = before + [check_parts.Part(**part) for part in plan["parts"]] + after
    assumed = "" if plan["assumed"] is False else " (assumed: no CUDA device here)"
    print(f"{PROG} --dry-run: the parts on one {plan['gpu']}{assumed}, {plan['card_gib']:.1f} GiB, in "
          f"{args.budget:.0f} s; nothing is run")
    print("\n".join(check_parts.plan_lines(parts, args.budget)))
    return 0


def run_worker(check, args):
    """The worker process(es): once, and again for the parts not yet run if one died in a part (recorded failed).
    Its stdout is this one's; its stderr goes to worker.log. Returns every event."""
    events_file, skip, crashed = check.folder / "events.jsonl", [], []
    events_file.unlink(missing_ok=True)
    deadline = check.deadline - sum(p.budget_s for p in check_parts.check_parts_around(args.cpu_tiny)[1])
    budget = check_parts.worker_budget(check.budget, args.cpu_tiny)
    for attempt in range(1 + RESTARTS):
        with open(check.folder / "worker.log", "a") as log:
            try:
                code = subprocess.run(worker_command(args, budget, deadline, events_file, skip), stderr=log, cwd=ROOT,
                                      env=quiet_env(), timeout=max(1.0, deadline - time.time() + GRACE_S)).returncode
            except subprocess.TimeoutExpired:
                code = 124
        events = read_events(events_file)
        started = [e["part"] for e in events if e["event"] == "start"]
        ended = {e["part"] for e in events if e["event"] == "end"}
        crashed += [(name, code) for name in started if name not in ended and name not in dict(crashed)]
        if code in (0, 124) or time.time() + check_parts.WORKER_START_S > deadline:
            break
        print(f"      the worker exited {code} in {crashed[-1][0] if crashed else 'its start-up'} (worker.log); "
              "starting it again for the parts left", flush=True)
        skip = started
    return events + [{"event": "crashed", "part": name, "exit": code} for name, code in crashed]


def read_events(path):
    try:
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return []


def results(events):
    """From the events: the card, the environment, the timings table {method: {"path/eager": stats or None}}, the
    rehearsal rows (a part whose process died in it recorded as failed), and the kernels' record per arm ({}: not
    run; None: the process died in their part)."""
    plans = [e for e in events if e["event"] == "plan"]
    plan = {part["name"]: check_parts.Part(**part) for part in plans[-1]["parts"]} if plans else {}
    device = {k: plans[0][k] for k in ("gpu", "torch", "cuda")} if plans else {}
    table = {}
    for e in (e for e in events if e["event"] == "timing"):
        table.setdefault(e["method"], {})[f"{e['path']}/eager"] = e["stats"]
    rows = [e["row"] for e in events if e["event"] == "rehearsal"]
    for e in (e for e in events if e["event"] == "crashed"):
        part = plan.get(e["part"])
        if part is not None and part.kind == "rehearsal":
            rows.append(check_parts.unshaped_row(device.get("gpu"), part, "failed", f"the process died in it (exit "
                                                 f"{e['exit']}; worker.log)"))
    environment = next((e for e in events if e["event"] == "environment"), None)
    started = {e["part"] for e in events if e["event"] == "start"}
    died = any(part.kind == "kernels" and name in started for name, part in plan.items())
    kernels = next((e["arms"] for e in events if e["event"] == "kernels"), None if died else {})
    return device, environment, table, rows, kernels


def judge_kernels(check, kernels):
    """PASS where every arm's kernel tests passed and its self-check took triton; each failing arm's fallback line."""
    if not kernels:
        check.verdict("kernels", None if kernels == {} else False, "not run" if kernels == {} else
                      "the worker died in the kernel tests (worker.log, kernel_tests.log)")
        return
    failing = {arm: record for arm, record in kernels.items()
               if record["tests"] == "FAIL" or record["path"] != "triton"}
    cases = sum(record["cases"] for record in kernels.values())
    passed = cases - sum(record["failed"] for record in kernels.values())
    check.verdict("kernels", not failing, f"{passed} of {cases} cases passed; self-check " + ", ".join(
        f"{arm} {record['path']}" for arm, record in kernels.items()) + (
        f"; failed: {', '.join(failing)} (kernel_tests.log)" if failing else ""))
    for arm, record in failing.items():
        print(f"      {arm}: {record['reason'] or record['why']}", flush=True)
        print(f"      {record['fallback']}", flush=True)


def fastest(table):
    """Per method, the stats of its fastest timed path (what a run with the right flags gets)."""
    best = {}
    for method, paths in table.items():
        timed = {path: s for path, s in paths.items() if s}
        if timed:
            path = min(timed, key=lambda p: timed[p]["step_s"])
            best[method] = {**timed[path], "path": path}
    return best


def planned(rows):
    """The rows at a micro-batch the planner picked (not the one above it)."""
    return [row for row in rows if not row["over_plan"]]


def judge(check, environment, table, rows):
    """Each part's verdict, and the over-the-plan rehearsal's outcome."""
    env = environment or {}
    check.verdict("bf16", env.get("bf16"), "torch.cuda.is_bf16_supported()" + (" (no part ran)" if not env else ""))
    attention = "flash-attn installed" if env.get("flash_attn") else "PyTorch SDPA flash backend"
    check.verdict("attention", None if env.get("sdpa_flash") is None else env["sdpa_flash"] or env["flash_attn"],
                  f"{attention}{'; ' + env['error'] if env.get('error') else ''}")
    compiled = [row for row in rows if row["compile"]]
    if compiled:
        check.verdict("compile", all(row["status"] == "ok" for row in compiled), ", ".join(
            f"{row['method']} d{row['depth']} {row['status']}" for row in compiled))
    judge_memory(check, rows)
    judge_step(check, rows)
    over = [row for row in rows if row["over_plan"]]
    for row in over:
        verdict = ("ran out of memory, as the plan expects: its limit is the card's" if row["status"] == "oom" else
                   f"trained: the plan is cautious by at least one micro-batch (peak {row['peak_alloc_gib']:.1f} GiB)"
                   if row["status"] == "ok" and row["peak_alloc_gib"] else f"{row['status']}: {row['reason']}")
        print(f"      over the plan: {row['method']} d{row['depth']} at micro-batch {row['micro_batch']}: {verdict}")
    for method, s in fastest(table).items():
        print(f"      {method:<11} fastest {s['path']}: {s['step_s']:.4f} s/step, {s['tokens_per_s']:,.0f} tok/s at "
              "the small size", flush=True)


def judge_memory(check, rows):
    runs = [row for row in planned(rows) if row["status"] in ("ok", "oom")]
    measured = [row for row in runs if row["status"] == "ok" and row["peak_alloc_gib"] is not None]
    out_of_memory = [f"{row['method']} d{row['depth']} x{row['micro_batch']}" for row in runs if row["status"] == "oom"]
    worst = max(measured, key=lambda row: row["peak_alloc_gib"] / row["planned_alloc_gib"], default=None)
    detail = (f"{len(measured)} shapes measured; closest to its plan: {worst['method']} d{worst['depth']} "
              f"{worst['peak_alloc_gib']:.1f} of {worst['planned_alloc_gib']:.1f} GiB" if worst else "no peak measured")
    ok = None if not runs or not (measured or out_of_memory) else \
        not out_of_memory and all(row["peak_alloc_gib"] <= row["planned_alloc_gib"] for row in measured)
    check.verdict("memory plan", ok, detail + (f"; out of memory at the planned micro-batch: "
                                               f"{', '.join(out_of_memory)}" if out_of_memory else ""))


def baseline_row(rows):
    """The baseline's rehearsal at the shallower depth, no lever: the step every arm's cost is set against."""
    shallow = min((row["depth"] for row in rows), default=None)
    return next((row for row in planned(rows) if row["method"] == "baseline" and row["depth"] == shallow
                 and not row["variant"]), None)


def judge_step(check, rows):
    base = baseline_row(rows)
    timed = [row for row in rows if row["status"] == "ok" and row["modelled_step_s"]]
    inside = sum(low <= row["step_s"] <= high for row in timed for low, high in [row["modelled_step_s"]])
    if base is None or base["status"] != "ok":
        check.verdict("step model", False, f"the baseline was not timed ({base['reason'] if base else 'no row'})")
        check.verdict("MFU", False, "the baseline was not timed")
        return
    low, high = base["modelled_step_s"] or (None, None)
    on_cpu = base["gpu"] == "cpu"           # --cpu-tiny: the CPU's rates are timed under the load of the moment
    check.verdict("step model", None if on_cpu else bool(low) and low / 2 <= base["step_s"] <= 2 * high,
                  f"baseline d{base['depth']} {base['step_s']:.3f} s/step against the planner's {low:.3f}-{high:.3f} s;"
                  f" PASS within half and twice of it; {inside} of {len(timed)} rehearsals inside their range"
                  if low else "no model for this GPU: its bf16 peak or bandwidth is not in hcstudy/planner")
    mfu = base["mfu"]
    check.verdict("MFU", None if on_cpu else mfu is not None,
                  f"baseline d{base['depth']} {mfu:.1%}" if mfu is not None else
                  "unknown: no bf16 peak for this card (hcstudy/planner/gpus.py)")


def fsdp(check, runs, tiny):
    """A torchrun run with --parallel fsdp that checkpoints at step 3, then its resume to step 6."""
    part = check_parts.check_parts_around(tiny)[1][0]
    print(f"part  {part.name:<34} {part.budget_s:6.0f} s  {part.sizes}", flush=True)
    flags = [*(check_parts.TINY_FSDP_FLAGS if tiny else check_parts.FSDP_FLAGS), "--out", str(runs),
             "--run-name", "fsdp"]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "train_c4.py"]
    first = check.run("fsdp", [*torchrun, *flags, "--steps", "3"], part.budget_s)
    second = check.run("fsdp_resume", [*torchrun, *flags, "--steps", "6", "--resume", "auto",
                                       "--allow-changed-settings"], part.budget_s)
    try:
        status = json.loads((runs / "fsdp" / STATUS_FILE).read_text())
    except (OSError, ValueError):
        status = {}
    check.verdict("FSDP", first == 0 and second == 0 and status.get("step") == 6,
                  f"exits {first}, {second}; resumed run at step {status.get('step')} of 6 (fsdp.log, fsdp_resume.log)")


def write_result(out, device, parts, table, rows, tiny=False, kernels=None):
    """{out}/gpu_check/result.json (contract.check_result): per method its fastest path's step with what the planner
    needs to scale it (`methods`), every path's figures under `timings`, the rehearsals' rows, and per arm its kernel
    tests and self-check (`kernels`)."""
    flags = check_parts.TINY_SMALL if tiny else check_parts.SMALL
    tokens = int(flags[flags.index("--micro-batch-size") + 1]) * int(flags[flags.index("--seq-len") + 1])
    result = check_result(device, flags, tokens, parts, table, fastest(table), {}, rows, kernels)
    result["cross_entropy"] = check_parts.loss_timings(rows)     # what --cross-entropy auto takes on this GPU
    check_path(out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(check_path(out), result)          # a reader never sees half a file


def main(argv=None):
    try:
        args = parse_args(argv)
    except ConfigError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    if args.dry_run:
        return dry_run(args)
    import torch
    if not torch.cuda.is_available() and not args.cpu_tiny:
        print(f"{PROG}: no CUDA GPU visible (torch {torch.__version__}, "
              f"{'CUDA ' + torch.version.cuda if torch.version.cuda else 'a CPU-only build'}): nothing was checked; "
              "run it on the GPU node", file=sys.stderr)
        return 1
    folder = check_path(args.out).parent
    runs = folder / "runs"
    try:
        runs.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        print(f"{PROG}: cannot create {runs}: {error.strerror}", file=sys.stderr)
        return 1
    check = Check(folder, args.budget)
    print(f"{PROG}: torch {torch.__version__}, {args.budget:.0f} s; logs and run folders in {folder}", flush=True)
    device, environment, table, rows, kernels = results(run_worker(check, args))
    fsdp(check, runs, args.cpu_tiny)
    judge_kernels(check, kernels)
    judge(check, environment, table, rows)
    write_result(args.out, device, check.parts, table, rows, args.cpu_tiny, kernels)
    failed = [part for part, verdict in check.parts.items() if verdict == "FAIL"]
    print(f"{PROG}: {sum(v == 'PASS' for v in check.parts.values())} of {len(check.parts)} parts passed"
          + (f"; failed: {', '.join(failed)} (their logs in {folder})" if failed else "")
          + f"; {folder / 'result.json'} written in {time.monotonic() - check.started:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

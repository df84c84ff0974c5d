"""The GPU path checked in one command of under 10 minutes on one GPU: what a CPU machine cannot check.

    bash run_experiments.sh --check [--out runs]      # this script, with the venv's python

Parts, each under its own time limit, one PASS/FAIL line each:
  bf16, attention   the card's bf16 support; flash-attn installed, else PyTorch SDPA's flash backend run
  timings           the trainer (train_c4.py, bundled sample, GPT-2 BPE, bf16) for a few steps per method
                    (baseline, hc, mhc, mhc-lite, identity-hc) on every --kernels path that has it (reference,
                    fused, triton), eager; then each method with --compile on its fastest eager path; width 2048,
                    depth 4, 8 x 1024 tokens per step: median step time, tokens/s, MFU, peak memory. The trainer's
                    auto takes the fastest path timed here (result.json's timings)
  compile           every --compile run finished
  memory plan       the trainer's --estimate allocated peak against the measured one (mHC, eager)
  step model, MFU   every eager step against the planner's modelled range (run_time.step_cost); the baseline's MFU
  FSDP              the trainer under torchrun --parallel fsdp (one process): a checkpoint, then a resume

Writes {out}/gpu_check/: result.json (its format: docs/planning.md; the dry run's planner reads its
`methods`), each part's log, and the run folders of the timed runs.
Without a CUDA GPU it prints one line and exits 1: nothing was checked.
"""
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time
from types import SimpleNamespace

from hcstudy import ROOT
from hcstudy.config_flags import OneLineErrorParser
from hcstudy.contract import (CHECKPOINTS, CONFIG_FILE, METHODS, METRICS_FILE, PLAN_JOBS, STATUS_FILE, ConfigError,
                              PlanJob, PlanRequest, check_path, check_result, read_json, read_plan_answer,
                              write_json_atomic)
from hcstudy.planner import gpus

PROG = "run_experiments.sh --check"
BUDGET_S = 570                     # the whole check, so that it ends within 10 minutes with its start-up
KERNELS = ("reference", "fused", "triton")
STEPS, WARM_STEPS = 10, 4          # median over the steps after the first WARM_STEPS (compile, allocator, loader)
SIZE = ["--data", "sample", "--tokenizer", "gpt2", "--dtype", "bf16", "--width", "2048", "--depth", "4",
        "--seq-len", "1024", "--batch-size", "8", "--micro-batch-size", "8", "--warmup", "2",
        "--eval-every", "1000", "--eval-batches", "1", "--metrics-every", "1000", "--layer-metrics-every", "1000",
        "--log-every", "1", "--ckpt-every", "1000", "--data-workers", "1", "--wandb", "disabled", "--resume", "never"]
TOKENS_PER_STEP = 8 * 1024


def parse_args(argv):
    p = OneLineErrorParser(prog=PROG, description=__doc__.splitlines()[0], error_type=ConfigError,
                           hint=" (it takes --out DIR and --budget SECONDS only)")
    p.add_argument("--out", default="runs", help="the runs folder; results go to OUT/gpu_check (default runs)")
    p.add_argument("--budget", type=float, default=BUDGET_S, help="seconds for the whole check; the parts that "
                   f"do not fit are reported out of time (default {BUDGET_S})")
    args = p.parse_args(argv)
    if not args.out:
        p.error("--out must not be empty")
    return args


class Check:
    """Runs the parts in order, each with a time limit taken from what is left of BUDGET_S."""

    def __init__(self, folder, budget=BUDGET_S):
        self.folder, self.started, self.parts, self.budget = folder, time.monotonic(), {}, budget

    def left(self):
        return self.budget - (time.monotonic() - self.started)

    def run(self, name, command, limit):
        """Run one command to name.log; its exit status (124: out of time, or no time left to start it)."""
        limit = min(limit, self.left())
        if limit < 10:
            return 124
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
        with open(self.folder / f"{name}.log", "w") as log:
            try:
                return subprocess.run(command, stdout=log, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                      timeout=limit).returncode
            except subprocess.TimeoutExpired:
                return 124

    def verdict(self, part, ok, detail):
        self.parts[part] = "PASS" if ok else "FAIL"
        print(f"{self.parts[part]}  {part:<12} {detail}", flush=True)


def environment(check):
    """bf16 and attention, from one small program on the card."""
    probe = ("import importlib.util, torch, torch.nn.functional as F\n"
             "from torch.nn.attention import SDPBackend, sdpa_kernel\n"
             "print('bf16', torch.cuda.is_bf16_supported())\n"
             "print('flash_attn', importlib.util.find_spec('flash_attn') is not None)\n"
             "q = torch.randn(2, 16, 1024, 128, device='cuda', dtype=torch.bfloat16)\n"
             "with sdpa_kernel(SDPBackend.FLASH_ATTENTION):\n"
             "    F.scaled_dot_product_attention(q, q, q, is_causal=True)\n"
             "print('sdpa_flash True')\n")
    code = check.run("environment", [sys.executable, "-c", probe], 90)
    said = dict(line.split() for line in (check.folder / "environment.log").read_text().splitlines()
                if re.fullmatch(r"\w+ (True|False)", line))
    check.verdict("bf16", said.get("bf16") == "True", "torch.cuda.is_bf16_supported()")
    attention = "flash-attn installed" if said.get("flash_attn") == "True" else "PyTorch SDPA flash backend"
    check.verdict("attention", said.get("sdpa_flash") == "True" or said.get("flash_attn") == "True",
                  f"{attention} (exit {code}; environment.log)")


def step_stats(run_dir):
    """Median step seconds, tokens/s, MFU and the peak memory over the steps after the warm-up, with the FLOPs per
    token of the run's configuration (the planner scales the measured rate to other depths by them), or None."""
    try:
        lines = [json.loads(line) for line in (run_dir / METRICS_FILE).read_text().splitlines() if line.strip()]
    except (OSError, ValueError):
        return None
    steps = [r for r in lines if isinstance(r.get("step_time_s"), (int, float)) and r["step"] > WARM_STEPS]
    if not steps:
        return None
    mfus = [r["mfu"] for r in steps if isinstance(r.get("mfu"), (int, float))]
    return {"step_s": statistics.median(r["step_time_s"] for r in steps),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steps),
            "mfu": statistics.median(mfus) if mfus else None,
            "mem_peak_gb": max((r.get("mem_peak_gb") or 0.0) for r in steps),
            "flops_per_token": timed_flops_per_token(run_dir)}


def timed_flops_per_token(run_dir):
    """FLOPs per token of a timed run, from the settings and parameter counts its config.json records; None without."""
    record = read_json(run_dir / CONFIG_FILE, {})
    try:
        return gpus.flops_per_token(SimpleNamespace(**record["config"]), record["params"]["non_embedding"])
    except (KeyError, TypeError):
        return None


def timings(check, runs, gpu, card_gib):
    """Every method on every kernel path that has it (the trainer's plan takes that path), eager; then each method
    compiled on its fastest eager path (a compile of every path would not fit the budget):
    {method: {"kernels/mode": stats or None}}."""
    plans = trainer_plans(gpu, card_gib, {m: KERNELS if m != "baseline" else ("reference",) for m in METHODS})
    table = {m: {} for m in METHODS}
    for path in KERNELS:                   # eager first: the plan's numbers before the slower compile runs
        for method in METHODS:
            if path == "reference" or plans.get(method, {}).get(path, {}).get("path") == path:
                table[method][f"{path}/eager"] = timed_run(check, runs, method, path, "eager")
    for method in METHODS:
        eager = {key.split("/")[0]: s["step_s"] for key, s in table[method].items() if s}
        if eager:
            path = min(eager, key=eager.get)
            table[method][f"{path}/compile"] = timed_run(check, runs, method, path, "compile")
    return table


def arm_flags(method, path):
    """The timed size for one arm on one kernel path. The baseline has no streams, so no --kernels (the trainer
    refuses a flag that changes nothing)."""
    return [*SIZE, "--residual", method, *(["--kernels", path] if method != "baseline" else [])]


def trainer_plans(gpu, card_gib, paths):
    """The trainer's plan (`train_c4.py --plan-jobs`, in one subprocess: the package never imports the trainer) of
    each arm on each of its `paths` ({method: paths}) at the timed size on this GPU, modelled (no GPU check given):
    {method: {path: JobAnswer as a dict}}; {} where the trainer gave no answer."""
    pairs = [(method, path) for method, method_paths in paths.items() for path in method_paths]
    request = PlanRequest(gpu, 1, card_gib, [PlanJob(arm_flags(method, path)) for method, path in pairs])
    try:
        done = subprocess.run([sys.executable, str(ROOT / "train_c4.py"), PLAN_JOBS], input=request.to_json(),
                              capture_output=True, text=True, cwd=ROOT, timeout=300)
        answers = read_plan_answer(done.stdout, pairs)["jobs"]
    except (OSError, subprocess.SubprocessError, ValueError, IndexError, KeyError, TypeError):
        return {}
    plans = {}
    for (method, path), answer in answers.items():
        plans.setdefault(method, {})[path] = answer
    return plans


def timed_run(check, runs, method, path, mode):
    """One trainer run of STEPS steps; its step stats, or None."""
    name = f"{method}_{path}_{mode}"
    flags = [*arm_flags(method, path), "--steps", str(STEPS), "--out", str(runs), "--run-name", name,
             *(["--compile"] if mode == "compile" else [])]
    code = check.run(name, [sys.executable, "train_c4.py", *flags], 240)
    stats = step_stats(runs / name) if code == 0 else None
    shutil.rmtree(runs / name / CHECKPOINTS, ignore_errors=True)    # GBs each, not needed
    shown = "out of time" if code == 124 else f"exit {code}" if code else \
        f"{stats['step_s']:.3f} s/step, {stats['tokens_per_s']:,.0f} tok/s" if stats else "no timed steps"
    print(f"      {name:<30} {shown}", flush=True)
    return stats


def fastest(table):
    """Per method, the stats of its fastest timed path (what a run with the right flags gets)."""
    best = {}
    for method, paths in table.items():
        timed = {path: s for path, s in paths.items() if s}
        if timed:
            path = min(timed, key=lambda p: timed[p]["step_s"])
            best[method] = {**timed[path], "path": path}
    return best


def planned_allocated_gb(check):
    """The allocated peak (GB) that the trainer's --estimate plans for the timed mHC run, or None."""
    command = [sys.executable, "train_c4.py", *SIZE, "--residual", "mhc", "--estimate"]
    check.run("estimate", command, 60)
    try:
        found = re.search(r"allocated peak.*?= ([0-9.]+) GB", (check.folder / "estimate.log").read_text())
    except OSError:                        # no time was left to run it
        found = None
    return float(found.group(1)) if found else None


def modelled_steps(table, gpu, card_gib=None):
    """The planner's step range (seconds) for every timed arm and path on this GPU, as the trainer plans it:
    {method: {path: (low, high)}}; none for an arm whose step it cannot model on this GPU."""
    paths = {method: sorted({key.split("/")[0] for key in timed}) for method, timed in table.items()}
    plans = trainer_plans(gpu, card_gib, paths)
    return {method: {path: tuple(answer["step_seconds"]) for path, answer in paths.items() if answer["step_seconds"]}
            for method, paths in plans.items() if any(answer["step_seconds"] for answer in paths.values())}


def inside_count(table, model):
    eager = [(s["step_s"], model[m][key.split("/")[0]]) for m, paths in table.items() for key, s in paths.items()
             if s and key.endswith("/eager") and m in model]
    return f"{sum(low <= step <= high for step, (low, high) in eager)} of {len(eager)}"


def judge(check, table, planned, model, gpu):
    """Each part's verdict; `model`: modelled_steps of the table."""
    best = fastest(table)
    compiled = [s for paths in table.values() for path, s in paths.items() if path.endswith("/compile")]
    check.verdict("compile", bool(compiled) and all(compiled), f"{sum(map(bool, compiled))} of "
                  f"{len(compiled)} --compile runs timed")
    eager = [s for path, s in table["mhc"].items() if s and path.endswith("/eager")]
    measured = max((s["mem_peak_gb"] for s in eager), default=None)
    plan = f"the planned {planned:.1f} GB allocated" if planned else "no plan read (estimate.log)"
    check.verdict("memory plan", planned is not None and measured is not None and measured <= planned,
                  f"mHC measured peak {measured or 0:.1f} GB against {plan}")
    base = best.get("baseline", {})
    low, high = model.get("baseline", {}).get(base.get("path", "").split("/")[0], (None, None))
    check.verdict("step model", bool(low) and low / 2 <= base["step_s"] <= 2 * high,
                  f"baseline {base.get('step_s', 0):.3f} s/step against the planner's {low:.3f}-{high:.3f} s; PASS "
                  f"within half and twice of it; {inside_count(table, model)} eager timings inside their modelled range"
                  if low else f"no model for {gpu}: its bf16 peak or bandwidth is not in hcstudy/planner")
    mfu = base.get("mfu")
    check.verdict("MFU", mfu is not None, f"baseline {mfu:.1%}" if mfu is not None
                  else "unknown: the trainer has no bf16 peak for this card (GPU_PEAK_BF16_FLOPS)")
    for method, s in best.items():
        low, high = model.get(method, {}).get(s["path"].split("/")[0], (0, 0))
        print(f"      {method:<9} {s['step_s']:.3f} s/step ({s['path']}; modelled {low:.3f}-{high:.3f}), "
              f"{s['tokens_per_s']:,.0f} tok/s, MFU {s['mfu'] or 0:.1%}, peak {s['mem_peak_gb']:.1f} GB", flush=True)


def fsdp(check, runs):
    """A torchrun run with --parallel fsdp that checkpoints at step 3, then its resume to step 6."""
    flags = [*SIZE, "--width", "1024", "--ckpt-every", "3", "--residual", "mhc", "--parallel", "fsdp",
             "--out", str(runs), "--run-name", "fsdp"]           # a later flag wins over SIZE's
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", "train_c4.py"]
    first = check.run("fsdp", [*torchrun, *flags, "--steps", "3"], 120)
    second = check.run("fsdp_resume", [*torchrun, *flags, "--steps", "6", "--resume", "auto",
                                       "--allow-changed-settings"], 120)
    try:
        status = json.loads((runs / "fsdp" / STATUS_FILE).read_text())
    except (OSError, ValueError):
        status = {}
    check.verdict("FSDP", first == 0 and second == 0 and status.get("step") == 6,
                  f"exits {first}, {second}; resumed run at step {status.get('step')} of 6 (fsdp.log, fsdp_resume.log)")


def write_result(out, device, parts, table, model):
    """{out}/gpu_check/result.json (contract.check_result): per method, its fastest path's step seconds with what the
    planner needs to scale them (`methods`, docs/planning.md); every path's figures under `timings`, the planner's
    range beside them under `modelled`."""
    result = check_result(device, SIZE, TOKENS_PER_STEP, parts, table, fastest(table), model)
    check_path(out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(check_path(out), result)          # a reader never sees half a file


def main(argv=None):
    try:
        args = parse_args(argv)
    except ConfigError as error:
        print(f"{PROG}: error: {error}", file=sys.stderr)
        return 2
    import torch
    if not torch.cuda.is_available():
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
    print(f"{PROG}: {torch.cuda.get_device_name()}, torch {torch.__version__}; logs and run folders in {folder}",
          flush=True)
    environment(check)
    fsdp(check, runs)                    # before the timings, which take whatever time is left
    planned = planned_allocated_gb(check)
    gpu, card_gib = torch.cuda.get_device_name(), torch.cuda.get_device_properties(0).total_memory / 2 ** 30
    table = timings(check, runs, gpu, card_gib)
    model = modelled_steps(table, gpu, card_gib)
    judge(check, table, planned, model, gpu)
    device = {"gpu": gpu, "torch": torch.__version__, "cuda": torch.version.cuda}
    write_result(args.out, device, check.parts, table, model)
    failed = [part for part, verdict in check.parts.items() if verdict == "FAIL"]
    print(f"{PROG}: {len(check.parts) - len(failed)} of {len(check.parts)} parts passed"
          + (f"; failed: {', '.join(failed)} (their logs in {folder})" if failed else "")
          + f"; {folder / 'result.json'} written in {time.monotonic() - check.started:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

"""A stand-in for train_c4.py that keeps the trainer's contract with the launcher (hcstudy/contract.py's exit codes, the
run folder of docs/reliability.md), for fast launcher tests.

It parses the flags the launcher passes, writes config.json / status.json atomically and appends
metrics.jsonl like the real trainer, "trains" by sleeping a little per step, saves a step counter as
its checkpoint (so a resumed run continues), and exits with the trainer's codes:
0 done, 2 bad arguments (argparse), 3 diverged, 4 out of memory, 5 device error, 75 interrupted.

Knobs (environment):
  TRAIN_C4_FAIL_DEVICES   comma list of device ids: exit 5 at start-up when one is in CUDA_VISIBLE_DEVICES
  FAKE_OOM_ABOVE_MICRO    exit 4 when --micro-batch-size is above this
  FAKE_DIVERGE            comma list of run names that diverge (exit 3) at step FAKE_DIVERGE_STEP (default 2)
  FAKE_EXIT               run=code,...: that run always exits with that code at start-up
  FAKE_EXIT_ONCE          run=code,...: that run exits with that code on its first start only
  FAKE_STEPS              default --steps (5)
  FAKE_STEP_SLEEP         seconds per step (0.02)
  FAKE_DEFAULT_MICRO      default --micro-batch-size (8); FAKE_DEFAULT_BATCH default --batch-size (32)
  FAKE_NO_CONFIG          when set, config.json is not written (tests the launcher's fallback)
  FAKE_STEP_SECONDS       --plan-jobs: the planned seconds per step (default: no time estimate)
`--plan-jobs` answers the launcher's check before its first launch as train_c4.py does (JSON in, JSON out):
each job's flags parsed by this parser (bad ones: the error), its micro-batch and batch, its time.
Test-only files in the run folder: fake.pid (the live process), invocations.jsonl (one line per start
that ended by itself: argv, CUDA_VISIBLE_DEVICES, start and end step, micro-batch, exit code).
"""

import argparse
import json
import os
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository
from hcstudy.contract import EXIT_DEVICE, EXIT_DIVERGED, EXIT_INTERRUPTED, EXIT_OK, EXIT_OOM  # noqa: E402


def write_json(path, obj):
    """Write atomically: a reader never sees a half-written file."""
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)


def parse_pairs(text):
    """'a=1,b=2' -> {'a': 1, 'b': 2}"""
    pairs = {}
    for item in filter(None, (text or "").split(",")):
        name, _, code = item.partition("=")
        pairs[name] = int(code)
    return pairs


class OneLineErrorParser(argparse.ArgumentParser):
    def error(self, message):
        raise ValueError(message)


def build_parser(env):
    p = OneLineErrorParser(description="fake train_c4.py for launcher tests")
    p.add_argument("--residual", choices=["baseline", "hc", "mhc", "mhc-lite", "identity-hc"], default="mhc")
    p.add_argument("--sinkhorn-iters", type=int, default=20)
    p.add_argument("--coefficients", choices=["token", "sequence"])
    p.add_argument("--depth", type=int, default=32)
    p.add_argument("--seed", type=int, default=42)
    p.add_argument("--run-name")
    p.add_argument("--out", default="runs")
    p.add_argument("--steps", type=int, default=int(env.get("FAKE_STEPS", "5")))
    p.add_argument("--micro-batch-size", type=int, default=int(env.get("FAKE_DEFAULT_MICRO", "8")))
    p.add_argument("--batch-size", type=int, default=int(env.get("FAKE_DEFAULT_BATCH", "32")))
    p.add_argument("--preset", choices=["tiny", "demo", "part1", "c4", "stress", "seed-study"], default="c4")
    p.add_argument("--resume", choices=["auto", "never"], default="auto")
    p.add_argument("--parallel", choices=["ddp", "fsdp"])
    p.add_argument("--data", default="c4")
    p.add_argument("--wandb", default="disabled")
    for flag in ("--data-seed", "--eval-every", "--metrics-every", "--ckpt-every"):
        p.add_argument(flag, type=int)
    return p


def plan_jobs(request, env):
    """train_c4.py --plan-jobs's answer, from this parser and the FAKE_ knobs."""
    answers, step_seconds = [], env.get("FAKE_STEP_SECONDS")
    for job in request["jobs"]:
        try:
            args = build_parser(env).parse_args(job["flags"])
        except ValueError as error:
            answers.append({"error": f"{error} (see --help)"})
            continue
        seconds = float(step_seconds) * (args.steps - job["done_steps"]) if step_seconds else None
        answers.append({"micro": args.micro_batch_size, "batch": args.batch_size, "memory": None,
                        "seconds": [seconds, 2 * seconds] if seconds else None, "basis": "fake"})
    return {"gpu": request["gpu"] or "FAKE GPU", "assumptions": ["Step times: fake"],
            "jobs": answers}


def main():
    env = os.environ
    if sys.argv[1:] == ["--plan-jobs"]:
        print(json.dumps(plan_jobs(json.load(sys.stdin), env)))
        sys.exit(EXIT_OK)
    try:
        args = build_parser(env).parse_args()
    except ValueError as error:         # bad arguments: one line and exit 2, as the real trainer does
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)

    run = args.run_name or f"{args.residual}_d{args.depth}_s{args.seed}"
    run_dir = os.path.join(args.out, run)
    os.makedirs(run_dir, exist_ok=True)
    ckpt = os.path.join(run_dir, "checkpoint.json")
    status_path = os.path.join(run_dir, "status.json")

    stop = {"signal": None}

    def on_signal(signum, frame):
        stop["signal"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    with open(os.path.join(run_dir, "fake.pid"), "w") as f:
        f.write(str(os.getpid()))
    step = 0
    if args.resume == "auto" and os.path.exists(ckpt):
        with open(ckpt) as f:
            step = json.load(f)["step"]
    record = {"argv": sys.argv[1:], "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
              "start_step": step, "micro_batch_size": args.micro_batch_size,
              "batch_size": args.batch_size, "pid": os.getpid(), "start": time.time()}

    def finish(state, code, reason=""):
        write_json(status_path, {"state": state, "step": step, "exit_code": code, "reason": reason,
                                 "updated": time.time()})
        record.update(exit_code=code, end=time.time(), end_step=step)
        with open(os.path.join(run_dir, "invocations.jsonl"), "a") as f:
            f.write(json.dumps(record) + "\n")
        if reason:
            print(reason, file=sys.stderr, flush=True)
        sys.exit(code)

    if not env.get("FAKE_NO_CONFIG"):
        write_json(os.path.join(run_dir, "config.json"),
                   {"config": {"residual": args.residual, "depth": args.depth, "seed": args.seed,
                               "micro_batch_size": args.micro_batch_size, "batch_size": args.batch_size,
                               "steps": args.steps, "run_name": run, "preset": args.preset,
                               "sinkhorn_iters": args.sinkhorn_iters, "coefficients": args.coefficients}})
    write_json(status_path, {"state": "running", "step": step, "exit_code": None, "reason": "",
                             "updated": time.time()})
    print(f"fake trainer: {run} from step {step}, micro {args.micro_batch_size}, "
          f"batch {args.batch_size}, CUDA_VISIBLE_DEVICES={env.get('CUDA_VISIBLE_DEVICES')!r}", flush=True)

    visible = set(filter(None, env.get("CUDA_VISIBLE_DEVICES", "").split(",")))
    failing = set(filter(None, env.get("TRAIN_C4_FAIL_DEVICES", "").split(",")))
    if visible & failing:
        finish("failed", EXIT_DEVICE, f"device error: CUDA error on device {sorted(visible & failing)[0]}")
    if run in parse_pairs(env.get("FAKE_EXIT")):
        code = parse_pairs(env["FAKE_EXIT"])[run]
        finish("failed", code, f"fake failure with exit code {code}")
    once = parse_pairs(env.get("FAKE_EXIT_ONCE"))
    marker = os.path.join(run_dir, "fake_exit_once.done")
    if run in once and not os.path.exists(marker):
        open(marker, "w").close()
        finish("failed", once[run], f"fake one-off failure with exit code {once[run]}")
    oom_above = env.get("FAKE_OOM_ABOVE_MICRO")
    if oom_above and args.micro_batch_size > int(oom_above):
        finish("failed", EXIT_OOM, f"out of memory: micro-batch {args.micro_batch_size} does not fit")

    diverge = set(filter(None, env.get("FAKE_DIVERGE", "").split(",")))
    diverge_step = int(env.get("FAKE_DIVERGE_STEP", "2"))
    step_sleep = float(env.get("FAKE_STEP_SLEEP", "0.02"))
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as metrics:
        while step < args.steps:
            if stop["signal"] is not None:
                finish("interrupted", EXIT_INTERRUPTED, f"interrupted by signal {stop['signal']} at step {step}")
            time.sleep(step_sleep)
            step += 1
            loss = float("nan") if run in diverge and step >= diverge_step else 10.0 / step
            metrics.write(json.dumps({"step": step, "time": time.time(), "loss": loss}) + "\n")
            metrics.flush()
            if loss != loss:
                finish("diverged", EXIT_DIVERGED, f"diverged: non-finite loss at step {step}")
            write_json(ckpt, {"step": step})
            write_json(status_path, {"state": "running", "step": step, "exit_code": None, "reason": "",
                                     "updated": time.time()})
    finish("completed", EXIT_OK)


if __name__ == "__main__":
    main()

"""Crafted files and command lines against the trainer, the launcher and report.py: counts tracebacks and
silent nonsense (an exit 0 whose result is wrong, a status.json left untrue). Not part of the test run.

    python benchmarks/fuzz_inputs.py [--trainer 300] [--launcher 60] [--report 60] [--seed 0]

Trainer: each invocation resumes (or consolidates) a copy of a finished tiny run (checkpoints step-3 and
step-6) after one to three random damages (crafted markers, train_state, model, optimizer and data states
with their checksums fixed up, config.json, metrics lines, status.json, symlinked or misnamed folders, a run
folder entry that is a link to a file outside it, checkpoints deleted or emptied, a .lock that is a folder), with
now and then a flag the arm does not have. It runs in a process forked from this one (torch is imported once).
Launcher: run_experiments.sh --dry-run / --summary with random flags over a folder of crafted run folders.
report.py: random crafted metrics.jsonl, status.json and config.json. Results go to docs/reliability.md.
"""
import argparse
import collections
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", WANDB_MODE="disabled", OMP_NUM_THREADS="1")

import torch  # noqa: E402

from hcstudy import run_folder  # noqa: E402
import train_c4 as T  # noqa: E402
from hcstudy.distributed import Dist

RUN = "mhc_d2_s42"
VICTIM = "victim.txt"           # beside the trainer's --out: no invocation may change it
BASE_ARGS = ["--preset", "tiny", "--steps", "6", "--ckpt-every", "3", "--eval-every", "3"]
DEEP = "[" * 60_000 + "]" * 60_000
JSON_VALUES = [None, [], {}, "abc", -1, 0, 1e400, 2.5, 10 ** 30, True, DEEP, {"config": None}, {"files": []},
               {"step": "6"}, {"files": {"../../x": "0"}}]
PAYLOADS = [{}, [], "abc", None, torch.zeros(3), {"step": "abc", "tokens": 0}, {"step": 6}, {"step": 6, "tokens": -1},
            {"step": 3, "tokens": 0}, {"state": {}, "param_groups": []}, {"data": {}}, {"data": {"streams": {}}},
            {"wte.weight": torch.zeros(2, 2)}]


def reseal(folder, name, payload):
    """Replace (or remove) a checkpoint file and fix the marker's checksum, as a crafted file would."""
    marker = json.loads((folder / run_folder.MARKER).read_text())
    if payload is None:
        (folder / name).unlink(missing_ok=True)
        marker["files"].pop(name, None)
    else:
        torch.save(payload, folder / name)
        marker["files"][name] = run_folder.sha256(folder / name)
    (folder / run_folder.MARKER).write_text(json.dumps(marker))


def damage(run_dir, rng):
    """One random damage to a run folder; returns its description."""
    checkpoints = sorted((run_dir / "checkpoints").glob("step-*"))
    folder = rng.choice(checkpoints) if checkpoints else None
    kind = rng.choice(["marker", "payload", "payload", "config", "metrics", "status", "symlink", "misnamed",
                       "lock", "truncate", "link", "history", "lock folder"])
    if folder is None or kind == "config":
        value = rng.choice(JSON_VALUES)
        (run_dir / "config.json").write_text(DEEP if value is DEEP else json.dumps(value))
        return "config.json"
    if kind == "marker":
        value = rng.choice(JSON_VALUES)
        (folder / run_folder.MARKER).write_text(DEEP if value is DEEP else json.dumps(value))
    elif kind == "payload":
        reseal(folder, rng.choice(["train_state.pt", "model.pt", "optimizer.pt", "rank0.pt"]), rng.choice(PAYLOADS))
    elif kind == "metrics":
        with open(run_dir / "metrics.jsonl", "a") as f:
            f.write(rng.choice(["[]", DEEP, '{"step": 1e400}', '{"step": "x"}', "{", '{"step": 2.5}']) + "\n")
    elif kind == "status":
        value = rng.choice(JSON_VALUES)
        (run_dir / "status.json").write_text(DEEP if value is DEEP else json.dumps(value))
    elif kind == "symlink":
        (run_dir / "checkpoints" / f"step-{rng.choice([9, 30])}").symlink_to(folder)
    elif kind == "misnamed":
        shutil.copytree(folder, run_dir / "checkpoints" / f"step-{rng.choice([4, 12])}", symlinks=True)
    elif kind == "lock":
        (run_dir / ".lock").write_text(rng.choice(["", "process 1 on nowhere\n", "\x00" * 100]))
    elif kind == "link":        # the trainer must refuse it: VICTIM, outside --out, stays as it is
        entry = run_dir / rng.choice([".status-reserve", ".lock", "train.log", "metrics.jsonl", "status.json"])
        entry.unlink(missing_ok=True)
        entry.symlink_to(run_dir.parent.parent / VICTIM)
    elif kind == "history":
        shutil.rmtree(run_dir / "checkpoints")
        if rng.random() < 0.5:
            (run_dir / "checkpoints").mkdir()
    elif kind == "lock folder":
        (run_dir / ".lock").unlink(missing_ok=True)
        (run_dir / ".lock").mkdir()
    else:
        victim = folder / rng.choice(["model.pt", "optimizer.pt", run_folder.MARKER])
        victim.write_bytes(victim.read_bytes()[: rng.randrange(0, 200)])
    return f"{kind} {folder.name}"


def damage_or_skip(run_dir, rng):
    """damage(), or 'skipped' where an earlier damage left nothing to apply it to (a marker already garbage)."""
    try:
        return damage(run_dir, rng)
    except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
        return "skipped"


def forked(argv, out_dir):
    """train_c4.main(argv) in a forked process: (exit code, stdout, stderr); an escaped exception is a traceback."""
    stdout, stderr = out_dir / "stdout", out_dir / "stderr"
    pid = os.fork()
    if pid == 0:
        with open(stdout, "w") as o, open(stderr, "w") as e:
            os.dup2(o.fileno(), 1)
            os.dup2(e.fileno(), 2)
            try:
                code = T.main(argv)
            except BaseException:
                import traceback
                traceback.print_exc()
                code = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), stdout.read_text(), stderr.read_text()


def nonsense_after_training(run_dir, code):
    """What is wrong with a run folder after the trainer ended with `code`; '' when nothing."""
    try:
        status = json.loads((run_dir / "status.json").read_text())
    except (OSError, ValueError, RecursionError):
        status = None
    if code != 0:
        return "status.json says running after the trainer ended" if isinstance(status, dict) and \
            status.get("state") == "running" else ""
    if not isinstance(status, dict) or status.get("state") != "completed" or status.get("step") != 6:
        return f"exit 0 but status.json is {str(status)[:80]}"
    steps = [json.loads(line).get("step") for line in (run_dir / "metrics.jsonl").read_text().splitlines()
             if line.strip()]
    if steps != list(range(7)):
        return f"exit 0 but metrics.jsonl steps are {steps[:12]}"
    found = run_folder.read_checkpoint(run_dir, Dist(0, 1, torch.device("cpu")), lambda line: None)
    if found is None or found[0].name != "step-6" or found[1]["train_state.pt"]["step"] != 6:
        return "exit 0 but the newest checkpoint that loads is not step 6"
    return ""


def nonsense_after_consolidate(run_dir, weights, code):
    if code != 0:
        return "an output file was written by a refused --consolidate" if weights.exists() else ""
    state = torch.load(weights, weights_only=True)
    folder = run_folder.read_checkpoint(run_dir, Dist(0, 1, torch.device("cpu")), lambda line: None)
    if folder is None:
        return "exit 0 although no checkpoint of the run verifies"
    saved = folder[1]["model.pt"]
    same = all(torch.equal(saved[key].reshape(state[key].shape), state[key]) for key in saved)
    return "" if same else "the exported weights differ from the newest checkpoint that loads"


def fuzz_trainer(count, rng, work, tally, examples):
    base = work / "base"
    code, _, stderr = forked([*BASE_ARGS, "--out", str(base)], work)
    assert code == 0, stderr
    (work / VICTIM).write_text("not the trainer's\n")
    for i in range(count):
        out = work / f"t{i}"
        shutil.copytree(base, out, symlinks=True)
        run_dir = out / RUN
        what = [damage_or_skip(run_dir, rng) for _ in range(rng.choice([1, 1, 2, 3]))]
        if i % 5 == 4:
            weights = out / "w.pt"
            code, _, stderr = forked(["--consolidate", str(run_dir), str(weights)], out)
            problem = nonsense_after_consolidate(run_dir, weights, code)
        else:
            extra = rng.choice([[], [], ["--allow-changed-settings"], ["--no-mixing-decay", "--allow-changed-settings"],
                                ["--hc-scale-init", "0.1"], ["--mhc-gate-init", "-1e6"], ["--resume", "never"]])
            code, _, stderr = forked([*BASE_ARGS, "--out", str(out), *extra], out)
            problem = nonsense_after_training(run_dir, code)
        if (work / VICTIM).read_text() != "not the trainer's\n":
            problem = f"{VICTIM}, outside --out, was written"
            (work / VICTIM).write_text("not the trainer's\n")
        record(tally, examples, "trainer", code, stderr, problem, what)
        shutil.rmtree(out)


def record(tally, examples, who, code, stderr, problem, what):
    errors = [line for line in stderr.strip().splitlines() if not line.startswith(("warning", "report: warning"))]
    tally[who, "invocations"] += 1
    tally[who, f"exit {code}"] += 1
    outcome = ("traceback" if "Traceback" in stderr else "silent nonsense" if problem else
               "more than one error line" if code not in (0, 75) and len(errors) > 1 and who == "trainer" else "")
    if outcome:
        tally[who, outcome] += 1
        examples.append(f"{who} {outcome}: {what}: exit {code}: {problem or stderr.strip()[-300:]}")


def crafted_runs(root, rng, count):
    """Run folders with crafted metrics, status and config files, for report.py and the launcher's --summary."""
    for i in range(count):
        run_dir = root / rng.choice([f"hc_d2_s{i}", f"mhc_d2_s{i}", f"baseline_d2_s{i}", f"x{i}"])
        run_dir.mkdir(parents=True, exist_ok=True)
        lines = [json.dumps({"step": s, "loss": rng.choice([1.0, float("nan"), "x", None, 1e308]),
                             "amax_fwd": rng.choice([1.0, 50.0, float("inf"), [1, 2]])})
                 for s in range(rng.randrange(5))]
        lines += rng.sample(["[]", DEEP, '{"step": 1e400}', '{"step": -1}', "{", '{"step": 2.5}', "\x00",
                             '{"step": 9223372036854775808}', '{"step": "3"}'], 2)
        (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        for name in ("status.json", "config.json"):
            value = rng.choice(JSON_VALUES + [{"state": "completed", "step": 1e400}, {"config": {"depth": "x"}},
                                              {"state": ["x"], "step": 1}, {"config": {"residual": "nope", "depth": 2}}])
            (run_dir / name).write_text(DEEP if value is DEEP else json.dumps(value))
        if rng.random() < 0.1:      # must be skipped, never read: a read would block
            victim = run_dir / rng.choice(["metrics.jsonl", "status.json", "config.json"])
            victim.unlink()
            os.mkfifo(victim)


def fuzz_report(count, rng, work, tally, examples):
    for i in range(count):
        root = work / f"r{i}"
        crafted_runs(root, rng, rng.randrange(1, 4))
        result = subprocess.run([sys.executable, str(ROOT / "report.py"), str(root), "--no-plots"], capture_output=True,
                                text=True, timeout=300)
        problem = "" if result.returncode != 0 or (root / "report" / "results.md").exists() else "exit 0, no results.md"
        record(tally, examples, "report.py", result.returncode, result.stderr, problem, "crafted run folders")
        shutil.rmtree(root)


LAUNCHER_FLAGS = [["--dry-run"], ["--summary"], ["--methods", "hc,mhc"], ["--methods", ""], ["--depths", "2,x"],
                  ["--seeds", "1e400"], ["--gpus", "0,1"], ["--gpus", "x"], ["--max-retries", "-1"], ["--quick"],
                  ["--", "--lr", "nan"], ["--", "--steps", "3"], ["--stagger", "1e400"], ["--gpus-per-run", "3"],
                  ["--gpus", "99"], ["--", "--parallel", "fsdp"], ["--gpu-type", "NVIDIA Nope"]]


def fuzz_launcher(count, rng, work, tally, examples):
    env = {**os.environ, "RUN_EXPERIMENTS_NVIDIA_SMI": "false", "RUN_EXPERIMENTS_TRAINER":
           f"{sys.executable} {ROOT / 'tests' / 'support' / 'fake_trainer.py'}"}
    for i in range(count):
        out = work / f"l{i}"
        out.mkdir()
        crafted_runs(out, rng, rng.randrange(0, 3))
        if rng.random() < 0.5:
            (out / "matrix.log").write_text(rng.choice(["", "garbage\n", "2026-01-01T00:00:00.0+0000 QUEUE slots=x\n"]))
        flags = [flag for group in rng.sample(LAUNCHER_FLAGS, rng.randrange(1, 4)) for flag in group]
        flags = (["--dry-run"] if "--summary" not in flags else []) + [f for f in flags if f != "--dry-run"]
        command = ["bash", str(ROOT / "run_experiments.sh"), "--out", str(out), *flags]
        result = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
        record(tally, examples, "launcher", result.returncode, result.stderr, "", " ".join(flags))
        shutil.rmtree(out)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trainer", type=int, default=300)
    parser.add_argument("--launcher", type=int, default=60)
    parser.add_argument("--report", type=int, default=60)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng, tally, examples = random.Random(args.seed), collections.Counter(), []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        fuzz_trainer(args.trainer, rng, work, tally, examples)
        fuzz_launcher(args.launcher, rng, work, tally, examples)
        fuzz_report(args.report, rng, work, tally, examples)
    for (who, what), count in sorted(tally.items()):
        print(f"{who:10s} {what:28s} {count}")
    for example in examples[:30]:
        print(example)
    return 1 if examples else 0


if __name__ == "__main__":
    sys.exit(main())

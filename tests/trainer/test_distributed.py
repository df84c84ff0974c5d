"""torchrun with 2 CPU processes (gloo) against one process: the same losses and weights, an exact
resume under DDP and FSDP, an FSDP checkpoint of 4 processes resumed on 2 and on 3, and a failure on one rank
that ends the whole job instead of hanging it.

Every torchrun start costs seconds (three interpreters import torch), so each test shares its runs."""
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hcstudy import consolidate
from hcstudy import run_folder
from hcstudy.config import parse_config
from hcstudy.distributed import Dist
from hcstudy.model import GPT

ROOT = Path(__file__).resolve().parents[2]
ARGS = ["--preset", "tiny", "--residual", "hc", "--steps", "20"]
RUN = "hc_d2_s42"
# fp32 on the CPU. The only difference from one process is the order of the gradient sums (two local
# backward passes added by gloo instead of one backward over the whole batch): a few ulps, measured
# 2e-7 relative at most over 20 steps. A real fault is far above 1e-5: a wrong or repeated batch, a
# gradient not averaged or a rank-local gradient norm moves the loss or the norm by 1e-3 or more.
LOSS_RTOL = 1e-5
# The weights carry those ulps through AdamW: measured after 20 steps, at most 2.3e-7 on HC's dynamic
# weights (which start at 0) and 2.2e-6 on mHC's b_res (about 4, so 4 ulps). Any real fault moves a
# weight by a good part of an update (lr 3e-3): 1e-5 absolute + 1e-5 relative is 40x above the noise
# and 100x below that.
PARAM_RTOL = PARAM_ATOL = 1e-5
# values that must be identical between an interrupted-and-resumed run and an uninterrupted one
DETERMINISTIC_KEYS = ("step", "loss", "grad_norm", "lr", "tokens", "val_loss", "amax_fwd", "amax_bwd",
                      "layer_gain_fwd")


def offline_env(tmp: Path, **extra) -> dict:
    # module-scoped runs start before conftest's per-test environment: set it here
    return {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "HF_HOME": str(tmp / "hf_home"), "WANDB_MODE": "disabled", "TRAIN_C4_INJECT_NAN": "", **extra}


def start(out: Path, *command: str, env: dict | None = None) -> subprocess.Popen:
    out.mkdir(parents=True, exist_ok=True)
    return subprocess.Popen(list(command), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env=offline_env(out, **(env or {})), cwd=out)


def trainer(out: Path, *args: str, env: dict | None = None, wait: bool = True):
    return finish(start(out, sys.executable, str(ROOT / "train_c4.py"), *ARGS, "--out", str(out), *args, env=env),
                  wait)


def torchrun(out: Path, parallel: str, *args: str, env: dict | None = None, wait: bool = True,
             processes: int = 2):
    # a fault is injected by tests/support/fault_trainer.py (train_c4.py with the fault patched in), never by train_c4.py
    script = "tests/support/fault_trainer.py" if "TRAIN_C4_INJECT_NAN" in (env or {}) else "train_c4.py"
    return finish(start(out, sys.executable, "-m", "torch.distributed.run", "--standalone",
                        f"--nproc_per_node={processes}", str(ROOT / script), *ARGS, "--parallel", parallel,
                        "--out", str(out), *args, env=env), wait)


def finish(process: subprocess.Popen, wait: bool):
    if not wait:
        return process
    stdout, stderr = process.communicate(timeout=300)
    return process.returncode, stdout, stderr


def metrics(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def deterministic(records: list[dict]) -> list[dict]:
    return [{k: r[k] for k in DETERMINISTIC_KEYS if k in r} for r in records]


def max_relative(records: list[dict], reference: list[dict], key: str) -> float:
    pairs = [(r[key], s[key]) for r, s in zip(records, reference, strict=True) if key in r]
    assert pairs and len(pairs) == sum(key in s for s in reference)
    return max(abs(a - b) / abs(b) for a, b in pairs)


def weights(run_dir: Path, out: Path, command_line: bool = False) -> dict:
    """The run's final weights through the converter: one file, loaded without a process group."""
    if command_line:
        code, _, stderr = finish(start(out.parent, sys.executable, str(ROOT / "train_c4.py"), "--consolidate",
                                       str(run_dir / "checkpoints" / "step-20"), str(out)), wait=True)
        assert code == 0, stderr
    else:                                                            # the same function, without a start-up
        consolidate.consolidate(run_dir / "checkpoints" / "step-20", out)
    state = torch.load(out, weights_only=True)
    GPT(parse_config(ARGS)).load_state_dict(state)              # strict: every key and shape
    return state


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    out = tmp_path_factory.mktemp("single")
    code, _, stderr = trainer(out)
    assert code == 0, stderr
    return out / RUN


@pytest.mark.slow
@pytest.mark.parametrize("parallel", ["ddp", "fsdp"])
def test_two_processes_match_one_process_and_resume_exactly(parallel, single, tmp_path):
    code, stdout, stderr = torchrun(tmp_path / "whole", parallel)
    assert code == 0, stderr
    whole = tmp_path / "whole" / RUN
    assert "micro-batch 2 x 1 accumulation steps x 2 process(es)" in stdout
    reference = metrics(single)
    for key in ("loss", "grad_norm", "val_loss"):                    # global values, logged once by rank 0
        assert max_relative(metrics(whole), reference, key) < LOSS_RTOL, key
    marker = json.loads((whole / "checkpoints" / "step-20" / "COMPLETE.json").read_text())
    sharded = [name for name in marker["files"] if name.startswith(f"{run_folder.SHARDED}/")]
    assert bool(sharded) == (parallel == "fsdp") and {"rank0.pt", "rank1.pt"} <= marker["files"].keys()
    if parallel == "fsdp":                                           # the marker's checksums cover DCP's files
        assert f"{run_folder.SHARDED}/.metadata" in sharded and len(sharded) >= 3
        whole_weights = weights(whole, tmp_path / "whole.pt", command_line=True)
        single_weights = weights(single, tmp_path / "single.pt")
        for name, value in single_weights.items():
            torch.testing.assert_close(whole_weights[name], value, rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=name)

    # stopped by SIGTERM to torchrun (which forwards it): every rank saves its part and exits 75; a rerun
    # of the same command continues with exactly the values of the uninterrupted run (under FSDP with each
    # rank's data read by a loader process instead of a thread: the same batches)
    loader = ["--data-workers", "1"] if parallel == "fsdp" else []
    process = torchrun(tmp_path / "resumed", parallel, *loader, wait=False)
    resumed = tmp_path / "resumed" / RUN
    while process.poll() is None and (not (resumed / "metrics.jsonl").exists()
                                      or len((resumed / "metrics.jsonl").read_text().splitlines()) < 2):
        time.sleep(0.02)
    process.send_signal(signal.SIGTERM)
    _, stderr = process.communicate(timeout=120)
    status = json.loads((resumed / "status.json").read_text())
    assert status["state"] == "interrupted" and status["exit_code"] == 75, stderr
    assert status["step"] < 20, "the run finished before it could be stopped"
    assert "\nrank 0: stopped by a signal" in stderr and "\nrank 1: stopped by a signal" in stderr, stderr[-4000:]
    assert "error:" not in stderr
    code, stdout, stderr = torchrun(tmp_path / "resumed", parallel, *loader)
    assert code == 0, stderr
    assert f"resumed from {resumed / 'checkpoints' / ('step-' + str(status['step']))}" in stdout
    assert deterministic(metrics(resumed)) == deterministic(metrics(whole))
    if parallel == "fsdp":                                            # optimizer shards restored exactly too
        resumed_weights = weights(resumed, tmp_path / "resumed.pt")
        assert all(torch.equal(resumed_weights[k], v) for k, v in whole_weights.items())
        # a damaged shard is caught by the marker's checksums: the previous checkpoint is used
        shard = next(name for name in sharded if name.endswith(".distcp"))
        path = whole / "checkpoints" / "step-20" / shard
        path.write_bytes(path.read_bytes()[:-1] + bytes([path.read_bytes()[-1] ^ 0xFF]))
        problems = []
        folder, _, marker = run_folder.read_checkpoint(whole, Dist(0, 1, torch.device("cpu")), problems.append)
        assert folder.name == "step-10" and marker["format"] == "sharded"
        assert problems == [f"checkpoint step-20 has a corrupted {shard} (checksum mismatch); falling back to the "
                            "previous one"]


# a global batch of 12 over 4 data streams: 4 and 2 processes own whole streams, 3 share them; a checkpoint at step 4
RESHARD_ARGS = ["--steps", "8", "--batch-size", "12", "--micro-batch-size", "1", "--data-streams", "4",
                "--ckpt-every", "4", "--eval-every", "4"]


@pytest.mark.slow
def test_fsdp_checkpoint_of_four_processes_resumes_on_two_and_on_three(tmp_path):
    """The 4-process run's checkpoint at step 4 resumes on 2 and on 3 processes: DCP reshards the weights and the
    AdamW moments, every data stream continues where it stopped (on 3, read by loader processes), and steps 5-8
    give the 4-process values. The run folder is copied with its step-8 checkpoint removed: what a stop right
    after step 4's checkpoint leaves (its metrics past step 4 are dropped on resume). Tolerances as above: only
    the order of the gradient sums differs (measured 1.8e-7 relative on the loss, 2e-8 absolute on the weights);
    without the optimizer state the loss moves by 1.3e-3, with the data restarted from the beginning by 9e-3."""
    code, _, stderr = torchrun(tmp_path / "whole", "fsdp", *RESHARD_ARGS, processes=4)
    assert code == 0, stderr
    whole = tmp_path / "whole" / RUN
    reference = metrics(whole)
    consolidate.consolidate(whole, tmp_path / "whole.pt")
    whole_weights = torch.load(tmp_path / "whole.pt", weights_only=True)
    for processes, loader in ((2, []), (3, ["--data-workers", "1"])):
        resumed = tmp_path / f"on{processes}" / RUN
        shutil.copytree(whole, resumed)
        shutil.rmtree(resumed / "checkpoints" / "step-8")
        code, stdout, stderr = torchrun(resumed.parent, "fsdp", *RESHARD_ARGS, *loader, processes=processes)
        assert code == 0, stderr
        assert f"resumed from {resumed / 'checkpoints' / 'step-4'}" in stdout
        assert f"written by 4 process(es), this run has {processes}" in stdout
        assert [r.get("tokens") for r in metrics(resumed)] == [r.get("tokens") for r in reference]
        for key in ("loss", "grad_norm", "val_loss"):
            assert max_relative(metrics(resumed), reference, key) < LOSS_RTOL, (processes, key)
        consolidate.consolidate(resumed, tmp_path / f"on{processes}.pt")
        for name, value in torch.load(tmp_path / f"on{processes}.pt", weights_only=True).items():
            torch.testing.assert_close(value, whole_weights[name], rtol=PARAM_RTOL, atol=PARAM_ATOL, msg=name)


def exit_codes(torchrun_stderr: str) -> list[str]:
    """The per-rank exit codes of torchrun's failure summary."""
    return re.findall(r"^\s*exitcode\s*:\s*(-?\d+)", torchrun_stderr, flags=re.MULTILINE)


@pytest.mark.slow
def test_non_finite_loss_on_one_rank_stops_every_rank_as_diverged(tmp_path):
    code, _, stderr = torchrun(tmp_path, "ddp", env={"TRAIN_C4_INJECT_NAN": "loss:4:1"})
    ended = time.time()
    assert code != 0
    assert exit_codes(stderr) == ["3", "3"], stderr                  # rank 0 saw it too: the loss is global
    assert "error: rank 0: non-finite loss at step 4" in stderr and "error: rank 1: non-finite loss" in stderr
    status = json.loads((tmp_path / RUN / "status.json").read_text())
    assert status["state"] == "diverged" and status["exit_code"] == 3 and status["step"] == 3
    assert ended - status["updated"] < 15, "a rank waited for the other instead of stopping"


@pytest.mark.slow
def test_a_failure_on_one_rank_ends_the_job_and_names_that_rank(tmp_path):
    code, _, stderr = torchrun(tmp_path, "fsdp", env={"TRAIN_C4_INJECT_NAN": "oom:3:1"})
    assert code != 0
    # rank 0 only lost its connection (exit 5 on its own); it takes rank 1's reason and exit code, so
    # the launcher halves the micro-batch instead of suspecting the GPUs
    assert exit_codes(stderr) == ["4", "4"], stderr
    assert "error: rank 1: out of memory at micro-batch 2" in stderr
    assert "error: rank 0: rank 1 failed: out of memory" in stderr
    status = json.loads((tmp_path / RUN / "status.json").read_text())
    assert status["state"] == "failed" and status["exit_code"] == 4 and status["reason"].startswith("rank 1 failed")


@pytest.mark.slow
def test_ddp_and_fsdp_share_one_precision_policy(tmp_path):
    """Under bf16, FSDP gathers the body's weights in bf16; the mixing parameters and the residual streams
    must stay fp32 as under DDP, so that the probe reads the same gains in both modes."""
    seen, probes = {}, {}
    for parallel in ("ddp", "fsdp"):
        done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                               str(ROOT / "tests" / "support" / "precision_probe.py"), "mhc", parallel], capture_output=True,
                              text=True, timeout=300, env={**offline_env(tmp_path), "PYTHONPATH": str(ROOT)})
        assert done.returncode == 0, done.stderr
        seen[parallel] = json.loads(done.stdout.strip().splitlines()[-1])
        code, _, stderr = torchrun(tmp_path / parallel, parallel, "--residual", "mhc", "--dtype", "bf16",
                                   "--steps", "6")
        assert code == 0, stderr
        # FSDP2 warns of each view a wrapped module returns (an in-place op on it would skip the all-gather)
        assert "returned a view tensor" not in stderr
        run_dir = tmp_path / parallel / "mhc_d2_s42"
        probes[parallel] = [r for r in metrics(run_dir) if "amax_bwd" in r]
        assert json.loads((run_dir / "config.json").read_text())["precision"]["mixing_parameters"] == "fp32"
    assert seen["ddp"]["connection"] == seen["fsdp"]["connection"] == {"input": "torch.float32",
                                                                       "parameters": ["torch.float32"]}
    assert seen["fsdp"]["attention"]["parameters"] == ["torch.bfloat16"]      # the body does run in bf16
    assert [r["step"] for r in probes["ddp"]] == [r["step"] for r in probes["fsdp"]] == [0, 5, 6]
    # the body's bf16 rounding differs between autocast (DDP) and bf16 weights (FSDP): measured 1e-6 on these
    # gains, 2% on the truncation error. With bf16 mixing parameters and streams under FSDP (the old policy):
    # 3e-5 on amax_bwd and a truncation error 5x smaller than DDP's
    for ddp, fsdp in zip(probes["ddp"], probes["fsdp"]):
        for key in ("amax_fwd", "amax_bwd", "amax_study", "amax_bwd_converged"):
            assert abs(ddp[key] - fsdp[key]) < 1e-5, (ddp["step"], key)
        assert ddp["sinkhorn_col_err"] == pytest.approx(fsdp["sinkhorn_col_err"], rel=0.1)


def test_torchrun_py_leaves_the_ranks_own_line_and_their_exit_code(tmp_path):
    """torchrun adds a ChildFailedError traceback and a failure table to every non-zero rank exit, and exits 1;
    and it leaves a torchelastic_* folder in TMPDIR, which torchrun.py does not."""
    tmpdir = tmp_path / "tmpdir"
    tmpdir.mkdir()
    env = {key: value for key, value in os.environ.items() if key != "PET_LOG_DIR"} | {"TMPDIR": str(tmpdir)}
    done = subprocess.run([sys.executable, str(ROOT / "torchrun.py"), "--standalone", "--nproc_per_node=2",
                           str(ROOT / "train_c4.py"), "--preset", "tiny", "--depth", "99999"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=300, env=env)
    assert list(tmpdir.iterdir()) == []
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and done.stdout == "", done.stderr
    # torchrun may end the other rank (SIGTERM) before it has said the same
    assert lines and set(lines) <= {f"error: rank {r}: --depth must be from 1 to 512, got 99999" for r in (0, 1)}
